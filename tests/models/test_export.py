"""ar_torchrl.models.export: the policy as a plain HF directory (no value head) that generates what the
trainer's policy generates, and a separate critic written and read back with its value head."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from support.hf_export import chat_prompts, greedy_tokens, weight_names
from tensordict import TensorDict
from transformers import AutoModelForCausalLM, AutoTokenizer

from ar_torchrl.models.export import export_critic, export_policy, load_critic
from ar_torchrl.models.tiny import build_char_tokenizer, build_tiny_qwen3
from ar_torchrl.modules import LMCritic, PopArtValueHead, attach_value_head, build_separate_critic

torch.set_num_threads(1)


def _policy(seed: int):
    """A tiny Qwen3 with a non-zero value head, as a trainer holds it; its weights moved (std 0.3)
    so that its greedy answers depend on the prompt (a fresh tiny model repeats one token)."""
    tok = build_char_tokenizer()
    model = attach_value_head(build_tiny_qwen3(len(tok), seed=seed))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval(), tok


def test_exported_policy_loads_without_value_head_and_generates_the_trainers_greedy_tokens(
    tmp_path,
):
    model, tok = _policy(seed=3)
    out = export_policy(model, tmp_path / "policy", tok)
    assert out == tmp_path / "policy"
    names = weight_names(out)
    assert names and not any(n.startswith("value_head") for n in names)
    assert "model.embed_tokens.weight" in names
    assert not (out / "value_head.safetensors").exists()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not hasattr(loaded, "value_head")
    want = {k: v for k, v in model.state_dict().items() if not k.startswith("value_head")}
    got = loaded.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    loaded_tok = AutoTokenizer.from_pretrained(out)
    assert loaded_tok.get_vocab() == tok.get_vocab()
    assert loaded_tok.chat_template == tok.chat_template
    prompts = chat_prompts(loaded_tok)
    assert prompts == chat_prompts(tok)
    tokens = greedy_tokens(loaded, prompts)
    assert tokens == greedy_tokens(model, prompts)
    assert len({tuple(t) for t in tokens}) > 1  # the answers depend on the prompt
    # the comparison can fail: another policy answers differently
    assert tokens != greedy_tokens(_policy(seed=4)[0], prompts)


def test_export_takes_given_tensors_and_drops_the_value_head(tmp_path):
    """A sharded trainer passes the gathered tensors: they are what gets written."""
    model, _ = _policy(seed=1)
    other, _ = _policy(seed=2)
    pairs = list(other.state_dict().items())  # value_head.* among them
    assert any(n.startswith("value_head") for n, _ in pairs)
    loaded = AutoModelForCausalLM.from_pretrained(
        export_policy(model, tmp_path / "p", tensors=pairs)
    )
    assert torch.equal(loaded.lm_head.weight, other.lm_head.weight)
    assert not torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert not any(n.startswith("value_head") for n in weight_names(tmp_path / "p"))


def test_export_replaces_a_previous_one_and_a_failed_export_keeps_it(tmp_path, monkeypatch):
    first, tok = _policy(seed=1)
    second, _ = _policy(seed=2)
    target = tmp_path / "policy"
    export_policy(first, target, tok)
    export_policy(second, target, tok)  # replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]  # no .tmp left over
    loaded = AutoModelForCausalLM.from_pretrained(target)
    assert torch.equal(loaded.lm_head.weight, second.lm_head.weight)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(tok, "save_pretrained", broken)
    with pytest.raises(OSError, match="disk full"):
        export_policy(first, target, tok)
    loaded = AutoModelForCausalLM.from_pretrained(target)  # still the second, whole
    assert torch.equal(loaded.lm_head.weight, second.lm_head.weight)


def _values(critic: LMCritic) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 99, (3, 7), generator=g)
    td = TensorDict(
        {"tokens": tokens, "attention_mask": torch.ones_like(tokens, dtype=torch.bool)}, [3, 7]
    )
    with torch.no_grad():
        return critic(td)["state_value"]


def test_critic_roundtrip_gives_the_same_values(tmp_path):
    policy, tok = _policy(seed=5)
    critic = build_separate_critic(policy)
    torch.nn.init.normal_(critic.model.value_head.weight, std=0.3)
    torch.nn.init.constant_(critic.model.value_head.bias, 0.25)
    out = export_critic(critic, tmp_path / "critic", tok)
    assert not any(n.startswith("value_head") for n in weight_names(out))
    assert weight_names(out, "value_head.safetensors") == {"value_head.weight", "value_head.bias"}
    with safe_open(str(out / "value_head.safetensors"), framework="pt") as f:
        assert f.metadata() == {"head": "linear"}
    again = load_critic(out)
    assert isinstance(again, LMCritic)
    want = _values(critic)
    assert want.abs().sum() > 0
    torch.testing.assert_close(_values(again), want, rtol=0, atol=0)
    # the same directory is an HF model too (its LM head unused by the critic)
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == "Qwen3ForCausalLM"


def test_popart_critic_roundtrip_keeps_statistics_and_step_size(tmp_path):
    model = build_tiny_qwen3(99, seed=6)
    attach_value_head(model, popart_beta=0.25)
    torch.nn.init.normal_(model.value_head.weight, std=0.3)
    model.value_head.update_statistics(torch.tensor([3.0, 9.0, -4.0]))
    critic = LMCritic(model)
    out = export_critic(critic, tmp_path / "critic")
    again = load_critic(out)
    head = again.model.value_head
    assert isinstance(head, PopArtValueHead) and head.beta == 0.25
    assert head.eps == model.value_head.eps
    assert torch.equal(head.mu, model.value_head.mu) and torch.equal(head.nu, model.value_head.nu)
    assert int(head.updates) == 1
    torch.testing.assert_close(_values(again), _values(critic), rtol=0, atol=0)


def test_export_critic_without_a_value_head_and_load_of_a_policy_are_refused(tmp_path):
    model = build_tiny_qwen3(99, seed=0)
    with pytest.raises(ValueError, match=r"export_critic: no value_head\.\* tensor among the"):
        export_critic(model, tmp_path / "critic")
    export_policy(model, tmp_path / "policy")
    with pytest.raises(FileNotFoundError, match="load_critic: no value_head.safetensors in"):
        load_critic(tmp_path / "policy")
