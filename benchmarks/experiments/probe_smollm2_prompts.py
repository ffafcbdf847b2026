"""How pretrained SmolLM2-135M-Instruct answers arithmetic under different prompts, before any RL.

For each prompt format, greedy decoding (and sampling at T = 1, what PPO sees) on the same
*training* problems of ``ar_torchrl/configs/smollm2_arithmetic.yaml`` (never the held-out ones): the fraction
of responses with an ``Answer:`` line (format rate), the DAPO accuracy (+1 rewards), the mean
response length. Formats: ``dapo`` (DAPO-Math-17k's prompt), ``short`` (the tiny model's short DAPO
prompt), ``plain`` (the bare question), ``oneshot`` (one solved user/assistant turn first, the
configuration's prompt). Prints a markdown table and writes
``benchmarks/results/probe_smollm2_prompts.json``.

Run:  .venv/bin/python benchmarks/experiments/probe_smollm2_prompts.py      (~10 min on one loaded core)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from ar_torchrl.backends import SamplingParams, TransformersBackend
from ar_torchrl.data.datasets import DAPO_TEMPLATE, SHORT_TEMPLATE
from ar_torchrl.data.tasks import arithmetic_task_split
from ar_torchrl.models import load_smollm2_135m
from ar_torchrl.rewards.math import dapo_math_reward, extract_answer

RESULTS = Path(__file__).resolve().parent / "results" / "probe_smollm2_prompts.json"
FORMATS = ("dapo", "short", "plain", "oneshot")


def messages(row: dict, fmt: str) -> list[dict]:
    """The row's question in prompt format ``fmt`` (``oneshot``: the row's own one-shot prompt)."""
    if fmt == "oneshot":
        return row["prompt"]
    question = row["prompt"][-1]["content"]
    content = {"dapo": DAPO_TEMPLATE, "short": SHORT_TEMPLATE, "plain": "{problem}"}[fmt]
    return [{"role": "user", "content": content.format(problem=question)}]


def probe(backend, tok, rows, fmt: str, temperature: float, max_new_tokens: int) -> dict:
    prompts = []
    for row in rows:
        text = tok.apply_chat_template(
            messages(row, fmt), add_generation_prompt=True, tokenize=False
        )
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=0)
    start = time.process_time()
    done = [
        c
        for i in range(0, len(prompts), 32)
        for c in backend.generate(prompts[i : i + 32], 1, sampling)
    ]
    texts = [tok.decode(c.token_ids, skip_special_tokens=True) for c in done]
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    return {
        "format": fmt,
        "temperature": temperature,
        "prompts": len(rows),
        "format_rate": sum(extract_answer(t) is not None for t in texts) / len(texts),
        "accuracy": sum(dapo_math_reward(t, g) > 0 for t, g in zip(texts, truths)) / len(texts),
        "response_tokens": sum(len(c) for c in done) / len(done),
        "prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "cpu_s": time.process_time() - start,
        "example": texts[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("AR_TORCHRL_CACHE", Path.home() / ".cache" / "ar_torchrl")),
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tok = load_smollm2_135m(args.cache)
    backend = TransformersBackend(model, mode="share", seed=0)
    # the configuration's training problems (+ and *, operands 0-9; its held-out ones are left out)
    train, _ = arithmetic_task_split(args.prompts, 64, ops=["+", "*"], max_operand=9, seed=0)
    results = []
    print("| prompt | T | format rate | accuracy | response tokens | prompt tokens |")
    print("|---|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        for temperature in (0.0, 1.0):
            r = probe(backend, tok, list(train), fmt, temperature, args.max_new_tokens)
            results.append(r)
            print(
                f"| {fmt} | {temperature:g} | {r['format_rate']:.0%} | {r['accuracy']:.0%} | "
                f"{r['response_tokens']:.1f} | {r['prompt_tokens']:.0f} |",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
