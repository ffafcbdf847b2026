"""examples/torchrl_llm_critic.py's TorchRL loop with its engines on Ray: each worker is a TorchRL
``RayLLMCollector`` actor (its own ``DatasetChatEnv`` and ``TransformersWrapper``, placed on its own
node), the learner trains the critic and the policy and publishes the new weights over a dedicated
gloo group (``ar_torchrl.interop.ray``; ``value_head.*`` never leaves the learner).

Run on one machine (a local Ray cluster of ``--workers`` one-CPU nodes, started and stopped here):
    python examples/torchrl_ray_critic.py --local-cluster --workers 2 --iterations 10
On a cluster started with ``ray start`` on every node (docs/scale-out.md):
    python examples/torchrl_ray_critic.py --ray-address auto --workers 8 --iterations 100

Each iteration prints the reward, the workers' policy versions, the loss and the first
mini-batch's ratio range (exactly 1: anchors recomputed over the first update's micro-batches).
``--greedy`` makes the engines deterministic (tests/interop/test_ray_rollout.py compares their
samples with one process's).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
from pathlib import Path

import torch
from tensordict import set_list_to_stack
from torchrl.envs import StepCounter
from torchrl.envs.llm import DatasetChatEnv
from torchrl.modules.llm import TransformersWrapper

from ar_torchrl.interop import TokenTrajectory
from ar_torchrl.interop.ray import RayRollout, local_cluster
from ar_torchrl.models import build_char_tokenizer, build_tiny_qwen3
from ar_torchrl.models.config import warm_started_tiny_model
from ar_torchrl.modules import LMActorCritic, attach_value_head
from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
from ar_torchrl.training import plan_micro_batches, ppo_update, recompute_old_log_probs_and_values
from ar_torchrl.weight_sync import named_policy_tensors


def _single_process_example():
    """examples/torchrl_llm_critic.py (its reward transform, prompt loader and first-mini-batch
    hook), imported by path: the examples folder is not a package."""
    name = "torchrl_llm_critic"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def make_env(worker: int, *, prompts_per_batch: int, group_size: int, seed: int):
    """Worker ``worker``'s TorchRL env (built on the worker): its own prompt stream."""
    base = _single_process_example()
    set_list_to_stack(True).set()
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    env = DatasetChatEnv.from_dataloader(
        base.prompt_loader(2000, prompts_per_batch, seed + 1000 * worker),
        repeats=group_size,
        batch_size=(prompts_per_batch * group_size,),
        tokenizer=tok,
        input_mode="history",
    )
    env.append_transform(StepCounter(max_steps=1))
    env.append_transform(base.DapoMathReward(tok))
    return env


def make_policy(*, max_new_tokens: int, greedy: bool):
    """The worker's engine (built on the worker): a TransformersWrapper over a tiny Qwen3 of the
    learner's architecture; its weights come from the learner before the first batch."""
    torch.set_num_threads(1)
    set_list_to_stack(True).set()
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0}
    return TransformersWrapper(
        build_tiny_qwen3(len(tok)),
        tokenizer=tok,
        input_mode="history",
        generate=True,
        return_log_probs=True,
        pad_output=False,
        generate_kwargs={
            "max_new_tokens": max_new_tokens,
            "bad_words_ids": [[tok.pad_token_id]],  # see torchrl_llm_critic.make_policy
            **sampling,
        },
    )


def register_by_value() -> None:
    """Ray pickles these factories by value (the examples folder is not importable on workers)."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cloudpickle.register_pickle_by_value(_single_process_example())


def main(
    iterations: int = 10,
    *,
    workers: int = 2,
    ray_address: str | None = None,
    prompts_per_batch: int = 2,
    group_size: int = 4,
    max_new_tokens: int = 12,
    epochs: int = 2,
    num_minibatches: int = 2,
    lr: float = 1e-3,
    greedy: bool = False,
    warm_start: bool = True,
    seed: int = 0,
) -> list[dict[str, float]]:
    import functools

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    set_list_to_stack(True).set()
    base = _single_process_example()
    register_by_value()
    if warm_start:
        cache = Path(os.environ.get("AR_TORCHRL_CACHE", Path.home() / ".cache" / "ar_torchrl"))
        model, tok = warm_started_tiny_model(cache)
    else:
        tok = build_char_tokenizer()
        model = build_tiny_qwen3(len(tok))
    model = attach_value_head(model)  # [ar_torchrl +]

    rollout = RayRollout(
        functools.partial(
            make_env, prompts_per_batch=prompts_per_batch, group_size=group_size, seed=seed
        ),
        functools.partial(make_policy, max_new_tokens=max_new_tokens, greedy=greedy),
        num_workers=workers,
        dialog_turns_per_batch=prompts_per_batch * group_size,
        postproc=TokenTrajectory(tok, max_new_tokens=max_new_tokens),
        ray_init_config=None if ray_address is None else {"address": ray_address},
    )
    history = []
    with rollout:
        rollout.connect(named_policy_tensors(model))  # the engines start from the learner's weights
        actor_critic = LMActorCritic(model)
        gae = TokenGAE(gamma=1.0, lmbda=0.95, normalize_advantage=True)
        loss_module = TokenPPOLoss(actor_critic, clip_epsilon=0.2, clip_value=0.2)
        optim = torch.optim.AdamW(loss_module.parameters(), lr=lr)
        shuffle = torch.Generator().manual_seed(seed)
        for i in range(iterations):
            versions = rollout.policy_versions
            data = rollout.collect()  # [sum of the workers' B, L]
            plan = plan_micro_batches(data, token_budget=512)
            recompute_old_log_probs_and_values(actor_critic, data, plan)
            gae(data)
            with base.first_minibatch(loss_module, optim) as first:
                metrics = ppo_update(
                    loss_module,
                    optim,
                    data,
                    plan,
                    epochs=epochs,
                    num_minibatches=num_minibatches,
                    generator=shuffle,
                )
            rollout.publish(named_policy_tensors(model), version=i + 1)
            row = {
                "reward": float(data["next", "reward"].sum((-2, -1)).mean()),
                "rows": data.batch_size[0],
                "first_min_ratio": min(float(o["min_ratio"]) for o in first),
                "first_max_ratio": max(float(o["max_ratio"]) for o in first),
                **metrics,
            }
            history.append(row)
            print(
                f"iter {i:3d}  reward {row['reward']:+.3f}  rows {row['rows']}  versions {versions}  "
                f"loss {metrics['train/loss_objective']:+.4f}  "
                f"first-minibatch ratio min {row['first_min_ratio']!r} max {row['first_max_ratio']!r}",
                flush=True,
            )
    return history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--ray-address", help="a running Ray cluster ('auto': ray start's)")
    where.add_argument("--local-cluster", action="store_true", help="start one on this machine")
    parser.add_argument("--greedy", action="store_true", help="deterministic engines")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        if args.local_cluster:
            stack.enter_context(local_cluster(args.workers))
        main(
            args.iterations,
            workers=args.workers,
            ray_address=args.ray_address,
            greedy=args.greedy,
            warm_start=args.warm_start,
            seed=args.seed,
        )
