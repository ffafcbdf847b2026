"""Multi-process workers for tests/distributed/test_distributed.py: each function runs as one rank of a gloo group.

:func:`spawn` starts ``world_size`` processes with ``torch.multiprocessing`` (spawn), waits with a
deadline and kills every one of them (by their own handles) on failure or timeout; each worker also
exits on its own when the test process dies. Workers write their results under ``out``; the test
process compares them with single-process references it computes itself.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from ar_torchrl.checkpoint import sharded as sharded_checkpoint
from ar_torchrl.distributed import (
    broadcast_batch,
    build_meta_model,
    close_distributed,
    init_distributed,
    load_pretrained_weights,
    push_weights,
    recompute_sharded_old_log_probs_and_values,
    reshard,
    shard_actor_critic,
    shard_plan,
)
from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.modules import (
    LMActorCritic,
    LMCritic,
    attach_confidence_features,
    attach_value_head,
    save_policy,
)
from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
from ar_torchrl.training import plan_micro_batches, ppo_update, recompute_old_log_probs_and_values
from support.trajectories import VOCAB, make_trajectory, shared_prompt_batch, with_confidence

PROMPTS = [3, 1, 4, 2, 5, 1, 3, 2, 4]
RESPONSES = [5, 2, 7, 1, 3, 6, 4, 8, 2]
BUDGET = 20  # 5 micro-batches: 3 + 2 over 2 ranks, so rank 1 runs padding passes


# --------------------------------------------------------------------------- shared with the tests
def actor_critic(seed: int, bf16_init: bool = False) -> LMActorCritic:
    model = build_tiny_qwen3(VOCAB, hidden_size=32, num_heads=2, seed=seed)
    if bf16_init:
        model = model.to(torch.bfloat16)
    return LMActorCritic(attach_value_head(model))


def batch(seed: int = 0):
    return make_trajectory(PROMPTS, RESPONSES, seed=seed)


def ppo_loss(ac: LMActorCritic, mode: str = "token_mean", critic=None) -> TokenPPOLoss:
    return TokenPPOLoss(ac, critic, clip_epsilon=(0.2, 0.28), clip_value=0.2, loss_agg_mode=mode)


def actor_and_critic(seed: int) -> tuple[LMActorCritic, LMCritic]:
    """An actor (no value head) and a separate critic over another tiny Qwen3 (non-zero head)."""
    actor = LMActorCritic(
        build_tiny_qwen3(VOCAB, hidden_size=32, num_heads=2, seed=seed), critic=False
    )
    critic_model = attach_value_head(
        build_tiny_qwen3(VOCAB, hidden_size=32, num_heads=2, seed=seed + 50)
    )
    torch.manual_seed(seed)
    torch.nn.init.normal_(critic_model.value_head.weight, std=0.5)
    return actor, LMCritic(critic_model)


def separate_optimizer(actor, critic, lr: float = 0.05, kind=torch.optim.SGD):
    """``kind`` (SGD) with the critic in its own, separately clipped group (as the recipe builds
    its AdamW)."""
    return kind(
        [
            {"params": list(actor.parameters()), "name": "policy"},
            {"params": list(critic.parameters()), "name": "critic", "clip_group": "critic"},
        ],
        lr=lr,
    )


def prepare(ac, td, plan, sharded=None):
    """Anchors (per rank when ``sharded``) and whitened GAE advantages over the whole batch."""
    if sharded is None:
        recompute_old_log_probs_and_values(ac, td, plan)
    else:
        recompute_sharded_old_log_probs_and_values(ac, td, sharded)
    return TokenGAE(gamma=1.0, lmbda=0.95, normalize_advantage=True)(td)


def compared_update(loss, opt, td, plan) -> dict:
    """The update that the 2-rank checks and their one-process references both run: 2 epochs,
    gradients clipped at 0.05 (active on these batches), the micro-batch order seeded."""
    return ppo_update(
        loss, opt, td, plan, epochs=2, grad_clip=0.05, generator=torch.Generator().manual_seed(0)
    )


def first_update_ratios(ac, loss, td, sharded) -> list:
    """Every rank's ``[min, max]`` ratio of each micro-batch it owns at the old weights (the same
    number of forwards on both ranks: padding passes included, not reported), gathered."""
    ratios = []
    for mb in sharded.local_plan.micro_batches:
        res = loss(sharded.crop(td, mb))
        if not mb.padding:
            ratios.append([res["min_ratio"].item(), res["max_ratio"].item()])
    reshard(ac)  # forwards without backward leave FSDP2's root gathered
    gathered = [None] * sharded.world_size
    torch.distributed.all_gather_object(gathered, ratios)
    return gathered


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank: the full fp32 tensors of ``module.state_dict()`` (collective under FSDP)."""
    out = {}
    for name, t in module.state_dict().items():
        t = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = t.detach().float().clone().contiguous()
    return out


