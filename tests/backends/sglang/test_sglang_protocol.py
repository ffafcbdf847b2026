"""SGLang /generate protocol: request bodies on SGLang's schema, and every malformed answer a clear error.

Malformed answers are the one place the test double leaves the protocol on purpose (the real server
cannot be made to send them); each must become ``SGLangResponseError`` naming the field, never a raw
``TypeError``/``IndexError``/``RecursionError``, and never a silently accepted value.
"""

from __future__ import annotations

import json

import pytest
from support.sglang_helpers import require_schema

from ar_torchrl.backends import SamplingParams
from ar_torchrl.backends.sglang import SGLangBackend, SGLangRequestError, SGLangResponseError
from ar_torchrl.backends.sglang.protocol import generate_body
from ar_torchrl.backends.sglang.schema import validate_generate_request, validate_generate_response

GREEDY = SamplingParams(max_new_tokens=2, temperature=0.0)


def item(ids=(5, 6), lps=((-0.1, 5), (-0.2, 6)), **meta):
    base = {
        "id": "x",
        "prompt_tokens": 1,
        "completion_tokens": len(ids),
        "weight_version": "default",
        "finish_reason": {"type": "length", "length": len(ids)},
        "output_token_logprobs": [[lp, t, None] for lp, t in lps],
    }
    return {"text": "", "output_ids": list(ids), "meta_info": {**base, **meta}}


def test_request_bodies_follow_sglangs_own_schema():
    require_schema()
    sampling = SamplingParams(
        max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(7,)
    )
    body = generate_body([1, 2], 3, sampling, extra={"ignore_eos": True})
    assert body == {
        "input_ids": [1, 2],
        "return_logprob": True,
        "sampling_params": {
            "max_new_tokens": 5,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "stop_token_ids": [7],
            "ignore_eos": True,
            "n": 3,
        },
    }
    assert validate_generate_request(body).return_logprob is True
    seeded = generate_body([1, 2], 2, SamplingParams(seed=10), prompt_index=1)
    assert [p["sampling_seed"] for p in seeded["sampling_params"]] == [12, 13]
    assert validate_generate_request(seeded).input_ids == [[1, 2], [1, 2]]
    validate_generate_response(item())  # the well-formed answer the cases below break


def test_unknown_sampling_keys_are_refused_here_and_by_the_schema(sglang_double):
    with SGLangBackend(sglang_double.url, show_progress=False) as backend:
        with pytest.raises(SGLangRequestError, match="unknown field `max_tokens`"):
            backend.post(
                sglang_double.url,
                "/generate",
                {"input_ids": [1], "sampling_params": {"max_tokens": 3}},
            )
    with pytest.raises(ValueError, match=r"keys SGLang rejects with HTTP 400: \['max_tokens'\]"):
        SGLangBackend("http://127.0.0.1:1", extra_sampling_params={"max_tokens": 3})
    with pytest.raises(ValueError, match=r"set \['temperature'\] through SamplingParams"):
        SGLangBackend("http://127.0.0.1:1", extra_sampling_params={"temperature": 1.0})
    status, answer = sglang_double.generate(
        {"input_ids": [1], "sampling_params": {"temperature": "hot"}}
    )
    assert status == 400 and "expected f64" in answer["error"]


def _raw(obj) -> bytes:
    return (
        obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    )  # NaN/Infinity as Python writes them


