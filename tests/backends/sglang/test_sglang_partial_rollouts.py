"""Partial rollouts on SGLang: a weight sync aborts the requests in flight (SGLang's
``/abort_request`` with the ids the backend gave them), the answers carry the tokens and log-probs
generated so far, and each completion continues from ``prompt + tokens so far`` under the new
weights, every token keeping the version (and log-prob) of the weights that sampled it.

Fast tests run on the schema-checked protocol double (``tests/support/sglang_double.py``: requests decoded
token by token, aborted as SGLang 0.5.23 does, versioned toy weights); the router test puts a real
sglang-router in front of two doubles (marker ``sglang``); the real-server test interrupts a
generation of the session's SGLang server with a real sync and checks every token's log-prob
against the trainer's under its own version (markers ``sglang``, ``slow``).
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from support.sglang_double import serve_double, toy_model
from support.sglang_helpers import (
    require_schema,
    require_sglang_venv,
    sglang_backend,
    trainer_with_value_head,
    wait_until,
)
from tensordict import TensorDict

from ar_torchrl.backends import SamplingParams
from ar_torchrl.backends.sglang import SGLangAbortError, SGLangBackend, SGLangRequestError
from ar_torchrl.backends.sglang.router import launch_sglang_router
from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.modules import LMActorCritic
from ar_torchrl.weight_sync import named_policy_tensors

PROMPTS = [[1, 10, 11], [1, 20]]
LONG = SamplingParams(max_new_tokens=60, temperature=1.0)
PARAMS = {"max_new_tokens": 60, "temperature": 1.0, "ignore_eos": True}


def _backend(urls, **kw) -> SGLangBackend:
    kw.setdefault("weight_sync", "tensor")
    kw.setdefault("extra_sampling_params", {"ignore_eos": True})
    backend = sglang_backend(urls, **kw)
    backend.partial_rollouts = True
    return backend


def _slow_double(**kw):
    double, stop = serve_double()
    double.versioned, double.token_delay_s = True, 0.004
    for key, value in kw.items():
        setattr(double, key, value)
    double.accept_weight_updates()
    return double, stop


def _in_background(backend, prompts, n, sampling):
    out: dict = {}

    def run():
        try:
            out["completions"] = backend.generate(prompts, n, sampling)
        except Exception as err:  # re-raised by the test
            out["error"] = err

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    return worker, out


def _running(doubles, count: int, tokens: int) -> bool:
    states = [s for d in doubles for s in list(d.in_flight.values())]
    return len(states) == count and min(s.tokens for s in states) >= tokens


def _expected(prompt, tokens, split, version_after):
    """The toy's tokens and log-probs of a completion split after ``split`` tokens: the first
    part by the starting weights, the rest from ``prompt + first part`` by ``version_after``."""
    first, first_lps, _ = toy_model(prompt, PARAMS, 0)
    rest_params = {**PARAMS, "max_new_tokens": PARAMS["max_new_tokens"] - split}
    rest, rest_lps, _ = toy_model(prompt + tokens[:split], rest_params, 0, version_after)
    return first[:split] + rest, first_lps[:split] + rest_lps


def _before_update(double) -> list[dict]:
    """The ``/generate`` bodies a double got before its weight update (the first round)."""
    paths = [p for p, _ in double.requests]
    update = paths.index("/update_weights_from_tensor")
    return [b for p, b in double.requests[:update] if p == "/generate"]


def _tensors():
    return named_policy_tensors(build_tiny_qwen3(99, seed=0))


def _finish(worker, out):
    worker.join(60)
    assert not worker.is_alive()
    if "error" in out:
        raise out["error"]
    return out["completions"]


def test_a_sync_aborts_requests_in_flight_and_each_token_keeps_its_version():
    require_schema()
    double, stop = _slow_double()
    try:
        with _backend(double.url) as backend:
            worker, out = _in_background(backend, PROMPTS, 2, LONG)
            assert wait_until(lambda: _running([double], 4, 5), 30) < 30
            backend.sync_weights(_tensors(), version=1)
            completions = _finish(worker, out)
            stats = dict(backend.stats)
            assert backend.policy_version == 1 and backend.interruptions == 1
    finally:
        stop()
    assert double.crashed is None
    first = double.generate_bodies()[:4]
    rids = {b["rid"] for b in first}
    assert len(rids) == 4 and all(b["sampling_params"]["n"] == 1 for b in first)
    paths = [p for p, _ in double.requests]
    aborts = [b for p, b in double.requests if p == "/abort_request"]
    assert {a["rid"] for a in aborts} == rids and all(set(a) == {"rid"} for a in aborts)
    update = paths.index("/update_weights_from_tensor")
    assert max(i for i, p in enumerate(paths) if p == "/abort_request") < update
    # the update itself drops the cache the old weights filled (its flush_cache flag)
    assert double.flushes == 1 and not [p for p in paths if p.startswith("/flush_cache")]
    later = [i for i, p in enumerate(paths) if p == "/generate"][4:]
    assert update < min(later) and len(later) >= 1
    for c in completions:
        prompt = PROMPTS[c.prompt_index]
        split = c.token_versions.index(1)
        assert 5 <= split < 60 and c.token_versions == [0] * split + [1] * (60 - split)
        assert len(c) == 60 and c.finish_reason == "length" and c.policy_version == 0
        tokens, log_probs = _expected(prompt, c.token_ids, split, "1")
        assert c.token_ids == tokens and c.log_probs == log_probs
    continued = sorted(  # each continues from prompt + its tokens so far, with the tokens left
        (b["input_ids"], b["sampling_params"]["max_new_tokens"])
        for b in double.generate_bodies()[4:]
    )
    cut = [(c, c.token_versions.index(1)) for c in completions]
    assert continued == sorted(
        (PROMPTS[c.prompt_index] + c.token_ids[:split], 60 - split) for c, split in cut
    )
    assert stats["interrupted"] == 4 and stats["aborted"] == 0 and stats["abort_requests"] >= 4


def test_requests_not_sent_yet_stay_home_and_run_under_the_new_weights():
    """One request in flight (max_concurrency=1): the two queued ones never leave, and after the
    sync they run whole under version 1."""
    require_schema()
    double, stop = _slow_double()
    prompts = [[1, 10, 11], [1, 20], [1, 30, 31, 32]]
    try:
        with _backend(double.url, max_concurrency=1) as backend:
            worker, out = _in_background(backend, prompts, 1, LONG)
            assert wait_until(lambda: _running([double], 1, 5), 30) < 30
            backend.sync_weights(_tensors(), version=1)
            completions = _finish(worker, out)
    finally:
        stop()
    split = completions[0].token_versions.index(1)
    assert 5 <= split < 60
    for c in completions[1:]:
        assert c.token_versions is None and c.policy_version == 1 and len(c) == 60
        assert c.token_ids == toy_model(prompts[c.prompt_index], PARAMS, 0, "1")[0]
    bodies = double.generate_bodies()
    assert bodies[0]["input_ids"] == prompts[0] and len(bodies) == 4  # 1 before, 3 after


def test_an_abort_sglang_lost_is_followed_by_abort_all(caplog):
    """SGLang loses an abort that reaches its scheduler before the request (and ignores the same
    rid again): after ``abort_all_after_s`` the server gets ``abort_all`` and the split happens."""
    require_schema()
    double, stop = _slow_double(lose_aborts=1)
    try:
        with _backend(double.url, abort_all_after_s=0.8) as backend:
            long = SamplingParams(max_new_tokens=450, temperature=1.0)  # 1.8 s
            worker, out = _in_background(backend, PROMPTS[:1], 1, long)
            assert wait_until(lambda: _running([double], 1, 3), 30) < 30
            with caplog.at_level(logging.WARNING, "ar_torchrl.backends.sglang.client"):
                backend.sync_weights(_tensors(), version=1)
            (c,) = _finish(worker, out)
    finally:
        stop()
    aborts = [b for p, b in double.requests if p == "/abort_request"]
    assert aborts[0] == {"rid": double.generate_bodies()[0]["rid"]}  # lost, then repeated
    assert aborts.count(aborts[0]) >= 2 and {"abort_all": True} in aborts
    assert "abort_all on" in caplog.text
    assert 3 <= c.token_versions.index(1) < 450 and len(c) == 450


def test_each_server_gets_the_aborts_of_its_own_requests():
    require_schema()
    (a, stop_a), (b, stop_b) = _slow_double(), _slow_double()
    try:
        with _backend([a.url, b.url]) as backend:
            worker, out = _in_background(backend, PROMPTS, 2, LONG)
            assert wait_until(lambda: _running([a, b], 4, 5), 30) < 30
            backend.sync_weights(_tensors(), version=1)
            completions = _finish(worker, out)
    finally:
        stop_a(), stop_b()
    for double in (a, b):
        sent = {body["rid"] for body in double.generate_bodies()[:2]}
        aborted = {body["rid"] for p, body in double.requests if p == "/abort_request"}
        assert aborted == sent and len(sent) == 2
    assert all(0 < c.token_versions.index(1) < 60 for c in completions)


def test_an_abort_the_backend_did_not_ask_for_still_raises(sglang_double):
    """Partial rollouts continue only what a sync cut: a server-side abort is an error
    (``on_abort="raise"``), not a completion to continue forever; the abort body is SGLang's."""
    sglang_double.inject("abort", message="Abort in waiting queue")
    with _backend(sglang_double.url) as backend:
        with pytest.raises(SGLangAbortError, match=r"aborted 1 of 1 completions"):
            backend.generate([[1, 2]], 1, LONG)
        with pytest.raises(SGLangRequestError, match=r"HTTP 400.*expected a string"):
            backend.post(sglang_double.url, "/abort_request", {"rid": 5})


