"""SGLangBackend: fast tests against the protocol double, and real-server tests (markers sglang, slow)."""
# ruff: noqa: F811 - pytest fixtures imported from sglang_fixtures are redefined as arguments

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from sglang_double import EOS_ID, serve_double, toy_model
from sglang_fixtures import (  # noqa: F401
    require_sglang_venv,
    sglang_double,
    sglang_model_dir,
    sglang_server,
    trainer_log_probs,
)

import ar_torchrl.backends.sglang as sgl
from ar_torchrl.assets import build_tiny_qwen3
from ar_torchrl.backends import SamplingParams
from ar_torchrl.backends._sglang_protocol import (
    validate_generate_request,
    validate_generate_response,
)
from ar_torchrl.backends.sglang import (
    SGLangAbortError,
    SGLangBackend,
    SGLangLaunchError,
    SGLangRequestError,
    SGLangResponseError,
    SGLangTimeoutError,
    SGLangUnavailableError,
    launch_sglang_server,
)
from ar_torchrl.weight_sync.errors import WeightSyncError
from ar_torchrl.weight_sync.names import named_policy_tensors

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
PROMPTS = [[1, 40, 41, 42], [1, 50], [1, 60, 61, 62, 63, 64]]


def _backend(urls, **kw) -> SGLangBackend:
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("show_progress", False)
    return SGLangBackend(urls, **kw)


# ---------------------------------------------------------------------------------------------
# Double-based unit tests
# ---------------------------------------------------------------------------------------------


def test_request_shape_is_sglang_protocol(sglang_double):
    with _backend(sglang_double.url) as backend:
        sampling = SamplingParams(
            max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(7,)
        )
        backend.generate(PROMPTS[:2], n=3, sampling=sampling)
    bodies = sglang_double.generate_bodies()
    assert len(bodies) == 2
    assert next(b for b in bodies if b["input_ids"] == PROMPTS[0]) == {
        "input_ids": PROMPTS[0],
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
                            "stop_token_ids": [7], "n": 3},
        "return_logprob": True,
    }  # fmt: skip
    for body in bodies:  # SGLang's own schema accepts them
        assert validate_generate_request(body).return_logprob is True


def test_seeded_requests_use_one_seed_per_sample(sglang_double):
    with _backend(sglang_double.url) as backend:
        out = backend.generate(PROMPTS[:2], n=2, sampling=SamplingParams(max_new_tokens=3, seed=10))
    bodies = sorted(sglang_double.generate_bodies(), key=lambda b: -len(b["input_ids"][0]))
    assert [b["input_ids"] for b in bodies] == [[PROMPTS[0]] * 2, [PROMPTS[1]] * 2]
    assert [p["sampling_seed"] for b in bodies for p in b["sampling_params"]] == [10, 11, 12, 13]
    assert [c.prompt_index for c in out] == [0, 0, 1, 1]


