"""Benchmark: sync vs one-step async vs bounded staleness with partial rollouts, samples per second.

What it measures (issue 21): the throughput of the rollout + update loop (samples trained per
second) in three modes of :class:`~ar_torchrl.collectors.WeightSyncCollector`, on each backend
(trainside ``TransformersBackend``; SGLang over HTTP with ``--launch`` or ``--url``):

* ``sync``: generate a batch, then train on it (``mode="sync"``);
* ``async``: the next batch is generated while the trainer updates (``mode="async"``,
  ``max_policy_lag=1``; a sync waits for the batch being generated);
* ``lag2_partial``: ``max_policy_lag=2`` (batches generated ahead under admission control) with
  partial rollouts (a sync interrupts the batch being generated; the rest of each response uses the
  new weights).

The setting has a **long-tailed response-length distribution**: a random tiny Qwen3 (h64, 2
layers) samples its EOS at random, so the lengths are roughly geometric, capped at
``--max-new-tokens`` (the table gives their median, 90th percentile and maximum). A batch is as
slow as its longest response, which is what partial rollouts address: the batch's short responses
are done early, and an update need not wait for the long ones. One update per batch: anchors over
the micro-batch plan, GAE, ``--epochs`` PPO epochs of ``TokenPPOLoss`` with the value head (AdamW),
then the weight sync; ``--update-repeats`` repeats the PPO epochs to make the update as long as a
generation (the interesting regime for overlap; the default makes them comparable on this CPU).
The learning rate is 0 by default (``--lr``): every step's compute is real (forward, backward,
AdamW, the sync of the weights), but the weights stay put, so every mode samples from the same
distribution of response lengths (with a moving policy the lengths drift differently per mode, and
a throughput ratio would compare different work).

The headline is the **ratio** of samples per second to ``sync``'s, measured in the same run: each
repetition runs every mode for ``--batches`` batches after one warm-up batch (the modes in rotated
order), and the ratio is the median over repetitions of the per-repetition ratio. Also reported:
the mean lag of the trained tokens and the number of interrupted generations. 1 torch thread in
this process (``--threads``); a launched server inherits ``OMP_NUM_THREADS``.

Run (from the repository root):
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_staleness.py --backends trainside
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_staleness.py --launch      # both backends
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_staleness.py --quick --backends trainside

Prints a table and writes ``benchmarks/results/bench_staleness[_quick].json`` (``--out``). The
learning curves of the three modes on the CPU default are ``benchmarks/experiments/critic_budget.py --task cpu
--variants staleness`` (same runner, same table).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import code_version, machine_info, write_json

from ar_torchrl.backends import SamplingParams, TransformersBackend
from ar_torchrl.collectors import WeightSyncCollector
from ar_torchrl.data import arithmetic_dataset
from ar_torchrl.envs import LLMEnv
from ar_torchrl.models import build_char_tokenizer, build_tiny_qwen3
from ar_torchrl.models.tiny import save_tiny_model
from ar_torchrl.modules import LMActorCritic, attach_value_head
from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
from ar_torchrl.training import plan_micro_batches, ppo_update, recompute_old_log_probs_and_values

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: mode -> (collector mode, max_policy_lag, partial rollouts)
MODES = {
    "sync": ("sync", 1, False),
    "async": ("async", 1, False),
    "lag2_partial": ("async", 2, True),
}
BACKENDS = ("trainside", "sglang")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--launch", action="store_true", help="launch a local SGLang server")
    p.add_argument("--url", default=None, help="a running SGLang server (the tiny model's shape)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--batches", type=int, default=6, help="measured batches per mode and rep")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--update-repeats", type=int, default=3, help="PPO epochs run this many times")
    p.add_argument("--lr", type=float, default=0.0, help="the update's learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="a smoke test: tiny sizes, 1 rep")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if "sglang" in args.backends and not (args.launch or args.url):
        raise SystemExit("bench_staleness: --backends sglang needs --launch or --url")
    if args.quick:
        args.prompts, args.samples, args.max_new_tokens = 2, 2, 24
        args.batches, args.reps, args.update_repeats = 2, 1, 1
    args.out = args.out or RESULTS / (
        "bench_staleness_quick.json" if args.quick else "bench_staleness.json"
    )
    return args


class Trainer:
    """The update side: one PPO update per batch on the trainer's model, then the sync."""

    def __init__(self, model, args) -> None:
        self.model, self.args = model, args
        self.actor_critic = LMActorCritic(model)
        self.loss = TokenPPOLoss(self.actor_critic, clip_value=0.2)
        self.gae = TokenGAE(gamma=1.0, lmbda=0.95, normalize_advantage=True)
        self.optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
        self.generator = torch.Generator().manual_seed(args.seed)

    def update(self, batch, collector) -> None:
        plan = plan_micro_batches(batch, token_budget=4096)
        recompute_old_log_probs_and_values(self.actor_critic, batch, plan)
        batch = self.gae(batch)
        for _ in range(self.args.update_repeats):
            ppo_update(
                self.loss,
                self.optim,
                batch,
                plan,
                epochs=self.args.epochs,
                generator=self.generator,
            )
        collector.update_policy_weights_()


