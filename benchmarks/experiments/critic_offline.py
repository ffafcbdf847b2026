"""Why the critic stays far below its ceiling on ``critic_arithmetic``: the same saved rollouts of a
fixed policy, critics trained offline on them in several ways, each measured on held-out batches.

The matched-token table (docs/evidence.md) found both critics at 5-7 % of the EV ceiling during
PPO. Two explanations predict different things: a critic that *could* learn the value but cannot
keep up with a moving policy reaches the ceiling once the policy stands still and it has as many
passes over the data as it likes; a critic that cannot learn what the ceiling counts stays low even
then. This script holds the policy still and removes the time limit:

1. ``source``: ``critic=separate`` on ``--config-name critic_arithmetic`` for ``--iterations``
   critic-only iterations (``algo.critic_warmup_iters``: the policy stays the warm start, bit for
   bit), saving every batch (``train.save_rollouts=true``); its online ``critic/explained_variance``
   per iteration is the fixed-policy online curve.
2. one run per arm: ``critic.pretrain_from=<source>`` for ``--epochs`` passes over the saved
   batches (every 10th held out, never trained on), logging per epoch the held-out
   ``critic/explained_variance``, its early / middle / late thirds, and
   ``critic/explained_variance_within_prompt`` (what the critic knows beyond the prompt: 0 for a
   critic that only learned how hard each prompt is).

Arms (``ARMS``): the separate critic at the recipe's defaults, at 3x lower and 3x higher value lr,
with Monte-Carlo targets and no value clipping, and with two more (identity-initialised) layers;
the shared value head (a head on the frozen policy trunk: the linear probe); the separate critic
with ``critic.confidence_features=true`` (it also reads the policy's sampling log-probs). The ceilings quoted
beside them are ``benchmarks/critic_ceiling.py``'s of the same warm start
(``benchmarks/results/critic_ceiling_critic_arithmetic.json``).

Runs live in ``--runs`` (default ``outputs/critic_offline``); finished runs are not repeated.

Commands::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/experiments/critic_offline.py --jobs 2 --write-docs
    .venv/bin/python benchmarks/experiments/critic_offline.py --report-only --write-docs
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # benchmarks/_common.py
from _common import code_version, machine_info, read_history, replace_marked_block, write_json

from ar_torchrl.objectives.metrics import CRITIC_HEALTH_KEYS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "dapo_ppo.py"
DOCS_PAGE = ROOT / "docs" / "evidence.md"
CEILING = ROOT / "benchmarks" / "results" / "critic_ceiling_critic_arithmetic.json"
CONFIG = "critic_arithmetic"
COMMON = ("train.eval_every=0", "train.plot=false", "logger=none")
#: arm -> recipe overrides of the offline run (``deeper`` also swaps in a deepened critic model).
ARMS: dict[str, tuple[str, ...]] = {
    "separate (defaults)": ("critic=separate",),
    "separate, value_lr 1e-3": ("critic=separate", "algo.value_lr=1e-3"),
    "separate, value_lr 1e-2": ("critic=separate", "algo.value_lr=1e-2"),
    "separate, MC targets, no value clip": (
        "critic=separate",
        "algo.gae.critic_lmbda=1.0",
        "algo.clip_value=null",
    ),
    "separate, +2 layers": ("critic=separate",),
    "shared head (linear probe)": ("critic=shared",),
    "separate + confidence features": ("critic=separate", "critic.confidence_features=true"),
}
#: the arm whose critic is the policy deepened by :data:`EXTRA_LAYERS` identity layers
DEEPER = "separate, +2 layers"
EXTRA_LAYERS = 2
#: the explained variances of critic health (overall, early / middle / late third, within prompt)
KEYS = tuple(k for k in CRITIC_HEALTH_KEYS if k.startswith("critic/explained_variance"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=Path, default=ROOT / "outputs" / "critic_offline")
    p.add_argument("--iterations", type=int, default=60, help="source: critic-only iterations")
    p.add_argument("--epochs", type=int, default=6, help="offline passes per arm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--write-docs", action="store_true")
    p.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "critic_offline.json"
    )
    return p.parse_args(argv)


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}


def _recipe(run_dir: Path, *overrides: str) -> float:
    cmd = [sys.executable, str(SCRIPT), "--config-name", CONFIG, f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    proc = subprocess.run(
        [*cmd, *COMMON, *overrides], cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd + list(overrides))} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def _deepen(source_model: Path, out: Path, extra: int) -> Path:
    """``source_model`` (a Llama/Qwen-style HF causal LM) with ``extra`` layers appended, each a copy
    of its last layer whose attention and MLP output projections are zero: the residual stream, and
    so every output, is unchanged at initialisation (checked)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").is_file():
        return out
    model = AutoModelForCausalLM.from_pretrained(source_model)
    tok = AutoTokenizer.from_pretrained(source_model)
    layers = model.model.layers
    for _ in range(extra):
        layer = copy.deepcopy(layers[-1])
        layer.self_attn.layer_idx = len(layers)
        torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
        torch.nn.init.zeros_(layer.mlp.down_proj.weight)
        layers.append(layer)
    model.config.num_hidden_layers = len(layers)
    if getattr(model.config, "layer_types", None) is not None:
        model.config.layer_types = [model.config.layer_types[-1]] * len(layers)
    ids = tok("12 + 3", return_tensors="pt")
    before = AutoModelForCausalLM.from_pretrained(source_model)(**ids).logits
    with torch.no_grad():
        if not torch.allclose(model(**ids).logits, before, atol=1e-6):
            raise RuntimeError("the deepened model does not reproduce the source model's logits")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run_all(args: argparse.Namespace) -> None:
    source = args.runs / "source"
    if (
        not (source / "rollouts").is_dir()
        or len(list((source / "rollouts").iterdir())) < args.iterations
    ):
        print(f"source: {args.iterations} critic-only iterations ...", file=sys.stderr)
        _recipe(
            source,
            "critic=separate",
            f"train.iterations={args.iterations}",
            f"algo.critic_warmup_iters={args.iterations}",
            "train.save_rollouts=true",
            "train.export=true",  # run_dir/policy/: the warm start, unchanged (critic-only iterations)
            f"seed={args.seed}",
        )

    def one(arm: str) -> None:
        run_dir = args.runs / _slug(arm)
        log = run_dir / "critic_pretrain.jsonl"
        if log.is_file() and len(log.read_text().splitlines()) >= args.epochs:
            return
        extra: list[str] = []
        if arm == DEEPER:
            model = args.runs / "deeper_model"
            extra = [f"critic.model_path={model}"]
        print(f"{arm}: {args.epochs} epochs ...", file=sys.stderr)
        _recipe(
            run_dir,
            *ARMS[arm],
            *extra,
            f"critic.pretrain_from={source}",
            f"critic.pretrain_epochs={args.epochs}",
            "train.iterations=1",
            "train.export=false",
            f"seed={args.seed}",
        )

    if DEEPER in ARMS:  # built once, before the arms run side by side
        _deepen(source / "policy", args.runs / "deeper_model", EXTRA_LAYERS)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, ARMS))


