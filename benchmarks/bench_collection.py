"""Benchmark: collection time per sample on the rollout side, split into the backend's generation
and everything else (the layout work), and the time to build the environment.

What it measures (issue 17, item 6), side by side in one run, on the CPU default's shapes
(``ar_torchrl/configs/dapo_ppo.yaml``: tiny Qwen3 h64, 2 layers, char tokenizer, warm-started as the recipe
does, 16 prompts x 4 samples, ``max_new_tokens`` 12, trainside ``TransformersBackend``, 1 thread):

* **collection**: one batch as the recipe collects it (a ``WeightSyncCollector`` in ``sync`` mode
  over an ``LLMEnv``, which calls ``gather_batch(env)``), split into the time inside
  ``backend.generate`` (the model forwards included; they are also timed alone with forward hooks
  on the trainside model) and **everything else**: the env's reset (prompts), the actions, the
  decoding and scoring, the token trajectory. ``reward_fn`` (the task's reward, timed by wrapping
  the callable passed to ``LLMEnv``) is reported on its own; ``layout`` = everything else minus
  ``reward_fn``, the part the rollout-side refactor targets. Where the env still has them, its
  public ``generate`` (the default policy), ``score`` and ``to_token_trajectory`` are timed too,
  to show where "else" goes (actions, decoding, reward, trajectory, other: reset, step, TorchRL's
  rollout, the collector's group bookkeeping); an API without them reports those parts as null;
* the same collection with :class:`FixedCompletionsBackend` (a test double returning fixed
  completions, no model) at the CPU default's ``B = 64`` and at ``B = 1024`` (256 prompts x 4)
  with ``max_new_tokens`` 128, so the layout overhead is measured without model time;
* **env construction**: ``LLMEnv(...)`` on the recipe's training rows (2000 generated rows minus 64
  held out), which tokenises every prompt; and ``check_prompts`` over the same rows (the recipe's
  prompt check at load, which tokenises them too).

Only public entry points are used (``LLMEnv(...)``, ``WeightSyncCollector``, the public
``GenerationBackend`` interface, ``check_prompts``), so the script runs unchanged before and after
a refactor of the rollout side. Every quantity is the median over ``--reps`` repetitions, the
scenarios and the construction interleaved (round-robin) in each repetition, after one warm-up
collection per scenario; per-sample values divide by the batch's rows. Wall time is the headline;
CPU time (``time.process_time``, insensitive to other processes at 1 thread) is in the JSON and in
the ``cpu`` column. The JSON records the commit of the code measured.

Run:
    .venv/bin/python benchmarks/bench_collection.py            # ~2-3 min on 2 cores
    .venv/bin/python benchmarks/bench_collection.py --quick    # seconds: no warm start, small B

Prints a table and writes ``benchmarks/results/bench_collection[_quick][_cuda].json`` (``--out``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _common import code_version, machine_info, write_json

from ar_torchrl.backends import Completion, GenerationBackend, SamplingParams, TransformersBackend
from ar_torchrl.collectors import WeightSyncCollector
from ar_torchrl.data import check_prompts
from ar_torchrl.envs import LLMEnv

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# --quick: the random tiny model (no 300-step warm start) and 300 generated rows
# Public LLMEnv methods of the current API, timed when present to split "else" (diagnostics only:
# an API without them reports those parts as null): the default policy (backend.generate + the
# action tensors), the scoring (decoding + checks + reward_fn), the token trajectory.
DIAGNOSTIC_METHODS = (
    ("generate", "env_generate"),
    ("score", "score"),
    ("to_token_trajectory", "trajectory"),
)
QUICK = ("model.warm_start.enabled=false", "data.num_rows=300")


# ----------------------------------------------------------------------------- timing
class Clock:
    """Wall and CPU seconds accumulated per part while a batch is collected."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def add(self, part: str, wall: float, cpu: float) -> None:
        self.wall[part] = self.wall.get(part, 0.0) + wall
        self.cpu[part] = self.cpu.get(part, 0.0) + cpu

    def timed(self, fn: Callable, part: str) -> Callable:
        """``fn`` with its wall and CPU time added to ``part`` (its signature kept: TorchRL reads a
        policy's)."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(part, time.perf_counter() - wall, time.process_time() - cpu)

        return wrapper

    def reset(self) -> None:
        self.wall, self.cpu = {}, {}


class TimedReward:
    """The task's reward (``reward_fn`` of ``LLMEnv``) with its time added to ``clock``; it keeps
    the reward's ``is_correct`` and ``name`` (what the collector's stats and errors read)."""

    def __init__(self, reward: Callable[[str, str], float], clock: Clock) -> None:
        self.reward, self.clock = reward, clock
        self.name = getattr(reward, "name", "reward")

    def _timed(self, fn, *args):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return fn(*args)
        finally:
            self.clock.add("reward_fn", time.perf_counter() - wall, time.process_time() - cpu)

    def __call__(self, text: str, truth: str) -> float:  # the API before the sample-aware rewards
        return self._timed(self.reward, text, truth)

    def score(self, sample: Any) -> float:  # the sample-aware reward protocol
        return self._timed(self.reward.score, sample)

    def correct(self, sample: Any, score: float) -> bool:
        return self.reward.correct(sample, score)

    def is_correct(self, value: Any) -> Any:
        judge = getattr(self.reward, "is_correct", None)
        return judge(value) if judge is not None else value > 0


def hook_forwards(module: torch.nn.Module, clock: Clock, part: str) -> None:
    """Forward pre/post hooks adding each forward's time to ``part`` (device-synchronised)."""
    starts: list[tuple[float, float]] = []

    def pre(*_):
        _sync()
        starts.append((time.perf_counter(), time.process_time()))

    def post(*_):
        _sync()
        wall, cpu = starts.pop()
        clock.add(part, time.perf_counter() - wall, time.process_time() - cpu)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- the fake backend
