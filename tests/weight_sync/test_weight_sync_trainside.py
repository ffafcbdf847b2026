"""TrainsideSender: copy tensor by tensor with checks; share mode checks names only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ar_torchrl.weight_sync import TrainsideSender, WeightSender, WeightSyncError


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(2))
        self.b = nn.Parameter(torch.zeros(3))


def test_copy_checks_each_tensor_then_copies_it():
    target = Tiny()
    sender = TrainsideSender(target, mode="copy")
    assert isinstance(sender, WeightSender)
    sender.send(
        [("a", torch.ones(2)), ("value_head.weight", torch.ones(1)), ("b", torch.full((3,), 2.0))],
        1,
    )
    assert torch.equal(target.a.detach(), torch.ones(2)) and torch.equal(
        target.b.detach(), torch.full((3,), 2.0)
    )
    assert sender.last_count == 2  # the value head was dropped
    with pytest.raises(WeightSyncError, match=r"unknown 'c'") as info:
        sender.send([("c", torch.ones(1))], 2)
    assert not info.value.partial
    with pytest.raises(
        WeightSyncError, match=r"shape of 'b' is \(2,\), the rollout model expects \(3,\)"
    ) as info:
        sender.send([("a", torch.zeros(2)), ("b", torch.zeros(2))], 2)
    assert info.value.partial and torch.equal(target.a.detach(), torch.zeros(2))  # 'a' was copied


def test_share_mode_only_checks_names():
    target = Tiny()
    sender = TrainsideSender(target, mode="share")
    sender.send([("a", torch.ones(2)), ("b", torch.ones(3))], 1)
    assert torch.equal(target.a.detach(), torch.zeros(2))  # nothing copied: the weights are shared
    with pytest.raises(WeightSyncError, match=r"missing \['b'\]") as info:
        sender.send([("a", torch.ones(2))], 2)
    assert not info.value.partial  # share mode changes nothing
    with pytest.raises(ValueError, match="mode must be 'copy' or 'share', got 'ref'"):
        TrainsideSender(target, mode="ref")
