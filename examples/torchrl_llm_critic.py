"""TorchRL's own LLM loop (ChatEnv + TransformersWrapper or SGLangWrapper + LLMCollector) trained
with this library's critic.

The loop of TorchRL's ``sota-implementations/grpo`` (a ``DatasetChatEnv`` fed by a DataLoader, each
prompt repeated for a group of samples, one turn per dialog, a reward transform, a TorchRL LLM
wrapper as the policy, an ``LLMCollector``, a training model and a weight sync), tiny and offline:
the library's tiny Qwen3 and character tokenizer, arithmetic prompts, DAPO's reward. Instead of
``GRPOLoss`` it trains a value head with token-level GAE and clipped PPO. Two engines:

- ``--engine transformers``: ``TransformersWrapper`` over the very model being trained (its new
  weights are live after each update, as in TorchRL's single-process GRPO);
- ``--engine sglang``: ``SGLangWrapper(AsyncSGLang.connect(url))``, a real SGLang server (``--url``:
  one serving the policy's starting weights, or one launched here on the policy, from
  ``.venv-sglang``). Its log-probs are kept
  (``rollout_log_prob="raise"``) and checked against the trainer's every iteration. TorchRL
  0.14.1's own SGLang weight sync is NCCL-only and fails against SGLang 0.5.23, so the sync goes
  through :class:`~ar_torchrl.backends.torchrl.TorchRLBackend` (this library's ``disk`` sender for
  the wrapper's server; ``value_head.*`` is never sent).

What this library changes in TorchRL's loop, line by line (marked in the code, and counted by
``tests/interop/test_interop_torchrl.py``):

- ``# [ar_torchrl +]``: added, at most 5 per engine: the value head, the advantage module, and per
  batch the micro-batch plan, the anchors (old log-probs and values) and the advantage;
- ``# [ar_torchrl converter]``: the collector's ``postproc``, TorchRL batch -> [B, L] trajectory;
- ``# [ar_torchrl ~]``: a TorchRL line replaced, not added: the training actor (``LMActorCritic``
  for TorchRL's ``TransformersWrapper(generate=False)``), the loss (``TokenPPOLoss`` for
  ``GRPOLoss``), the update (``ppo_update`` for ``loss(data).backward(); optim.step()``) and, with
  SGLang, the weight sync (``TorchRLBackend(policy).sync_weights`` for TorchRL's sync scheme).

Run:  python examples/torchrl_llm_critic.py --iterations 30 [--engine sglang [--url URL]]

Each iteration prints the reward, the finish of the responses, the loss, the ratio statistics of
the first mini-batch (exactly 1: the anchors are recomputed over the same micro-batches the first
training forward uses, docs/design.md section 4), the value head's gradient norm and, with SGLang,
the largest gap between the server's log-probs and the trainer's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from pathlib import Path

import torch
from tensordict import set_list_to_stack
from torch.utils.data import DataLoader
from torchrl.collectors.llm import LLMCollector
from torchrl.data import Unbounded
from torchrl.envs import StepCounter, Transform
from torchrl.envs.llm import DatasetChatEnv
from torchrl.modules.llm import SGLangWrapper, TransformersWrapper

from ar_torchrl.backends.torchrl import TorchRLBackend
from ar_torchrl.data import arithmetic_dataset
from ar_torchrl.interop import TokenTrajectory
from ar_torchrl.models import build_char_tokenizer, build_tiny_qwen3
from ar_torchrl.models.config import warm_started_tiny_model
from ar_torchrl.modules import LMActorCritic, attach_value_head
from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
from ar_torchrl.rewards import dapo_math_reward
from ar_torchrl.training import plan_micro_batches, ppo_update, recompute_old_log_probs_and_values
from ar_torchrl.weight_sync import named_policy_tensors


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


@contextlib.contextmanager
def sglang_server(url: str | None, model, tokenizer):
    """``url``, or a server launched here on the policy's weights (stopped at the end)."""
    if url is not None:
        yield url
        return
    from ar_torchrl.backends.sglang.launcher import launch_sglang_server
    from ar_torchrl.modules import save_policy

    with tempfile.TemporaryDirectory(prefix="torchrl_llm_critic-") as tmp:
        model_dir = save_policy(model, Path(tmp) / "policy", tokenizer)
        with launch_sglang_server(model_dir, log_file=Path(tmp) / "server.log") as server:
            yield server.url


