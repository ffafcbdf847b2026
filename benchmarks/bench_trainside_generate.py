"""Benchmark: TransformersBackend (our KV-cache sampling loop) vs ``model.generate`` on CPU.

What it measures (issue 3): generated tokens per second of the trainside backend against Hugging Face
``model.generate`` on the same prompts, the same model and the same sampling (temperature 1, no
top-k/top-p, EOS ends a row), in the rollout shape of the CPU recipe: ``P`` chat-templated
single-digit-addition prompts x ``n`` samples, left-padded.

Paths (all after one untimed warm-up call, then one timed run, seeded):

* ``backend``: ``TransformersBackend.generate(prompts, n, SamplingParams(...))``; returns token ids
  *and* the log-prob of every sampled token.
* ``hf_generate``: ``model.generate(input_ids, attention_mask, do_sample=True, top_k=0,
  max_new_tokens=...)`` on the same left-padded rows (prompts repeated ``n`` times); token ids only.
* ``hf_generate_logprobs``: the same with ``output_scores=True, return_dict_in_generate=True`` and
  ``compute_transition_scores(..., normalize_logits=True)`` so it returns log-probs too.

Before timing, the script asserts that greedy decoding gives the same tokens on both paths.
Tokens counted: generated tokens up to and including EOS in each row (padding after EOS is not
counted). The table reports tokens/s and the ratio backend / path. Models: the tiny recipe model
(Qwen3 hidden 64, 2 layers, ~105k parameters) and a larger one (hidden 256, 4 layers) where the
forward cost dominates the Python loop.

Run:
    .venv/bin/python benchmarks/bench_trainside_generate.py            # ~1 min on 2 cores
    .venv/bin/python benchmarks/bench_trainside_generate.py --quick    # a few seconds

Prints a table and writes ``benchmarks/results/bench_trainside_generate.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

from ar_torchrl.assets import build_char_tokenizer, build_tiny_qwen3
from ar_torchrl.backends import SamplingParams, TransformersBackend
from ar_torchrl.data import arithmetic_dataset

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_trainside_generate.json"
MODELS = {
    "tiny_h64_l2": dict(hidden_size=64, num_layers=2),
    "h256_l4": dict(hidden_size=256, num_layers=4),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated subset of {list(MODELS)}"
    )
    p.add_argument("--quick", action="store_true", help="4 prompts x 2 samples, 16 new tokens")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.samples, args.max_new_tokens = 4, 2, 16
    args.models = args.models.split(",")
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        p.error(f"unknown --models {unknown}; choose from {list(MODELS)}")
    return args


def chat_prompts(tok, num_prompts: int) -> list[list[int]]:
    rows = arithmetic_dataset(num_prompts, seed=0)
    texts = [
        tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        for r in rows
    ]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    return ids, mask


def count_until_eos(new_tokens: torch.Tensor, eos: int) -> int:
    """Generated tokens per row up to and including the first EOS (``[B, T]`` -> total)."""
    is_eos = new_tokens == eos
    first = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, new_tokens.shape[-1])
    return int(first.sum())


def check_greedy_agreement(model, prompts, max_new_tokens: int) -> None:
    """Before timing: greedy decoding of both paths gives the same tokens (same model, same rows)."""
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    ours = TransformersBackend(model, mode="share").generate(prompts, 1, greedy)
    ids, mask = left_pad(prompts, pad=0)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=2, pad_token_id=0)[:, ids.shape[1] :]  # fmt: skip
    for c, row in zip(ours, ref):
        if c.token_ids != row[: len(c)].tolist():
            raise AssertionError(
                f"greedy mismatch on prompt {c.prompt_index}: {c.token_ids} vs {row.tolist()}"
            )


def run_backend(model, prompts, args) -> tuple[float, int]:
    backend = TransformersBackend(model, mode="share")
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
    backend.generate(prompts[:2], 1, sampling)  # warm-up
    start = time.perf_counter()
    out = backend.generate(prompts, args.samples, sampling)
    return time.perf_counter() - start, sum(len(c) for c in out)


def run_hf(model, prompts, args, *, logprobs: bool) -> tuple[float, int]:
    ids, mask = left_pad([p for p in prompts for _ in range(args.samples)], pad=0)
    kwargs = dict(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=2, pad_token_id=0
    )
    if logprobs:
        kwargs.update(output_scores=True, return_dict_in_generate=True)
    model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, **kwargs)  # warm-up
    torch.manual_seed(0)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, **kwargs)
    sequences = out.sequences if logprobs else out
    if logprobs:
        model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    elapsed = time.perf_counter() - start
    return elapsed, count_until_eos(sequences[:, ids.shape[1] :], eos=2)


def bench(args) -> list[dict]:
    tok = build_char_tokenizer()
    prompts = chat_prompts(tok, args.prompts)
    results = []
    for name in args.models:
        model = build_tiny_qwen3(len(tok), max_position_embeddings=1024, **MODELS[name])
        with torch.no_grad():
            check_greedy_agreement(model, prompts[:4], args.max_new_tokens)
            runs = {
                "backend": run_backend(model, prompts, args),
                "hf_generate": run_hf(model, prompts, args, logprobs=False),
                "hf_generate_logprobs": run_hf(model, prompts, args, logprobs=True),
            }
        ours = runs["backend"][1] / runs["backend"][0]
        for path, (seconds, tokens) in runs.items():
            rate = tokens / seconds
            results.append(
                dict(model=name, path=path, seconds=seconds, tokens=tokens, tokens_per_s=rate,
                     backend_ratio=ours / rate)
            )  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results = bench(args)
    header = f"{'model':<12} {'path':<22} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'backend/path':>12}"
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r['model']:<12} {r['path']:<22} {r['tokens']:>7d} {r['seconds']:>8.3f} "
            f"{r['tokens_per_s']:>9.0f} {r['backend_ratio']:>12.2f}"
        )
    sys.stdout.write("\n".join(lines) + "\n")
    meta = dict(
        prompts=args.prompts, samples=args.samples, max_new_tokens=args.max_new_tokens,
        threads=args.threads, torch=torch.__version__, transformers=transformers.__version__,
        python=platform.python_version(), machine=platform.machine(),
    )  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": meta, "results": results}, indent=2) + "\n")
    sys.stdout.write(f"wrote {args.out}\n")


if __name__ == "__main__":
    main()
