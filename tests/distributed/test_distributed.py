"""ar_torchrl.distributed: FSDP2 data parallelism on CPU/gloo, checked against one process.

The multi-process checks share one 2-rank spawn (``two_ranks``: tests/support/dist_workers.py); the
single-process references are computed here.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from support.dist_workers import (
    BUDGET,
    TREE_VARIANTS,
    actor_and_critic,
    actor_critic,
    all_checks,
    batch,
    compared_update,
    fast_checks,
    ppo_loss,
    prepare,
    separate_optimizer,
    spawn,
    tree_actor_critic,
    tree_batch,
    tree_plan,
)
from transformers import AutoModelForCausalLM

from ar_torchrl.modules import ConfidenceFeatures, attach_value_head
from ar_torchrl.objectives import TokenGAE
from ar_torchrl.training import plan_micro_batches, ppo_update, recompute_old_log_probs_and_values

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    """One spawn of 2 ranks for the module: every check when one of its slow tests is selected,
    else the fast tier's (their results are files the tests read)."""
    out = tmp_path_factory.mktemp("two_ranks")
    slow = any(
        getattr(item, "module", None) is request.module  # doctest items have none
        and item.get_closest_marker("slow") is not None
        for item in request.session.items
    )
    spawn(all_checks if slow else fast_checks, 2, out)
    return out


