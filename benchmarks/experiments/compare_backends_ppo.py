"""Backend comparison: the same PPO run with trainside rollouts and with a real local SGLang server.

Same seed, same prompts, greedy decoding, 3 rollouts, one PPO update (one mini-batch) per rollout,
weights pushed to the backend after each update. Per rollout it reports, side by side: the PPO loss
(objective + value + KL terms), the mean ratio of the update, the mean |rollout - trainer| log-prob
over generated tokens, and the gradient norm. Prints a table and writes
``benchmarks/results/compare_backends_ppo.json``.

Run:  .venv/bin/python benchmarks/experiments/compare_backends_ppo.py          (needs .venv-sglang, ~3 min on CPU)
      .venv/bin/python benchmarks/experiments/compare_backends_ppo.py --url http://127.0.0.1:30000   (running server)
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
from _compare import make_backend, ppo_step, run_both, write_result

from ar_torchrl.backends import SamplingParams
from ar_torchrl.data.datasets import arithmetic_dataset
from ar_torchrl.envs import LLMEnv
from ar_torchrl.models.config import warm_started_tiny_model
from ar_torchrl.modules import LMActorCritic, attach_value_head
from ar_torchrl.objectives import TokenGAE, TokenPPOLoss

RESULTS = Path(__file__).resolve().parent / "results" / "compare_backends_ppo.json"
ROLLOUTS, PROMPTS, MAX_NEW = 3, 16, 12


def starting_policy(cache: Path, seed: int):
    """The recipe's warm-started tiny model (cached), a fresh value head and its tokenizer."""
    model, tok = warm_started_tiny_model(
        cache
    )  # the CPU default's warm start (ar_torchrl/configs/model/tiny.yaml)
    torch.manual_seed(seed)
    return attach_value_head(model), tok


def run(backend_name: str, args, stack) -> list[dict]:
    model, tok = starting_policy(args.cache, args.seed)
    backend = make_backend(backend_name, model, tok, stack, seed=args.seed, url=args.url)
    env = LLMEnv(
        arithmetic_dataset(200, seed=args.seed),
        tok,
        backend,
        num_samples=1,
        prompts_per_batch=PROMPTS,
        sampling=SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0),
        seed=args.seed,
    )
    ac = LMActorCritic(model)
    loss_fn = TokenPPOLoss(ac, clip_epsilon=0.2, clip_value=0.2, critic_coeff=1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gae = TokenGAE(gamma=1.0, lmbda=0.95, normalize_advantage=True)
    rows = []
    for i in range(ROLLOUTS):
        _, out, row = ppo_step(env, ac, loss_fn, optimizer, gae, backend)
        rows.append(
            {"rollout": i, **row, "logprob_abs_diff": out["train/rollout_log_prob_abs_diff"]}
        )
    return rows


def table(results: dict[str, list[dict]]) -> str:
    head = ["rollout", "metric", "trainside", "sglang", "abs diff"]
    lines = [" | ".join(f"{h:>17}" for h in head)]
    for a, b in zip(results["trainside"], results["sglang"]):
        for key in ("loss", "mean_ratio", "logprob_abs_diff", "grad_norm", "reward_mean"):
            cells = [
                a["rollout"],
                key,
                f"{a[key]:.6g}",
                f"{b[key]:.6g}",
                f"{abs(a[key] - b[key]):.2e}",
            ]
            lines.append(" | ".join(f"{str(c):>17}" for c in cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="an already running SGLang server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("AR_TORCHRL_CACHE", Path.home() / ".cache" / "ar_torchrl")),
    )
    args = parser.parse_args()
    results, seconds = run_both(run, args)
    same_tokens = [
        a["tokens"] == b["tokens"] for a, b in zip(results["trainside"], results["sglang"])
    ]
    max_loss_diff = max(
        abs(a["loss"] - b["loss"]) for a, b in zip(results["trainside"], results["sglang"])
    )
    finite = all(
        math.isfinite(r[k])
        for rows in results.values()
        for r in rows
        for k in ("loss", "mean_ratio", "logprob_abs_diff", "grad_norm")
    )
    print(table(results))
    print(
        f"same greedy tokens per rollout: {same_tokens}; max |loss diff| = {max_loss_diff:.3e}; "
        f"all finite: {finite}; wall s: {seconds}"
    )
    write_result(
        args.out,
        results,
        same_tokens=same_tokens,
        max_loss_abs_diff=max_loss_diff,
        all_finite=finite,
        wall_s=seconds,
        seed=args.seed,
    )


if __name__ == "__main__":
    main()
