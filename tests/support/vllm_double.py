"""A test double of vLLM for TorchRL 0.14.1's **real** ``vLLMWrapper`` (vLLM is not installable here).

vLLM needs CUDA (or a CPU build that does not exist for these machines), so it cannot run in these
tests. What runs instead is everything TorchRL calls of vLLM, following its real protocol (vLLM
0.11's ``vllm.LLM`` / ``SamplingParams`` / ``TokensPrompt`` / ``RequestOutput`` / ``CompletionOutput``
/ ``Logprob``, as ``torchrl/modules/llm/policies/vllm_wrapper.py`` and
``torchrl/weight_update/llm/vllm_double_buffer.py`` use them), and nothing more:

- :class:`LLM` (class name ``LLM`` in a ``vllm.*`` module: the wrapper's ``sync_vllm`` model type)
  generates with an HF causal LM, one token at a time: ``temperature`` (0: greedy), ``top_k``,
  ``top_p``, ``max_tokens``, stopping after the tokenizer's EOS (kept in ``token_ids``, as vLLM does),
  ``logprobs=1`` giving ``[{token_id: Logprob(...)}]`` per token with the *processed* log-prob,
  ``log softmax(logits / T)`` (vLLM's ``logprobs_mode="processed_logprobs"``), ``n`` samples;
- ``llm_engine.model_executor.driver_worker.model_runner.model.load_weights(pairs)`` (what TorchRL's
  ``VLLMDoubleBufferWeightReceiver`` calls for a local ``vllm.LLM``) copies HF-named tensors into the
  HF model and records their names; ``reset_prefix_cache()`` answers True.

:func:`install` (a pytest ``monkeypatch``) puts these classes where the wrapper looks for them:
``sys.modules["vllm"]`` (and ``vllm.outputs`` / ``vllm.inputs`` / ``vllm.sampling_params``) and the
wrapper module's globals that TorchRL set to ``None`` when it found no vLLM at import time.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

import torch
from tensordict import from_dataclass


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Any = None
    lora_request: Any = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int | None = None


class TokensPrompt(dict):
    """vLLM's ``TokensPrompt`` is a ``TypedDict`` with ``prompt_token_ids``."""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        super().__init__(prompt_token_ids=list(prompt_token_ids))


class SamplingParams:
    """The fields of vLLM's ``SamplingParams`` that generation reads (others are kept, unread)."""

    def __init__(
        self,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        max_tokens: int | None = 16,
        logprobs: int | None = None,
        seed: int | None = None,
        **others: Any,
    ) -> None:
        self.n, self.temperature, self.top_p, self.top_k = n, temperature, top_p, top_k
        self.max_tokens, self.logprobs, self.seed = max_tokens, logprobs, seed
        self.others = others


class _Model:
    """``model_runner.model``: vLLM's model with its ``load_weights(iterable of (name, tensor))``."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        self.hf_model = hf_model
        self.loaded: list[list[str]] = []

    def load_weights(self, weights) -> set[str]:
        params = self.hf_model.state_dict()
        names = []
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)  # an unknown name raises, as vLLM's loader does
                names.append(name)
        self.loaded.append(names)
        return set(names)


class LLM:
    """``vllm.LLM`` over an HF causal LM (see the module docstring)."""

    def __init__(self, hf_model: torch.nn.Module, tokenizer) -> None:
        self.hf_model, self.tokenizer = hf_model.eval(), tokenizer
        model = _Model(hf_model)
        runner = types.SimpleNamespace(model=model)
        worker = types.SimpleNamespace(model_runner=runner)
        executor = types.SimpleNamespace(driver_worker=worker)
        self.llm_engine = types.SimpleNamespace(model_executor=executor)
        self.model = model
        self.requests = 0

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        return True

    def generate(self, prompts, sampling_params: SamplingParams | None = None, **_: Any):
        params = sampling_params or SamplingParams()
        prompts = prompts if isinstance(prompts, list) else [prompts]
        outputs = []
        for prompt in prompts:
            ids = list(prompt["prompt_token_ids"])
            completions = [self._sample(ids, params, j) for j in range(params.n)]
            outputs.append(
                RequestOutput(str(self.requests), None, ids, None, completions, finished=True)
            )
            self.requests += 1
        return outputs

    @torch.no_grad()
    def _sample(self, prompt: list[int], params: SamplingParams, index: int) -> CompletionOutput:
        ids, log_probs, finish = list(prompt), [], "length"
        eos = self.tokenizer.eos_token_id
        for _ in range(params.max_tokens):
            logits = self.hf_model(torch.tensor([ids])).logits[0, -1].float()
            greedy = params.temperature == 0
            lp = torch.log_softmax(logits if greedy else logits / params.temperature, -1)
            if greedy:
                token = int(lp.argmax())
            else:
                token = int(torch.multinomial(_filtered(lp, params).exp(), 1))
            ids.append(token)
            log_probs.append({token: Logprob(float(lp[token]), rank=1)})
            if token == eos:
                finish = "stop"
                break
        new = ids[len(prompt) :]
        return CompletionOutput(
            index=index,
            text=self.tokenizer.decode(new),
            token_ids=new,
            cumulative_logprob=sum(next(iter(d.values())).logprob for d in log_probs),
            logprobs=log_probs if params.logprobs else None,
            finish_reason=finish,
        )


def _filtered(lp: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """top-k / top-p filtering of the sampling distribution (the reported log-prob is not)."""
    keep = torch.ones_like(lp, dtype=torch.bool)
    if params.top_k not in (-1, 0, None) and params.top_k < lp.numel():
        keep &= lp >= lp.topk(params.top_k).values[-1]
    if params.top_p < 1.0:
        probs, order = lp.exp().sort(descending=True)
        before = probs.cumsum(0) - probs
        keep[order[before >= params.top_p]] = False
    return torch.log_softmax(torch.where(keep, lp, -torch.inf), -1)


def install(monkeypatch) -> None:
    """Make TorchRL's ``vLLMWrapper`` find this double (see the module docstring)."""
    from torchrl.modules.llm.policies import vllm_wrapper

    vllm = types.ModuleType("vllm")
    outputs = types.ModuleType("vllm.outputs")
    inputs = types.ModuleType("vllm.inputs")
    sampling = types.ModuleType("vllm.sampling_params")
    outputs.RequestOutput, outputs.CompletionOutput = RequestOutput, CompletionOutput
    inputs.TokensPrompt = TokensPrompt
    sampling.SamplingParams = SamplingParams
    vllm.outputs, vllm.inputs, vllm.sampling_params = outputs, inputs, sampling
    vllm.SamplingParams, vllm.LLM, vllm.TokensPrompt = SamplingParams, LLM, TokensPrompt
    for name, module in {
        "vllm": vllm,
        "vllm.outputs": outputs,
        "vllm.inputs": inputs,
        "vllm.sampling_params": sampling,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(vllm_wrapper, "_HAS_VLLM", True)
    monkeypatch.setattr(vllm_wrapper, "SamplingParams", SamplingParams)
    monkeypatch.setattr(vllm_wrapper, "RequestOutput", RequestOutput)
    monkeypatch.setattr(vllm_wrapper, "TokensPrompt", TokensPrompt)
    # the wrapper caches a TensorClass of vllm.outputs.CompletionOutput on its class: this one's,
    # removed again at teardown
    completion_tc = from_dataclass(CompletionOutput)
    monkeypatch.setattr(
        vllm_wrapper.vLLMWrapper, "_CompletionOutput_tc", completion_tc, raising=False
    )


LLM.__module__ = "vllm.entrypoints.llm"  # vLLMWrapper's model-type check: ``vllm.LLM``
