"""A stalled SGLang server: named in the log while it is silent, its requests moved to the other
servers after ``stall_grace_s``, its late answers discarded, and a sync it cannot answer failed
with the version unchanged. Fast tests on the schema-checked double (``SGLangDouble.sigstop``),
one on two real servers, one of them SIGSTOPped (markers sglang, slow)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
from support.recipe_helpers import typed
from support.sglang_double import serve_double, toy_model
from support.sglang_helpers import require_schema, sglang_backend

import ar_torchrl.backends.sglang.http as http
from ar_torchrl.backends import SamplingParams
from ar_torchrl.backends.registry import BackendContext
from ar_torchrl.backends.sglang import SGLangBackend, SGLangTimeoutError
from ar_torchrl.backends.sglang.config import SGLangBackendConfig
from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.weight_sync import WeightSyncError, named_policy_tensors

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
LOGGER = "ar_torchrl.backends.sglang.client"


def _backend(urls, **kw) -> SGLangBackend:
    return sglang_backend(urls, **kw)


@pytest.fixture
def two_doubles():
    require_schema()
    (a, stop_a), (b, stop_b) = serve_double(), serve_double()
    yield a, b
    a.sigcont(), b.sigcont()  # what a stopped double held ends before the server stops
    stop_a(), stop_b()


def _expected(prompt: list[int]) -> list[int]:
    return toy_model(prompt, {"max_new_tokens": 6, "temperature": 0.0}, 0)[0]


def _messages(caplog, level=logging.WARNING) -> list[tuple[float, str]]:
    return [(r.created, r.getMessage()) for r in caplog.records if r.levelno >= level]


def test_a_stalled_server_costs_the_grace_period_then_its_requests_finish_elsewhere(
    two_doubles, caplog
):
    a, b = two_doubles
    stopped = []

    def answer_once_then_stop(prompt, params, sample):  # b stops in the middle of the batch
        if not stopped:
            stopped.append(time.time())
            b.sigstop()
        return toy_model(prompt, params, sample)

    b.model = answer_once_then_stop
    prompts = [[1, 10 + i] for i in range(6)]
    caplog.set_level(logging.INFO, logger=LOGGER)
    with _backend([a.url, b.url], max_concurrency=2, stall_grace_s=1.0) as backend:
        out = backend.generate(prompts, n=1, sampling=GREEDY)
        stats = dict(backend.stats)
        # b stays out until it answers a probe again; here it does (SIGCONT) while a is slow
        b.sigcont()
        for _ in range(6):
            a.inject("delay", delay_s=0.3)
        later = [[1, 50 + i] for i in range(6)]
        again = backend.generate(later, n=1, sampling=GREEDY)
    assert [c.token_ids for c in out] == [_expected(p) for p in prompts]
    assert [c.token_ids for c in again] == [_expected(p) for p in later]
    assert stats["requests"] == 6 and stats["completions"] == 6 and stats["moved"] >= 1
    assert stats["discarded"] == 0  # the moved requests' sockets were shut down: nothing came late
    warnings = _messages(caplog)
    silent = [(t, m) for t, m in warnings if f"server {b.url} has been silent for" in m]
    assert silent and "they move to the other server(s) if it stays silent" in silent[0][1]
    moved = [(t, m) for t, m in warnings if "moved its" in m]
    assert len(moved) == 1 and f"server {b.url}" in moved[0][1]
    assert f"request(s) to ['{a.url}']" in moved[0][1] and "stall_grace_s=1s" in moved[0][1]
    cost = moved[0][0] - stopped[0]
    print(f"double SIGSTOP -> requests moved: {cost:.2f} s (stall_grace_s=1)")
    assert 0 < cost <= 1.0 + 0.5, f"the stopped server cost {cost:.2f} s with stall_grace_s=1"
    assert any(f"server {b.url} answers again" in m for _, m in warnings)
    assert any(body["input_ids"] in later for body in b.generate_bodies())  # it serves again


def test_the_late_answer_of_a_moved_request_is_discarded(two_doubles, caplog, monkeypatch):
    """The answer that races the move (or one on a socket the client cannot shut down) is dropped:
    each request is counted once, with the answer of the server it was moved to."""
    a, b = two_doubles
    monkeypatch.setattr(http.Flight, "_attach", lambda self, sock: None)  # cancel cannot interrupt
    calls = []

    def wake_b_then_answer(prompt, params, sample):  # a's second request is the moved one
        calls.append(prompt)
        if len(calls) == 2:
            b.sigcont()  # b now answers the request it held, before a does
            time.sleep(1.0)
        return toy_model(prompt, params, sample)

    def other_model(prompt, params, sample):  # b's answers are recognisable
        ids, lps, _ = toy_model(prompt, params, sample)
        return [i + 1 for i in ids], lps, {"type": "length", "length": len(ids)}

    a.model, b.model = wake_b_then_answer, other_model
    caplog.set_level(logging.INFO, logger=LOGGER)
    # a grace well above a loaded machine's answer time: only b (stopped) may look stalled (with
    # 0.5 s, a CI run under heavy load once saw both servers "silent", and the moved request went
    # back to b)
    with _backend([a.url, b.url], max_concurrency=2, stall_grace_s=2.0) as backend:
        backend.context_length  # noqa: B018 - /server_info is read (once) before b stops
        b.sigstop()
        out = backend.generate([[1, 20], [1, 21]], n=1, sampling=GREEDY)
        stats = dict(backend.stats)
    assert [c.token_ids for c in out] == [_expected([1, 20]), _expected([1, 21])]
    assert len(b.generate_bodies()) == 1  # b did answer, late
    assert stats["moved"] == 1 and stats["discarded"] == 1
    assert stats["requests"] == 2 and stats["completions"] == 2
    assert any("late answer of a moved request was discarded" in m for _, m in _messages(caplog, 0))


def test_a_lone_stalled_server_is_named_while_the_client_waits(caplog):
    require_schema()
    double, stop = serve_double()
    caplog.set_level(logging.WARNING, logger=LOGGER)
    try:
        with _backend(double.url, stall_grace_s=0.4, timeout_s=1.5) as backend:
            backend.context_length  # noqa: B018 - /server_info is read (once) before it stops
            double.sigstop()
            start = time.monotonic()
            with pytest.raises(SGLangTimeoutError, match=r"timeout_s=1.5s.*backend.timeout_s"):
                backend.generate([[1, 2]], n=1, sampling=GREEDY)
            assert time.monotonic() - start < 3.0
            assert backend.stats["moved"] == 0
    finally:
        double.sigcont()
        stop()
    warnings = [m for _, m in _messages(caplog)]
    assert any(f"server {double.url} has been silent for" in m for m in warnings)
    assert any(
        "no other server answers to move them to; waiting for it (timeout_s=1.5s)" in m
        for m in warnings
    )


def test_a_stalled_server_fails_the_sync_and_the_version_stays(two_doubles):
    a, b = two_doubles
    a.accept_weight_updates(), b.accept_weight_updates()
    model = build_tiny_qwen3(99)
    with _backend([a.url, b.url], weight_sync="tensor", sync_timeout_s=1.0) as backend:
        b.sigstop()
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match=rf"failed on 1 of 2 server\(s\): {b.url}: "):
            backend.sync_weights(named_policy_tensors(model), version=1)
        assert time.monotonic() - start < 4.0  # sync_timeout_s, not 30 s per request
        assert backend.policy_version == 0 and a.weight_version == b.weight_version == "default"
        b.sigcont()
        backend.sync_weights(named_policy_tensors(model), version=1)  # it reaches both again
        out = backend.generate([[1, 2]] * 4, n=1, sampling=GREEDY)
    assert a.weight_version == b.weight_version == "1"
    assert {(c.policy_version, c.meta["server_weight_version"]) for c in out} == {(1, "1")}


def test_the_timeouts_are_keys_of_the_backend_config(sglang_double, tmp_path):
    prefix = "config: backend."
    with pytest.raises(ValueError, match=r"config: backend.stall_grace_s must be >= 2, got 0.5 \("):
        SGLangBackendConfig(stall_grace_s=0.5).check(prefix)
    with pytest.raises(ValueError, match=r"config: backend.timeout_s must be > 0, got 0"):
        SGLangBackendConfig(timeout_s=0).check(prefix)
    with pytest.raises(ValueError, match=r"config: backend.sync_timeout_s must be > 0, got -1"):
        SGLangBackendConfig(sync_timeout_s=-1).check(prefix)
    with pytest.raises(ValueError, match=r"SGLangBackend: stall_grace_s must be > 0, got 0"):
        SGLangBackend("http://127.0.0.1:9", stall_grace_s=0)
    with pytest.raises(ValueError, match=r"config: backend.stall_grace_s must be >= 2, got 1.0"):
        typed(["backend=sglang", "backend.stall_grace_s=1"])
    cfg = typed(
        [
            "backend=sglang",
            f"backend.url={sglang_double.url}",
            "backend.timeout_s=30",
            "backend.stall_grace_s=null",
            "backend.sync_timeout_s=5",
        ]
    ).backend
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=99))
    with contextlib.ExitStack() as stack:
        backend = cfg.build(BackendContext(model, None, tmp_path, stack))
        assert (backend.timeout_s, backend.stall_grace_s, backend.sync_timeout_s) == (30, None, 5)
    defaults = typed(["backend=sglang"]).backend
    assert (defaults.timeout_s, defaults.stall_grace_s, defaults.sync_timeout_s) == (600, 60, 600)


# ---------------------------------------------------------------------------------------------
# Two real servers (SGLang 0.5.23 on CPU), one SIGSTOPped in the middle of a batch
# ---------------------------------------------------------------------------------------------

GRACE_S = 10.0
STOP_AFTER_S = 0.3  # after the second server got its first request of the batch


@pytest.mark.sglang
@pytest.mark.slow
def test_a_sigstopped_real_server_costs_the_grace_period(sglang_server, second_server, caplog):
    second = second_server.get()
    urls = [sglang_server.url, second.url]
    sampling = SamplingParams(max_new_tokens=128, temperature=0.0)
    caplog.set_level(logging.INFO, logger=LOGGER)
    with _backend(
        urls,
        max_concurrency=4,
        stall_grace_s=GRACE_S,
        timeout_s=300,
        extra_sampling_params={"ignore_eos": True},
        vocab_size=99,
    ) as backend:
        # both servers on the same weights (other tests change them), then one reference answer
        backend.sync_weights(named_policy_tensors(build_tiny_qwen3(99, seed=0)), version=500)
        reference = backend.generate([[1, 30, 31]], n=1, sampling=sampling)[0].token_ids
        stopped: list[float] = []  # wall clock of the SIGSTOP (log records carry wall clock)
        session, inner = backend.session, backend.session.request

        def stop_second() -> None:
            os.kill(second.pid, signal.SIGSTOP)
            stopped.append(time.time())

        def request(method, url, **kw):  # stop the second server while it computes a request
            if url == second.url + "/generate" and not timers:
                timers.append(threading.Timer(STOP_AFTER_S, stop_second))
                timers[0].start()
            return inner(method, url, **kw)

        timers: list[threading.Timer] = []
        session.request = request
        try:
            start = time.time()
            out = backend.generate([[1, 30, 31]] * 8, n=1, sampling=sampling)
            end = time.time()
            stats = dict(backend.stats)
        finally:
            for timer in timers:
                timer.join()
            os.kill(second.pid, signal.SIGCONT)
            session.request = inner
    with _backend([second.url], stall_grace_s=None) as resumed:
        resumed.wait_until_healthy(timeout_s=60)  # the fixture stops it cleanly later
    assert len(out) == 8 and all(c.token_ids == reference for c in out)
    assert {(c.policy_version, c.meta["server_weight_version"]) for c in out} == {(500, "500")}
    assert stats["moved"] >= 1 and stats["requests"] == 9 and stats["completions"] == 9
    warnings = _messages(caplog)
    silent = [(t, m) for t, m in warnings if f"server {second.url} has been silent for" in m]
    moved = [(t, m) for t, m in warnings if f"server {second.url}" in m and "moved its" in m]
    assert silent and len(moved) == 1
    assert f"to ['{sglang_server.url}']" in moved[0][1]
    cost = moved[0][0] - stopped[0]
    print(
        f"SIGSTOP -> requests moved: {cost:.2f} s (stall_grace_s={GRACE_S}); first warning after "
        f"{silent[0][0] - stopped[0]:.2f} s; batch: {end - start:.2f} s, {end - moved[0][0]:.2f} s "
        f"of it after the move; {stats['moved']} moved, {stats['discarded']} late answers dropped"
    )
    assert cost <= GRACE_S + 2.0
