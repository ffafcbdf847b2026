"""Benchmark: ``ar_torchrl.functional.token_gae`` vs TorchRL's loop and vectorized GAE.

What it reproduces (issues 2 and 10): the time of token-level GAE on one PPO batch of B=256 rows of
L=4096 tokens, for lambda 0.95 and 1.0 (gamma 1), against TorchRL 0.14.1's two functional GAE paths
on the same data, with ``torch.set_num_threads(1)`` and with all the machine's cores (``--device
cpu``) or on a GPU (``--device cuda``: one host thread, every call synchronised); and how far each
path is from a memory-bandwidth bound measured in the same run on the same device.

Data (seeded): each row is a left-padded prompt (length uniform in ``[P/8, P]``, P=512) followed by a
right-padded response of length uniform in ``[1, L - P]``, the docs/design.md token-trajectory layout.
``loss_mask`` is True on response tokens; ``value`` is uniform in ``[-1, 1]`` on real tokens, 0 on
padding; the reward is +-1 on the last response token, 0 elsewhere.

What each path computes (all with gamma=1, all responses terminated, no bootstrap):

* ``token_gae``: ``token_gae(reward, value, loss_mask, gamma, lmbda)`` on the full ``[B, L]``
  rows: GAE over the trained tokens, skipping masked ones, advantage and value_target 0 elsewhere.
  The timed call includes its input checks (a non-zero reward on a masked token is an error).
* ``torchrl_loop``: ``generalized_advantage_estimate`` (a Python loop over time, vectorized over B).
* ``torchrl_vec``: ``vec_generalized_advantage_estimate`` (scalar gamma/lambda dispatch to
  ``_fast_vec_gae``: split rows at ``done`` into trajectories, pad, conv1d with the geometric
  filter ``(gamma*lambda)**k`` truncated below 1e-7, so O(B * T * min(T, log(1e-7)/log(gamma*lambda)))).

TorchRL gets its best-case input, prepared outside the timed region: the time axis is the response
segment only (columns ``P:L``, a view: the prompt is left-padded to P so every response starts at
column P), shape ``[B, L - P, 1]``; ``next_state_value`` is the value shifted by one step;
``done = terminated = True`` on the last response token only (the right padding after it becomes a
separate trajectory that TorchRL also computes, since TorchRL has no mask). Running TorchRL on the
whole row instead costs more steps; marking every padding token ``done`` makes the vectorized path
O(B * L^2) (docs/design.md section 8), so neither is used. On trained tokens all paths compute the same
numbers: the script asserts |difference| <= 1e-4 for advantage and value_target before timing.

Bandwidth bound: the bytes token_gae must move at least once (reward, value float32 + mask bool
read, advantage and value_target float32 written: 17 bytes per token) divided by the copy bandwidth
measured in the same run with ``Tensor.copy_`` of a buffer much larger than the caches (read + write
counted), at the same thread count, on the same device. On a GPU a call of a few kernels is bound
by kernel launches and host syncs rather than bandwidth, so the bound is a yardstick only there. The 17.8 MB working set can partly stay in a large last-level
cache, so a fused kernel could beat this DRAM-copy figure; it is the yardstick the issue asks for.

Run:
    .venv/bin/python benchmarks/bench_gae.py            # full size, ~1 min on 2 cores
    .venv/bin/python benchmarks/bench_gae.py --quick    # small sizes, seconds (-> bench_gae_quick.json)
    .venv/bin/python benchmarks/bench_gae.py --device cuda   # on a GPU (-> bench_gae_cuda.json)

Timing: every path is called once to warm up, then the paths of one (lambda, threads) group are
timed round-robin, so a change of load on the shared machine hits them alike; ``ms`` is the median
of up to ``--reps`` calls (fewer for a path whose calls would exceed ``--budget-s``: TorchRL's
vectorized path at lambda=1 takes seconds), ``min_ms`` the fastest call, ``cpu_ms`` the median
process CPU time of a call (all threads summed; at 1 thread it is the least load-sensitive number
on a shared machine, as waiting for a core does not count). The 1-minute load average
before and after is recorded (on a busy machine the ratios are more meaningful than the times), and
so are ``git describe --dirty`` and a hash of the file defining ``token_gae`` (which version ran).
With all cores on a machine that other jobs keep busy, OpenMP threads wait for each other and every
path slows down erratically; compare the 1-thread rows there.

Prints a table (path | lambda | threads | ms | speed-up vs TorchRL fastest | x of bandwidth bound |
cpu ms)
and writes ``benchmarks/results/bench_gae[_quick][_cuda].json`` (``--out`` to change). Targets: on
CPU >= 5x TorchRL's fastest path and <= 10x the bandwidth bound (issue 2); on every device not
slower than TorchRL's fastest path (issue 10, ``not_slower_met``).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torchrl
from _common import write_json
from torch import Tensor
from torchrl.objectives.value.functional import (
    generalized_advantage_estimate,
    vec_generalized_advantage_estimate,
)

from ar_torchrl.functional import token_gae

GAMMA = 1.0
LAMBDAS = (0.95, 1.0)
CHECK_ATOL = 1e-4
BYTES_PER_TOKEN = 4 + 4 + 1 + 4 + 4  # reward, value, mask in; advantage, value_target out
TARGET_SPEEDUP = {"cpu": 5.0, "cuda": 1.0}  # issue 2 (CPU); issue 10: not slower, every device
TARGET_X_BOUND = {"cpu": 10.0, "cuda": None}  # on a GPU launches and syncs bound a call, not bytes
TORCHRL_PATHS = ("torchrl_loop", "torchrl_vec")
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="B=16, L=512, P=64, 3 repetitions")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument(
        "--batches",
        type=str,
        default=None,
        help="a sweep over B, comma-separated (default --batch)",
    )
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--prompt", type=int, default=512, help="left-padded prompt width P")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions (after one warm-up)")
    p.add_argument("--budget-s", type=float, default=4.0, help="max timed seconds per path")
    p.add_argument(
        "--vec-max-gb",
        type=float,
        default=4.0,
        help="skip TorchRL's vectorized path where its [B, T, filter] buffer exceeds this",
    )
    p.add_argument("--threads", type=str, default=f"1,{cores}", help="comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", type=Path, default=None, help="default results/bench_gae[_quick].json")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.length, args.prompt, args.reps = 16, 512, 64, 3
    if args.out is None:
        suffix = ("_quick" if args.quick else "") + ("_cuda" if args.device == "cuda" else "")
        args.out = RESULTS / f"bench_gae{suffix}.json"
    if not 0 < args.prompt < args.length:
        p.error(f"--prompt must be in (0, --length={args.length}), got {args.prompt}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False on this machine")
    args.threads = sorted({int(t) for t in args.threads.split(",")})
    args.batches = [int(b) for b in args.batches.split(",")] if args.batches else [args.batch]
    if args.device == "cuda":  # host threads do not matter to GPU kernels: one group
        args.threads = [1]
    return args


# ----------------------------------------------------------------------------- data
def make_batch(batch: int, length: int, prompt: int, seed: int) -> dict[str, Tensor]:
    """Seeded token-trajectory batch: ``reward``, ``value``, ``loss_mask`` ``[B, L]``."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(max(1, prompt // 8), prompt + 1, (batch,), generator=g)
    response_len = torch.randint(1, length - prompt + 1, (batch,), generator=g)
    pos = torch.arange(length)
    end = prompt + response_len  # exclusive
    loss_mask = (pos >= prompt) & (pos < end[:, None])
    real = (pos >= prompt - prompt_len[:, None]) & (pos < end[:, None])
    value = torch.where(real, torch.rand(batch, length, generator=g) * 2 - 1, 0.0)
    reward = torch.zeros(batch, length)
    sign = torch.where(torch.rand(batch, generator=g) < 0.5, 1.0, -1.0)
    reward[torch.arange(batch), end - 1] = sign
    return {"reward": reward, "value": value, "loss_mask": loss_mask, "response_len": response_len}


