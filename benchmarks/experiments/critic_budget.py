"""PPO with the shared value head, PPO with a separate critic, GRPO and RLOO at the same budget
(``--variants critic``, the default); or sync vs async vs bounded staleness with partial rollouts
(``--variants staleness``: does staleness break learning?).

Same prompts, samples, iterations and seeds for every variant (only the advantage estimator and
where the values come from differ); per task:

- ``cpu``: the CPU default (``ar_torchrl/configs/dapo_ppo.yaml``), ``--iterations`` (default 100, the CI
  version) over 5 seeds;
- ``smollm2``: SmolLM2-135M-Instruct on ``--config-name smollm2_arithmetic`` (10 iterations, held-out
  evaluation every 5) over 3 seeds;
- ``critic_arithmetic`` (5 seeds x 100 iterations), ``smollm2_mixed``
  (``smollm2_arithmetic_mixed``, 3 seeds x 10 iterations) and ``tool_smollm2``
  (``tool_arithmetic_smollm2``, 3 seeds x 6 iterations): the tasks of the matched-token table
  (``--variants matched``: every arm the same samples per iteration, the task's own batch). Memory:
  a SmolLM2 run holds ~5 GB on the mixed task and 7-10 GB on the tool task (RSS of its 16 x 2 and
  32 x 1 arms), the tool task's separate-critic arm peaks at ~18 GB (two models and their
  optimizers, 4,096-token micro-batches), so with ``--jobs 2`` it runs alone (``ALONE``: it waits
  for the running job and holds both slots; beside another run it was killed for memory on a 24 GB
  machine); run nothing else beside the script then (two tool-task runs and a 3 GB benchmark
  beside them were killed for memory too).

Per run: reward rise (mean reward of the last 20 % of iterations minus the first 20 %), held-out
greedy accuracy at step 0 and at the end, the run-mean of ``train/explained_variance`` (PPO and the
critic targets of GRPO/RLOO when a critic is trained; none for critic-free GRPO/RLOO) and seconds per
iteration (the stages' sum, ``time/*``). Per variant: mean [min, max] over the seeds, and the
mean curves (sampled reward per iteration, held-out accuracy per evaluation) in one PNG.

Runs live in ``--runs`` (default ``outputs/critic_budget``) with a checkpoint every
``--checkpoint-every`` iterations: a finished run is not repeated and an unfinished one resumes
from its checkpoint (``train.resume_from=<run dir>``), so the table can be built over several
sittings. A machine that does not keep ``outputs/`` between sittings starts without run dirs:
the finished runs the last report (``--out``, committed under ``benchmarks/results/``) recorded
are kept from it and not run again (:func:`recorded_runs`; only an unfinished run is lost, so
give such a sitting ``--start-within MINUTES``: no run is begun after that). ``--jobs 2`` runs
two at once (then seconds per iteration compare only within a run of the script, not with
single-job numbers).

Commands::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/experiments/critic_budget.py --task cpu --jobs 2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/experiments/critic_budget.py --task cpu --variants staleness
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/experiments/critic_budget.py --task smollm2 --jobs 2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/experiments/critic_budget.py --task smollm2_mixed --variants matched
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/experiments/critic_budget.py --task cpu --quick   # smoke test
    .venv/bin/python benchmarks/experiments/critic_budget.py --task cpu --report-only --write-docs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # benchmarks/_common.py
from _common import code_version, machine_info, read_history, replace_marked_block, write_json
from readme_figures import figures, run_recipe
from smollm2_curves import seed_mean

ROOT = Path(__file__).resolve().parents[2]
#: The page that holds the blocks (``critic_budget_<task>``, ``staleness_<task>``).
DOCS_PAGE = ROOT / "docs" / "evidence.md"

#: variant -> recipe overrides (everything else is the task's configuration), per variant set.
VARIANT_SETS: dict[str, dict[str, tuple[str, ...]]] = {
    "critic": {
        "ppo_shared": ("critic=shared",),
        "ppo_separate": ("critic=separate",),
        "grpo": ("algo=grpo",),
        "rloo": ("algo=rloo",),
    },
    "staleness": {
        "sync": (),
        "async": ("train.mode=async",),
        "lag2_partial": (
            "train.mode=async",
            "train.max_policy_lag=2",
            "train.partial_rollouts=true",
        ),
    },
}
#: ``--variants matched``: the same samples (and so about the same generated tokens) per iteration,
#: split into prompts x samples per prompt differently per estimator (a critic needs no group, a
#: group baseline needs one): 256 = 64 prompts x 4 samples on critic_arithmetic (its own batch),
#: 32 = 8 x 4 on the SmolLM2 tasks (theirs).
MATCHED_SAMPLES_BY_TASK = {"critic_arithmetic": 256, "smollm2_mixed": 32, "tool_smollm2": 32}
MATCHED_SAMPLES = MATCHED_SAMPLES_BY_TASK["critic_arithmetic"]  # its name before the SmolLM2 tasks

#: arm -> (samples per prompt, overrides): the arms the issue asks for on every task ...
MATCHED_ARMS: dict[str, tuple[int, tuple[str, ...]]] = {
    "ppo_n1": (1, ("critic=shared",)),
    "ppo_n2": (2, ("critic=shared",)),
    "ppo_separate_n2": (2, ("critic=separate",)),
    "grpo_n4": (4, ("algo=grpo",)),
    "grpo_n8": (8, ("algo=grpo",)),
    "rloo_n4": (4, ("algo=rloo",)),
    "rloo_n8": (8, ("algo=rloo",)),
    "reinforce_pp_n1": (1, ("algo=reinforce_pp",)),
}
#: ... and the further arms measured on critic_arithmetic only
MATCHED_EXTRA_ARMS: dict[str, tuple[int, tuple[str, ...]]] = {
    # the critics given the policy's sampling log-probs (critic.confidence_features)
    "ppo_n1_confidence": (1, ("critic=shared", "critic.confidence_features=true")),
    "ppo_n2_confidence": (2, ("critic=shared", "critic.confidence_features=true")),
    "ppo_separate_n2_confidence": (2, ("critic=separate", "critic.confidence_features=true")),
    # lambda = 1: the advantage is the Monte-Carlo return minus the critic's value (unbiased
    # whatever the critic predicts; the critic only reduces variance)
    "ppo_n1_confidence_lmbda1": (
        1,
        ("critic=shared", "critic.confidence_features=true", "algo.gae.lmbda=1.0"),
    ),
    "ppo_n1_lmbda1": (1, ("critic=shared", "algo.gae.lmbda=1.0")),  # its control
    # between the recipe's 0.95 and 1 (issue 27: not measured before)
    "ppo_n1_lmbda099": (1, ("critic=shared", "algo.gae.lmbda=0.99")),
}


#: task -> arms that run with no other run beside them (their peak memory; see the docstring)
ALONE: dict[str, frozenset[str]] = {"tool_smollm2": frozenset({"ppo_separate_n2"})}


class Slots:
    """``jobs`` run slots handed out in submission order: a run takes ``weight`` slots (all of
    them for a run that must run alone) and starts only when its turn has come and they are free,
    so a heavy run is never starved by the light ones behind it.

    Example:
        >>> slots, order = Slots(2), []
        >>> def job(ticket, name, weight):
        ...     with slots.hold(ticket, weight):
        ...         order.append(name)
        >>> tickets = [slots.ticket() for _ in range(3)]
        >>> threads = [threading.Thread(target=job, args=(t, n, w))
        ...            for t, n, w in zip(tickets[::-1], "cba", (1, 2, 1))]
        >>> for t in threads: t.start()
        >>> for t in threads: t.join()
        >>> order
        ['a', 'b', 'c']
    """

    def __init__(self, jobs: int) -> None:
        self.jobs, self.free, self._next, self._issued = jobs, jobs, 0, 0
        self._cond = threading.Condition()

    def ticket(self) -> int:
        """The next place in the start order (take them in submission order)."""
        with self._cond:
            self._issued += 1
            return self._issued - 1

    @contextlib.contextmanager
    def hold(self, ticket: int, weight: int):
        """Wait for ``ticket``'s turn and ``weight`` free slots, then hold them (a context)."""
        weight = min(weight, self.jobs)
        with self._cond:
            self._cond.wait_for(lambda: self._next == ticket and self.free >= weight)
            self.free -= weight
            self._next += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self.free += weight
                self._cond.notify_all()


