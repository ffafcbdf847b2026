"""SGLangBackend: fast tests on the schema-checked double, real-server tests (markers sglang, slow),
including two real servers synced together."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing  # noqa: F401 - registers the reductions used to decode tensor payloads
from support.sglang_double import EOS_ID, serve_double, toy_model
from support.sglang_helpers import (
    PROMPTS,
    SentNames,
    assert_server_matches,
    require_schema,
    sglang_backend,
    trainer_log_probs,
    trainer_with_value_head,
)

from ar_torchrl.backends import ContextLengthError, SamplingParams
from ar_torchrl.backends.sglang import (
    SGLangAbortError,
    SGLangBackend,
    SGLangRequestError,
    SGLangResponseError,
    SGLangTimeoutError,
)
from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.weight_sync import WeightSyncError, named_policy_tensors

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
ROOT = Path(__file__).resolve().parents[3]


def _backend(urls, **kw) -> SGLangBackend:
    return sglang_backend(urls, **kw)


# ---------------------------------------------------------------------------------------------
# Double-based unit tests
# ---------------------------------------------------------------------------------------------


def test_completions_prompt_major_with_logprobs_finish_and_version(sglang_double):
    prompts = [[1, 40, 41, 42], [1, 50], [1, 60, 61, 62, 63, 64]]
    with _backend(sglang_double.url) as backend:
        out = backend.generate(
            prompts, n=2, sampling=SamplingParams(max_new_tokens=6, temperature=1.0)
        )
        stats = dict(backend.stats)
    assert [c.prompt_index for c in out] == [0, 0, 1, 1, 2, 2]
    for k, c in enumerate(out):
        ids, lps, finish = toy_model(
            prompts[k // 2], {"max_new_tokens": 6, "temperature": 1.0}, k % 2
        )
        assert c.token_ids == ids and c.log_probs == lps and c.finish_reason == finish["type"]
        assert c.policy_version == 0 and c.meta["server_weight_version"] == "default"
    assert (
        stats["completions"] == 6
        and stats["tokens"] == sum(map(len, out))
        and stats["requests"] == 3
    )
    bodies = sglang_double.generate_bodies()
    assert len(bodies) == 3 and all(b["sampling_params"]["n"] == 2 for b in bodies)


def test_seeded_requests_use_one_seed_per_sample(sglang_double):
    with _backend(sglang_double.url) as backend:
        out = backend.generate(PROMPTS, n=2, sampling=SamplingParams(max_new_tokens=3, seed=10))
    bodies = sorted(sglang_double.generate_bodies(), key=lambda b: -len(b["input_ids"][0]))
    assert [b["input_ids"] for b in bodies] == [[PROMPTS[0]] * 2, [PROMPTS[1]] * 2]
    assert [p["sampling_seed"] for b in bodies for p in b["sampling_params"]] == [10, 11, 12, 13]
    assert [c.prompt_index for c in out] == [0, 0, 1, 1]


def test_finish_reason_stop_keeps_stop_token_and_length(sglang_double):
    first = toy_model([1, 40], {"max_new_tokens": 8, "temperature": 0.0}, 0)[0]
    with _backend(sglang_double.url) as backend:
        stopped = backend.generate(
            [[1, 40]],
            1,
            SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(first[2],)),
        )
        cut = backend.generate([[1, 40]], 1, SamplingParams(max_new_tokens=2, temperature=0.0))
    assert stopped[0].finish_reason == "stop" and stopped[0].token_ids == first[:3]
    assert cut[0].finish_reason == "length" and len(cut[0]) == 2


def test_requests_are_spread_over_servers():
    require_schema()
    (d1, stop1), (d2, stop2) = serve_double(), serve_double()
    try:
        with _backend([d1.url, d2.url], max_concurrency=1) as backend:
            backend.generate([[1, 5]] * 4, n=1, sampling=GREEDY)
    finally:
        stop1(), stop2()
    assert len(d1.generate_bodies()) == 2 and len(d2.generate_bodies()) == 2


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


def test_the_servers_context_length_is_enforced(sglang_double):
    sglang_double.context_length = 10
    with _backend(sglang_double.url) as backend:
        assert backend.context_length == 10 and backend.weight_dtype == torch.float32
        with pytest.raises(
            ContextLengthError,
            match=r"prompts \(index, tokens\) \[\(1, 8\)\] plus max_new_tokens=6 exceed the model's context of 10 tokens",
        ):
            backend.generate([[1, 2], [1] * 8], n=1, sampling=GREEDY)
    assert not sglang_double.generate_bodies()  # refused before sending


def test_a_server_reporting_another_version_is_an_error(sglang_double):
    sglang_double.accept_weight_updates()
    with _backend(sglang_double.url, weight_sync="tensor") as backend:
        backend.sync_weights(named_policy_tensors(build_tiny_qwen3(99)), version=4)
        assert backend.generate([[1, 2]], 1, GREEDY)[0].policy_version == 4
        sglang_double.weight_version = "3"  # another client synced the server
        with pytest.raises(
            SGLangResponseError,
            match=r"meta_info.weight_version is \['3'\] but this backend synced version 4",
        ):
            backend.generate([[1, 2]], 1, GREEDY)


def test_one_failing_server_fails_the_sync_for_all(sglang_double):
    other, stop = serve_double()
    try:
        sglang_double.accept_weight_updates()
        other.accept_weight_updates(fail=True)
        model = build_tiny_qwen3(99)
        with _backend([sglang_double.url, other.url], weight_sync="tensor") as backend:
            with pytest.raises(
                WeightSyncError, match=rf"failed on 1 of 2 server\(s\): {other.url}: .*disk full"
            ) as info:
                backend.sync_weights(named_policy_tensors(model), version=1)
            assert info.value.partial and backend.policy_version == 0
            assert sglang_double.weight_version == "1" and other.weight_version == "default"
            with pytest.raises(WeightSyncError, match="failed part-way"):  # never a mixed batch
                backend.generate([[1, 2]] * 2, 1, GREEDY)
            other.accept_weight_updates()
            backend.sync_weights(named_policy_tensors(model), version=1)
            out = backend.generate([[1, 2]] * 2, 1, GREEDY)
        assert {c.meta["server_weight_version"] for c in out} == {
            "1"
        } and other.weight_version == "1"
    finally:
        stop()


def test_bad_inputs():
    with pytest.raises(ValueError, match="URLs must start with http"):
        SGLangBackend("localhost:3000")
    with pytest.raises(ValueError, match="a server is listed twice"):
        SGLangBackend(["http://a:1", "http://a:1"])
    with pytest.raises(ValueError, match=r"weight sync method 'copy' does not serve sglang"):
        SGLangBackend("http://127.0.0.1:1", weight_sync="copy")


def test_the_client_takes_its_options_grouped_and_the_old_keywords_for_one_release():
    """SGLangBackend took 20 keywords: now where (urls, router_url), how weights travel
    (weight_sync, weight_sync_options) and how it talks (options: SGLangClientOptions)."""
    import inspect
    import warnings

    from ar_torchrl.backends.sglang import SGLangClientOptions

    params = inspect.signature(SGLangBackend).parameters
    assert [p for p in params if params[p].kind is not inspect.Parameter.VAR_KEYWORD] == [
        "urls",
        "router_url",
        "weight_sync",
        "weight_sync_options",
        "options",
    ]
    options = SGLangClientOptions(timeout_s=30.0, max_concurrency=2, show_progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new form warns nothing
        backend = SGLangBackend("http://127.0.0.1:9", options=options)
    assert (backend.options, backend.timeout_s, backend._pool._max_workers) == (options, 30.0, 2)
    backend.close()
    with pytest.warns(
        DeprecationWarning, match=r"options=SGLangClientOptions\(timeout_s=30, max_c"
    ):
        old = SGLangBackend("http://127.0.0.1:9", timeout_s=30, max_concurrency=2)
    assert old.options == SGLangClientOptions(timeout_s=30, max_concurrency=2)
    old.close()
    with pytest.raises(
        TypeError, match=r"unexpected keyword argument\(s\) \['timeout'\] \(did you"
    ):
        SGLangBackend("http://127.0.0.1:9", timeout=30)
    with pytest.raises(ValueError, match=r"SGLangBackend: on_abort='drop' is not one of"):
        SGLangBackend("http://127.0.0.1:9", options=SGLangClientOptions(on_abort="drop"))


# ---------------------------------------------------------------------------------------------
# Real server (SGLang 0.5.23 on CPU)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_trainer():
    torch.set_num_threads(1)
    return build_tiny_qwen3(99, seed=0)


@pytest.fixture
def real_backend(sglang_server, tiny_trainer):
    backend = _backend(sglang_server.url, timeout_s=120, vocab_size=99)
    # Other tests change the server's weights: load the trainer's (seed 0) weights first.
    backend.sync_weights(named_policy_tensors(tiny_trainer), version=100)
    yield backend
    backend.close()


@pytest.mark.sglang
@pytest.mark.slow
def test_real_greedy_and_sampled_log_probs_match_the_trainer(real_backend, tiny_trainer):
    prompts = [[1, 40, 41, 42], [1, 50], [1, 60, 61, 62, 63, 64]]
    out = real_backend.generate(
        prompts, n=2, sampling=SamplingParams(max_new_tokens=12, temperature=0.0)
    )
    assert len(out) == 6 and {c.policy_version for c in out} == {100}
    for c in out:
        ref = trainer_log_probs(tiny_trainer, prompts[c.prompt_index], c.token_ids)
        torch.testing.assert_close(torch.tensor(c.log_probs), ref, atol=1e-4, rtol=0)
        assert c.finish_reason == ("stop" if c.token_ids[-1] == EOS_ID else "length")
    assert out[0].token_ids == out[1].token_ids  # greedy: both samples identical
    gap = 0.0
    for c in real_backend.generate(
        prompts, n=3, sampling=SamplingParams(max_new_tokens=12, temperature=0.7)
    ):
        ref = trainer_log_probs(tiny_trainer, prompts[c.prompt_index], c.token_ids, temperature=0.7)
        torch.testing.assert_close(torch.tensor(c.log_probs), ref, atol=1e-4, rtol=0)
        t1 = trainer_log_probs(tiny_trainer, prompts[c.prompt_index], c.token_ids)
        gap = max(gap, (torch.tensor(c.log_probs) - t1).abs().max().item())
    assert gap > 1e-2  # really the T-scaled distribution, not the T=1 one


@pytest.mark.sglang
@pytest.mark.slow
def test_real_api_key_400_context_and_timeout(real_backend, sglang_server):
    assert sglang_server.api_key  # the session server runs with --api-key
    with _backend(sglang_server.url, api_key="") as anonymous:
        with pytest.raises(
            SGLangRequestError, match=r"HTTP 401\): Unauthorized; the server requires an API key"
        ):
            anonymous.generate([[1, 2]], 1, GREEDY)
    with (
        _backend(sglang_server.url, api_key="wrong") as wrong,
        pytest.raises(SGLangRequestError, match="HTTP 401"),
    ):
        wrong.get(sglang_server.url, "/model_info")
    with pytest.raises(SGLangRequestError, match="unknown field `max_tokens`"):
        real_backend.post(
            sglang_server.url,
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"max_tokens": 2}},
        )
    assert real_backend.context_length == 512
    with pytest.raises(
        ContextLengthError,
        match=r"\[\(0, 3\)\] plus max_new_tokens=5000 exceed the model's context of 512",
    ):
        real_backend.generate([[1, 2, 3]], n=1, sampling=SamplingParams(max_new_tokens=5000))
    slow = _backend(sglang_server.url, timeout_s=0.05, extra_sampling_params={"ignore_eos": True})
    with slow, pytest.raises(SGLangTimeoutError, match="timeout_s=0.05s"):
        slow.generate([[1, 2, 3]], n=1, sampling=SamplingParams(max_new_tokens=200))
    real_backend.post(sglang_server.url, "/abort_request", {"abort_all": True})  # free the server
    assert real_backend.health()  # the server survived


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["disk", "tensor"])
def test_two_real_servers_are_synced_together(sglang_server, second_server, mode):
    """Both servers get every sync (in parallel); afterwards both serve the new weights."""
    urls = [sglang_server.url, second_server.get().url]
    with _backend(urls, weight_sync=mode, vocab_size=99) as backend:
        sent = SentNames(backend)
        for step, seed in enumerate((51, 52), start=1):
            version = {"disk": 200, "tensor": 300}[mode] + step
            model = trainer_with_value_head(seed=seed)
            backend.sync_weights(model.state_dict().items(), version=version)  # value head filtered
            for url in urls:
                assert backend.get(url, "/model_info")["weight_version"] == str(version)
            assert_server_matches(
                backend, model, version, prompts=PROMPTS * 2
            )  # both servers answer
            answered = [backend.get(u, "/server_info") for u in urls]
            assert all(a.get("context_length") == 512 for a in answered)
        assert backend.stats["requests"] >= 8
    assert not [n for n in sent.names if n.startswith("value_head.")]
    per_server = len({n for n, _ in named_policy_tensors(model)})
    assert len(sent.names) == 2 * 2 * per_server  # 2 syncs x 2 servers, every tensor once each


@pytest.mark.sglang
@pytest.mark.slow
def test_compare_backends_benchmark_quick(sglang_server, tmp_path):
    script = ROOT / "benchmarks" / "experiments" / "compare_backends.py"
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
def test_compare_backends_ppo_run_agrees(sglang_server, tmp_path, cache_dir):
    """The README's backend comparison: 3 greedy rollouts + 1 PPO update each, trainside vs SGLang
    (the session's cache: the CPU default's warm start is computed once per session)."""
    script = ROOT / "benchmarks" / "experiments" / "compare_backends_ppo.py"
    out = tmp_path / "cmp.json"
    cmd = [
        sys.executable,
        str(script),
        "--url",
        sglang_server.url,
        "--out",
        str(out),
        "--cache",
        str(cache_dir),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["all_finite"] and result["same_tokens"] == [True, True, True]
    assert result["max_loss_abs_diff"] < 1e-6
    for row in result["rollouts"]["sglang"]:
        assert row["mean_ratio"] == 1.0 and row["logprob_abs_diff"] < 1e-4
