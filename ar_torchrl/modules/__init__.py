"""Value head and the LM actor-critic module."""

from ar_torchrl.modules.actor_critic import LMActorCritic
from ar_torchrl.modules.critic import LMCritic, build_separate_critic, check_same_tokenizer
from ar_torchrl.modules.log_probs import (
    LOGITS_MEMORY_BUDGET,
    chunk_tokens_for_budget,
    token_log_probs,
)
from ar_torchrl.modules.packing import (
    PACKED_KEY,
    PackedLayout,
    is_varlen,
    pack_rows,
    packed_layout,
)
from ar_torchrl.modules.shared_prefix import (
    SHARED_KEY,
    SharedPrefix,
    shared_hidden_states,
    supports_shared_prefix,
    why_not_shared,
    why_not_tree,
)
from ar_torchrl.modules.value_head import (
    VALUE_HEAD_FILE,
    ConfidenceFeatures,
    PopArtValueHead,
    ValueHead,
    attach_confidence_features,
    attach_value_head,
    load_value_head,
    save_policy,
    save_value_head,
)

__all__ = [
    "LOGITS_MEMORY_BUDGET",
    "PACKED_KEY",
    "SHARED_KEY",
    "VALUE_HEAD_FILE",
    "LMActorCritic",
    "LMCritic",
    "PackedLayout",
    "PopArtValueHead",
    "SharedPrefix",
    "ValueHead",
    "ConfidenceFeatures",
    "attach_confidence_features",
    "attach_value_head",
    "build_separate_critic",
    "check_same_tokenizer",
    "chunk_tokens_for_budget",
    "is_varlen",
    "load_value_head",
    "pack_rows",
    "packed_layout",
    "save_policy",
    "save_value_head",
    "shared_hidden_states",
    "supports_shared_prefix",
    "token_log_probs",
    "why_not_shared",
    "why_not_tree",
]
