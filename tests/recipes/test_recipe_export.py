"""The end of a run: ``run_dir/policy/`` (an HF directory without ``value_head.*``) that generates the
trainer's greedy tokens, ``run_dir/critic/`` for a separate critic, and ``train.export=false``."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from support.hf_export import chat_prompts, greedy_tokens, weight_names
from support.recipe_helpers import load, typed
from transformers import AutoModelForCausalLM, AutoTokenizer

from ar_torchrl.models.export import load_critic
from ar_torchrl.recipes import Launch, dapo_ppo
from ar_torchrl.recipes.dapo_ppo import loop
from ar_torchrl.recipes.strategy import LocalStrategy

SHORT = [
    "train.iterations=2",
    "train.eval_every=0",
    "train.plot=false",
    "logger=none",
    "rollout.prompts_per_iter=8",
]


@pytest.mark.slow
def test_the_exported_policy_generates_the_trainers_greedy_tokens(tmp_path, cache_dir):
    cfg = typed([*SHORT, f"cache_dir={cache_dir}"])
    with contextlib.ExitStack() as stack:
        run = loop.setup(cfg, tmp_path, None, stack, LocalStrategy(cfg.device))
        assert loop.train(run, SimpleNamespace(requested=False)) == 2
        written = loop.export(run)
    assert written == {"policy": tmp_path / "policy"}  # the value head is the policy's: no critic/
    policy_dir = written["policy"]
    assert not (tmp_path / "critic").exists()
    names = weight_names(policy_dir)
    assert not any(n.startswith("value_head") for n in names)
    trained = {k: v for k, v in run.model.state_dict().items() if not k.startswith("value_head")}
    assert run.model.value_head.weight.abs().sum() > 0  # a trained head was left out
    exported = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    assert exported.state_dict().keys() == trained.keys()
    for k, v in exported.state_dict().items():
        assert torch.equal(v, trained[k]), k
    tok = AutoTokenizer.from_pretrained(policy_dir)
    assert tok.get_vocab() == run.tokenizer.get_vocab()
    prompts = chat_prompts(tok)
    assert prompts == chat_prompts(run.tokenizer)
    tokens = greedy_tokens(exported, prompts)
    assert tokens == greedy_tokens(run.model.eval(), prompts)
    assert len({tuple(t) for t in tokens}) > 1  # the answers depend on the question


@pytest.mark.slow
def test_a_separate_critic_run_exports_both_models_as_its_last_checkpoint_holds_them(
    separate_run,
):
    run_dir, history = separate_run  # examples/dapo_ppo.py, critic=separate, 3 iterations
    state = torch.load(run_dir / "checkpoints" / "step_3.pt", map_location="cpu", weights_only=True)
    policy = load_file(str(run_dir / "policy" / "model.safetensors"))
    assert not any(k.startswith("value_head") for k in policy)
    for k, v in policy.items():
        assert torch.equal(v, state["model"][k]), k
    critic = load_critic(run_dir / "critic")
    for k, v in critic.model.state_dict().items():
        assert torch.equal(v, state["critic"][k]), k
    assert critic.model.value_head.weight.abs().sum() > 0  # the trained head, not a fresh one
    assert (run_dir / "critic" / "tokenizer.json").read_text() == (
        run_dir / "policy" / "tokenizer.json"
    ).read_text()


@pytest.mark.slow
def test_export_false_writes_no_model_directory(tmp_path, cache_dir):
    overrides = [*SHORT, "train.iterations=1", f"cache_dir={cache_dir}", "train.export=false"]
    launch = Launch(tmp_path, "dapo_ppo", "dapo_ppo", overrides, script="dapo_ppo.py")
    result = dapo_ppo.run(load(overrides), launch)
    assert result.status == 0, result.lines
    assert (tmp_path / "checkpoints" / "step_1.pt").is_file()
    assert not (tmp_path / "policy").exists() and not (tmp_path / "critic").exists()
    assert not any(line.startswith("exported") for line in result.lines)
