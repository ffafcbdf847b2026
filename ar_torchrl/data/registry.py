"""The registry of tasks (:data:`TASKS`): name -> a torch-free config schema that builds the rows.

A task's schema is a dataclass of its options with ``check(prefix)`` (range checks) and
``build() -> (train_rows, eval_rows)`` (rows in the DAPO-Math schema, the held-out rows disjoint
from the training ones); its ``holdout`` field is the number of held-out rows. Schemas register
with ``@register_task(name, help=...)`` (the one shape of :mod:`ar_torchrl.registry`) beside the
code that makes their rows: ``arithmetic`` and ``dapo_math`` in :mod:`ar_torchrl.data.datasets`,
``fewshot_arithmetic`` and ``tool_arithmetic`` in :mod:`ar_torchrl.data.tasks`.
"""

from __future__ import annotations

from ar_torchrl.registry import Registry

__all__ = ["TASKS", "register_task"]

TASKS = Registry(
    "task",
    builtins=("ar_torchrl.data.datasets", "ar_torchrl.data.tasks"),
    decorator="register_task",
    build="build(self) -> (train_rows, eval_rows)",
)

#: ``@register_task(name, help=...)`` on the task's options dataclass
#: (:meth:`ar_torchrl.registry.Registry.register` of :data:`TASKS`).
register_task = TASKS.register
