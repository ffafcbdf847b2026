"""Smoke test: ``benchmarks/bench_collection.py --quick`` runs and writes a consistent JSON (so it
can't rot); no timings are asserted. Its test double (``FixedCompletionsBackend``) is checked
against the ``GenerationBackend`` contract by hand."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ar_torchrl.backends import SamplingParams
from ar_torchrl.models import build_char_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_collection.py"


@pytest.mark.slow  # a benchmark script: full tier only (~25 s, mostly imports)
def test_bench_collection_quick_writes_every_scenario(tmp_path):
    out = tmp_path / "collection.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--reps", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "collection per sample" in proc.stdout and "env construction" in proc.stdout
    data = json.loads(out.read_text())
    cfg, result = data["config"], data["results"]
    assert cfg["quick"] and cfg["reps"] == 2 and cfg["threads"] == 1
    assert len(cfg["commit"]) == 40  # the code measured
    assert result["rows"] == 300 - 64  # data.num_rows=300 minus the held-out rows
    names = [(s["backend"], s["batch"], s["max_new_tokens"]) for s in result["scenarios"]]
    assert names == [("trainside", 64, 12), ("fake", 64, 12), ("fake", 128, 32)]
    for s in result["scenarios"]:
        assert len(s["reps"]) == 2
        med, per = s["median_per_batch"], s["median_per_sample"]
        assert 0 < med["generate_s"] < med["total_s"]
        assert med["reward_fn_s"] > 0 and med["layout_s"] > 0
        assert per["else_ms"] == pytest.approx(1e3 * med["else_s"] / s["batch"])
        assert s["else_fraction"] == pytest.approx(med["else_s"] / med["total_s"])
        assert 1 <= s["mean_response_tokens"] <= s["max_new_tokens"]
        for rep in s["reps"]:
            assert rep["else_s"] == pytest.approx(rep["total_s"] - rep["generate_s"])
            assert rep["layout_s"] == pytest.approx(rep["else_s"] - rep["reward_fn_s"])
            # today's LLMEnv: generate (backend + samples, decoding included), the reward, the
            # trajectory builder; no separate score/decode step (that was the env before segments)
            assert rep["decode_s"] is None
            parts = ("actions_s", "reward_fn_s", "trajectory_s", "other_s")
            assert all(rep[k] > 0 for k in parts)
            assert sum(rep[k] for k in parts) == pytest.approx(rep["else_s"])
        forwards = med.get("model_forward_s", 0.0)
        if s["backend"] == "trainside":
            assert 0 < forwards < med["generate_s"]  # the model runs inside generate
        else:
            assert forwards == 0.0
    cons = result["construction"]
    assert len(cons["reps"]) == 2 and cons["median"]["env_s"] > 0 and cons["median"]["check_s"] > 0


def test_fixed_completions_backend_follows_the_backend_contract():
    # imported by name (benchmarks/ is on pytest's path): its dataclasses need sys.modules
    bench = importlib.import_module("bench_collection")
    tok = build_char_tokenizer()
    fake = bench.FixedCompletionsBackend(
        tok, max_new_tokens=16, eos_token_id=tok.eos_token_id, pool=8
    )
    out = fake.generate([[5, 6], [7]], 3, SamplingParams(max_new_tokens=16))
    assert [c.prompt_index for c in out] == [0, 0, 0, 1, 1, 1]  # prompt-major
    assert all(c.policy_version == 0 and 1 <= len(c) <= 16 for c in out)
    assert {c.finish_reason for c in out} == {"stop", "length"}
    for c in out:
        assert all(0 <= t < len(tok) for t in c.token_ids)
        assert (c.token_ids[-1] == tok.eos_token_id) == (c.finish_reason == "stop")
    again = fake.generate([[5, 6], [7]], 3, SamplingParams(max_new_tokens=16))
    assert [c.token_ids for c in again] == [c.token_ids for c in out]  # fixed
    out[0].token_ids.append(1)  # fresh objects: a caller's change does not reach the pool
    assert (
        fake.generate([[5]], 1, SamplingParams(max_new_tokens=16))[0].token_ids
        == again[0].token_ids
    )