def _slug(arm: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in arm).strip("_")


def summarize(args: argparse.Namespace) -> dict:
    source = read_history(args.runs / "source")
    online = [
        h.get("critic/explained_variance") for h in source if "critic/explained_variance" in h
    ]
    tail = [h for h in source if "critic/explained_variance" in h][-10:]
    result = {
        "config": {"iterations": args.iterations, "epochs": args.epochs, "seed": args.seed},
        "machine": machine_info(),
        "code": code_version(),
        "source_online": {
            "critic/explained_variance": online,
            "last_10": {k: _mean([h.get(k) for h in tail]) for k in KEYS},
        },
        "arms": {},
    }
    for arm in ARMS:
        log = args.runs / _slug(arm) / "critic_pretrain.jsonl"
        if log.is_file():
            records = [json.loads(x) for x in log.read_text().splitlines()]
            result["arms"][arm] = {"overrides": list(ARMS[arm]), "epochs": records}
    if CEILING.is_file():
        c = json.loads(CEILING.read_text())["results"]
        result["ceiling"] = {
            "critic/explained_variance": c["token"]["ceiling"],
            **{f"critic/explained_variance_{k}": v["ceiling"] for k, v in c["by_position"].items()},
        }
        if c.get("within_prompt"):
            result["ceiling"]["critic/explained_variance_within_prompt"] = c["within_prompt"][
                "ceiling"
            ]
    return result


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(result: dict) -> str:
    head = "| critic | epochs | held-out EV | early | middle | late | within prompt | value loss |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for arm, r in result["arms"].items():
        best = max(r["epochs"], key=lambda e: e.get("critic/explained_variance", float("-inf")))
        last = r["epochs"][-1]
        lines.append(
            f"| {arm} | {len(r['epochs'])} | {_f(last.get(KEYS[0]))} (best {_f(best.get(KEYS[0]))}, "
            f"epoch 1 {_f(r['epochs'][0].get(KEYS[0]))}) | "
            + " | ".join(_f(last.get(k)) for k in KEYS[1:])
            + f" | {_f(last.get('train/loss_critic'))} |"
        )
    s = result["source_online"]["last_10"]
    lines.append(
        f"| online, same policy (source run, last 10 of {result['config']['iterations']} iterations) | - | "
        + " | ".join(_f(s.get(k)) for k in KEYS)
        + " | - |"
    )
    if "ceiling" in result:
        c = result["ceiling"]
        lines.append(
            "| **ceiling** (a perfect critic of this policy) | - | "
            + " | ".join(_f(c.get(k)) for k in KEYS)
            + " | - |"
        )
    return "\n".join(lines)


BEGIN, END = "<!-- critic_offline:begin -->", "<!-- critic_offline:end -->"


def docs_block(result: dict) -> str:
    """The evidence page's block, markers included."""
    cfg = result["config"]
    return (
        BEGIN
        + "\n"
        + (
            table(result) + "\n\nHeld-out: every 10th of the source run's "
            f"{cfg['iterations']} saved batches (64 prompts x 4 samples each), after the last of "
            f"{cfg['epochs']} epochs; seed {cfg['seed']}. Written by `OMP_NUM_THREADS=1 .venv/bin/python "
            "benchmarks/experiments/critic_offline.py --jobs 2 --write-docs` "
            f"(`benchmarks/results/critic_offline.json`; torch {result['machine'].get('torch')}, "
            f"{result['machine'].get('cpu_count')} cores)."
        )
        + "\n"
        + END
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.report_only:
        run_all(args)
    result = summarize(args)
    write_json(result, args.out)
    print(table(result))
    if args.write_docs:
        replace_marked_block(DOCS_PAGE, BEGIN, END, docs_block(result))
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
