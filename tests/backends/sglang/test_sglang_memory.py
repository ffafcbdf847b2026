"""The colocated SGLang server's memory lifecycle (``ar_torchrl.backends.sglang.memory``).

Release and resume around each update as an idempotent, state-tracked step: pause, release, a
barrier on the device before the trainer allocates (the release answers early: the double frees
the memory ``release_lag_s`` after its answer), resume, cache flush, and generation only after the
weights were synced. SGLang 0.5.23's CPU server dies on ``/release_memory_occupation`` (its
scheduler calls ``torch.cuda.synchronize()``: ``RuntimeError: Found no NVIDIA driver on your
system``), so the lifecycle runs against the protocol double (``tests/support/sglang_double.py``), whose
request fields are checked against SGLang's installed ``io_struct`` source here; the one real-server
test checks that the backend refuses a CPU server before anything is sent (markers ``sglang``,
``slow``).
"""

from __future__ import annotations

import ast
import logging
import time
from types import SimpleNamespace

import pytest
import requests
from support.recipe_helpers import typed
from support.sglang_double import IO_STRUCT_FIELDS, MEMORY_TAGS, serve_double, toy_model
from support.sglang_helpers import require_schema, sglang_backend

import ar_torchrl.backends.sglang.http as http
from ar_torchrl.backends import SamplingParams
from ar_torchrl.backends.sglang import (
    SGLangBackend,
    SGLangMemoryError,
    SGLangUnavailableError,
)
from ar_torchrl.backends.sglang.schema import default_sglang_venv, load_api_types
from ar_torchrl.distributed.context import DistContext
from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.recipes.dapo_ppo.loop import engine_memory
from ar_torchrl.weight_sync import WeightSyncError, named_policy_tensors

GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)
CAPACITY = 80 << 30  # the fake device the doubles share


def _backend(urls, **kw) -> SGLangBackend:
    kw.setdefault("weight_sync", "tensor")
    return sglang_backend(urls, **kw)


def _probe(*doubles):
    """Free bytes of a device the doubles share (what ``torch.cuda.mem_get_info`` would say)."""
    return lambda: CAPACITY - sum(d.held_bytes() for d in doubles)


def _tensors():
    return named_policy_tensors(build_tiny_qwen3(99, seed=0))


def _paths(double, since: int = 0) -> list[str]:
    return [p for p, _ in double.requests[since:] if not p.startswith(("/health", "/v1/loads"))]


@pytest.fixture
def colocated():
    """A GPU-like double (memory saver on) that answers weight updates; the release frees the
    memory 0.3 s after its answer (slime #579)."""
    require_schema()
    double, stop = serve_double()
    double.release_lag_s = 0.3
    double.accept_weight_updates()
    yield double
    stop()


