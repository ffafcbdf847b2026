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
  sequence-level rollout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Categorical, Composite, Unbounded
from torchrl.envs import EnvBase

from ar_torchrl.backends.base import Completion, GenerationBackend, SamplingParams
from ar_torchrl.data.collate import completions_to_trajectory
from ar_torchrl.rewards.math import dapo_math_reward, overlong_penalty

__all__ = ["EpochSampler", "LLMEnv"]

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]
ACTION_KEYS = (
    "response_tokens",
    "response_length",
    "response_log_prob",
    "response_stopped",
    "policy_version",
)


class EpochSampler:
    """Seeded sampler without replacement: a new permutation each epoch; resumable.

    Example:
        >>> s = EpochSampler(5, seed=0)
        >>> a = s.draw(3); state = s.state_dict(); b = s.draw(4)
        >>> s.load_state_dict(state); b == s.draw(4), sorted(a + b[:2])
        (True, [0, 1, 2, 3, 4])
    """

    def __init__(self, size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.cursor = 0, 0

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=gen).tolist()

    def draw(self, k: int) -> list[int]:
        """Next ``k`` indices (crossing into the next epoch when this one runs out)."""
        out: list[int] = []
        while len(out) < k:
            order = self._order()
            take = order[self.cursor : self.cursor + k - len(out)]
            out += take
            self.cursor += len(take)
            if self.cursor == self.size:
                self.epoch, self.cursor = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.epoch, self.cursor = state["seed"], state["epoch"], state["cursor"]


def _check_tokenizer(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "LLMEnv: the tokenizer has no chat template (tokenizer.chat_template is None); set one, "
            "e.g. tokenizer.chat_template = ar_torchrl.assets.CHATML_TEMPLATE"
        )
    if tokenizer.pad_token_id is None:
        raise ValueError("LLMEnv: the tokenizer has no pad_token_id; set tokenizer.pad_token")


