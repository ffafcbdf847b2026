"""SGLangBackend behind a real sglang-router (``ar_torchrl.backends.sglang.router``).

Fast tests: the config keys and their errors, the wiring of ``backend.router=launch`` in front of
``num_servers`` launched servers, the router's worker list and its error paths. With the SGLang
environment (marker ``sglang``): the real router (it starts in ~2 s) in front of two protocol
doubles (``tests/support/sglang_double.py``): requests and their RL fields go through it, every sync
reaches both workers and flushes their caches, a worker that fails its sync fails the sync, and the
router dies with the process that launched it. Real servers (markers ``sglang``, ``slow``): the
session's two SGLang servers behind a launched router (``backend.router=launch``): after every sync
both serve the new weights and report the version; one of them SIGKILLed mid-sync fails the sync
with the version unchanged; the router does not outlive its owner.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import requests
import torch
from support.recipe_helpers import typed
from support.sglang_double import serve_double, toy_model
from support.sglang_helpers import (
    ROOT,
    alive,
    children_named,
    group_pids,
    require_schema,
    require_sglang_venv,
    trainer_log_probs,
    trainer_with_value_head,
    wait_until,
)

import ar_torchrl.backends.sglang.launcher as launcher
import ar_torchrl.backends.sglang.router as router_module
from ar_torchrl.backends import SamplingParams
from ar_torchrl.backends.registry import BackendContext
from ar_torchrl.backends.sglang import SGLangBackend, SGLangResponseError
from ar_torchrl.backends.sglang.router import launch_sglang_router, router_workers
from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.weight_sync import WeightSyncError, named_policy_tensors

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
PREFIX = "config: backend."
ROUTER_COMM = "sglang::router"  # the router's process title (and /proc/<pid>/comm)


def _model():
    return SimpleNamespace(config=SimpleNamespace(vocab_size=99))


# ---------------------------------------------------------------------------------------------
# Fast: config keys, wiring, worker list (no process)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["backend.router=lunch"], r"backend.router='lunch' must be none, launch, or the URL"),
        (["backend.router=http://r"], r"backend.router='http://r' is not a server URL"),
        (
            ["backend.router=http://127.0.0.1:30000", "backend.url=http://127.0.0.1:30001"],
            r"backend.url='http://127.0.0.1:30001' must be null when backend.router is a URL",
        ),
        (["backend.num_servers=0"], r"backend.num_servers must be >= 1 and <= 64, got 0"),
        (
            ["backend.num_servers=2", "backend.url=http://127.0.0.1:30001"],
            r"backend.num_servers=2 launches servers but backend.url names running ones",
        ),
        (
            ["backend.router_args=[--policy,round_robin]"],
            r"router_args / backend.router_health_checks configure a launched router; set "
            r"backend.router=launch \(it is 'none'\)",
        ),
    ],
)
def test_router_keys_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        typed(["backend=sglang", *overrides])


def test_router_keys_and_which_servers_start_with_the_trainer_weights():
    def cfg(*overrides):
        return typed(["backend=sglang", *overrides]).backend

    assert cfg().router_mode == "none" and cfg().starts_with_trainer_weights()
    launched = cfg("backend.router=launch", "backend.num_servers=3")
    assert launched.router_mode == "launch" and launched.starts_with_trainer_weights()
    running = cfg("backend.router=http://127.0.0.1:30000")
    assert running.router_mode == "url" and not running.starts_with_trainer_weights()
    given = cfg("backend.router=launch", "backend.url=[http://a:1,http://b:2]")
    assert not given.starts_with_trainer_weights()


def test_router_launch_starts_num_servers_then_a_router_in_front(
    sglang_double, monkeypatch, tmp_path
):
    """The wiring of ``backend.router=launch`` with ``backend.url=null``: ``num_servers`` servers
    on the starting policy (one model directory, removed by the first-launched one), then a router
    given their URLs; the backend sends requests to the router and syncs the servers."""
    calls = []

    @contextlib.contextmanager
    def fake_server(model_dir, **kw):
        calls.append(("server", model_dir, kw["log_file"].name, kw["owned_dirs"]))
        yield SimpleNamespace(url=sglang_double.url + f"/s{len(calls)}")

    @contextlib.contextmanager
    def fake_router(urls, **kw):
        calls.append(("router", urls, kw["log_file"].name, kw["extra_args"]))
        yield SimpleNamespace(url=sglang_double.url)

    monkeypatch.setattr(launcher, "launch_sglang_server", fake_server)
    monkeypatch.setattr(router_module, "launch_sglang_router", fake_router)
    monkeypatch.setattr(SGLangBackend, "health", lambda self: True)
    cfg = typed(
        [
            "backend=sglang",
            "backend.router=launch",
            "backend.num_servers=2",
            "backend.router_args=[--policy,round_robin]",
        ]
    ).backend
    start = tmp_path / "start"
    with contextlib.ExitStack() as stack:
        backend = cfg.build(BackendContext(_model(), None, tmp_path, stack, start_dir=start))
        assert backend.route_urls == [sglang_double.url] and backend.router_url == sglang_double.url
        assert backend.urls == [sglang_double.url + "/s1", sglang_double.url + "/s2"]
    assert calls == [
        ("server", start, "sglang_server-0.log", []),
        ("server", start, "sglang_server-1.log", []),
        ("router", backend.urls, "sglang_router.log", ["--policy", "round_robin"]),
    ]


def test_the_router_worker_list_is_checked():
    url = "http://127.0.0.1:30000"
    worker = {"id": "a1", "url": "http://127.0.0.1:30001/", "is_healthy": False, "load": 0}
    assert [(w.url, w.id, w.healthy) for w in router_workers({"workers": [worker]}, url)] == [
        ("http://127.0.0.1:30001", "a1", False)
    ]
    cases = [
        (
            {"detail": "Not Found"},
            r"expected \{'workers': \[...\]\}.*is http://127.0.0.1:30000 an sglang-router",
        ),
        ({"workers": [{"id": "x"}]}, r"workers\[0\] has no 'url'"),
        (
            {"workers": [{"url": "grpc://127.0.0.1:1"}]},
            r"'grpc://127.0.0.1:1' is not an http\(s\)://host:port server",
        ),
        ({"workers": [worker, worker]}, r"a worker is listed twice"),
        ({"workers": []}, r"lists no worker: add the servers to it \(POST /workers"),
    ]
    for answer, message in cases:
        with pytest.raises(SGLangResponseError, match=message):
            router_workers(answer, url)


def test_a_router_without_workers_list_fails_the_sync_before_anything_is_sent(sglang_double):
    """A router URL that does not list workers (here a plain server: 404 on /workers) or does
    not answer: the sync is refused (nothing sent), the version unchanged; ``health()`` is
    ``False``; keys the router would drop are refused up front."""
    model = build_tiny_qwen3(99, seed=0)
    with SGLangBackend(
        router_url=sglang_double.url, show_progress=False, backoff_s=0.01
    ) as backend:
        assert backend.health() is False
        with pytest.raises(
            WeightSyncError,
            match=r"weight sync to version 1 not started: the workers of the sglang-router could "
            r"not be read \(.*HTTP 404.*; the engine keeps policy_version 0",
        ) as info:
            backend.sync_weights(named_policy_tensors(model), version=1)
        assert not info.value.partial and backend.policy_version == 0
    assert {p for p, _ in sglang_double.requests} == {"/workers"}  # nothing else was sent
    with pytest.raises(
        ValueError, match=r"extra_sampling_params \['logit_bias'\] would be dropped"
    ):
        SGLangBackend(
            router_url=sglang_double.url, extra_sampling_params={"logit_bias": {"5": 1.0}}
        )
    with pytest.raises(ValueError, match=r"pass the servers' `urls`, or the `router_url`"):
        SGLangBackend()
    with pytest.raises(ValueError, match=r"router_url must start with http:// or https://"):
        SGLangBackend(router_url="127.0.0.1:30000")


def test_a_router_url_given_as_a_server_is_named_when_a_sync_gets_404(sglang_double):
    """Before this module, a router URL in ``urls`` was documented as working; it has no weight
    route: the error says to give it as the router."""
    with SGLangBackend(sglang_double.url, show_progress=False, weight_sync="tensor") as backend:
        with pytest.raises(WeightSyncError, match=r"HTTP 404.*is that URL an sglang-router\?"):
            backend.sync_weights(named_policy_tensors(build_tiny_qwen3(99, seed=0)), version=1)


# ---------------------------------------------------------------------------------------------
# The real router in front of two protocol doubles (needs .venv-sglang, where it is installed)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def two_workers(tmp_path, sglang_api_key):
    """Two doubles that serve a local directory (the router loads its tokenizer from a worker's
    ``model_path``: a local path keeps it off the network) and require the session's API key."""
    require_schema()
    require_sglang_venv()
    doubles = []
    for name in "ab":
        (tmp_path / name).mkdir()
        double, stop = serve_double()
        double.model_path, double.api_key = str(tmp_path / name), sglang_api_key
        double.accept_weight_updates()
        doubles.append((double, stop))
    yield [d for d, _ in doubles]
    for _, stop in doubles:
        stop()


