"""Benchmark: shared-prefix micro-batches vs padded ones, for the old-log-prob pass and the update.

What it measures (issue 31, item 1): with ``n`` samples per prompt every prompt is forwarded ``n``
times by the old-log-prob/value pass and by every training pass, although the ``n`` rows share it
token for token. A shared-prefix plan (``plan_micro_batches(..., shared_prefix=True)``) keeps the
rows of a prompt in one micro-batch and computes the prompt once per group
(:mod:`ar_torchrl.modules.shared_prefix`). For each ``n`` in ``--ns`` (default 1, 4, 8), one batch
of ``--prompts`` prompts x ``n`` samples is planned four ways with the same token budget and timed
side by side: ``padded`` (the baseline), ``shared`` (padded shared micro-batches: the prompts'
KV cache, then the responses, two backbone calls), ``packed`` (padding-free, no sharing) and
``tree`` (packed shared micro-batches, ``packing=True, shared_prefix=True``: each prompt once
followed by its responses, one call with a 4D mask). Per path:

* ``anchor``: :func:`~ar_torchrl.training.recompute_old_log_probs_and_values` over the plan (no
  grad: old log-probs and values);
* ``train``: one training pass, the forward and backward of every micro-batch
  (``(log_prob + state_value) * loss_mask``, summed; the recipe's update runs this per epoch);
* ``total``: anchor + train of the same round.

Reported per ``n`` and path: tokens the forwards compute (``rows x width`` padded, ``groups x prompt
+ rows x rest`` shared, ``bins x bin width`` packed and tree), seconds (median [min, max] of
``--reps`` rounds, default 7, the paths interleaved in every round), and the speed-up padded / path as the median [min, max] of the
per-round ratios; CPU seconds beside the wall ones (1 thread: the load-insensitive figure). Before
timing, the script checks that every plan gives the padded plan's log-probs and values (1e-5,
float32) on every position with a real previous token.

Data: the CPU default (``--model tiny``: the recipe's tiny Qwen3, hidden 64, 2 layers, the char
tokenizer, the arithmetic prompts chat-templated as the recipe does (86 tokens), 16 prompts,
responses uniform in 1-``--max-new`` tokens (default 12: ``rollout.max_new_tokens``), token budget
2048, as ``configs/dapo_ppo.yaml``) or ``--model smollm2`` (a random init of
the SmolLM2-135M shape, vocabulary 49,152, hidden 576, ``--layers`` of its 30 (default 30), random
prompts of 150-250 tokens, responses 1-32 tokens, 2 prompts, token budget 8192).

Run:
    .venv/bin/python benchmarks/bench_shared_prefix.py                    # CPU default, ~3 min
    .venv/bin/python benchmarks/bench_shared_prefix.py --model smollm2 --layers 4
    .venv/bin/python benchmarks/bench_shared_prefix.py --quick            # seconds

Prints a table and writes ``benchmarks/results/bench_shared_prefix[_<model>][_quick].json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from _common import code_version, machine_info, write_json
from tensordict import TensorDict
from transformers import LlamaConfig, LlamaForCausalLM

from ar_torchrl.data import arithmetic_dataset
from ar_torchrl.models.tiny import build_char_tokenizer, build_tiny_qwen3
from ar_torchrl.modules import LMActorCritic, attach_value_head
from ar_torchrl.training import plan_micro_batches, recompute_old_log_probs_and_values

RESULTS = Path(__file__).resolve().parent / "results"
PATHS = ("padded", "shared", "packed", "tree")
STAGES = ("anchor", "train", "total")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--layers", type=int, default=30, help="smollm2: decoder layers (of 30)")
    p.add_argument("--ns", default="1,4,8", help="samples per prompt, comma-separated")
    p.add_argument("--prompts", type=int, default=None, help="default 16 (tiny), 2 (smollm2)")
    p.add_argument("--token-budget", type=int, default=None, help="default 2048 / 8192")
    p.add_argument(
        "--max-new", type=int, default=None, help="responses uniform in 1..N (default 12 / 32)"
    )
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="n = 1, 4; 4 prompts; 1 round")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.ns = [int(n) for n in args.ns.split(",")]
    tiny = args.model == "tiny"
    args.prompts = args.prompts or (16 if tiny else 2)
    args.token_budget = args.token_budget or (2048 if tiny else 8192)
    args.max_new = args.max_new or (12 if tiny else 32)
    if args.quick:
        args.ns, args.prompts, args.reps = [1, 4], 4, 1
    if min(args.ns) < 1 or args.reps < 1 or args.max_new < 1:
        p.error(
            f"--ns, --reps and --max-new must be >= 1, got {args.ns}, {args.reps}, {args.max_new}"
        )
    suffix = ("" if tiny else f"_{args.model}") + ("_quick" if args.quick else "")
    suffix += "" if args.max_new == (12 if tiny else 32) else f"_new{args.max_new}"
    args.out = args.out or RESULTS / f"bench_shared_prefix{suffix}.json"
    return args


# ----------------------------------------------------------------------------- model, batch
def build_model(args) -> tuple[LMActorCritic, int]:
    """The actor-critic (a value head that is not zero) and its vocabulary size."""
    if args.model == "tiny":
        model = build_tiny_qwen3(len(build_char_tokenizer()), seed=args.seed)
    else:
        torch.manual_seed(args.seed)
        config = LlamaConfig(
            vocab_size=49_152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=args.layers,
            num_attention_heads=9,
            num_key_value_heads=3,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
        )
        model = LlamaForCausalLM(config)
    ac = LMActorCritic(attach_value_head(model.float()))
    with torch.no_grad():
        ac.model.value_head.weight.normal_(0, 0.1)
    return ac, ac.model.config.vocab_size


def prompt_ids(args, vocab: int, g: torch.Generator) -> list[list[int]]:
    if args.model == "tiny":  # the CPU default's own prompts
        tok = build_char_tokenizer()
        rows = arithmetic_dataset(args.prompts, seed=args.seed)
        texts = [
            tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
            for r in rows
        ]
        return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    lengths = torch.randint(150, 251, (args.prompts,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def make_batch(args, n: int, vocab: int) -> TensorDict:
    """``prompts x n`` rows, prompt-major: left-padded prompts, right-padded responses."""
    g = torch.Generator().manual_seed(args.seed)
    prompts = prompt_ids(args, vocab, g)
    max_new = args.max_new
    width = max(len(p) for p in prompts)
    rows = len(prompts) * n
    responses = torch.randint(1, max_new + 1, (rows,), generator=g).tolist()
    tokens = torch.zeros(rows, width + max_new, dtype=torch.long)
    attention = torch.zeros(rows, width + max_new, dtype=torch.bool)
    loss_mask = torch.zeros_like(attention)
    for b, r in enumerate(responses):
        p = prompts[b // n]
        tokens[b, width - len(p) : width] = torch.tensor(p)
        tokens[b, width : width + r] = torch.randint(3, vocab, (r,), generator=g)
        attention[b, width - len(p) : width + r] = True
        loss_mask[b, width : width + r] = True
    return TensorDict(
        {"tokens": tokens, "attention_mask": attention, "loss_mask": loss_mask},
        [rows, width + max_new],
    )


# ----------------------------------------------------------------------------- passes
def anchor_pass(ac, td, plan) -> None:
    recompute_old_log_probs_and_values(ac, td, plan)


def train_pass(ac, td, plan) -> None:
    ac.zero_grad(set_to_none=True)
    for sub in plan.split(td):
        out = ac(ac.select_inputs(sub))
        loss = (out["log_prob"] + out["state_value"].squeeze(-1)) * sub["loss_mask"]
        loss.sum().backward()


def check_equal(ac, td, plans) -> float:
    """Max |diff| of every plan's old log-probs and values vs the padded plan's."""
    outs = {name: anchor_pass(ac, x := td.clone(), plan) or x for name, plan in plans.items()}
    mask = td["attention_mask"]
    defined = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, 1:] & mask[:, :-1]], dim=1)
    diff = 0.0
    for key in ("sample_log_prob", "state_value"):
        base = outs["padded"][key].reshape(mask.shape)
        for path in PATHS[1:]:
            other = outs[path][key].reshape(mask.shape)
            diff = max(diff, float((other - base)[defined].abs().max()))
    if diff > 1e-5:
        raise AssertionError(f"a plan differs from the padded one by {diff:.3g}")
    return diff


def time_round(ac, td, plans) -> dict[str, dict[str, tuple[float, float]]]:
    """One round: every path's anchor and train pass, interleaved; (wall, CPU) seconds."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for name, plan in plans.items():
        times = {}
        for stage, fn in (("anchor", anchor_pass), ("train", train_pass)):
            wall, cpu = time.perf_counter(), time.process_time()
            fn(ac, td, plan)
            times[stage] = (time.perf_counter() - wall, time.process_time() - cpu)
        times["total"] = tuple(a + b for a, b in zip(times["anchor"], times["train"]))
        out[name] = times
    return out