@pytest.mark.sglang
def test_partial_rollouts_through_a_real_router(tmp_path, sglang_api_key):
    """sglang-router (0.3.2) has no /abort_request (404) and refuses a list of rids: requests
    carry one string rid each (it arrives at the worker), the aborts go to every worker."""
    require_schema()
    require_sglang_venv()
    doubles = []
    for name in "ab":
        (tmp_path / name).mkdir()
        double, stop = _slow_double(model_path=str(tmp_path / name), api_key=sglang_api_key)
        doubles.append((double, stop))
    workers = [d for d, _ in doubles]
    try:
        urls = [d.url for d in workers]
        with launch_sglang_router(urls, log_file=tmp_path / "router.log", timeout_s=60) as router:
            with SGLangBackend(
                router_url=router.url,
                show_progress=False,
                weight_sync="tensor",
                extra_sampling_params={"ignore_eos": True},
            ) as backend:
                backend.partial_rollouts = True
                worker, out = _in_background(backend, PROMPTS, 2, LONG)
                assert wait_until(lambda: _running(workers, 4, 5), 30) < 30
                backend.sync_weights(_tensors(), version=1)
                completions = _finish(worker, out)
    finally:
        for _, stop in doubles:
            stop()
    sent = {b["rid"] for d in workers for b in _before_update(d)}
    assert len(sent) == 4  # the router forwarded each request's rid
    for double in workers:  # every worker was asked to abort every request of the first round
        aborted = {body["rid"] for p, body in double.requests if p == "/abort_request"}
        assert sent <= aborted
    for c in completions:
        split = c.token_versions.index(1)
        assert 5 <= split < 60
        tokens, log_probs = _expected(PROMPTS[c.prompt_index], c.token_ids, split, "1")
        assert c.token_ids == tokens and c.log_probs == log_probs


