"""``TorchRLBackend``: a TorchRL LLM wrapper as this library's rollout engine.

A TorchRL user who already runs ``TransformersWrapper``, ``vLLMWrapper`` or ``SGLangWrapper`` (over
``AsyncSGLang``) keeps that engine: wrapped in :class:`TorchRLBackend` it generates for
:class:`~ar_torchrl.envs.LLMEnv`, :class:`~ar_torchrl.envs.ToolEnv` and the recipe's collector like
any :class:`~ar_torchrl.backends.GenerationBackend`, token-in / token-out: the prompts' token ids go
in as ``("tokens", "prompt")`` of the wrapper in ``input_mode="tokens"`` (a copy made with the
wrapper's own ``get_new_version``: the user's wrapper is never changed), the sampled ids come back
from ``("tokens", "response")``; nothing is decoded and re-tokenized.

Log-probs (``Completion.log_probs``, the ``rollout_log_prob`` of the trajectory: ``log softmax(
logits / T)`` of the sampled token, docs/design.md section 7b):

- ``SGLangWrapper``: the server's own (``meta_info.output_token_logprobs``, temperature-scaled);
  they match the trainer's recompute within 1e-4 (``tests/backends/torchrl``, a real server);
- ``vLLMWrapper``: the engine's own (``CompletionOutput.logprobs``); vLLM's V1 engine computes
  them from the raw logits by default (``logprobs_mode="raw_logprobs"``): start it with
  ``logprobs_mode="processed_logprobs"`` when sampling at ``T != 1``;
- ``TransformersWrapper``: recomputed with the wrapper's model (the trainer's numerics: one
  :class:`~ar_torchrl.modules.LMActorCritic` forward per micro-batch), because TorchRL 0.14.1
  writes 0.0 for the first token and ignores the temperature (docs/design.md section 8). Its
  generation also bans the pad id (``bad_words_ids``): TorchRL drops sampled pad ids from the
  response, which would lose tokens.

Sampling: ``SamplingParams`` become the wrapper's generation keywords (``max_new_tokens``,
``temperature`` / greedy, ``top_p``, ``top_k``; ``stop_token_ids`` for transformers and SGLang). A
per-call ``seed`` is honoured by ``TransformersWrapper`` (a forked, seeded torch RNG); TorchRL's SGLang
and vLLM wrappers send one sampling setting for every request, so a seed would make the ``n``
samples of a prompt identical: it is refused there. The finish is read from the tokens (EOS or a
stop id last: ``"stop"``; ``max_new_tokens`` tokens: ``"length"``); a shorter response without
one lost tokens and is an error.

Weight sync (:meth:`~ar_torchrl.backends.GenerationBackend.sync_weights`, the backend owning the
version) goes through TorchRL's own machinery where it works (:mod:`.sender`); ``value_head.*`` never
leaves the trainer (:func:`~ar_torchrl.weight_sync.policy_only`).

Capabilities (:class:`~ar_torchrl.backends.BackendCapabilities`): none. TorchRL's wrappers cannot be
interrupted mid-generation (no partial rollouts), release no memory, and keep no sampler state a
checkpoint could restore.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Literal

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack, set_list_to_stack

from ar_torchrl.backends.base import (
    BackendCapabilities,
    Completion,
    FinishReason,
    GenerationBackend,
    SamplingParams,
)
from ar_torchrl.weight_sync.base import WeightSender

__all__ = ["TorchRLBackend", "WrapperKind", "wrapper_kind"]

logger = logging.getLogger(__name__)

WrapperKind = Literal["transformers", "vllm", "sglang"]
_OWNER = "TorchRLBackend"


def wrapper_kind(wrapper: Any) -> WrapperKind:
    """Which TorchRL LLM wrapper ``wrapper`` is (its class; subclasses included).

    Example:
        >>> wrapper_kind(object())
        Traceback (most recent call last):
        ...
        TypeError: TorchRLBackend wraps a TorchRL LLM wrapper (TransformersWrapper, vLLMWrapper or SGLangWrapper from torchrl.modules.llm), got object
    """
    from torchrl.modules.llm import SGLangWrapper, TransformersWrapper, vLLMWrapper

    for cls, kind in (
        (TransformersWrapper, "transformers"),
        (SGLangWrapper, "sglang"),
        (vLLMWrapper, "vllm"),
    ):
        if isinstance(wrapper, cls):
            return kind
    raise TypeError(
        f"{_OWNER} wraps a TorchRL LLM wrapper (TransformersWrapper, vLLMWrapper or SGLangWrapper "
        f"from torchrl.modules.llm), got {type(wrapper).__name__}"
    )


class TorchRLBackend(GenerationBackend):
    """A :class:`~ar_torchrl.backends.GenerationBackend` over a TorchRL LLM wrapper (see the
    module docstring).

    Args:
        wrapper: a ``TransformersWrapper``, ``vLLMWrapper`` or ``SGLangWrapper`` with a tokenizer
            (its pad and EOS ids). Its ``input_mode``, ``generate_kwargs`` and output padding do
            not matter: the backend generates with its own token-mode copies.
        sender: how :meth:`sync_weights` ships tensors (default: the engine's, :mod:`.sender`).
        weight_sync: ``SGLangWrapper`` only: this library's SGLang sync method for the wrapper's
            server (``disk``, ``tensor``, ``distributed``).
        weight_sync_options: that method's options; for ``vLLMWrapper``, ``directory`` /
            ``num_threads`` of the double buffer.
        token_budget: tokens per micro-batch of the ``TransformersWrapper`` log-prob recompute.

    Raises:
        TypeError: ``wrapper`` is not one of TorchRL's LLM wrappers.
        ValueError: the wrapper has no tokenizer, or its pad id is an EOS id.

    Example:
        >>> from torchrl.modules.llm import TransformersWrapper
        >>> from ar_torchrl.models import build_char_tokenizer, build_tiny_qwen3
        >>> tok = build_char_tokenizer()
        >>> policy = TransformersWrapper(build_tiny_qwen3(len(tok)), tokenizer=tok, input_mode="history")
        >>> engine = TorchRLBackend(policy)
        >>> out = engine.generate([[1, 40, 41]], 2, SamplingParams(max_new_tokens=3, seed=0))
        >>> [(len(c.token_ids), c.finish_reason, c.policy_version) for c in out]
        [(3, 'length', 0), (3, 'length', 0)]
        >>> all(lp < 0 for c in out for lp in c.log_probs), engine.capabilities.partial_rollouts
        (True, False)
    """

    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities()

    def __init__(
        self,
        wrapper: Any,
        *,
        sender: WeightSender | None = None,
        weight_sync: str = "disk",
        weight_sync_options: Mapping[str, Any] | None = None,
        token_budget: int = 16384,
    ) -> None:
        self.kind = wrapper_kind(wrapper)
        self.wrapper = wrapper
        tokenizer = getattr(wrapper, "tokenizer", None)
        if tokenizer is None or not isinstance(getattr(tokenizer, "pad_token_id", None), int):
            raise ValueError(
                f"{_OWNER}: the {type(wrapper).__name__} has no tokenizer with a pad_token_id; "
                "pass tokenizer= to the wrapper (its pad and EOS ids are needed)"
            )
        self.tokenizer = tokenizer
        self.pad_token_id = int(tokenizer.pad_token_id)
        eos = tokenizer.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos or [])
        if not self.eos_token_ids or self.pad_token_id in self.eos_token_ids:
            raise ValueError(
                f"{_OWNER}: eos ids {sorted(self.eos_token_ids)} and pad id {self.pad_token_id}: "
                "TorchRL drops generated pad-id tokens, so an EOS equal to the pad id would be "
                "lost; give the tokenizer its own pad token"
            )
        self.token_budget = int(token_budget)
        if sender is None:
            from ar_torchrl.backends.torchrl.sender import default_sender

            sender = default_sender(
                wrapper,
                self.kind,
                weight_sync=weight_sync,
                weight_sync_options=weight_sync_options,
            )
        super().__init__(sender)
        self._policies: dict[tuple, Any] = {}

    # ------------------------------------------------------------------ the wrapper's copies
    def _generate_kwargs(self, sampling: SamplingParams) -> dict[str, Any]:
        """``SamplingParams`` in the wrappers' standard generation keywords."""
        gk: dict[str, Any] = {"max_new_tokens": sampling.max_new_tokens}
        if sampling.greedy:
            gk.update({"do_sample": False} if self.kind == "transformers" else {"temperature": 0.0})
        else:
            gk.update(temperature=sampling.temperature, top_p=sampling.top_p)
            if self.kind == "transformers":
                gk["do_sample"] = True
                # HF's GenerationConfig defaults to top_k=50; the vocabulary size keeps every token
                gk["top_k"] = sampling.top_k if sampling.top_k != -1 else self._vocab_size()
            elif sampling.top_k != -1:
                gk["top_k"] = sampling.top_k
        if self.kind == "vllm":  # the prompt's log-probs are never read: not computed
            gk["prompt_logprobs"] = None
        if self.kind == "transformers":
            gk["eos_token_id"] = sorted(self.eos_token_ids | set(sampling.stop_token_ids))
            gk["pad_token_id"] = self.pad_token_id
            gk["bad_words_ids"] = [[self.pad_token_id]]  # TorchRL drops sampled pad ids
        return gk

    def _vocab_size(self) -> int:
        get = getattr(self.wrapper.model, "get_input_embeddings", None)
        weight = getattr(get(), "weight", None) if callable(get) else None
        return int(weight.shape[0]) if weight is not None else len(self.tokenizer)

    def _check_sampling(self, sampling: SamplingParams) -> None:
        name = type(self.wrapper).__name__
        if sampling.seed is not None and self.kind != "transformers":
            raise ValueError(
                f"{_OWNER}: {name} sends one sampling setting for every request, so a seed would "
                f"make the samples of a prompt identical; leave SamplingParams.seed=None (got "
                f"{sampling.seed})"
            )
        if sampling.stop_token_ids and self.kind == "vllm":
            raise ValueError(
                f"{_OWNER}: TorchRL 0.14.1's vLLMWrapper drops stop_token_ids from its generation "
                f"keywords (got {list(sampling.stop_token_ids)}); end responses with the EOS id"
            )

    def _policy(self, sampling: SamplingParams) -> Any:
        """The wrapper's token-mode copy for ``sampling`` (one per setting, kept)."""
        self._check_sampling(sampling)
        key = (sampling.max_new_tokens, sampling.temperature, sampling.top_p, sampling.top_k)
        key += (sampling.stop_token_ids,)
        policy = self._policies.get(key)
        if policy is None:
            policy = self.wrapper.get_new_version(
                input_mode="tokens",
                input_key=("tokens", "prompt"),
                generate=True,
                return_log_probs=self.kind != "transformers",
                pad_output=False,
                num_samples=None,
                inplace=False,
                generate_kwargs=self._generate_kwargs(sampling),
            )
            if self.kind == "sglang" and sampling.stop_token_ids:
                # SGLangWrapper's keyword conversion knows no stop ids; its generate_kwargs are the
                # sampling_params AsyncSGLang posts (unknown names pass through)
                policy.generate_kwargs["stop_token_ids"] = list(sampling.stop_token_ids)
            self._policies[key] = policy
        return policy

    @contextlib.contextmanager
    def _seeded(self, sampling: SamplingParams) -> Iterator[None]:
        if sampling.seed is None:
            yield
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(sampling.seed))
            yield

    # ------------------------------------------------------------------ generation
    def _generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams
    ) -> list[Completion]:
        policy = self._policy(sampling)
        self._check_prompts(prompts)
        rows = [p for p in prompts for _ in range(n)]
        td = lazy_stack([self._input(p) for p in rows])
        with set_list_to_stack(True), self._seeded(sampling), torch.no_grad():
            out = policy(td)
        responses = self._responses(out, len(rows))
        finishes = [self._finish(r, ids, sampling) for r, ids in enumerate(responses)]
        if self.kind == "transformers":
            log_probs = self._recompute(rows, responses, finishes, sampling)
        else:
            log_probs = self._engine_log_probs(out, responses)
        return [
            Completion(r // n, ids, lp, finish)
            for r, (ids, lp, finish) in enumerate(zip(responses, log_probs, finishes))
        ]

    def _input(self, prompt: list[int]) -> TensorDict:
        ids = torch.tensor(prompt)
        td = TensorDict({"tokens": TensorDict({"prompt": ids})})
        if self.kind == "transformers":  # else TorchRL masks the prompt's pad-id tokens out
            td["attention_mask"] = torch.ones_like(ids, dtype=torch.bool)
        return td

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        if self.kind != "vllm":
            return
        bad = [i for i, p in enumerate(prompts) if self.pad_token_id in p]
        if bad:
            raise ValueError(
                f"{_OWNER}: prompts {bad[:5]} hold the pad id {self.pad_token_id}, which TorchRL "
                "0.14.1's vLLMWrapper strips from token prompts (the engine would see another "
                "prompt); give the tokenizer a pad token the prompts never contain"
            )

    def _responses(self, out: TensorDictBase, rows: int) -> list[list[int]]:
        ids = out.get(("tokens", "response"), None, as_list=True)
        if ids is None or len(ids) != rows:
            got = "none" if ids is None else len(ids)
            raise RuntimeError(
                f"{_OWNER}: {type(self.wrapper).__name__} returned {got} ('tokens', 'response') "
                f"rows for {rows} prompts"
            )
        return [torch.as_tensor(x).reshape(-1).tolist() for x in ids]

    def _finish(self, row: int, ids: list[int], sampling: SamplingParams) -> FinishReason:
        stops = self.eos_token_ids | set(sampling.stop_token_ids)
        early = [k for k, t in enumerate(ids[:-1]) if t in stops]
        if early or len(ids) > sampling.max_new_tokens:
            raise RuntimeError(
                f"{_OWNER}: row {row}: {type(self.wrapper).__name__} returned {len(ids)} tokens "
                f"(max_new_tokens={sampling.max_new_tokens}) with a stop id at {early[:3]} before "
                "the last: the engine did not stop where it should"
            )
        if ids and ids[-1] in stops:
            return "stop"
        if len(ids) == sampling.max_new_tokens:
            return "length"
        raise RuntimeError(
            f"{_OWNER}: row {row}: {type(self.wrapper).__name__} returned {len(ids)} tokens, "
            f"without a stop id {sorted(stops)} and fewer than max_new_tokens="
            f"{sampling.max_new_tokens}: tokens were lost (TorchRL drops generated pad-id tokens, "
            f"pad id {self.pad_token_id}) or the engine stopped for a reason this backend does not "
            "know (stop strings)"
        )

    def _engine_log_probs(
        self, out: TensorDictBase, responses: list[list[int]]
    ) -> list[list[float]]:
        lps = out.get(("log_probs", "response"), None, as_list=True)
        if lps is None:
            raise RuntimeError(
                f"{_OWNER}: {type(self.wrapper).__name__} returned no ('log_probs', 'response') "
                "(return_log_probs=True was asked)"
            )
        result = []
        for r, (lp, ids) in enumerate(zip(lps, responses)):
            lp = torch.as_tensor(lp, dtype=torch.float32).reshape(-1)
            if lp.numel() != len(ids) or not torch.isfinite(lp).all() or (lp > 1e-4).any():
                raise RuntimeError(
                    f"{_OWNER}: row {r}: {type(self.wrapper).__name__} returned {lp.numel()} "
                    f"log-probs for {len(ids)} tokens (or values that are not finite "
                    "log-probabilities <= 0)"
                )
            result.append(lp.tolist())
        return result

    def _recompute(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        finishes: list[FinishReason],
        sampling: SamplingParams,
    ) -> list[list[float]]:
        """``log softmax(logits / T)`` of the sampled tokens with the wrapper's model, through
        the trainer's own forward (``LMActorCritic``, micro-batched by a plan)."""
        from ar_torchrl.data.samples import Sample, Segment
        from ar_torchrl.data.trajectory import build_trajectory
        from ar_torchrl.modules import LMActorCritic
        from ar_torchrl.training.micro_batch import plan_micro_batches
        from ar_torchrl.training.old_log_probs import recompute_old_log_probs_and_values

        keep = [r for r, ids in enumerate(responses) if ids]
        out: list[list[float]] = [[] for _ in responses]
        if not keep:
            return out
        samples = [
            Sample(
                [Segment(prompts[r]), Segment(responses[r], trained=True)],
                finish_reason=finishes[r],
            )
            for r in keep
        ]
        td = build_trajectory(samples, pad_token_id=self.pad_token_id)
        inputs = td.select("tokens", "attention_mask")
        temperature = 1.0 if sampling.greedy else sampling.temperature
        actor = LMActorCritic(self.wrapper.model, critic=False, temperature=temperature)
        plan = plan_micro_batches(inputs, token_budget=max(self.token_budget, inputs.shape[1]))
        recompute_old_log_probs_and_values(actor, inputs, plan)
        log_prob = inputs["sample_log_prob"]
        for row, r in enumerate(keep):
            out[r] = log_prob[row][td["loss_mask"][row]].tolist()
        return out
