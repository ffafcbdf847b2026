"""Per-token log-probs from final hidden states: the LM head and log-softmax in memory-bounded chunks.

The ``[N, V]`` float32 logits are never materialised for all positions: the LM head and
log-softmax run over chunks of token positions, sized by a memory budget that knows the
vocabulary (:func:`chunk_tokens_for_budget`), each chunk wrapped in activation checkpointing when
gradients are on (only the hidden states are kept for backward). The chunk size never depends on
the grad mode, so the no-grad old-log-prob pass and the training forward compute identical numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["LOGITS_MEMORY_BUDGET", "chunk_tokens_for_budget", "token_log_probs"]

#: Default bytes the float32 ``[chunk, V]`` buffers of one LM-head chunk may take (1 GiB).
LOGITS_MEMORY_BUDGET = 2**30

# Float32 [chunk, V] buffers alive at the peak of one chunk: the backward of a recomputed chunk
# with entropies (logits, log-softmax, its exp, their gradients; measured on CPU with
# benchmarks/bench_logprob_memory.py; without entropies or without grad fewer are alive). One
# constant for every mode: the no-grad old-log-prob pass and the training forward, with or without
# entropies, must cut the positions into the same chunks, or the matmuls round differently and the
# first PPO ratio is no longer exactly 1.
_LIVE_BUFFERS = 5


def chunk_tokens_for_budget(vocab_size: int, memory_budget: int) -> int:
    """Token positions per LM-head chunk so one chunk's float32 buffers fit ``memory_budget`` bytes.

    ``memory_budget // (vocab_size * 4 bytes * k)`` with ``k = 5`` float32 ``[chunk, V]`` buffers
    alive at a chunk's peak (backward with entropies; fewer otherwise), at least 1.

    Example:
        >>> chunk_tokens_for_budget(151_936, 2**30)  # Qwen3's vocabulary, 1 GiB
        353
    """
    if vocab_size < 1 or memory_budget < 1:
        raise ValueError(
            f"chunk_tokens_for_budget: vocab_size and memory_budget must be >= 1, got {vocab_size} "
            f"and {memory_budget}"
        )
    return max(1, memory_budget // (vocab_size * 4 * _LIVE_BUFFERS))


def _vocab_size(lm_head: nn.Module) -> int:
    size = getattr(lm_head, "out_features", None)
    if size is None and isinstance(getattr(lm_head, "weight", None), Tensor):
        size = lm_head.weight.shape[0]
    if size is None:
        raise ValueError(
            f"token_log_probs: cannot read the vocabulary size of {type(lm_head).__name__} "
            "(no out_features or weight); pass chunk_tokens="
        )
    return int(size)


def _chunked_log_probs(
    hidden: Tensor,
    targets: Tensor,
    lm_head: nn.Module,
    *,
    temperature: float,
    chunk_tokens: int,
    with_entropy: bool,
    use_checkpoint: bool,
) -> tuple[Tensor, Tensor | None]:
    """``log softmax(lm_head(hidden[i]) / T)[targets[i]]`` (and entropies) over chunks.

    Shapes: hidden ``[N, H]``, targets ``[N]`` -> ``[N]`` float32 (each).
    """

    def chunk_fn(h: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        logits = lm_head(h).float()
        if temperature != 1.0:
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)
        picked = logp.gather(-1, t.unsqueeze(-1)).squeeze(-1)
        if not with_entropy:
            return picked, picked.new_zeros(())
        return picked, -(logp.exp() * logp).sum(-1)

    pieces, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        sl = slice(start, start + chunk_tokens)
        if use_checkpoint:
            lp, ent = checkpoint(chunk_fn, hidden[sl], targets[sl], use_reentrant=False)
        else:
            lp, ent = chunk_fn(hidden[sl], targets[sl])
        pieces.append(lp)
        entropies.append(ent)
    if not pieces:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty if with_entropy else None
    return torch.cat(pieces), torch.cat(entropies) if with_entropy else None


def token_log_probs(
    hidden: Tensor,
    tokens: Tensor,
    lm_head: nn.Module,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    memory_budget: int = LOGITS_MEMORY_BUDGET,
    with_entropy: bool = False,
    use_checkpoint: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of ``tokens[:, t]`` under ``softmax(lm_head(hidden[:, t-1]) / T)``.

    Args:
        hidden: ``[B, L, H]`` final hidden states.
        tokens: ``[B, L]`` int64 token ids.
        lm_head: maps ``[N, H] -> [N, V]``.
        temperature: divides the logits (match the rollout's sampling temperature).
        chunk_tokens: token positions per LM-head chunk (default: sized by ``memory_budget`` with
            :func:`chunk_tokens_for_budget`). Results do not depend on it beyond float rounding.
        memory_budget: bytes one chunk's float32 ``[chunk, V]`` buffers may take.
        with_entropy: also return the entropy of each predictive distribution.
        use_checkpoint: recompute each chunk in backward (default: when grad is enabled).

    Returns:
        ``(log_prob [B, L] float32, entropy [B, L] float32 or None)``, 0 at position 0.

    Example:
        >>> head = torch.nn.Linear(4, 7, bias=False)
        >>> lp, ent = token_log_probs(torch.randn(2, 5, 4), torch.randint(7, (2, 5)), head,
        ...                           chunk_tokens=3, with_entropy=True)
        >>> lp.shape, bool((lp[:, 1:] < 0).all()), lp[:, 0].tolist()
        (torch.Size([2, 5]), True, [0.0, 0.0])
    """
    batch, length, width = hidden.shape
    if tokens.shape != (batch, length):
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}, expected {(batch, length)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if chunk_tokens is None:
        chunk_tokens = chunk_tokens_for_budget(_vocab_size(lm_head), memory_budget)
    lp, ent = _chunked_log_probs(
        hidden[:, :-1].reshape(-1, width),
        tokens[:, 1:].reshape(-1),
        lm_head,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        with_entropy=with_entropy,
        use_checkpoint=torch.is_grad_enabled() if use_checkpoint is None else use_checkpoint,
    )
    zero_col = hidden.new_zeros(batch, 1, dtype=torch.float32)
    log_prob = torch.cat([zero_col, lp.reshape(batch, length - 1)], dim=1)
    if not with_entropy:
        return log_prob, None
    return log_prob, torch.cat([zero_col, ent.reshape(batch, length - 1)], dim=1)
