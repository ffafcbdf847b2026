"""Tool messages as the chat template's token delta, and a check that the template is prefix-stable.

A multi-turn episode is built token-in/token-out: the prompt's ids, then each model turn's ids as
the engine sampled them (ending with the model's end-of-turn token, ``<|im_end|>`` in ChatML), then
the ids of the tool messages, then the next turn, ... Earlier turns are never decoded and
re-tokenised. :func:`tool_delta_ids` computes the ids to append after a model turn: everything the
template writes after the assistant's end-of-turn token (ChatML: ``"\\n"``), the tool message(s),
and the generation prompt that opens the next assistant turn (``"<|im_start|>assistant\\n"``).

How: render a fixed dummy conversation (system, user, assistant) followed by the tool messages,
with ``add_generation_prompt=True``, take the text after the dummy assistant's end-of-turn token,
and tokenise that text once. This is the "fixed base" method SkyRL uses for its observation ids
(``SkyRLGymGenerator``: a base conversation ending with an assistant message, its ids cut after the
last EOS, and ``apply_chat_template(base + observation, add_generation_prompt=True)`` minus the
base's ids; after jybsuper.github.io/posts/multiturn_tokenization). verl's ``ToolAgentLoop``
(``verl/experimental/agent_loop/tool_agent_loop.py``) renders the tool messages alone and cuts off
the ids of the system prompt rendered for an empty conversation, so the ``"\n"`` a ChatML template
writes right after the assistant's ``<|im_end|>`` is not in its delta. Taking the difference at the text
level, after the end-of-turn token, does not depend on how the dummy assistant turn itself is
rendered (Qwen3 renders a *last* assistant turn with an empty ``<think>`` block and an earlier one
without), and because the delta starts right after a special token, tokenising it alone gives the
ids a tokenisation of the whole text gives there.

Tool contents are outside text (a tool's answer, or the calculator's echo of the model's own
expression): special-token text in them (``<|im_end|>\n<|im_start|>assistant``) stays text. When a
content holds (or could complete) a special token's text, :func:`tool_delta` locates the contents in
the delta (the template rendered with placeholders, the contents substituted back, checked equal to
the real rendering), keeps the template's own special tokens, and tokenises the text between them
with ``split_special_tokens=True``: the special-token ids of the delta are those of a benign
answer, and the text round-trips. Benign contents take the plain path above, id for id. Such a
delta differs from what ``apply_chat_template(tokenize=True)`` gives for the whole conversation (it
would parse the content's special-token text), so :class:`ToolDelta` says when it was neutralised.

:func:`check_prefix_stable` re-renders a whole conversation and compares it with the incremental
ids. A mismatch has one of two meanings, and the check says which:

- ``"template"``: the *texts* differ: the template renders the conversation differently from the
  turns as they were sampled and appended (it drops earlier turns' ``<think>`` content, reformats
  an assistant turn, or writes something else between turns). Training on the incremental ids is
  still on-policy, but the template would show the model another context at inference time.
- ``"tokenization"``: the texts are equal, the ids are not: the sampled ids are a different
  tokenisation of the same text (BPE ambiguity; e.g. a turn that starts with ``"\\n"`` right after
  the generation prompt's ``"\\n"`` is tokenised ``"\\n\\n"`` in one piece by a re-tokenisation).
  The template is prefix-stable; only re-tokenising the text would change the ids.

Nothing here imports torch or transformers: ``tokenizer`` is any Hugging Face tokenizer with a chat
template (``apply_chat_template``, ``encode``, ``decode``, ``convert_ids_to_tokens``).
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "PrefixCheck",
    "PrefixMismatchError",
    "PrefixMismatchWarning",
    "ToolDelta",
    "as_tool_messages",
    "check_prefix_stable",
    "render_ids",
    "special_token_texts",
    "tool_delta",
    "tool_delta_ids",
    "tool_delta_text",
]

logger = logging.getLogger(__name__)

#: The dummy conversation the delta is taken after (its assistant content appears nowhere else).
DUMMY_CONVERSATION: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "I am a user."},
    {"role": "assistant", "content": "I am an assistant."},
)


class PrefixMismatchError(ValueError):
    """The incremental ids differ from the template's rendering (see :class:`PrefixCheck`)."""

    def __init__(self, check: PrefixCheck) -> None:
        super().__init__(check.message)
        self.check = check