def matched_arms(task: str) -> dict[str, tuple[str, ...]]:
    """``task``'s matched arms: name -> recipe overrides, every arm ``MATCHED_SAMPLES_BY_TASK[task]``
    samples per iteration.

    Example:
        >>> matched_arms("tool_smollm2")["grpo_n8"]
        ('rollout.prompts_per_iter=4', 'rollout.samples_per_prompt=8', 'algo=grpo')
        >>> "ppo_n1_lmbda1" in matched_arms("critic_arithmetic"), "ppo_n1_lmbda1" in matched_arms("tool_smollm2")
        (True, False)
    """
    if task not in MATCHED_SAMPLES_BY_TASK:
        raise ValueError(
            f"--variants matched has no sample count for --task {task!r}; "
            f"tasks with one: {sorted(MATCHED_SAMPLES_BY_TASK)}"
        )
    samples = MATCHED_SAMPLES_BY_TASK[task]
    arms = dict(MATCHED_ARMS)
    if task == "critic_arithmetic":
        arms.update(MATCHED_EXTRA_ARMS)
    return {
        name: (
            f"rollout.prompts_per_iter={samples // n}",
            f"rollout.samples_per_prompt={n}",
            *overrides,
        )
        for name, (n, overrides) in arms.items()
    }


VARIANT_SETS["matched"] = matched_arms("critic_arithmetic")
VARIANTS = {name: o for variants in VARIANT_SETS.values() for name, o in variants.items()}
COLORS = {
    "sync": "tab:blue",
    "async": "tab:purple",
    "lag2_partial": "tab:brown",
    "ppo_shared": "tab:blue",
    "ppo_separate": "tab:green",
    "grpo": "tab:orange",
    "rloo": "tab:red",
    "ppo_n1": "tab:blue",
    "ppo_n2": "tab:cyan",
    "ppo_separate_n2": "tab:green",
    "grpo_n4": "tab:orange",
    "grpo_n8": "gold",
    "rloo_n4": "tab:red",
    "rloo_n8": "tab:pink",
    "reinforce_pp_n1": "tab:gray",
    "ppo_n1_confidence": "navy",
    "ppo_n2_confidence": "teal",
    "ppo_separate_n2_confidence": "darkgreen",
    "ppo_n1_confidence_lmbda1": "purple",
    "ppo_n1_lmbda1": "slateblue",
    "ppo_n1_lmbda099": "mediumpurple",
}