@pytest.mark.sglang
def test_requests_go_through_the_router_and_syncs_reach_each_worker(two_workers, tmp_path):
    a, b = two_workers
    log = tmp_path / "router.log"
    with launch_sglang_router([a.url, b.url], log_file=log, timeout_s=60) as router:
        assert router.api_key and router.metrics_port  # the session's key, metrics on loopback
        with SGLangBackend(
            router_url=router.url, weight_sync="tensor", show_progress=False, max_concurrency=2
        ) as backend:
            assert backend.urls == sorted([a.url, b.url]) and backend.health()
            prompts = [[1, 10 + i, 20 + i] for i in range(6)]
            sampling = SamplingParams(max_new_tokens=5, temperature=1.0)
            out = backend.generate(prompts, n=2, sampling=sampling)
            params = {"max_new_tokens": 5, "temperature": 1.0}
            assert [c.token_ids for c in out] == [
                toy_model(prompts[i], params, j)[0] for i in range(6) for j in range(2)
            ]
            bodies = a.generate_bodies() + b.generate_bodies()
            assert len(bodies) == 6  # one per prompt, each through the router to one worker
            for body in bodies:  # the RL fields arrive as sent
                assert body["return_logprob"] is True and body["input_ids"] in prompts
                assert body["sampling_params"] == {
                    "max_new_tokens": 5,
                    "temperature": 1.0,
                    "top_p": 1.0,
                    "top_k": -1,
                    "n": 2,
                }
            seeded = backend.generate(
                prompts[:2], n=2, sampling=SamplingParams(max_new_tokens=3, seed=7)
            )
            assert [c.prompt_index for c in seeded] == [0, 0, 1, 1]
            singles = (a.generate_bodies() + b.generate_bodies())[6:]
            assert sorted(body["sampling_params"]["sampling_seed"] for body in singles) == [
                7,
                8,
                9,
                10,
            ]
            assert all(isinstance(body["sampling_params"], dict) for body in singles)

            backend.sync_weights(named_policy_tensors(build_tiny_qwen3(99, seed=0)), version=1)
            assert backend.policy_version == 1 and (a.weight_version, b.weight_version) == (
                "1",
                "1",
            )
            for double in (a, b):
                paths = [p for p, _ in double.requests]
                assert "/update_weights_from_tensor" in paths
                # the update flushed the cache itself: no separate /flush_cache call
                assert double.flushes == 1 and "/flush_cache?timeout=30" not in paths
            again = backend.generate(prompts[:2], n=1, sampling=GREEDY)
            assert {(c.policy_version, c.meta["server_weight_version"]) for c in again} == {
                (1, "1")
            }
    assert router.api_key not in log.read_text()