class PrefixMismatchWarning(UserWarning):
    """:func:`check_prefix_stable` found a mismatch and was asked to warn."""


@dataclass(frozen=True)
class PrefixCheck:
    """What :func:`check_prefix_stable` found.

    Attributes:
        kind: ``"stable"`` (ids equal), ``"tokenization"`` (same text, other ids) or
            ``"template"`` (the texts differ: the template is not prefix-stable).
        position: the first differing token position (``None`` when stable).
        message: what differs, where, and what it means.

    Example:
        >>> from ar_torchrl.models import build_char_tokenizer
        >>> tok = build_char_tokenizer()
        >>> msgs = [{"role": "user", "content": "hi"}]
        >>> check = check_prefix_stable(tok, msgs, [1, 2, 3], on_mismatch="ignore")
        >>> check.kind, check.position, check.stable
        ('template', 1, False)
    """

    kind: Literal["stable", "tokenization", "template"]
    position: int | None = None
    message: str = "the incremental ids equal the template's rendering"

    @property
    def stable(self) -> bool:
        return self.kind == "stable"


def as_tool_messages(messages: Sequence[str | Mapping[str, Any]], role: str = "tool") -> list[dict]:
    """Chat messages from tool contents (``str`` -> ``{"role": role, "content": str}``)."""
    if isinstance(messages, (str, Mapping)) or not messages:
        raise ValueError(
            f"tool messages must be a non-empty list of strings or messages, got {messages!r}"
        )
    return [{"role": role, "content": m} if isinstance(m, str) else dict(m) for m in messages]


def render_ids(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool, **kwargs
) -> list[int]:
    """``apply_chat_template(messages, tokenize=True)`` as a list of ids (transformers 4 or 5)."""
    out = tokenizer.apply_chat_template(
        list(messages), tokenize=True, add_generation_prompt=add_generation_prompt, **kwargs
    )
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):  # transformers 5: a BatchEncoding
        out = out["input_ids"]
    return [int(i) for i in out]


def _end_of_turn(tokenizer: Any, end_of_turn: str | None) -> str:
    token = end_of_turn or getattr(tokenizer, "eos_token", None)
    if not token:
        raise ValueError("tool_delta_ids: the tokenizer has no eos_token; pass end_of_turn=")
    return token


def tool_delta_text(
    tokenizer: Any,
    messages: Sequence[str | Mapping[str, Any]],
    *,
    role: str = "tool",
    end_of_turn: str | None = None,
    include_end_of_turn: bool = False,
    **template_kwargs: Any,
) -> str:
    """The text :func:`tool_delta_ids` tokenises (same arguments).

    Example:
        >>> from ar_torchrl.models import build_char_tokenizer
        >>> tool_delta_text(build_char_tokenizer(), ["408"])
        '\\n<|im_start|>tool\\n408<|im_end|>\\n<|im_start|>assistant\\n'
    """
    eot = _end_of_turn(tokenizer, end_of_turn)
    conversation = [*DUMMY_CONVERSATION, *as_tool_messages(messages, role)]
    text = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True, **template_kwargs
    )
    dummy = DUMMY_CONVERSATION[-1]["content"]
    start = text.find(dummy)
    cut = -1 if start < 0 else text.find(eot, start + len(dummy))
    if cut < 0:
        raise ValueError(
            f"tool_delta_ids: the template does not end the assistant turn with {eot!r} (rendered "
            f"{text!r}); pass the end-of-turn token the model samples as end_of_turn="
        )
    return text[cut if include_end_of_turn else cut + len(eot) :]