def make_policy(engine: str, model, tok, url: str | None, max_new_tokens: int):
    """TorchRL's policy, as a TorchRL user writes it. The pad id is banned for transformers:
    TorchRL 0.14.1 drops generated tokens equal to it (``from_policy`` refuses a policy that
    allows it); SGLang keeps every token."""
    if engine == "transformers":
        return TransformersWrapper(
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
    from torchrl.modules.llm.backends.sglang import AsyncSGLang

    return SGLangWrapper(
        AsyncSGLang.connect(url),
        tokenizer=tok,
        input_mode="history",
        return_log_probs=True,
        generate_kwargs={"max_new_tokens": max_new_tokens, "temperature": 1.0},
    )


def main(
    iterations: int = 30,
    *,
    engine: str = "transformers",
    url: str | None = None,
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
    if engine not in ("transformers", "sglang"):
        raise ValueError(f"--engine must be transformers or sglang, got {engine!r}")

    # The policy being trained: the tiny Qwen3 and its character tokenizer, optionally
    # warm-started on the answer format (cached; the same run as examples/compose_torchrl.py).
    if (
        warm_start
    ):  # the recipe's own warm start and its cache entry (ar_torchrl/configs/model/tiny.yaml)
        cache = Path(os.environ.get("AR_TORCHRL_CACHE", Path.home() / ".cache" / "ar_torchrl"))
        model, tok = warm_started_tiny_model(cache)
    else:
        tok = build_char_tokenizer()
        model = build_tiny_qwen3(len(tok))
    tok.padding_side = "left"
    model = attach_value_head(model)  # [ar_torchrl +] V(s) = 0 at start; generation is unchanged

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

    with contextlib.ExitStack() as stack:
        if engine == "sglang":
            url = stack.enter_context(sglang_server(url, model, tok))
        policy = make_policy(engine, model, tok, url, max_new_tokens)
        # SGLang's log-probs are right: keep them as rollout_log_prob (TorchRL 0.14.1's
        # TransformersWrapper zeroes the first token's: drop them, the trainer recomputes anyway)
        keep = {"rollout_log_prob": "raise"} if engine == "sglang" else {}
        to_trajectory = TokenTrajectory.from_policy(policy, **keep)  # [ar_torchrl converter]

        # TorchRL collector; its postproc turns each batch into the [B, L] token trajectory.
        collector = LLMCollector(
            env,
            policy=policy,
            dialog_turns_per_batch=batch,
            total_dialog_turns=iterations * batch,
            track_policy_version=True,
            postproc=to_trajectory,  # TorchRL batch -> [B, L] token trajectory
        )
        stack.callback(collector.shutdown)

        # The weight sync (SGLang only; the transformers policy samples with this very model).
        if engine == "sglang":
            sync = stack.enter_context(TorchRLBackend(policy))  # [ar_torchrl ~] the sync scheme

        # Critic and loss: one backbone forward gives log-probs and values.
        actor_critic = LMActorCritic(model)  # [ar_torchrl ~] TorchRL's training wrapper
        gae = TokenGAE(gamma=1.0, lmbda=0.95, normalize_advantage=True)  # [ar_torchrl +]
        loss_module = TokenPPOLoss(actor_critic, clip_epsilon=0.2, clip_value=0.2)  # [ar_torchrl ~]
        optim = torch.optim.AdamW(loss_module.parameters(), lr=lr)
        shuffle = torch.Generator().manual_seed(seed)

        history = []
        for i, data in enumerate(collector):  # data: [B, L], each token a time step
            plan = plan_micro_batches(data, token_budget=512)  # [ar_torchrl +]
            recompute_old_log_probs_and_values(actor_critic, data, plan)  # [ar_torchrl +]
            gae(data)  # [ar_torchrl +] writes "advantage" and "value_target"
            engine_gap = _engine_gap(data)  # the server's log-probs vs the trainer's (anchors)
            with first_minibatch(loss_module, optim) as first:
                metrics = ppo_update(  # [ar_torchrl ~] epochs x mini-batches x micro-batches
                    loss_module,
                    optim,
                    data,
                    plan,
                    epochs=epochs,
                    num_minibatches=num_minibatches,
                    generator=shuffle,
                )
            if engine == "sglang":
                sync.sync_weights(named_policy_tensors(model), i + 1)  # [ar_torchrl ~] the sync
            collector.increment_version()
            history.append(_row(data, first, model, metrics, engine_gap))
            _print(i, history[-1], metrics)
    return history


def _engine_gap(data) -> float | None:
    """``max |rollout_log_prob - sample_log_prob|`` over the trained tokens (engine vs trainer)."""
    if "rollout_log_prob" not in data.keys():
        return None
    mask = data["loss_mask"]
    return float((data["rollout_log_prob"] - data["sample_log_prob"])[mask].abs().max())


def _row(data, first, model, metrics, engine_gap) -> dict[str, float]:
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
    if engine_gap is not None:
        row["engine_log_prob_max_abs_diff"] = engine_gap
    return row


def _print(i: int, row: dict[str, float], metrics: dict[str, float]) -> None:
    gap = row.get("engine_log_prob_max_abs_diff")
    print(
        f"iter {i:3d}  reward {row['reward']:+.3f}  terminated {row['terminated']:.2f}  "
        f"L {row['width']}  loss {metrics['train/loss_objective']:+.4f}  "
        f"critic {metrics['train/loss_critic']:.4f}  "
        f"first-minibatch ratio min {row['first_min_ratio']!r} max {row['first_max_ratio']!r} "
        f"({row['first_micro_batches']} micro-batches)  "
        f"value-head grad {row['value_head_grad_norm']:.3e}"
        + ("" if gap is None else f"  engine log-prob gap {gap:.2e}")
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--engine", choices=("transformers", "sglang"), default="transformers")
    parser.add_argument("--url", default=None, help="a running SGLang server (--engine sglang)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warm-start",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start from the cached supervised warm start (the answer format)",
    )
    args = parser.parse_args()
    main(
        args.iterations,
        engine=args.engine,
        url=args.url,
        warm_start=args.warm_start,
        seed=args.seed,
    )