def test_completions_prompt_major_with_logprobs_and_finish(sglang_double):
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
    with _backend(sglang_double.url) as backend:
        out = backend.generate(PROMPTS, n=2, sampling=sampling)
        stats = dict(backend.stats)
    assert [c.prompt_index for c in out] == [0, 0, 1, 1, 2, 2]
    params = {"max_new_tokens": 6, "temperature": 1.0}
    for k, c in enumerate(out):
        ids, lps, finish = toy_model(PROMPTS[k // 2], params, k % 2)
        assert c.token_ids == ids and c.log_probs == lps
        assert c.finish_reason == finish["type"] and c.weight_version == "default"
    assert (
        stats["completions"] == 6
        and stats["tokens"] == sum(map(len, out))
        and stats["requests"] == 3
    )


def test_finish_reason_stop_keeps_stop_token_and_length():
    first = toy_model([1, 40], {"max_new_tokens": 8, "temperature": 0.0}, 0)[0]
    double, stop = serve_double()
    try:
        with _backend(double.url) as backend:
            stopped = backend.generate(
                [[1, 40]],
                1,
                SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(first[2],)),
            )
            cut = backend.generate([[1, 40]], 1, SamplingParams(max_new_tokens=2, temperature=0.0))
    finally:
        stop()
    assert stopped[0].finish_reason == "stop" and stopped[0].token_ids == first[:3]
    assert cut[0].finish_reason == "length" and len(cut[0]) == 2


def test_round_robin_over_servers():
    (d1, stop1), (d2, stop2) = serve_double(), serve_double()
    try:
        with _backend([d1.url, d2.url], max_concurrency=1) as backend:
            backend.generate([[1, 5]] * 4, n=1, sampling=GREEDY)
    finally:
        stop1(), stop2()
    assert len(d1.generate_bodies()) == 2 and len(d2.generate_bodies()) == 2


def test_retries_5xx_and_dropped_connection_with_exponential_backoff(sglang_double, monkeypatch):
    delays = []
    monkeypatch.setattr(sgl.time, "sleep", delays.append)
    sglang_double.inject("status", status=503, message="overloaded")
    sglang_double.inject("drop")
    sglang_double.inject("status", status=502, message="bad gateway")
    with _backend(sglang_double.url, max_retries=3, backoff_s=0.5, backoff_max_s=1.5) as backend:
        out = backend.generate([[1, 2, 3]], n=1, sampling=GREEDY)
        assert backend.stats["retries"] == 3
    assert delays == [0.5, 1.0, 1.5]
    assert out[0].token_ids == toy_model([1, 2, 3], {"max_new_tokens": 6, "temperature": 0.0}, 0)[0]


def test_retries_are_bounded(sglang_double):
    for _ in range(3):
        sglang_double.inject("status", status=500, message="boom")
    with _backend(sglang_double.url, max_retries=2) as backend:
        with pytest.raises(SGLangUnavailableError, match=r"after 3 attempt\(s\).*HTTP 500: boom"):
            backend.generate([[1, 2]], n=1, sampling=GREEDY)
        assert backend.stats["retries"] == 2


def test_4xx_raises_with_server_message_and_no_retry(sglang_double):
    sglang_double.inject(
        "status", status=400, message="Requested token count exceeds the context length"
    )
    with _backend(sglang_double.url) as backend:
        with pytest.raises(
            SGLangRequestError, match="HTTP 400.*exceeds the context length"
        ) as info:
            backend.generate([[1, 2]], n=1, sampling=GREEDY)
        assert info.value.status == 400 and backend.stats["retries"] == 0


def test_unknown_sampling_key_rejected_by_schema(sglang_double):
    with _backend(sglang_double.url) as backend:
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


def test_timeout_raises(sglang_double):
    sglang_double.inject("delay", delay_s=1.0)
    with _backend(sglang_double.url, timeout_s=0.2) as backend:
        with pytest.raises(SGLangTimeoutError, match=r"timeout_s=0.2s"):
            backend.generate([[1, 2]], n=1, sampling=GREEDY)


def test_aborts_are_counted_and_raise_or_kept(sglang_double):
    sglang_double.inject("abort", message="Abort before prefill")
    with _backend(sglang_double.url) as backend:
        with pytest.raises(
            SGLangAbortError, match=r"aborted 2 of 2 completions.*Abort before prefill"
        ):
            backend.generate([[1, 2]], n=2, sampling=GREEDY)
        assert backend.stats["aborted"] == 2
    sglang_double.inject("abort", message="paused")
    with _backend(sglang_double.url, on_abort="keep") as backend:
        out = backend.generate([[1, 2], [1, 3]], n=1, sampling=GREEDY)
        assert [c.finish_reason for c in out].count("abort") == 1 and backend.stats["aborted"] == 1


def _crafted(ids, lps, completion_tokens):
    item = {"text": "", "output_ids": ids, "meta_info": {"id": "x", "prompt_tokens": 1,
            "completion_tokens": completion_tokens, "finish_reason": {"type": "length", "length": len(ids)},
            "output_token_logprobs": [[lp, t, None] for lp, t in lps], "weight_version": "default"}}  # fmt: skip
    validate_generate_response(item)  # still on protocol: only the counts disagree
    return item


@pytest.mark.parametrize(
    "item, match",
    [
        (
            _crafted([5, 6], [(-0.1, 5)], 2),
            r"2 output_ids, 1 output_token_logprobs, completion_tokens=2",
        ),
        (_crafted([5, 6], [(-0.1, 5), (-0.2, 6)], 3), r"completion_tokens=3"),
        (
            _crafted([5, 6], [(-0.1, 5), (-0.2, 9)], 2),
            r"disagree with output_ids or are null at positions \[1\]",
        ),
    ],
)
def test_count_mismatch_is_an_error_not_truncation(sglang_double, item, match):
    sglang_double.handlers["/generate"] = lambda body: (200, item)
    with _backend(sglang_double.url) as backend:
        with pytest.raises(SGLangResponseError, match=match):
            backend.generate([[1]], n=1, sampling=GREEDY)


def test_n_mismatch_is_an_error(sglang_double):
    sglang_double.handlers["/generate"] = lambda body: (200, _crafted([5], [(-0.1, 5)], 1))
    with _backend(sglang_double.url) as backend:
        with pytest.raises(SGLangResponseError, match=r"asked n=2, got 1 items"):
            backend.generate([[1]], n=2, sampling=GREEDY)


def test_bad_inputs():
    with pytest.raises(ValueError, match="URLs must start with http"):
        SGLangBackend("localhost:3000")
    with SGLangBackend("http://127.0.0.1:1") as backend:
        with pytest.raises(ValueError, match=r"prompts \[1\] are empty"):
            backend.generate([[1], []], n=1, sampling=GREEDY)
        with pytest.raises(ValueError, match="n must be >= 1, got 0"):
            backend.generate([[1]], n=0, sampling=GREEDY)


def test_health_and_server_not_up(sglang_double):
    with _backend(sglang_double.url) as backend:
        assert backend.health() is True
        backend.wait_until_healthy(timeout_s=5)
    dead = f"http://127.0.0.1:{sgl.free_port()}"
    with _backend(dead, max_retries=2, connect_timeout_s=0.5) as backend:
        assert backend.health() is False
        with pytest.raises(SGLangUnavailableError, match=r"not healthy after 0.3s"):
            backend.wait_until_healthy(timeout_s=0.3, poll_s=0.1)
        with pytest.raises(SGLangUnavailableError, match=r"after 3 attempt\(s\).*connection error"):
            backend.generate([[1, 2]], n=1, sampling=GREEDY)
        assert backend.stats["retries"] == 2


def test_double_rejects_off_protocol_requests(sglang_double):
    status, answer = sglang_double.generate(
        {"input_ids": [1], "sampling_params": {"temperature": "hot"}}
    )
    assert status == 400 and "expected f64" in answer["error"]


def test_sgl_kernel_shim_raises_naming_the_op(monkeypatch):
    shim = Path(__file__).resolve().parents[1] / "tools" / "sgl_kernel_shim"
    monkeypatch.syspath_prepend(str(shim))
    for name in ("sgl_kernel", "sgl_kernel._shim", "sgl_kernel.mamba"):  # import fresh, drop after
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)
    import sgl_kernel
    from sgl_kernel.mamba import causal_conv1d_fwd

    with pytest.raises(
        NotImplementedError, match=r"sgl_kernel.fused_add_rmsnorm was called.*CPU import shim"
    ):
        sgl_kernel.fused_add_rmsnorm(1, 2)
    with pytest.raises(NotImplementedError, match=r"sgl_kernel.mamba.causal_conv1d_fwd was called"):
        causal_conv1d_fwd()
    assert not hasattr(sgl_kernel, "__wrapped__")  # dunders are real AttributeErrors
    assert Path(sgl_kernel.__file__).is_relative_to(shim)