# --------------------------------------------------------------------------- process management
def spawn(fn, world_size: int, out: Path, timeout_s: float = 900.0) -> None:
    """Run ``fn(ctx, out)`` on ``world_size`` ranks; raise if one fails; no process outlives this."""
    procs = mp.start_processes(
        _entry,
        args=(fn, world_size, str(out), os.getpid()),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not procs.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__}: ranks still running after {timeout_s} s")
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


def _exit_with_parent(parent: int) -> None:
    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def _entry(rank: int, fn, world_size: int, out: str, parent: int) -> None:
    _exit_with_parent(parent)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    ctx = init_distributed("cpu", init_method=f"file://{out}/store", timeout_s=300)
    try:
        fn(ctx, Path(out))
        # every rank past its last collective before any rank tears the group down (one CI run
        # saw rank 1 abort in teardown, "terminate called without an active exception", after
        # the last check's writes while rank 0 was still finishing them; not reproduced here)
        torch.distributed.barrier()
    finally:
        close_distributed(ctx)


def _save(ctx, out: Path, name: str, tensors: dict | None = None, data: dict | None = None):
    if ctx.is_main:
        if tensors is not None:
            save_file(tensors, str(out / f"{name}.safetensors"))
        if data is not None:
            (out / f"{name}.json").write_text(json.dumps(data))


# --------------------------------------------------------------------------- the checks
def train_checks(ctx, out: Path) -> None:
    """2-rank ppo_update (fp32) for two aggregation modes; bf16 masters; first-update ratios."""
    for mode, checkpointing in (("token_mean", False), ("seq_mean_token_mean", True)):
        ac = shard_actor_critic(
            actor_critic(seed=1),
            ctx,
            compute_dtype="float32",
            activation_checkpointing=checkpointing,
        )
        opt = torch.optim.SGD(ac.parameters(), lr=0.5)
        td = broadcast_batch(batch() if ctx.is_main else None, ctx)
        sharded = shard_plan(plan_micro_batches(td, BUDGET), td, rank=ctx.rank, world_size=2)
        td = prepare(ac, td, None, sharded)
        metrics = compared_update(ppo_loss(ac, mode), opt, td, sharded)
        padding = [len(sharded.local_plan) - len(sharded.owned(r)) for r in range(2)]
        _save(
            ctx,
            out,
            f"equal_{mode}",
            full_state(ac.model),
            {"metrics": metrics, "padding": padding, "tokens": sharded.rank_tokens()},
        )
    _bf16_checks(ctx, out)


