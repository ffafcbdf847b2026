"""TorchRLBackend over TorchRL's SGLangWrapper(AsyncSGLang) against the session's real SGLang
server: the rollout engine of LLMEnv and ToolEnv, token-in/token-out, with the server's log-probs
equal to the trainer's within 1e-4, synced without ``value_head.*`` (the names the sync wrote are
recorded), and a first PPO update at ratio exactly 1. TorchRL's AsyncSGLang sends no API key: the
requests it makes carry the session's (tests/support/torchrl_sglang.py)."""

from __future__ import annotations

import pytest
import torch
from support.sglang_helpers import SentNames, trainer_with_value_head
from support.torchrl_sglang import authorized
from support.trajectories import first_update_has_ratio_one

from ar_torchrl.backends import SamplingParams
from ar_torchrl.backends.torchrl import TorchRLBackend
from ar_torchrl.data import arithmetic_dataset
from ar_torchrl.data.tasks import tool_arithmetic_rows
from ar_torchrl.envs import LLMEnv, ToolEnv
from ar_torchrl.models import build_char_tokenizer
from ar_torchrl.modules import LMActorCritic
from ar_torchrl.tools import ToolConfig
from ar_torchrl.training import plan_micro_batches
from ar_torchrl.weight_sync import named_policy_tensors

VERSION = 900
TEMPERATURE = 0.7


def assert_trainer_log_probs(model, td, temperature=TEMPERATURE, atol=1e-4):
    """Every trained token's rollout log-prob against a plain fp32 forward of its row."""
    for b in range(td.batch_size[0]):
        real = td["attention_mask"][b]
        ids = td["tokens"][b][real]
        with torch.no_grad():
            logits = model(ids[None]).logits[0].float() / temperature
        ref = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
        trained = td["loss_mask"][b][real][1:]
        got = td["rollout_log_prob"][b][real][1:][trained]
        torch.testing.assert_close(got, ref[trained], atol=atol, rtol=0)


@pytest.mark.sglang
def test_an_sglang_wrapper_generates_for_llm_env_and_tool_env(
    sglang_server, sglang_api_key, monkeypatch
):
    from torchrl.modules.llm import SGLangWrapper
    from torchrl.modules.llm.backends.sglang import AsyncSGLang

    torch.set_num_threads(1)
    authorized(monkeypatch, sglang_server.url, sglang_api_key)
    tok = build_char_tokenizer()
    policy = SGLangWrapper(AsyncSGLang.connect(sglang_server.url), tokenizer=tok)
    source = trainer_with_value_head(seed=31)
    with TorchRLBackend(policy) as engine:
        sent = SentNames(engine.sender.client)  # what the disk sync wrote
        engine.sync_weights(source.state_dict().items(), version=VERSION)
        assert sent.paths.count("/update_weights_from_disk") == 1
        assert sorted(sent.names) == sorted(n for n, _ in named_policy_tensors(source))
        assert not any(n.startswith("value_head.") for n in sent.names)

        sampling = SamplingParams(max_new_tokens=6, temperature=TEMPERATURE)
        env = LLMEnv(
            arithmetic_dataset(8),
            tok,
            engine,
            num_samples=2,
            prompts_per_batch=2,
            sampling=sampling,
        )
        td = env.collect()
        for b in range(td.batch_size[0]):  # token-in: the chat-templated prompt ids
            prompt = td["tokens"][b][td["attention_mask"][b] & ~td["loss_mask"][b]].tolist()
            assert prompt == env.prompt_token_ids(int(td["prompt_id"][b, 0]))
        assert (td["policy_version"] == VERSION).all()
        assert_trainer_log_probs(source, td)
        plan = plan_micro_batches(td, token_budget=2 * td.batch_size[1])
        first_update_has_ratio_one(LMActorCritic(source), td, plan)
        assert source.value_head.weight.grad.norm() > 0

        tool_env = ToolEnv(
            tool_arithmetic_rows(2, seed=0),
            tok,
            engine,
            toolbox=ToolConfig().build(),
            num_samples=1,
            prompts_per_batch=2,
            sampling=sampling,
            max_turns=2,
        )
        episodes = tool_env.collect()
        assert "turn_id" in episodes.keys() and (episodes["policy_version"] == VERSION).all()
        assert_trainer_log_probs(source, episodes)
        with pytest.raises(ValueError, match=r"SGLangWrapper sends one sampling setting"):
            engine.generate([[1, 40]], 2, SamplingParams(max_new_tokens=2, seed=1))