def test_launcher_failure_reports_log_tail(tmp_path):
    # The library venv has no sglang: the server process dies at import, and the error says why.
    with pytest.raises(
        SGLangLaunchError, match=r"(?s)exited with code 1 .*No module named 'sglang'"
    ):
        with launch_sglang_server(
            tmp_path, python=sys.executable, log_file=tmp_path / "log", timeout_s=60
        ):
            pass


# ---------------------------------------------------------------------------------------------
# Real server (SGLang 0.5.23 on CPU)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_trainer():
    torch.set_num_threads(1)
    return build_tiny_qwen3(99, seed=0)


@pytest.fixture
def real_backend(sglang_server, tiny_trainer):
    backend = _backend(sglang_server.url, timeout_s=120)
    # Other tests change the server's weights: load the trainer's (seed 0) weights first.
    backend.sync_weights(named_policy_tensors(tiny_trainer), version=100)
    yield backend
    backend.close()


@pytest.mark.sglang
@pytest.mark.slow
def test_real_greedy_log_probs_match_trainer(real_backend, tiny_trainer):
    out = real_backend.generate(
        PROMPTS, n=2, sampling=SamplingParams(max_new_tokens=12, temperature=0.0)
    )
    assert len(out) == 6 and all(c.weight_version == "100" for c in out)
    for c in out:
        ref = trainer_log_probs(tiny_trainer, PROMPTS[c.prompt_index], c.token_ids)
        torch.testing.assert_close(torch.tensor(c.log_probs), ref, atol=1e-4, rtol=0)
        assert c.finish_reason == ("stop" if c.token_ids[-1] == EOS_ID else "length")
    assert out[0].token_ids == out[1].token_ids  # greedy: both samples identical


@pytest.mark.sglang
@pytest.mark.slow
def test_real_sampled_log_probs_are_temperature_scaled(real_backend, tiny_trainer):
    torch.manual_seed(0)
    out = real_backend.generate(
        PROMPTS, n=3, sampling=SamplingParams(max_new_tokens=12, temperature=0.7)
    )
    max_gap_to_t1 = 0.0
    for c in out:
        prompt = PROMPTS[c.prompt_index]
        ref = trainer_log_probs(tiny_trainer, prompt, c.token_ids, temperature=0.7)
        torch.testing.assert_close(torch.tensor(c.log_probs), ref, atol=1e-4, rtol=0)
        gap = (
            (torch.tensor(c.log_probs) - trainer_log_probs(tiny_trainer, prompt, c.token_ids))
            .abs()
            .max()
        )
        max_gap_to_t1 = max(max_gap_to_t1, gap.item())
    assert max_gap_to_t1 > 1e-2  # really the T-scaled distribution, not the T=1 one