class FixedCompletionsBackend(GenerationBackend):
    """A test double: a ``GenerationBackend`` that returns fixed completions without a model, so a
    benchmark times the rollout side's layout work alone (the real engines are ``TransformersBackend``
    and ``SGLangBackend``).

    The completions are drawn once, at construction, from a seeded RNG: ``pool`` token lists of
    1..``max_new_tokens`` tokens of text ending in an ``Answer: <n>`` line (so the reward parses
    something), every second one ended by ``eos_token_id`` (``"stop"``), the others cut at their
    length (``"length"``), with fixed negative log-probs. ``generate`` hands out fresh
    :class:`Completion` objects of that pool, cycling, prompt-major (``_generate``, the public
    interface's one method); the base class stamps ``policy_version``. It cannot be synced.

    Args:
        tokenizer: encodes the completion texts (its ids must fit the env's vocabulary).
        max_new_tokens: longest completion.
        eos_token_id: id that ends a ``"stop"`` completion.
        pool: how many distinct completions.
        seed: seed of the draw.

    Example:
        >>> from ar_torchrl.models import build_char_tokenizer
        >>> tok = build_char_tokenizer()
        >>> fake = FixedCompletionsBackend(tok, max_new_tokens=8, eos_token_id=tok.eos_token_id)
        >>> out = fake.generate([[1, 2], [3]], 2, SamplingParams(max_new_tokens=8))
        >>> [c.prompt_index for c in out], all(1 <= len(c) <= 8 for c in out)
        ([0, 0, 1, 1], True)
    """

    def __init__(
        self, tokenizer, *, max_new_tokens: int, eos_token_id: int, pool: int = 256, seed: int = 0
    ) -> None:
        super().__init__(sender=None)
        rng = random.Random(seed)
        letters = "abcdefghijklmnopqrstuvwxyz     "
        self.pool: list[tuple[list[int], list[float], str]] = []
        for k in range(pool):
            length, stop = rng.randint(1, max_new_tokens), k % 2 == 0
            answer = f"\nAnswer: {rng.randint(0, 18)}"
            room = length - int(stop)
            filler = "".join(rng.choice(letters) for _ in range(max(0, room - len(answer))))
            ids = tokenizer.encode(filler + answer, add_special_tokens=False)[-room:][:room]
            ids = [*ids, eos_token_id] if stop else ids
            ids = ids or [eos_token_id]
            reason = "stop" if ids[-1] == eos_token_id else "length"
            self.pool.append((ids, [-0.5 - 0.01 * (t % 7) for t in range(len(ids))], reason))

    def _generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams
    ) -> list[Completion]:
        out = []
        for i in range(len(prompts)):
            for j in range(n):
                ids, lps, reason = self.pool[(i * n + j) % len(self.pool)]
                out.append(Completion(i, list(ids), list(lps), reason))
        return out