def _bf16_checks(ctx, out: Path) -> None:
    ac = shard_actor_critic(actor_critic(seed=2, bf16_init=True), ctx, compute_dtype="bfloat16")
    seen = {}

    def record(name):  # the dtype of the parameter a module computes with, during its forward
        def hook(module, args):
            seen.setdefault(name, str(module.weight.dtype))

        return hook

    ac.model.value_head.register_forward_pre_hook(record("value_head"))
    ac.model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(record("q_proj"))
    opt = torch.optim.AdamW(ac.parameters(), lr=1e-6, weight_decay=0.0)
    td = broadcast_batch(batch() if ctx.is_main else None, ctx)
    sharded = shard_plan(plan_micro_batches(td, BUDGET), td, rank=ctx.rank, world_size=2)
    td = prepare(ac, td, None, sharded)
    loss = ppo_loss(ac)
    all_ratios = first_update_ratios(ac, loss, td, sharded)
    policy = [p for n, p in ac.named_parameters() if "value_head" not in n]
    before = [p.to_local().detach().clone() for p in policy]
    ppo_update(loss, opt, td, sharded, grad_clip=1.0)
    changed = sum(int((p.to_local() != b).sum()) for p, b in zip(policy, before))
    counts = ctx.all_reduce(torch.tensor([changed, sum(b.numel() for b in before)]))
    _save(
        ctx,
        out,
        "bf16",
        data={
            "changed": counts.tolist(),
            "ratios": all_ratios,
            "dtypes": {
                **seen,
                "state_value": str(td["state_value"].dtype),
                "master": str(policy[0].dtype),
            },
        },
    )


class Recorder:
    """A recording weight sender (the ``send(named_tensors, version)`` protocol), test only;
    ``sync(version)`` is the consumer :func:`push_weights` calls (as ``backend.sync_weights``)."""

    def __init__(self, fail_after: int | None = None):
        self.fail_after, self.tensors, self.version = fail_after, {}, None

    def send(self, named_tensors, version: int) -> None:
        self.version = version
        for i, (name, tensor) in enumerate(named_tensors):
            if self.fail_after is not None and i == self.fail_after:
                raise ConnectionError("rollout engine went away")
            self.tensors[name] = tensor.clone()

    def sync(self, version: int):
        return lambda named_tensors: self.send(named_tensors, version)


def load_checks(ctx, out: Path) -> None:
    """Meta-device + sharded load vs eager; value head from its file; the weight push."""
    base, policy = out / "base", out / "policy"
    if ctx.is_main:
        build_tiny_qwen3(VOCAB, hidden_size=32, num_heads=2, seed=3).to(
            torch.bfloat16
        ).save_pretrained(base, max_shard_size="40KB")
        model = attach_value_head(build_tiny_qwen3(VOCAB, hidden_size=32, num_heads=2, seed=4))
        torch.nn.init.normal_(model.value_head.weight)
        save_policy(model, policy)
    ctx.barrier()
    for name, path in (("base", base), ("policy", policy)):
        for suffix in ("", "_confidence"):  # and with confidence features the files lack
            model = build_meta_model(path)
            if suffix:
                attach_confidence_features(model)
            ac = shard_actor_critic(LMActorCritic(model), ctx)
            report = load_pretrained_weights(ac, path, device=ctx.device)
            files = len(list(path.glob("*.safetensors")))
            _save(
                ctx,
                out,
                f"meta_{name}{suffix}",
                full_state(ac.model),
                {"files": files, "value_head": report["value_head"]},
            )
    recorder = Recorder() if ctx.is_main else None
    push_weights(ac, ctx, recorder.sync(7) if ctx.is_main else None, dtype=torch.bfloat16)
    errors = []
    try:
        push_weights(ac, ctx, Recorder(fail_after=3).sync(8) if ctx.is_main else None)
    except Exception as err:  # noqa: BLE001 - recorded for the test
        errors.append(f"{type(err).__name__}: {err}")
    all_errors = [None, None]
    torch.distributed.all_gather_object(all_errors, errors)
    if ctx.is_main:
        _save(
            ctx,
            out,
            "push",
            recorder.tensors,
            {"version": recorder.version, "names": list(recorder.tensors), "errors": all_errors},
        )


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _train_steps(ac, opt, ctx, steps, gen, ckpt=None, save_at=()):
    metrics = []
    for step in steps:
        td = None
        if ctx.is_main:  # the rollout: drawn from rank 0's global RNG
            lengths = torch.randint(1, 6, (2, 6))
            td = make_trajectory(lengths[0].tolist(), lengths[1].tolist(), seed=int(lengths.sum()))
        td = broadcast_batch(td, ctx)
        sharded = shard_plan(plan_micro_batches(td, 16), td, rank=ctx.rank, world_size=2)
        td = prepare(ac, td, None, sharded)
        metrics.append(
            ppo_update(
                ppo_loss(ac),
                opt,
                td,
                sharded,
                epochs=2,
                num_minibatches=2,
                grad_clip=1.0,
                generator=gen,
            )
        )
        if step in save_at:
            sharded_checkpoint.save(
                ckpt,
                step=step,
                model=ac,
                optimizer=opt,
                ctx=ctx,
                extra={"shuffle": gen.get_state(), "note": "x"},
            )
    return metrics