@pytest.mark.sglang
@pytest.mark.slow
def test_real_400_and_timeout(real_backend, sglang_server):
    with pytest.raises(SGLangRequestError, match="unknown field `max_tokens`"):
        real_backend.post(
            sglang_server.url,
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"max_tokens": 2}},
        )
    with pytest.raises(SGLangRequestError, match=r"HTTP 400.*(context length|maximum)") as info:
        real_backend.generate([[1, 2, 3]], n=1, sampling=SamplingParams(max_new_tokens=5000))
    assert info.value.server_message
    slow = _backend(sglang_server.url, timeout_s=0.05, extra_sampling_params={"ignore_eos": True})
    with slow, pytest.raises(SGLangTimeoutError, match="timeout_s=0.05s"):
        slow.generate([[1, 2, 3]], n=1, sampling=SamplingParams(max_new_tokens=200))
    real_backend.post(sglang_server.url, "/abort_request", {"abort_all": True})  # free the server
    assert real_backend.health()  # the server survived


@pytest.mark.sglang
@pytest.mark.slow
def test_real_server_killed_mid_rollout(sglang_model_dir, tmp_path):
    python = require_sglang_venv()
    with launch_sglang_server(
        sglang_model_dir, python=python, log_file=tmp_path / "victim.log"
    ) as server:
        backend = _backend(
            server.url,
            max_retries=2,
            connect_timeout_s=1,
            extra_sampling_params={"ignore_eos": True},
        )
        result: dict = {}

        def rollout():
            try:
                result["out"] = backend.generate(
                    [[1, 2, 3]] * 2, n=2, sampling=SamplingParams(max_new_tokens=400)
                )
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                result["error"] = exc

        thread = threading.Thread(target=rollout)
        thread.start()
        deadline = time.monotonic() + 30
        while backend.stats["requests"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # let the requests reach the scheduler
        server.process.send_signal(signal.SIGKILL)
        thread.join(60)
        with pytest.raises(
            WeightSyncError, match=r"disk weight sync \(version 1\) failed.*connection error"
        ):
            backend.sync_weights(named_policy_tensors(build_tiny_qwen3(99)), version=1)
        backend.close()
    assert not thread.is_alive()
    assert "out" not in result, "a rollout cannot finish on a killed server"
    assert isinstance(result["error"], SGLangUnavailableError)
    assert "connection error" in str(result["error"]) and backend.stats["retries"] >= 2


@pytest.mark.sglang
@pytest.mark.slow
def test_compare_backends_benchmark_quick(sglang_server, tmp_path):
    import json
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "compare_backends.py"
    out = tmp_path / "compare.json"
    cmd = [sys.executable, str(script), "--quick", "--url", sglang_server.url, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    drift = result["drift"]
    assert drift["completions"] == 8 and drift["token_identical"] == 8
    assert drift["drift_sglang_vs_trainer"]["max_abs"] < 1e-4
    assert drift["drift_sglang_vs_trainside"]["tokens"] == result["sglang"]["tokens"] > 0
    assert "tokens/s" in proc.stdout


@pytest.mark.sglang
@pytest.mark.slow
def test_compare_backends_ppo_run_agrees(sglang_server, tmp_path):
    """The README's backend comparison: 3 greedy rollouts + 1 PPO update each, trainside vs SGLang."""
    import json
    import os
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "compare_backends_ppo.py"
    out = tmp_path / "cmp.json"
    cmd = [sys.executable, str(script), "--url", sglang_server.url, "--out", str(out),
           "--cache", str(tmp_path / "cache")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["all_finite"] and result["same_tokens"] == [True, True, True]
    assert result["max_loss_abs_diff"] < 1e-6
    for row in result["rollouts"]["sglang"]:
        assert row["ratio_mean"] == 1.0 and row["logprob_abs_diff"] < 1e-4


@pytest.mark.sglang
@pytest.mark.slow
def test_launcher_retries_when_its_port_is_taken(sglang_model_dir, tmp_path, monkeypatch):
    """SGLang's own children bind random ports; if one takes ours first the launcher retries."""
    import socket

    import ar_torchrl.backends.sglang as sglang_mod

    python = require_sglang_venv()
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    taken = squatter.getsockname()[1]
    ports = iter([taken, sglang_mod.free_port()])
    monkeypatch.setattr(sglang_mod, "free_port", lambda host="127.0.0.1": next(ports))
    try:
        log = tmp_path / "retry.log"
        with launch_sglang_server(sglang_model_dir, python=python, log_file=log) as server:
            assert server.port != taken and _backend(server.url).health()
        assert "address already in use" in log.read_text()
    finally:
        squatter.close()