def one_mode(name: str, backend, model, start: dict, tok, args, rep: int) -> dict:
    """From the ``start`` weights (trainer and engine): a warm-up batch, then ``args.batches``
    timed batches of mode ``name``."""
    from ar_torchrl.weight_sync import named_policy_tensors

    mode, lag, partial = MODES[name]
    model.load_state_dict(start)
    backend.sync_weights(named_policy_tensors(model), version=backend.policy_version + 1)
    backend.partial_rollouts = partial
    env = LLMEnv(
        arithmetic_dataset(4096, seed=args.seed + rep),
        tok,
        backend,
        num_samples=args.samples,
        prompts_per_batch=args.prompts,
        sampling=SamplingParams(max_new_tokens=args.max_new_tokens),
        seed=args.seed + rep,
    )
    collector = WeightSyncCollector(
        env, model, total_batches=args.batches + 1, mode=mode, max_policy_lag=lag
    )
    trainer, lengths, lags, began, before = Trainer(model, args), [], [], None, 0
    try:
        for i, batch in enumerate(collector):
            if i == 1:  # after the warm-up batch
                began, before = time.perf_counter(), backend.interruptions
            if i >= 1:
                lengths += batch["loss_mask"].sum(-1).tolist()
                lags += [lag for lag, n in collector.last_token_lags.items() for _ in range(n)]
            trainer.update(batch, collector)
        wall = time.perf_counter() - began
    finally:
        collector.shutdown()
        backend.partial_rollouts = False
    samples = args.batches * args.prompts * args.samples
    return {
        "wall_s": wall,
        "samples_per_s": samples / wall,
        "lengths": lengths,
        "mean_token_lag": statistics.fmean(lags) if lags else 0.0,
        "interruptions": backend.interruptions - before,
    }


@contextlib.contextmanager
def engines(args, model, tok):
    """``name -> backend`` (a launched server is stopped on exit, also on an error)."""
    with contextlib.ExitStack() as stack:
        out = {}
        if "trainside" in args.backends:
            out["trainside"] = TransformersBackend(model, mode="copy", seed=args.seed)
        if "sglang" in args.backends:
            from ar_torchrl.backends import SGLangBackend, SGLangClientOptions, launch_sglang_server
            from ar_torchrl.weight_sync import named_policy_tensors

            url = args.url
            if url is None:
                tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-st-")))
                model_dir = save_tiny_model(tmp / "model", seed=args.seed)
                server = stack.enter_context(
                    launch_sglang_server(
                        model_dir,
                        log_file=tmp / "server.log",
                        timeout_s=600,
                        extra_args=("--max-total-tokens", "16384"),
                    )
                )
                url = server.url
            backend = stack.enter_context(
                SGLangBackend(
                    url,
                    options=SGLangClientOptions(
                        max_concurrency=args.prompts * args.samples,
                        timeout_s=900,
                        vocab_size=len(tok),
                        show_progress=False,
                    ),
                )
            )
            backend.sync_weights(named_policy_tensors(model), version=1)  # the trainer's weights
            out["sglang"] = backend
        yield out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    tok = build_char_tokenizer()
    results: dict[str, dict[str, list[dict]]] = {}
    model = attach_value_head(build_tiny_qwen3(len(tok), seed=args.seed))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with engines(args, model, tok) as backends:
        for name, backend in backends.items():
            order = list(MODES)
            for rep in range(args.reps):
                for mode in order[rep % len(order) :] + order[: rep % len(order)]:
                    out = one_mode(mode, backend, model, start, tok, args, rep)
                    results.setdefault(name, {}).setdefault(mode, []).append(out)
                    print(
                        f"{name} {mode} rep {rep}: {out['samples_per_s']:.2f} samples/s",
                        file=sys.stderr,
                    )
    return summarize(results, args)


def summarize(results: dict, args) -> dict:
    """Per backend and mode: samples/s (median over reps), its ratio to sync's (median of the
    per-rep ratios), the response lengths, the mean token lag and the interruptions."""
    table = {}
    for backend, modes in results.items():
        rows = {}
        for mode, reps in modes.items():
            ratios = [r["samples_per_s"] / s["samples_per_s"] for r, s in zip(reps, modes["sync"])]
            lengths = [n for r in reps for n in r["lengths"]]
            rows[mode] = {
                "samples_per_s": statistics.median(r["samples_per_s"] for r in reps),
                "ratio_to_sync": statistics.median(ratios),
                "ratios": ratios,
                "length_p50": percentile(lengths, 0.5),
                "length_p90": percentile(lengths, 0.9),
                "length_max": max(lengths) if lengths else 0,
                "mean_token_lag": statistics.fmean(r["mean_token_lag"] for r in reps),
                "interruptions": sum(r["interruptions"] for r in reps),
            }
        table[backend] = rows
    return {
        "machine": machine_info(),
        "code": code_version(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "modes": {k: list(v) for k, v in MODES.items()},
        "results": table,
    }


def report(result: dict) -> str:
    lines = [
        "| backend | mode | samples/s | ratio to sync | response length p50 / p90 / max | "
        "mean token lag | interruptions |",
        "|---|---|---|---|---|---|---|",
    ]
    for backend, rows in result["results"].items():
        for mode, r in rows.items():
            lines.append(
                f"| {backend} | {mode} | {r['samples_per_s']:.2f} | {r['ratio_to_sync']:.2f}x | "
                f"{r['length_p50']:.0f} / {r['length_p90']:.0f} / {r['length_max']:.0f} | "
                f"{r['mean_token_lag']:.2f} | {r['interruptions']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    write_json(result, args.out)
    print(report(result))
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