@pytest.mark.sglang
def test_a_worker_that_fails_its_sync_fails_the_sync_with_the_version_unchanged(two_workers):
    a, b = two_workers
    b.accept_weight_updates(fail=True)
    model = build_tiny_qwen3(99, seed=0)
    with launch_sglang_router([a.url, b.url], timeout_s=60) as router:
        with SGLangBackend(
            router_url=router.url, weight_sync="tensor", show_progress=False
        ) as backend:
            with pytest.raises(
                WeightSyncError,
                match=rf"weight sync to version 3 failed \(.*failed on 1 of 2 server\(s\): "
                rf"{b.url}: .*disk full.*\); the engine keeps policy_version 0",
            ) as info:
                backend.sync_weights(named_policy_tensors(model), version=3)
            assert info.value.partial and backend.policy_version == 0
            assert not [p for p, _ in b.requests if p.startswith("/flush_cache")] and not b.flushes


PARENT = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from support.sglang_double import serve_double
from ar_torchrl.backends.sglang.router import launch_sglang_router

doubles = []
for path in sys.argv[2:]:
    double, _ = serve_double()
    double.model_path = path
    doubles.append(double)
with launch_sglang_router([d.url for d in doubles], timeout_s=60) as router:
    print(json.dumps({"pid": router.process.pid, "url": router.url}), flush=True)
    time.sleep(600)
