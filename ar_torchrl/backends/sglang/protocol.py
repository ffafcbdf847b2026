"""The ``/generate`` protocol of SGLang 0.5.x: request bodies, and answers checked field by field.

Request: ``input_ids``, ``sampling_params`` (SGLang's keys only: an unknown key is a 400) and
``return_logprob: true``; optionally ``rid``, the request id SGLang's ``/abort_request`` names
(``{"rid": ...}``: the server then answers the request with the tokens and log-probs it has and
``finish_reason = {"type": "abort", "message": "Aborted", ...}``). ``n > 1`` (or a batch) answers a
list; the samples of ``n > 1`` get ids of the server's own choosing, so a request meant to be
aborted carries one sample. Each item has ``output_ids`` and
``meta_info`` with ``output_token_logprobs`` (``[[logprob, token_id, text], ...]``),
``finish_reason`` (``{"type": "stop" | "length" | "abort", ...}``), ``completion_tokens`` and
``weight_version``.

Log-probs: SGLang turns ``temperature = 0`` into ``top_k = 1`` at ``T = 1``, so greedy log-probs are
those of the ``T = 1`` distribution; sampled ones are ``log softmax(logits / T)``, taken *before*
top-k / top-p truncation (``srt/layers/sampler.py``). ``sampling_seed`` is honoured only when the
server runs with ``--enable-deterministic-inference``.

An answer is trusted in nothing: every field the client reads is checked (type, count, finite
log-prob ``<= 0``, token id in ``[0, vocab_size)``) and a violation raises
:class:`SGLangResponseError` naming the field, never a raw ``TypeError``/``IndexError``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ar_torchrl.backends.base import Completion, SamplingParams
from ar_torchrl.backends.sglang.errors import SGLangResponseError

__all__ = [
    "SGLANG_SAMPLING_KEYS",
    "check_sampling_keys",
    "generate_body",
    "single_samples",
    "parse_generate_answer",
    "parse_generate_item",
]

#: ``sampling_params`` keys SGLang 0.5.23 accepts (``api_types.SamplingParams``); others are a 400.
SGLANG_SAMPLING_KEYS = frozenset(
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty "
    "presence_penalty repetition_penalty min_new_tokens n json_schema regex ebnf structural_tag "
    "ignore_eos skip_special_tokens spaces_between_special_tokens no_stop_trim stream_interval "
    "logit_bias sampling_seed custom_params beam_width watermark choice".split()
)
_RESERVED = frozenset({"n", "max_new_tokens", "temperature", "top_p", "top_k", "sampling_seed"})
#: A log-prob above this is not a log-prob (rounding can make ``log p`` of ``p = 1`` a hair above 0).
LOGPROB_TOLERANCE = 1e-5


def check_sampling_keys(params: Mapping[str, Any]) -> dict:
    """Check extra ``sampling_params`` against SGLang's schema (here, not at the server).

    Example:
        >>> check_sampling_keys({"max_tokens": 3})
        Traceback (most recent call last):
        ...
        ValueError: SGLangBackend: extra_sampling_params has keys SGLang rejects with HTTP 400: ['max_tokens']; allowed: [...]
    """
    unknown = sorted(set(params) - SGLANG_SAMPLING_KEYS)
    if unknown:
        raise ValueError(
            f"SGLangBackend: extra_sampling_params has keys SGLang rejects with HTTP 400: {unknown}; "
            f"allowed: [{', '.join(repr(k) for k in sorted(SGLANG_SAMPLING_KEYS))}]"
        )
    reserved = sorted(set(params) & _RESERVED)
    if reserved:
        raise ValueError(
            f"SGLangBackend: set {reserved} through SamplingParams / `n`, not extra_sampling_params"
        )
    return dict(params)


def generate_body(
    prompt: Sequence[int],
    n: int,
    sampling: SamplingParams,
    prompt_index: int = 0,
    extra: Mapping[str, Any] | None = None,
) -> dict:
    """The ``/generate`` body for one prompt.

    With ``sampling.seed`` set, the body is a batch of ``n`` copies of the prompt, each with its
    own ``sampling_seed = seed + prompt_index * n + j`` (one seed for ``n`` samples would make
    them identical); otherwise a single prompt with ``sampling_params.n = n``.

    Example:
        >>> generate_body([5, 6], 2, SamplingParams(max_new_tokens=4, temperature=0.0))
        {'input_ids': [5, 6], 'sampling_params': {'max_new_tokens': 4, 'temperature': 0.0, 'top_p': 1.0, 'top_k': -1, 'n': 2}, 'return_logprob': True}
        >>> single_samples(generate_body([5], 2, SamplingParams(max_new_tokens=1)))[1]
        {'input_ids': [5], 'sampling_params': {'max_new_tokens': 1, 'temperature': 1.0, 'top_p': 1.0, 'top_k': -1, 'n': 1}, 'return_logprob': True}
    """
    params = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
    }
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    params.update(extra or {})
    ids = [int(t) for t in prompt]
    if sampling.seed is None:
        return {"input_ids": ids, "sampling_params": {**params, "n": n}, "return_logprob": True}
    seeds = [sampling.seed + prompt_index * n + j for j in range(n)]
    return {
        "input_ids": [ids] * n,
        "sampling_params": [{**params, "sampling_seed": s} for s in seeds],
        "return_logprob": True,
    }


def single_samples(body: dict) -> list[dict]:
    """A :func:`generate_body` as one request per sample (a single prompt, ``n = 1``, one
    ``sampling_params`` dict each): what sglang-router accepts for seeded requests (it refuses a
    list of ``sampling_params``), and what can be aborted by its ``rid``.

    Example:
        >>> seeded = generate_body([5], 2, SamplingParams(max_new_tokens=1, seed=3))
        >>> [(b["input_ids"], b["sampling_params"]["sampling_seed"]) for b in single_samples(seeded)]
        [([5], 3), ([5], 4)]
    """
    params = body["sampling_params"]
    if isinstance(params, list):  # seeded: a batch of copies of the prompt, one seed each
        return [
            {**body, "input_ids": ids, "sampling_params": p}
            for ids, p in zip(body["input_ids"], params)
        ]
    n = params.get("n", 1)
    return [{**body, "sampling_params": {**params, "n": 1}} for _ in range(n)]


class _Where:
    """Names the place of a problem: ``SGLang /generate: prompt 3: meta_info.finish_reason ...``."""

    def __init__(self, where: str, prompt_index: int) -> None:
        self.prefix = f"{where}: prompt {prompt_index}"

    def error(self, field: str, problem: str) -> SGLangResponseError:
        return SGLangResponseError(f"{self.prefix}: {field} {problem}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finish_type(meta: Mapping, at: _Where) -> str:
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, Mapping) else None
    if kind not in ("stop", "length", "abort"):
        raise at.error(
            "meta_info.finish_reason",
            f"is {reason!r:.200}; expected {{'type': 'stop' | 'length' | 'abort', ...}} (unfinished request?)",
        )
    return kind


def _token_ids(ids: Any, at: _Where, vocab_size: int | None) -> list[int]:
    if not isinstance(ids, list):
        raise at.error(
            "output_ids",
            f"is {type(ids).__name__}, expected a list of token ids (the request must set return_logprob=true)",
        )
    for k, t in enumerate(ids):
        if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise at.error(f"output_ids[{k}]", f"is {t!r:.80}, expected an int token id {bound}")
    return ids


def _log_probs(entries: Any, ids: list[int], at: _Where) -> list[float]:
    field = "meta_info.output_token_logprobs"
    if not isinstance(entries, list):
        raise at.error(
            field,
            f"is {type(entries).__name__}, expected [[logprob, token_id, text], ...] (the request must set return_logprob=true)",
        )
    if len(entries) != len(ids):
        raise at.error(
            field, f"has {len(entries)} entries for {len(ids)} output_ids; they must agree"
        )
    out = []
    for k, (entry, tok) in enumerate(zip(entries, ids)):
        if not isinstance(entry, list) or len(entry) < 2:
            raise at.error(f"{field}[{k}]", f"is {entry!r:.80}, expected [logprob, token_id, text]")
        lp, eid = entry[0], entry[1]
        if (
            isinstance(lp, bool)
            or not isinstance(lp, (int, float))
            or not math.isfinite(lp)
            or lp > LOGPROB_TOLERANCE
        ):
            raise at.error(f"{field}[{k}][0]", f"is {lp!r:.80}, expected a finite log-prob <= 0")
        if eid != tok:
            raise at.error(f"{field}[{k}][1]", f"is token {eid!r:.40} but output_ids[{k}] is {tok}")
        out.append(float(lp))
    return out


def parse_generate_item(
    item: Any, prompt_index: int, *, vocab_size: int | None = None, where: str = "SGLang /generate"
) -> Completion:
    """Map one ``/generate`` answer item to a :class:`Completion`, checking every field it reads.

    Raises:
        SGLangResponseError: naming the field that breaks the protocol.

    Example:
        >>> item = {"output_ids": [7, 2], "meta_info": {"completion_tokens": 2,
        ...     "finish_reason": {"type": "stop", "matched": 2}, "weight_version": "3",
        ...     "output_token_logprobs": [[-0.1, 7, None], [-0.2, 2, None]]}}
        >>> c = parse_generate_item(item, 0)
        >>> c.token_ids, c.log_probs, c.finish_reason, c.meta["server_weight_version"]
        ([7, 2], [-0.1, -0.2], 'stop', '3')
    """
    at = _Where(where, prompt_index)
    if not isinstance(item, Mapping):
        raise at.error(
            "answer item", f"is {type(item).__name__} ({item!r:.80}), expected an object"
        )
    meta = item.get("meta_info")
    if not isinstance(meta, Mapping):
        raise at.error("meta_info", f"is {type(meta).__name__}, expected an object")
    kind = _finish_type(meta, at)
    ids, entries = item.get("output_ids"), meta.get("output_token_logprobs")
    if kind == "abort" and not ids and not entries:  # aborted while waiting: SGLang sends no tokens
        ids, entries = [], []
    ids = _token_ids(ids, at, vocab_size)
    log_probs = _log_probs(entries, ids, at)
    count = meta.get("completion_tokens", len(ids))
    if kind != "abort" and count != len(ids):
        raise at.error(
            "meta_info.completion_tokens",
            f"is {count!r:.40} but there are {len(ids)} output_ids; they must agree",
        )
    version = meta.get("weight_version")
    return Completion(
        prompt_index=prompt_index,
        token_ids=list(ids),
        log_probs=log_probs,
        finish_reason=kind,
        meta={
            "finish_reason": meta.get("finish_reason"),
            "id": meta.get("id"),
            "server_weight_version": None if version is None else str(version),
        },
    )


def parse_generate_answer(
    answer: Any,
    n: int,
    prompt_index: int,
    *,
    vocab_size: int | None = None,
    where: str = "SGLang /generate",
) -> list[Completion]:
    """The ``n`` completions of one prompt's ``/generate`` answer (an object, or a list of ``n``).

    Raises:
        SGLangResponseError: an empty or malformed answer, or not ``n`` items.

    Example:
        >>> parse_generate_answer(None, 1, 0)
        Traceback (most recent call last):
        ...
        ar_torchrl.backends.sglang.errors.SGLangResponseError: SGLang /generate: prompt 0: answer is empty (null), expected an object or a list of 1
    """
    at = _Where(where, prompt_index)
    if answer is None:
        raise at.error("answer", f"is empty (null), expected an object or a list of {n}")
    items = answer if isinstance(answer, list) else [answer]
    if len(items) != n:
        raise at.error("answer", f"has {len(items)} items, asked n={n}")
    if n > 1 and all(isinstance(it, Mapping) and _is_int(it.get("index")) for it in items):
        items = sorted(items, key=lambda it: it["index"])
    return [
        parse_generate_item(it, prompt_index, vocab_size=vocab_size, where=where) for it in items
    ]
