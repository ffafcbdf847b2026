"""Can the critic *represent* the value of ``critic_arithmetic``, or only not *learn* it from returns?

The offline study (``critic_offline.py``) found every critic flat within a response: it learns
how hard each prompt is and nothing about the response (``critic/explained_variance_within_prompt``
~ 0), although a perfect critic would explain 0.54 of the within-prompt variance. Two causes
predict different things when the same critic architecture is trained on the same samples with a
*denoised* target:

* **raw**: each trained token's Monte-Carlo return ``R`` (+-1: what PPO's critic regresses on with
  ``critic_lmbda = 1``);
* **state mean**: the mean ``R`` over every training sample that passed through the token's state
  (prompt + response prefix; the ceiling tool's grouping), i.e. an estimate of ``E[R | s]`` from
  ``K`` samples per prompt, the target a VinePPO-style Monte-Carlo value estimate gives.

If the critic fits the state means and then predicts held-out prompts' returns beyond the prompt,
it can represent the value and the ``+-1`` targets are too noisy for it at this budget; if it fails
on the state means too, it cannot represent it. Both arms: a copy of the warm-start policy with a
zero value head (:func:`~ar_torchrl.modules.build_separate_critic`, the recipe's
``critic=separate``), AdamW at the recipe's ``algo.value_lr`` (3e-3), gradient clip 1, 256 samples
per step, the same steps; evaluated after each epoch on held-out *prompts* against their raw returns
(``critic/explained_variance``, its thirds, and within prompts), beside their ceilings.

Command::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/experiments/critic_targets.py --write-docs
    .venv/bin/python benchmarks/experiments/critic_targets.py --report-only --write-docs
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # benchmarks/_common.py
from _common import code_version, machine_info, replace_marked_block, write_json

from ar_torchrl.objectives.metrics import CRITIC_HEALTH_KEYS

ROOT = Path(__file__).resolve().parents[2]
DOCS_PAGE = ROOT / "docs" / "evidence.md"
#: the explained variances of critic health (overall, early / middle / late third, within prompt)
KEYS = tuple(k for k in CRITIC_HEALTH_KEYS if k.startswith("critic/explained_variance"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config-name", default="critic_arithmetic")
    p.add_argument("--train-prompts", type=int, default=128)
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=16, help="K samples per prompt")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=256, help="samples per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-docs", action="store_true")
    p.add_argument("--report-only", action="store_true", help="table and docs from --out's JSON")
    p.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "critic_targets.json"
    )
    return p.parse_args(argv)


def sample(cfg, prompts: int, samples: int, seed: int):
    """``prompts`` x ``samples`` trajectories of the configuration's starting policy, as one padded
    batch: ``tokens``, ``attention_mask``, ``loss_mask``, ``returns`` (Monte-Carlo, gamma = 1),
    ``states`` (prefix ids), ``prompt`` (an id per row); and the policy."""
    import torch

    from ar_torchrl.functional import monte_carlo_returns, prefix_state_ids
    from ar_torchrl.recipes.ceiling import _padded, _stack, sampling_env_of_config

    env, model = sampling_env_of_config(
        cfg, prompts=prompts, samples_per_prompt=samples, prompts_per_batch=16, seed=seed
    )
    with torch.no_grad():
        batches = [env.collect() for _ in range(-(-prompts // env.prompts_per_batch))]
    b = _stack(batches)
    width = b["tokens"].shape[1]
    log_prob = torch.cat([_padded(td, "rollout_log_prob", width, 0.0) for td in batches])
    mask = b["loss_mask"]
    states = prefix_state_ids(b["tokens"], b["attention_mask"])
    first = mask.long().argmax(-1, keepdim=True)
    return {
        "tokens": b["tokens"],
        "attention_mask": b["attention_mask"],
        "loss_mask": mask,
        "returns": monte_carlo_returns(b["reward"], mask, gamma=1.0),
        "states": states,
        "prompt": states.gather(1, first).squeeze(1),  # the prompt's state id, one per row
        "log_prob": log_prob,  # the policy's log-prob of each sampled token
    }, model


def state_means(data: dict):
    """Each trained token's target ``E[R | s]`` estimated by the mean return over the training
    tokens in its state (itself included)."""
    import torch

    mask = data["loss_mask"]
    _, inverse = torch.unique(data["states"][mask], return_inverse=True)
    r = data["returns"][mask].double()
    n = torch.bincount(inverse).double()
    mean = torch.zeros(len(n), dtype=torch.float64).index_add_(0, inverse, r) / n
    out = torch.zeros_like(data["returns"])
    out[mask] = mean[inverse].to(out.dtype)
    return out


def evaluate(critic, data: dict) -> dict[str, float]:
    """The critic's values on ``data`` against its Monte-Carlo returns: the definitions of
    :func:`~ar_torchrl.objectives.metrics.critic_health` (overall, thirds, within prompts)."""
    import torch

    return value_metrics(_values(critic, data, torch.arange(len(data["tokens"])), grad=False), data)


def value_metrics(values, data: dict) -> dict[str, float]:
    """``values`` (``[B, L]``) against ``data``'s Monte-Carlo returns: EV overall, by third and
    within prompts."""

    from ar_torchrl.functional import (
        explained_variance_or_nan,
        explained_variance_within_groups,
        position_thirds,
    )

    mask, returns = data["loss_mask"], data["returns"]
    out = {KEYS[0]: explained_variance_or_nan(values, returns, mask)}
    third = position_thirds(mask)
    for i, name in enumerate(("early", "middle", "late")):
        out[f"critic/explained_variance_{name}"] = explained_variance_or_nan(
            values, returns, mask & (third == i)
        )
    prompt = data["prompt"].unsqueeze(-1).expand_as(mask)
    out[KEYS[-1]] = explained_variance_within_groups(values[mask], returns[mask], prompt[mask])
    return {k: float(v) for k, v in out.items()}


#: bin edges of the lowest sampled-token log-prob so far (:func:`confidence_features`)
LOG_PROB_BINS = (-20.0, -8.0, -5.0, -3.0, -2.0, -1.5, -1.0, -0.7, -0.5, -0.3, -0.2, -0.1, -0.05)


def confidence_features(data: dict):
    """Two functions of each trained token's state: the prompt's length (how hard the problem is,
    here) and the bin of the lowest log-prob the policy gave a token it sampled *before* this one
    (0 before the first): ``[B, L]`` int64 each."""
    import torch

    mask = data["loss_mask"]
    low = torch.cummin(torch.where(mask, data["log_prob"], 0.0), dim=1).values
    before = torch.cat([torch.zeros_like(low[:, :1]), low[:, :-1]], dim=1)
    first = mask.long().argmax(-1, keepdim=True)
    prompt_len = (data["attention_mask"].long().cumsum(-1).gather(1, first) - 1).expand_as(mask)
    return prompt_len, torch.bucketize(before.contiguous(), torch.tensor(LOG_PROB_BINS))


def lookup_values(train: dict, data: dict, *, confidence: bool):
    """A table, not a network: the mean training return of each (prompt length[, log-prob bin]),
    looked up for ``data``'s trained tokens (an unseen key: its prompt length's mean, then the
    overall mean)."""
    import torch

    def keys(d):
        length, low = confidence_features(d)
        return length * 100 + (low if confidence else 0), length

    (k_tr, len_tr), (k_ev, len_ev) = keys(train), keys(data)
    m = train["loss_mask"]
    r = train["returns"][m].double()

    def table(k):
        u, inv = torch.unique(k[m], return_inverse=True)
        mean = torch.zeros(len(u), dtype=torch.float64).index_add_(0, inv, r) / torch.bincount(inv)
        return dict(zip(u.tolist(), mean.tolist()))

    full, by_length, overall = table(k_tr), table(len_tr), float(r.mean())
    out = [
        full.get(a, by_length.get(b, overall))
        for a, b in zip(k_ev.reshape(-1).tolist(), len_ev.reshape(-1).tolist())
    ]
    return torch.tensor(out, dtype=torch.float32).reshape(k_ev.shape)


def _values(critic, data: dict, rows, *, grad: bool):
    import torch
    from tensordict import TensorDict

    td = TensorDict(
        {
            "tokens": data["tokens"][rows],
            "attention_mask": data["attention_mask"][rows],
            "rollout_log_prob": data["log_prob"][rows],  # read by value_head.confidence
            "loss_mask": data["loss_mask"][rows],
        },
        batch_size=[len(rows)],
    )
    with torch.set_grad_enabled(grad):
        return critic(td)["state_value"].reshape(td["tokens"].shape)


def train(critic, data: dict, target, args, evaluate_on: dict, label: str) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(critic.parameters(), lr=args.lr, weight_decay=0.0)
    mask = data["loss_mask"]
    records = []
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(mask), generator=g)
        losses = []
        for start in range(0, len(order), args.batch):
            rows = order[start : start + args.batch]
            v = _values(critic, data, rows, grad=True)
            m = mask[rows]
            loss = 0.5 * ((v - target[rows]) ** 2)[m].mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
            opt.step()
            losses.append(float(loss.detach()))
        record = {"epoch": epoch, "loss": sum(losses) / len(losses)}
        record.update(evaluate(critic, evaluate_on))
        records.append(record)
        print(
            f"{label} epoch {epoch}: loss {record['loss']:.4f}, held-out EV "
            f"{record.get(KEYS[0], float('nan')):.3f}, within prompt "
            f"{record.get(KEYS[-1], float('nan')):.3f}",
            file=sys.stderr,
        )
    return records


def measure(args: argparse.Namespace) -> dict:
    import torch
    from critic_ceiling import compose

    from ar_torchrl.modules import attach_confidence_features, build_separate_critic
    from ar_torchrl.recipes.ceiling import ceiling_from_trajectories  # noqa: F401 (docs)

    torch.manual_seed(args.seed)
    cfg = compose(args.config_name, [])
    start = time.perf_counter()
    total = args.train_prompts + args.eval_prompts
    data, policy = sample(cfg, total, args.samples, args.seed)
    # split by prompt: the held-out prompts are never trained on
    prompts = torch.unique(data["prompt"])
    held = prompts[torch.randperm(len(prompts), generator=torch.Generator().manual_seed(1))][
        : max(1, len(prompts) * args.eval_prompts // total)
    ]
    is_held = torch.isin(data["prompt"], held)
    split = {
        name: {k: v[sel] for k, v in data.items()}
        for name, sel in (("train", ~is_held), ("eval", is_held))
    }
    sampled_s = time.perf_counter() - start
    targets = {"raw returns": split["train"]["returns"], "state means": state_means(split["train"])}
    arms = {}
    for label, target in targets.items():
        critic = build_separate_critic(copy.deepcopy(policy))
        arms[label] = train(critic, split["train"], target, args, split["eval"], label)
    label = "raw returns, + an MLP of the sampling log-probs so far"
    critic = build_separate_critic(copy.deepcopy(policy))
    attach_confidence_features(critic.model)  # critic.confidence_features=true
    arms[label] = train(critic, split["train"], targets["raw returns"], args, split["eval"], label)
    lookups = {
        "(table) prompt length only": False,
        "(table) prompt length + lowest sampled log-prob so far": True,
    }
    for label, confidence in lookups.items():
        values = lookup_values(split["train"], split["eval"], confidence=confidence)
        arms[label] = [{"epoch": 0, "loss": float("nan"), **value_metrics(values, split["eval"])}]
    ceilings = _ceilings(split["eval"])
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine_info(),
        "code": code_version(),
        "rows": {k: int(len(v["tokens"])) for k, v in split.items()},
        "prompts": {"train": int(len(prompts) - len(held)), "eval": int(len(held))},
        "sampling_s": sampled_s,
        "seconds": time.perf_counter() - start,
        "arms": arms,
        "ceiling_eval": ceilings,
    }


def _ceilings(data: dict) -> dict[str, float]:
    """The held-out prompts' own ceilings (token level, thirds, within prompt; no bootstrap)."""
    import torch

    from ar_torchrl.functional import ev_ceiling, ev_ceiling_within_groups, position_thirds

    mask = data["loss_mask"]
    r, s = data["returns"][mask], data["states"][mask]
    prompt = data["prompt"].unsqueeze(-1).expand_as(mask)[mask]
    rows = torch.arange(mask.shape[0]).unsqueeze(-1).expand_as(mask)[mask]
    out = {KEYS[0]: ev_ceiling(r, s, bootstrap=0).ceiling}
    third = position_thirds(mask)[mask]
    for i, name in enumerate(("early", "middle", "late")):
        out[f"critic/explained_variance_{name}"] = ev_ceiling(
            r[third == i], s[third == i], bootstrap=0
        ).ceiling
    out[KEYS[-1]] = ev_ceiling_within_groups(r, s, prompt, rows, bootstrap=0).ceiling
    return out


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(result: dict) -> str:
    lines = [
        "| critic trained on | epochs (steps) | held-out EV | early | middle | late | within prompt | loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    steps = -(-result["rows"]["train"] // result["config"]["batch"])
    for label, records in result["arms"].items():
        last = records[-1]
        trained = records[-1]["epoch"] > 0
        lines.append(
            f"| {label} | {f'{len(records)} ({len(records) * steps})' if trained else '-'} | "
            + " | ".join(_f(last.get(k)) for k in KEYS)
            + f" | {last['loss']:.4f} |".replace("| nan |", "| - |")
        )
    c = result["ceiling_eval"]
    lines.append(
        "| **ceiling** of the held-out prompts | - | "
        + " | ".join(_f(c.get(k)) for k in KEYS)
        + " | - |"
    )
    return "\n".join(lines)


BEGIN, END = "<!-- critic_targets:begin -->", "<!-- critic_targets:end -->"


def docs_block(result: dict) -> str:
    """The evidence page's block, markers included."""
    cfg = result["config"]
    return (
        BEGIN
        + "\n"
        + (
            table(result)
            + f"\n\n{result['prompts']['train']} training prompts and {result['prompts']['eval']} "
            f"held-out prompts x {cfg['samples']} samples of the warm start ({result['rows']['train']} "
            f"and {result['rows']['eval']} responses); value lr {cfg['lr']:g}, {cfg['batch']} samples "
            f"per step; seed {cfg['seed']}. Written by `OMP_NUM_THREADS=1 .venv/bin/python "
            "benchmarks/experiments/critic_targets.py --write-docs` "
            f"(`benchmarks/results/critic_targets.json`, {result['seconds'] / 60:.0f} min; torch "
            f"{result['machine'].get('torch')})."
        )
        + "\n"
        + END
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    if args.report_only:
        import json

        result = json.loads(args.out.read_text())
    else:
        result = measure(args)
        write_json(result, args.out)
    print(table(result))
    if args.write_docs:
        replace_marked_block(DOCS_PAGE, BEGIN, END, docs_block(result))
    if not args.report_only:
        print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
