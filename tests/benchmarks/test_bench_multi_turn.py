"""Smoke tests: ``benchmarks/bench_multi_turn.py --quick`` runs and writes a consistent JSON (so it
can't rot); no timings are asserted, only the structure and the invariants of the token counts
(every turn runs to its cap, the contexts grow by the earlier turns and the tool deltas)."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ar_torchrl.backends import EpisodeCache, SamplingParams, TransformersBackend
from ar_torchrl.models import build_char_tokenizer, build_tiny_qwen3
from ar_torchrl.tools.template import tool_delta_ids

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_multi_turn.py"
KS = (1, 2, 4, 8)
T, B = 48, 4  # --quick


def run_quick(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "bench_multi_turn.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--reps", "1", "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio = time(K turns) / time(1 generation)" in proc.stdout
    return json.loads(out.read_text())


def submitted_tokens(prompt: int, k: int, delta: int, short_deltas: int = 0) -> int:
    """Prompt tokens sent over the k turns of B episodes: turn j sends the prompt, j turns of
    T // k tokens and j tool deltas (a turn that sampled EOS last gets a delta 1 token shorter)."""
    return B * sum(prompt + j * (T // k + delta) for j in range(k)) - short_deltas


def check(data: dict, backends: list[str]) -> None:
    cfg, result = data["config"], data["results"]
    assert cfg["quick"] and cfg["reps"] == 1 and cfg["threads"] == 1 and cfg["backends"] == backends
    assert (cfg["total_tokens"], cfg["episodes"], cfg["ks"]) == (T, B, list(KS))
    assert len(cfg["commit"]) == 40 and not cfg["eos_stops"]
    delta = tool_delta_ids(build_char_tokenizer(), ["42"], include_end_of_turn=True)
    assert cfg["tool_delta_tokens"] == len(delta)
    rows = {(r["backend"], r["turns"]): r for r in result["rows"]}
    assert sorted(rows) == sorted((b, k) for b in backends for k in KS)
    assert set(result["ratios"]) == set(backends)
    for name in backends:
        assert set(result["ratios"][name]) == {str(k) for k in KS}
        assert result["ratios"][name]["1"] == 1.0
        for k in KS:
            r = rows[name, k]
            (rep,) = r["reps"]
            assert result["ratios"][name][str(k)] == r["ratio"] > 0
            assert r["ratio_reps"] == [r["ratio"]]
            assert r["ratio"] == pytest.approx(rep["seconds"] / rows[name, 1]["reps"][0]["seconds"])
            # the same-context reference: one generation from the final context length (k > 1)
            if k == 1 or name == "one_loop":
                assert r["same_context_ratio"] is None and r["same_context_seconds"] is None
            else:
                lo, med, hi = r["same_context_ratio"]
                assert lo == med == hi == pytest.approx(rep["seconds"] / r["same_context_seconds"])
            # EOS is switched off: every episode generates exactly T tokens in k turns of T // k
            assert r["max_new_tokens_per_turn"] == T // k
            assert rep["generated_tokens"] == r["generated_tokens"] == B * T
            assert rep["min_episode_tokens"] == rep["max_episode_tokens"] == T
            assert rep["finish_reasons"] == {"length": B * k}
            assert len(rep["turn_seconds"]) == (1 if name == "one_loop" else k)
            # the bound: each trainside row over the one-loop time at the same K, same rep
            if name == "one_loop" or "one_loop" not in backends:
                assert r["over_one_loop"] is None
            else:
                lo, med, hi = r["over_one_loop"]
                bound = rows["one_loop", k]["reps"][0]["seconds"]
                assert lo == med == hi == pytest.approx(rep["seconds"] / bound)
            assert r["ms_per_generated_token"] == pytest.approx(
                1e3 * rep["seconds"] / rep["generated_tokens"]
            )
            assert r["ms_per_episode"] == pytest.approx(1e3 * rep["seconds"] / B)
            assert r["cpu_ratio"] == pytest.approx(
                rep["cpu_seconds"] / rows[name, 1]["reps"][0]["cpu_seconds"]
            )
            assert 0 < sum(rep["turn_seconds"]) <= rep["seconds"]
            if name == "one_loop":  # one loop: the prompt and the k - 1 deltas forwarded once
                assert rep["cached_tokens"] is None and rep["prefill_forwards"] is None
                assert rep["submitted_prompt_tokens"] == rep["prefilled_tokens"]
                assert rep["submitted_prompt_tokens"] == B * (
                    cfg["prompt_tokens"] + (k - 1) * len(delta)
                )
                continue
            full = submitted_tokens(cfg["prompt_tokens"], k, len(delta))
            # up to one token shorter per delta where a turn's last sampled token was the EOS id
            assert full - B * (k - 1) <= rep["submitted_prompt_tokens"] <= full
            if name == "trainside_prefill":  # no cache between calls: every turn prefills all
                assert rep["cached_tokens"] is None
                assert rep["prefilled_tokens"] == rep["submitted_prompt_tokens"]
                assert rep["prefill_forwards"] == k  # one prefill forward per generate call
                assert 0 < rep["prefill_seconds"] < sum(rep["turn_seconds"])
            elif name == "trainside" and k == 1:  # the reference: one plain generation
                assert rep["cached_tokens"] is None and rep["prefill_forwards"] == 1
            elif name == "trainside":  # each episode keeps its KV cache: turn j reuses turn j-1's
                # context and its tokens but the last one (sampled, never forwarded)
                turns = [cfg["prompt_tokens"] + j * (T // k + len(delta)) for j in range(k)]
                reused = B * sum(turns[j - 1] + T // k - 1 for j in range(1, k))
                assert abs(rep["cached_tokens"] - reused) <= B * (k - 1)  # EOS-shortened deltas
                assert (
                    rep["prefilled_tokens"] == rep["submitted_prompt_tokens"] - rep["cached_tokens"]
                )
                assert rep["prefill_forwards"] == k
            else:  # SGLang's radix cache: later turns reuse the earlier turns' prefix
                assert rep["prefill_seconds"] is None and rep["prefill_forwards"] is None
                assert 0 <= rep["cached_tokens"] < rep["submitted_prompt_tokens"]
                assert (
                    rep["prefilled_tokens"] == rep["submitted_prompt_tokens"] - rep["cached_tokens"]
                )
                if k > 1:  # at least the prompt of every episode is cached for turns 2..k
                    assert rep["cached_tokens"] >= B * (k - 1) * cfg["prompt_tokens"]


@pytest.mark.slow  # a benchmark script: full tier only
def test_bench_multi_turn_quick_trainside_kept_and_prefilled(tmp_path):
    names = ["trainside", "trainside_prefill", "one_loop"]
    check(run_quick(tmp_path, "--backends", ",".join(names)), names)


@pytest.mark.sglang
@pytest.mark.slow
def test_bench_multi_turn_quick_all_backends(tmp_path, sglang_server):
    # every backend in one run (the trainside ones alone would repeat their half: CI time); the
    # script syncs the trainside model's weights into the server before timing
    names = ["trainside", "trainside_prefill", "sglang"]
    data = run_quick(tmp_path, "--backends", ",".join(names), "--url", sglang_server.url)
    check(data, names)
    assert data["config"]["sglang_version"] and data["config"]["url"] == sglang_server.url


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backends", "sglang"], "--backends has sglang: pass --url URL of a running server"),
        (["--backends", "trainside,vllm"], r"--backends must be distinct names of"),
        (["--launch", "--url", "http://127.0.0.1:1"], "--url and --launch exclude each other"),
        (["--backends", "trainside", "--launch"], r"--url/--launch given but --backends is"),
        (["--backends", "trainside", "--ks", "2,4"], r"including 1 \(the reference\)"),
        (["--backends", "trainside", "--total-tokens", "10"], r"not divisible by K=\[4, 8\]"),
        (["--backends", "trainside", "--system-chars", "-1"], r"--system-chars must be >= 0"),
        (["--backends", "one_loop", "--allow-eos"], r"one_loop runs every turn to its cap"),
    ],
    ids=[
        "sglang-without-server",
        "unknown-backend",
        "url-and-launch",
        "launch-without-sglang",
        "no-k-1",
        "t-not-divisible",
        "negative-system-message",
        "one-loop-with-eos",
    ],
)
def test_bench_multi_turn_rejects_bad_arguments(argv, message, capsys):
    bench = importlib.import_module("bench_multi_turn")  # benchmarks/ is on pytest's path
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_bench_multi_turn_system_message_lengthens_every_prompt_alike():
    bench = importlib.import_module("bench_multi_turn")
    tok = build_char_tokenizer()
    plain = bench.make_prompts(tok, 3, seed=0)
    longer = bench.make_prompts(tok, 3, seed=0, system_chars=250)
    assert len({len(p) for p in longer}) == 1
    # the system message's 250 characters plus its ChatML turn markers, the user turn unchanged
    assert len(longer[0]) - len(plain[0]) > 250
    assert all(long[-len(short) :] == short for long, short in zip(longer, plain))


def test_bench_multi_turn_refuses_a_context_over_the_model_positions():
    bench = importlib.import_module("bench_multi_turn")
    args = bench.parse_args(["--backends", "trainside", "--system-chars", "1000", "--quick"])
    with pytest.raises(SystemExit, match=r"final context is \d+ tokens .* over the model's 1024"):
        bench.run(args)


def test_one_loop_bound_does_the_trainside_episode_s_work():
    """The ``one_loop`` bound forwards exactly what the trainside engine forwards over K turns
    (prompt, turns, tool deltas), in one loop: seeded alike, it draws the same tokens with the
    same log-probs as K ``generate`` calls that keep each episode's cache."""
    bench = importlib.import_module("bench_multi_turn")
    tok = build_char_tokenizer()
    backend = TransformersBackend(build_tiny_qwen3(len(tok), seed=0), eos_token_id=())
    prompts = bench.make_prompts(tok, 4, seed=0)
    delta = tool_delta_ids(tok, ["42"], include_end_of_turn=True)
    k, per_turn, seed = 4, 6, 7
    contexts, log_probs = [list(p) for p in prompts], [[] for _ in prompts]
    episodes = EpisodeCache()
    for turn in range(k):
        sampling = SamplingParams(max_new_tokens=per_turn, temperature=1.0, seed=seed + turn)
        out = backend.generate(contexts, 1, sampling, episodes=episodes, episode_ids=range(4))
        for b, c in enumerate(out):
            contexts[b] += c.token_ids + (delta if turn < k - 1 else [])
            log_probs[b] += c.log_probs
    assert episodes.reused_tokens > 0  # the kept-cache path ran
    bound, bound_lps = bench.one_loop_episodes(backend.model, prompts, k, per_turn, seed, delta)
    assert bound == contexts
    assert torch.allclose(torch.tensor(bound_lps), torch.tensor(log_probs), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"must all have one length .* got lengths \[3, 4\]"):
        bench.one_loop_episodes(backend.model, [[5, 6, 7], [5, 6, 7, 8]], 2, 2, 0, delta)
