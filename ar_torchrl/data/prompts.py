"""Prompts as token ids: the chat template applied once, and checked against the model's context.

:func:`prompt_token_ids` is how every prompt becomes token ids (the chat template with the
generation prompt, no special tokens added on top). :func:`check_prompts` runs it over a dataset at
load time, before any rollout, so that a bad row is found once, named by its source line, instead of
ending the run whenever the sampler draws it:

- a prompt that leaves fewer than ``max_new_tokens`` of the context is **too long**: an error naming
  the row's source (``data/dapo.jsonl line 7``), or, with ``skip_invalid``, the row is skipped and
  counted;
- a prompt whose tokens lose characters of its text (a tokenizer without those characters in its
  vocabulary drops them: ``"Compute √2 × π"`` becomes ``"Compute 2  "``) is kept, and the rows and
  characters are named in a warning.

Nothing here imports torch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PromptCheck", "check_prompts", "prompt_token_ids"]

logger = logging.getLogger(__name__)


def prompt_token_ids(messages: Sequence[Mapping[str, str]], tokenizer: Any) -> list[int]:
    """The chat-templated token ids of a prompt's messages, with the generation prompt.

    Example:
        >>> from ar_torchrl.models import build_char_tokenizer
        >>> tok = build_char_tokenizer()
        >>> ids = prompt_token_ids([{"role": "user", "content": "1+1?"}], tok)
        >>> tok.decode(ids)
        '<|im_start|>user\\n1+1?<|im_end|>\\n<|im_start|>assistant\\n'
    """
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _lost_characters(messages: Sequence[Mapping[str, str]], ids: list[int], tokenizer) -> set[str]:
    decoded = tokenizer.decode(ids, skip_special_tokens=False)
    wanted = {c for m in messages for c in str(m.get("content", "")) if not c.isspace()}
    return wanted - set(decoded)


@dataclass
class PromptCheck:
    """What :func:`check_prompts` found: the rows kept (indices into the dataset) and why others
    were dropped; ``lost_characters``: row index -> characters its tokens do not reproduce."""

    kept: list[int]
    too_long: list[tuple[int, int]] = field(default_factory=list)  # (row, prompt tokens)
    lost_characters: dict[int, str] = field(default_factory=dict)


def check_prompts(
    dataset: Sequence[Mapping],
    tokenizer: Any,
    *,
    max_prompt_tokens: int,
    skip_invalid: bool = False,
    name: str = "data",
) -> PromptCheck:
    """Check every prompt of ``dataset`` against ``max_prompt_tokens`` (the context left for the
    prompt: context length minus ``max_new_tokens``).

    Args:
        dataset: DAPO-schema rows (a :class:`~ar_torchrl.data.MathDataset` names their source lines).
        tokenizer: the policy's tokenizer (with its chat template).
        max_prompt_tokens: the longest prompt the model can take with room for the response.
        skip_invalid: skip too-long rows (counted, logged) instead of raising.
        name: how messages name the dataset (a config key such as ``data``).

    Raises:
        ValueError: a too-long prompt without ``skip_invalid`` (its source, its length and the
            limit named), or no row left.

    Example:
        >>> from ar_torchrl.data import arithmetic_dataset
        >>> from ar_torchrl.models import build_char_tokenizer
        >>> rows = arithmetic_dataset(3)
        >>> check_prompts(rows, build_char_tokenizer(), max_prompt_tokens=500).kept
        [0, 1, 2]
        >>> check_prompts(rows, build_char_tokenizer(), max_prompt_tokens=20)
        Traceback (most recent call last):
        ...
        ValueError: data: the prompt of arithmetic row 0 has 86 tokens, more than the 20 the model's context leaves for it after rollout.max_new_tokens; shorten it, raise the context, or set data.skip_invalid=true to skip (and count) such rows
    """
    found = PromptCheck(kept=[])
    for i, row in enumerate(dataset):
        messages = row["prompt"]
        ids = prompt_token_ids(messages, tokenizer)
        lost = _lost_characters(messages, ids, tokenizer)
        if lost:
            found.lost_characters[i] = "".join(sorted(lost))
        if len(ids) <= max_prompt_tokens:
            found.kept.append(i)
            continue
        if not skip_invalid:
            raise ValueError(
                f"{name}: the prompt of {_source(dataset, i)} has {len(ids)} tokens, more than the "
                f"{max_prompt_tokens} the model's context leaves for it after "
                "rollout.max_new_tokens; shorten it, raise the context, or set "
                f"{name}.skip_invalid=true to skip (and count) such rows"
            )
        found.too_long.append((i, len(ids)))
    _report(found, dataset, name, max_prompt_tokens)
    return found


def _source(dataset: Any, i: int) -> str:
    source = getattr(dataset, "source", None)
    return source(i) if source is not None else f"row {i}"


def _report(found: PromptCheck, dataset: Any, name: str, limit: int) -> None:
    if found.too_long:
        first, tokens = found.too_long[0]
        logger.warning(
            "%s: skipped %d prompt(s) longer than the %d tokens the context leaves (first: %s, "
            "%d tokens)",
            name,
            len(found.too_long),
            limit,
            _source(dataset, first),
            tokens,
        )
    if not found.kept:
        raise ValueError(
            f"{name}: no prompt fits in {limit} tokens ({len(found.too_long)} skipped)"
        )
    if found.lost_characters:
        first = next(iter(found.lost_characters))
        chars = sorted(set("".join(found.lost_characters.values())))
        logger.warning(
            "%s: the tokenizer drops characters of %d prompt(s) (not in its vocabulary: %r; first: "
            "%s); the model sees those prompts without them",
            name,
            len(found.lost_characters),
            "".join(chars[:20]),
            _source(dataset, first),
        )