def bench_n(args, ac, vocab: int, n: int) -> dict:
    td = make_batch(args, n, vocab)
    budget = args.token_budget
    plans = {
        "padded": plan_micro_batches(td, budget),
        "shared": plan_micro_batches(td, budget, shared_prefix=True),
        "packed": plan_micro_batches(td, budget, packing=True),
        "tree": plan_micro_batches(td, budget, packing=True, shared_prefix=True),
    }
    diff = check_equal(ac, td, plans)
    time_round(ac, td, plans)  # warm-up
    rounds = []
    for rep in range(args.reps):  # the order of the paths alternates between rounds
        order = dict(reversed(plans.items())) if rep % 2 else plans
        rounds.append(time_round(ac, td, order))
    rows = {}
    for name in PATHS:
        row = {"micro_batches": len(plans[name]), "computed_tokens": plans[name].num_tokens}
        for stage in STAGES:
            for which, i in (("s", 0), ("cpu_s", 1)):
                values = [r[name][stage][i] for r in rounds]
                row[f"{stage}_{which}"] = statistics.median(values)
                row[f"{stage}_{which}_range"] = [min(values), max(values)]
                ratios = sorted(r["padded"][stage][i] / r[name][stage][i] for r in rounds)
                row[f"{stage}_{which}_speedup"] = [ratios[0], statistics.median(ratios), ratios[-1]]
        rows[name] = row
    lengths = td["attention_mask"].sum(-1).float()
    responses = td["loss_mask"].sum(-1).float()
    return {
        "n": n,
        "rows": td.shape[0],
        "width": td.shape[1],
        "prompt_tokens_mean": float((lengths - responses).mean()),
        "response_tokens_mean": float(responses.mean()),
        "max_abs_diff": diff,
        **rows,
    }


