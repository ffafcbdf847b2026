"""LLMEnv: a TorchRL environment whose rollouts are token trajectories.

Design (two time scales):

- **As a TorchRL env** the task is a one-step episode at the *sequence* level, with batch size
  ``[N]`` (``N = prompts_per_batch * num_samples``, prompt-major: rows ``i*n .. i*n+n-1`` share a
  prompt). ``_reset`` draws the next prompts from the dataset (a seeded, resumable epoch sampler),
  applies the chat template and writes them left-padded to ``max_prompt_tokens``; the *action* is a
  whole response (``"response_tokens"`` right-padded to ``max_new_tokens`` with its length, log-probs,
  stop flag and weight version); ``_step`` decodes it, scores it with ``reward_fn`` (+ optional DAPO
  overlong penalty) and ends the episode. Specs are fixed-width, so ``check_env_specs`` holds and any
  TorchRL policy writing these action keys can drive the env.
- **``rollout()``** (the default policy is :meth:`LLMEnv.generate`, which calls the backend) returns
  the ``[N, L]`` *token-time* trajectory of docs/design.md section 1, built by
  :func:`~ar_torchrl.data.collate.completions_to_trajectory` with ``L`` the batch's own width (no
  fixed-width padding reaches the trainer). ``rollout(token_trajectory=False)`` is TorchRL's plain
  sequence-level rollout; a collector that samples several rounds gathers those steps and calls
  :meth:`LLMEnv.to_token_trajectory` once (:mod:`ar_torchrl.envs.layout`).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.envs import EnvBase

from ar_torchrl.backends.base import GenerationBackend, SamplingParams
from ar_torchrl.data.prompts import prompt_token_ids
from ar_torchrl.envs.layout import completions_to_actions, sequence_specs, sequences_to_trajectory
from ar_torchrl.envs.sampler import EpochSampler
from ar_torchrl.rewards.math import dapo_math_reward, overlong_penalty

__all__ = ["LLMEnv", "NonFiniteRewardPolicy"]

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]
NonFiniteRewardPolicy = Literal["raise", "drop"]


def _check_tokenizer(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "LLMEnv: the tokenizer has no chat template (tokenizer.chat_template is None); set one, "
            "e.g. tokenizer.chat_template = ar_torchrl.models.tiny.CHATML_TEMPLATE"
        )
    if tokenizer.pad_token_id is None:
        raise ValueError("LLMEnv: the tokenizer has no pad_token_id; set tokenizer.pad_token")


class LLMEnv(EnvBase):
    """Prompts in, scored token trajectories out (see the module docstring for the design).

    Args:
        dataset: DAPO-schema rows (e.g. :class:`~ar_torchrl.data.datasets.MathDataset`).
        tokenizer: HF tokenizer with a chat template and a pad token.
        backend: the rollout engine.
        reward_fn: ``(response_text, ground_truth) -> float``; default DAPO's math reward.
        num_samples: completions per prompt (the GRPO group size).
        prompts_per_batch: prompts per reset.
        sampling: sampling parameters (``max_new_tokens`` fixes the action width).
        max_prompt_tokens: observation width; default: the longest templated prompt of the dataset.
            A longer prompt is an error (never truncated).
        overlong_buffer_len: if set, add DAPO's :func:`~ar_torchrl.rewards.overlong_penalty` with
            ``max_len = sampling.max_new_tokens``.
        overlong_penalty_factor: penalty at the length cap.
        seed: prompt-order seed.
        shuffle: shuffle prompts each epoch.
        non_finite_reward: a NaN/inf reward from ``reward_fn`` (+ penalty) is an error naming the
            row, the prompt and the value (``"raise"``), or the row is dropped from the token
            trajectory and counted in ``non_finite_rewards_dropped`` (``"drop"``).

    The weight version of the rows is the one the backend stamped on the completions (the backend
    owns it); the env only reads it.

    Example:
        >>> from ar_torchrl.models.tiny import build_char_tokenizer, build_tiny_qwen3
        >>> from ar_torchrl.backends import TransformersBackend
        >>> from ar_torchrl.data.datasets import arithmetic_dataset
        >>> tok = build_char_tokenizer()
        >>> env = LLMEnv(arithmetic_dataset(8), tok, TransformersBackend(build_tiny_qwen3(len(tok))),
        ...              num_samples=2, prompts_per_batch=2, sampling=SamplingParams(max_new_tokens=4))
        >>> td = env.rollout()
        >>> td.batch_dims, td.shape[0], int(td["loss_mask"].sum(-1).max()) <= 4
        (2, 4, True)
    """

    def __init__(
        self,
        dataset: Sequence[dict],
        tokenizer,
        backend: GenerationBackend,
        *,
        reward_fn: RewardFn = dapo_math_reward,
        num_samples: int = 4,
        prompts_per_batch: int = 8,
        sampling: SamplingParams | None = None,
        max_prompt_tokens: int | None = None,
        overlong_buffer_len: int | None = None,
        overlong_penalty_factor: float = 1.0,
        seed: int = 0,
        shuffle: bool = True,
        non_finite_reward: NonFiniteRewardPolicy = "raise",
    ) -> None:
        _check_tokenizer(tokenizer)
        if non_finite_reward not in ("raise", "drop"):
            raise ValueError(
                f"LLMEnv: non_finite_reward must be 'raise' or 'drop', got {non_finite_reward!r}"
            )
        if num_samples < 1 or prompts_per_batch < 1:
            raise ValueError(
                f"LLMEnv: num_samples and prompts_per_batch must be >= 1, got {num_samples} and "
                f"{prompts_per_batch}"
            )
        if len(dataset) == 0:
            raise ValueError("LLMEnv: the dataset is empty")
        super().__init__(batch_size=torch.Size([prompts_per_batch * num_samples]))
        self.dataset, self.tokenizer, self.backend = dataset, tokenizer, backend
        self.reward_fn, self.num_samples = reward_fn, num_samples
        self.prompts_per_batch, self.sampling = prompts_per_batch, sampling or SamplingParams()
        self.overlong_buffer_len, self.overlong_penalty_factor = (
            overlong_buffer_len,
            overlong_penalty_factor,
        )
        self.non_finite_reward, self.non_finite_rewards_dropped = non_finite_reward, 0
        self.sampler = EpochSampler(len(dataset), seed=seed, shuffle=shuffle)
        self._prompt_cache: dict[int, list[int]] = {}
        self.max_prompt_tokens = max_prompt_tokens or max(
            len(self.prompt_token_ids(i)) for i in range(len(dataset))
        )
        self._make_specs()

    # ------------------------------------------------------------------ prompts
    def prompt_token_ids(self, index: int) -> list[int]:
        """Chat-templated token ids of dataset row ``index`` (with the generation prompt)."""
        if index not in self._prompt_cache:
            ids = prompt_token_ids(self.dataset[index]["prompt"], self.tokenizer)
            self._prompt_cache[index] = ids
        return self._prompt_cache[index]

    def _make_specs(self) -> None:
        specs = sequence_specs(
            self.batch_size[0],
            self.max_prompt_tokens,
            len(self.tokenizer),
            self.sampling.max_new_tokens,
        )
        for name, spec in specs.items():
            setattr(self, name, spec)

    # ------------------------------------------------------------------ EnvBase
    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        reset = None if tensordict is None else tensordict.get("_reset", None)
        if reset is not None and not bool(reset.all()):
            raise RuntimeError(
                "LLMEnv: partial reset requested; all rows of a batch end together, reset them all"
            )
        indices = self.sampler.draw(self.prompts_per_batch)
        prompts = [self.prompt_token_ids(i) for i in indices]
        too_long = [
            (i, len(p)) for i, p in zip(indices, prompts) if len(p) > self.max_prompt_tokens
        ]
        if too_long:
            raise ValueError(
                f"LLMEnv: prompts (row, tokens) {too_long[:5]} exceed max_prompt_tokens="
                f"{self.max_prompt_tokens}; raise max_prompt_tokens (prompts are never truncated)"
            )
        n, width = self.batch_size[0], self.max_prompt_tokens
        tokens = torch.full((n, width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.bool)
        for row in range(n):
            p = prompts[row // self.num_samples]
            tokens[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = True
        prompt_id = torch.tensor(indices).repeat_interleave(self.num_samples)
        out = TensorDict(
            {"prompt_tokens": tokens, "prompt_mask": mask, "prompt_id": prompt_id},
            batch_size=self.batch_size,
        )
        return out.update(self.full_done_spec.zero())

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        tokens, lengths = tensordict["response_tokens"], tensordict["response_length"]
        stopped = tensordict["response_stopped"].reshape(-1)
        prompt_ids = tensordict["prompt_id"].tolist()
        rewards = [
            self.score(tokens[b, : int(lengths[b])].tolist(), prompt_ids[b], row=b)
            for b in range(tokens.shape[0])
        ]
        done = torch.ones((tokens.shape[0], 1), dtype=torch.bool)
        return TensorDict(
            {
                # the next observation is the same prompt: the episode ends here
                "prompt_tokens": tensordict["prompt_tokens"].clone(),
                "prompt_mask": tensordict["prompt_mask"].clone(),
                "prompt_id": tensordict["prompt_id"].clone(),
                "reward": torch.tensor(rewards, dtype=torch.float32).unsqueeze(-1),
                "done": done,
                "terminated": stopped.unsqueeze(-1).clone(),
                "truncated": ~stopped.unsqueeze(-1),
            },
            batch_size=self.batch_size,
        )

    def _set_seed(self, seed: int | None) -> None:
        self.sampler = EpochSampler(len(self.dataset), seed=seed or 0, shuffle=self.sampler.shuffle)

    # ------------------------------------------------------------------ reward / generation
    def score(self, response_ids: list[int], index: int, row: int | None = None) -> float:
        """Reward of a response to dataset row ``index`` (task reward + optional overlong penalty).

        Raises:
            ValueError: a NaN/inf reward with ``non_finite_reward="raise"`` (naming the batch
                ``row``, the prompt ``index`` and the value).
        """
        text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
        value = self.reward_fn(text, self.dataset[index]["reward_model"]["ground_truth"])
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            name = getattr(self.reward_fn, "name", None) or getattr(
                self.reward_fn, "__qualname__", type(self.reward_fn).__name__
            )
            raise TypeError(
                f"LLMEnv: the reward function {name} returned {value!r} "
                f"({type(value).__name__}) for batch row {row} (prompt index {index}, response "
                f"{text[:80]!r}); a reward must be a real number (int or float; not a bool, a "
                "string, a list or None)"
            )
        reward = float(value)
        if self.overlong_buffer_len is not None:
            reward += overlong_penalty(
                len(response_ids),
                self.sampling.max_new_tokens,
                self.overlong_buffer_len,
                self.overlong_penalty_factor,
            )
        if not math.isfinite(reward) and self.non_finite_reward == "raise":
            raise ValueError(
                f"LLMEnv: reward_fn returned {reward} for batch row {row} (prompt index {index}, "
                f"response {text[:80]!r}); rewards must be finite: fix the reward function, or pass "
                "non_finite_reward='drop' to drop such rows (they are counted)"
            )
        return reward

    def _prompts_of(self, tensordict: TensorDictBase) -> list[list[int]]:
        """Unique prompts of a reset tensordict (one per group of ``num_samples`` rows)."""
        rows = range(0, tensordict.shape[0], self.num_samples)
        return [tensordict["prompt_tokens"][r][tensordict["prompt_mask"][r]].tolist() for r in rows]

    def generate(self, tensordict: TensorDictBase) -> TensorDictBase:
        """The default policy: sample responses with the backend and write the action keys.

        ``policy_version`` is the weight version the backend stamped on the completions.
        """
        prompts = self._prompts_of(tensordict)
        completions = self.backend.generate(prompts, self.num_samples, self.sampling)
        if len(completions) != tensordict.shape[0]:
            raise RuntimeError(
                f"LLMEnv: the backend returned {len(completions)} completions, expected "
                f"{tensordict.shape[0]} ({len(prompts)} prompts x {self.num_samples})"
            )
        actions = completions_to_actions(
            completions,
            max_new_tokens=self.sampling.max_new_tokens,
            vocab=len(self.tokenizer),
            pad_token_id=self.tokenizer.pad_token_id,
            prompt_ids=tensordict["prompt_id"].tolist(),
        )
        return tensordict.update(actions)

    def rollout(
        self, max_steps: int = 1, policy=None, *args, token_trajectory: bool = True, **kwargs
    ):
        """Roll out one batch.

        Args:
            max_steps: episodes last one (sequence-level) step; the token trajectory needs ``1``.
            policy: defaults to :meth:`generate` (the backend).
            token_trajectory: return the ``[N, L]`` token trajectory (default; rows with a
                non-finite reward dropped under ``non_finite_reward="drop"``) instead of TorchRL's
                ``[N, max_steps]`` sequence-level rollout.
            *args: forwarded to :meth:`torchrl.envs.EnvBase.rollout`.
            **kwargs: forwarded to :meth:`torchrl.envs.EnvBase.rollout`.
        """
        policy = self.generate if policy is None else policy
        if not token_trajectory:
            return super().rollout(max_steps, policy, *args, **kwargs)
        if max_steps != 1:
            raise ValueError(
                f"LLMEnv.rollout: a token trajectory is one episode, got max_steps={max_steps}"
            )
        seq = super().rollout(1, policy, *args, **kwargs)[..., 0]
        return self.to_token_trajectory(self.drop_non_finite(seq))

    def drop_non_finite(self, seq: TensorDictBase) -> TensorDictBase:
        """Rows of a sequence-level step whose reward is finite (the others counted in
        ``non_finite_rewards_dropped``); a no-op unless ``non_finite_reward="drop"``."""
        finite = torch.isfinite(seq["next", "reward"].reshape(-1))
        if bool(finite.all()) or self.non_finite_reward != "drop":
            return seq
        dropped = (~finite).nonzero().flatten().tolist()
        self.non_finite_rewards_dropped += len(dropped)
        logger.warning(
            "LLMEnv: dropped %d row(s) with a non-finite reward (rows %s; %d so far)",
            len(dropped),
            dropped[:8],
            self.non_finite_rewards_dropped,
        )
        return seq[finite]

    def to_token_trajectory(self, seq: TensorDictBase) -> TensorDict:
        """Sequence-level steps ``[N]`` (any rows) -> the ``[N, L]`` token trajectory."""
        return sequences_to_trajectory(seq, self.tokenizer.pad_token_id)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self, *args, **kwargs) -> dict:
        """Data position (sampler epoch/cursor/seed), the drop counter and the backend's RNG if any."""
        state = {
            "sampler": self.sampler.state_dict(),
            "non_finite_rewards_dropped": self.non_finite_rewards_dropped,
        }
        if hasattr(self.backend, "state_dict"):
            state["backend"] = self.backend.state_dict()
        return state

    def load_state_dict(self, state: dict, *args, **kwargs) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.non_finite_rewards_dropped = int(state.get("non_finite_rewards_dropped", 0))
        if "backend" in state and hasattr(self.backend, "load_state_dict"):
            self.backend.load_state_dict(state["backend"])
