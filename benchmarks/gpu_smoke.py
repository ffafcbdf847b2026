"""GPU smoke test: one PPO update of a Qwen3-0.6B-shaped model under FSDP2 with fp32 master weights.

A random Qwen3-0.6B-shaped model (hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim 128,
intermediate 3072, vocab 151,936; bf16-representable weights) is sharded with FSDP2
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, world size 1 unless launched with
torchrun), anchored over a token-budget micro-batch plan, then trained for one PPO update (AdamW,
lr 1e-6) on a synthetic batch of 32 rows of 200-1000 tokens. Reports the first-update ratio on every
micro-batch (must be exactly 1), tokens/s of the anchor pass and of the update, peak memory, and
the fraction of fp32 master elements the step changed. Prints a table, writes JSON.

Run:  python benchmarks/gpu_smoke.py                          (one GPU, NCCL; < 5 min on an H200)
      torchrun --nproc-per-node 8 benchmarks/gpu_smoke.py     (8 GPUs; rank 0 reports)
      python benchmarks/gpu_smoke.py --device cpu --tiny       (CPU, gloo, a tiny model: seconds)
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from tensordict import TensorDict
from transformers import Qwen3Config, Qwen3ForCausalLM

from ar_torchrl.distributed import (
    broadcast_batch,
    distributed,
    recompute_sharded_old_log_probs_and_values,
    shard_actor_critic,
    shard_plan,
)
from ar_torchrl.modules import LMActorCritic, attach_value_head
from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
from ar_torchrl.training import plan_micro_batches, ppo_update

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_smoke.json"
QWEN3_0_6B = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
)


def build_model(shape: dict, device: torch.device, seed: int) -> torch.nn.Module:
    """A random Qwen3 of ``shape`` with bf16 weights and a zero fp32 value head."""
    config = Qwen3Config(
        **shape,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    return attach_value_head(model).eval()


def make_batch(rows: int, lengths: tuple[int, int], vocab: int, seed: int) -> TensorDict:
    """Left-padded 64-token prompts and right-padded responses of ``lengths`` (tokens), +-1 reward."""
    g = torch.Generator().manual_seed(seed)
    prompt = 64
    resp = torch.randint(lengths[0] - prompt, lengths[1] - prompt + 1, (rows,), generator=g)
    width = prompt + int(resp.max())
    tokens = torch.randint(3, vocab, (rows, width), generator=g)
    pos = torch.arange(width)
    attn = pos < prompt + resp.unsqueeze(1)
    loss_mask = attn & (pos >= prompt)
    last = (prompt + resp - 1).unsqueeze(1)
    done = (pos == last).unsqueeze(-1)
    sign = torch.where(torch.rand(rows, generator=g) < 0.5, -1.0, 1.0)
    reward = done.float() * sign.view(rows, 1, 1)
    return TensorDict(
        {
            "tokens": torch.where(attn, tokens, 0),
            "attention_mask": attn,
            "loss_mask": loss_mask,
            "next": {"reward": reward, "done": done, "terminated": done.clone()},
        },
        [rows, width],
    )


class RecordRatios:
    """Wraps the loss and records ``min_ratio/max`` of each micro-batch of the first mini-batch."""

    def __init__(self, loss: TokenPPOLoss):
        self.loss, self.ratios = loss, []

    def global_normalizer(self, tds):
        return self.loss.global_normalizer(tds)

    def __call__(self, td, normalizer=None):
        out = self.loss(td, normalizer=normalizer)
        if bool(td["loss_mask"].any()):
            self.ratios.append((out["min_ratio"].item(), out["max_ratio"].item()))
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args) -> dict:
    with distributed(args.device, process_group=True) as ctx:
        shape = TINY if args.tiny else QWEN3_0_6B
        ac = LMActorCritic(build_model(shape, ctx.device, args.seed))
        shard_actor_critic(
            ac,
            ctx,
            compute_dtype="bfloat16",
            activation_checkpointing=args.activation_checkpointing,
        )
        optimizer = torch.optim.AdamW(ac.parameters(), lr=1e-6, weight_decay=0.0)
        lengths = (16 + 64, 48 + 64) if args.tiny else (200, 1000)
        td = make_batch(args.rows, lengths, shape["vocab_size"], args.seed) if ctx.is_main else None
        td = broadcast_batch(td, ctx)
        budget = 512 if args.tiny else args.token_budget
        sharded = shard_plan(
            plan_micro_batches(td, budget), td, rank=ctx.rank, world_size=ctx.world_size
        )
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        _sync(ctx.device)
        t0 = time.perf_counter()
        recompute_sharded_old_log_probs_and_values(ac, td, sharded)
        _sync(ctx.device)
        t_anchor = time.perf_counter() - t0
        td = TokenGAE(gamma=1.0, lmbda=0.95, normalize_advantage=True)(td)
        loss = RecordRatios(TokenPPOLoss(ac, clip_epsilon=(0.2, 0.28), clip_value=0.2))
        policy = [p for n, p in ac.named_parameters() if "value_head" not in n]
        before = [p.to_local().detach().clone() for p in policy]
        t0 = time.perf_counter()
        metrics = ppo_update(loss, optimizer, td, sharded, grad_clip=1.0)
        _sync(ctx.device)
        t_update = time.perf_counter() - t0
        changed = sum(int((p.to_local() != b).sum()) for p, b in zip(policy, before))
        counts = ctx.all_reduce(torch.tensor([changed, sum(b.numel() for b in before)]))
        ratios = [None] * ctx.world_size
        if ctx.is_distributed and ctx.world_size > 1:
            torch.distributed.all_gather_object(ratios, loss.ratios)
        else:
            ratios = [loss.ratios]
        real = int(td["attention_mask"].sum())
        padded = sum(mb.num_tokens for mb in sharded.plan.micro_batches)
        peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else None
        return {
            "config": {
                "model": "tiny" if args.tiny else "qwen3-0.6b-shape",
                **shape,
                "device": str(ctx.device),
                "world_size": ctx.world_size,
                "rows": args.rows,
                "token_budget": budget,
                "compute_dtype": "bfloat16",
                "activation_checkpointing": args.activation_checkpointing,
                "torch": torch.__version__,
                "python": platform.python_version(),
                "gpu": torch.cuda.get_device_name(ctx.device)
                if ctx.device.type == "cuda"
                else None,
            },
            "micro_batches": len(sharded.plan),
            "tokens": real,
            "padded_tokens": padded,
            "min_ratio": min(r[0] for rank in ratios for r in rank),
            "max_ratio": max(r[1] for rank in ratios for r in rank),
            "ratio_exactly_one": all(r == (1.0, 1.0) for rank in ratios for r in rank),
            "anchor_s": t_anchor,
            "update_s": t_update,
            "anchor_tokens_per_s": real / t_anchor,
            "update_tokens_per_s": real / t_update,
            "peak_memory_gib": None if peak is None else peak / 2**30,
            "masters_changed_fraction": counts[0].item() / counts[1].item(),
            "loss_objective": metrics["train/loss_objective"],
            "grad_norm": metrics["train/grad_norm"],
            "is_main": ctx.is_main,
        }


def print_table(result: dict) -> None:
    rows = [
        (
            "model",
            f"{result['config']['model']} on {result['config']['device']} "
            f"x{result['config']['world_size']}",
        ),
        (
            "micro-batches / tokens (padded)",
            f"{result['micro_batches']} / {result['tokens']} ({result['padded_tokens']})",
        ),
        ("first-update ratio min / max", f"{result['min_ratio']!r} / {result['max_ratio']!r}"),
        ("anchor pass tokens/s", f"{result['anchor_tokens_per_s']:,.0f}"),
        ("PPO update tokens/s", f"{result['update_tokens_per_s']:,.0f}"),
        (
            "peak memory (GiB)",
            "n/a" if result["peak_memory_gib"] is None else f"{result['peak_memory_gib']:.2f}",
        ),
        ("fp32 masters changed (lr 1e-6)", f"{100 * result['masters_changed_fraction']:.2f} %"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu", "auto"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = run(args)
    if result.pop("is_main"):
        print_table(result)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
        if not result["ratio_exactly_one"]:
            raise SystemExit("first-update ratio is not exactly 1 on every micro-batch")


if __name__ == "__main__":
    main()