def resume_checks(ctx, out: Path) -> None:
    """Uninterrupted 4 steps vs resume from step 2 after the step-4 checkpoint was truncated."""
    ckpt = out / "ckpt"
    torch.manual_seed(100)
    ac = shard_actor_critic(actor_critic(seed=5), ctx, compute_dtype="bfloat16")
    opt = torch.optim.AdamW(ac.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    straight = _train_steps(ac, opt, ctx, range(1, 5), gen, ckpt, save_at=(2, 4))
    final = full_state(ac.model)
    if ctx.is_main:
        damaged = ckpt / "step_4" / "__1_0.distcp"
        damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    ctx.barrier()
    handler = _Collect()
    logging.getLogger("ar_torchrl.checkpoint.sharded").addHandler(handler)
    path = sharded_checkpoint.latest(ckpt, ctx)
    torch.manual_seed(999)  # a fresh process: other weights, other RNG states
    ac2 = shard_actor_critic(actor_critic(seed=6), ctx, compute_dtype="bfloat16")
    opt2 = torch.optim.AdamW(ac2.parameters(), lr=1e-3)
    state = sharded_checkpoint.load(path, model=ac2, optimizer=opt2, ctx=ctx)
    gen2 = torch.Generator()
    gen2.set_state(state["extra"]["shuffle"])
    resumed = _train_steps(ac2, opt2, ctx, range(state["step"] + 1, 5), gen2)
    again = full_state(ac2.model)
    same = all(torch.equal(final[k], again[k]) for k in final)
    _save(
        ctx,
        out,
        "resume",
        data={
            "straight": straight,
            "resumed": resumed,
            "path": str(path),
            "step": state["step"],
            "warnings": handler.messages,
            "same_params": same,
            "note": state["extra"]["note"],
        },
    )


def _separate_steps(actor, critic, opt, ctx, steps, gen, ckpt=None, save_at=()):
    """PPO steps with a separate critic on 2 ranks (batches from rank 0's RNG)."""
    metrics = []
    for step in steps:
        td = None
        if ctx.is_main:
            lengths = torch.randint(1, 6, (2, 6))
            td = make_trajectory(lengths[0].tolist(), lengths[1].tolist(), seed=int(lengths.sum()))
        td = broadcast_batch(td, ctx)
        sharded = shard_plan(plan_micro_batches(td, 16), td, rank=ctx.rank, world_size=2)
        loss = ppo_loss(actor, critic=critic)
        recompute_sharded_old_log_probs_and_values(actor, td, sharded, loss=loss)
        td = TokenGAE(gamma=1.0, lmbda=0.95, normalize_advantage=True)(td)
        metrics.append(ppo_update(loss, opt, td, sharded, epochs=2, grad_clip=1.0, generator=gen))
        if step in save_at:
            both = torch.nn.ModuleDict({"policy": actor, "critic": critic})
            sharded_checkpoint.save(
                ckpt, step=step, model=both, optimizer=opt, ctx=ctx, extra={"g": gen.get_state()}
            )
    return metrics


def _both_states(actor, critic) -> dict[str, torch.Tensor]:
    """Full tensors of both models, ``actor.*`` and ``critic.*`` (collective under FSDP)."""
    state = {f"actor.{k}": v for k, v in full_state(actor.model).items()}
    return state | {f"critic.{k}": v for k, v in full_state(critic.model).items()}


def separate_critic_checks(ctx, out: Path) -> None:
    """critic=separate on 2 ranks: one ppo_update equals one process (the test computes it);
    3 steps straight vs resumed from the step-1 checkpoint of both models; the critic of that
    checkpoint loaded alone (warm start) equals the saved one."""
    actor, critic = actor_and_critic(seed=7)
    actor = shard_actor_critic(actor, ctx, compute_dtype="float32")
    critic = shard_actor_critic(critic, ctx, compute_dtype="float32")
    opt = separate_optimizer(actor, critic)
    td = broadcast_batch(batch(seed=3) if ctx.is_main else None, ctx)
    sharded = shard_plan(plan_micro_batches(td, BUDGET), td, rank=ctx.rank, world_size=2)
    loss = ppo_loss(actor, critic=critic)
    recompute_sharded_old_log_probs_and_values(actor, td, sharded, loss=loss)
    td = TokenGAE(gamma=1.0, lmbda=0.95, normalize_advantage=True)(td)
    metrics = compared_update(loss, opt, td, sharded)
    _save(ctx, out, "separate_equal", _both_states(actor, critic), {"metrics": metrics})

    ckpt = out / "separate_ckpt"
    torch.manual_seed(200)
    actor, critic = (
        shard_actor_critic(m, ctx, compute_dtype="float32") for m in actor_and_critic(8)
    )
    opt = separate_optimizer(actor, critic, 1e-3, torch.optim.AdamW)
    gen = torch.Generator().manual_seed(0)
    straight = _separate_steps(actor, critic, opt, ctx, range(1, 4), gen, ckpt, save_at=(1,))
    final = _both_states(actor, critic)
    torch.manual_seed(201)
    actor2, critic2 = (
        shard_actor_critic(m, ctx, compute_dtype="float32") for m in actor_and_critic(9)
    )
    opt2 = separate_optimizer(actor2, critic2, 1e-3, torch.optim.AdamW)
    path = ckpt / "step_1"
    loaded = sharded_checkpoint.load(
        path,
        model=torch.nn.ModuleDict({"policy": actor2, "critic": critic2}),
        optimizer=opt2,
        ctx=ctx,
    )
    saved_critic = full_state(critic2.model)  # as the step-1 checkpoint holds it
    gen2 = torch.Generator()
    gen2.set_state(loaded["extra"]["g"])
    resumed = _separate_steps(actor2, critic2, opt2, ctx, range(2, 4), gen2)
    again = _both_states(actor2, critic2)
    _, fresh = actor_and_critic(10)
    fresh = shard_actor_critic(fresh, ctx, compute_dtype="float32")
    what = sharded_checkpoint.load_critic(path, critic=fresh, policy=None, ctx=ctx)
    warm = full_state(fresh.model)
    _save(
        ctx,
        out,
        "separate_resume",
        data={
            "straight": straight,
            "resumed": resumed,
            "same_params": all(torch.equal(final[k], again[k]) for k in final),
            "warm_start_equal": all(torch.equal(saved_critic[k], warm[k]) for k in saved_critic),
            "warm_start_what": what,
        },
    )


def export_checks(ctx, out: Path) -> None:
    """The end-of-run export from 2 FSDP2 ranks (bf16 compute): every rank gathers, rank 0 writes
    ``out/export/{policy,critic}``; what each rank got back."""
    from ar_torchrl.distributed import export_trained

    actor, critic = (
        shard_actor_critic(m, ctx, compute_dtype="bfloat16") for m in actor_and_critic(seed=12)
    )
    written = export_trained(ctx, out / "export", policy=actor, critic=critic)
    per_rank = [None] * ctx.world_size
    torch.distributed.all_gather_object(per_rank, sorted(written))
    _save(ctx, out, "export", data={"per_rank": per_rank})


TREE_BUDGET = 60  # 4 prompts x 3 samples: several tree micro-batches, uneven over 2 ranks


def tree_batch():
    return shared_prompt_batch(groups=4, n=3, seed=11)


def tree_plan(td):
    """Packed shared-prefix micro-batches only (the tree layout: what FSDP2 plans)."""
    return plan_micro_batches(
        td, TREE_BUDGET, packing=True, shared_prefix=True, shared_padded=False
    )


#: the tree checks: name -> (activation checkpointing, confidence features on the value head)
TREE_VARIANTS = {
    "plain": (False, False),
    "checkpointing": (True, False),
    "confidence": (False, True),
}


def tree_actor_critic(confidence: bool) -> LMActorCritic:
    """The tree checks' model; ``confidence``: with ``value_head.confidence`` (non-zero weights,
    so its term changes the values; it is called apart from the head's forward)."""
    ac = actor_critic(seed=21)
    if confidence:
        with_confidence(ac.model, seed=21)
    return ac


def tree_checks(ctx, out: Path) -> None:
    """Packed shared-prefix (tree) micro-batches under FSDP2, with and without activation
    checkpointing, and with confidence features: first-update ratios on every rank, and a 2-epoch
    ppo_update (the one process reference is computed by the test)."""
    for name, (checkpointing, confidence) in TREE_VARIANTS.items():
        ac = shard_actor_critic(
            tree_actor_critic(confidence),
            ctx,
            compute_dtype="float32",
            activation_checkpointing=checkpointing,
        )
        opt = torch.optim.SGD(ac.parameters(), lr=0.5)
        td = broadcast_batch(tree_batch() if ctx.is_main else None, ctx)
        sharded = shard_plan(tree_plan(td), td, rank=ctx.rank, world_size=2)
        td = prepare(ac, td, None, sharded)
        loss = ppo_loss(ac)
        all_ratios = first_update_ratios(ac, loss, td, sharded)
        metrics = compared_update(loss, opt, td, sharded)
        owned = [[bool(mb.shared and mb.packed) for mb in sharded.owned(r)] for r in range(2)]
        _save(
            ctx,
            out,
            f"tree_{name}",
            full_state(ac.model),
            {"metrics": metrics, "ratios": all_ratios, "owned": owned},
        )


def all_checks(ctx, out: Path) -> None:
    """Every multi-process check in one spawn (each spawn costs seconds of imports per rank)."""
    train_checks(ctx, out)
    tree_checks(ctx, out)
    load_checks(ctx, out)
    resume_checks(ctx, out)
    separate_critic_checks(ctx, out)
    export_checks(ctx, out)


def fast_checks(ctx, out: Path) -> None:
    """The checks the fast tier's tests read (bf16 masters and first-update ratios, meta loads and
    the weight push, resuming), when none of the slow ones is selected."""
    _bf16_checks(ctx, out)
    load_checks(ctx, out)
    resume_checks(ctx, out)


# --------------------------------------------------------------------------- Ray rollout (interop.ray)
RAY_ADDRESS_ENV = "AR_TORCHRL_TEST_RAY_ADDRESS"


def engine_weights(collector) -> dict[str, torch.Tensor]:
    """Run in a Ray worker's actor (``RayRollout.run_on_workers``): its engine's weights."""
    return {k: v.clone() for k, v in collector.policy.model.state_dict().items()}


def ray_example():
    """examples/torchrl_ray_critic.py, imported once by path (the examples folder is not a
    package); its factories and this module (:func:`engine_weights`) are pickled by value for
    Ray's workers, where neither folder is importable."""
    import importlib.util
    import sys

    from ray import cloudpickle

    name = "torchrl_ray_critic"
    if name not in sys.modules:
        script = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        module.register_by_value()
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return sys.modules[name]


def shrink_engine(collector) -> bool:
    """Run in a Ray worker's actor: give its engine an embedding of another width (hidden 32
    instead of 64), so that it refuses the learner's next push."""
    model = collector.policy.model
    model.model.embed_tokens.weight = torch.nn.Parameter(torch.zeros(99, 32))
    return True


def collector_is_truthy(collector) -> bool:
    """Run in a Ray worker's actor: ``bool(collector)`` (what Ray evaluates when it stores a
    task's exception)."""
    return bool(collector)


def ray_learner_model():
    """The learner's HF policy for the Ray tests: the example engines' architecture (the char
    vocabulary, hidden 64), not their weights (their samples match only after a sync), and
    weights larger than at init (a freshly initialised tiny model greedily repeats one token)."""
    model = build_tiny_qwen3(99, seed=7)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5, generator=gen)
    return model