def test_release_barrier_resume_flush_then_the_sync_lets_generation_continue(colocated):
    double = colocated
    with _backend(double.url) as backend:
        before = backend.generate([[1, 2, 3]], 1, GREEDY)
        mark = len(double.requests)
        start = time.monotonic()
        report = backend.release_memory(probe=_probe(double))
        waited = time.monotonic() - start
        # the barrier held the call until the device showed the memory free (0.3 s after the
        # answer), at least half of what /v1/loads reported for all tags
        assert waited >= 0.3 and report["barrier_s"] >= 0.25
        assert report["freed_bytes"] == int(6.5 * 2**30) and double.held_bytes() == 0
        assert backend.memory_state == "released" and double.offloaded == set(MEMORY_TAGS)
        assert _paths(double, mark) == ["/pause_generation", "/release_memory_occupation"]
        assert [b for p, b in double.requests if p.startswith("/pause")] == [{"mode": "abort"}]
        assert [b for p, b in double.requests if p.startswith("/release")] == [{}]
        assert backend.release_memory() == {}  # idempotent: nothing sent again
        with pytest.raises(SGLangMemoryError, match=r"memory is released.*resume_memory\(\)"):
            backend.generate([[1, 2, 3]], 1, GREEDY)
        mark = len(double.requests)
        with pytest.raises(WeightSyncError, match=r"weight sync refused.*resume_memory\(\) first"):
            backend.sync_weights(_tensors(), version=1)
        assert _paths(double, mark) == [] and backend.policy_version == 0  # nothing sent

        assert set(backend.resume_memory()) == {"resume_s"}
        assert backend.memory_state == "resuming" and double.offloaded == set()
        assert _paths(double, mark) == ["/resume_memory_occupation", "/flush_cache"]
        assert backend.resume_memory() == {}  # idempotent
        with pytest.raises(SGLangMemoryError, match=r"call sync_weights\(\) first"):
            backend.generate([[1, 2, 3]], 1, GREEDY)
        assert double.paused == "abort"  # other clients are held too

        mark = len(double.requests)
        backend.sync_weights(_tensors(), version=1)
        paths = _paths(double, mark)
        assert paths.index("/update_weights_from_tensor") < paths.index("/continue_generation")
        assert backend.memory_state == "resident" and double.paused is None
        after = backend.generate([[1, 2, 3]], 1, GREEDY)
        assert after[0].policy_version == 1 and after[0].token_ids == before[0].token_ids
    assert double.crashed is None and double.weights_valid


def test_a_barrier_that_times_out_names_the_numbers_and_the_next_call_waits_again(colocated):
    double = colocated
    double.release_lag_s = 0.6
    with _backend(double.url) as backend:
        with pytest.raises(
            SGLangMemoryError,
            match=r"device freed only 0 MiB of the expected >= 3328 MiB within 0.2 s",
        ):
            backend.release_memory(probe=_probe(double), timeout_s=0.2)
        assert backend.memory_state == "released"  # the server did release
        mark = len(double.requests)
        report = backend.release_memory(probe=_probe(double), timeout_s=10)
        assert report["release_s"] == 0 and report["freed_bytes"] == int(6.5 * 2**30)
        assert _paths(double, mark) == []  # only waited
    assert double.crashed is None


def test_only_what_is_left_is_done_after_a_failure_part_way(colocated):
    """Two servers; the second refuses its release once (HTTP 400): the first stays released and
    is not sent it again (SGLang would die of a second release), the generation is refused, and
    the next call finishes the second."""
    b, stop_b = serve_double()
    b.accept_weight_updates()
    refusals = iter([(400, {"error": {"message": "injected: busy"}})])
    b.handlers["/release_memory_occupation"] = lambda body: (
        next(refusals, None) or b.memory("/release_memory_occupation", body)
    )
    try:
        with _backend([colocated.url, b.url]) as backend:
            with pytest.raises(
                SGLangMemoryError,
                match=rf"release failed on 1 of 2 server\(s\): {b.url} \(paused\)",
            ):
                backend.release_memory(probe=None)
            assert backend.memory_state == "releasing"
            assert backend._memory.states == {colocated.url: "released", b.url: "paused"}
            with pytest.raises(SGLangMemoryError, match=r"stopped part-way"):
                backend.generate([[1, 2]], 1, GREEDY)
            backend.release_memory(probe=None)
            releases = [
                [p for p, _ in d.requests].count("/release_memory_occupation")
                for d in (colocated, b)
            ]
            assert releases == [1, 2] and backend.memory_state == "released"
            backend.resume_memory()
            backend.sync_weights(_tensors(), version=3)
            out = backend.generate([[1, 2]] * 2, 1, GREEDY)
            assert {c.policy_version for c in out} == {3}
    finally:
        stop_b()
    assert colocated.crashed is None and b.crashed is None


