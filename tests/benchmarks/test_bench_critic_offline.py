"""benchmarks/experiments/critic_offline.py without its recipe runs: finished runs are not repeated,
the table and docs block from synthetic logs, and the deepened critic model (identity layers
appended) reproduces its source model's logits."""

from __future__ import annotations

import json

import pytest
import torch
from support.bench_helpers import load_benchmark


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_finished_runs_are_summarised_not_repeated_and_tabled(tmp_path, monkeypatch):
    m = load_benchmark("critic_offline")
    calls = []
    monkeypatch.setattr(m, "_recipe", lambda run_dir, *o: calls.append(run_dir))
    monkeypatch.setattr(m, "_deepen", lambda *a: calls.append("deepen"))
    args = m.parse_args(["--runs", str(tmp_path), "--iterations", "3", "--epochs", "2"])
    (tmp_path / "source" / "rollouts").mkdir(parents=True)
    for i in range(3):
        (tmp_path / "source" / "rollouts" / f"step_{i}.safetensors").write_bytes(b"")
    _write(
        tmp_path / "source" / "metrics.jsonl",
        [{"step": i, "critic/explained_variance": 0.1 * i} for i in range(1, 4)],
    )
    for k, arm in enumerate(m.ARMS):
        records = [
            {
                "epoch": e,
                "train/loss_critic": 0.2 / e,
                "critic/explained_variance": 0.3 + 0.01 * e + 0.1 * k,
                "critic/explained_variance_within_prompt": 0.01 * e,
            }
            for e in (1, 2)
        ]
        _write(tmp_path / m._slug(arm) / "critic_pretrain.jsonl", records)
    m.run_all(args)
    assert calls == ["deepen"]  # the deeper model is (re)built, no run is repeated
    result = m.summarize(args)
    assert list(result["arms"]) == list(m.ARMS)
    assert result["source_online"]["last_10"]["critic/explained_variance"] == pytest.approx(0.2)
    table = m.table(result)
    assert (
        "| separate (defaults) | 2 | 0.320 (best 0.320, epoch 1 0.310) | - | - | - | 0.020 | 0.100 |"
        in table
    )
    assert "| online, same policy (source run, last 10 of 3 iterations) | - | 0.200 |" in table
    # the shipped ceiling of critic_arithmetic's warm start, within-prompt one included
    assert (
        "| **ceiling** (a perfect critic of this policy) | - | 0.702 | 0.439 | 0.746 | 0.987 | 0.539 | - |"
        in table
    )
    assert "benchmarks/experiments/critic_offline.py --jobs 2 --write-docs" in m.docs_block(result)
    block = m.docs_block(result)
    assert block.startswith("<!-- critic_offline:begin -->") and block.endswith(
        "<!-- critic_offline:end -->"
    )


def test_the_deepened_critic_model_starts_as_its_source(tmp_path):
    from transformers import AutoModelForCausalLM

    from ar_torchrl.models.tiny import build_char_tokenizer, build_tiny_qwen3

    tok = build_char_tokenizer()
    model = build_tiny_qwen3(len(tok), seed=0)
    model.save_pretrained(tmp_path / "src")
    tok.save_pretrained(tmp_path / "src")
    m = load_benchmark("critic_offline")
    out = m._deepen(tmp_path / "src", tmp_path / "deep", 2)
    deep = AutoModelForCausalLM.from_pretrained(out)
    assert deep.config.num_hidden_layers == model.config.num_hidden_layers + 2
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(deep(ids).logits, model(ids).logits, atol=1e-6)