"""


@pytest.mark.sglang
def test_a_launched_router_dies_with_its_sigkilled_trainer(tmp_path):
    """SIGKILL runs no ``finally``: the reaper stops the router (as it stops launched servers)."""
    require_schema()
    require_sglang_venv()
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for path in paths:
        os.mkdir(path)
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(ROOT / "tests"), *paths],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        info = json.loads(parent.stdout.readline())
        pid = info["pid"]
        assert requests.get(info["url"] + "/health", timeout=5).ok and alive(pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(30)
        took = wait_until(lambda: not group_pids(pid), 15)
        assert took < 15, f"router pid {pid} outlived its SIGKILLed trainer"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(30)


# ---------------------------------------------------------------------------------------------
# Two real SGLang 0.5.23 servers (CPU) behind a real router
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def routed(sglang_server, second_server, tmp_path_factory):
    """The session's two servers behind a router launched by the recipe's config
    (``backend.router=launch``, ``backend.url=[a, b]``); ``.close()`` stops it (also at the end)."""
    second = second_server.get()
    urls = [sglang_server.url, second.url]
    cfg = typed(["backend=sglang", f"backend.url=[{','.join(urls)}]", "backend.router=launch"])
    run_dir = tmp_path_factory.mktemp("routed")
    with contextlib.ExitStack() as stack:
        before = set(children_named(os.getpid(), ROUTER_COMM))
        start = time.monotonic()
        backend = cfg.backend.build(BackendContext(_model(), None, run_dir, stack))
        start_s = time.monotonic() - start
        routers = sorted(set(children_named(os.getpid(), ROUTER_COMM)) - before)
        assert len(routers) == 1, routers
        print(f"router started in front of 2 servers in {start_s:.2f} s")
        yield SimpleNamespace(
            backend=backend, urls=urls, second=second, router_pid=routers[0], close=stack.close
        )


def _served(url: str, model, version: int) -> None:
    """The server at ``url`` alone: greedy log-probs equal the trainer's to 1e-4, and it reports
    ``version`` (in each completion and in ``/model_info``)."""
    prompts = [[1, 40, 41, 42], [1, 50, 51]]
    with SGLangBackend(url, show_progress=False, vocab_size=99) as one:
        assert one.get(url, "/model_info")["weight_version"] == str(version)
        out = one.generate(prompts, n=1, sampling=SamplingParams(max_new_tokens=8, temperature=0.0))
    for c in out:
        assert c.meta["server_weight_version"] == str(version)
        ref = trainer_log_probs(model, prompts[c.prompt_index], c.token_ids)
        torch.testing.assert_close(torch.tensor(c.log_probs), ref, atol=1e-4, rtol=0)


@pytest.mark.sglang
@pytest.mark.slow
def test_after_every_sync_both_workers_serve_the_new_weights(routed):
    backend = routed.backend
    assert backend.router_url and backend.urls == routed.urls
    with SGLangBackend(router_url=backend.router_url, show_progress=False) as discovering:
        assert discovering.urls == sorted(routed.urls)  # the router lists exactly those
    with SGLangBackend(routed.urls, show_progress=False) as direct:
        for version in (701, 702):
            model = trainer_with_value_head(seed=version)
            start = time.monotonic()
            backend.sync_weights(named_policy_tensors(model), version=version)
            routed_s = time.monotonic() - start
            assert backend.policy_version == version
            for url in routed.urls:  # each worker alone
                _served(url, model, version)
            prompts = [[1, 60 + i, 61] for i in range(4)]  # through the router
            out = backend.generate(
                prompts, n=2, sampling=SamplingParams(max_new_tokens=6, temperature=0.0)
            )
            assert {(c.policy_version, c.meta["server_weight_version"]) for c in out} == {
                (version, str(version))
            }
            for c in out:
                ref = trainer_log_probs(model, prompts[c.prompt_index], c.token_ids)
                torch.testing.assert_close(torch.tensor(c.log_probs), ref, atol=1e-4, rtol=0)
            start = time.monotonic()  # the same sync without the router, for the timing only
            direct.sync_weights(named_policy_tensors(model), version=version)
            print(
                f"version {version}: sync {routed_s:.2f} s behind the router, "
                f"{time.monotonic() - start:.2f} s to the same servers without it"
            )


@pytest.mark.sglang
@pytest.mark.slow
def test_a_worker_killed_mid_sync_fails_it_with_the_version_unchanged(routed):
    """(The module's last test with servers: it ends the second server.) The second server is
    SIGKILLed by its pid as its weight update is sent; the sync fails naming it, the backend keeps
    its version and refuses to generate from the partly updated workers."""
    backend, victim = routed.backend, routed.second
    version = backend.policy_version
    session, inner = backend.session, backend.session.request
    killed = []

    def request(method, url, **kw):
        if url == victim.url + "/update_weights_from_disk" and not killed:
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(time.monotonic())
        return inner(method, url, **kw)

    session.request = request
    try:
        with pytest.raises(
            WeightSyncError, match=rf"failed on 1 of 2 server\(s\): {victim.url}"
        ) as info:
            backend.sync_weights(
                named_policy_tensors(trainer_with_value_head(seed=703)), version=703
            )
    finally:
        session.request = inner
    assert killed and info.value.partial and backend.policy_version == version
    with pytest.raises(WeightSyncError, match="sync again before generating"):
        backend.generate([[1, 2, 3]], n=1, sampling=GREEDY)
    assert wait_until(lambda: not group_pids(victim.pid), 15) < 15, group_pids(victim.pid)
    victim.close()  # its stand-in trainer exits (the session starts a new second server if needed)


@pytest.mark.sglang
@pytest.mark.slow
def test_no_router_outlives_its_backend(routed, sglang_server):
    pid = routed.router_pid
    assert alive(pid)
    routed.close()
    assert wait_until(lambda: not group_pids(pid), 15) < 15, f"router pid {pid} outlived the run"
    assert not children_named(os.getpid(), ROUTER_COMM)
    assert sglang_server.process.poll() is None  # the session's server is not the run's to stop
