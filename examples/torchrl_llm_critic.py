"""TorchRL's own LLM loop (ChatEnv + TransformersWrapper + LLMCollector) trained with this library's critic.

The loop of TorchRL's ``sota-implementations/grpo`` (a ``DatasetChatEnv`` fed by a DataLoader, each
prompt repeated for a group of samples, one turn per dialog, a reward transform, a
``TransformersWrapper`` policy and an ``LLMCollector``), tiny and offline: the library's tiny
Qwen3 and character tokenizer, arithmetic prompts, DAPO's reward. Instead of ``GRPOLoss`` it trains
a value head with token-level GAE and clipped PPO. The lines this library adds are marked
``# [ar_torchrl]``:

    model = attach_value_head(model)                            # a zero-initialised V(s) head
    postproc=TokenTrajectory.from_policy(policy)                # TorchRL batch -> [B, L] trajectory
    actor_critic = LMActorCritic(model)                         # one forward: log-probs + values
    gae, loss_module = TokenGAE(...), TokenPPOLoss(actor_critic, ...)
    recompute_old_log_probs_and_values(actor_critic, data, plan); gae(data); ppo_update(loss_module, optim, data, plan)

Run:  python examples/torchrl_llm_critic.py --iterations 30

Each iteration prints the reward, the finish of the responses, the loss, the ratio statistics of
the first mini-batch (exactly 1: the anchors are recomputed over the same micro-batches the first
training forward uses, docs/design.md section 4) and the value head's gradient norm.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

import torch
from tensordict import set_list_to_stack
from torch.utils.data import DataLoader
from torchrl.collectors.llm import LLMCollector
from torchrl.data import Unbounded
from torchrl.envs import StepCounter, Transform
from torchrl.envs.llm import DatasetChatEnv
from torchrl.modules.llm import TransformersWrapper

from ar_torchrl.data import arithmetic_dataset
from ar_torchrl.interop import TokenTrajectory
from ar_torchrl.models import build_char_tokenizer, build_tiny_qwen3
from ar_torchrl.models.config import warm_started_tiny_model
from ar_torchrl.modules import LMActorCritic, attach_value_head
from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
from ar_torchrl.rewards import dapo_math_reward
from ar_torchrl.training import plan_micro_batches, ppo_update, recompute_old_log_probs_and_values


class DapoMathReward(Transform):
    """The env's reward (TorchRL style, like ``GSM8KRewardParser``): DAPO's +1/-1 on the last
    assistant message, written as ``("next", "reward")`` of shape ``[B, 1, 1]``."""

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.eos = tokenizer.eos_token

    def _step(self, tensordict, next_tensordict):
        responses = [h[-1].content for h in tensordict["history", "full"].unbind(0)]
        rewards = [
            dapo_math_reward(text.removesuffix(self.eos), answer)
            for text, answer in zip(responses, tensordict["answer"])
        ]
        next_tensordict["reward"] = torch.tensor(rewards).view(-1, 1, 1)
        return next_tensordict

    def transform_reward_spec(self, reward_spec):
        reward_spec["reward"] = Unbounded(reward_spec.shape + (1, 1))
        return reward_spec


def prompt_loader(num_rows: int, batch_size: int, seed: int) -> DataLoader:
    """Arithmetic questions and answers as a DataLoader of ``{"query", "answer"}`` batches."""
    ds = arithmetic_dataset(num_rows, seed=seed)
    rows = [
        {"query": ds.messages(i)[0]["content"], "answer": ds.ground_truth(i)}
        for i in range(len(ds))
    ]
    return DataLoader(
        rows,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        collate_fn=lambda b: {"query": [r["query"] for r in b], "answer": [r["answer"] for r in b]},
    )


@contextlib.contextmanager
def first_minibatch(loss_module: torch.nn.Module, optimizer):
    """Collect the loss outputs of the first mini-batch: the loss calls before the first
    optimizer step (weights still those of the anchors, so every ratio must be exactly 1)."""
    outputs = []

    def stop(*_):
        for hook in hooks:
            hook.remove()

    hooks = [
        loss_module.register_forward_hook(lambda module, args, out: outputs.append(out)),
        optimizer.register_step_pre_hook(stop),
    ]
    try:
        yield outputs
    finally:
        stop()


def main(
    iterations: int = 30,
    *,
    prompts_per_batch: int = 4,
    group_size: int = 4,
    max_new_tokens: int = 12,
    epochs: int = 2,
    num_minibatches: int = 2,
    lr: float = 1e-3,
    warm_start: bool = True,
    seed: int = 0,
) -> list[dict[str, float]]:
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    set_list_to_stack(True).set()  # TorchRL's LLM envs need it (as in sota-implementations/grpo)

    # Policy: the tiny Qwen3 and its character tokenizer, optionally warm-started on the answer
    # format (cached; the same run as examples/compose_torchrl.py).
    if warm_start:  # the recipe's warm start and cache entry (ar_torchrl/configs/model/tiny.yaml)
        cache = Path(os.environ.get("AR_TORCHRL_CACHE", Path.home() / ".cache" / "ar_torchrl"))
        model, tok = warm_started_tiny_model(cache)
    else:
        tok = build_char_tokenizer()
        model = build_tiny_qwen3(len(tok))
    tok.padding_side = "left"
    model = attach_value_head(model)  # [ar_torchrl] V(s) = 0 at start; generation is unchanged

    # TorchRL env: a ChatEnv fed by the DataLoader, each prompt repeated group_size times, one
    # turn per dialog (StepCounter), DAPO's reward on the response.
    batch = prompts_per_batch * group_size
    env = DatasetChatEnv.from_dataloader(
        prompt_loader(2000, prompts_per_batch, seed),
        repeats=group_size,
        batch_size=(batch,),
        tokenizer=tok,
        input_mode="history",
    )
    env.append_transform(StepCounter(max_steps=1))
    env.append_transform(DapoMathReward(tok))

    # TorchRL policy: sampling with transformers. The pad id is banned: TorchRL 0.14.1 drops
    # generated tokens equal to it (TokenTrajectory.from_policy refuses a policy that allows it).
    policy = TransformersWrapper(
        model,
        tokenizer=tok,
        input_mode="history",
        generate=True,
        return_log_probs=True,
        pad_output=False,
        generate_kwargs={
            "max_new_tokens": max_new_tokens,
            "do_sample": True,
            "temperature": 1.0,
            "bad_words_ids": [[tok.pad_token_id]],
        },
    )

    # TorchRL collector; its postproc turns each batch into the [B, L] token trajectory.
    collector = LLMCollector(
        env,
        policy=policy,
        dialog_turns_per_batch=batch,
        total_dialog_turns=iterations * batch,
        track_policy_version=True,
        postproc=TokenTrajectory.from_policy(policy),  # [ar_torchrl]
    )

    # Critic and loss: one backbone forward gives log-probs and values.
    actor_critic = LMActorCritic(model)  # [ar_torchrl]
    gae = TokenGAE(gamma=1.0, lmbda=0.95, normalize_advantage=True)  # [ar_torchrl]
    loss_module = TokenPPOLoss(actor_critic, clip_epsilon=0.2, clip_value=0.2)  # [ar_torchrl]
    optim = torch.optim.AdamW(loss_module.parameters(), lr=lr)
    shuffle = torch.Generator().manual_seed(seed)

    history = []
    for i, data in enumerate(collector):  # data: [B, L], each token a time step
        plan = plan_micro_batches(data, token_budget=512)
        recompute_old_log_probs_and_values(
            actor_critic, data, plan
        )  # [ar_torchrl] "old" log-probs and values
        gae(data)  # writes "advantage" and "value_target"
        with first_minibatch(loss_module, optim) as first:
            metrics = ppo_update(  # [ar_torchrl] epochs x mini-batches x the plan's micro-batches
                loss_module,
                optim,
                data,
                plan,
                epochs=epochs,
                num_minibatches=num_minibatches,
                generator=shuffle,
            )
        # The policy generates with this very model, so its new weights are already live; only
        # the version moves. (A vLLM/SGLang policy would get them through TorchRL's weight-sync
        # sender: sender.update_weights(weights=ar_torchrl.interop.policy_state_dict(model)).)
        collector.increment_version()

        head_grad = model.value_head.weight.grad  # of the last mini-batch, after clipping
        row = {
            "reward": float(data["next", "reward"].sum((-2, -1)).mean()),
            "terminated": float(data["next", "terminated"].any(-2).float().mean()),
            "width": data.batch_size[1],
            "first_min_ratio": min(float(o["min_ratio"]) for o in first),
            "first_max_ratio": max(float(o["max_ratio"]) for o in first),
            "first_micro_batches": len(first),
            "value_head_grad_norm": 0.0 if head_grad is None else float(head_grad.norm()),
            **metrics,
        }
        history.append(row)
        print(
            f"iter {i:3d}  reward {row['reward']:+.3f}  terminated {row['terminated']:.2f}  "
            f"L {row['width']}  loss {metrics['train/loss_objective']:+.4f}  "
            f"critic {metrics['train/loss_critic']:.4f}  "
            f"first-minibatch ratio min {row['first_min_ratio']!r} max {row['first_max_ratio']!r} "
            f"({row['first_micro_batches']} micro-batches)  "
            f"value-head grad {row['value_head_grad_norm']:.3e}"
        )
    collector.shutdown()
    return history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warm-start",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start from the cached supervised warm start (the answer format)",
    )
    args = parser.parse_args()
    main(args.iterations, warm_start=args.warm_start, seed=args.seed)