def report(results: list[dict], args, load: list[float]) -> str:
    prompt = [r["prompt_tokens_mean"] for r in results]
    response = [r["response_tokens_mean"] for r in results]
    lines = [
        f"model {args.model}, {args.prompts} prompts x n, prompts {min(prompt):.0f}-"
        f"{max(prompt):.0f} tokens (mean per n), responses 1-{args.max_new} (mean per n "
        f"{min(response):.1f}-{max(response):.1f}), token "
        f"budget {args.token_budget}, {args.reps} rounds (seconds: median; speed-up = padded / "
        f"path per round, median [min, max]), load average {load[0]:.1f} -> {load[1]:.1f}",
        f"  {'n':>2} {'path':<7} {'tokens':>7} {'anchor s':>9} {'train s':>9} {'total s':>9} "
        f"{'x anchor':>20} {'x train':>20} {'x total':>20} {'x total (CPU)':>20}",
    ]
    for r in results:
        for name in PATHS:
            row = r[name]

            def x(stage, which="s", row=row):
                lo, med, hi = row[f"{stage}_{which}_speedup"]
                return f"{med:.2f} [{lo:.2f}, {hi:.2f}]"

            lines.append(
                f"  {r['n']:>2} {name:<7} {row['computed_tokens']:>7} {row['anchor_s']:>9.3f} "
                f"{row['train_s']:>9.3f} {row['total_s']:>9.3f} {x('anchor'):>20} "
                f"{x('train'):>20} {x('total'):>20} {x('total', 'cpu_s'):>20}"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    ac, vocab = build_model(args)
    results = [bench_n(args, ac, vocab, n) for n in args.ns]
    load = [load_before, os.getloadavg()[0]]
    sys.stdout.write(report(results, args, load))
    meta = dict(
        model=args.model,
        layers=args.layers if args.model == "smollm2" else 2,
        ns=args.ns,
        prompts=args.prompts,
        token_budget=args.token_budget,
        max_new=args.max_new,
        reps=args.reps,
        threads=args.threads,
        quick=args.quick,
        load_average=load,
        **code_version(),
        **machine_info(),
    )
    write_json({"config": meta, "results": results}, args.out)
    sys.stdout.write(f"wrote {args.out}\n")


if __name__ == "__main__":
    main()
