"""TorchRLBackend over TorchRL's TransformersWrapper (real) and vLLMWrapper (real wrapper, vLLM
double: tests/support/vllm_double.py): token-in/token-out for LLMEnv, log-probs equal to the
trainer's, weight sync through TorchRL's own machinery without ``value_head.*``, the registry entry.
The SGLangWrapper against a real server: test_backend_sglang.py."""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
from support import vllm_double
from torchrl.modules.llm import TransformersWrapper

from ar_torchrl.backends import BackendCapabilities, SamplingParams
from ar_torchrl.backends.registry import BACKENDS, BackendContext
from ar_torchrl.backends.torchrl import TorchRLBackend
from ar_torchrl.data import arithmetic_dataset
from ar_torchrl.envs import LLMEnv
from ar_torchrl.models import build_char_tokenizer, build_tiny_qwen3
from ar_torchrl.modules import attach_value_head
from ar_torchrl.weight_sync import WeightSyncError, named_policy_tensors

torch.set_num_threads(1)
TEMPERATURE = 0.7


@pytest.fixture
def tok():
    return build_char_tokenizer()


def trainer(seed: int = 0) -> torch.nn.Module:
    """A policy with a non-zero value head (a head that leaked would show)."""
    model = attach_value_head(build_tiny_qwen3(99, seed=seed))
    with torch.no_grad():
        model.value_head.weight.fill_(0.5)
    return model


def trainer_log_probs(model, td, temperature: float = TEMPERATURE) -> list[torch.Tensor]:
    """Per row: a plain full forward of the unpadded row, ``log_softmax(logits / T)`` of its
    trained tokens (the trainer's fp32 numerics)."""
    out = []
    for b in range(td.batch_size[0]):
        real, mask = td["attention_mask"][b], td["loss_mask"][b]
        ids = td["tokens"][b][real]
        with torch.no_grad():
            logits = model(ids[None]).logits[0].float() / temperature
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
        out.append(lp[mask[real][1:]])
    return out


def env_for(tok, engine, **kwargs):
    return LLMEnv(
        arithmetic_dataset(8, seed=0),
        tok,
        engine,
        num_samples=2,
        prompts_per_batch=2,
        sampling=SamplingParams(max_new_tokens=6, temperature=TEMPERATURE, **kwargs),
    )


def check_layout(td, tok, env):
    """Each row: the chat-templated prompt ids, then the sampled tokens (token-in/token-out)."""
    for b in range(td.batch_size[0]):
        prompt = td["tokens"][b][td["attention_mask"][b] & ~td["loss_mask"][b]].tolist()
        assert prompt == env.prompt_token_ids(int(td["prompt_id"][b, 0]))
        assert 1 <= int(td["loss_mask"][b].sum()) <= 6


# -- TransformersWrapper ---------------------------------------------------------------------------


def test_transformers_wrapper_generates_for_llm_env_with_the_trainers_log_probs(tok):
    model = trainer()
    policy = TransformersWrapper(model, tokenizer=tok, input_mode="history", generate=True)
    before = (policy.input_mode, dict(policy.generate_kwargs))
    engine = TorchRLBackend(policy)
    assert engine.capabilities == BackendCapabilities()  # nothing partial, no memory, no RNG state
    with pytest.raises(ValueError, match=r"TorchRLBackend cannot interrupt its generation"):
        engine.partial_rollouts = True
    env = env_for(tok, engine, seed=3)
    td = env.collect()
    check_layout(td, tok, env)
    for b, ref in enumerate(trainer_log_probs(model, td)):
        torch.testing.assert_close(
            td["rollout_log_prob"][b][td["loss_mask"][b]], ref, atol=1e-5, rtol=0
        )
    assert (policy.input_mode, dict(policy.generate_kwargs)) == before  # the user's wrapper
    again = env_for(tok, TorchRLBackend(policy), seed=3).collect()  # a seed reproduces the batch
    assert torch.equal(again["tokens"], td["tokens"])
    other = env_for(tok, TorchRLBackend(policy), seed=4).collect()
    assert not torch.equal(other["tokens"], td["tokens"])


def test_transformers_sync_goes_through_torchrls_strategy_without_the_value_head(tok, monkeypatch):
    from torchrl.weight_update import WeightStrategy

    applied = []
    real = WeightStrategy.apply_weights

    def record(self, destination, weights, inplace=True):
        applied.append(sorted(weights))
        return real(self, destination, weights, inplace)

    monkeypatch.setattr(WeightStrategy, "apply_weights", record)
    engine_model = attach_value_head(build_tiny_qwen3(99, seed=1))  # its head stays zero
    engine = TorchRLBackend(TransformersWrapper(engine_model, tokenizer=tok))
    source = trainer(seed=0)
    engine.sync_weights(source.state_dict().items(), version=2)  # value_head.* offered, dropped
    assert engine.policy_version == 2 and len(applied) == 1
    assert not any(n.startswith("value_head.") for n in applied[0])
    assert set(applied[0]) == {n for n, _ in named_policy_tensors(source)}
    for name, tensor in named_policy_tensors(source):
        assert torch.equal(engine_model.state_dict()[name], tensor), name
    assert (engine_model.value_head.weight == 0).all()
    wrong = [(n, t[:1] if n == "lm_head.weight" else t) for n, t in named_policy_tensors(source)]
    with pytest.raises(
        WeightSyncError,
        match=r"'lm_head.weight' has shape \(1, 64\), the engine's model \(99, 64\)",
    ):
        engine.sync_weights(wrong, version=3)
    assert engine.policy_version == 2 and len(applied) == 1  # refused before anything was applied
    with pytest.raises(WeightSyncError, match=r"has no tensors \['extra.weight'\]"):
        engine.sync_weights([*named_policy_tensors(source), ("extra.weight", torch.ones(1))], 3)
    engine.generate([[1, 40]], 1, SamplingParams(max_new_tokens=2))  # not broken: nothing applied


