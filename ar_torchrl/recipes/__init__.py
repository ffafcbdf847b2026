"""Recipes as library code, beside the components they compose (as torchtune keeps ``recipes/``).

- :mod:`.run`: run management shared by recipes (run directories, resume by config match, history
  truncation, signals, the end-of-run report);
- :mod:`.strategy`: the execution strategy (one process, or FSDP2 under torchrun) a recipe runs on;
- :mod:`.checkpoint`: single-process ``.pt`` checkpoints;
- :mod:`.config`: typed configurations from the registries' schemas, validation, ``--help``;
- :mod:`.dapo_ppo`: the DAPO-math PPO recipe (its command line: ``ar-torchrl-dapo``, ``python -m
  ar_torchrl.recipes.dapo_ppo`` or ``examples/dapo_ppo.py``).

Hydra stays in the YAML (``ar_torchrl/configs/``, shipped in the wheel) and in the command line
(``dapo_ppo.main.cli`` imports it): a recipe gets the composed configuration and a
:class:`~ar_torchrl.recipes.launch.Launch`. Importing this package imports neither torch nor Hydra.
"""

from ar_torchrl.recipes.launch import Launch, StopOnSignal

__all__ = ["Launch", "StopOnSignal"]