MALFORMED = {
    "empty body": (b"", r"answer is empty \(null\)"),
    "null": (None, r"answer is empty \(null\)"),
    "a string": ("hello", r"answer item is str \('hello'\), expected an object"),
    "list for meta_info": (
        {**item(), "meta_info": [1, 2]},
        r"meta_info is list, expected an object",
    ),
    "no meta_info": ({"output_ids": [5]}, r"meta_info is NoneType, expected an object"),
    "no finish_reason": (item(finish_reason=None), r"meta_info.finish_reason is None; expected"),
    "unknown finish type": (
        item(finish_reason={"type": "running"}),
        r"meta_info.finish_reason is \{'type': 'running'\}",
    ),
    "output_ids a dict": (
        {**item(), "output_ids": {"a": 1}},
        r"output_ids is dict, expected a list",
    ),
    "string token id": (
        {**item(), "output_ids": [5, "6"]},
        r"output_ids\[1\] is '6', expected an int token id \[0, 99\)",
    ),
    "bool token id": ({**item(), "output_ids": [True, 6]}, r"output_ids\[0\] is True"),
    "negative token id": (item(ids=(5, -1), lps=((-0.1, 5), (-0.2, -1))), r"output_ids\[1\] is -1"),
    "token id == vocab size": (
        item(ids=(5, 99), lps=((-0.1, 5), (-0.2, 99))),
        r"output_ids\[1\] is 99, expected an int token id \[0, 99\)",
    ),
    "null log-probs": (
        item(output_token_logprobs=None),
        r"meta_info.output_token_logprobs is NoneType",
    ),
    "scalar log-prob entry": (
        item(output_token_logprobs=[-0.1, -0.2]),
        r"output_token_logprobs\[0\] is -0.1, expected \[logprob, token_id, text\]",
    ),
    "short log-prob entry": (
        item(output_token_logprobs=[[-0.1], [-0.2]]),
        r"output_token_logprobs\[0\] is \[-0.1\]",
    ),
    "too few log-probs": (
        item(lps=((-0.1, 5),)),
        r"output_token_logprobs has 1 entries for 2 output_ids",
    ),
    "token mismatch": (
        item(lps=((-0.1, 5), (-0.2, 9))),
        r"output_token_logprobs\[1\]\[1\] is token 9 but output_ids\[1\] is 6",
    ),
    "NaN log-prob": (
        item(lps=((float("nan"), 5), (-0.2, 6))),
        r"output_token_logprobs\[0\]\[0\] is nan, expected a finite log-prob <= 0",
    ),
    "inf log-prob": (
        item(lps=((-0.1, 5), (float("-inf"), 6))),
        r"output_token_logprobs\[1\]\[0\] is -inf",
    ),
    "positive log-prob": (
        item(lps=((0.5, 5), (-0.2, 6))),
        r"output_token_logprobs\[0\]\[0\] is 0.5",
    ),
    "string log-prob": (
        item(lps=(("-0.1", 5), (-0.2, 6))),
        r"output_token_logprobs\[0\]\[0\] is '-0.1'",
    ),
    "completion_tokens disagree": (
        item(completion_tokens=3),
        r"meta_info.completion_tokens is 3 but there are 2 output_ids",
    ),
    "deep nesting": (b"[" * 50_000 + b"]" * 50_000, r"answer nests too deeply"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_answers_name_the_field(sglang_double, case):
    answer, match = MALFORMED[case]
    sglang_double.handlers["/generate"] = lambda body: (200, _raw(answer))
    with SGLangBackend(sglang_double.url, vocab_size=99, show_progress=False) as backend:
        with pytest.raises(SGLangResponseError, match=match):
            backend.generate([[1]], n=1, sampling=GREEDY)


def test_n_mismatch_and_a_list_of_items_out_of_order(sglang_double):
    sglang_double.handlers["/generate"] = lambda body: (200, item(ids=(5,), lps=((-0.1, 5),)))
    with SGLangBackend(sglang_double.url, show_progress=False) as backend:
        with pytest.raises(SGLangResponseError, match=r"answer has 1 items, asked n=2"):
            backend.generate([[1]], n=2, sampling=GREEDY)
        first, second = item(ids=(5,), lps=((-0.1, 5),)), item(ids=(7,), lps=((-0.3, 7),))
        sglang_double.handlers["/generate"] = lambda body: (
            200,
            [{**second, "index": 1}, {**first, "index": 0}],
        )
        out = backend.generate([[1]], n=2, sampling=GREEDY)
    assert [c.token_ids for c in out] == [[5], [7]]