# ---------------------------------------------------------------------------------------------
# The session's real SGLang 0.5.23 server (CPU)
# ---------------------------------------------------------------------------------------------


def _trainer_log_probs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The trainer's fp32 log-prob of each token (LMActorCritic, T = 1) given what precedes it."""
    ids = torch.tensor([prompt + tokens])
    td = TensorDict({"tokens": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool)}, [1])
    td.batch_size = ids.shape
    with torch.no_grad():
        return LMActorCritic(model, critic=False)(td)["log_prob"][0, len(prompt) :]


@pytest.mark.sglang
@pytest.mark.slow
def test_a_real_sync_splits_real_responses_with_each_tokens_own_log_prob(sglang_server):
    prompts = [[1, 40, 41, 42], [1, 50, 51]]
    sampling = SamplingParams(max_new_tokens=300, temperature=1.0)
    old, new = trainer_with_value_head(seed=811), trainer_with_value_head(seed=812)
    with _backend(sglang_server.url, weight_sync="disk", vocab_size=99) as backend:
        backend.sync_weights(named_policy_tensors(old), version=811)  # known starting weights

        def decoding() -> bool:  # all 4 requests run and have decoded a few tokens
            load = backend.get(sglang_server.url, "/v1/loads")["loads"][0]
            return load["num_running_reqs"] == 4 and load["num_used_tokens"] >= 4 * 10

        start = time.monotonic()
        worker, out = _in_background(backend, prompts, 2, sampling)
        waited = wait_until(decoding, 60, poll_s=0.02)
        assert waited < 60
        sync_start = time.monotonic()
        backend.sync_weights(named_policy_tensors(new), version=812)
        sync_s = time.monotonic() - sync_start
        completions = _finish(worker, out)
        total_s = time.monotonic() - start
        assert backend.interruptions == 1 and backend.stats["interrupted"] == 4
    splits, worst = [], 0.0
    for c in completions:
        assert len(c) == 300 and c.finish_reason == "length" and c.policy_version == 811
        split = c.token_versions.index(812)
        assert 0 < split < 300 and c.token_versions == [811] * split + [812] * (300 - split)
        splits.append(split)
        prompt = prompts[c.prompt_index]
        by_old = _trainer_log_probs(old, prompt, c.token_ids)
        by_new = _trainer_log_probs(new, prompt, c.token_ids)
        want = torch.cat([by_old[:split], by_new[split:]])
        torch.testing.assert_close(torch.tensor(c.log_probs), want, atol=1e-4, rtol=0)
        worst = max(worst, (torch.tensor(c.log_probs) - want).abs().max().item())
        assert (by_old[split:] - by_new[split:]).abs().max() > 1e-3  # the versions differ
    print(
        f"partial rollout on a real server: sync issued {waited:.2f} s after the start, split "
        f"after {sorted(splits)} tokens, sync (abort included) {sync_s:.2f} s, whole generation "
        f"{total_s:.2f} s; largest |log-prob - trainer's under its version| {worst:.1e}"
    )
