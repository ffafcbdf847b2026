"""Components defined outside ``ar_torchrl``, each one file's worth (docs/extending.md points here).

A run selects them by name once the recipe imports this module (``imports=[external_components]``)
or by dotted path (a group option's YAML with ``_component_: external_components.SumsTaskConfig``):

- a **task**, ``sums``: "What is a + b?" rows over a range of operands, in the DAPO-Math schema;
- an **advantage estimator**, ``batch_baseline``: REINFORCE with the batch's mean reward as the
  baseline (no critic, no groups), scaled by ``algo.batch_baseline.scale``.

Importing it registers both in the library's registries, so pytest never collects it
(``tests/support/conftest.py``); tests/recipes/test_components.py runs it in a recipe subprocess.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ar_torchrl.data.datasets import make_row, train_holdout_split
from ar_torchrl.data.registry import register_task
from ar_torchrl.objectives.registry import register_advantage
from ar_torchrl.utils.checks import check_number


@register_task("sums", help="'What is a + b?' over operands in [0, max_operand]")
@dataclass
class SumsTaskConfig:
    """``data=sums``: ``num_rows`` seeded additions, ``holdout`` of them held out."""

    num_rows: int = 256  # generated problems
    max_operand: int = 9  # operands in [0, max_operand]
    holdout: int = 16  # rows held out for evaluation
    seed: int = 0  # generation and split seed

    def check(self, prefix: str) -> None:
        check_number(prefix, "num_rows", self.num_rows, ge=2, integer=True)
        check_number(prefix, "max_operand", self.max_operand, ge=0, integer=True)
        check_number(prefix, "holdout", self.holdout, ge=1, lt=self.num_rows, integer=True)

    def build(self):
        rng = random.Random(self.seed)
        pairs = [
            (rng.randint(0, self.max_operand), rng.randint(0, self.max_operand))
            for _ in range(self.num_rows)
        ]
        rows = [
            make_row(f"What is {a} + {b}?", str(a + b), index=i, template="short")
            for i, (a, b) in enumerate(pairs)
        ]
        return train_holdout_split(rows, self.holdout, seed=self.seed)


class BatchBaseline:
    """``advantage = scale * (R - mean(R))`` of each row's sequence reward ``R`` (the sum of
    ``("next", "reward")``), broadcast to its trained tokens: ``td = module(td)``."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, td):
        mask = td["loss_mask"]
        reward = td["next", "reward"].squeeze(-1).sum(-1)  # [B]
        advantage = self.scale * (reward - reward.mean())
        td["advantage"] = torch.where(mask, advantage[:, None], 0.0).unsqueeze(-1)
        return td


@register_advantage("batch_baseline", help="REINFORCE with the batch's mean reward as baseline")
@dataclass
class BatchBaselineConfig:
    """``algo.advantage_mode=batch_baseline`` (no critic: ``algo.critic_coeff=0``)."""

    scale: float = 1.0  # multiplies every advantage

    def check(self, prefix: str) -> None:
        check_number(prefix, "scale", self.scale, gt=0)

    def build(self, *, critic: bool, gamma: float) -> BatchBaseline:
        if critic:
            raise ValueError("batch_baseline writes no value targets: set algo.critic_coeff=0")
        return BatchBaseline(self.scale)
