"""Single-process mixed precision: bf16 storage vs autocast vs FSDP2 at world size 1 (vs fp32).

The same random Qwen3 and batch, one anchor pass and one PPO update (AdamW, lr 1e-6) per mode:

- ``fp32``: float32 parameters and compute (the reference).
- ``bf16_storage``: bfloat16 parameters updated in place (what ``model.dtype=bfloat16`` did before).
- ``autocast``: float32 parameters, forward/backward under ``torch.autocast(bfloat16)``.
- ``fsdp_ws1``: FSDP2 on a one-rank group, ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``, the value head in fp32 (:func:`ar_torchrl.distributed.shard_actor_critic`):
  the numerics of N ranks, in one process.

Per mode: seconds for anchors + update, the fraction of policy elements one step changes, whether the
first-update ratio is exactly 1 on every micro-batch, the mean |anchor log-prob difference| over
trained tokens to the fp32 and to the bf16-storage forward (what a bf16 rollout engine computes),
and peak CUDA memory. Prints a table, writes JSON (timings on a shared CPU are indicative only).

Run:  python benchmarks/bench_mixed_precision.py                    (CPU, a small model, ~1 min)
      python benchmarks/bench_mixed_precision.py --device cuda --shape qwen3-0.6b
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch
from gpu_smoke import QWEN3_0_6B, RecordRatios, build_model, make_batch

from ar_torchrl.distributed import distributed, reshard, shard_actor_critic
from ar_torchrl.functional import masked_mean
from ar_torchrl.modules import LMActorCritic
from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
from ar_torchrl.training import plan_micro_batches, ppo_update, recompute_old_log_probs_and_values

RESULTS = Path(__file__).resolve().parent / "results" / "bench_mixed_precision.json"
SMALL = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=768,
    vocab_size=2048,
)
MODES = ("fp32", "bf16_storage", "autocast", "fsdp_ws1")


def _actor(mode: str, args, ctx) -> LMActorCritic:
    model = build_model(args.shape_dict, ctx.device, args.seed)  # bf16-representable weights
    if mode == "bf16_storage":
        head = model.value_head
        model = model.to(torch.bfloat16)
        model.value_head = head.float()
    else:
        model = model.float()
    ac = LMActorCritic(model)
    if mode == "fsdp_ws1":
        shard_actor_critic(ac, ctx, compute_dtype="bfloat16")
    return ac


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def run_mode(mode: str, args, ctx, batch) -> tuple[dict, torch.Tensor]:
    ac = _actor(mode, args, ctx)
    opt = torch.optim.AdamW(ac.parameters(), lr=1e-6, weight_decay=0.0)
    td = batch.clone().to(ctx.device)
    plan = plan_micro_batches(td, args.token_budget)
    amp = (
        torch.autocast(ctx.device.type, dtype=torch.bfloat16)
        if mode == "autocast"
        else contextlib.nullcontext()
    )
    policy = [p for n, p in ac.named_parameters() if "value_head" not in n]
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    t0 = time.perf_counter()
    with amp:
        recompute_old_log_probs_and_values(ac, td, plan)
    reshard(ac)
    before = [_local(p).detach().clone() for p in policy]
    td = TokenGAE(gamma=1.0, lmbda=0.95, normalize_advantage=True)(td)
    loss = RecordRatios(TokenPPOLoss(ac, clip_epsilon=(0.2, 0.28), clip_value=0.2))
    with amp:
        ppo_update(loss, opt, td, plan, grad_clip=1.0)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    seconds = time.perf_counter() - t0
    changed = sum(int((_local(p) != b).sum()) for p, b in zip(policy, before))
    peak = (
        torch.cuda.max_memory_allocated(ctx.device) / 2**30 if ctx.device.type == "cuda" else None
    )
    row = {
        "mode": mode,
        "seconds": seconds,
        "changed_fraction": changed / sum(b.numel() for b in before),
        "ratio_exactly_one": all(r == (1.0, 1.0) for r in loss.ratios),
        "peak_memory_gib": peak,
        "param_dtype": str(policy[0].dtype).removeprefix("torch."),
        "value_dtype": str(td["state_value"].dtype).removeprefix("torch."),
    }
    return row, td["sample_log_prob"].float().cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", choices=["small", "qwen3-0.6b"], default="small")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.shape_dict = SMALL if args.shape == "small" else QWEN3_0_6B
    lengths = (96, 320) if args.shape == "small" else (200, 1000)
    batch = make_batch(args.rows, lengths, args.shape_dict["vocab_size"], args.seed)
    mask = batch["loss_mask"]
    rows, log_probs = [], {}
    load_before = os.getloadavg()[0]
    with distributed(args.device, process_group=True) as ctx:
        for mode in MODES:
            row, log_probs[mode] = run_mode(mode, args, ctx, batch)
            rows.append(row)
    for row in rows:
        for ref in ("fp32", "bf16_storage"):
            diff = (log_probs[row["mode"]] - log_probs[ref]).abs()
            row[f"logprob_abs_diff_vs_{ref}"] = float(masked_mean(diff, mask))
    header = (
        f"{'mode':<14}{'s':>8}{'changed':>10}{'ratio==1':>10}{'|dlogp| fp32':>14}"
        f"{'|dlogp| bf16':>14}{'peak GiB':>10}"
    )
    print(header)
    for r in rows:
        peak = "n/a" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}"
        print(
            f"{r['mode']:<14}{r['seconds']:>8.2f}{100 * r['changed_fraction']:>9.2f}%"
            f"{str(r['ratio_exactly_one']):>10}{r['logprob_abs_diff_vs_fp32']:>14.2e}"
            f"{r['logprob_abs_diff_vs_bf16_storage']:>14.2e}{peak:>10}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {
        "device": args.device,
        "shape": args.shape,
        **args.shape_dict,
        "rows": args.rows,
        "tokens": int(batch["attention_mask"].sum()),
        "torch": torch.__version__,
        "load_avg_1m": {"before": load_before, "after": os.getloadavg()[0]},
    }
    args.out.write_text(json.dumps({"config": config, "results": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
