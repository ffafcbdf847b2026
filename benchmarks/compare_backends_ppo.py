"""Backend comparison: the same PPO run with trainside rollouts and with a real local SGLang server.

Same seed, same prompts, greedy decoding, 3 rollouts, one PPO update (one mini-batch) per rollout,
weights pushed to the backend after each update. Per rollout it reports, side by side: the PPO loss
(objective + value + KL terms), the mean ratio of the update, the mean |rollout - trainer| log-prob
over generated tokens, and the gradient norm. Prints a table and writes
``benchmarks/results/compare_backends_ppo.json``.

Run:  .venv/bin/python benchmarks/compare_backends_ppo.py          (needs .venv-sglang, ~3 min on CPU)
      .venv/bin/python benchmarks/compare_backends_ppo.py --url http://127.0.0.1:30000   (running server)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from ar_torchrl.backends import SamplingParams, TransformersBackend
from ar_torchrl.data import plan_micro_batches
from ar_torchrl.data.datasets import arithmetic_dataset
from ar_torchrl.envs import LLMEnv
from ar_torchrl.models import build_tiny_model
from ar_torchrl.modules import LMActorCritic, attach_value_head, save_policy
from ar_torchrl.objectives import TokenGAE, TokenPPOLoss, recompute_anchors
from ar_torchrl.training import ppo_update
from ar_torchrl.warmstart import cached_warm_start
from ar_torchrl.weight_sync import named_policy_tensors

RESULTS = Path(__file__).resolve().parent / "results" / "compare_backends_ppo.json"
ROLLOUTS, PROMPTS, MAX_NEW = 3, 16, 12


def starting_policy(cache: Path, seed: int):
    """The recipe's warm-started tiny model (cached), a fresh value head and its tokenizer."""
    model, tok = build_tiny_model()
    rows = list(arithmetic_dataset(1000, seed=1234))
    model, _ = cached_warm_start(model, tok, rows, cache_dir=cache / "warmstart", steps=300,
                                 batch_size=32, lr=3e-3, final_lr_ratio=0.1,
                                 correct_fraction=0.3, seed=1234)  # fmt: skip
    torch.manual_seed(seed)
    return attach_value_head(model), tok


def run(backend_name: str, args, stack: contextlib.ExitStack) -> list[dict]:
    model, tok = starting_policy(args.cache, args.seed)
    backend = make_backend(backend_name, model, tok, args, stack)
    env = LLMEnv(arithmetic_dataset(200, seed=args.seed), tok, backend, num_samples=1,
                 prompts_per_batch=PROMPTS, sampling=SamplingParams(max_new_tokens=MAX_NEW,
                 temperature=0.0), seed=args.seed)  # fmt: skip
    ac = LMActorCritic(model)
    loss_fn = TokenPPOLoss(ac, clip_epsilon=0.2, clip_value=0.2, critic_coeff=1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gae = TokenGAE(gamma=1.0, lmbda=0.95, normalize_advantage=True)
    rows = []
    for i in range(ROLLOUTS):
        td = env.rollout()
        plan = plan_micro_batches(td, token_budget=4096)
        recompute_anchors(ac, td, plan)
        td = gae(td)
        out = ppo_update(loss_fn, optimizer, td, plan, epochs=1, num_minibatches=1, grad_clip=1.0)
        backend.sync_weights(named_policy_tensors(model), version=backend.weight_version + 1)
        rows.append({
            "rollout": i,
            "loss": out["train/loss_objective"] + out["train/loss_critic"],
            "ratio_mean": out["train/ratio_mean"],
            "logprob_abs_diff": out["train/rollout_log_prob_abs_diff"],
            "grad_norm": out["train/grad_norm"],
            "reward_mean": float(td["next", "reward"].sum((-2, -1)).mean()),
            "response_tokens": int(td["loss_mask"].sum()),
            "tokens": td["tokens"][td["loss_mask"]].tolist(),
        })  # fmt: skip
    return rows


def make_backend(name: str, model, tok, args, stack: contextlib.ExitStack):
    if name == "trainside":
        return TransformersBackend(model, seed=args.seed)
    from ar_torchrl.backends.sglang import SGLangBackend, launch_sglang_server

    url = args.url
    if url is None:
        model_dir = save_policy(model, Path(tempfile.mkdtemp(prefix="cmp-sglang-")), tok)
        url = stack.enter_context(launch_sglang_server(model_dir, timeout_s=600)).url
    backend = SGLangBackend(url, weight_sync="disk", show_progress=False)
    stack.callback(backend.close)
    if args.url is not None:  # a running server holds other weights: push the starting policy
        backend.sync_weights(named_policy_tensors(model), version=0)
    return backend


def table(results: dict[str, list[dict]]) -> str:
    head = ["rollout", "metric", "trainside", "sglang", "abs diff"]
    lines = [" | ".join(f"{h:>17}" for h in head)]
    for a, b in zip(results["trainside"], results["sglang"]):
        for key in ("loss", "ratio_mean", "logprob_abs_diff", "grad_norm", "reward_mean"):
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
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get(
        "AR_TORCHRL_CACHE", Path.home() / ".cache" / "ar_torchrl")))  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    results, seconds = {}, {}
    for name in ("trainside", "sglang"):
        start = time.perf_counter()
        with contextlib.ExitStack() as stack:
            results[name] = run(name, args, stack)
        seconds[name] = time.perf_counter() - start
    same_tokens = [
        a["tokens"] == b["tokens"] for a, b in zip(results["trainside"], results["sglang"])
    ]
    max_loss_diff = max(
        abs(a["loss"] - b["loss"]) for a, b in zip(results["trainside"], results["sglang"])
    )
    finite = all(math.isfinite(r[k]) for rows in results.values() for r in rows
                 for k in ("loss", "ratio_mean", "logprob_abs_diff", "grad_norm"))  # fmt: skip
    print(table(results))
    print(f"same greedy tokens per rollout: {same_tokens}; max |loss diff| = {max_loss_diff:.3e}; "
          f"all finite: {finite}; wall s: {seconds}")  # fmt: skip
    for rows in results.values():
        for r in rows:
            r.pop("tokens")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "rollouts": results, "same_tokens": same_tokens, "max_loss_abs_diff": max_loss_diff,
        "all_finite": finite, "wall_s": seconds, "seed": args.seed,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}",
    }, indent=2))  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