@dataclass(frozen=True)
class ToolDelta:
    """What :func:`tool_delta` computed.

    Attributes:
        ids: the delta's ids (:func:`tool_delta_ids`).
        text: the delta's text (:func:`tool_delta_text`); ``tokenizer.decode(ids) == text``.
        neutralised: special-token text in a tool content was kept as text, so ``ids`` differ
            from the plain tokenisation of ``text`` (and from ``apply_chat_template(tokenize=True)``
            of the conversation: :func:`check_prefix_stable` cannot compare past this delta).

    Example:
        >>> from ar_torchrl.models import build_char_tokenizer
        >>> delta = tool_delta(build_char_tokenizer(), ["408"])
        >>> delta.neutralised, delta.text == tool_delta_text(build_char_tokenizer(), ["408"])
        (False, True)
    """

    ids: list[int]
    text: str
    neutralised: bool = False


def special_token_texts(tokenizer: Any) -> frozenset[str]:
    """The texts a tokenizer turns into special tokens (``all_special_tokens`` and every added
    token marked special), which tool contents must not forge.

    Example:
        >>> from ar_torchrl.models import build_char_tokenizer
        >>> sorted(special_token_texts(build_char_tokenizer()))
        ['<|endoftext|>', '<|im_end|>', '<|im_start|>']
    """
    texts = {str(t) for t in getattr(tokenizer, "all_special_tokens", None) or ()}
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            texts.add(str(getattr(token, "content", token)))
    return frozenset(t for t in texts if t)


def tool_delta(
    tokenizer: Any,
    tool_messages: Sequence[str | Mapping[str, Any]],
    *,
    role: str = "tool",
    end_of_turn: str | None = None,
    include_end_of_turn: bool = False,
    **template_kwargs: Any,
) -> ToolDelta:
    """:func:`tool_delta_ids` with its text and whether special-token text in the tool contents
    was neutralised (the module docstring; same arguments).

    Example:
        >>> from ar_torchrl.models import build_char_tokenizer
        >>> tok = build_char_tokenizer()
        >>> forged = tool_delta(tok, ["<|im_end|>"])
        >>> forged.neutralised, tok.decode(forged.ids) == forged.text
        (True, True)
        >>> [tok.convert_ids_to_tokens(i) for i in forged.ids if i < 3]  # the template's own
        ['<|im_start|>', '<|im_end|>', '<|im_start|>']
    """
    messages = as_tool_messages(tool_messages, role)
    options = dict(end_of_turn=end_of_turn, include_end_of_turn=include_end_of_turn)
    text = tool_delta_text(tokenizer, messages, role=role, **options, **template_kwargs)
    ids = _encode(tokenizer, text)
    contents = [m.get("content") for m in messages]
    specials = special_token_texts(tokenizer)
    if not any(isinstance(c, str) and _may_forge(c, specials) for c in contents):
        return ToolDelta(ids, text)
    parts = _template_parts(tokenizer, messages, contents, text, role, options, template_kwargs)
    if parts is None:
        logger.warning(
            "tool_delta: the chat template does not render the tool contents verbatim, so their "
            "special-token text could not be kept as text (contents %r)",
            [c[:80] if isinstance(c, str) else c for c in contents],
        )
        return ToolDelta(ids, text)
    try:
        safe = _splice(tokenizer, parts, contents, specials)
    finally:  # transformers leaves split_special_tokens set on the backend until its next call
        tokenizer.encode("", add_special_tokens=False)
    return ToolDelta(safe, text, neutralised=safe != ids)


def _encode(tokenizer: Any, text: str, *, split_special_tokens: bool = False) -> list[int]:
    kwargs = {"split_special_tokens": True} if split_special_tokens else {}
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False, **kwargs)]


def _may_forge(content: str, specials: frozenset[str]) -> bool:
    """``content`` holds a special token's text, or begins or ends with part of one (the
    template's text next to it could complete it)."""
    for s in specials:
        if s in content:
            return True
        if any(content.endswith(s[:k]) or content.startswith(s[k:]) for k in range(1, len(s))):
            return True
    return False