#: task -> (config overrides, seeds, iterations, evaluate every, checkpoint every)
TASKS: dict[str, tuple[tuple[str, ...], int, int, int, int]] = {
    "cpu": ((), 5, 100, 100, 50),
    "smollm2": (("--config-name", "smollm2_arithmetic"), 3, 10, 5, 1),
    "critic_arithmetic": (("--config-name", "critic_arithmetic"), 5, 100, 100, 50),
    # the SmolLM2 tasks of the matched table (``--variants matched``)
    "smollm2_mixed": (("--config-name", "smollm2_arithmetic_mixed"), 3, 10, 5, 1),
    # its config's 6 iterations (held-out greedy accuracy starts at ~0.98; the sampled reward
    # rises within a few iterations) at ~2.5 min each on 1 CPU thread
    "tool_smollm2": (("--config-name", "tool_arithmetic_smollm2"), 3, 6, 3, 1),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=sorted(TASKS), default="cpu")
    p.add_argument("--variants", choices=sorted(VARIANT_SETS), default="critic")
    p.add_argument("--only", nargs="+", choices=sorted(VARIANTS), help="these variants only")
    p.add_argument("--iterations", type=int, default=None, help="default: the task's")
    p.add_argument("--seeds", type=int, default=None, help="default: the task's")
    p.add_argument("--jobs", type=int, default=1, help="runs at once")
    p.add_argument("--runs", type=Path, default=ROOT / "outputs" / "critic_budget")
    p.add_argument(
        "--start-within",
        type=float,
        default=None,
        metavar="MINUTES",
        help="start no run later than this many minutes after the script starts (a sitting "
        "whose run dirs do not outlive it: a run it cannot finish is not begun)",
    )
    p.add_argument("--quick", action="store_true", help="3 iterations, 1 seed, a temporary dir")
    p.add_argument("--report-only", action="store_true", help="summarise the runs there, run none")
    p.add_argument(
        "--ceilings",
        action="store_true",
        help="measure each finished run's EV ceiling at its last checkpoint (16 x 64, cached)",
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--png", type=Path, default=None)
    p.add_argument(
        "--write-docs",
        "--write-readme",  # its name before the tables moved to docs/
        action="store_true",
        help="replace the table block in docs/evidence.md",
    )
    args = p.parse_args(argv)
    _, seeds, iterations, eval_every, checkpoint_every = TASKS[args.task]
    args.iterations = args.iterations or iterations
    args.seeds = args.seeds or seeds
    args.eval_every = min(eval_every, args.iterations)
    args.checkpoint_every = min(checkpoint_every, args.iterations)
    if args.quick:
        args.iterations, args.seeds, args.eval_every, args.checkpoint_every = 3, 1, 3, 2
    stem = _stem(args.variants, args.task) + ("_quick" if args.quick else "")
    args.out = args.out or ROOT / "benchmarks" / "results" / f"{stem}.json"
    args.png = args.png or args.out.with_suffix(".png")
    return args


def _finished(history: list[dict], iterations: int) -> bool:
    return sum("rollout/reward_mean" in h for h in history) >= iterations


#: In a run dir: the sittings (machine boots) the run ran in, one id per (re)start.
SITTINGS_NAME = "sittings.json"


def sitting_id() -> str:
    """This machine's boot: runs stamped with the same id ran on the same machine, in one boot
    (so their times compare); the kernel's boot id, else the host name.

    Example:
        >>> sitting_id() == sitting_id() and len(sitting_id()) > 0
        True
    """
    boot = Path("/proc/sys/kernel/random/boot_id")
    return boot.read_text().strip() if boot.is_file() else platform.node()


def sittings_of(run_dir: Path) -> list[str] | None:
    """The sittings ``run_dir`` recorded (``None``: a run started before the stamp existed)."""
    path = run_dir / SITTINGS_NAME
    return json.loads(path.read_text()) if path.is_file() else None


def record_sitting(run_dir: Path) -> list[str]:
    """Add this sitting to ``run_dir``'s :data:`SITTINGS_NAME` (a run resumed on another machine
    lists both) and return the list."""
    sittings, here = sittings_of(run_dir) or [], sitting_id()
    if here not in sittings:
        sittings.append(here)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / SITTINGS_NAME).write_text(json.dumps(sittings) + "\n")
    return sittings


