"""The DAPO-math PPO recipe as library code: config schemas, builders, the loop, the entry.

- :mod:`.config`: the typed configuration (the recipe's sections; group options from registries);
- :mod:`.main`: :func:`run`, from a composed configuration to a finished run, and ``cli``, the
  command line (``ar-torchrl-dapo``, ``python -m ar_torchrl.recipes.dapo_ppo``,
  ``examples/dapo_ppo.py``);
- :mod:`.build` and :mod:`.loop`: the pieces and the PPO loop (torch, transformers, TorchRL).

Importing this package imports neither torch nor Hydra.
"""

from ar_torchrl.recipes.dapo_ppo.config import Config, schemas, validate_config
from ar_torchrl.recipes.dapo_ppo.main import (
    PROG,
    RESUMABLE_CHANGES,
    Result,
    checkpoint_to_resume,
    help_text,
    hydra_argv,
    launch_argv,
    run,
)
from ar_torchrl.recipes.dapo_ppo.main import (
    find_checkpoint as find_checkpoint,  # deprecated: checkpoint_to_resume with a store
)

__all__ = [
    "PROG",
    "RESUMABLE_CHANGES",
    "Config",
    "Result",
    "checkpoint_to_resume",
    "help_text",
    "hydra_argv",
    "launch_argv",
    "run",
    "schemas",
    "validate_config",
]