def _template_parts(tokenizer, messages, contents, text, role, options, template_kwargs):
    """The delta text around the contents (``len(contents) + 1`` parts), or ``None`` when the
    template does not render the contents verbatim (the placeholder rendering, with the contents
    substituted back, must be exactly ``text``)."""
    if not all(isinstance(c, str) for c in contents):
        return None
    marks = [f"\ue000{i}\ue001" for i in range(len(contents))]
    placeholders = [{**m, "content": mark} for m, mark in zip(messages, marks)]
    rendered = tool_delta_text(tokenizer, placeholders, role=role, **options, **template_kwargs)
    parts, rest = [], rendered
    for mark in marks:
        if rest.count(mark) != 1:
            return None
        head, rest = rest.split(mark)
        parts.append(head)
    parts.append(rest)
    rebuilt = parts[0] + "".join(c + p for c, p in zip(contents, parts[1:]))
    return parts if rebuilt == text else None


def _splice(tokenizer, parts: list[str], contents: list[str], specials: frozenset[str]) -> list:
    """The ids of ``parts`` interleaved with ``contents``: the special tokens of the template's
    parts kept, the text between them (contents included) tokenised with
    ``split_special_tokens=True`` (as a tokenizer splits a text at its special tokens first)."""
    pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
    ids: list[int] = []
    pending = ""
    for i, part in enumerate(parts):
        pos = 0
        for match in pattern.finditer(part):
            pending += part[pos : match.start()]
            ids += _encode(tokenizer, pending, split_special_tokens=True)
            ids.append(int(tokenizer.convert_tokens_to_ids(match[0])))
            pending, pos = "", match.end()
        pending += part[pos:] + (contents[i] if i < len(contents) else "")
    return ids + _encode(tokenizer, pending, split_special_tokens=True)


def tool_delta_ids(
    tokenizer: Any,
    tool_messages: Sequence[str | Mapping[str, Any]],
    *,
    role: str = "tool",
    end_of_turn: str | None = None,
    include_end_of_turn: bool = False,
    **template_kwargs: Any,
) -> list[int]:
    """The ids to append after a model turn so that the next generation starts at the
    template's generation prompt: what the template writes after the assistant's end-of-turn
    token, the tool message(s), and the generation prompt. Special-token text in a tool content
    stays text (:func:`tool_delta`).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        tool_messages: the tool messages' contents (``str``) or whole messages (mappings).
        role: the role of ``str`` contents (``"tool"``; some templates want ``"user"``).
        end_of_turn: the token that ends the model's turn (default: ``tokenizer.eos_token``).
        include_end_of_turn: start the delta *with* the end-of-turn token, for a turn that stopped
            without sampling it (a stop string): the token is then inserted, not trained.
        **template_kwargs: passed to ``apply_chat_template`` (``chat_template=``, ``tools=``,
            ``enable_thinking=``, ...), the same as for the prompt.

    Returns:
        The delta's ids (never including the model's own end-of-turn token unless asked).

    Example:
        >>> from ar_torchrl.models import build_char_tokenizer
        >>> tok = build_char_tokenizer()
        >>> prompt = render_ids(tok, [{"role": "user", "content": "12*34?"}], add_generation_prompt=True)
        >>> turn = tok.encode('<tool name="calculator">12*34</tool><|im_end|>')  # as sampled
        >>> ids = prompt + turn + tool_delta_ids(tok, ["408"])
        >>> ids == render_ids(tok, [{"role": "user", "content": "12*34?"},
        ...     {"role": "assistant", "content": '<tool name="calculator">12*34</tool>'},
        ...     {"role": "tool", "content": "408"}], add_generation_prompt=True)
        True
    """
    return tool_delta(
        tokenizer,
        tool_messages,
        role=role,
        end_of_turn=end_of_turn,
        include_end_of_turn=include_end_of_turn,
        **template_kwargs,
    ).ids