# ----------------------------------------------------------------------------- the setting
def compose_config(overrides: list[str]):
    """The recipe's typed config (``ar_torchrl/configs/dapo_ppo.yaml`` + overrides)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from ar_torchrl.recipes.config import CONFIG_DIR
    from ar_torchrl.recipes.dapo_ppo import schemas, validate_config

    for group, schema_name, schema in schemas():  # as examples/dapo_ppo.py stores them
        ConfigStore.instance().store(group=group, name=schema_name, node=schema)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return validate_config(compose(config_name="dapo_ppo", overrides=overrides))


@dataclass
class Setting:
    """What every scenario shares: the recipe's rows, tokenizer, reward, model and sampling."""

    cfg: Any
    rows: Any
    tokenizer: Any
    reward: Any
    model: torch.nn.Module
    clock: Clock = field(default_factory=Clock)

    def sampling(self, max_new_tokens: int) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k
        )

    def env(self, backend: GenerationBackend, prompts: int, max_new_tokens: int) -> LLMEnv:
        """The recipe's training env (``build_envs``' arguments) with ``prompts`` per batch."""
        r = self.cfg.rollout
        return LLMEnv(
            self.rows,
            self.tokenizer,
            backend,
            reward_fn=TimedReward(self.reward, self.clock),
            num_samples=r.samples_per_prompt,
            prompts_per_batch=prompts,
            sampling=self.sampling(max_new_tokens),
            seed=self.cfg.seed,
        )


def build_setting(args) -> Setting:
    cfg = compose_config([f"device={args.device}", *args.set])
    torch.manual_seed(cfg.seed)
    rows, _ = cfg.data.build()  # the training rows (the held-out ones go to evaluation)
    model, tokenizer = cfg.model.build(cache_dir=cfg.cache_dir)
    return Setting(cfg, rows, tokenizer, cfg.reward.build(), model.to(args.device).eval())


@dataclass
class Scenario:
    """One collection setting: its env, its collector's iterator, and its per-rep timings."""

    name: str
    backend_kind: str
    prompts: int
    samples: int
    max_new_tokens: int
    env: LLMEnv
    batches: Any
    reps: list[dict] = field(default_factory=list)

    @property
    def batch(self) -> int:
        return self.prompts * self.samples


