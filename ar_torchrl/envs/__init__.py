"""TorchRL environments whose samples become token trajectories: single-turn and tool-use episodes.

:data:`~ar_torchrl.envs.registry.ENV_KINDS` names them (``single_turn``: :class:`LLMEnv`,
``tool``: :class:`ToolEnv`; a recipe picks one with ``rollout.env``). Names are imported on first
use: the registry and its schemas (:mod:`.registry`, :mod:`.config`) need no torch.
"""

from __future__ import annotations

from ar_torchrl._lazy import lazy_exports

_EXPORTS = {
    "EpochSampler": "sampler",
    "LLMEnv": "llm_env",
    "ToolEnv": "tool_env",
    "ENV_KINDS": "registry",
    "EnvContext": "registry",
    "register_env_kind": "registry",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