def check_prefix_stable(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    incremental_ids: Sequence[int],
    *,
    on_mismatch: Literal["raise", "warn", "ignore"] = "raise",
    **template_kwargs: Any,
) -> PrefixCheck:
    """Compare incrementally built ids with the template's rendering of the whole conversation.

    ``messages`` is the conversation as text: the prompt's messages, each model turn as an
    assistant message whose content is the decoded sampled text *without* the end-of-turn token,
    and the tool messages. ``incremental_ids`` are the prompt ids + each turn's sampled ids + each
    :func:`tool_delta_ids`. When the last message is not the assistant's, the rendering is
    ``apply_chat_template(messages, tokenize=True, add_generation_prompt=True)`` and must equal the
    ids; when it is (the episode ended with a model turn), the ids must be a prefix of the
    rendering without a generation prompt, the rest being whitespace the template writes after the
    final end-of-turn token. See the module docstring for what a mismatch means.

    Args:
        tokenizer: the tokenizer (and chat template) the episode was built with.
        messages: the conversation as text.
        incremental_ids: the episode's ids.
        on_mismatch: ``"raise"`` a :class:`PrefixMismatchError`, ``"warn"``
            (:class:`PrefixMismatchWarning`) or ``"ignore"``; the :class:`PrefixCheck` is returned.
        **template_kwargs: passed to ``apply_chat_template``.

    Example:
        >>> from ar_torchrl.models import build_char_tokenizer
        >>> tok = build_char_tokenizer()
        >>> msgs = [{"role": "user", "content": "hi"}]
        >>> check_prefix_stable(tok, msgs, render_ids(tok, msgs, add_generation_prompt=True)).kind
        'stable'
    """
    if on_mismatch not in ("raise", "warn", "ignore"):
        raise ValueError(f"on_mismatch must be 'raise', 'warn' or 'ignore', got {on_mismatch!r}")
    ids = [int(i) for i in incremental_ids]
    ends_with_model = bool(messages) and messages[-1].get("role") == "assistant"
    rendered = render_ids(
        tokenizer, messages, add_generation_prompt=not ends_with_model, **template_kwargs
    )
    expected = rendered
    if ends_with_model and rendered[: len(ids)] == ids:
        if not tokenizer.decode(rendered[len(ids) :]).strip():
            expected = ids  # only the whitespace after the final end-of-turn token is left
    check = PrefixCheck("stable") if ids == expected else _mismatch(tokenizer, ids, rendered)
    if not check.stable:
        if on_mismatch == "raise":
            raise PrefixMismatchError(check)
        if on_mismatch == "warn":
            warnings.warn(check.message, PrefixMismatchWarning, stacklevel=2)
        logger.debug("check_prefix_stable: %s", check.message)
    return check


def _mismatch(tokenizer: Any, ids: list[int], rendered: list[int]) -> PrefixCheck:
    pos = next((i for i, (a, b) in enumerate(zip(ids, rendered)) if a != b), None)
    pos = min(len(ids), len(rendered)) if pos is None else pos
    ours, theirs = _token(tokenizer, ids, pos), _token(tokenizer, rendered, pos)
    text, rendered_text = tokenizer.decode(ids), tokenizer.decode(rendered)
    where = (
        f"token {pos} differs: the incremental ids have {ours}, the template's rendering has "
        f"{theirs} ({len(ids)} vs {len(rendered)} ids)"
    )
    same_text = text == rendered_text or (
        rendered_text.startswith(text) and not rendered_text[len(text) :].strip()
    )
    if same_text:
        return PrefixCheck(
            "tokenization",
            pos,
            f"{where}; the decoded texts are equal: the sampled ids are another tokenisation of "
            "the same text (BPE ambiguity), the template is prefix-stable",
        )
    char = next(
        (i for i, (a, b) in enumerate(zip(text, rendered_text)) if a != b),
        min(len(text), len(rendered_text)),
    )
    return PrefixCheck(
        "template",
        pos,
        f"{where}; the texts differ from character {char}: incremental "
        f"{text[max(char - 30, 0) : char + 30]!r} vs rendered "
        f"{rendered_text[max(char - 30, 0) : char + 30]!r}: the chat template is not "
        "prefix-stable (it renders earlier turns differently from how they were sampled)",
    )


def _token(tokenizer: Any, ids: list[int], pos: int) -> str:
    if pos >= len(ids):
        return "<end>"
    return f"{tokenizer.convert_ids_to_tokens(ids[pos])!r} (id {ids[pos]})"
