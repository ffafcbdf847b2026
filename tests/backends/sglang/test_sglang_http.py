"""SGLang HTTP transport: retries, whole-request deadline, body limit, API key, unreachable server."""

from __future__ import annotations

import time

import pytest
from support.sglang_double import toy_model
from support.sglang_helpers import sglang_backend

import ar_torchrl.backends.sglang.http as http
from ar_torchrl.backends import SamplingParams
from ar_torchrl.backends.sglang import (
    SGLangBackend,
    SGLangRequestError,
    SGLangResponseError,
    SGLangTimeoutError,
    SGLangUnavailableError,
    free_port,
)
from ar_torchrl.weight_sync import WeightSyncError

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def _backend(urls, **kw) -> SGLangBackend:
    return sglang_backend(urls, **kw)


def test_retries_5xx_and_dropped_connection_with_exponential_backoff(sglang_double, monkeypatch):
    delays = []
    monkeypatch.setattr(http.time, "sleep", delays.append)
    for fault in (
        dict(kind="status", status=503, message="overloaded"),
        dict(kind="drop"),
        dict(kind="status", status=502, message="bad gateway"),
    ):
        sglang_double.inject(**fault)
    with _backend(sglang_double.url, max_retries=3, backoff_s=0.5, backoff_max_s=1.5) as backend:
        out = backend.generate([[1, 2, 3]], n=1, sampling=GREEDY)
        assert backend.retries == 3
    assert delays == [0.5, 1.0, 1.5]
    assert out[0].token_ids == toy_model([1, 2, 3], {"max_new_tokens": 6, "temperature": 0.0}, 0)[0]


def test_retries_are_bounded(sglang_double):
    for _ in range(3):
        sglang_double.inject("status", status=500, message="boom")
    with _backend(sglang_double.url, max_retries=2) as backend:
        with pytest.raises(SGLangUnavailableError, match=r"after 3 attempt\(s\).*HTTP 500: boom"):
            backend.generate([[1, 2]], n=1, sampling=GREEDY)
        assert backend.retries == 2


def test_4xx_raises_with_server_message_and_no_retry(sglang_double):
    sglang_double.inject(
        "status", status=400, message="Requested token count exceeds the context length"
    )
    with _backend(sglang_double.url) as backend:
        with pytest.raises(
            SGLangRequestError, match="HTTP 400.*exceeds the context length"
        ) as info:
            backend.generate([[1, 2]], n=1, sampling=GREEDY)
        assert info.value.status == 400 and backend.retries == 0


def test_the_deadline_bounds_a_dripping_answer(sglang_double):
    sglang_double.inject("drip", delay_s=0.25)  # 80 bytes, one every 0.25 s: 20 s in all
    with _backend(sglang_double.url, timeout_s=1.0) as backend:
        backend.context_length  # noqa: B018 - read /server_info before the clock starts
        start = time.monotonic()
        with pytest.raises(SGLangTimeoutError, match=r"no complete answer within timeout_s=1.0s"):
            backend.generate([[1, 2]], n=1, sampling=GREEDY)
        assert time.monotonic() - start < 5.0  # the deadline, not 20 s of dripping
        assert backend.retries == 0


def test_a_slow_server_times_out(sglang_double):
    sglang_double.inject("delay", delay_s=1.0)
    with _backend(sglang_double.url, timeout_s=0.2) as backend:
        with pytest.raises(SGLangTimeoutError, match=r"timeout_s=0.2s"):
            backend.generate([[1, 2]], n=1, sampling=GREEDY)


@pytest.mark.parametrize("kind", ["declared", "streamed"])
def test_answers_above_the_body_limit_are_refused(sglang_double, kind):
    if kind == "declared":  # Content-Length says it
        sglang_double.handlers["/generate"] = lambda body: (200, b"[" + b"0," * 40_000 + b"0]")
    else:  # no Content-Length: counted while reading
        sglang_double.inject("flood", size=80_000)
    with _backend(sglang_double.url, max_response_bytes=50_000) as backend:
        with pytest.raises(SGLangResponseError, match=r"exceeds max_response_bytes=50000"):
            backend.generate([[1, 2]], n=1, sampling=GREEDY)


def test_api_key_is_sent_and_a_missing_key_is_named(sglang_double):
    sglang_double.api_key = "secret"
    with _backend(sglang_double.url, api_key="secret") as backend:
        assert len(backend.generate([[1, 2]], n=1, sampling=GREEDY)) == 1
    auth = [p for p, _ in sglang_double.requests]
    assert "/generate" in auth
    with _backend(sglang_double.url, api_key="") as backend:  # explicitly none
        assert backend.health()  # /health needs no key, as in SGLang
        with pytest.raises(
            SGLangRequestError,
            match=r"HTTP 401\): Unauthorized; the server requires an API key: pass api_key=",
        ):
            backend.generate([[1, 2]], n=1, sampling=GREEDY)


def test_an_unreachable_server_is_said_once_and_short():
    dead = f"http://127.0.0.1:{free_port()}"
    with _backend(dead, max_retries=2, connect_timeout_s=0.5) as backend:
        assert backend.health() is False
        with pytest.raises(SGLangUnavailableError, match=r"not healthy after 0.3s"):
            backend.wait_until_healthy(timeout_s=0.3, poll_s=0.1)
        with pytest.raises(SGLangUnavailableError) as info:
            backend.generate([[1, 2]], n=1, sampling=GREEDY)
        assert str(info.value) == (
            f"the SGLang server at {dead} is not reachable ([Errno 111] Connection refused, 3 "
            "attempt(s)); is it running, and is the URL right?"
        )
        assert (
            info.value.__cause__ is None and info.value.__context__ is None
        )  # no chained traceback
        assert backend.retries == 2
        with pytest.raises(
            WeightSyncError, match=rf"is not reachable.*{dead}|{dead} is not reachable"
        ) as info:
            backend.sync_weights([("w", __import__("torch").ones(1))], version=1)
        assert str(info.value).count("not reachable") == 1


def test_non_json_and_deeply_nested_answers(sglang_double):
    sglang_double.handlers["/generate"] = lambda body: (200, b"<html>oops</html>")
    with _backend(sglang_double.url) as backend:
        with pytest.raises(SGLangResponseError, match=r"answer is not JSON: b'<html>oops</html>'"):
            backend.generate([[1]], n=1, sampling=GREEDY)
        sglang_double.handlers["/generate"] = lambda body: (200, b"[" * 100_000 + b"]" * 100_000)
        with pytest.raises(SGLangResponseError, match="answer nests too deeply"):
            backend.generate([[1]], n=1, sampling=GREEDY)
