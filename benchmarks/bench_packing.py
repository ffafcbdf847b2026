"""Benchmark: padding-free (packed) micro-batches vs padded ones, on a long-tailed length distribution.

What it measures (issue 10, item 1): for one rollout batch of ``B`` rows, the same token budget
planned two ways with :func:`~ar_torchrl.data.plan_micro_batches` (``packing=False`` and
``packing=True``), side by side in one run:

* ``padding %``: padding (packed: bin slack) as a fraction of the tokens the forwards compute
  (a variable-length attention kernel, ``--attn flash_attention_2`` or ``flex_attention``,
  computes the real tokens only: 0 %);
* ``anchor tok/s``: real tokens per second of :func:`~ar_torchrl.objectives.recompute_old_log_probs_and_values`
  (no grad) over the plan;
* ``train tok/s``: real tokens per second of the training forward + backward over the plan (the
  ``LMActorCritic`` forward on each crop, ``(log_prob + state_value).sum().backward()``).

Data (seeded): response lengths log-normal (median ``--median``, sigma ``--sigma``) clipped to
``[--min-response, --max-response]`` (the issue: 16..4096), prompts uniform in
``[--prompt / 2, --prompt]``; left-padded prompts, right-padded responses (docs/design.md section 1).
``--dist uniform`` draws responses uniformly in ``[--max-response / 2, --max-response]`` instead
(little padding: where ``packing="auto"`` should keep the padded plan).

Before timing, the script checks that packed log-probs and values equal the padded ones on every
token that has them (float32: |diff| <= 1e-4, the max is reported) and that the ``"auto"`` plan is
the one ``AUTO_PACKING_MIN_PADDING`` selects. Timing: one warm-up pass each, then ``--reps``
round-robin passes (padded, packed, padded, ...; default 7); the median is reported, and the
speed-up as the ratio of the medians with the [min, median, max] of the per-round ratios.

Models: ``--model small`` (CPU default: a random-init Qwen3, hidden 128, 2 layers, vocab 8192,
float32) or ``--model qwen3-0.6b`` (random init of the Qwen3-0.6B shape: hidden 1024, 28 layers,
16 heads, 8 KV heads, vocab 151,936; bf16 on ``--device cuda``). ``--attn`` picks the attention
implementation (``sdpa``; ``flex_attention``, ``flash_attention_2`` where installed).

Run:
    .venv/bin/python benchmarks/bench_packing.py                 # CPU, scaled down (~2 min on 2 cores)
    .venv/bin/python benchmarks/bench_packing.py --quick         # seconds (CI smoke test)
    python benchmarks/bench_packing.py --device cuda --model qwen3-0.6b --batch 64 \
        --max-response 4096 --median 512 --prompt 256 --token-budget 32768

Prints a table and writes ``benchmarks/results/bench_packing[_quick][_cuda].json`` (``--out``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from _common import machine_info, write_json
from tensordict import TensorDict
from transformers import Qwen3Config, Qwen3ForCausalLM

from ar_torchrl.modules import LMActorCritic, attach_value_head, is_varlen
from ar_torchrl.training import plan_micro_batches, recompute_old_log_probs_and_values
from ar_torchrl.training.micro_batch import AUTO_PACKING_MIN_PADDING, MicroBatchPlan

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {
    "small": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        vocab_size=8192,
    ),
    "qwen3-0.6b": dict(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151_936,
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--attn", default="sdpa", help="attention implementation")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="default: float32 on cpu, bfloat16 on cuda",
    )
    p.add_argument("--dist", choices=("lognormal", "uniform"), default="lognormal")
    p.add_argument("--batch", type=int, default=32, help="rows B")
    p.add_argument("--prompt", type=int, default=64, help="longest prompt P")
    p.add_argument("--median", type=float, default=64.0, help="median response length")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma")
    p.add_argument("--min-response", type=int, default=16)
    p.add_argument("--max-response", type=int, default=1024)
    p.add_argument("--token-budget", type=int, default=4096)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="B=8, responses <= 128, 1 rep")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.max_response, args.median, args.prompt = 8, 128, 32.0, 16
        args.token_budget, args.reps = 512, 1
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if not 1 <= args.min_response <= args.max_response:
        p.error("need 1 <= --min-response <= --max-response")
    if args.out is None:
        suffix = ("_quick" if args.quick else "") + ("_cuda" if args.device == "cuda" else "")
        args.out = RESULTS / f"bench_packing{suffix}.json"
    return args


# ----------------------------------------------------------------------------- data and model
def response_lengths(args: argparse.Namespace, g: torch.Generator) -> torch.Tensor:
    """``[B]`` response lengths: clipped log-normal, or uniform in ``[max / 2, max]``."""
    if args.dist == "uniform":
        return torch.randint(
            args.max_response // 2, args.max_response + 1, (args.batch,), generator=g
        )
    normal = torch.randn(args.batch, generator=g, dtype=torch.float64)
    lengths = torch.exp(math.log(args.median) + args.sigma * normal).round().long()
    return lengths.clamp(args.min_response, args.max_response)


def make_batch(args: argparse.Namespace, vocab: int) -> TensorDict:
    """Left-padded prompts + right-padded responses: ``tokens``, ``attention_mask``, ``loss_mask``."""
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(max(1, args.prompt // 2), args.prompt + 1, (args.batch,), generator=g)
    responses = response_lengths(args, g)
    length = args.prompt + int(responses.max())
    pos = torch.arange(length)
    real = (pos >= args.prompt - prompts[:, None]) & (pos < args.prompt + responses[:, None])
    tokens = torch.where(real, torch.randint(3, vocab, (args.batch, length), generator=g), 0)
    return TensorDict(
        {"tokens": tokens, "attention_mask": real, "loss_mask": real & (pos >= args.prompt)},
        batch_size=[args.batch, length],
        device=args.device,
    )


def build_actor_critic(args: argparse.Namespace) -> LMActorCritic:
    config = Qwen3Config(
        **MODELS[args.model], tie_word_embeddings=True, max_position_embeddings=8192
    )
    dtype = getattr(torch, args.dtype)
    with torch.random.fork_rng(devices=[]), torch.device(args.device):
        torch.manual_seed(args.seed)
        model = Qwen3ForCausalLM(config).to(dtype)
    model.set_attn_implementation(args.attn)
    model = attach_value_head(model)
    torch.nn.init.normal_(model.value_head.weight, std=0.02)
    return LMActorCritic(model)


# ----------------------------------------------------------------------------- passes
def anchor_pass(ac: LMActorCritic, td: TensorDict, plan: MicroBatchPlan) -> None:
    recompute_old_log_probs_and_values(ac, td, plan)


def train_pass(ac: LMActorCritic, td: TensorDict, plan: MicroBatchPlan) -> None:
    for sub in plan.split(td):
        out = ac(ac.select_inputs(sub))
        (out["log_prob"].sum() + out["state_value"].sum()).backward()
    ac.model.zero_grad(set_to_none=True)


def check_equal(ac: LMActorCritic, td: TensorDict, padded, packed, atol: float | None) -> dict:
    """Max |packed - padded| of log_prob and state_value over tokens that have them."""
    a = recompute_old_log_probs_and_values(ac, td.clone(), padded)
    b = recompute_old_log_probs_and_values(ac, td.clone(), packed)
    mask = td["attention_mask"]
    has = mask & (mask.long().cumsum(-1) > 1)
    diffs = {
        "log_prob": float((a["sample_log_prob"] - b["sample_log_prob"])[has].abs().max()),
        "state_value": float((a["state_value"] - b["state_value"]).squeeze(-1)[has].abs().max()),
    }
    if atol is not None and max(diffs.values()) > atol:
        raise AssertionError(f"packed outputs differ from padded ones: {diffs} > {atol}")
    return diffs


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_round_robin(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, list[float]]:
    for fn in fns.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            _sync()
            start = time.perf_counter()
            fn()
            _sync()
            times[name].append(time.perf_counter() - start)
    return times


# ----------------------------------------------------------------------------- run
def plan_stats(plan: MicroBatchPlan, real: int, varlen: bool) -> dict:
    packed = plan.micro_batches[0].packed
    computed = real if packed and varlen else plan.num_tokens
    return {
        "micro_batches": len(plan),
        "computed_tokens": computed,
        "real_tokens": real,
        "padding_fraction": 1 - real / computed,
    }


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    ac = build_actor_critic(args)
    td = make_batch(args, MODELS[args.model]["vocab_size"])
    real = int(td["attention_mask"].sum())
    plans = {
        "padded": plan_micro_batches(td, args.token_budget, packing=False),
        "packed": plan_micro_batches(td, args.token_budget, packing=True),
    }
    auto = plan_micro_batches(td, args.token_budget, packing="auto")
    padding = 1 - real / plans["padded"].num_tokens
    saving = 1 - plans["packed"].num_tokens / plans["padded"].num_tokens
    expected = "packed" if padding >= AUTO_PACKING_MIN_PADDING else "padded"
    auto_choice = "packed" if auto.micro_batches[0].packed else "padded"
    assert auto_choice == expected, f"auto chose {auto_choice}, expected {expected}"
    atol = 1e-4 if args.dtype == "float32" else None
    diffs = check_equal(ac, td, plans["padded"], plans["packed"], atol)
    fns = {}
    for name, plan in plans.items():
        fns[f"anchor/{name}"] = lambda plan=plan: anchor_pass(ac, td, plan)
        fns[f"train/{name}"] = lambda plan=plan: train_pass(ac, td, plan)
    times = time_round_robin(fns, args.reps)
    rows = []
    for name, plan in plans.items():
        row = {"mode": name, **plan_stats(plan, real, is_varlen(args.attn))}
        for stage in ("anchor", "train"):
            seconds = statistics.median(times[f"{stage}/{name}"])
            row[f"{stage}_s"] = seconds
            row[f"{stage}_tokens_per_s"] = real / seconds
        rows.append(row)
    for stage in ("anchor", "train"):
        rows[1][f"{stage}_speedup"] = rows[0][f"{stage}_s"] / rows[1][f"{stage}_s"]
        rows[0][f"{stage}_speedup"] = 1.0
        paired = sorted(  # per round: padded and packed ran back to back, under the same load
            a / b for a, b in zip(times[f"{stage}/padded"], times[f"{stage}/packed"])
        )
        rows[1][f"{stage}_speedup_range"] = [paired[0], statistics.median(paired), paired[-1]]
        rows[0][f"{stage}_speedup_range"] = [1.0, 1.0, 1.0]
    return {
        "config": config_dict(args, td),
        "check_max_abs_diff": diffs,
        "auto": {
            "choice": auto_choice,
            "token_saving": saving,
            "padded_padding": padding,
            "min_padding": AUTO_PACKING_MIN_PADDING,
        },
        "results": rows,
    }


def config_dict(args: argparse.Namespace, td: TensorDict) -> dict:
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    lengths = td["loss_mask"].sum(-1).float()
    cfg.update(
        batch_length=td.shape[1],
        response_length={
            "mean": float(lengths.mean()),
            "median": float(lengths.median()),
            "max": int(lengths.max()),
            "min": int(lengths.min()),
        },
        transformers=transformers.__version__,
        **machine_info(),
    )
    return cfg


def print_table(result: dict) -> None:
    cfg, auto = result["config"], result["auto"]
    r = cfg["response_length"]
    print(
        f"\nPacking benchmark: model {cfg['model']} ({cfg['dtype']}, {cfg['attn']}) on "
        f"{cfg['gpu'] or 'cpu'}, B={cfg['batch']} rows, responses {cfg['dist']} "
        f"(median {r['median']:.0f}, mean {r['mean']:.0f}, max {r['max']}), "
        f"token budget {cfg['token_budget']}, load {cfg['load_avg_1m']:.1f}"
    )
    header = (
        f"{'mode':<7}| {'micro-batches':>13} | {'computed':>9} | {'padding %':>9} | "
        f"{'anchor tok/s':>12} | {'x [min, med, max]':>24} | {'train tok/s':>11} | "
        f"{'x [min, med, max]':>24}"
    )
    print(header)
    print("-" * len(header))
    for row in result["results"]:
        a, t = row["anchor_speedup_range"], row["train_speedup_range"]
        anchor = f"{row['anchor_speedup']:.2f} [{a[0]:.2f}, {a[1]:.2f}, {a[2]:.2f}]"
        train = f"{row['train_speedup']:.2f} [{t[0]:.2f}, {t[1]:.2f}, {t[2]:.2f}]"
        print(
            f"{row['mode']:<7}| {row['micro_batches']:>13} | {row['computed_tokens']:>9} | "
            f"{100 * row['padding_fraction']:>9.1f} | {row['anchor_tokens_per_s']:>12.0f} | "
            f"{anchor:>24} | {row['train_tokens_per_s']:>11.0f} | {train:>24}"
        )
    diffs = result["check_max_abs_diff"]
    print(
        f"packed vs padded max |diff|: log_prob {diffs['log_prob']:.2e}, state_value "
        f"{diffs['state_value']:.2e}; auto: {auto['choice']} (padded plan: "
        f"{100 * auto['padded_padding']:.1f} % padding, threshold {100 * auto['min_padding']:.0f} %; "
        f"packing saves {100 * auto['token_saving']:.1f} % of the backbone tokens)"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    print_table(result)
    write_json(result, args.out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
