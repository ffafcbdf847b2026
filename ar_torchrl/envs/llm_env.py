"""LLMEnv: a TorchRL environment that answers prompts with a rollout engine, and the token trajectory.

Two time scales:

- **As a TorchRL env** one step answers one batch of prompts: a one-step episode per row, batch
  size ``[N]`` (``N = prompts_per_batch * num_samples``, prompt-major: rows ``i*n .. i*n+n-1`` share
  a prompt). ``reset`` draws the next prompts from the dataset (a seeded, resumable epoch sampler)
  and writes their dataset index, ``"prompt_id"``. The engine is the env's policy: the only action
  is ``"action" = 0``, "answer with the engine", so ``env.rollout()`` without a policy (TorchRL's
  ``rand_action``), under a ``TransformedEnv`` too, always answers with the backend, never with
  random tokens. ``step`` generates (token-in: the chat-templated prompt ids), scores every answer
  with the reward (which sees the whole :class:`~ar_torchrl.data.samples.Sample`; off this thread,
  with a deadline: :class:`~ar_torchrl.rewards.scoring.RewardScorer`) and writes
  ``("next", "reward")``, ``done``/``terminated``/``truncated`` (``truncated``: cut by
  ``max_new_tokens``) and ``("next", "sample_id")``, the id of each row's sample (token ids,
  log-probs, weight version, text, row), which the env keeps for the last ``keep_rounds`` steps
  (:meth:`LLMEnv.samples` looks them up: plain integers are what TorchRL's rollout clones and
  indexes, not Python objects). ``check_env_specs`` holds, and TorchRL reward transforms apply as
  usual.
- **The token trajectory** (docs/design.md section 1) is built from those samples by the one
  builder, :func:`~ar_torchrl.data.trajectory.build_trajectory`, with the rewards of the step (so
  a reward transform's rewards are the trained ones): :meth:`LLMEnv.to_token_trajectory` of a step,
  or :meth:`LLMEnv.collect` (reset, step, build), which a collector gathering several rounds uses
  through :func:`~ar_torchrl.collectors.sampling.gather_batch`. ``L`` is the batch's own width:
  nothing is padded to a dataset-wide width, and no prompt is tokenised before it is drawn.
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Categorical, Composite, Unbounded
from torchrl.envs import EnvBase

from ar_torchrl.backends.base import GenerationBackend, SamplingParams
from ar_torchrl.data.prompts import prompt_token_ids
from ar_torchrl.data.samples import Sample, Segment
from ar_torchrl.data.trajectory import build_trajectory
from ar_torchrl.envs.sampler import EpochSampler
from ar_torchrl.rewards.math import dapo_math_reward
from ar_torchrl.rewards.registry import as_reward
from ar_torchrl.rewards.scoring import RewardScorer

__all__ = ["LLMEnv", "NonFiniteRewardPolicy"]

logger = logging.getLogger(__name__)

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
    """Prompts in, scored samples out; token trajectories from them (see the module docstring).

    Args:
        dataset: rows with a ``"prompt"`` (chat messages), e.g. a
            :class:`~ar_torchrl.data.datasets.MathDataset` (its rows' sources name them in errors).
        tokenizer: HF tokenizer with a chat template and a pad token.
        backend: the rollout engine.
        reward_fn: a reward (``score(sample)`` / ``correct(sample, score)``, see
            :mod:`ar_torchrl.rewards.registry`) or a function ``fn(sample)`` or
            ``fn(response_text, ground_truth)`` (DAPO's schema); default DAPO's math reward. Shaping
            (e.g. :class:`~ar_torchrl.rewards.registry.OverlongPenalty`) wraps it.
        num_samples: completions per prompt (the GRPO group size).
        prompts_per_batch: prompts per reset.
        sampling: sampling parameters.
        seed: prompt-order seed.
        shuffle: shuffle prompts each epoch.
        non_finite_reward: a NaN/inf reward is an error naming the row, the prompt and the value
            (``"raise"``), or the row is dropped from the token trajectory and counted in
            ``non_finite_rewards_dropped`` (``"drop"``).
        reward_workers: threads that score a batch (1: the reward need not be thread-safe).
        reward_timeout_s: the deadline of one reward call.
        keep_rounds: how many steps' samples the env keeps for :meth:`samples` (a collector that
            samples several rounds per batch needs them all).

    The weight version of the rows is the one the backend stamped on the completions (the backend
    owns it); the env only reads it.

    Example:
        >>> from ar_torchrl.models import build_char_tokenizer, build_tiny_qwen3
        >>> from ar_torchrl.backends import TransformersBackend
        >>> from ar_torchrl.data.datasets import arithmetic_dataset
        >>> from torchrl.envs.utils import check_env_specs
        >>> tok = build_char_tokenizer()
        >>> env = LLMEnv(arithmetic_dataset(8), tok, TransformersBackend(build_tiny_qwen3(len(tok))),
        ...              num_samples=2, prompts_per_batch=2, sampling=SamplingParams(max_new_tokens=4))
        >>> check_env_specs(env)  # a well-behaved TorchRL env (the steps come from the backend)
        >>> td = env.collect()  # the [N, L] token trajectory of one batch
        >>> td.batch_dims, td.shape[0], int(td["loss_mask"].sum(-1).max()) <= 4
        (2, 4, True)
    """

    def __init__(
        self,
        dataset: Sequence[dict],
        tokenizer,
        backend: GenerationBackend,
        *,
        reward_fn=dapo_math_reward,
        num_samples: int = 4,
        prompts_per_batch: int = 8,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        shuffle: bool = True,
        non_finite_reward: NonFiniteRewardPolicy = "raise",
        reward_workers: int = 1,
        reward_timeout_s: float = 60.0,
        keep_rounds: int = 32,
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
        self.reward_fn = as_reward(reward_fn)
        self.num_samples, self.prompts_per_batch = num_samples, prompts_per_batch
        self.sampling = sampling or SamplingParams()
        self.non_finite_reward, self.non_finite_rewards_dropped = non_finite_reward, 0
        self._scorer = RewardScorer(
            self.reward_fn, workers=reward_workers, timeout_s=reward_timeout_s
        )
        self.sampler = EpochSampler(len(dataset), seed=seed, shuffle=shuffle)
        self._prompt_cache: dict[int, list[int]] = {}
        self._samples: OrderedDict[int, Sample] = OrderedDict()
        self._next_id, self._keep = 0, max(1, keep_rounds) * prompts_per_batch * num_samples
        self._make_specs()

    # ------------------------------------------------------------------ prompts
    def prompt_token_ids(self, index: int) -> list[int]:
        """Chat-templated token ids of dataset row ``index`` (with the generation prompt; cached)."""
        if index not in self._prompt_cache:
            ids = prompt_token_ids(self.dataset[index]["prompt"], self.tokenizer)
            self._prompt_cache[index] = ids
        return self._prompt_cache[index]

    def _source(self, index: int) -> str:
        source = getattr(self.dataset, "source", None)
        return source(index) if source is not None else f"row {index}"

    #: TorchRL steps of one episode (one turn: the answer); :class:`~ar_torchrl.envs.ToolEnv` has more
    max_turns = 1

    def _make_specs(self) -> None:
        n = self.batch_size[0]
        self.observation_spec = Composite(
            prompt_id=Unbounded(shape=(n,), dtype=torch.int64),
            sample_id=Unbounded(shape=(n,), dtype=torch.int64),
            shape=(n,),
        )
        # the engine answers: "action" has one value, so no policy (or rand_action) picks tokens
        self.action_spec = Categorical(1, shape=(n,), dtype=torch.int64)
        self.reward_spec = Unbounded(shape=(n, 1), dtype=torch.float32)
        flag = Categorical(2, shape=(n, 1), dtype=torch.bool)
        self.full_done_spec = Composite(
            done=flag, terminated=flag.clone(), truncated=flag.clone(), shape=(n,)
        )

    # ------------------------------------------------------------------ EnvBase
    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        reset = None if tensordict is None else tensordict.get("_reset", None)
        if reset is not None and not bool(reset.all()):
            raise RuntimeError(
                "LLMEnv: partial reset requested; all rows of a batch end together, reset them all"
            )
        indices = self.sampler.draw(self.prompts_per_batch)
        prompt_id = torch.tensor(indices).repeat_interleave(self.num_samples)
        out = TensorDict(
            {"prompt_id": prompt_id, "sample_id": torch.full_like(prompt_id, -1)},
            batch_size=self.batch_size,
        )
        return out.update(self.full_done_spec.zero())

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        prompt_id = tensordict["prompt_id"]
        samples = self.generate(prompt_id.tolist())
        self._scorer(samples)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32).unsqueeze(-1)
        self._check_finite(samples, rewards)
        stopped = torch.tensor([s.terminated for s in samples]).unsqueeze(-1)
        out = TensorDict(
            {
                "prompt_id": prompt_id.clone(),  # the next observation: the same prompts
                "reward": rewards,
                "done": torch.ones_like(stopped),
                "terminated": stopped,
                "truncated": ~stopped,
                "sample_id": self._keep_samples(samples),
            },
            batch_size=self.batch_size,
        )
        return out

    def _keep_samples(self, samples: list[Sample]) -> torch.Tensor:
        ids = torch.arange(self._next_id, self._next_id + len(samples))
        self._next_id += len(samples)
        self._samples.update(zip(ids.tolist(), samples))
        while len(self._samples) > self._keep:
            self._samples.popitem(last=False)
        return ids

    def samples(self, td: TensorDictBase, key=("next", "sample_id")) -> list[Sample]:
        """The :class:`~ar_torchrl.data.samples.Sample` of each row of a step (``td[key]``), in
        row order.

        Raises:
            KeyError: a sample the env no longer keeps (more than ``keep_rounds`` steps ago).
        """
        ids = td.get(key).reshape(-1).tolist()
        try:
            return [self._samples[i] for i in ids]
        except KeyError as err:
            raise KeyError(
                f"LLMEnv.samples: sample {err.args[0]} is gone (the env keeps the last "
                f"{self._keep} samples, keep_rounds={self._keep // self.batch_size[0]} steps); "
                "build the token trajectory within keep_rounds steps, or raise keep_rounds"
            ) from None

    def _set_seed(self, seed: int | None) -> None:
        self.sampler = EpochSampler(len(self.dataset), seed=seed or 0, shuffle=self.sampler.shuffle)

    # ------------------------------------------------------------------ generation, scoring
    def generate(self, prompt_id: Sequence[int]) -> list[Sample]:
        """The samples of rows ``prompt_id`` (prompt-major, ``num_samples`` rows per prompt): the
        prompts' token ids to the backend, each completion with its prompt as a sample, unscored.
        ``policy_version`` is the weight version the backend stamped on the completions."""
        groups = list(prompt_id)[:: self.num_samples]
        prompts = [self.prompt_token_ids(i) for i in groups]
        completions = self.backend.generate(prompts, self.num_samples, self.sampling)
        if len(completions) != len(prompt_id):
            raise RuntimeError(
                f"LLMEnv: the backend returned {len(completions)} completions, expected "
                f"{len(prompt_id)} ({len(prompts)} prompts x {self.num_samples})"
            )
        vocab = len(self.tokenizer)
        samples = []
        for row, c in enumerate(completions):
            index = groups[c.prompt_index]
            bad = [t for t in c.token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"LLMEnv: the completion of batch row {row} (prompt index {index}) has token "
                    f"ids {bad[:5]} outside the tokenizer's vocabulary [0, {vocab})"
                )
            sample = Sample(
                [Segment(prompts[c.prompt_index]), c],
                row=self.dataset[index],
                prompt_id=index,
                finish_reason=c.finish_reason,
                source=self._source(index),
            )
            sample.text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            samples.append(sample)
        return samples

    def _check_finite(self, samples: list[Sample], rewards: torch.Tensor) -> None:
        bad = (~torch.isfinite(rewards.reshape(-1))).nonzero().flatten().tolist()
        if bad and self.non_finite_reward == "raise":
            s = samples[bad[0]]
            raise ValueError(
                f"LLMEnv: reward_fn returned {s.reward} for batch row {bad[0]} (prompt index "
                f"{s.prompt_id}, response {s.text[:80]!r}); rewards must be finite: fix the reward "
                "function, or pass non_finite_reward='drop' to drop such rows (they are counted)"
            )

    def drop_non_finite(self, seq: TensorDictBase) -> TensorDictBase:
        """Rows of a step whose reward is finite (the others counted in
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

    # ------------------------------------------------------------------ the token trajectory
    def to_token_trajectory(self, seq: TensorDictBase) -> TensorDict:
        """Steps ``[N]`` (any rows, e.g. the groups kept over several sampling rounds) -> the
        ``[N, L]`` token trajectory, with the steps' (possibly transformed) rewards."""
        return build_trajectory(
            self.samples(seq),
            pad_token_id=self.tokenizer.pad_token_id,
            rewards=seq["next", "reward"].reshape(-1),
            allow_mixed_versions=self.backend.partial_rollouts,
        )

    def episodes(self, steps: TensorDictBase) -> TensorDictBase:
        """A rollout ``[N, T]`` of whole episodes -> one row per episode ``[N]`` (its last step,
        with ``("next", "reward")`` the episode's return: here episodes are one step)."""
        return steps[..., -1]

    def rollout(self, max_steps: int | None = None, *args, **kwargs) -> TensorDictBase:
        """TorchRL's ``EnvBase.rollout``: ``max_steps`` steps of the env (``max_turns`` steps are
        whole episodes), a ``[N, T]`` TensorDict of steps. The token trajectory is :meth:`collect`.

        ``env.rollout()`` without ``max_steps`` returned the token trajectory in ar_torchrl 0.1; it
        still does for one release, with a ``DeprecationWarning`` naming :meth:`collect`.

        Raises:
            TypeError: no ``max_steps`` but other arguments (TorchRL's rollout needs it).
        """
        if max_steps is None:
            name = type(self).__name__
            if args or kwargs:
                raise TypeError(
                    f"{name}.rollout() needs max_steps, as TorchRL's EnvBase.rollout: "
                    f"env.rollout({self.max_turns}, ...) runs whole episodes; the token trajectory "
                    "of a batch is env.collect()"
                )
            warnings.warn(
                f"{name}.rollout() without max_steps returned the token trajectory in ar_torchrl "
                "0.1: that is env.collect() now (env.rollout(max_steps) is TorchRL's rollout, the "
                "[N, T] steps); the old call goes in ar_torchrl 0.2",
                DeprecationWarning,
                stacklevel=2,
            )
            return self.collect()
        return super().rollout(max_steps, *args, **kwargs)

    def collect(self) -> TensorDict:
        """One batch as a token trajectory: ``rollout(max_turns)`` (reset + the episodes), rows
        with a non-finite reward dropped under ``non_finite_reward="drop"``, then
        :meth:`to_token_trajectory`."""
        seq = self.episodes(self.rollout(self.max_turns))
        return self.to_token_trajectory(self.drop_non_finite(seq))

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self, *args, **kwargs) -> dict:
        """Data position (sampler epoch/cursor/seed), the drop counter and the backend's RNG if any."""
        state = {
            "sampler": self.sampler.state_dict(),
            "non_finite_rewards_dropped": self.non_finite_rewards_dropped,
        }
        if self.backend.capabilities.sampler_state:
            state["backend"] = self.backend.state_dict()
        return state

    def load_state_dict(self, state: dict, *args, **kwargs) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.non_finite_rewards_dropped = int(state.get("non_finite_rewards_dropped", 0))
        if "backend" in state and self.backend.capabilities.sampler_state:
            self.backend.load_state_dict(state["backend"])

    def close(self, *, raise_if_closed: bool = True) -> None:
        self._scorer.close()
        super().close(raise_if_closed=raise_if_closed)
