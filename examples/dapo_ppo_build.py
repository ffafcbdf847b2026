"""The recipe's building blocks: data, model, rollout engine, environments, advantage, optimizer.

Each turns one part of the configuration (examples/dapo_ppo_config.py) into library objects;
dapo_ppo_recipe.py's ``setup`` calls them in order (and, under FSDP2, dapo_ppo_dist.py's sharding).
"""

from __future__ import annotations

import contextlib
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from dapo_ppo_config import (
    ArithmeticDataConfig,
    Config,
    FewshotArithmeticDataConfig,
    SmolLM2ModelConfig,
    TinyModelConfig,
    TrainsideBackendConfig,
)

from ar_torchrl.backends import SamplingParams, TransformersBackend
from ar_torchrl.data.datasets import arithmetic_dataset, load_dapo_math, train_holdout_split
from ar_torchrl.data.tasks import arithmetic_task_split
from ar_torchrl.envs import LLMEnv
from ar_torchrl.models import build_tiny_model, check_tokenizer, load_hf_model, load_smollm2_135m
from ar_torchrl.modules import save_policy
from ar_torchrl.objectives import make_advantage
from ar_torchrl.warmstart import cached_warm_start
from ar_torchrl.weight_sync import named_policy_tensors

log = logging.getLogger("dapo_ppo")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_datasets(cfg: Config) -> tuple[list[dict], list[dict]]:
    """Training rows and held-out evaluation rows (DAPO-Math schema)."""
    d = cfg.data
    if isinstance(d, FewshotArithmeticDataConfig):  # disjoint train/held-out problems
        train_rows, eval_rows = arithmetic_task_split(
            d.num_rows,
            d.holdout,
            ops=list(d.ops),
            min_operand=d.min_operand,
            max_operand=d.max_operand,
            shots=d.shots,
            seed=d.seed,
        )
        return list(train_rows), list(eval_rows)[: cfg.train.eval_prompts]
    if isinstance(d, ArithmeticDataConfig):
        rows = arithmetic_dataset(
            d.num_rows, seed=d.seed, template=d.template, max_operand=d.max_operand
        )
    else:
        rows = load_dapo_math(d.path, skip_invalid=d.skip_invalid, limit=d.limit)
        if rows.num_skipped:
            log.warning("data: skipped %d malformed rows of %s", rows.num_skipped, d.path)
    train_rows, eval_rows = train_holdout_split(rows, d.holdout, seed=d.seed)
    return list(train_rows), list(eval_rows)[: cfg.train.eval_prompts]


def build_model(cfg: Config):
    """The starting policy (before the value head) and its tokenizer; warm-started when configured."""
    m = cfg.model
    if isinstance(m, TinyModelConfig):
        model, tok = build_tiny_model(
            hidden_size=m.hidden_size,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            seed=m.init_seed,
        )
        source = "model=tiny"
    elif isinstance(m, SmolLM2ModelConfig):
        model, tok = load_smollm2_135m(cfg.cache_dir)
        source = "model=smollm2_135m"
    else:
        model, tok = load_hf_model(m.path, dtype=m.dtype, attn_implementation=m.attn_implementation)
        source = f"model.path={m.path}"
    check_tokenizer(tok, where=f"the tokenizer of {source}")
    ws = m.warm_start
    if ws.enabled:
        rows = arithmetic_dataset(ws.num_rows, seed=ws.data_seed, template=ws.template)
        model, _ = cached_warm_start(
            model,
            tok,
            list(rows),
            cache_dir=Path(cfg.cache_dir) / "warmstart",
            steps=ws.steps,
            batch_size=ws.batch_size,
            lr=ws.lr,
            final_lr_ratio=ws.final_lr_ratio,
            correct_fraction=ws.correct_fraction,
            seed=ws.data_seed,
        )
    return model, tok