def torchrl_inputs(data: dict[str, Tensor], prompt: int) -> dict[str, Tensor]:
    """TorchRL's best-case input: the response segment ``[B, L - P, 1]``, done at its last token."""
    reward = data["reward"][:, prompt:].unsqueeze(-1)
    value = data["value"][:, prompt:].unsqueeze(-1)
    next_value = torch.cat([value[:, 1:], torch.zeros_like(value[:, :1])], dim=1)
    done = torch.zeros_like(reward, dtype=torch.bool)
    done[torch.arange(done.shape[0], device=done.device), data["response_len"] - 1] = True
    return {
        "state_value": value,
        "next_state_value": next_value,
        "reward": reward,
        "done": done,
        "terminated": done.clone(),
    }


def make_paths(
    data: dict[str, Tensor], trl: dict[str, Tensor], lmbda: float, vec: bool = True
) -> dict[str, Callable[[], tuple[Tensor, Tensor]]]:
    """Zero-argument callables returning ``(advantage, value_target)`` in each path's layout
    (``vec=False``: without TorchRL's vectorized path)."""
    r, v, m = data["reward"], data["value"], data["loss_mask"]
    paths = {
        "token_gae": lambda: token_gae(r, v, m, gamma=GAMMA, lmbda=lmbda),
        "torchrl_loop": lambda: generalized_advantage_estimate(GAMMA, lmbda, **trl),
        "torchrl_vec": lambda: vec_generalized_advantage_estimate(GAMMA, lmbda, **trl),
    }
    if not vec:
        del paths["torchrl_vec"]
    return paths


