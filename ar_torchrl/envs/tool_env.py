"""ToolEnv: multi-turn tool-use episodes as a TorchRL env, token-in/token-out, one step per turn.

A batch of ``N`` episodes (prompt-major, ``num_samples`` per prompt, as :class:`LLMEnv`). Each TorchRL
step is one **turn** of every episode still running: the engine continues each episode from its
exact token ids (the prompt, every earlier turn as sampled, every tool answer as the chat template's
delta tokens: nothing is decoded and re-tokenised), the turn's text is parsed for a tool call
(:class:`~ar_torchrl.tools.Toolbox`), the tool runs (bounded: a time limit, an output size limit) and
its answer is appended as observation tokens (not trained). An episode ends when the model answers
without a call (``terminated``), or is cut (``truncated``) by ``max_turns`` (it still called a tool on
its last turn), by ``max_total_tokens`` (the next turn or tool answer would not fit), or by the
per-turn token cap (a turn that did not finish). Finished episodes stop generating; the TorchRL
``done`` flags rise for the whole batch at the step where the last episode ends (rows keep their
own ending in ``terminated``/``truncated`` and their state in ``"episode_done"``).

Rewards: the outcome reward (the reward over the whole sample, :mod:`ar_torchrl.rewards`) when an
episode ends, plus an optional per-turn penalty for tool errors (malformed call, unknown tool, a
raising or timed-out tool, an oversized answer), each in the step of its turn. The token trajectory
(:func:`~ar_torchrl.data.trajectory.build_trajectory`) has ``turn_id`` (the turn on trained tokens,
-1 on prompt, tool and padding tokens) and puts each step's reward on its turn's last trained token,
the outcome on the episode's last trained token; tool tokens have ``loss_mask`` False.

KV cache: on an engine that keeps one (``backend.capabilities.episode_cache``, the trainside
engine) each episode keeps its key/value cache from turn to turn (an
:class:`~ar_torchrl.backends.EpisodeCache` per batch, from the reset to the last turn): a turn
forwards only what the context added since the last (the turn's last token and the tool's delta),
not the whole prefix again; episodes that ended are dropped from it. SGLang keeps its own (the
radix cache). ``kv_cache=False`` sends the whole context every turn.

Weight versions: a batch's episodes are generated under one version. A collector's weight sync
waits for the batch in flight (:class:`~ar_torchrl.collectors.WeightSyncCollector` holds its lock
while a batch is generated, also in async mode), and the builder refuses a batch that mixes versions.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Categorical, Composite, Unbounded

from ar_torchrl.backends.base import EpisodeCache, GenerationBackend, SamplingParams
from ar_torchrl.data.samples import Sample, Segment
from ar_torchrl.data.trajectory import build_trajectory
from ar_torchrl.envs.llm_env import LLMEnv
from ar_torchrl.rewards.math import dapo_math_reward

__all__ = ["ToolEnv"]

logger = logging.getLogger(__name__)


class ToolEnv(LLMEnv):
    """Multi-turn tool-use episodes (see the module docstring).

    Args:
        dataset, tokenizer, backend, reward_fn, num_samples, prompts_per_batch, seed, shuffle,
        non_finite_reward, reward_workers, reward_timeout_s, keep_rounds: as :class:`LLMEnv`.
        toolbox: the tools, the call parser and their limits (:class:`~ar_torchrl.tools.Toolbox`).
        sampling: sampling parameters of one turn (``max_new_tokens``: the per-turn token cap).
        max_turns: most model turns per episode.
        max_total_tokens: most tokens per episode (prompt, turns and tool answers).
        tool_error_penalty: added to the reward of a turn whose tool call failed (per error).
        template_check: compare each episode's ids with the chat template's rendering of the whole
            conversation when it ends (``"raise"`` / ``"warn"`` on a template that is not
            prefix-stable, ``"off"``).
        kv_cache: keep each episode's KV cache between turns on an engine that can (see the
            module docstring); the tokens are those of ``False`` (the log-probs equal to float
            rounding), which prefills each turn's whole context.

    Example:
        >>> from ar_torchrl.models import build_char_tokenizer, build_tiny_qwen3
        >>> from ar_torchrl.backends import TransformersBackend
        >>> from ar_torchrl.data.tasks import tool_arithmetic_rows
        >>> from ar_torchrl.tools import ToolConfig
        >>> from torchrl.envs.utils import check_env_specs
        >>> tok = build_char_tokenizer()
        >>> env = ToolEnv(tool_arithmetic_rows(8), tok, TransformersBackend(build_tiny_qwen3(len(tok))),
        ...               toolbox=ToolConfig().build(), num_samples=2,
        ...               prompts_per_batch=2, sampling=SamplingParams(max_new_tokens=8), max_turns=3)
        >>> check_env_specs(env)
        >>> td = env.collect()
        >>> td.batch_dims, int(td["turn_id"].max()) < 3
        (2, True)
    """

    def __init__(
        self,
        dataset: Sequence[dict],
        tokenizer,
        backend: GenerationBackend,
        *,
        toolbox: Any,
        reward_fn=dapo_math_reward,
        max_turns: int = 4,
        max_total_tokens: int = 512,
        tool_error_penalty: float = 0.0,
        template_check: Literal["raise", "warn", "off"] = "raise",
        kv_cache: bool = True,
        **kwargs: Any,
    ) -> None:
        if max_turns < 1 or max_total_tokens < 2:
            raise ValueError(
                f"ToolEnv: max_turns must be >= 1 and max_total_tokens >= 2, got {max_turns} and "
                f"{max_total_tokens}"
            )
        if template_check not in ("raise", "warn", "off"):
            raise ValueError(
                f"ToolEnv: template_check must be 'raise', 'warn' or 'off', got {template_check!r}"
            )
        self.toolbox = toolbox
        self.max_turns, self.max_total_tokens = int(max_turns), int(max_total_tokens)
        self.tool_error_penalty, self.template_check = float(tool_error_penalty), template_check
        self.kv_cache = bool(kv_cache) and backend.capabilities.episode_cache
        self._episode_cache: EpisodeCache | None = None
        super().__init__(dataset, tokenizer, backend, reward_fn=reward_fn, **kwargs)

    # ------------------------------------------------------------------ specs
    def _make_specs(self) -> None:
        super()._make_specs()
        n = self.batch_size[0]
        self.observation_spec = Composite(
            prompt_id=Unbounded(shape=(n,), dtype=torch.int64),
            sample_id=Unbounded(shape=(n,), dtype=torch.int64),
            turn=Unbounded(shape=(n,), dtype=torch.int64),
            episode_done=Categorical(2, shape=(n,), dtype=torch.bool),
            shape=(n,),
        )

    # ------------------------------------------------------------------ EnvBase
    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        out = super()._reset(tensordict, **kwargs)
        samples = []
        for index in out["prompt_id"].tolist():
            sample = Sample(
                [Segment(self.prompt_token_ids(index))],
                row=self.dataset[index],
                prompt_id=index,
                source=self._source(index),
            )
            sample.extra.update(turns=0, tool_calls=0, tool_errors=0, done=False, messages=[])
            samples.append(sample)
        out["sample_id"] = self._keep_samples(samples)
        self._episode_cache = EpisodeCache() if self.kv_cache else None
        out["turn"] = torch.zeros_like(out["prompt_id"])
        out["episode_done"] = torch.zeros(out.shape, dtype=torch.bool)
        return out

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        samples = self.samples(tensordict, key="sample_id")
        turn = int(tensordict["turn"].max()) if len(samples) else 0
        active = [b for b, s in enumerate(samples) if not s.extra["done"]]
        reward = torch.zeros(len(samples), dtype=torch.float32)
        ended = self._turn(samples, active, turn, reward)
        if self._episode_cache is not None:  # ended episodes need no cache
            self._episode_cache.drop(ended)
        if ended:
            self._scorer([samples[b] for b in ended])
            for b in ended:
                reward[b] += samples[b].reward
        all_done = all(s.extra["done"] for s in samples)
        if all_done:
            self._episode_cache = None
        stopped = torch.tensor([s.terminated for s in samples])
        done = torch.full((len(samples), 1), all_done)
        rewards = reward.unsqueeze(-1)
        self._check_finite(samples, rewards)
        return TensorDict(
            {
                "prompt_id": tensordict["prompt_id"].clone(),
                "sample_id": tensordict["sample_id"].clone(),
                "turn": torch.full_like(tensordict["turn"], turn + 1),
                "episode_done": torch.tensor([s.extra["done"] for s in samples]),
                "reward": rewards,
                "done": done,
                "terminated": done & stopped.unsqueeze(-1),
                "truncated": done & ~stopped.unsqueeze(-1),
            },
            batch_size=self.batch_size,
        )

    # ------------------------------------------------------------------ one turn
    def _turn(self, samples: list[Sample], active: list[int], turn: int, reward) -> list[int]:
        """Generate turn ``turn`` of the ``active`` episodes, run their tools; returns the rows
        that ended (their outcome is scored by the caller)."""
        ended = []
        by_budget: dict[int, list[int]] = {}
        for b in active:
            room = self.max_total_tokens - sum(len(x) for x in samples[b].segments)
            if room < 1:
                self._end(samples[b], "length")
                ended.append(b)
                continue
            by_budget.setdefault(min(self.sampling.max_new_tokens, room), []).append(b)
        for budget, rows in sorted(by_budget.items()):
            sampling = _with_max_new_tokens(self.sampling, budget)
            prompts = [[int(t) for s in samples[b].segments for t in s.token_ids] for b in rows]
            cached = {}
            if self._episode_cache is not None:  # continue each episode from its KV cache
                cached = {"episodes": self._episode_cache, "episode_ids": rows}
            completions = self.backend.generate(prompts, 1, sampling, **cached)
            for b, c in zip(rows, completions):
                if self._after_turn(samples[b], c, turn, reward, b):
                    ended.append(b)
        return ended

    def _after_turn(self, sample: Sample, completion, turn: int, reward, row: int) -> bool:
        """Append the turn, run its tool call; True when the episode ended."""
        bad = [t for t in completion.token_ids if not 0 <= t < len(self.tokenizer)]
        if bad:
            raise ValueError(
                f"ToolEnv: the completion of batch row {row} (prompt index {sample.prompt_id}, turn "
                f"{turn}) has token ids {bad[:5]} outside the tokenizer's vocabulary"
            )
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        if "checkable" not in sample.extra and not self._round_trips(completion, text):
            sample.extra["checkable"] = (len(sample.extra["messages"]), len(sample.segments))
        sample.segments.append(_TurnSegment(completion, turn))
        sample.extra["messages"].append({"role": "assistant", "content": text})
        sample.extra["turns"] = turn + 1
        sample.text = "\n".join(m["content"] for m in sample.extra["messages"])
        if completion.finish_reason != "stop":  # cut by the token cap: the turn did not end
            return self._end(sample, completion.finish_reason)
        handled = self.toolbox.handle(text)
        if handled.ended:  # an answer without a call: the episode is over
            return self._end(sample, "stop")
        sample.extra["tool_calls"] += len(handled.calls)
        errors = sum(not r.ok for r in handled.results)
        sample.extra["tool_errors"] += errors
        if errors and self.tool_error_penalty:
            penalty = self.tool_error_penalty * errors
            sample.turn_rewards[turn] = sample.turn_rewards.get(turn, 0.0) + penalty
            reward[row] += penalty
        if turn + 1 >= self.max_turns:  # it asked for a tool on its last turn
            return self._end(sample, "length")
        messages = handled.messages()
        # a turn that ended on a stop token other than EOS gets its end-of-turn token inserted
        # (untrained) before the tool message, as the template would render the conversation
        ids = completion.token_ids
        closed = len(ids) > 0 and ids[-1] == self.tokenizer.eos_token_id
        delta = self._tool_delta(messages, include_end_of_turn=not closed)
        used = sum(len(x) for x in sample.segments)
        if used + len(delta.ids) >= self.max_total_tokens:  # no room for the answer and a next turn
            return self._end(sample, "length")
        if delta.neutralised and "checkable" not in sample.extra:
            # special-token text in a tool answer stays text; the template's rendering would parse it
            sample.extra["checkable"] = (len(sample.extra["messages"]), len(sample.segments))
        sample.segments.append(Segment(delta.ids))
        sample.extra["messages"] += messages
        return False

    def _tool_delta(self, messages: list[dict], include_end_of_turn: bool = False):
        from ar_torchrl.tools.template import tool_delta

        return tool_delta(self.tokenizer, messages, include_end_of_turn=include_end_of_turn)

    def _end(self, sample: Sample, finish: str) -> bool:
        sample.finish_reason = finish
        sample.extra["done"] = True
        if self.template_check != "off" and sample.extra["messages"]:
            self._check_template(sample)
        return True

    def _check_template(self, sample: Sample) -> None:
        """The episode's ids against the template's rendering of its conversation, up to the first
        turn whose text cannot reproduce its tokens: a turn cut by the token cap (the template would
        close it), one that sampled a special token mid-turn (its text drops it), or a tool answer
        whose special-token text was kept as text (the rendering would parse it). Such turns are
        why the env never re-tokenizes; they say nothing about the template."""
        from ar_torchrl.tools.template import check_prefix_stable

        messages, segments = list(sample.extra["messages"]), list(sample.segments)
        if "checkable" in sample.extra:
            n_messages, n_segments = sample.extra["checkable"]
            messages, segments = messages[:n_messages], segments[:n_segments]
        if not messages:
            return
        ids = [int(t) for s in segments for t in s.token_ids]
        on_mismatch = "raise" if self.template_check == "raise" else "warn"
        check_prefix_stable(
            self.tokenizer, [*sample.row["prompt"], *messages], ids, on_mismatch=on_mismatch
        )

    def _round_trips(self, completion, text: str) -> bool:
        """Whether the turn's text, tokenized, gives back its sampled ids (then its end-of-turn
        token): not when the token cap cut it, nor when it sampled a special token mid-turn, nor
        when the sampler chose a non-canonical tokenization."""
        ids = list(completion.token_ids)
        if completion.finish_reason != "stop" or not ids or ids[-1] != self.tokenizer.eos_token_id:
            return False
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] == ids[:-1]

    # ------------------------------------------------------------------ episodes -> trajectory
    def episodes(self, steps: TensorDictBase) -> TensorDictBase:
        """A rollout ``[N, T]`` of whole episodes -> one row per episode ``[N]``: the last step,
        with ``("next", "reward")`` the episode's return; each step's (possibly transformed)
        reward becomes its turn's reward on the episode's sample (what the trajectory trains on)."""
        if steps.batch_dims == 1:
            steps = steps.unsqueeze(-1)
        samples = self.samples(steps[..., -1])
        rewards = steps["next", "reward"].squeeze(-1)  # [N, T]
        for b, sample in enumerate(samples):
            sample.turn_rewards = {t: float(rewards[b, t]) for t in range(sample.extra["turns"])}
        last = steps[..., -1].clone()
        last["next", "reward"] = rewards.sum(-1, keepdim=True)
        return last

    def to_token_trajectory(self, seq: TensorDictBase) -> TensorDict:
        """Episodes ``[N]`` (any rows) -> the ``[N, L]`` token trajectory: the turns' rewards on
        their last trained tokens (the outcome within the last turn's)."""
        samples = self.samples(seq)
        return build_trajectory(
            samples,
            pad_token_id=self.tokenizer.pad_token_id,
            rewards=[0.0] * len(samples),
            allow_mixed_versions=self.backend.partial_rollouts,
        )

    def collect(self) -> TensorDict:
        """One batch of whole episodes as a token trajectory."""
        seq = self.episodes(self.rollout(self.max_turns))
        return self.to_token_trajectory(self.drop_non_finite(seq))


class _TurnSegment:
    """A completion as a trained segment of turn ``turn`` (the backend's object is not changed)."""

    trained = True

    def __init__(self, completion, turn: int) -> None:
        self.token_ids, self.log_probs = completion.token_ids, completion.log_probs
        self.policy_version, self.turn = completion.policy_version, turn
        self.token_versions = completion.token_versions  # partial rollouts: per token
        self.finish_reason = completion.finish_reason

    def __len__(self) -> int:
        return len(self.token_ids)


def _with_max_new_tokens(sampling: SamplingParams, max_new_tokens: int) -> SamplingParams:
    import dataclasses

    if sampling.max_new_tokens == max_new_tokens:
        return sampling
    return dataclasses.replace(sampling, max_new_tokens=max_new_tokens)