def same_sitting(a: dict, b: dict) -> bool:
    """Whether two run summaries ran in one sitting, so that their times per iteration compare:
    each ran in exactly one, the same (``sittings``); runs reported before the stamp existed
    compare when they were reported at one commit (a sitting's runs were).

    Example:
        >>> same_sitting({"sittings": ["x"]}, {"sittings": ["x"]})
        True
        >>> same_sitting({"sittings": ["x", "y"]}, {"sittings": ["x", "y"]})  # resumed elsewhere
        False
        >>> same_sitting({"commit": "c"}, {"commit": "c"}), same_sitting({"commit": "c"}, {"commit": "c", "sittings": ["x"]})
        (True, False)
    """
    if "sittings" in a or "sittings" in b:
        return len(a.get("sittings", ())) == 1 and a.get("sittings") == b.get("sittings")
    return a.get("commit") is not None and a.get("commit") == b.get("commit")


def variants_of(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """The variant set ``args.variants`` on ``args.task``: name -> recipe overrides."""
    if args.variants == "matched":
        return matched_arms(args.task)
    return VARIANT_SETS[args.variants]


def one_run(args: argparse.Namespace, variant: str, seed: int, run_dir: Path, cache: Path) -> None:
    """Run ``variant`` with ``seed`` into ``run_dir`` until it has ``args.iterations`` iterations
    (resuming a stopped run from its checkpoint)."""
    if _finished(read_history(run_dir), args.iterations):
        return
    resume = []
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
        resume = [f"train.resume_from={run_dir}"]
    config, *_ = TASKS[args.task]
    record_sitting(run_dir)
    run_recipe(
        run_dir,
        cache,
        *config,
        f"train.iterations={args.iterations}",
        f"train.eval_every={args.eval_every}",
        f"train.checkpoint_every={args.checkpoint_every}",
        "train.keep_checkpoints=1",
        "logger=none",
        f"seed={seed}",
        *variants_of(args)[variant],
        *resume,
    )


def _late_mean(steps: list[dict], key: str) -> float | None:
    """The mean of ``key`` over the last 20 % of ``steps`` where it is logged (``None``: nowhere)."""
    late = steps[-max(1, len(steps) // 5) :]
    values = [h[key] for h in late if h.get(key) is not None]
    return sum(values) / len(values) if values else None


def samples_per_prompt(overrides: tuple[str, ...] | list[str], default: int = 4) -> int:
    """``rollout.samples_per_prompt`` of a variant's overrides (``default``: the config's)."""
    for o in overrides:
        if o.startswith("rollout.samples_per_prompt="):
            return int(o.split("=", 1)[1])
    return default


def summarize(history: list[dict], samples_per_prompt: int = 4) -> dict:
    """One run: :func:`readme_figures.figures` plus the run-mean explained variance (``None``
    without a critic), seconds per iteration and the curves.

    Example:
        >>> h = [{"step": 0, "eval/accuracy": 0.5}] + [
        ...     {"step": i, "rollout/reward_mean": i / 10, "rollout/accuracy": 0.5,
        ...      "train/explained_variance": -0.5, "time/update": 2.0} for i in range(1, 6)]
        >>> s = summarize(h)
        >>> round(s["reward_rise"], 2), s["explained_variance"], s["seconds_per_iteration"]
        (0.4, -0.5, 2.0)
    """
    steps = [h for h in history if "rollout/reward_mean" in h]
    ev = [h["train/explained_variance"] for h in steps if "train/explained_variance" in h]
    tokens = [
        h.get("rollout/response_length", 0.0)
        * h.get("rollout/groups_generated", 0.0)
        * samples_per_prompt
        for h in steps
    ]
    return {
        **figures(history),
        "explained_variance": sum(ev) / len(ev) if ev else None,
        # out of sample (the critic's values of each fresh batch vs its Monte-Carlo returns)
        "critic_explained_variance_late": _late_mean(steps, "critic/explained_variance"),
        # the same beyond the prompt (each prompt's mean removed; needs >= 2 samples per prompt)
        "critic_within_prompt_late": _late_mean(steps, "critic/explained_variance_within_prompt")
        if samples_per_prompt >= 2
        else None,
        "generated_tokens": sum(tokens),
        "reward_curve_tokens": [
            (sum(tokens[: i + 1]) / 1e6, h["rollout/reward_mean"]) for i, h in enumerate(steps)
        ],
        "critic_ev_curve": [
            (h["step"], h["critic/explained_variance"])
            for h in steps
            if h.get("critic/explained_variance") is not None
        ],
        "seconds_per_iteration": sum(
            v for h in steps for k, v in h.items() if k.startswith("time/")
        )
        / max(1, len(steps)),
        "all_finite": all(
            math.isfinite(v)
            for h in history
            for v in h.values()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ),
        "reward_curve": [(h["step"], h["rollout/reward_mean"]) for h in steps],
        "eval_curve": [(h["step"], h["eval/accuracy"]) for h in history if "eval/accuracy" in h],
    }


#: ``--ceilings``: the ceiling of each run's final policy, written beside its history.
CEILING_NAME = "ceiling_end.json"


def end_ceiling(run_dir: Path) -> dict | None:
    """The EV ceilings of ``run_dir``'s last checkpoint (K x P = 16 x 64 training prompts,
    ``benchmarks/critic_ceiling.py``), measured once and cached in the run directory:
    ``{"token": x, "within_prompt": y}`` (``within_prompt`` ``None`` in a cache written before the
    tool measured it); ``None`` without a checkpoint."""
    import subprocess

    out = run_dir / CEILING_NAME
    if not out.is_file():
        if not any((run_dir / "checkpoints").glob("step_*")):
            return None
        cmd = [
            sys.executable,
            str(ROOT / "benchmarks" / "critic_ceiling.py"),
            "--run",
            str(run_dir),
        ]
        cmd += ["--samples", "16", "--prompts", "64", "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    results = json.loads(out.read_text())["results"]
    within = results.get("within_prompt")
    return {
        "token": results["token"]["ceiling"],
        "within_prompt": within["ceiling"] if within else None,
    }


def recorded_runs(
    out: Path, args: argparse.Namespace, variants: dict[str, tuple[str, ...]]
) -> dict[tuple[str, int], dict]:
    """The finished runs ``out`` (an earlier report of this task and variant set) recorded:
    ``(variant, seed) -> summary``, only where the variant's overrides and the iteration count are
    still the same. A report merges them with the runs on disk, so the table grows across sittings
    on machines that do not keep ``outputs/`` (each summary names the commit it ran at: ``commit``,
    or the report's for summaries written before runs carried their own).

    Example:
        >>> import argparse, json, tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> old = {"task": "t", "variant_set": "matched", "iterations": 2,
        ...        "code": {"commit": "abc"},
        ...        "variants": {"a": {"overrides": ["x=1"], "runs": [{"seed": 0}]},
        ...                     "b": {"overrides": ["y=1"], "runs": [{"seed": 0}]}}}
        >>> _ = (d / "r.json").write_text(json.dumps(old))
        >>> args = argparse.Namespace(task="t", variants="matched", iterations=2)
        >>> recorded_runs(d / "r.json", args, {"a": ("x=1",), "b": ("y=2",)})
        {('a', 0): {'commit': 'abc', 'seed': 0}}
    """
    if not out.is_file():
        return {}
    old = json.loads(out.read_text())
    if (old.get("task"), old.get("variant_set", "critic"), old.get("iterations")) != (
        args.task,
        args.variants,
        args.iterations,
    ):
        return {}
    commit = (old.get("code") or {}).get("commit")
    kept = {}
    for name, v in old.get("variants", {}).items():
        if name in variants and list(v["overrides"]) == list(variants[name]):
            for run in v["runs"]:
                kept[name, run["seed"]] = {"commit": commit, **run}
    return kept


def measure(args: argparse.Namespace) -> dict:
    variants = variants_of(args)
    names = args.only or list(variants)
    unknown = sorted(set(names) - set(variants))
    if unknown:
        raise SystemExit(
            f"--only {unknown}: not in --variants {args.variants} on --task {args.task}"
        )
    cache = Path(os.environ.get("AR_TORCHRL_CACHE", ROOT / ".cache" / "ar_torchrl"))
    tmp = tempfile.TemporaryDirectory(prefix="critic_budget_") if args.quick else None
    runs = Path(tmp.name) if tmp else args.runs / args.task
    if args.variants != "critic" and not tmp:
        runs = args.runs.parent / args.variants / args.task
    # the report covers every arm and the task's seeds (--only / --seeds choose what runs), so a
    # partial sitting does not drop from args.out the runs it recorded before
    report_seeds = args.seeds if tmp else max(args.seeds, TASKS[args.task][1])
    dirs = {  # seed-major: a sitting that stops early has compared every arm at the first seeds
        (name, seed): runs / f"{name}_it{args.iterations}_s{seed}"
        for seed in range(report_seeds)
        for name in variants
    }
    # finished runs an earlier sitting recorded in args.out (a fresh machine has no run dirs)
    recorded = {} if tmp else recorded_runs(args.out, args, variants)
    on_disk = {key for key, run_dir in dirs.items() if read_history(run_dir)}
    todo = {
        (name, seed): d
        for (name, seed), d in dirs.items()
        if name in names
        and seed < args.seeds
        and ((name, seed) in on_disk or (name, seed) not in recorded)
    }
    if recorded:
        kept = sorted(set(recorded) - on_disk)
        print(f"{len(kept)} finished runs kept from {args.out} (no run dir here): {kept}")
    if not args.report_only:
        slots, alone = Slots(args.jobs), ALONE.get(args.task, frozenset())
        start = time.monotonic()
        late: list[str] = []

        def scheduled(ticket: int, name: str, seed: int, run_dir: Path) -> None:
            with slots.hold(ticket, args.jobs if name in alone else 1):
                waited = (time.monotonic() - start) / 60
                if args.start_within is None or waited <= args.start_within:
                    one_run(args, name, seed, run_dir, cache)
                else:
                    late.append(run_dir.name)

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [
                pool.submit(scheduled, slots.ticket(), name, seed, run_dir)
                for (name, seed), run_dir in todo.items()
            ]
            for future in futures:
                future.result()
        if late:
            print(f"not started (--start-within {args.start_within:g} min): {sorted(late)}")
    results: dict[str, list[dict]] = {}
    code = code_version()
    for (name, seed), run_dir in dirs.items():
        history = read_history(run_dir)
        if (name, seed) not in on_disk and (name, seed) in recorded:
            results.setdefault(name, []).append(recorded[name, seed])
        elif _finished(history, args.iterations):
            n = samples_per_prompt(variants[name])
            summary = {"seed": seed, "commit": code["commit"], **summarize(history, n)}
            if (sittings := sittings_of(run_dir)) is not None:
                summary["sittings"] = sittings
            if args.ceilings or (run_dir / CEILING_NAME).is_file():
                ceilings = end_ceiling(run_dir) or {}
                summary["ceiling_end"] = ceilings.get("token")
                summary["ceiling_within_prompt_end"] = ceilings.get("within_prompt")
            results.setdefault(name, []).append(summary)
    if tmp:
        tmp.cleanup()
    return {
        "machine": machine_info(),
        "code": code,
        "task": args.task,
        "variant_set": args.variants,
        "iterations": args.iterations,
        "variants": {
            name: {"overrides": list(variants[name]), "runs": results[name]}
            for name in variants
            if name in results
        },
    }


def _span(xs: list[float], fmt: str) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(sum(xs) / len(xs), fmt)} [{format(min(xs), fmt)}, {format(max(xs), fmt)}]"


def table(result: dict) -> str:
    """A markdown table: one row per variant (mean and [min, max] over its seeds)."""
    lines = [
        "| variant | overrides | seeds | reward rise | held-out acc. start -> end | "
        "`train/explained_variance` | `critic/explained_variance`, last 20 % | s / iteration | "
        "finite |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in result["variants"].items():
        runs = v["runs"]
        ev = [r["explained_variance"] for r in runs if r["explained_variance"] is not None]
        late = [  # absent from runs made before the metric existed
            r["critic_explained_variance_late"]
            for r in runs
            if r.get("critic_explained_variance_late") is not None
        ]
        acc0 = _span([r["eval_accuracy_start"] or 0.0 for r in runs], ".2f")
        acc1 = _span([r["eval_accuracy_end"] or 0.0 for r in runs], ".2f")
        lines.append(
            f"| {name} | {' '.join(f'`{o}`' for o in v['overrides'])} | {len(runs)} | "
            f"{_span([r['reward_rise'] for r in runs], '+.2f')} | {acc0} -> {acc1} | "
            f"{_span(ev, '.3f')} | {_span(late, '.3f')} | "
            f"{_span([r['seconds_per_iteration'] for r in runs], '.2f')} | "
            f"{'yes' if all(r['all_finite'] for r in runs) else 'NO'} |"
        )
    return "\n".join(lines)


#: The critic's EV ceiling on critic_arithmetic's warm start (token level, K x P = 32 x 128;
#: benchmarks/results/critic_ceiling_critic_arithmetic.json): what a perfect critic could explain.
CEILING_FILE = ROOT / "benchmarks" / "results" / "critic_ceiling_{task}.json"


def _ceiling(task: str) -> float | None:
    config = TASKS[task][0]  # the ceiling files are named after the config
    name = config[config.index("--config-name") + 1] if "--config-name" in config else task
    path = Path(str(CEILING_FILE).format(task=name))
    if not path.is_file():
        return None
    return json.loads(path.read_text())["results"]["token"]["ceiling"]


def matched_table(result: dict) -> str:
    """The matched-token table: one row per arm (mean and [min, max] over its seeds), with the
    generated tokens, the reward rise, the held-out greedy accuracy, the critic's out-of-sample EV
    over the last 20 % of iterations against the task's token-level ceiling, s / iteration, and
    s / iteration over the first arm's with the same seed where both ran in one sitting
    (:func:`same_sitting`: seeds, and sometimes the arms of one seed, run in sittings on machines of
    different speed; "-" where the first arm's run of that seed ran elsewhere)."""
    ceiling = _ceiling(result["task"])
    lines = [
        "| arm | overrides | seeds | generated tokens (M) | reward rise | "
        "held-out acc. start -> end | `critic/explained_variance`, last 20 % | "
        "token-level ceiling at the end | within prompt, last 20 % (ceiling at the end) | "
        "s / iteration | time / first arm's, same seed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    first = next(iter(result["variants"].values()), {"runs": []})
    base = {r["seed"]: r for r in first["runs"]}

    def over_first(r: dict) -> float | None:
        b = base.get(r["seed"])
        if b is None or not b["seconds_per_iteration"] or not same_sitting(r, b):
            return None
        return r["seconds_per_iteration"] / b["seconds_per_iteration"]

    for name, v in result["variants"].items():
        runs = v["runs"]
        ev = [
            r["critic_explained_variance_late"]
            for r in runs
            if r.get("critic_explained_variance_late") is not None
        ]
        within = [
            r["critic_within_prompt_late"]
            for r in runs
            if r.get("critic_within_prompt_late") is not None
        ]
        within_ceiling = [
            r["ceiling_within_prompt_end"]
            for r in runs
            if r.get("ceiling_within_prompt_end") is not None
        ]
        acc0 = _span([r["eval_accuracy_start"] or 0.0 for r in runs], ".2f")
        acc1 = _span([r["eval_accuracy_end"] or 0.0 for r in runs], ".2f")
        lines.append(
            f"| {name} | {' '.join(f'`{o}`' for o in v['overrides'])} | {len(runs)} | "
            f"{_span([r['generated_tokens'] / 1e6 for r in runs], '.3g')} | "
            f"{_span([r['reward_rise'] for r in runs], '+.2f')} | {acc0} -> {acc1} | "
            f"{_span(ev, '.3f')} | "
            f"{_span([r['ceiling_end'] for r in runs if r.get('ceiling_end') is not None], '.2f')} | "
            f"{_span(within, '.3f')} ({_span(within_ceiling, '.2f')}) | "
            f"{_span([r['seconds_per_iteration'] for r in runs], '.2f')} | "
            f"{_span([x for x in map(over_first, runs) if x is not None], '.2f')} |"
        )
    start = f"; the starting policy's ceiling is {ceiling:.2f}" if ceiling is not None else ""
    return "\n".join(lines) + (
        f"\n\nCeilings: what a perfect critic of the run's final policy could explain (16 x 64, "
        f"`benchmarks/critic_ceiling.py --run <run dir>`){start}."
    )


def plot(result: dict, png: Path) -> None:
    """Left: sampled reward per iteration (``--variants matched``: against the generated tokens;
    mean over seeds, each run thin); middle: held-out greedy accuracy per evaluation; right
    (matched): the critic's out-of-sample ``critic/explained_variance`` against the ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matched = result.get("variant_set") == "matched"
    fig, axes = plt.subplots(1, 3 if matched else 2, figsize=(15 if matched else 10, 3.6))
    left, right = axes[0], axes[1]
    curve = "reward_curve_tokens" if matched else "reward_curve"
    for name, v in result["variants"].items():
        color, runs = COLORS.get(name), v["runs"]
        for r in runs:
            left.plot(*zip(*r[curve]), color=color, alpha=0.15, lw=0.6)
        label = f"{name} ({len(runs)} seeds)"
        if not matched:
            left.plot(*seed_mean([r[curve] for r in runs]), color=color, lw=1.6, label=label)
        else:  # token counts differ between seeds: the mean over seeds per iteration
            mean_x = seed_mean([[(i, x) for i, (x, _) in enumerate(r[curve])] for r in runs])[1]
            mean_y = seed_mean([[(i, y) for i, (_, y) in enumerate(r[curve])] for r in runs])[1]
            left.plot(mean_x, mean_y, color=color, lw=1.6, label=label)
        right.plot(
            *seed_mean([r["eval_curve"] for r in runs]),
            color=color,
            lw=1.6,
            marker="o",
            label=label,
        )
        if matched and any(r.get("critic_ev_curve") for r in runs):
            axes[2].plot(
                *seed_mean([r["critic_ev_curve"] for r in runs if r.get("critic_ev_curve")]),
                color=color,
                lw=1.2,
                label=name,
            )
    left.set(
        title=f"sampled reward ({result['task']})",
        xlabel="generated tokens (M)" if matched else "iteration",
        ylim=(-1.05, 1.05),
    )
    right.set(title="greedy held-out accuracy", xlabel="iteration", ylim=(0, 1.02))
    if matched:
        ceiling = _ceiling(result["task"])
        if ceiling is not None:
            axes[2].axhline(ceiling, color="k", ls="--", lw=0.8, label="token-level ceiling")
        axes[2].set(
            title="critic/explained_variance (out of sample)",
            xlabel="iteration",
            ylim=(-0.5, 1.0),
        )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=80)
    plt.close(fig)


def render(result: dict) -> str:
    """The table of ``result``'s variant set."""
    return matched_table(result) if result.get("variant_set") == "matched" else table(result)


def _stem(variants: str, task: str) -> str:
    return f"{'critic_budget' if variants == 'critic' else variants}_{task}"


def begin_end(stem: str) -> tuple[str, str]:
    return f"<!-- {stem}:begin -->", f"<!-- {stem}:end -->"


def docs_block(result: dict) -> str:
    """The block of docs/evidence.md for ``result``: the table and where it comes from."""
    stem = _stem(result.get("variant_set", "critic"), result["task"])
    m, (begin, end) = result["machine"], begin_end(stem)
    runs = [r for v in result["variants"].values() for r in v["runs"]]
    seeds = max((len(v["runs"]) for v in result["variants"].values()), default=0)
    flags = "" if seeds == TASKS[result["task"]][1] else f"--seeds {seeds} "
    flags += "--ceilings " if any(r.get("ceiling_end") is not None for r in runs) else ""
    return (
        f"{begin}\n{render(result)}\n\n{result['iterations']} iterations per run, mean [min, max] over "
        f"the seeds; written by `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/experiments/critic_budget.py "
        f"--task {result['task']} --variants {result.get('variant_set', 'critic')} {flags}--jobs 2 "
        f"--write-docs` (`benchmarks/results/{stem}.json`; torch {m['torch']}, "
        f"{m['cpu_count']} cores).\n{end}"
    )


def write_docs(block: str, stem: str, page: Path = DOCS_PAGE) -> None:
    """Replace ``page``'s ``<stem>`` block (e.g. ``critic_budget_cpu``) with ``block``."""
    replace_marked_block(page, *begin_end(stem), block)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = measure(args)
    if not result["variants"]:
        raise SystemExit(f"no finished run under {args.runs / args.task}")
    write_json(result, args.out)
    plot(result, args.png)
    print(render(result))
    if args.write_docs:
        write_docs(docs_block(result), _stem(args.variants, args.task))
    print(f"\nwrote {args.out} and {args.png}", file=sys.stderr)


if __name__ == "__main__":
    main()
