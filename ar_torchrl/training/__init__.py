"""The training side of an iteration: the micro-batch plan, the old log-probs and values recomputed
with it, and the PPO update over it.

- :mod:`.micro_batch`: :func:`plan_micro_batches` splits a ``[B, L]`` batch into micro-batches (the
  one geometry of the old-log-prob pass and the training forward, docs/design.md section 4).
- :mod:`.old_log_probs`: :func:`recompute_old_log_probs_and_values` fills ``sample_log_prob`` (the
  PPO "old" log-probs, TorchRL's name), ``state_value`` and optional ``ref_log_prob`` with the
  trainer's own model over that plan, so the first update has ratio exactly 1.
- :mod:`.update`: :func:`ppo_update` (epochs x mini-batches x micro-batches, NaN/inf skipping).

Names are imported on first use.
"""

from __future__ import annotations

from ar_torchrl._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(["MicroBatch", "MicroBatchPlan", "Plan", "plan_micro_batches"], "micro_batch"),
    "recompute_old_log_probs_and_values": "old_log_probs",
    **dict.fromkeys(["lr_schedule_factor", "ppo_update", "total_loss"], "update"),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