def build_backend(
    cfg: Config,
    model,
    tokenizer,
    run_dir: Path,
    stack: contextlib.ExitStack,
    *,
    start_dir: Path | None = None,
):
    """The rollout engine: a private copy of the policy in this process, or an SGLang server.

    ``start_dir``: the HF directory of the starting policy when ``model`` has no weights in this
    process (a pretrained model built on the meta device and loaded shard by shard under FSDP2):
    the trainside copy and a launched server load it from there; a running server gets it from
    the sharded policy (``push_weights`` in ``setup``). The engine computes in ``model.dtype``.
    """
    b = cfg.backend
    if isinstance(b, TrainsideBackendConfig):
        if start_dir is not None:  # the engine's own full copy, on this rank's device
            model = load_hf_model(start_dir, dtype=cfg.model.dtype)[0].to(cfg.device)
        backend = TransformersBackend(
            model, mode="copy", max_batch_size=b.max_batch_size, seed=cfg.seed
        )
        backend.model.to(
            getattr(torch, cfg.model.dtype)
        )  # it computes in model.dtype (float32: as is)
        stack.callback(backend.close)
        return backend
    from ar_torchrl.backends.sglang import (
        SGLangBackend,
        SGLangUnavailableError,
        launch_sglang_server,
    )

    url = b.url  # one URL, a list of them, or an sglang-router URL
    if url is None:  # launch a local server on the starting policy, stopped when the run ends
        model_dir = start_dir
        if model_dir is None:  # the server's start weights: deleted when it stops
            model_dir = run_dir / "sglang_model"
            stack.callback(shutil.rmtree, model_dir, ignore_errors=True)
            save_policy(model, model_dir, tokenizer)
        server = stack.enter_context(
            launch_sglang_server(
                model_dir,
                python=b.python,
                device=b.device,
                extra_args=list(b.extra_args),
                log_file=run_dir / "sglang_server.log",
            )
        )
        url = server.url
    urls = [url] if isinstance(url, str) else list(url)
    backend = SGLangBackend(
        urls,
        weight_sync=b.weight_sync,
        weight_sync_options=dict(b.weight_sync_options),
        vocab_size=model.config.vocab_size,
        show_progress=False,
    )
    stack.callback(backend.close)
    if not backend.health():  # said once, before anything reads as a weight-sync failure
        raise SGLangUnavailableError(
            f"backend.url={urls}: no SGLang server answers GET /health there; start it (or set "
            "backend.url=null to launch one) and check the URL"
        )
    if b.url is not None and start_dir is None:  # a running server holds other weights
        backend.sync_weights(named_policy_tensors(model), version=0)
    return backend


def build_envs(cfg: Config, rows, eval_rows, tokenizer, backend, model) -> tuple[LLMEnv, LLMEnv]:
    """Prompts in, scored token trajectories out: sampled for training, greedy for evaluation."""
    r = cfg.rollout
    sampling = SamplingParams(
        max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k
    )
    env = LLMEnv(
        rows,
        tokenizer,
        backend,
        num_samples=r.samples_per_prompt,
        prompts_per_batch=r.prompts_per_iter,
        sampling=sampling,
        overlong_buffer_len=r.overlong_buffer,
        overlong_penalty_factor=r.overlong_penalty,
        seed=cfg.seed,
    )
    # Evaluation decodes greedily from the trainer's own weights (trainside) or the server; under
    # FSDP2 the trainer holds shards: the rollout copy, synced after each update, decodes instead.
    trainside = isinstance(cfg.backend, TrainsideBackendConfig) and not cfg.sharded
    eval_backend = TransformersBackend(model, mode="share") if trainside else backend
    greedy = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0)
    eval_env = LLMEnv(
        eval_rows,
        tokenizer,
        eval_backend,
        num_samples=1,
        prompts_per_batch=len(eval_rows),
        sampling=greedy,
        shuffle=False,
    )
    return env, eval_env


def build_advantage(cfg: Config):
    """``algo.advantage_mode`` from the registry; the value head (critic_coeff > 0) is its critic.

    GRPO with a value head trains the head on Monte-Carlo returns (README: the one-key swap).
    Zero-spread groups are left to the collector's dynamic sampling (:func:`dynamic_sampling`).
    """
    a = cfg.algo
    kwargs = a.advantage_kwargs()
    kwargs.pop("drop_zero_spread", None)
    return make_advantage(a.advantage_mode, critic=a.critic_coeff > 0, **kwargs)


def dynamic_sampling(cfg: Config) -> bool:
    """DAPO dynamic sampling (refill with groups whose rewards differ): ``rollout.dynamic_sampling``,
    or its older spelling ``algo.grpo.drop_zero_spread`` (which applies with GRPO only)."""
    grpo = cfg.algo.advantage_mode == "grpo" and cfg.algo.grpo.drop_zero_spread
    return bool(cfg.rollout.dynamic_sampling or grpo)


def build_optimizer(cfg: Config, model) -> torch.optim.Optimizer:
    """AdamW with its own param group (learning rate) for the value head."""
    a = cfg.algo
    head = list(model.value_head.parameters())
    head_ids = {id(p) for p in head}
    policy = [p for p in model.parameters() if id(p) not in head_ids]
    groups = [{"params": policy, "lr": a.lr, "name": "policy"}]
    if a.critic_coeff > 0:
        value_lr = a.lr if a.value_lr is None else a.value_lr  # 0: a frozen head
        groups.append({"params": head, "lr": value_lr, "name": "value_head"})
    return torch.optim.AdamW(groups, weight_decay=a.weight_decay)
