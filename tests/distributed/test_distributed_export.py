"""ar_torchrl.distributed.export: the end-of-run export from FSDP2-sharded models (world size 1 here; 2
ranks in tests/distributed/test_distributed.py) equals the export of the same models unsharded."""

from __future__ import annotations

import pytest
import torch
from support.dist_workers import actor_and_critic
from support.hf_export import greedy_tokens, weight_names
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from ar_torchrl.distributed import DistContext, distributed, export_trained, shard_actor_critic
from ar_torchrl.models.export import load_critic
from ar_torchrl.models.tiny import build_char_tokenizer

torch.set_num_threads(1)

PROMPTS = [[1, 5, 9, 12], [1, 7, 7, 3, 40], [1, 60, 2]]


def _plain_export(tmp_path):
    actor, critic = actor_and_critic(seed=11)
    return (
        actor,
        critic,
        export_trained(DistContext(), tmp_path / "plain", policy=actor, critic=critic),
    )


def test_world_size_1_fsdp_export_equals_the_plain_export(tmp_path):
    actor, critic, plain = _plain_export(tmp_path)
    tok = build_char_tokenizer()
    with distributed("cpu", process_group=True) as ctx:
        sharded_actor, sharded_critic = (
            shard_actor_critic(m, ctx, compute_dtype="bfloat16") for m in actor_and_critic(11)
        )
        assert all(isinstance(p, DTensor) for p in sharded_critic.parameters())
        out = export_trained(
            ctx, tmp_path / "run", policy=sharded_actor, tokenizer=tok, critic=sharded_critic
        )
    assert out == {"policy": tmp_path / "run" / "policy", "critic": tmp_path / "run" / "critic"}
    assert (out["policy"] / "tokenizer.json").is_file()
    assert not any(n.startswith("value_head") for n in weight_names(out["policy"]))
    for name in ("policy", "critic"):
        want = AutoModelForCausalLM.from_pretrained(plain[name]).state_dict()
        got = AutoModelForCausalLM.from_pretrained(out[name]).state_dict()
        assert want.keys() == got.keys()
        for k in want:  # fp32 masters, gathered: bf16 compute does not touch what is exported
            assert got[k].dtype == torch.float32 and torch.equal(got[k], want[k]), (name, k)
    head = load_critic(out["critic"]).model.value_head
    assert torch.equal(head.weight, critic.model.value_head.weight)
    assert head.weight.abs().sum() > 0
    # the exported policy generates what the trainer's (unsharded twin) generates
    policy = AutoModelForCausalLM.from_pretrained(out["policy"]).eval()
    assert greedy_tokens(policy, PROMPTS) == greedy_tokens(actor.model.eval(), PROMPTS)


def test_a_failed_write_raises_and_leaves_no_export(tmp_path, monkeypatch):
    import ar_torchrl.distributed.export as export_module

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(export_module, "export_critic", broken)
    actor, critic = actor_and_critic(seed=2)
    with distributed("cpu", process_group=True) as ctx:
        with pytest.raises(OSError, match="disk full"):
            export_trained(ctx, tmp_path, policy=actor, critic=critic)
    assert not (tmp_path / "critic").exists()
