"""Benchmark: peak memory of per-token log-probs, memory-budgeted chunks vs a naive ``log_softmax``.

What it measures (issue 10, item 2): the extra memory one log-prob pass over ``B x L`` positions
takes on top of its inputs, with the real vocabulary (V=151,936 by default), for the anchor pass
(no grad) and the training pass (forward + backward of ``log_prob.sum()``), three ways:

* ``naive``: ``log_softmax(lm_head(h).float() / T).gather(tokens)`` over every position at once;
* ``chunk_4096``: :func:`~ar_torchrl.modules.token_log_probs` with ``chunk_tokens=4096`` (the
  fixed chunk the library used before, whatever the vocabulary);
* ``budget``: ``token_log_probs`` with chunks sized by a memory budget (``--budget-mib``, default
  the library's ``LOGITS_MEMORY_BUDGET``): ``chunk = budget / (V * 4 bytes * k)``.

Every (path, pass) runs in a fresh subprocess. CPU: the peak is ``ru_maxrss`` after the pass minus
the resident set just before it (``MALLOC_MMAP_THRESHOLD_=65536`` so freed buffers leave the
process and an earlier allocation cannot hide a later one); CUDA:
``torch.cuda.max_memory_allocated()`` minus the allocated bytes before. Inputs (hidden states,
LM head) are allocated before the baseline; for the training pass the LM head's ``.grad`` buffer is
allocated before it too (it lives across micro-batches), so the peak is the pass's own working
memory: logits, softmax, their gradients, and the LM head's gradient contributions (autograd sums
the chunks' contributions to the weight in one ``V x H`` buffer before adding it to ``.grad``: a
cost of the hidden size, not of ``B x L``, and the reason ``--hidden`` is small on CPU). Each
child also saves its log-probs (and the hidden states' gradient); the parent checks that every
path equals ``naive`` (max |diff| reported, asserted <= 1e-4 in float32).

Scaling: the naive peak grows with ``B x L`` (a few float32 ``[B x L, V]`` buffers: ~10 GB each at
B=8, L=2048, V=151,936), the budgeted one does not (``k`` buffers of ``chunk x V``, at most the
budget), so the ratio measured at a CPU-sized ``B x L`` grows linearly with ``B x L``.

Run:
    .venv/bin/python benchmarks/bench_logprob_memory.py            # CPU, B=2 L=1024 (naive: 3.7 GB)
    .venv/bin/python benchmarks/bench_logprob_memory.py --quick    # small vocabulary, ~1 min
    python benchmarks/bench_logprob_memory.py --device cuda --batch 8 --length 2048 --hidden 1024

Prints a table and writes ``benchmarks/results/bench_logprob_memory[_quick][_cuda].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import machine_info, write_json

from ar_torchrl.modules import LOGITS_MEMORY_BUDGET, chunk_tokens_for_budget, token_log_probs

RESULTS = Path(__file__).resolve().parent / "results"
PATHS = ("naive", "chunk_4096", "budget")
PASSES = ("anchor_no_grad", "train_grad")
TARGET_X_LESS = 8.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="hidden states / LM head dtype (default: float32 cpu, bfloat16 cuda)",
    )
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument(
        "--hidden",
        type=int,
        default=128,
        help="sets only the LM head's own V x H gradient (Qwen3-0.6B: 1024)",
    )
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--budget-mib", type=float, default=LOGITS_MEMORY_BUDGET / 2**20)
    p.add_argument("--entropy", action="store_true", help="also compute entropies")
    p.add_argument("--quick", action="store_true", help="V=32768, H=16, B=2, L=256, 4 MiB budget")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", nargs=3, metavar=("PATH", "PASS", "SAVE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.vocab, args.hidden, args.batch, args.length, args.budget_mib = 32768, 16, 2, 256, 4
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if args.out is None:
        suffix = ("_quick" if args.quick else "") + ("_cuda" if args.device == "cuda" else "")
        args.out = RESULTS / f"bench_logprob_memory{suffix}.json"
    return args


# ----------------------------------------------------------------------------- child
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _log_probs(path: str, hidden, tokens, head, args) -> torch.Tensor:
    if path == "naive":
        logp = torch.log_softmax(head(hidden[:, :-1]).float(), dim=-1)
        lp = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
        if args.entropy:
            lp = lp + 0.0 * (logp.exp() * logp).sum(-1)  # the entropy's buffers, not its value
        return lp
    chunk = 4096 if path == "chunk_4096" else None
    budget = int(args.budget_mib * 2**20)
    lp, ent = token_log_probs(
        hidden, tokens, head, chunk_tokens=chunk, memory_budget=budget, with_entropy=args.entropy
    )
    return lp[:, 1:] if ent is None else lp[:, 1:] + 0.0 * ent[:, 1:]


def child(args: argparse.Namespace) -> None:
    """One (path, pass) in this fresh process; prints a JSON line, saves outputs to SAVE."""
    path, pass_, save = args.child
    grad = pass_ == "train_grad"
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=device, dtype=dtype)
    hidden = torch.randn(args.batch, args.length, args.hidden, device=device, dtype=dtype)
    hidden.requires_grad_(grad)
    tokens = torch.randint(args.vocab, (args.batch, args.length), device=device)
    if grad:
        head.weight.grad = torch.zeros_like(head.weight)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss()
    start = time.perf_counter()
    with torch.set_grad_enabled(grad):
        lp = _log_probs(path, hidden, tokens, head, args)
        if grad:
            lp.sum().backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    seconds = time.perf_counter() - start
    torch.save(
        {
            "log_prob": lp.detach().float().cpu(),
            "hidden_grad": hidden.grad.float().cpu() if grad else None,
        },
        save,
    )
    print(json.dumps({"peak_bytes": peak, "seconds": seconds}))


# ----------------------------------------------------------------------------- parent
def measure(args: argparse.Namespace, path: str, pass_: str, save: Path) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        path,
        pass_,
        str(save),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--vocab",
        str(args.vocab),
        "--hidden",
        str(args.hidden),
        "--batch",
        str(args.batch),
        "--length",
        str(args.length),
        "--budget-mib",
        str(args.budget_mib),
    ] + (["--entropy"] if args.entropy else [])
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{path}/{pass_} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict:
    budget = int(args.budget_mib * 2**20)
    chunk = chunk_tokens_for_budget(args.vocab, budget)
    rows, outputs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for pass_ in PASSES:
            for path in PATHS:
                save = Path(tmp) / f"{path}_{pass_}.pt"
                res = measure(args, path, pass_, save)
                outputs[path, pass_] = torch.load(save)
                rows.append(
                    {
                        "path": path,
                        "pass": pass_,
                        "chunk_tokens": {"naive": None, "chunk_4096": 4096}.get(path, chunk),
                        **res,
                    }
                )
                print(f"  {pass_} {path}: {res['peak_bytes'] / 2**20:.0f} MiB", file=sys.stderr)
    diffs = compare(outputs, atol=1e-4 if args.dtype == "float32" else None)
    for row in rows:
        naive = next(r for r in rows if r["path"] == "naive" and r["pass"] == row["pass"])
        row["x_less_than_naive"] = naive["peak_bytes"] / max(row["peak_bytes"], 1)
        row["max_abs_diff_vs_naive"] = diffs[row["path"], row["pass"]]
    worst = min(r["x_less_than_naive"] for r in rows if r["path"] == "budget")
    return {
        "config": config_dict(args, budget, chunk),
        "results": rows,
        "target": {
            "x_less": TARGET_X_LESS,
            "worst_budget_x_less": worst,
            "met": worst >= TARGET_X_LESS,
        },
    }


def compare(outputs: dict, atol: float | None) -> dict:
    """Max |diff| of log-probs and hidden-state gradients of each path vs ``naive``."""
    diffs = {}
    for (path, pass_), out in outputs.items():
        ref = outputs["naive", pass_]
        diff = float((out["log_prob"] - ref["log_prob"]).abs().max())
        if out["hidden_grad"] is not None:
            diff = max(diff, float((out["hidden_grad"] - ref["hidden_grad"]).abs().max()))
        if atol is not None and diff > atol:
            raise AssertionError(f"{path}/{pass_} differs from naive by {diff:.3g} > {atol}")
        diffs[path, pass_] = diff
    return diffs


def config_dict(args: argparse.Namespace, budget: int, chunk: int) -> dict:
    return {
        "device": args.device,
        "dtype": args.dtype,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "batch": args.batch,
        "length": args.length,
        "positions": args.batch * (args.length - 1),
        "budget_bytes": budget,
        "budget_chunk_tokens": chunk,
        "entropy": args.entropy,
        "quick": args.quick,
        **machine_info(),
        "measure": "cuda max_memory_allocated" if args.device == "cuda" else "ru_maxrss - rss",
    }


def print_table(result: dict) -> None:
    cfg = result["config"]
    print(
        f"\nLog-prob peak memory: V={cfg['vocab']}, H={cfg['hidden']}, B={cfg['batch']}, "
        f"L={cfg['length']} ({cfg['positions']} positions), {cfg['dtype']} on "
        f"{cfg['gpu'] or 'cpu'}, budget {cfg['budget_bytes'] / 2**20:.0f} MiB -> "
        f"{cfg['budget_chunk_tokens']} tokens per chunk{', with entropy' if cfg['entropy'] else ''}"
    )
    header = (
        f"{'pass':<15}| {'path':<11}| {'chunk':>6} | {'peak MiB':>9} | "
        f"{'x less than naive':>17} | {'max |diff|':>10} | {'s (cold)':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in result["results"]:
        chunk = "-" if r["chunk_tokens"] is None else str(r["chunk_tokens"])
        print(
            f"{r['pass']:<15}| {r['path']:<11}| {chunk:>6} | {r['peak_bytes'] / 2**20:>9.1f} | "
            f"{r['x_less_than_naive']:>17.1f} | {r['max_abs_diff_vs_naive']:>10.2e} | "
            f"{r['seconds']:>8.2f}"
        )
    t = result["target"]
    print(
        f"budget path: worst {t['worst_budget_x_less']:.1f}x less than naive "
        f"(target >= {t['x_less']}x at this size: {'met' if t['met'] else 'MISSED'})"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    result = run(args)
    print_table(result)
    write_json(result, args.out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
