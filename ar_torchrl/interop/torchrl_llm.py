"""TorchRL's own LLM stack (``ChatEnv`` + an LLM wrapper + ``LLMCollector``) -> this library.

:class:`TokenTrajectory` turns a batch of TorchRL 0.14.1's LLM collector (``tokens.prompt`` /
``tokens.response`` lists, ``log_probs.response``, a reward per step) into the ``[B, L]`` token
trajectory of docs/design.md section 1, so that ``TokenGAE``, ``TokenPPOLoss``,
``recompute_old_log_probs_and_values`` and ``ppo_update`` run on it unchanged. Pass it as the
collector's ``postproc``::

    collector = LLMCollector(env, policy=policy, postproc=TokenTrajectory.from_policy(policy), ...)

Single-turn dialogs (``StepCounter(max_steps=1)``) become one row each; **multi-turn dialogs**
(``ChatEnv`` with TorchRL's tool transforms, collected whole with
``LLMCollector(yield_completed_trajectories=True)``) become one row per dialog: the first prompt, then
every assistant turn (trained, ``turn_id`` = the turn) and, between turns, the tokens TorchRL's next
prompt adds after the turn (the tool / user messages and the next generation prompt: masked), each
turn with its own reward (on its last trained token) and weight version. Tokens are never
re-tokenized: turn ``k + 1``'s prompt must continue turn ``k``'s prompt and response token for
token, else the dialog is refused (a chat template that renders a sampled turn differently).

What TorchRL 0.14.1 gets wrong and how the converter deals with it (docs/design.md section 8):

- ``TransformersWrapper`` writes 0.0 as the log-prob of every first generated token, and its
  log-probs come from the raw logits (temperature ignored). They never become ``rollout_log_prob``
  unchecked: ``rollout_log_prob="drop"`` (default) leaves the key out, ``"recompute"`` recomputes
  it with the generating model, ``"raise"`` keeps the engine's log-probs and refuses the defect
  (``SGLangWrapper``'s are right: keep them with ``"raise"``).
- ``TransformersWrapper`` drops generated tokens equal to the pad id from ``tokens.response``
  (and their log-probs): the sampled sequence is lost, nothing can repair it. A response that
  ends neither with EOS nor at ``max_new_tokens`` shows the loss and is refused;
  :meth:`TokenTrajectory.from_policy` also refuses a ``TransformersWrapper`` that can sample the
  pad id (fix: ``generate_kwargs={"bad_words_ids": [[pad_id]]}``; TorchRL silently drops
  ``suppress_tokens``). ``SGLangWrapper`` and ``vLLMWrapper`` keep every token.
- ``StepCounter(max_steps=1)`` marks every row truncated. A single-turn dialog's finish is read from
  its tokens: EOS last -> terminated, ``max_new_tokens`` reached -> truncated. A multi-turn dialog is
  terminated when its last step is (``("next", "terminated")``, e.g. a transform that ends the
  dialog on an answer without a tool call) and its last turn ended with EOS; truncated otherwise.

:func:`policy_state_dict` is the value-head-free state dict for TorchRL's weight-sync helpers
(``get_model_metadata``, ``WeightStrategy.extract_weights``, ``sender.update_weights``), which
would otherwise send ``value_head.weight`` / ``value_head.bias`` to the inference engine.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from collections.abc import Sequence
from typing import Literal

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey
from torch import nn

from ar_torchrl.data.samples import Sample, Segment
from ar_torchrl.data.trajectory import build_trajectory
from ar_torchrl.weight_sync.names import named_policy_tensors

__all__ = ["PolicyStateDict", "TokenTrajectory", "policy_state_dict", "prompt_group_id"]

logger = logging.getLogger(__name__)

#: Largest log-prob ``"raise"`` mode accepts: ``log softmax`` is <= 0 exactly in float32 (the max
#: logit minus a logsumexp that is >= it), so anything above is not a log-probability; the margin
#: leaves room for an engine that rounds differently.
LOG_PROB_TOLERANCE = 1e-4

RolloutLogProb = Literal["drop", "recompute", "raise"]
_MODES = ("drop", "recompute", "raise")
_OWNER = "TokenTrajectory"
_PAD_FIX = "TransformersWrapper(..., generate_kwargs={{'bad_words_ids': [[{pad}]], ...}})"


def prompt_group_id(prompt: Sequence[int] | torch.Tensor) -> int:
    """A stable, non-negative int64 id of a prompt's token ids: the GRPO group (``prompt_id``).

    The same tokens give the same id in every batch and every process (a BLAKE2b digest, not
    Python's salted ``hash``), so batches concatenated later keep distinct prompts apart.

    Example:
        >>> prompt_group_id([1, 5, 6]) == prompt_group_id(torch.tensor([1, 5, 6]))
        True
        >>> prompt_group_id([1, 5, 6]) == prompt_group_id([1, 5, 7])
        False
    """
    ids = torch.as_tensor(prompt, dtype=torch.int64).reshape(-1).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(ids, digest_size=8).digest(), "little") >> 1


class TokenTrajectory:
    """``LLMCollector`` postproc: a TorchRL LLM batch -> the ``[B, L]`` token trajectory.

    Reads, per step of the (flattened, time-ordered) batch: ``("tokens", "prompt")`` and
    ``("tokens", "response")`` (1-D id tensors, ``pad_output=False``), the reward ``("next",
    "reward")`` (one value per step, e.g. ``[B, 1, 1]``), ``("next", "done")`` (where a dialog ends),
    ``("next", "policy_version")`` or ``"policy_version"`` (an int:
    ``LLMCollector(track_policy_version=True)``), ``("collector", "traj_ids")`` when present, and,
    with ``rollout_log_prob="raise"``, ``("log_probs", "response")``. Consecutive steps up to a done
    step are one dialog (a ``[B, T]`` batch: row by row); each dialog is one row of the trajectory.

    Writes the keys of docs/design.md section 1: ``tokens``, ``attention_mask``, ``loss_mask`` (the
    assistant turns only), ``("next", "reward")`` (each turn's reward on its last trained token),
    ``("next", "done")`` / ``("next", "terminated")`` / ``("next", "truncated")`` on the dialog's last
    trained token (see the module docstring for the finish), ``prompt_id`` =
    :func:`prompt_group_id` of the dialog's first prompt (same prompt -> same group),
    ``policy_version`` (each turn's own on its tokens), ``rollout_log_prob`` unless dropped, and
    ``turn_id`` (section 1b: the turn on trained tokens, -1 elsewhere) when a dialog of the batch has
    several turns (``turn_ids=True``: always, e.g. for a replay buffer whose batches must share keys).

    Args:
        tokenizer: the policy's tokenizer (its ``pad_token_id``, and ``eos_token_id`` by default).
        max_new_tokens: the generation cap of one turn: a turn of that many tokens without EOS was
            cut by length (truncated); a shorter one without EOS lost tokens and is refused. A pad id
            dropped from inside an EOS-ended response leaves no such trace: only a policy that
            cannot sample the pad id (checked by :meth:`from_policy`) rules it out.
        rollout_log_prob: what becomes ``rollout_log_prob``:

            - ``"drop"`` (default): nothing; the key is left out. The library's old log-probs are
              recomputed by the trainer (``recompute_old_log_probs_and_values``), so the engine's
              log-probs only feed drift metrics and truncated importance sampling, and TorchRL
              0.14.1's ``TransformersWrapper`` gets them wrong on the first token. Leaving the key
              out (rather than zeros plus a flag) keeps ``TokenPPOLoss`` from reporting a drift
              against zeros, and ``tis_cap`` then fails loudly (missing key) instead of weighting by
              ``exp(log_prob - 0)``.
            - ``"recompute"``: ``log softmax(logits / temperature)`` of the sampled tokens with
              ``model`` (the generating model, at its current weights), micro-batched.
            - ``"raise"``: keep the engine's log-probs (``SGLangWrapper``'s, ``vLLMWrapper``'s);
              raise when a turn's first log-prob is exactly 0.0 (``TransformersWrapper``'s defect)
              or a turn's log-probs do not match its tokens.
        model: the generating HF model, for ``"recompute"``.
        temperature: the sampling temperature, for ``"recompute"``.
        eos_token_id: the id(s) that end a response (default ``tokenizer.eos_token_id``).
        token_budget: tokens per micro-batch of the ``"recompute"`` forward.
        vocab_size: token ids must lie in ``[0, vocab_size)`` (default: the rows of ``model``'s
            input embeddings when a model is given, else ``len(tokenizer)``;
            :meth:`from_policy` takes the policy model's).
        turn_ids: write ``turn_id`` always (``True``), never (``False``), or when a dialog of the
            batch has several turns (``None``).
        allow_mixed_versions: accept a batch whose turns were sampled under several weight versions
            (a dialog open across ``collector.increment_version()``): each token keeps its turn's
            version (``policy_version`` varies along a row). Otherwise one batch holds one version.

    Raises (when called):
        KeyError: a key the batch lacks, with the TorchRL setting that writes it.
        ValueError: naming the step (and the value): an empty batch, a token id outside the
            vocabulary, a batch that ends inside a dialog, a turn whose prompt does not continue the
            dialog token for token, lost tokens, a turn with more than ``max_new_tokens`` tokens, a
            dialog without a generated token, several or non-finite rewards, log-probs with the
            defect or above 0 (``LOG_PROB_TOLERANCE``), a non-integer policy version, or steps of
            several policy versions without ``allow_mixed_versions``.

    Example:
        >>> from tensordict import lazy_stack
        >>> from ar_torchrl.models.tiny import build_char_tokenizer
        >>> tok = build_char_tokenizer()  # pad 0, eos 2
        >>> def step(prompt, response, done):
        ...     return TensorDict({"tokens": {"prompt": torch.tensor(prompt), "response": torch.tensor(response)},
        ...                        "next": {"reward": torch.ones(1, 1), "done": torch.tensor([done]),
        ...                                 "policy_version": torch.tensor(3)}})
        >>> single = [step([1, 40], [7, 2], True), step([1, 40], [7, 8, 9], True)]
        >>> td = TokenTrajectory(tok, max_new_tokens=3)(lazy_stack(single))
        >>> td.batch_size, td["tokens"].tolist()
        (torch.Size([2, 5]), [[1, 40, 7, 2, 0], [1, 40, 7, 8, 9]])
        >>> td["next", "terminated"].any(1).flatten().tolist(), td["next", "truncated"].any(1).flatten().tolist()
        ([True, False], [False, True])
        >>> "rollout_log_prob" in td.keys(), td["policy_version"][:, 0].tolist()
        (False, [3, 3])
        >>> dialog = [step([1, 40], [7, 2], False), step([1, 40, 7, 2, 50, 51], [8, 2], True)]  # a tool answered 50 51
        >>> td = TokenTrajectory(tok, max_new_tokens=3)(lazy_stack(dialog))
        >>> td["tokens"].tolist(), td["loss_mask"].int().tolist(), td["turn_id"].tolist()
        ([[1, 40, 7, 2, 50, 51, 8, 2]], [[0, 0, 1, 1, 0, 0, 1, 1]], [[-1, -1, 0, 0, -1, -1, 1, 1]])
        >>> td["next", "reward"].squeeze(-1).tolist()
        [[0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]]
    """

    def __init__(
        self,
        tokenizer,
        *,
        max_new_tokens: int,
        rollout_log_prob: RolloutLogProb = "drop",
        model: nn.Module | None = None,
        temperature: float = 1.0,
        eos_token_id: int | Sequence[int] | None = None,
        token_budget: int = 16384,
        vocab_size: int | None = None,
        turn_ids: bool | None = None,
        allow_mixed_versions: bool = False,
    ) -> None:
        if rollout_log_prob not in _MODES:
            raise ValueError(
                f"{_OWNER}: rollout_log_prob must be one of {_MODES}, got {rollout_log_prob!r}"
            )
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(f"{_OWNER}: max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"{_OWNER}: max_new_tokens must be >= 1, got {max_new_tokens}")
        if rollout_log_prob == "recompute" and not isinstance(model, nn.Module):
            raise ValueError(
                f"{_OWNER}: rollout_log_prob='recompute' needs the generating model: "
                f"TokenTrajectory(..., model=policy.model), got model={type(model).__name__}"
            )
        if turn_ids not in (None, True, False):
            raise ValueError(f"{_OWNER}: turn_ids must be None, True or False, got {turn_ids!r}")
        self.tokenizer = tokenizer
        self.pad_token_id = _pad_id(tokenizer)
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos)
        if not self.eos_token_ids or self.pad_token_id in self.eos_token_ids:
            raise ValueError(
                f"{_OWNER}: eos ids {sorted(self.eos_token_ids)} and pad id {self.pad_token_id}: "
                "TransformersWrapper drops pad-id tokens, so an EOS equal to the pad id is lost; "
                "give the tokenizer its own pad token (tokenizer.pad_token = '<pad>' or another "
                "special token the model never samples)"
            )
        self.max_new_tokens = max_new_tokens
        self.rollout_log_prob = rollout_log_prob
        self.model = model
        self.temperature = float(temperature)
        self.token_budget = int(token_budget)
        self.vocab_size = _vocab_size(tokenizer, model, vocab_size)
        self.turn_ids = turn_ids
        self.allow_mixed_versions = bool(allow_mixed_versions)

    @property
    def collate_fn(self):
        """:func:`~ar_torchrl.data.pad_trajectories` with this converter's pad id: the ``collate_fn``
        of a ``ReplayBuffer(storage=LazyStackStorage(n))`` holding converted batches of several
        widths (``ReplayBuffer(..., collate_fn=converter.collate_fn)``)."""
        from ar_torchrl.data.pad import pad_trajectories

        return functools.partial(pad_trajectories, pad_token_id=self.pad_token_id)

    @classmethod
    def from_policy(cls, policy, **kwargs) -> TokenTrajectory:
        """Build from a TorchRL LLM wrapper: its tokenizer, ``max_new_tokens``, temperature, EOS
        ids and (for ``"recompute"``) model.

        - ``TransformersWrapper`` (and any wrapper with HF ``generate_kwargs``): after checking
          that it cannot sample the pad id (TorchRL 0.14.1 drops sampled pad ids);
        - ``SGLangWrapper``: ``generate_kwargs`` are SGLang's sampling params (``max_new_tokens``,
          ``temperature``); SGLang keeps every sampled token, so no pad-id ban is needed;
        - ``vLLMWrapper``: ``sampling_params.max_tokens`` and ``.temperature``.

        Raises:
            ValueError: ``pad_output=True``, no ``max_new_tokens``, or a ``TransformersWrapper``
                whose pad id is not banned through ``bad_words_ids``.
        """
        name = type(policy).__name__
        if getattr(policy, "pad_output", False):
            raise ValueError(
                f"{_OWNER}.from_policy: {name}(pad_output=True) mixes padding into tokens.response "
                "(and, in history mode, into the response text); use pad_output=False"
            )
        kind = _policy_kind(policy)
        if kind == "vllm":
            params = policy.sampling_params
            gk = {"max_new_tokens": getattr(params, "max_tokens", None)}
            if getattr(params, "temperature", None) is not None:
                gk["temperature"] = float(params.temperature)
            gk = {k: v for k, v in gk.items() if v is not None}
        else:
            gk = dict(getattr(policy, "generate_kwargs", None) or {})
        if "max_new_tokens" not in gk:
            raise ValueError(
                f"{_OWNER}.from_policy: {name}.generate_kwargs has no max_new_tokens (got keys "
                f"{sorted(gk)}); set generate_kwargs={{'max_new_tokens': N, ...}} so that a cut by "
                "length can be told from a finished response"
            )
        tokenizer = policy.tokenizer
        if kind == "transformers":
            _check_pad_banned(policy, gk, _pad_id(tokenizer), name)
        config = getattr(getattr(policy, "model", None), "generation_config", None)
        if kind == "transformers":
            sampled = gk.get("do_sample", getattr(config, "do_sample", False))
        else:  # SGLang / vLLM sample unless the temperature is 0 (greedy: T = 1 log-probs)
            sampled = float(gk.get("temperature", 1.0)) > 0
        kwargs.setdefault("max_new_tokens", int(gk["max_new_tokens"]))
        kwargs.setdefault("temperature", float(gk.get("temperature", 1.0)) if sampled else 1.0)
        eos = gk.get("eos_token_id", getattr(config, "eos_token_id", None))
        if eos is not None and kind == "transformers":
            kwargs.setdefault("eos_token_id", eos)
        if kwargs.get("rollout_log_prob") == "recompute":
            kwargs.setdefault("model", policy.model)
        embeddings = _embedding_rows(getattr(policy, "model", None))
        if embeddings is not None:
            kwargs.setdefault("vocab_size", embeddings)
        return cls(tokenizer, **kwargs)

    def __call__(self, data: TensorDictBase) -> TensorDict:
        rows = data.reshape(-1) if data.batch_dims != 1 else data
        if rows.batch_size[0] == 0:
            raise ValueError(
                f"{_OWNER}: the batch has no rows (batch size {tuple(data.batch_size)}); a "
                "collector batch holds at least one dialog turn"
            )
        prompts = _id_list(rows, ("tokens", "prompt"), "the policy's prompt tokens")
        responses = _id_list(rows, ("tokens", "response"), "an LLM wrapper with generate=True")
        _check_vocabulary(prompts, ("tokens", "prompt"), self.vocab_size)
        _check_vocabulary(responses, ("tokens", "response"), self.vocab_size)
        rewards = _per_row(rows, ("next", "reward"), "a reward transform on the env", float)
        _check_finite_rewards(rewards)
        versions = _policy_versions(rows, self.allow_mixed_versions)
        log_probs = self._engine_log_probs(rows, responses)
        dialogs = _dialogs(rows, _row_dim(data))
        multi = self.turn_ids or (self.turn_ids is None and any(len(d) > 1 for d in dialogs))
        terminated = _flags(rows, ("next", "terminated"))
        samples = []
        for steps in dialogs:
            segments = self._segments(steps, prompts, responses, log_probs, versions, multi)
            finish = self._dialog_finish(steps, responses, terminated)
            sample = Sample(
                segments, prompt_id=prompt_group_id(prompts[steps[0]]), finish_reason=finish
            )
            if multi:
                sample.turn_rewards = {k: rewards[s] for k, s in enumerate(steps)}
            else:
                sample.reward = rewards[steps[0]]
            samples.append(sample)
        for b, steps in enumerate(dialogs):
            if not samples[b].num_trained:
                raise ValueError(
                    f"{_OWNER}: the dialog of rows {steps} has no generated token; there is no "
                    "token to train on or to put its reward on"
                )
        td = build_trajectory(
            samples, pad_token_id=self.pad_token_id, allow_mixed_versions=self.allow_mixed_versions
        )
        if self.rollout_log_prob == "drop":
            del td["rollout_log_prob"]
        elif self.rollout_log_prob == "recompute":
            td.set("rollout_log_prob", self._recompute(td))
        logger.debug(
            "%s: %d steps, %d dialogs, %d terminated, width %d",
            _OWNER,
            rows.batch_size[0],
            td.batch_size[0],
            int(td["next", "terminated"].sum()),
            td.batch_size[1],
        )
        return td

    def _segments(self, steps, prompts, responses, log_probs, versions, multi) -> list[Segment]:
        """The dialog's first prompt, each turn (trained) and what TorchRL's next prompt adds."""
        segments = [Segment(prompts[steps[0]].tolist())]
        context = prompts[steps[0]]
        for k, s in enumerate(steps):
            if k:
                prompt = prompts[s]
                _check_continues(s, k, context, prompt, self.tokenizer)
                segments.append(Segment(prompt[len(context) :].tolist()))
                context = prompt
            ids = responses[s]
            self._check_turn(s, ids, last=k == len(steps) - 1)
            segments.append(
                Segment(
                    ids.tolist(),
                    trained=True,
                    log_probs=log_probs[s],
                    policy_version=int(versions[s]),
                    turn=k if multi else None,
                )
            )
            context = torch.cat([context, ids])
        return segments

    def _check_turn(self, row: int, ids: torch.Tensor, last: bool) -> None:
        """A turn ends with EOS or has ``max_new_tokens`` tokens (else tokens were lost)."""
        n = len(ids)
        if n > self.max_new_tokens:
            raise ValueError(
                f"{_OWNER}: row {row} has {n} generated tokens, more than max_new_tokens="
                f"{self.max_new_tokens}; pass the policy's max_new_tokens (or use from_policy)"
            )
        if (n and int(ids[-1]) in self.eos_token_ids) or n == self.max_new_tokens:
            return
        raise ValueError(
            f"{_OWNER}: row {row} has {n} generated tokens, does not end with EOS "
            f"{sorted(self.eos_token_ids)} and is shorter than max_new_tokens="
            f"{self.max_new_tokens}: tokens were lost. TorchRL 0.14.1's TransformersWrapper drops "
            f"generated tokens equal to the pad id {self.pad_token_id}; ban it with "
            + _PAD_FIX.format(pad=self.pad_token_id)
            + " (or the generation stopped for a reason this converter does not know, e.g. stop "
            "strings)"
        )

    def _dialog_finish(self, steps: list[int], responses, terminated) -> str:
        """``"stop"`` (terminated) or ``"length"`` (truncated); see the module docstring."""
        ids = responses[steps[-1]]
        ended = len(ids) > 0 and int(ids[-1]) in self.eos_token_ids
        if len(steps) == 1 or terminated is None:
            return "stop" if ended else "length"
        return "stop" if ended and bool(terminated[steps[-1]]) else "length"

    def _engine_log_probs(self, rows, responses) -> list[list[float] | None]:
        if self.rollout_log_prob != "raise":
            return [None] * len(responses)
        lps = _id_list(
            rows, ("log_probs", "response"), "the wrapper's return_log_probs=True", float
        )
        for r, (ids, lp) in enumerate(zip(responses, lps)):
            if lp.shape != ids.shape or not torch.isfinite(lp).all():
                raise ValueError(
                    f"{_OWNER}: row {r}: log_probs.response has shape {tuple(lp.shape)} for "
                    f"{len(ids)} tokens (or non-finite values); use rollout_log_prob='recompute'"
                )
            above = (lp > LOG_PROB_TOLERANCE).nonzero()
            if above.numel():
                t = int(above[0])
                raise ValueError(
                    f"{_OWNER}: row {r}: log_probs.response[{t}] = {float(lp[t]):.6g} is positive (a "
                    f"log-probability is <= 0; tolerance {LOG_PROB_TOLERANCE:g}): the engine's "
                    "log-probs are not log-probabilities of the sampled tokens; use "
                    "rollout_log_prob='recompute' or 'drop'"
                )
            if len(lp) and float(lp[0]) == 0.0:
                raise ValueError(
                    f"{_OWNER}: row {r}: the first generated token's log-prob is exactly 0.0, "
                    "TorchRL 0.14.1 TransformersWrapper's defect (it overwrites it); use "
                    "rollout_log_prob='drop' (old log-probs are recomputed by the trainer anyway) or "
                    "'recompute'"
                )
        return [lp.tolist() for lp in lps]

    def _recompute(self, td: TensorDict) -> torch.Tensor:
        from ar_torchrl.modules import LMActorCritic
        from ar_torchrl.training.micro_batch import plan_micro_batches
        from ar_torchrl.training.old_log_probs import recompute_old_log_probs_and_values

        actor = LMActorCritic(self.model, critic=False, temperature=self.temperature)
        inputs = td.select("tokens", "attention_mask")
        plan = plan_micro_batches(inputs, token_budget=max(self.token_budget, td.batch_size[1]))
        recompute_old_log_probs_and_values(actor, inputs, plan)
        return torch.where(td["loss_mask"], inputs["sample_log_prob"], 0.0)


def _embedding_rows(model) -> int | None:
    get = getattr(model, "get_input_embeddings", None)
    weight = getattr(get(), "weight", None) if callable(get) else None
    return int(weight.shape[0]) if weight is not None else None


def _vocab_size(tokenizer, model, vocab_size) -> int:
    if vocab_size is None:
        vocab_size = _embedding_rows(model) if model is not None else None
    if vocab_size is None:
        vocab_size = len(tokenizer)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"{_OWNER}: vocab_size must be an int >= 1, got {vocab_size!r}")
    return vocab_size


def _check_vocabulary(ids: list[torch.Tensor], key: NestedKey, vocab_size: int) -> None:
    """Every id in ``[0, vocab_size)`` (an embedding lookup, on CUDA a device-side assert)."""
    for r, v in enumerate(ids):
        bad = ((v < 0) | (v >= vocab_size)).nonzero()
        if bad.numel():
            t = int(bad[0])
            raise ValueError(
                f"{_OWNER}: row {r}: {key!r}[{t}] = {int(v[t])} is outside the vocabulary "
                f"[0, {vocab_size}) (pass vocab_size= if the model has more embedding rows)"
            )


def _check_finite_rewards(rewards: list[float]) -> None:
    for r, value in enumerate(rewards):
        if not math.isfinite(value):
            raise ValueError(
                f"{_OWNER}: row {r}: the reward ('next', 'reward') is {value}, not finite; fix the "
                "reward transform (or drop the row before the converter)"
            )


def _pad_id(tokenizer) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if not isinstance(pad, int):
        raise ValueError(
            f"{_OWNER}: the tokenizer has no pad_token_id (got {pad!r}); set tokenizer.pad_token "
            "to a special token the model never samples"
        )
    return pad


def _get(rows: TensorDictBase, key: NestedKey, fix: str, **kwargs):
    value = rows.get(key, None, **kwargs)
    if value is None:
        keys = ", ".join(sorted(map(str, rows.keys(include_nested=True, leaves_only=True))))
        raise KeyError(f"{_OWNER}: the batch has no {key!r} (needs {fix}); it has {keys}")
    return value


def _id_list(rows, key, fix, dtype=int) -> list[torch.Tensor]:
    """One 1-D tensor per row (TorchRL stores ragged per-row tensors in a lazy stack)."""
    values = _get(rows, key, fix, as_list=True)
    out = []
    for r, v in enumerate(values):
        v = torch.as_tensor(v)
        floating = v.is_floating_point()
        if v.dim() != 1 or floating != (dtype is float):
            kind = "float log-probs" if dtype is float else "integer token ids"
            raise ValueError(
                f"{_OWNER}: row {r}: {key!r} must be 1-D {kind} (pad_output=False), got "
                f"{v.dtype} {tuple(v.shape)}"
            )
        out.append(v)
    return out


def _per_row(rows, key, fix, cast) -> list:
    value = torch.as_tensor(_get(rows, key, fix)).reshape(len(rows), -1)
    if value.shape[1] != 1:
        raise ValueError(
            f"{_OWNER}: {key!r} has {value.shape[1]} values per row (shape "
            f"{tuple(rows.get(key).shape)}); one per row is expected (a single-turn batch)"
        )
    return [cast(v) for v in value[:, 0].tolist()]


def _row_dim(data: TensorDictBase) -> int:
    """Steps per environment row: a ``[B, T]`` batch holds ``B`` rows of ``T`` time-ordered steps
    (a dialog never crosses rows); a 1-D batch is one time-ordered sequence."""
    return int(data.batch_size[-1])


def _flags(rows: TensorDictBase, key: NestedKey) -> torch.Tensor | None:
    value = rows.get(key, None)
    if value is None:
        return None
    return torch.as_tensor(value).reshape(len(rows), -1).bool().any(-1)


def _dialogs(rows: TensorDictBase, row_len: int) -> list[list[int]]:
    """The steps of each dialog, in order: consecutive steps up to a done step (and, with
    ``("collector", "traj_ids")``, of one trajectory). Without ``("next", "done")`` every step is a
    dialog of its own."""
    done = _flags(rows, ("next", "done"))
    traj = rows.get(("collector", "traj_ids"), None)
    traj = None if traj is None else torch.as_tensor(traj).reshape(len(rows), -1)[:, 0].tolist()
    dialogs: list[list[int]] = []
    current: list[int] = []
    for r in range(len(rows)):
        if current and traj is not None and traj[r] != traj[current[-1]]:
            _incomplete(current[-1], current)
        current.append(r)
        if done is None or bool(done[r]):
            dialogs.append(current)
            current = []
        elif (r + 1) % row_len == 0:
            _incomplete(r, current)
    return dialogs


def _incomplete(row: int, steps: list[int]) -> None:
    raise ValueError(
        f"{_OWNER}: row {row} is not done (('next', 'done') False) and is the last step of the "
        f"batch's dialog of rows {steps[:8]}: the batch ends inside a dialog, which cannot be "
        "trained without its end; collect whole dialogs (LLMCollector(..., "
        "yield_completed_trajectories=True)) or end every dialog after one turn "
        "(StepCounter(max_steps=1))"
    )


def _check_continues(
    row: int, turn: int, context: torch.Tensor, prompt: torch.Tensor, tokenizer
) -> None:
    """Turn ``turn``'s prompt starts with the dialog so far (prompt + turns + inserts) exactly."""
    n = len(context)
    if len(prompt) >= n and torch.equal(prompt[:n], context):
        return
    same = (prompt[:n] == context[: len(prompt)]).tolist()
    k = same.index(False) if False in same else min(n, len(prompt))
    sampled = tokenizer.decode(context[k : k + 12].tolist())
    rendered = tokenizer.decode(prompt[k : k + 12].tolist())
    raise ValueError(
        f"{_OWNER}: row {row} (turn {turn} of its dialog): its prompt does not continue the "
        f"dialog token for token: at position {k} the dialog has {sampled!r}, TorchRL's prompt "
        f"{rendered!r}. The chat template renders a sampled turn back to other tokens (TorchRL "
        "re-tokenizes the history), so the turn would be trained on tokens the policy did not "
        "sample; use a chat template that renders an assistant turn back to its sampled tokens "
        "(ar_torchrl.tools.template.check_prefix_stable checks one), or ToolEnv, which never "
        "re-tokenizes"
    )


def _policy_kind(policy) -> str:
    from torchrl.modules.llm import SGLangWrapper, vLLMWrapper

    if isinstance(policy, SGLangWrapper):
        return "sglang"
    if isinstance(policy, vLLMWrapper):
        return "vllm"
    return "transformers"


def _check_pad_banned(policy, gk: dict, pad: int, name: str) -> None:
    if [pad] not in [list(w) for w in gk.get("bad_words_ids") or []]:
        raise ValueError(
            f"{_OWNER}.from_policy: {name} can sample the pad id {pad}, and TorchRL 0.14.1 "
            "drops generated tokens equal to it (the sampled sequence is lost); ban it with "
            + _PAD_FIX.format(pad=pad)
            + " (TorchRL silently ignores suppress_tokens)"
        )


def _policy_versions(rows: TensorDictBase, allow_mixed: bool) -> torch.Tensor:
    """``[N]`` int64: each step's weight version (one per batch unless ``allow_mixed``)."""
    for key in (("next", "policy_version"), "policy_version"):
        value = rows.get(key, None)
        if value is None:
            continue
        if (
            not isinstance(value, torch.Tensor)
            or value.is_floating_point()
            or value.dtype == torch.bool
        ):
            got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"{_OWNER}: {key!r} must hold integers, got {got}; use "
                "PolicyVersion(version_type='int') (LLMCollector(track_policy_version=True) does)"
            )
        per_row = value.reshape(len(rows), -1)
        inside = (per_row != per_row[:, :1]).any(-1).nonzero()
        if inside.numel():
            r = int(inside[0])
            raise ValueError(
                f"{_OWNER}: row {r} has {key!r} {per_row[r].unique().tolist()}: one step is "
                "sampled under one weight version"
            )
        mixed = (per_row[:, 0] != per_row[0, 0]).nonzero()
        if mixed.numel() and not allow_mixed:
            r = int(mixed[0])
            raise ValueError(
                f"{_OWNER}: row {r} has {key!r} {per_row[r].unique().tolist()}, row 0 has "
                f"{int(per_row[0, 0])}: one batch holds one weight version (docs/design.md section "
                "1; the builder refuses mixed batches too); collect each batch under one version "
                "(a synchronous LLMCollector, increment_version() between batches), split it by "
                "version, or pass allow_mixed_versions=True (each turn keeps its own version)"
            )
        return per_row[:, 0].to(torch.int64)
    raise KeyError(
        f"{_OWNER}: the batch has no 'policy_version'; build the collector with "
        "LLMCollector(..., track_policy_version=True) and call collector.increment_version() "
        "after each update"
    )


class PolicyStateDict(dict):
    """``{hf_name: tensor}`` of the policy, without ``value_head.*``, that TorchRL's weight-sync
    helpers accept where they take a model.

    A ``dict`` (``WeightStrategy.extract_weights``, ``sender.update_weights(weights=...)``) that
    also answers ``state_dict()`` (``get_model_metadata``, ``sender.register_model``, which keeps
    only a weak reference: hold on to the object). Without ``dtype`` its tensors are detached views
    of the live parameters, so it follows in-place optimizer steps.
    """

    def state_dict(self) -> PolicyStateDict:
        return self


def policy_state_dict(model: nn.Module, *, dtype: torch.dtype | None = None) -> PolicyStateDict:
    """The tensors the inference engine loads (``named_policy_tensors``), as a :class:`PolicyStateDict`.

    Example:
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> from ar_torchrl.modules import attach_value_head
        >>> model = attach_value_head(build_tiny_qwen3(99))
        >>> sd = policy_state_dict(model)
        >>> "value_head.weight" in model.state_dict(), "value_head.weight" in sd
        (True, False)
        >>> sd.state_dict() is sd, len(sd) == len(model.state_dict()) - 2
        (True, True)
    """
    return PolicyStateDict(named_policy_tensors(model, dtype=dtype))