def _check_weight_versions(completions: Sequence[Completion], version: int) -> None:
    """The engine's reported weight version must be the one the rows get stamped with.

    Engines that report no version (``None``) or SGLang's ``"default"`` (never synced: the weights
    it was launched with) are not checked.
    """
    reported = {c.weight_version for c in completions} - {None, "default"}
    if reported and reported != {str(version)}:
        raise RuntimeError(
            f"LLMEnv: the backend generated with weight version(s) {sorted(reported)} but the rows "
            f"would be stamped policy_version={version}; another client may have synced the "
            "server, or a sync was lost: sync the weights again before collecting"
        )


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

    Example:
        >>> from ar_torchrl.assets import build_char_tokenizer, build_tiny_qwen3
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
    ) -> None:
        _check_tokenizer(tokenizer)
        if num_samples < 1 or prompts_per_batch < 1:
            raise ValueError(
                f"LLMEnv: num_samples and prompts_per_batch must be >= 1, got {num_samples} and "
                f"{prompts_per_batch}"
            )
        if len(dataset) == 0:
            raise ValueError("LLMEnv: the dataset is empty")
        super().__init__(batch_size=torch.Size([prompts_per_batch * num_samples]))
        self.dataset, self.tokenizer, self.backend = dataset, tokenizer, backend
        self.reward_fn, self.num_samples, self.prompts_per_batch = (
            reward_fn,
            num_samples,
            prompts_per_batch,
        )
        self.sampling = sampling or SamplingParams()
        self.overlong_buffer_len, self.overlong_penalty_factor = (
            overlong_buffer_len,
            overlong_penalty_factor,
        )
        self.policy_version = 0
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
            messages = self.dataset[index]["prompt"]
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            self._prompt_cache[index] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._prompt_cache[index]

    def _make_specs(self) -> None:
        n, width, vocab = self.batch_size[0], self.max_prompt_tokens, len(self.tokenizer)
        max_new = self.sampling.max_new_tokens

        def ids(shape):
            return Bounded(0, vocab - 1, shape=shape, dtype=torch.int64)

        def flag(shape):
            return Categorical(2, shape=shape, dtype=torch.bool)

        self.observation_spec = Composite(
            prompt_tokens=ids((n, width)),
            prompt_mask=flag((n, width)),
            prompt_id=Unbounded(shape=(n,), dtype=torch.int64),
            shape=(n,),
        )
        self.full_action_spec = Composite(
            response_tokens=ids((n, max_new)),
            response_length=Bounded(1, max_new, shape=(n,), dtype=torch.int64),
            response_log_prob=Unbounded(shape=(n, max_new), dtype=torch.float32),
            response_stopped=flag((n,)),
            policy_version=Unbounded(shape=(n,), dtype=torch.int64),
            shape=(n,),
        )
        self.reward_spec = Unbounded(shape=(n, 1), dtype=torch.float32)
        self.full_done_spec = Composite(
            done=flag((n, 1)), terminated=flag((n, 1)), truncated=flag((n, 1)), shape=(n,)
        )

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
        rewards = [
            self.score(tokens[b, : int(lengths[b])].tolist(), int(tensordict["prompt_id"][b]))
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
    def score(self, response_ids: list[int], index: int) -> float:
        """Reward of a response to dataset row ``index`` (task reward + optional overlong penalty)."""
        text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
        reward = float(self.reward_fn(text, self.dataset[index]["reward_model"]["ground_truth"]))
        if self.overlong_buffer_len is not None:
            reward += overlong_penalty(
                len(response_ids),
                self.sampling.max_new_tokens,
                self.overlong_buffer_len,
                self.overlong_penalty_factor,
            )
        return reward

    def _prompts_of(self, tensordict: TensorDictBase) -> list[list[int]]:
        """Unique prompts of a reset tensordict (one per group of ``num_samples`` rows)."""
        rows = range(0, self.batch_size[0], self.num_samples)
        return [tensordict["prompt_tokens"][r][tensordict["prompt_mask"][r]].tolist() for r in rows]

    def generate(self, tensordict: TensorDictBase) -> TensorDictBase:
        """The default policy: sample responses with the backend and write the action keys."""
        version = self.policy_version
        completions = self.backend.generate(
            self._prompts_of(tensordict), self.num_samples, self.sampling
        )
        if len(completions) != self.batch_size[0]:
            raise RuntimeError(
                f"LLMEnv: the backend returned {len(completions)} completions, expected "
                f"{self.batch_size[0]} ({self.prompts_per_batch} prompts x {self.num_samples})"
            )
        _check_weight_versions(completions, version)
        n, max_new = self.batch_size[0], self.sampling.max_new_tokens
        tokens = torch.full((n, max_new), self.tokenizer.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros((n, max_new), dtype=torch.float32)
        for b, c in enumerate(completions):
            if len(c) > max_new:
                raise RuntimeError(
                    f"LLMEnv: completion {b} has {len(c)} tokens > max_new_tokens={max_new}"
                )
            tokens[b, : len(c)] = torch.tensor(c.token_ids, dtype=torch.long)
            log_probs[b, : len(c)] = torch.tensor(c.log_probs, dtype=torch.float32)
        tensordict["response_tokens"] = tokens
        tensordict["response_length"] = torch.tensor([len(c) for c in completions])
        tensordict["response_log_prob"] = log_probs
        tensordict["response_stopped"] = torch.tensor(
            [c.finish_reason == "stop" for c in completions]
        )
        tensordict["policy_version"] = torch.full((n,), version, dtype=torch.long)
        return tensordict

    def rollout(
        self, max_steps: int = 1, policy=None, *args, token_trajectory: bool = True, **kwargs
    ):
        """Roll out one batch.

        Args:
            max_steps: episodes last one (sequence-level) step; the token trajectory needs ``1``.
            policy: defaults to :meth:`generate` (the backend).
            token_trajectory: return the ``[N, L]`` token trajectory (default) instead of TorchRL's
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
        seq = super().rollout(1, policy, *args, **kwargs)
        return self.to_token_trajectory(seq[..., 0])

    def to_token_trajectory(self, seq: TensorDictBase) -> TensorDict:
        """Sequence-level step ``[N]`` (after ``step``) -> the ``[N, L]`` token trajectory."""
        versions = seq["policy_version"].unique()
        if versions.numel() != 1:
            raise ValueError(f"LLMEnv: one batch mixes policy versions {versions.tolist()}")
        n = self.num_samples
        prompts = self._prompts_of(seq)
        completions = []
        for b in range(seq.shape[0]):
            length = int(seq["response_length"][b])
            completions.append(
                Completion(
                    prompt_index=b // n,
                    token_ids=seq["response_tokens"][b, :length].tolist(),
                    log_probs=seq["response_log_prob"][b, :length].tolist(),
                    finish_reason="stop" if bool(seq["response_stopped"][b]) else "length",
                )
            )
        return completions_to_trajectory(
            prompts,
            completions,
            seq["next", "reward"].reshape(-1),
            pad_token_id=self.tokenizer.pad_token_id,
            group_ids=seq["prompt_id"][::n].tolist(),
            policy_version=int(versions[0]),
        )

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self, *args, **kwargs) -> dict:
        """Data position (sampler epoch/cursor/seed), weight version and the backend's RNG if any."""
        state = {"sampler": self.sampler.state_dict(), "policy_version": self.policy_version}
        if hasattr(self.backend, "state_dict"):
            state["backend"] = self.backend.state_dict()
        return state

    def load_state_dict(self, state: dict, *args, **kwargs) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.policy_version = int(state["policy_version"])
        if "backend" in state and hasattr(self.backend, "load_state_dict"):
            self.backend.load_state_dict(state["backend"])