def vec_gae_bytes(batch: int, steps: int, lmbda: float) -> int:
    """About the float32 bytes TorchRL's vectorized GAE holds: ``[B, T, filter]`` with the filter
    ``(gamma*lambda)**k`` truncated below 1e-7 (``T`` long at gamma*lambda = 1)."""
    decay = GAMMA * lmbda
    taps = steps if decay >= 1.0 else min(steps, math.ceil(math.log(1e-7) / math.log(decay)))
    return 4 * batch * steps * taps


# ----------------------------------------------------------------------------- check
def check_equal(data: dict[str, Tensor], paths: dict, prompt: int) -> dict[str, float]:
    """Assert every TorchRL path equals token_gae on trained tokens; return the max |diffs|."""
    adv, ret = paths["token_gae"]()
    mask = data["loss_mask"]
    outside = torch.cat([adv[~mask], ret[~mask]]).abs().max() if (~mask).any() else 0.0
    assert float(outside) == 0.0, f"token_gae wrote {float(outside)} on a masked token"
    seg_mask = mask[:, prompt:]
    errors = {}
    for name in (n for n in TORCHRL_PATHS if n in paths):
        t_adv, t_ret = (x.squeeze(-1) for x in paths[name]())
        err = max(
            float((t_adv - adv[:, prompt:])[seg_mask].abs().max()),
            float((t_ret - ret[:, prompt:])[seg_mask].abs().max()),
        )
        assert err <= CHECK_ATOL, f"{name} differs from token_gae by {err:.3g} > {CHECK_ATOL}"
        errors[name] = err
    return errors