def ray_rollout(greedy: bool = True, **kwargs):
    """Two example workers (2 prompts x 2 samples, 6 new tokens each) as a ``RayRollout``."""
    import functools

    from ar_torchrl.interop import TokenTrajectory
    from ar_torchrl.interop.ray import RayRollout
    from ar_torchrl.models import build_char_tokenizer

    ex = ray_example()
    return RayRollout(
        functools.partial(ex.make_env, prompts_per_batch=2, group_size=2, seed=0),
        functools.partial(ex.make_policy, max_new_tokens=6, greedy=greedy),
        num_workers=2,
        dialog_turns_per_batch=4,
        postproc=TokenTrajectory(build_char_tokenizer(), max_new_tokens=6),
        **kwargs,
    )


def ray_publish_checks(ctx, out: Path) -> None:
    """An FSDP2 learner on 2 ranks drives a RayRollout from rank 0 (the Ray cluster of the test,
    ``$AR_TORCHRL_TEST_RAY_ADDRESS``): rank 0 publishes its lazy FullTensorStream over the weight
    group while rank 1 drains its own (the gathers in lockstep); the learner's default group still
    works afterwards. Rank 0 saves the workers' engine weights and the full policy."""
    from ar_torchrl.distributed import FullTensorStream

    model = ray_learner_model()
    ac = shard_actor_critic(LMActorCritic(attach_value_head(model)), ctx, compute_dtype="float32")
    rollout = None
    if ctx.is_main:
        import ray

        ray.init(address=os.environ[RAY_ADDRESS_ENV])
        rollout = ray_rollout()
    try:
        for version in (0, 1):
            if version == 1:  # change every shard, so that the push has something new to carry
                with torch.no_grad():
                    for p in ac.parameters():
                        p.mul_(1.5)
            if ctx.is_main:
                stream = FullTensorStream(ac.model)
                if version == 0:
                    rollout.connect(stream)
                else:
                    rollout.publish(stream, version)
            else:
                FullTensorStream(ac.model, keep=False).drain()
            full = full_state(ac.model)
            if ctx.is_main:
                got = rollout.run_on_workers(engine_weights)
                policy = {n: t for n, t in full.items() if not n.startswith("value_head")}
                _save(
                    ctx,
                    out,
                    f"ray_v{version}",
                    policy,
                    {
                        "versions": rollout.policy_versions,
                        "nodes": len(set(rollout.nodes)),
                        "equal": [
                            all(torch.equal(g[n], t) for n, t in policy.items()) for g in got
                        ],
                        "value_head_sent": any(n.startswith("value_head") for n in got[0]),
                    },
                )
        total = torch.ones(1)
        torch.distributed.all_reduce(total)  # the learner's own group, after the weight group
        _save(ctx, out, "ray_default_group", data={"sum": float(total)})
    finally:
        if rollout is not None:
            rollout.shutdown()
            import ray

            ray.shutdown()
