"""What the backend comparisons (``compare_backends_ppo.py``, ``compare_backends_smollm2.py``) share.

The backend under test (trainside, or a real SGLang server: launched here or given by URL), one PPO
step per rollout (anchors, GAE, one update of one mini-batch, weight push), both backends run one
after the other with the same seed, and the JSON result.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ar_torchrl.backends import TransformersBackend
from ar_torchrl.modules import save_policy
from ar_torchrl.training import plan_micro_batches, ppo_update, recompute_old_log_probs_and_values
from ar_torchrl.weight_sync import named_policy_tensors

BACKENDS = ("trainside", "sglang")


def make_backend(
    name: str,
    model,
    tok,
    stack: contextlib.ExitStack,
    *,
    seed: int,
    url: str | None = None,
    vocab_size: int | None = None,
    timeout_s: float = 600,
):
    """The backend ``name`` over ``model``, closed by ``stack``.

    ``sglang`` without ``url`` launches a local server on the saved policy (removed with the stack);
    with ``url`` the running server first receives the starting policy (it holds other weights).
    """
    if name == "trainside":
        backend = TransformersBackend(model, seed=seed)
        stack.callback(backend.close)
        return backend
    from ar_torchrl.backends.sglang import SGLangBackend, SGLangClientOptions, launch_sglang_server

    if url is None:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cmp-sglang-")))
        model_dir = save_policy(model, tmp / "model", tok)
        server = launch_sglang_server(model_dir, timeout_s=timeout_s, log_file=tmp / "server.log")
        url_to_use = stack.enter_context(server).url
    else:
        url_to_use = url
    backend = SGLangBackend(
        url_to_use,
        weight_sync="disk",
        options=SGLangClientOptions(vocab_size=vocab_size, show_progress=False),
    )
    stack.callback(backend.close)
    if url is not None:
        backend.sync_weights(named_policy_tensors(model), version=0)
    return backend


def ppo_step(
    env,
    actor_critic,
    loss_fn,
    optimizer,
    gae,
    backend,
    on_anchors: Callable[[Any], dict] | None = None,
) -> tuple[Any, dict, dict]:
    """One rollout, its anchors, GAE, one PPO update (one mini-batch, grad clip 1), the weight push.

    ``on_anchors(td)`` measures the batch right after the anchor pass (before the update).
    Returns the batch, the update's metrics and the row both comparisons report.
    """
    td = env.collect()
    plan = plan_micro_batches(td, token_budget=4096)
    recompute_old_log_probs_and_values(actor_critic, td, plan)
    extra = on_anchors(td) if on_anchors is not None else {}
    td = gae(td)
    out = ppo_update(loss_fn, optimizer, td, plan, epochs=1, num_minibatches=1, grad_clip=1.0)
    model = actor_critic.model
    backend.sync_weights(named_policy_tensors(model), version=backend.policy_version + 1)
    row = {
        "loss": out["train/loss_objective"] + out["train/loss_critic"],
        "mean_ratio": out["train/mean_ratio"],
        **extra,
        "grad_norm": out["train/grad_norm"],
        "reward_mean": float(td["next", "reward"].sum((-2, -1)).mean()),
        "response_tokens": int(td["loss_mask"].sum()),
        "tokens": td["tokens"][td["loss_mask"]].tolist(),
    }
    return td, out, row


def run_both(run: Callable[[str, Any, contextlib.ExitStack], list[dict]], args):
    """``run(name, args, stack)`` for each backend, one after the other: (rows, wall seconds)."""
    torch.set_num_threads(1)
    results, seconds = {}, {}
    for name in BACKENDS:
        start = time.perf_counter()
        with contextlib.ExitStack() as stack:
            results[name] = run(name, args, stack)
        seconds[name] = time.perf_counter() - start
    return results, seconds


def write_result(out: Path, results: dict[str, list[dict]], **fields) -> None:
    """The JSON result: the rows (without their sampled tokens), ``fields`` and the machine."""
    rollouts = {
        name: [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
        for name, rows in results.items()
    }
    machine = f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rollouts": rollouts, **fields, "machine": machine}, indent=2))
    print(f"wrote {out}")