# ----------------------------------------------------------------------------- timing
def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _call_s(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and process CPU seconds of one call (GPU work finished before and after)."""
    _sync()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    _sync()
    return time.perf_counter() - wall, time.process_time() - cpu


def time_paths(paths: dict, reps: int, budget_s: float) -> dict[str, dict]:
    """Warm up each path once, then time them round-robin (so a load change on the shared machine
    hits every path alike); each path gets up to ``reps`` calls within ``budget_s``.

    Returns ``{name: {"ms": median wall, "min_ms": min wall, "cpu_ms": median CPU, "reps": n,
    "wall_ms": every call's wall ms, in round order}}``.
    """
    n = {
        name: max(1, min(reps, int(budget_s / max(_call_s(fn)[0], 1e-9))))
        for name, fn in paths.items()
    }
    wall: dict[str, list[float]] = {name: [] for name in paths}
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(max(n.values())):
        for name, fn in paths.items():
            if i < n[name]:
                w, c = _call_s(fn)
                wall[name].append(w * 1e3)
                cpu[name].append(c * 1e3)
    return {
        name: {
            "ms": statistics.median(wall[name]),
            "min_ms": min(wall[name]),
            "cpu_ms": statistics.median(cpu[name]),
            "reps": len(wall[name]),
            "wall_ms": wall[name],
        }
        for name in paths
    }


def copy_bandwidth_gbs(n_bytes: int, device: str, reps: int = 5) -> float:
    """Copy bandwidth in GB/s (bytes read + bytes written per second) of ``dst.copy_(src)``."""
    src = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = time_paths({"copy": lambda: dst.copy_(src)}, reps, budget_s=10.0)["copy"]["ms"]
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def run(args: argparse.Namespace) -> dict:
    rows, bandwidth, check_errors, skipped = [], {}, {}, []
    copy_bytes = (64 if args.quick else 256) * 2**20 * (8 if args.device == "cuda" else 1)
    load_before = os.getloadavg()[0]
    for threads in args.threads:
        torch.set_num_threads(threads)
        bw = copy_bandwidth_gbs(copy_bytes, args.device)
        bandwidth[str(threads)] = {"copy_gbs": bw}
        for batch in args.batches:
            data = make_batch(batch, args.length, args.prompt, args.seed)
            data = {k: v.to(args.device) for k, v in data.items()}
            trl = torchrl_inputs(data, args.prompt)
            bound_ms = batch * args.length * BYTES_PER_TOKEN / (bw * 1e9) * 1e3
            for lmbda in LAMBDAS:
                vec = (
                    vec_gae_bytes(batch, args.length - args.prompt, lmbda) <= args.vec_max_gb * 1e9
                )
                if not vec:
                    skipped.append({"path": "torchrl_vec", "batch": batch, "lmbda": lmbda})
                paths = make_paths(data, trl, lmbda, vec=vec)
                check_errors[f"B={batch} lambda={lmbda}"] = check_equal(data, paths, args.prompt)
                for name, t in time_paths(paths, args.reps, args.budget_s).items():
                    rows.append(
                        {
                            "path": name,
                            "batch": batch,
                            "lmbda": lmbda,
                            "threads": threads,
                            **t,
                            "bound_ms": bound_ms,
                            "x_bandwidth_bound": t["ms"] / bound_ms,
                        }
                    )
                print(
                    f"  threads={threads} B={batch} lambda={lmbda} done",
                    file=sys.stderr,
                    flush=True,
                )
    add_speedups(rows)
    cfg = config_dict(args, args.batches[0] * args.length * BYTES_PER_TOKEN, copy_bytes)
    cfg["load_avg_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
    return {
        "config": cfg,
        "bandwidth": bandwidth,
        "check_max_abs_diff": check_errors,
        "results": rows,
        "skipped": skipped,  # over --vec-max-gb: the speed-up is vs TorchRL's loop there
        "targets": targets(rows, args.device),
    }


def add_speedups(rows: list[dict]) -> None:
    """``speedup_vs_torchrl_fastest`` = fastest TorchRL ms / this ms (medians), per (B, lambda,
    threads); ``speedup_range``: [min, median, max] of the per-round ratios (the i-th call of the
    fastest TorchRL path over the i-th call of this path: the same load on both)."""
    for row in rows:
        same = [r for r in rows if r["path"] in TORCHRL_PATHS and _group(r) == _group(row)]
        fastest = min(same, key=lambda r: r["ms"])
        row["speedup_vs_torchrl_fastest"] = fastest["ms"] / row["ms"]
        paired = sorted(a / b for a, b in zip(fastest["wall_ms"], row["wall_ms"]))
        row["speedup_range"] = [paired[0], statistics.median(paired), paired[-1]]
        row["torchrl_fastest"] = fastest["path"]


def _group(row: dict) -> tuple[int, float, int]:
    return row["batch"], row["lmbda"], row["threads"]


def targets(rows: list[dict], device: str = "cpu") -> dict:
    ours = [r for r in rows if r["path"] == "token_gae"]
    speedup = min(r["speedup_vs_torchrl_fastest"] for r in ours)
    x_bound = max(r["x_bandwidth_bound"] for r in ours)
    bound_target = TARGET_X_BOUND[device]
    return {
        "speedup_target": TARGET_SPEEDUP[device],
        "x_bound_target": bound_target,
        "worst_speedup": speedup,
        "worst_x_bound": x_bound,
        "speedup_met": speedup >= TARGET_SPEEDUP[device],
        "x_bound_met": None if bound_target is None else x_bound <= bound_target,
        "not_slower_met": speedup >= 1.0,
    }


def config_dict(args: argparse.Namespace, gae_bytes: int, copy_bytes: int) -> dict:
    return {
        "batch": args.batch,
        "batches": args.batches,
        "length": args.length,
        "prompt": args.prompt,
        "torchrl_time_steps": args.length - args.prompt,
        "gamma": GAMMA,
        "lambdas": list(LAMBDAS),
        "threads": args.threads,
        "reps": args.reps,
        "seed": args.seed,
        "quick": args.quick,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "gae_bytes": gae_bytes,
        "copy_buffer_bytes": copy_bytes,
        "torch": torch.__version__,
        "torchrl": torchrl.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "git": _git_describe(),
        "token_gae_file_sha256": hashlib.sha256(
            Path(inspect.getsourcefile(token_gae)).read_bytes()
        ).hexdigest()[:16],
    }


def _git_describe() -> str | None:
    """``git describe --always --dirty`` of the checkout (token_gae may be edited in the tree)."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def print_table(result: dict) -> None:
    cfg = result["config"]
    load = cfg["load_avg_1m"]
    print(
        f"\nGAE benchmark: B={cfg['batches']} L={cfg['length']} (TorchRL on the response "
        f"segment, T={cfg['torchrl_time_steps']}), gamma={cfg['gamma']}, 1-min load average "
        f"{load['before']:.1f} -> {load['after']:.1f} on {cfg['cpu_count']} cores, device "
        f"{cfg['gpu'] or 'cpu'}"
    )
    for threads, bw in result["bandwidth"].items():
        print(f"  threads={threads}: copy bandwidth {bw['copy_gbs']:.1f} GB/s")
    header = f"{'path':<14}| {'B':>5} | {'lambda':>6} | {'threads':>7} | {'ms':>9} | "
    header += (
        f"{'speed-up vs TorchRL fastest [min, med, max]':>44} | {'x bound':>7} | {'cpu ms':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in result["results"]:
        lo, med, hi = r["speedup_range"]
        speedup = f"{r['speedup_vs_torchrl_fastest']:.2f} [{lo:.2f}, {med:.2f}, {hi:.2f}]"
        print(
            f"{r['path']:<14}| {r['batch']:>5} | {r['lmbda']:>6} | {r['threads']:>7} | "
            f"{r['ms']:>9.2f} | {speedup:>44} | {r['x_bandwidth_bound']:>7.1f} | "
            f"{r['cpu_ms']:>9.2f}"
        )
    t = result["targets"]
    bound = "no target" if t["x_bound_met"] is None else "met" if t["x_bound_met"] else "MISSED"
    print(
        f"token_gae worst speed-up {t['worst_speedup']:.2f}x (target >= {t['speedup_target']}x: "
        f"{'met' if t['speedup_met'] else 'MISSED'}; not slower: "
        f"{'met' if t['not_slower_met'] else 'MISSED'}), worst {t['worst_x_bound']:.1f}x of the "
        f"bandwidth bound (target <= {t['x_bound_target']}x: {bound})"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    print_table(result)
    write_json(result, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
