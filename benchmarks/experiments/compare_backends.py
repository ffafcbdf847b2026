"""Compare the two rollout backends on the same prompts: SGLang (HTTP server) vs trainside transformers.

Greedy decoding of the same prompts with the same tiny Qwen3 weights on both backends. Reports:

- agreement: how many completions are token-identical between the backends;
- per-token log-prob drift between the backends (on the common prefix of each pair of completions)
  and of each backend vs the trainer's own fp32 forward (``log_softmax`` of the same tokens,
  teacher-forced): max and mean absolute difference;
- throughput: generated tokens / wall-clock second of each backend (after one warm-up call; best of
  ``--repeats`` calls, all times are in the JSON: the machine is shared, so the spread is large).

Prints a table and writes ``benchmarks/results/compare_backends.json``.

Run (CPU; launches a local SGLang server from ``.venv-sglang`` unless ``--url`` is given)::

    .venv/bin/python benchmarks/experiments/compare_backends.py                  # 32 prompts x 2, 32 new tokens
    .venv/bin/python benchmarks/experiments/compare_backends.py --quick          # 8 prompts x 1, 16 new tokens
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from ar_torchrl.backends import SamplingParams, TransformersBackend
from ar_torchrl.backends.sglang import SGLangBackend, SGLangClientOptions, launch_sglang_server
from ar_torchrl.models.tiny import build_char_tokenizer, build_tiny_qwen3, save_tiny_model

RESULTS = Path(__file__).resolve().parent / "results" / "compare_backends.json"


def make_prompts(num: int, seed: int) -> list[list[int]]:
    """Chat-formatted single-digit addition prompts, tokenized with the char tokenizer."""
    tok = build_char_tokenizer()
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(num):
        a, b = torch.randint(0, 10, (2,), generator=gen).tolist()
        messages = [
            {"role": "user", "content": f"What is {a} + {b}? End with a line Answer: $Answer"}
        ]
        prompts.append(
            tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return [list(p) for p in prompts]


def trainer_log_probs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """fp32 ``log_softmax`` of ``tokens`` after ``prompt`` from the trainer's forward: ``[len(tokens)]``."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def timed_generate(backend, prompts, n, sampling, repeats: int) -> tuple[list, list[float]]:
    """Warm up once, then time ``repeats`` identical greedy calls; returns the first output and the times."""
    backend.generate(prompts[:1], 1, sampling)
    out, times = None, []
    for _ in range(repeats):
        start = time.perf_counter()
        result = backend.generate(prompts, n, sampling)
        times.append(time.perf_counter() - start)
        out = out or result
    return out, times


def drift_stats(diffs: list[torch.Tensor]) -> dict:
    flat = torch.cat([d.abs() for d in diffs]) if diffs else torch.zeros(0)
    return {
        "tokens": int(flat.numel()),
        "max_abs": float(flat.max()) if flat.numel() else 0.0,
        "mean_abs": float(flat.mean()) if flat.numel() else 0.0,
    }


def compare(model, prompts, sgl_out, tf_out) -> dict:
    """Agreement and log-prob drift between the backends and vs the trainer forward."""
    between, sgl_vs_trainer, tf_vs_trainer, identical = [], [], [], 0
    for s, t in zip(sgl_out, tf_out):
        prompt = prompts[s.prompt_index]
        identical += s.token_ids == t.token_ids
        common = next(
            (i for i, (a, b) in enumerate(zip(s.token_ids, t.token_ids)) if a != b),
            min(len(s), len(t)),
        )
        k = min(common + 1, len(s), len(t))  # the first differing token still has the same prefix
        between.append(torch.tensor(s.log_probs[:k]) - torch.tensor(t.log_probs[:k]))
        sgl_vs_trainer.append(
            torch.tensor(s.log_probs) - trainer_log_probs(model, prompt, s.token_ids)
        )
        tf_vs_trainer.append(
            torch.tensor(t.log_probs) - trainer_log_probs(model, prompt, t.token_ids)
        )
    return {
        "completions": len(sgl_out),
        "token_identical": identical,
        "drift_sglang_vs_trainside": drift_stats(between),
        "drift_sglang_vs_trainer": drift_stats(sgl_vs_trainer),
        "drift_trainside_vs_trainer": drift_stats(tf_vs_trainer),
    }


def print_table(result: dict) -> None:
    rows = [
        (
            "backend",
            "tokens",
            "seconds",
            "tokens/s",
            "max|dlogp| vs trainer",
            "mean|dlogp| vs trainer",
        ),
        *[
            (
                name,
                str(r["tokens"]),
                f"{r['seconds']:.2f}",
                f"{r['tokens_per_s']:.1f}",
                f"{result['drift'][key]['max_abs']:.2e}",
                f"{result['drift'][key]['mean_abs']:.2e}",
            )
            for name, r, key in (
                ("sglang", result["sglang"], "drift_sglang_vs_trainer"),
                ("trainside", result["trainside"], "drift_trainside_vs_trainer"),
            )
        ],
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    d = result["drift"]
    print(
        f"token-identical completions: {d['token_identical']}/{d['completions']}; "
        f"sglang vs trainside drift: max {d['drift_sglang_vs_trainside']['max_abs']:.2e}, "
        f"mean {d['drift_sglang_vs_trainside']['mean_abs']:.2e} over {d['drift_sglang_vs_trainside']['tokens']} tokens"
    )


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    prompts = make_prompts(args.num_prompts, args.seed)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    model = build_tiny_qwen3(99, hidden_size=args.hidden, num_layers=args.layers, seed=args.seed)
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            model_dir = save_tiny_model(
                Path(stack.enter_context(tempfile.TemporaryDirectory())) / "model",
                seed=args.seed,
                hidden_size=args.hidden,
                num_layers=args.layers,
            )
            url = stack.enter_context(launch_sglang_server(model_dir, timeout_s=600)).url
        sgl = stack.enter_context(
            SGLangBackend(url, options=SGLangClientOptions(show_progress=False))
        )
        if args.url is not None:  # an external server: make sure it serves these weights
            sgl.sync_weights(model.state_dict().items(), version=0)
        sgl_out, sgl_s = timed_generate(sgl, prompts, args.n, sampling, args.repeats)
        trainside = TransformersBackend(model, mode="copy", seed=args.seed)
        tf_out, tf_s = timed_generate(trainside, prompts, args.n, sampling, args.repeats)
    side = {
        name: {
            "tokens": sum(map(len, out)),
            "seconds": min(times),
            "seconds_all": times,
            "tokens_per_s": sum(map(len, out)) / min(times),
        }
        for name, out, times in (("sglang", sgl_out, sgl_s), ("trainside", tf_out, tf_s))
    }
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "env": {
            "torch": torch.__version__,
            "threads_trainside": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(),
            "machine": platform.machine(),
        },
        **side,
        "drift": compare(model, prompts, sgl_out, tf_out),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of the trainside backend"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed calls per backend (best is reported)"
    )
    parser.add_argument(
        "--url", default=None, help="use a running SGLang server instead of launching one"
    )
    parser.add_argument(
        "--quick", action="store_true", help="8 prompts x 1 sample, 16 new tokens, 1 repeat"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.n, args.max_new_tokens, args.repeats = 8, 1, 16, 1
    result = run(args)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
