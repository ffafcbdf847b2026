"""Plain TorchRL composition: LLMEnv + TokenGAE + TokenPPOLoss + a TorchRL ReplayBuffer.

The same loop as TorchRL's own PPO examples (sota-implementations/ppo): collect a batch, compute
advantages with the value estimator, put the batch in a ``ReplayBuffer`` sampling without
replacement, and run a few epochs of mini-batch updates. Only the pieces are ours: an env whose
rollouts are ``[B, L]`` token trajectories, token-level GAE, and the token-masked PPO loss.

Run:  python examples/compose_torchrl.py --iterations 30

Difference from examples/dapo_ppo.py: mini-batches are random rows drawn from the buffer, so the
training forward does not reuse the anchor pass's micro-batch geometry; the first ratio is 1 up to
float rounding instead of exactly 1 (see docs/design.md section 4).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement

from ar_torchrl.backends import SamplingParams, TransformersBackend
from ar_torchrl.data.datasets import arithmetic_dataset
from ar_torchrl.envs import LLMEnv
from ar_torchrl.models.config import warm_started_tiny_model
from ar_torchrl.modules import LMActorCritic, attach_value_head
from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
from ar_torchrl.training import plan_micro_batches, recompute_old_log_probs_and_values
from ar_torchrl.weight_sync import named_policy_tensors


def quiet_storage_init() -> None:
    """Drop TorchRL's "Initialized LazyTensorStorage ..." INFO record (one per batch here).

    Each batch has its own width L, so the buffer is rebuilt per batch and TorchRL logs that line
    every iteration; only that record is filtered, every other message (warnings included) stays.
    """
    logging.getLogger("torchrl").addFilter(
        lambda record: not record.getMessage().startswith("Initialized LazyTensorStorage")
    )


def main(iterations: int, epochs: int = 2, minibatch_rows: int = 32, seed: int = 0) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    quiet_storage_init()
    cache = Path(os.environ.get("AR_TORCHRL_CACHE", Path.home() / ".cache" / "ar_torchrl"))

    # Policy: the tiny Qwen3, warm-started on the answer format (cached), plus a value head.
    model, tok = warm_started_tiny_model(
        cache
    )  # the CPU default's warm start (ar_torchrl/configs/model/tiny.yaml)
    model = attach_value_head(model)
    actor_critic = LMActorCritic(model)

    # Env: prompts in, scored [B, L] token trajectories out (16 prompts x 4 samples).
    backend = TransformersBackend(model, seed=seed)
    env = LLMEnv(
        arithmetic_dataset(2000, seed=seed),
        tok,
        backend,
        num_samples=4,
        prompts_per_batch=16,
        sampling=SamplingParams(max_new_tokens=12),
        seed=seed,
    )

    # Advantage (a TorchRL ValueEstimatorBase) and loss (a TorchRL LossModule), TorchRL style.
    advantage_module = TokenGAE(gamma=1.0, lmbda=0.95, normalize_advantage=True)
    loss_module = TokenPPOLoss(actor_critic, clip_epsilon=0.2, clip_value=0.2, critic_coeff=1.0)
    optim = torch.optim.AdamW(loss_module.parameters(), lr=1e-3)

    for i in range(iterations):
        data = env.collect()  # [B, L]: each token position is a time step
        plan = plan_micro_batches(data, token_budget=4096)
        recompute_old_log_probs_and_values(
            actor_critic, data, plan
        )  # "old" log-probs and values, no grad
        advantage_module(data)  # writes "advantage" and "value_target"

        # As in TorchRL's PPO example: a buffer of this batch, sampled without replacement.
        buffer = ReplayBuffer(
            storage=LazyTensorStorage(data.shape[0]),
            sampler=SamplerWithoutReplacement(),
            batch_size=minibatch_rows,
        )
        buffer.extend(data)
        for _ in range(epochs):
            for _ in range(data.shape[0] // minibatch_rows):
                batch = buffer.sample()  # [minibatch_rows, L]
                loss_vals = loss_module(batch)
                loss = loss_vals["loss_objective"] + loss_vals["loss_critic"]
                loss.backward()
                torch.nn.utils.clip_grad_norm_(loss_module.parameters(), 1.0)
                optim.step()
                optim.zero_grad()

        backend.sync_weights(named_policy_tensors(model), version=backend.policy_version + 1)
        reward = data["next", "reward"].sum(dim=(-2, -1)).mean().item()
        print(
            f"iter {i:3d}  reward {reward:+.3f}  loss {loss.item():+.4f}  "
            f"ratio {loss_vals['mean_ratio'].item():.4f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(args.iterations, seed=args.seed)
