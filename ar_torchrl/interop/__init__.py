"""Bridges to other stacks: TorchRL's own LLM collectors and weight-sync schemes (:mod:`.torchrl_llm`),
TorchRL's ``RayLLMCollector`` workers fed by the learner's weights (:mod:`.ray`, the ``[ray]``
extra), and engine completions -> token trajectories (:mod:`.collate`).

Names are imported on first use.
"""

from __future__ import annotations

from ar_torchrl._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(
        ["PolicyStateDict", "TokenTrajectory", "policy_state_dict", "prompt_group_id"],
        "torchrl_llm",
    ),
    **dict.fromkeys(["RayRollout", "RolloutWorkerLost", "local_cluster"], "ray"),
    "completions_to_trajectory": "collate",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
