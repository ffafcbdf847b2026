"""Trainside rollout backend: batched KV-cache sampling from an in-process HF causal LM.

The sampling loop is our own (not ``model.generate``) so that every detail the PPO data relies on is
explicit:

- prompts are left-padded; position ids are ``cumsum(attention_mask) - 1``, so padding never shifts
  positions (docs/design.md section 1);
- completions are tracked by *length*, not by pad id: a sampled token equal to the pad id (or a
  tokenizer with ``pad == eos``) is never mistaken for padding;
- the EOS/stop token that ends a completion is kept in it, with its log-prob;
- the log-prob of every sampled token (the first included) is, by default, the project's
  convention ``log softmax(logits / T)`` of the unfiltered distribution (what SGLang reports and
  the trainer recomputes), also under top-k/top-p; ``logprob_mode="processed"`` reports the
  filtered, renormalised sampling distribution instead (:func:`next_token_log_probs`);
- decoding writes a preallocated KV cache in place and drops finished rows from the batch
  (:mod:`ar_torchrl.backends.transformers.kv_cache`); the LM head runs on the last position only;
- with partial rollouts a waiting weight sync stops decoding after the current token; the
  unfinished rows come back with ``finish_reason="abort"`` and continue under the new weights
  (:class:`~ar_torchrl.backends.GenerationBackend`).
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache

from ar_torchrl.backends.base import (
    BackendCapabilities,
    Completion,
    EpisodeCache,
    GenerationBackend,
    SamplingParams,
)
from ar_torchrl.backends.transformers.kv_cache import (
    KeptState,
    decode_cache,
    keeps_episodes,
    kept_states,
    load_kept,
)
from ar_torchrl.backends.transformers.token_sampling import (
    LogProbMode,
    next_token_log_probs,
    sample_next_token,
)
from ar_torchrl.utils.checks import check_max_batch_size
from ar_torchrl.weight_sync.registry import make_sender

__all__ = ["DEVICE_SYNC_EVERY", "LogProbMode", "TransformersBackend", "next_token_log_probs"]

logger = logging.getLogger(__name__)

#: tokens between two host reads of the decode loop on an accelerator (``sync_every=None``)
DEVICE_SYNC_EVERY = 16


class TransformersBackend(GenerationBackend):
    """Rollouts from an HF causal LM in the trainer's process ("trainside").

    Args:
        model: the trainer's HF causal LM (a value head, if attached, is ignored).
        mode: the sync method: ``"copy"`` keeps a private deep copy (``sync_weights`` copies
            tensors in); ``"share"`` samples from ``model`` itself (``sync_weights`` only checks
            names and records the version).
        eos_token_id: id(s) that end a completion; default: ``model.generation_config.eos_token_id``.
        pad_token_id: id written in the (never returned) padding; default: the model config's pad id,
            else 0. Padding is tracked with masks, never by comparing ids.
        max_batch_size: most sequences per forward (``None``: all at once).
        logprob_mode: ``"temperature"`` (default, the project's convention) reports
            ``log_softmax(logits / T)`` before top-k/top-p filtering (what SGLang returns and what
            the trainer recomputes); ``"processed"`` reports ``log p`` under the exact distribution
            the token was drawn from (filtered and renormalised). They agree when top-k/top-p are off.
        seed: seed of the backend's own generator (used when ``SamplingParams.seed`` is None).
        sync_every: tokens between two reads of the decode loop's state by the host (whether every
            row stopped, whether to drop the finished ones). ``1`` reads every token (today's
            random stream); ``> 1`` keeps the device busy between reads (the stop condition is
            checked on the device, finished rows compute padding until the next read) and draws
            each step's noise for the whole chunk so the tokens do not depend on the interval.
            ``None``: 1 on a CPU, :data:`DEVICE_SYNC_EVERY` on an accelerator.

    Example:
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> backend = TransformersBackend(build_tiny_qwen3(99), seed=0)
        >>> out = backend.generate([[5, 6, 7], [8]], n=2, sampling=SamplingParams(max_new_tokens=4))
        >>> len(out), [c.prompt_index for c in out], all(len(c) <= 4 for c in out)
        (4, [0, 0, 1, 1], True)
    """

    capabilities = BackendCapabilities(
        partial_rollouts=True, sampler_state=True, episode_cache=True
    )

    def __init__(
        self,
        model: nn.Module,
        *,
        mode: Literal["copy", "share"] = "copy",
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        max_batch_size: int | None = None,
        logprob_mode: LogProbMode = "temperature",
        seed: int = 0,
        sync_every: int | None = None,
    ) -> None:
        if mode not in ("copy", "share"):
            raise ValueError(f"TransformersBackend: mode must be 'copy' or 'share', got {mode!r}")
        if logprob_mode not in ("temperature", "processed"):
            raise ValueError(
                f"TransformersBackend: logprob_mode must be 'temperature' or 'processed', "
                f"got {logprob_mode!r}"
            )
        check_max_batch_size("TransformersBackend", max_batch_size)
        if sync_every is not None and (isinstance(sync_every, bool) or int(sync_every) < 1):
            raise ValueError(
                f"TransformersBackend: sync_every must be an int >= 1 (tokens between host reads) "
                f"or None (1 on a CPU), got {sync_every!r}"
            )
        self.sync_every = None if sync_every is None else int(sync_every)
        self._episode_layers: bool | None = None
        self.mode = mode
        self.model = model if mode == "share" else _rollout_copy(model)
        super().__init__(make_sender(mode, self.model, engine="trainside"))
        self.eos_token_ids = _resolve_eos(self.model, eos_token_id)
        pad = (
            pad_token_id
            if pad_token_id is not None
            else getattr(model.config, "pad_token_id", None)
        )
        self.pad_token_id = int(pad) if pad is not None else 0
        self.max_batch_size = max_batch_size
        self.logprob_mode = logprob_mode
        self._generator = torch.Generator(device=self._device()).manual_seed(seed)
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_args else "past_key_values"
        self._last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in forward_args else {}

    # ------------------------------------------------------------------ interface
    @property
    def shares_trainer_weights(self) -> bool:
        """``mode="share"``: the rollout model is the trainer's module."""
        return self.mode == "share"

    @property
    def context_length(self) -> int | None:
        """``config.max_position_embeddings`` of the model (``None`` when it has none)."""
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def weight_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams
    ) -> list[Completion]:
        flat = [p for p in prompts for _ in range(n)]
        index = [i for i in range(len(prompts)) for _ in range(n)]
        generator = self._generator_for(sampling)
        step = self.max_batch_size or len(flat)
        starts = range(0, len(flat), step)
        out: list[Completion] = []
        for s in tqdm(starts, desc="generate", disable=len(starts) <= 1, leave=False):
            if self.interrupted:  # partial rollouts: the chunks left continue after the sync
                out.extend(Completion(i, [], [], "abort") for i in index[s : s + step])
                continue
            out.extend(
                self._generate_chunk(flat[s : s + step], index[s : s + step], sampling, generator)
            )
        return out

    def _generate_episodes(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        episodes: EpisodeCache,
        episode_ids: list[int],
    ) -> list[Completion]:
        """Continue each episode from its kept key/value states (:mod:`.kv_cache`); a model with
        layers other than full attention (sliding windows) keeps nothing and prefills whole."""
        if not self._keeps_episodes():
            return self._generate(prompts, 1, sampling)
        generator = self._generator_for(sampling)
        step = self.max_batch_size or len(prompts)
        out: list[Completion] = []
        for s in range(0, len(prompts), step):
            chunk = prompts[s : s + step]
            kept = _Kept(episodes, episode_ids[s : s + step])
            index = list(range(s, s + len(chunk)))
            out.extend(self._generate_chunk(chunk, index, sampling, generator, kept))
        return out

    def _keeps_episodes(self) -> bool:
        if self._episode_layers is None:
            self._episode_layers = keeps_episodes(decode_cache(self.model.config, 1))
            if not self._episode_layers:
                logger.info(
                    "TransformersBackend: the model has cache layers other than full attention; "
                    "multi-turn episodes prefill their whole context every turn"
                )
        return self._episode_layers

    def _sync_interval(self) -> int:
        """Tokens between two host reads of the decode loop (``sync_every``; default: 1 on a
        CPU, where the read costs nothing, else :data:`DEVICE_SYNC_EVERY`)."""
        if self.sync_every is not None:
            return self.sync_every
        return 1 if self._device().type == "cpu" else DEVICE_SYNC_EVERY

    def _generator_for(self, sampling: SamplingParams) -> torch.Generator:
        """Per-call seeded generator, or the backend's stream; on the model's device."""
        device = self._device()
        if sampling.seed is not None:
            return torch.Generator(device=device).manual_seed(sampling.seed)
        if self._generator.device != device:  # the model moved: continue the stream there
            seed = int(torch.randint(2**62, (1,), generator=self._generator))
            self._generator = torch.Generator(device=device).manual_seed(seed)
        return self._generator

    def state_dict(self) -> dict:
        """The sampler's RNG state (for resume; weights and version come back through a sync)."""
        return {"generator": self._generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self._generator.set_state(state["generator"])

    # ------------------------------------------------------------------ internals
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forward(self, ids, mask, positions, cache, dense_mask: bool = False) -> torch.Tensor:
        """``[B, q]`` ids -> next-token logits ``[B, V]`` (the LM head runs on the last position only).

        ``dense_mask``: under SDPA attention, pass the ``[B, 1, q, kv]`` boolean mask built here
        (Hugging Face reads a 2-D mask on the host to decide whether it may skip it: a sync)."""
        if dense_mask and getattr(self.model.config, "_attn_implementation", None) == "sdpa":
            mask = _dense_causal_mask(mask, ids.shape[1])
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_kwarg: cache},
            **self._last_logits_only,
        )
        return out.logits[:, -1]

    def _left_pad(self, prompts: list[list[int]], room: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ids ``[B, W]`` and a long mask ``[B, W + room]`` (zeros after ``W``)."""
        width = max(len(p) for p in prompts)
        pad = [self.pad_token_id]
        ids = torch.tensor([pad * (width - len(p)) + p for p in prompts], dtype=torch.long)
        lengths = torch.tensor([len(p) for p in prompts])
        columns = torch.arange(width + room)
        mask = ((columns >= width - lengths[:, None]) & (columns < width)).long()
        device = self._device()
        return ids.to(device), mask.to(device)

    @torch.no_grad()
    def _generate_chunk(
        self, prompts, index, sampling: SamplingParams, generator, kept: _Kept | None = None
    ) -> list[Completion]:
        """Prefill, then one token per step for the rows still generating.

        Rows are left-padded; each row's positions count its real tokens only. The KV cache is
        preallocated (:func:`decode_cache`); with ``kept`` (multi-turn episodes) it starts with
        what each episode kept of its context, and only the rest is prefilled. Once a quarter of
        the batch has finished, the finished rows are dropped from the batch (cache, mask,
        positions), so later steps compute only the rows that still generate. ``rows`` maps the
        shrinking batch to the output rows. The stop condition is checked on the device; the host
        reads it every :meth:`_sync_interval` tokens (on a CPU every token, as before).
        """
        max_new = sampling.max_new_tokens
        ids, mask, cache = self._prefill_inputs(prompts, max_new, kept)
        (bsz, _), device = ids.shape, ids.device
        width = mask.shape[1] - max_new  # the kept prefix and the prefilled block
        stop_ids = torch.tensor(
            sorted(set(self.eos_token_ids) | set(sampling.stop_token_ids)), device=device
        )
        tokens = torch.zeros((bsz, max_new), dtype=torch.long, device=device)
        log_probs = torch.zeros((bsz, max_new), dtype=torch.float32, device=device)
        lengths = torch.zeros(bsz, dtype=torch.long, device=device)
        stopped = torch.zeros(bsz, dtype=torch.bool, device=device)
        aborted = torch.zeros(bsz, dtype=torch.bool, device=device)
        rows, alive = (
            torch.arange(bsz, device=device),
            torch.ones(bsz, dtype=torch.bool, device=device),
        )
        every = self._sync_interval()
        positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)[:, width - ids.shape[1] :]
        logits = self._forward(ids, mask[:, :width], positions, cache, every > 1)
        positions = positions[:, -1:] + 1
        for t in range(max_new):
            tok, lp = sample_next_token(
                logits, sampling, generator, self.logprob_mode, *((rows, bsz) if every > 1 else ())
            )
            tokens[rows, t], log_probs[rows, t] = tok, lp  # read up to `lengths` only
            lengths[rows] += alive.long()
            ended = alive & torch.isin(tok, stop_ids)
            stopped[rows] |= ended
            alive &= ~ended
            if t == max_new - 1:
                break
            if self.interrupted:  # partial rollouts: a sync waits; the rest continues after it
                aborted[rows] |= alive
                break
            if every == 1 or (t + 1) % every == 0:
                running = int(alive.sum())  # the host reads the batch (once per `every` tokens)
                if running == 0:
                    break
                if 4 * (len(rows) - running) >= len(rows):  # drop the finished rows
                    if kept is not None:
                        done = (~alive).nonzero().squeeze(-1).tolist()
                        self._keep(kept, cache, mask, rows, done, prompts, tokens, lengths)
                    keep = alive.nonzero().squeeze(-1)
                    cache.batch_select_indices(keep)
                    rows, alive, tok, mask, positions = (
                        x[keep] for x in (rows, alive, tok, mask, positions)
                    )
            mask[:, width + t] = alive.long()
            step_ids = torch.where(alive, tok, self.pad_token_id).unsqueeze(-1)
            logits = self._forward(step_ids, mask[:, : width + t + 1], positions, cache, every > 1)
            positions += 1
        if kept is not None:
            self._keep(kept, cache, mask, rows, list(range(len(rows))), prompts, tokens, lengths)
        return _to_completions(tokens, log_probs, lengths, stopped, index, aborted)

    def _prefill_inputs(
        self, prompts: list[list[int]], max_new: int, kept: _Kept | None
    ) -> tuple[torch.Tensor, torch.Tensor, DynamicCache]:
        """The first forward's ids ``[B, q]`` (left-padded), the mask ``[B, W0 + q + max_new]``
        and the cache. Without ``kept``, ``W0 = 0`` and every prompt is prefilled whole; with it,
        the leading ``W0`` positions hold each episode's kept states (left-padded) and ``ids``
        the last ``q`` tokens of every context, ``q`` the most any context added since its kept
        state (a row that added fewer forwards a few kept tokens again instead of padding)."""
        used = [0] * len(prompts)
        states: list[KeptState | None] = [None] * len(prompts)
        if kept is not None:  # each state moves into the new cache (it is stored again after)
            for i, (context, key) in enumerate(zip(prompts, kept.ids)):
                states[i] = kept.cache.states.pop(key, None)
                used[i] = states[i].reusable(context) if states[i] is not None else 0
            # Every row forwards the same number of tokens, the last `q` of its context: a row
            # whose kept state covers more loads it only up to there and forwards the rest again,
            # where it would otherwise forward padding (the same compute), so that the row's
            # cached positions stay contiguous and the next turn keeps views, not copies.
            q = max(len(p) - u for p, u in zip(prompts, used))
            used = [max(len(p) - q, 0) if u else 0 for p, u in zip(prompts, used)]
            states = [s if u else None for s, u in zip(states, used)]
            kept.cache.reused_tokens += sum(used)
            kept.cache.prefilled_tokens += sum(len(p) for p in prompts) - sum(used)
        ids, mask = self._left_pad([p[u:] for p, u in zip(prompts, used)], room=max_new)
        cache = decode_cache(self.model.config, max(used) + mask.shape[1])
        if max(used):
            mask = torch.cat([load_kept(cache, states, used), mask], dim=1)
        return ids, mask, cache

    def _keep(self, kept: _Kept, cache, mask, rows, local: list[int], prompts, tokens, lengths):
        """Store, for the batch rows ``local`` whose turn is over, what the next turn reuses."""
        if not local:
            return
        out_rows, counts = rows.tolist(), lengths.tolist()
        sampled = tokens[rows[local]].tolist()
        for j, (i, layers) in enumerate(zip(local, kept_states(cache, local, mask))):
            r = out_rows[i]
            ids = prompts[r] + sampled[j][: counts[r] - 1]  # the last one never ran
            if layers[0][0].shape[1] != len(ids):
                raise RuntimeError(
                    f"TransformersBackend: row {r} keeps {layers[0][0].shape[1]} cached positions "
                    f"for {len(ids)} tokens; the episode cache is inconsistent"
                )
            kept.cache.states[kept.ids[r]] = KeptState(ids, layers)


@dataclass
class _Kept:
    """A chunk's episode cache and the episode id of each of its rows."""

    cache: EpisodeCache
    ids: list[int]


def _rollout_copy(model: nn.Module) -> nn.Module:
    """A private, frozen, eval-mode copy of the policy (a train-only value head is dropped)."""
    rollout = copy.deepcopy(model).eval().requires_grad_(False)
    if isinstance(getattr(rollout, "value_head", None), nn.Module):
        del rollout.value_head
    return rollout


def _resolve_eos(model: nn.Module, eos_token_id) -> tuple[int, ...]:
    if eos_token_id is None:
        gen_config = getattr(model, "generation_config", None)
        eos_token_id = getattr(gen_config, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
    if eos_token_id is None:
        raise ValueError(
            "TransformersBackend: the model config has no eos_token_id; pass `eos_token_id=`"
        )
    if isinstance(eos_token_id, int):
        return (eos_token_id,)
    return tuple(int(e) for e in eos_token_id)


def _dense_causal_mask(mask: torch.Tensor, q: int) -> torch.Tensor:
    """``[B, kv]`` padding mask -> ``[B, 1, q, kv]`` boolean causal mask of the last ``q`` queries.

    A query row with no key to attend (a padding query of a left-padded prompt) attends to all
    of them instead, as Hugging Face's SDPA mask does: its output is never read, and a row of
    ``-inf`` would give NaN keys/values that leak through ``0 * NaN``."""
    kv = mask.shape[-1]
    causal = torch.ones(q, kv, dtype=torch.bool, device=mask.device).tril(diagonal=kv - q)
    dense = mask.bool()[:, None, None, :] & causal
    return dense | ~dense.any(-1, keepdim=True)


def _to_completions(tokens, log_probs, lengths, stopped, index, aborted=None) -> list[Completion]:
    """Completions of a decoded chunk; ``aborted`` rows (a sync interrupted them) say "abort"."""
    if aborted is None:
        aborted = torch.zeros_like(stopped)
    tokens, log_probs, lengths, stopped, aborted = (
        x.tolist() for x in (tokens, log_probs, lengths, stopped, aborted)
    )
    return [
        Completion(
            prompt_index=index[i],
            token_ids=tokens[i][: lengths[i]],
            log_probs=log_probs[i][: lengths[i]],
            finish_reason="stop" if stopped[i] else "abort" if aborted[i] else "length",
        )
        for i in range(len(index))
    ]
