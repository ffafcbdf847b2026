"""The env's two layouts: fixed-width sequence-level specs, and the ``[N, L]`` token trajectory.

- :func:`sequence_specs`: the TorchRL specs of one sequence-level step (prompt left-padded to a
  fixed width, the whole response as the action, right-padded to ``max_new_tokens``);
- :func:`completions_to_actions`: backend completions -> those action tensors;
- :func:`sequences_to_trajectory`: sequence-level steps (any rows, e.g. gathered over several
  sampling rounds) -> the token trajectory, with ``L`` the batch's own width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Categorical, Composite, Unbounded

from ar_torchrl.backends.base import Completion
from ar_torchrl.data.collate import completions_to_trajectory

__all__ = ["completions_to_actions", "sequence_specs", "sequences_to_trajectory"]


def sequence_specs(n: int, prompt_width: int, vocab: int, max_new: int) -> dict[str, Composite]:
    """Observation, action, reward and done specs of a batch of ``n`` one-step episodes.

    Example:
        >>> specs = sequence_specs(4, prompt_width=10, vocab=99, max_new=6)
        >>> specs["full_action_spec"]["response_tokens"].shape
        torch.Size([4, 6])
    """

    def ids(shape):
        return Bounded(0, vocab - 1, shape=shape, dtype=torch.int64)

    def flag(shape):
        return Categorical(2, shape=shape, dtype=torch.bool)

    return {
        "observation_spec": Composite(
            prompt_tokens=ids((n, prompt_width)),
            prompt_mask=flag((n, prompt_width)),
            prompt_id=Unbounded(shape=(n,), dtype=torch.int64),
            shape=(n,),
        ),
        "full_action_spec": Composite(
            response_tokens=ids((n, max_new)),
            response_length=Bounded(1, max_new, shape=(n,), dtype=torch.int64),
            response_log_prob=Unbounded(shape=(n, max_new), dtype=torch.float32),
            response_stopped=flag((n,)),
            policy_version=Unbounded(shape=(n,), dtype=torch.int64),
            shape=(n,),
        ),
        "reward_spec": Unbounded(shape=(n, 1), dtype=torch.float32),
        "full_done_spec": Composite(
            done=flag((n, 1)), terminated=flag((n, 1)), truncated=flag((n, 1)), shape=(n,)
        ),
    }


def completions_to_actions(
    completions: Sequence[Completion],
    *,
    max_new_tokens: int,
    pad_token_id: int,
    vocab: int,
    prompt_ids: Sequence[int],
) -> dict[str, torch.Tensor]:
    """Fixed-width action tensors of one batch of completions (one weight version).

    Raises:
        ValueError: a token id outside ``[0, vocab)`` (naming the row and its prompt index).
        RuntimeError: a completion longer than ``max_new_tokens``.

    Each row carries its completion's ``policy_version``; "one batch, one version" is checked once,
    where the batch is built (:func:`sequences_to_trajectory`).

    Example:
        >>> acts = completions_to_actions([Completion(0, [5, 2], [-0.5, -0.1], "stop")],
        ...     max_new_tokens=3, pad_token_id=0, vocab=99, prompt_ids=[7])
        >>> acts["response_tokens"].tolist(), acts["response_length"].tolist()
        ([[5, 2, 0]], [2])
    """
    n = len(completions)
    tokens = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long)
    log_probs = torch.zeros((n, max_new_tokens), dtype=torch.float32)
    for b, c in enumerate(completions):
        if len(c) > max_new_tokens:
            raise RuntimeError(
                f"LLMEnv: completion {b} has {len(c)} tokens > max_new_tokens={max_new_tokens}"
            )
        bad = [t for t in c.token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"LLMEnv: the completion of batch row {b} (prompt index {prompt_ids[b]}) has token "
                f"ids {bad[:5]} outside the tokenizer's vocabulary [0, {vocab})"
            )
        tokens[b, : len(c)] = torch.tensor(c.token_ids, dtype=torch.long)
        log_probs[b, : len(c)] = torch.tensor(c.log_probs, dtype=torch.float32)
    return {
        "response_tokens": tokens,
        "response_length": torch.tensor([len(c) for c in completions]),
        "response_log_prob": log_probs,
        "response_stopped": torch.tensor([c.finish_reason == "stop" for c in completions]),
        "policy_version": torch.tensor([c.policy_version for c in completions], dtype=torch.long),
    }


def sequences_to_trajectory(seq: TensorDictBase, pad_token_id: int) -> TensorDict:
    """Sequence-level steps ``[N]`` (after ``step``) -> the ``[N, L]`` token trajectory.

    Rows may come in any number and order (e.g. the groups kept over several sampling rounds);
    each row's prompt is read from its own ``prompt_tokens``/``prompt_mask``.

    This is where "one batch, one weight version" is checked (the one check per batch).

    Raises:
        ValueError: the rows mix policy versions.
    """
    versions = seq["policy_version"].unique()
    if versions.numel() != 1:
        raise ValueError(f"LLMEnv: one batch mixes policy versions {versions.tolist()}")
    prompts, completions = [], []
    for b in range(seq.shape[0]):
        length = int(seq["response_length"][b])
        prompts.append(seq["prompt_tokens"][b][seq["prompt_mask"][b]].tolist())
        completions.append(
            Completion(
                prompt_index=b,
                token_ids=seq["response_tokens"][b, :length].tolist(),
                log_probs=seq["response_log_prob"][b, :length].tolist(),
                finish_reason="stop" if bool(seq["response_stopped"][b]) else "length",
            )
        )
    return completions_to_trajectory(
        prompts,
        completions,
        seq["next", "reward"].reshape(-1),
        pad_token_id=pad_token_id,
        prompt_id=seq["prompt_id"].tolist(),
        policy_version=int(versions[0]),
    )
