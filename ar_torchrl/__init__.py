"""ar_torchrl: TorchRL-native components for PPO on autoregressive language models.

The one data layout is the *token trajectory*: a ``[B, L]`` TensorDict where each position is a
time step (see ``docs/design.md`` section 1). Sub-packages:

- :mod:`ar_torchrl.functional`: pure tensor math (GAE, GRPO, masked reductions, PPO terms).
- :mod:`ar_torchrl.modules`: value head and :class:`~ar_torchrl.modules.LMActorCritic`.
- :mod:`ar_torchrl.objectives`: ``TokenGAE``, ``GRPOAdvantage``, ``TokenPPOLoss``.
- :mod:`ar_torchrl.data`: micro-batch planning, datasets, collation.
- :mod:`ar_torchrl.backends`, :mod:`ar_torchrl.envs`, :mod:`ar_torchrl.collectors`,
  :mod:`ar_torchrl.weight_sync`, :mod:`ar_torchrl.rewards`: rollouts.
"""

from __future__ import annotations

import logging

from ar_torchrl import _compat

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())
_compat.install()  # old import paths of moved modules (one release)
