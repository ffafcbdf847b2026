"""The registry of tasks (:data:`TASKS`): name -> a torch-free config schema that builds the rows.

A task's schema is a dataclass of its options with ``check(prefix)`` (range checks) and
``build() -> (train_rows, eval_rows)`` (rows in the DAPO-Math schema, the held-out rows disjoint
from the training ones); its ``holdout`` field is the number of held-out rows. Schemas register
with :func:`register_task` beside the code that makes their rows: ``arithmetic`` and ``dapo_math``
in :mod:`ar_torchrl.data.datasets`, ``fewshot_arithmetic`` in :mod:`ar_torchrl.data.tasks`.
"""

from __future__ import annotations

from collections.abc import Callable

from ar_torchrl.registry import Registry

__all__ = ["TASKS", "register_task"]

TASKS = Registry("task", builtins=("ar_torchrl.data.datasets", "ar_torchrl.data.tasks"))


def register_task(name: str, *, help: str) -> Callable[[type], type]:
    """Class decorator: register a task schema (``build()`` makes its rows) as ``name``."""

    def decorator(schema: type) -> type:
        TASKS.register(name, config=schema, help=help)(lambda options: options.build())
        return schema

    return decorator
