"""Value head and the LM actor-critic module."""

from ar_torchrl.modules.actor_critic import LMActorCritic, token_log_probs
from ar_torchrl.modules.value_head import (
    VALUE_HEAD_FILE,
    ValueHead,
    attach_value_head,
    load_value_head,
    save_policy,
    save_value_head,
)

__all__ = [
    "VALUE_HEAD_FILE",
    "LMActorCritic",
    "ValueHead",
    "attach_value_head",
    "load_value_head",
    "save_policy",
    "save_value_head",
    "token_log_probs",
]