def test_a_cpu_server_or_one_without_memory_saver_is_refused_before_anything_is_sent(colocated):
    for key, value, message in [
        ("device", "cpu", r"runs on device='cpu'.*Found no NVIDIA driver on your system"),
        ("enable_memory_saver", False, r"runs without --enable-memory-saver"),
    ]:
        setattr(colocated, key, value)
        with _backend(colocated.url) as backend:
            with pytest.raises(SGLangMemoryError, match=message):
                backend.release_memory(probe=_probe(colocated))
            assert backend.memory_state == "resident"
            assert backend.generate([[1, 2]], 1, GREEDY)[0].finish_reason == "length"
        setattr(colocated, key, {"device": "cuda", "enable_memory_saver": True}[key])
    assert not [p for p, _ in colocated.requests if "memory" in p or "pause" in p]
    assert colocated.crashed is None


def test_transient_errors_are_retried_and_a_lost_answer_stops_the_lifecycle(colocated):
    double = colocated
    unavailable = iter([(503, {"error": {"message": "overloaded"}})])
    double.handlers["/resume_memory_occupation"] = lambda body: (
        next(unavailable, None) or double.memory("/resume_memory_occupation", body)
    )
    with _backend(double.url) as backend:
        backend.release_memory(probe=None)
        backend.resume_memory()  # the 503 (nothing processed) was retried
        assert backend.retries == 1 and backend.memory_state == "resuming"
        backend.sync_weights(_tensors(), version=1)

        session, inner = backend.session, backend.session.request

        def lost(method, url, **kw):  # the server applies the release; its answer is lost
            answer = inner(method, url, **kw)
            if url.endswith("/release_memory_occupation"):
                raise requests.exceptions.ConnectionError("('Connection aborted.', reset)")
            return answer

        session.request = lost
        with pytest.raises(SGLangMemoryError, match=r"may have applied it"):
            backend.release_memory(probe=None)
        session.request = inner
        assert backend.memory_state == "unknown"
        mark = len(double.requests)
        for step in (backend.release_memory, backend.resume_memory):
            with pytest.raises(SGLangMemoryError, match=r"is unknown.*restart it"):
                step()
        with pytest.raises(SGLangMemoryError, match=r"memory is unknown"):
            backend.generate([[1, 2]], 1, GREEDY)
        assert _paths(double, mark) == []  # nothing more is sent there
    assert (
        double.crashed is None
        and [p for p, _ in double.requests].count("/release_memory_occupation") == 2
    )


def test_a_request_that_must_not_repeat_is_retried_only_when_it_never_arrived(
    sglang_double, monkeypatch
):
    """``idempotent=False``: a refused connection is retried (then 'not reachable'), a
    connection dropped after the request went out is not (it may have been applied)."""
    monkeypatch.setattr(http.time, "sleep", lambda s: None)
    client = http.HttpClient(retry=http.RetryPolicy(max_retries=2), connect_timeout_s=0.5)
    with pytest.raises(SGLangUnavailableError, match=r"not reachable .*3 attempt\(s\)"):
        client.request("POST", ["http://127.0.0.1:9"], "/x", {}, timeout_s=1, idempotent=False)
    sglang_double.inject("drop")
    with pytest.raises(SGLangUnavailableError, match=r"after the request was sent; the server may"):
        client.request("POST", [sglang_double.url], "/generate", {}, timeout_s=5, idempotent=False)
    assert client.stats["retries"] == 2  # the two reconnects, not the dropped request
    sglang_double.inject("drop")
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    answer = client.request("POST", [sglang_double.url], "/generate", body, timeout_s=5)
    assert answer["output_ids"] == toy_model([1, 2], {"max_new_tokens": 2}, 0)[0]


def test_where_sglang_dies_the_double_dies():
    """The double's fatal cases, as SGLang 0.5.23 (the client must never reach them)."""
    require_schema()
    for setup, path, reason in [
        (dict(device="cpu"), "/release_memory_occupation", "Found no NVIDIA driver"),
        ({}, "/resume_memory_occupation", "KeyError: 'weights'"),
    ]:
        double, stop = serve_double()
        for key, value in setup.items():
            setattr(double, key, value)
        try:
            with pytest.raises(requests.exceptions.ConnectionError):
                requests.post(double.url + path, json={}, timeout=5)
            assert reason in double.crashed
            time.sleep(0.2)
            with pytest.raises(requests.exceptions.ConnectionError):  # the port is gone
                requests.get(double.url + "/health", timeout=5)
        finally:
            stop()