def test_wrappers_only_and_their_limits(tok, monkeypatch):
    with pytest.raises(TypeError, match=r"TorchRLBackend wraps a TorchRL LLM wrapper .* got Qwen3"):
        TorchRLBackend(build_tiny_qwen3(99))
    same = build_char_tokenizer()
    same.pad_token = same.eos_token
    with pytest.raises(ValueError, match=r"eos ids \[2\] and pad id 2"):
        TorchRLBackend(TransformersWrapper(build_tiny_qwen3(99), tokenizer=same))


# -- vLLMWrapper (the real wrapper over the vLLM double) ---------------------------------------------


@pytest.fixture
def vllm(monkeypatch):
    vllm_double.install(monkeypatch)
    from torchrl.modules.llm import vLLMWrapper

    return vLLMWrapper


def test_vllm_wrapper_generates_with_engine_log_probs_and_syncs_by_double_buffer(tok, vllm):
    engine_model = build_tiny_qwen3(99, seed=1)
    llm = vllm_double.LLM(engine_model, tok)
    policy = vllm(llm, tokenizer=tok, input_mode="history", generate_kwargs={"max_new_tokens": 4})
    engine = TorchRLBackend(policy)
    source = trainer(seed=0)
    engine.sync_weights(source.state_dict().items(), version=1)  # TorchRL's double buffer
    assert llm.model.loaded and not any(n.startswith("value_head.") for n in llm.model.loaded[-1])
    assert set(llm.model.loaded[-1]) == {n for n, _ in named_policy_tensors(source)}
    directory = engine.sender.directory
    assert os.path.isdir(directory)
    torch.manual_seed(0)
    env = env_for(tok, engine)
    td = env.collect()
    check_layout(td, tok, env)
    assert (td["policy_version"] == 1).all()
    for b, ref in enumerate(
        trainer_log_probs(source, td)
    ):  # the engine's own (processed) log-probs
        torch.testing.assert_close(
            td["rollout_log_prob"][b][td["loss_mask"][b]], ref, atol=1e-5, rtol=0
        )
    assert (
        llm.requests == 4
    )  # one token prompt per sample (the backend repeats each prompt n times)
    engine.close()
    assert not os.path.exists(directory)


def test_what_vllm_and_sglang_wrappers_cannot_do_is_refused(tok, vllm):
    policy = vllm(vllm_double.LLM(build_tiny_qwen3(99), tok), tokenizer=tok)
    engine = TorchRLBackend(policy)
    with pytest.raises(ValueError, match=r"vLLMWrapper sends one sampling setting .* seed"):
        engine.generate([[1, 40]], 2, SamplingParams(max_new_tokens=2, seed=1))
    with pytest.raises(ValueError, match=r"vLLMWrapper drops stop_token_ids .*got \[7\]"):
        engine.generate([[1, 40]], 1, SamplingParams(max_new_tokens=2, stop_token_ids=(7,)))
    with pytest.raises(ValueError, match=r"prompts \[1\] hold the pad id 0, which TorchRL"):
        engine.generate([[1, 40], [1, 0, 40]], 1, SamplingParams(max_new_tokens=2))
    engine.close()


# -- the registry ------------------------------------------------------------------------------------


def test_registered_as_backend_torchrl(tok, tmp_path):
    assert BACKENDS["torchrl"].help.startswith("a TorchRL LLM wrapper")
    options = BACKENDS.options("torchrl", {}, prefix="config: backend.")
    assert options.starts_with_trainer_weights()
    model = trainer()
    with contextlib.ExitStack() as stack:
        engine = BACKENDS.build("torchrl", {}, context=BackendContext(model, tok, tmp_path, stack))
        assert isinstance(engine, TorchRLBackend) and engine.kind == "transformers"
        assert engine.wrapper.model is not model  # a copy of the policy
        out = engine.generate([[1, 40]], 2, SamplingParams(max_new_tokens=3, seed=0))
        assert [len(c) for c in out] == [3, 3]
        engine.sync_weights(named_policy_tensors(copy.deepcopy(model)), version=1)
    sglang = BACKENDS.options("torchrl", {"wrapper": "sglang", "url": "http://127.0.0.1:1"})
    assert not sglang.starts_with_trainer_weights()
    with pytest.raises(
        ValueError, match=r"config: backend.url is required with backend.wrapper=sglang"
    ):
        BACKENDS.options("torchrl", {"wrapper": "sglang"}, prefix="config: backend.")
    with pytest.raises(
        ValueError, match=r"backend.url / backend.weight_sync_options configure an SGLangWrapper"
    ):
        BACKENDS.options("torchrl", {"url": "http://127.0.0.1:1"}, prefix="config: backend.")
    with pytest.raises(
        ValueError,
        match=r"config: backend.wrapper='vllm' is not one of \['transformers', 'sglang'\]",
    ):
        BACKENDS.options("torchrl", {"wrapper": "vllm"}, prefix="config: backend.")
    with pytest.raises(ValueError, match=r"weight_sync_options.bucket_bytes must be >= 1"):
        BACKENDS.options(
            "torchrl",
            {"wrapper": "sglang", "url": "http://h:1", "weight_sync_options": {"bucket_bytes": 0}},
            prefix="config: backend.",
        )