def make_scenarios(s: Setting, args) -> list[Scenario]:
    r, eos = s.cfg.rollout, s.tokenizer.eos_token_id
    out = []
    specs = [
        ("trainside", r.prompts_per_iter, r.max_new_tokens),
        ("fake", r.prompts_per_iter, r.max_new_tokens),
        ("fake", args.large_batch // r.samples_per_prompt, args.large_max_new_tokens),
    ]
    for kind, prompts, max_new in specs:
        if kind == "trainside":
            backend = TransformersBackend(
                s.model, mode="copy", max_batch_size=s.cfg.backend.max_batch_size, seed=s.cfg.seed
            )
            hook_forwards(backend.model, s.clock, "model_forward")
        else:
            backend = FixedCompletionsBackend(
                s.tokenizer, max_new_tokens=max_new, eos_token_id=eos, seed=s.cfg.seed
            )
        backend.generate = s.clock.timed(backend.generate, "generate")  # what LLMEnv calls
        env = s.env(backend, prompts, max_new)
        for attr, part in DIAGNOSTIC_METHODS:  # where they exist: where "else" goes
            if callable(getattr(env, attr, None)):
                setattr(env, attr, s.clock.timed(getattr(env, attr), part))
        collector = WeightSyncCollector(env, s.model, mode="sync")  # the recipe's, in sync mode
        b = prompts * r.samples_per_prompt
        name = f"{kind} B={b} new={max_new}"
        out.append(
            Scenario(name, kind, prompts, r.samples_per_prompt, max_new, env, iter(collector))
        )
    return out


# ----------------------------------------------------------------------------- measuring
def collect_once(s: Setting, sc: Scenario) -> dict:
    """Time one batch of ``sc`` (the collector's ``next``), with its parts."""
    gc.collect()
    s.clock.reset()
    wall, cpu = time.perf_counter(), time.process_time()
    batch = next(sc.batches)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if batch.shape[0] != sc.batch:
        raise RuntimeError(
            f"bench_collection: {sc.name}: got {batch.shape[0]} rows, not {sc.batch}"
        )
    loss_mask = batch.get("loss_mask", None)
    tokens = int(loss_mask.sum()) if loss_mask is not None else None
    rep = {"total_s": wall, "total_cpu_s": cpu, "response_tokens": tokens}
    for part in ("generate", "model_forward", "reward_fn"):
        rep[f"{part}_s"] = s.clock.wall.get(part, 0.0)
        rep[f"{part}_cpu_s"] = s.clock.cpu.get(part, 0.0)
    rep["else_s"] = wall - rep["generate_s"]
    rep["else_cpu_s"] = cpu - rep["generate_cpu_s"]
    rep["layout_s"] = rep["else_s"] - rep["reward_fn_s"]
    rep["layout_cpu_s"] = rep["else_cpu_s"] - rep["reward_fn_cpu_s"]
    found = {p: s.clock.wall.get(p) for _, p in DIAGNOSTIC_METHODS}
    rep.update(dict.fromkeys(("actions_s", "decode_s", "trajectory_s", "other_s")))
    if found["env_generate"] is not None and found["trajectory"] is not None:
        # before: env.generate = backend + action tensors, env.score = decode + reward_fn; after:
        # env.generate = backend + samples (decoding included), the reward runs on its own
        rep["actions_s"] = found["env_generate"] - rep["generate_s"]
        rep["trajectory_s"] = found["trajectory"]
        scored = found["score"] if found["score"] is not None else rep["reward_fn_s"]
        if found["score"] is not None:
            rep["decode_s"] = found["score"] - rep["reward_fn_s"]
        rep["other_s"] = rep["else_s"] - rep["actions_s"] - scored - rep["trajectory_s"]
    return rep


def construct_once(s: Setting) -> dict:
    """Time ``LLMEnv(...)`` on the training rows, then ``check_prompts`` over them."""
    fake = FixedCompletionsBackend(s.tokenizer, max_new_tokens=1, eos_token_id=0, pool=1)
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    s.env(fake, s.cfg.rollout.prompts_per_iter, s.cfg.rollout.max_new_tokens)
    out = {"env_s": time.perf_counter() - wall, "env_cpu_s": time.process_time() - cpu}
    limit = s.model.config.max_position_embeddings - s.cfg.rollout.max_new_tokens
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    check_prompts(s.rows, s.tokenizer, max_prompt_tokens=limit, name="data")
    out.update(check_s=time.perf_counter() - wall, check_cpu_s=time.process_time() - cpu)
    return out


def medians(reps: list[dict]) -> dict:
    keys = [k for k in reps[0] if reps[0][k] is not None]
    return {k: statistics.median(r[k] for r in reps) for k in keys}


def summarize(sc: Scenario) -> dict:
    """Medians per batch and per sample; the fraction of the total outside ``backend.generate``."""
    med = medians(sc.reps)
    per_sample = {k.replace("_s", "_ms"): 1e3 * v / sc.batch for k, v in med.items() if "_s" in k}
    tokens = med.get("response_tokens")
    return dict(
        scenario=sc.name,
        backend=sc.backend_kind,
        batch=sc.batch,
        prompts=sc.prompts,
        samples_per_prompt=sc.samples,
        max_new_tokens=sc.max_new_tokens,
        median_per_batch=med,
        median_per_sample=per_sample,
        mean_response_tokens=None if tokens is None else tokens / sc.batch,
        else_fraction=med["else_s"] / med["total_s"],
        layout_fraction=med["layout_s"] / med["total_s"],
        reps=sc.reps,
    )


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    s = build_setting(args)
    scenarios = make_scenarios(s, args)
    for sc in scenarios:  # warm-up: first-call costs (template compilation, allocator)
        collect_once(s, sc)
    construction = []
    for _ in range(args.reps):  # round-robin: one of everything per repetition
        construction.append(construct_once(s))
        for sc in scenarios:
            sc.reps.append(collect_once(s, sc))
    rows = len(s.rows)
    cons = medians(construction)
    return dict(
        rows=rows,
        construction=dict(
            median=cons,
            env_us_per_row=1e6 * cons["env_s"] / rows,
            check_us_per_row=1e6 * cons["check_s"] / rows,
            reps=construction,
        ),
        scenarios=[summarize(sc) for sc in scenarios],
    )


# ----------------------------------------------------------------------------- reporting
def report(result: dict, reps: int) -> str:
    lines = [
        f"collection per sample, ms (median of {reps} reps, round-robin; 'else' = total - time "
        "in backend.generate; layout = else - reward_fn)",
        f"  {'scenario':<26} {'resp':>5} {'total':>8} {'generate':>9} {'(model)':>8} "
        f"{'else':>7} {'cpu':>7} {'reward':>7} {'layout':>7} {'else %':>7}",
    ]
    for r in result["scenarios"]:
        p, resp = r["median_per_sample"], r["mean_response_tokens"]
        model = f"{p['model_forward_ms']:.3f}" if r["backend"] == "trainside" else "-"
        lines.append(
            f"  {r['scenario']:<26} {resp if resp is None else f'{resp:.1f}':>5} "
            f"{p['total_ms']:>8.3f} {p['generate_ms']:>9.3f} {model:>8} "
            f"{p['else_ms']:>7.3f} {p['else_cpu_ms']:>7.3f} {p['reward_fn_ms']:>7.3f} "
            f"{p['layout_ms']:>7.3f} {100 * r['else_fraction']:>6.1f}%"
        )
    lines.append(
        "  (resp: mean response tokens per sample; cpu: CPU ms of 'else'; reward: the task's "
        "reward_fn)"
    )
    lines.append(
        "where 'else' goes, ms per sample (LLMEnv's public methods of the current API; '-': absent)"
    )
    lines.append(
        f"  {'scenario':<26} {'actions':>8} {'decode':>8} {'reward':>8} {'trajectory':>10} "
        f"{'other':>8}"
    )
    for r in result["scenarios"]:
        p = r["median_per_sample"]
        cells = [p.get(k) for k in ("actions_ms", "decode_ms", "reward_fn_ms", "trajectory_ms")]
        cells.append(p.get("other_ms"))
        text = ["-" if v is None else f"{v:.3f}" for v in cells]
        lines.append(
            f"  {r['scenario']:<26} {text[0]:>8} {text[1]:>8} {text[2]:>8} {text[3]:>10} "
            f"{text[4]:>8}"
        )
    lines.append(
        "  (actions: env.generate - backend.generate; decode: env.score - reward_fn; other: reset, "
        "step, TorchRL's rollout, gather_batch's groups)"
    )
    c = result["construction"]
    lines += [
        f"env construction, {result['rows']} rows: LLMEnv(...) {1e3 * c['median']['env_s']:.1f} ms "
        f"({c['env_us_per_row']:.1f} us/row, cpu {1e3 * c['median']['env_cpu_s']:.1f} ms); "
        f"check_prompts {1e3 * c['median']['check_s']:.1f} ms ({c['check_us_per_row']:.1f} us/row)",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 15; quick 3)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument(
        "--large-batch", type=int, default=None, help="rows of the large fake (default 1024)"
    )
    p.add_argument(
        "--large-max-new-tokens", type=int, default=None, help="its max_new_tokens (default 128)"
    )
    p.add_argument(
        "--quick", action="store_true", help="random model, 300 rows, 3 reps, large fake 128 x 32"
    )
    p.add_argument("--set", action="append", default=[], help="extra Hydra override (repeatable)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.reps = args.reps or (3 if args.quick else 15)
    args.large_batch = args.large_batch or (128 if args.quick else 1024)
    args.large_max_new_tokens = args.large_max_new_tokens or (32 if args.quick else 128)
    if args.quick:
        args.set = [*QUICK, *args.set]
    if args.reps < 1:
        p.error(f"--reps must be >= 1, got {args.reps}")
    if args.large_batch < 1 or args.large_max_new_tokens < 1:
        p.error(
            f"--large-batch and --large-max-new-tokens must be >= 1, got {args.large_batch} and "
            f"{args.large_max_new_tokens}"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False on this machine")
    suffix = ("_quick" if args.quick else "") + ("_cuda" if args.device == "cuda" else "")
    args.out = args.out or RESULTS / f"bench_collection{suffix}.json"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    result = run(args)
    import ar_torchrl

    meta = dict(
        device=args.device,
        reps=args.reps,
        threads=args.threads,
        quick=args.quick,
        overrides=args.set,
        large_batch=args.large_batch,
        large_max_new_tokens=args.large_max_new_tokens,
        ar_torchrl=str(Path(ar_torchrl.__file__).parent),
        load_average=[load_before, os.getloadavg()[0]],
        **code_version(),
        **machine_info(),
    )
    sys.stdout.write(report(result, args.reps))
    sys.stdout.write(
        f"load average {meta['load_average'][0]:.1f} -> {meta['load_average'][1]:.1f}; "
        f"commit {meta['commit']}{' (dirty)' if meta['dirty'] else ''}\n"
    )
    write_json({"config": meta, "results": result}, args.out)
    sys.stdout.write(f"wrote {args.out}\n")


if __name__ == "__main__":
    main()