def test_the_doubles_request_fields_are_sglangs():
    """The fields of the routes without an api_types schema, as the installed SGLang's
    ``io_struct`` declares them (and ``BaseReq``'s ``rid``/``http_worker_ipc``); the abort body
    is checked with api_types' own ``AbortRequest``."""
    require_schema()
    srt = next(default_sglang_venv().glob("lib/python3*/site-packages/sglang/srt"))
    tree = ast.parse((srt / "managers" / "io_struct.py").read_text())
    fields = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            fields[node.name] = {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    for name, want in IO_STRUCT_FIELDS.items():
        assert fields[name] | fields["BaseReq"] == want, name
    constants = {
        node.targets[0].id: node.value.value
        for node in ast.parse((srt / "constants.py").read_text()).body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
    }
    assert {v for k, v in constants.items() if k.startswith("GPU_MEMORY_TYPE_")} == set(MEMORY_TAGS)
    api = load_api_types()
    assert set(api.AbortRequest.__struct_fields__) == {"rid", "abort_all"}


def test_the_config_key_and_the_recipe_steps(sglang_double, caplog):
    with pytest.raises(ValueError, match=r"run on backend.device=cpu, where SGLang 0.5.23's"):
        typed(["backend=sglang", "backend.release_memory_during_update=true"])
    cfg = typed(
        ["backend=sglang", "backend.release_memory_during_update=true", "backend.device=cuda"]
    ).backend
    assert cfg.server_args() == ["--enable-memory-saver"]
    running = typed(
        ["backend=sglang", "backend.release_memory_during_update=true", "backend.url=http://h:1"]
    )
    assert running.backend.release_memory_during_update  # running servers: checked at release

    with pytest.raises(ValueError, match=r"needs train.mode=sync \(got async\)"):
        typed(
            [
                "backend=sglang",
                "backend.release_memory_during_update=true",
                "backend.url=http://h:1",
                "train.mode=async",
            ]
        )

    sglang_double.accept_weight_updates()
    with _backend(sglang_double.url) as backend:
        run = SimpleNamespace(
            cfg=running,
            collector=SimpleNamespace(env=SimpleNamespace(backend=backend)),
            strategy=SimpleNamespace(ctx=DistContext()),
        )
        with caplog.at_level(logging.INFO, "ar_torchrl.backends.sglang.memory"):
            engine_memory(run, release=True)
            assert backend.memory_state == "released"
            engine_memory(run, release=False)
        assert backend.memory_state == "resuming"
        backend.sync_weights(_tensors(), version=1)  # the loop's push_policy
        assert backend.memory_state == "resident" and "released on 1 server(s)" in caplog.text
        other_rank = SimpleNamespace(cfg=run.cfg, collector=None, strategy=run.strategy)
        engine_memory(other_rank, release=True)  # no backend there: the barrier only


@pytest.mark.sglang
@pytest.mark.slow
def test_a_real_cpu_server_is_refused_clearly_and_survives(sglang_server):
    with _backend(sglang_server.url, weight_sync="disk") as backend:
        info = backend.server_info()[0]
        assert info["device"] == "cpu" and info["enable_memory_saver"] is False
        with pytest.raises(
            SGLangMemoryError,
            match=r"runs on device='cpu'.*'RuntimeError: Found no NVIDIA driver on your system'",
        ):
            backend.release_memory()
        assert backend.memory_state == "resident" and backend.health()
        assert len(backend.generate([[1, 2, 3]], 1, GREEDY)[0]) == 4
