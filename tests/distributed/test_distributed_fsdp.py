"""FSDP2 wrapping, activation checkpointing, loading and the weight push in one process.

The single-process bf16 path is FSDP2 at world size 1 (a one-rank gloo group): the same numerics as N
ranks. The multi-rank checks are in tests/distributed/test_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
from support.dist_workers import Recorder, actor_critic, batch, ppo_loss, prepare
from torch import nn
from torch.distributed.tensor import DTensor

from ar_torchrl.distributed import (
    DistContext,
    broadcast_batch,
    build_meta_model,
    checkpoint_decoder_layers,
    decoder_layers,
    distributed,
    init_distributed,
    load_pretrained_weights,
    parameters_on_meta,
    push_weights,
    shard_actor_critic,
    shard_plan,
)
from ar_torchrl.models.tiny import build_tiny_qwen3, save_tiny_model
from ar_torchrl.training import plan_micro_batches, ppo_update

torch.set_num_threads(1)


def _grads(ac, td, plan):
    ac.zero_grad()
    loss = ppo_loss(ac)
    for sub in plan.split(td):
        out = loss(sub)
        (out["loss_objective"] + out["loss_critic"]).backward()
    return {n: p.grad.clone() for n, p in ac.named_parameters() if p.grad is not None}


class RecordRatios:
    """Wraps a loss: records ``(min_ratio, max_ratio)`` of every call."""

    def __init__(self, loss):
        self.loss, self.ratios = loss, []

    def global_normalizer(self, tds):
        return self.loss.global_normalizer(tds)

    def __call__(self, td, normalizer=None):
        out = self.loss(td, normalizer=normalizer)
        self.ratios.append((out["min_ratio"].item(), out["max_ratio"].item()))
        return out


def test_activation_checkpointing_recomputes_layers_with_the_same_gradients():
    plain, wrapped = actor_critic(seed=1), actor_critic(seed=1)
    assert checkpoint_decoder_layers(wrapped.model) == 2
    assert checkpoint_decoder_layers(wrapped.model) == 2  # idempotent
    calls = []
    wrapped.model.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: calls.append(1))
    td = batch()
    plan = plan_micro_batches(td, 20)
    td = prepare(plain, td, plan)
    with torch.no_grad():
        wrapped(td[:2].select("tokens", "attention_mask"))
    assert len(calls) == 1  # without grad: the layer runs once
    calls.clear()
    want, got = _grads(plain, td, plan), _grads(wrapped, td, plan)
    assert len(calls) == 2 * len(plan)  # forward + recomputation in backward
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_world_size_1_fsdp_trains_like_the_plain_model_in_fp32():
    plain = actor_critic(seed=1)
    td = batch()
    plan = plan_micro_batches(td, 20)
    td = prepare(plain, td, plan)
    kwargs = dict(epochs=2, num_minibatches=2, grad_clip=0.5)
    want = ppo_update(
        ppo_loss(plain),
        torch.optim.SGD(plain.parameters(), lr=0.5),
        td.clone(),
        plan,
        generator=torch.Generator().manual_seed(0),
        **kwargs,
    )
    with distributed("cpu", process_group=True) as ctx:
        ac = shard_actor_critic(actor_critic(seed=1), ctx, compute_dtype="float32")
        got = ppo_update(
            ppo_loss(ac),
            torch.optim.SGD(ac.parameters(), lr=0.5),
            td.clone(),
            plan,
            generator=torch.Generator().manual_seed(0),
            **kwargs,
        )
        state = {n: t.full_tensor() for n, t in ac.model.state_dict().items()}
    assert got["train/optimizer_steps"] == 4.0
    assert got["train/loss_objective"] == pytest.approx(want["train/loss_objective"], abs=1e-6)
    for name, param in plain.model.state_dict().items():
        torch.testing.assert_close(state[name], param, atol=1e-6, rtol=0, msg=name)


def test_world_size_1_bf16_first_update_ratio_is_one_and_masters_stay_fp32():
    with distributed("cpu", process_group=True) as ctx:
        ac = shard_actor_critic(
            actor_critic(seed=2), ctx, compute_dtype="bfloat16", activation_checkpointing=True
        )
        td = batch()
        with torch.no_grad():  # torch behaviour the anchor pass works around (pinned here)
            ac(td[:2].select("tokens", "attention_mask"))
        assert not all(isinstance(p, DTensor) for p in ac.parameters())
        plan = plan_micro_batches(td, 20)
        td = prepare(ac, td, plan, shard_plan(plan, td, rank=0, world_size=1))
        # the anchor pass resharded FSDP2's root: the optimizer gets the fp32 shards, not the
        # gathered bf16 parameters a forward without backward leaves registered
        assert all(isinstance(p, DTensor) for p in ac.parameters())
        opt = torch.optim.AdamW(ac.parameters(), lr=1e-6, weight_decay=0.0)
        loss = RecordRatios(ppo_loss(ac))
        ppo_update(loss, opt, td, plan)  # one mini-batch: every forward at unchanged weights
        masters = {p.dtype for p in ac.parameters()}
    assert len(loss.ratios) == len(plan) and set(loss.ratios) == {(1.0, 1.0)}
    assert masters == {torch.float32}
    assert td["sample_log_prob"].dtype == td["state_value"].dtype == torch.float32


def test_weight_push_in_one_process_and_a_failing_sender():
    model = build_tiny_qwen3(99, hidden_size=16, num_heads=2)
    rec = Recorder()
    push_weights(model, DistContext(), rec.sync(2), dtype=torch.bfloat16)
    assert rec.version == 2 and list(rec.tensors) == list(model.state_dict())
    assert all(t.dtype == torch.bfloat16 for t in rec.tensors.values())
    with pytest.raises(ConnectionError, match="went away"):
        push_weights(model, DistContext(), Recorder(fail_after=1).sync(3))

    def takes_two(named_tensors):
        next(named_tensors), next(named_tensors)

    with pytest.raises(RuntimeError, match=r"the consumer stopped with \d+ tensors unread"):
        push_weights(model, DistContext(), takes_two)
    with pytest.raises(
        ValueError, match=r"rank 0 needs a consumer of the weights \(sync\), got None"
    ):
        push_weights(model, DistContext(), None)


def test_meta_model_loads_like_from_pretrained_without_a_process_group(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path, hidden_size=16, num_heads=2)
    model = build_meta_model(path)
    report = load_pretrained_weights(model, path)
    eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert report == {"tensors": 24, "unexpected": [], "value_head": "zero"}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    for name, tensor in eager.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_loading_errors_name_the_tensor(tmp_path):
    path = save_tiny_model(tmp_path, hidden_size=16, num_heads=2)
    wider = build_meta_model(path)
    wider.model.norm.weight = nn.Parameter(torch.empty(32, device="meta"))
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \[16\] in the checkpoint"):
        load_pretrained_weights(wider, path)
    deeper = build_tiny_qwen3(99, hidden_size=16, num_heads=2, num_layers=3)
    with pytest.raises(KeyError, match=r"has no \['model.layers.2"):
        load_pretrained_weights(deeper, path)
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_pretrained_weights(deeper, tmp_path / "nowhere")


def test_parameters_on_meta_restores_register_parameter_on_error():
    original = nn.Module.register_parameter
    with pytest.raises(RuntimeError, match="boom"), parameters_on_meta():
        assert nn.Linear(2, 2).weight.is_meta
        raise RuntimeError("boom")
    assert nn.Module.register_parameter is original and not nn.Linear(2, 2).weight.is_meta


def test_argument_errors():
    with pytest.raises(ValueError, match="has no `get_decoder\\(\\).layers`"):
        decoder_layers(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="compute_dtype must be float32, bfloat16 or float16"):
        shard_actor_critic(actor_critic(seed=0), DistContext(), compute_dtype="int8")
    with pytest.raises(RuntimeError, match="no process group"):
        shard_actor_critic(actor_critic(seed=0), DistContext())
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu' or 'cuda', got 'tpu'"):
        init_distributed("tpu")
    with pytest.raises(ValueError, match="rank 0 \\(the source\\) must pass the batch"):
        broadcast_batch(None, DistContext())


def test_sharded_value_head_returns_no_view_and_global_warning_filters_are_untouched():
    """FSDP2 warns when a wrapped module returns a view; the value head returns a copy instead of
    the library installing a process-wide warnings filter."""
    import warnings

    filters = list(warnings.filters)
    td = batch()
    with distributed("cpu", process_group=True) as ctx:
        ac = shard_actor_critic(actor_critic(seed=1), ctx, compute_dtype="float32")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ac(td.clone())
    assert not [w for w in caught if "returned a view" in str(w.message)]
    assert warnings.filters == filters