def _json(out, name):
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.slow  # a benchmark script or a multi-process run: full tier only
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_two_ranks_train_like_one_process(two_ranks, mode):
    """2 ranks (FSDP2, padding passes, clipping, 2 epochs) = 1 process on the same batch."""
    got = load_file(str(two_ranks / f"equal_{mode}.safetensors"))
    info = _json(two_ranks, f"equal_{mode}")
    ac = actor_critic(seed=1)
    td = batch()
    plan = plan_micro_batches(td, BUDGET)
    td = prepare(ac, td, plan)
    want = compared_update(ppo_loss(ac, mode), torch.optim.SGD(ac.parameters(), lr=0.5), td, plan)
    assert max(info["padding"]) >= 1, "the plan must be uneven over the ranks"
    assert want["train/grad_norm"] > 0.05, "clipping must be active"
    metrics = info["metrics"]
    assert metrics["train/optimizer_steps"] == want["train/optimizer_steps"] == 2.0
    assert metrics.keys() == want.keys()
    for key in (
        "loss_objective",
        "loss_critic",
        "grad_norm",
        "mean_ratio",
        "clip_fraction",
        "max_ratio",  # whole mini-batch: the maximum over both ranks' tokens
        "min_ratio",
        "ESS",
        "explained_variance",  # from sums over both ranks
        "explained_variance_finite",
    ):
        assert metrics[f"train/{key}"] == pytest.approx(want[f"train/{key}"], rel=1e-5, abs=1e-6)
    for name, param in ac.model.state_dict().items():
        torch.testing.assert_close(got[name], param, atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow  # a multi-process run: full tier only
@pytest.mark.parametrize("variant", list(TREE_VARIANTS))
def test_two_ranks_with_packed_shared_prefixes_train_like_one_process(two_ranks, variant):
    """Packed shared-prefix (tree) micro-batches under FSDP2 (one backbone call per forward), with
    and without activation checkpointing, and with confidence features on the value head (their
    own FSDP2 unit): the first update's ratio is exactly 1 on every rank and 2 epochs on 2 ranks
    equal one process on the same plan."""
    got = load_file(str(two_ranks / f"tree_{variant}.safetensors"))
    info = _json(two_ranks, f"tree_{variant}")
    assert all(all(rank) and rank for rank in info["owned"]), "every rank runs tree micro-batches"
    assert {v for rank in info["ratios"] for pair in rank for v in pair} == {1.0}
    ac = tree_actor_critic(confidence=TREE_VARIANTS[variant][1])
    td = tree_batch()
    plan = tree_plan(td)
    td = prepare(ac, td, plan)
    want = compared_update(ppo_loss(ac), torch.optim.SGD(ac.parameters(), lr=0.5), td, plan)
    metrics = info["metrics"]
    assert metrics["train/optimizer_steps"] == want["train/optimizer_steps"] == 2.0
    for key in ("loss_objective", "loss_critic", "grad_norm", "mean_ratio", "explained_variance"):
        assert metrics[f"train/{key}"] == pytest.approx(want[f"train/{key}"], rel=1e-5, abs=1e-6)
    for name, param in ac.model.state_dict().items():
        torch.testing.assert_close(got[name], param, atol=1e-5, rtol=0, msg=name)
    if TREE_VARIANTS[variant][1]:  # the confidence MLP trained, the same on both sides
        assert any(".confidence." in name for name in got)
        start = tree_actor_critic(confidence=True).model.value_head.confidence.state_dict()
        moved = [not torch.equal(got[f"value_head.confidence.{k}"], v) for k, v in start.items()]
        assert any(moved)


def test_bf16_compute_updates_fp32_masters(two_ranks):
    """lr=1e-6, bf16 compute: >= 99 % of the fp32 masters move; pure bf16 storage moves ~2 %."""
    info = _json(two_ranks, "bf16")
    changed, total = info["changed"]
    ac = actor_critic(seed=2, bf16_init=True)  # the current recipe: bf16 parameters, fp32 head
    td = batch()
    plan = plan_micro_batches(td, BUDGET)
    td = prepare(ac, td, plan)
    policy = [p for n, p in ac.named_parameters() if "value_head" not in n]
    before = [p.detach().clone() for p in policy]
    opt = torch.optim.AdamW(ac.parameters(), lr=1e-6, weight_decay=0.0)
    ppo_update(ppo_loss(ac), opt, td, plan, grad_clip=1.0)
    bf16_changed = sum(int((p != b).sum()) for p, b in zip(policy, before))
    assert total == sum(b.numel() for b in before)
    print(
        f"fp32 masters changed: {changed}/{total} = {changed / total:.4f}; "
        f"bf16 storage changed: {bf16_changed}/{total} = {bf16_changed / total:.4f}"
    )
    assert changed / total >= 0.99
    assert bf16_changed / total < 0.1
    assert info["dtypes"] == {
        "value_head": "torch.float32",
        "q_proj": "torch.bfloat16",
        "state_value": "torch.float32",
        "master": "torch.float32",
    }


def test_first_update_ratio_is_exactly_one_on_every_rank(two_ranks):
    ratios = _json(two_ranks, "bf16")["ratios"]
    assert all(len(r) >= 1 for r in ratios)
    assert {v for rank in ratios for pair in rank for v in pair} == {1.0}


def test_meta_sharded_load_equals_eager_load(two_ranks):
    base = load_file(str(two_ranks / "meta_base.safetensors"))
    info = _json(two_ranks, "meta_base")
    eager = attach_value_head(
        AutoModelForCausalLM.from_pretrained(two_ranks / "base", dtype=torch.float32)
    )
    want = eager.state_dict()
    assert info["files"] >= 2 and info["value_head"] == "zero"
    assert sorted(base) == sorted(want)
    diff = max((base[k] - want[k]).abs().max().item() for k in want)
    print(f"eager/meta checkpoint state maximum difference: {diff}")
    assert diff == 0.0
    assert base["value_head.weight"].abs().sum() == 0 and base["value_head.bias"].abs().sum() == 0
    policy = load_file(str(two_ranks / "meta_policy.safetensors"))
    head = load_file(str(two_ranks / "policy" / "value_head.safetensors"))
    assert _json(two_ranks, "meta_policy")["value_head"].endswith("value_head.safetensors")
    assert torch.equal(policy["value_head.weight"], head["value_head.weight"])
    assert policy["value_head.weight"].abs().sum() > 0
    # confidence features attached to a meta-built model: neither file has them, so they start
    # from ConfidenceFeatures.initial_state (not zeros: an all-zero MLP gets no gradient)
    fresh = ConfidenceFeatures.initial_state()
    for name, want_head in (("base", base), ("policy", policy)):
        got = load_file(str(two_ranks / f"meta_{name}_confidence.safetensors"))
        conf = {k: v for k, v in got.items() if k.startswith("value_head.confidence.")}
        assert sorted(conf) == sorted(f"value_head.confidence.{k}" for k in fresh), name
        for k, v in fresh.items():
            assert torch.equal(got[f"value_head.confidence.{k}"], v), (name, k)
        assert fresh["net.0.weight"].abs().sum() > 0
        for k, v in want_head.items():  # everything else as loaded without them
            assert torch.equal(got[k], v), (name, k)
    assert _json(two_ranks, "meta_policy_confidence")["value_head"].endswith(
        "value_head.safetensors"
    )


def test_weight_push_gathers_full_tensors_on_rank_0(two_ranks):
    pushed = load_file(str(two_ranks / "push.safetensors"))
    info = _json(two_ranks, "push")
    eager = AutoModelForCausalLM.from_pretrained(two_ranks / "policy", dtype=torch.float32)
    want = eager.state_dict()
    assert info["version"] == 7 and info["names"] == list(want)  # state_dict order, no value head
    for name, tensor in want.items():
        assert pushed[name].dtype == torch.bfloat16
        assert torch.equal(pushed[name], tensor.to(torch.bfloat16)), name
    rank0, rank1 = info["errors"]
    assert rank0 == ["ConnectionError: rollout engine went away"]
    assert rank1 == [
        "RuntimeError: push_weights: rank 0 failed to push the weights to its rollout engine"
    ]


def test_resume_from_two_rank_checkpoint_reproduces_the_run(two_ranks):
    info = _json(two_ranks, "resume")
    assert info["path"].endswith("step_2") and info["step"] == 2 and info["note"] == "x"
    assert any(
        "step_4 is unusable" in m and "__1_0.distcp" in m and "truncated" in m
        for m in info["warnings"]
    ), info["warnings"]
    assert info["resumed"] == info["straight"][2:]
    assert info["same_params"]


@pytest.mark.slow  # a multi-process run: full tier only
def test_two_ranks_with_a_separate_critic_train_like_one_process(two_ranks):
    """critic=separate under FSDP2 (both models sharded, the critic clipped on its own): 2 ranks
    give one process's update of both models."""
    got = load_file(str(two_ranks / "separate_equal.safetensors"))
    metrics = _json(two_ranks, "separate_equal")["metrics"]
    actor, critic = actor_and_critic(seed=7)
    td = batch(seed=3)
    plan = plan_micro_batches(td, BUDGET)
    loss = ppo_loss(actor, critic=critic)
    recompute_old_log_probs_and_values(actor, td, plan, loss=loss)
    td = TokenGAE(gamma=1.0, lmbda=0.95, normalize_advantage=True)(td)
    want = compared_update(loss, separate_optimizer(actor, critic), td, plan)
    assert want["train/grad_norm"] > 0.05 and want["train/grad_norm_critic"] > 0.05  # both clip
    for key in ("loss_objective", "loss_critic", "grad_norm", "grad_norm_critic", "mean_ratio"):
        assert metrics[f"train/{key}"] == pytest.approx(want[f"train/{key}"], rel=1e-5, abs=1e-6)
    for prefix, model in (("actor", actor.model), ("critic", critic.model)):
        for name, param in model.state_dict().items():
            torch.testing.assert_close(got[f"{prefix}.{name}"], param, atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow  # a multi-process run: full tier only
def test_two_ranks_with_a_separate_critic_resume_exactly_and_warm_start_the_critic(two_ranks):
    info = _json(two_ranks, "separate_resume")
    assert info["same_params"], "resumed policy and critic differ from the uninterrupted run"
    assert info["resumed"] == info["straight"][1:]  # every metric of steps 2-3, exactly
    assert info["warm_start_equal"] and info["warm_start_what"] == "the separate critic of step_1"


@pytest.mark.slow
def test_two_ranks_export_the_full_models_from_rank_0(two_ranks, tmp_path):
    """FSDP2 on 2 ranks: rank 0 writes policy/ and critic/, equal to the unsharded models' export."""
    from ar_torchrl.distributed import DistContext, export_trained

    assert _json(two_ranks, "export")["per_rank"] == [["critic", "policy"], []]
    actor, critic = actor_and_critic(seed=12)
    plain = export_trained(DistContext(), tmp_path, policy=actor, critic=critic)
    for name in ("policy", "critic"):
        want = load_file(str(plain[name] / "model.safetensors"))
        got = load_file(str(two_ranks / "export" / name / "model.safetensors"))
        assert want.keys() == got.keys() and not any(k.startswith("value_head") for k in got)
        for k in want:
            assert torch.equal(got[k], want[k]), (name, k)
    head = load_file(str(two_ranks / "export" / "critic" / "value_head.safetensors"))
    assert torch.equal(head["value_head.weight"], critic.model.value_head.weight)
