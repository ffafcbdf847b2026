"""pad_trajectories on batches that need no new padding (and may hold no padding at all)."""

from __future__ import annotations

import pytest
import torch
from support.trajectories import make_trajectory
from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement

from ar_torchrl.data import pad_trajectories


def unpadded(seed: int):
    """Two rows of prompt 5 + response 4 tokens: no padded position anywhere (no pad id to read)."""
    td = make_trajectory([5, 5], [4, 4], seed=seed)
    assert td["attention_mask"].all()
    return td


def test_equal_width_unpadded_batches_through_a_replay_buffer():
    """The README's collate_fn on a normal run's batches (equal prompt lengths, every response at
    max_new_tokens): no pad id is needed, none is invented, and the sample is the rows as stored."""
    a, b = unpadded(0), unpadded(1)
    buffer = ReplayBuffer(
        storage=LazyStackStorage(8),
        sampler=SamplerWithoutReplacement(),
        batch_size=4,
        collate_fn=pad_trajectories,
    )
    buffer.extend(a)
    buffer.extend(b)
    sample, info = buffer.sample(return_info=True)
    both = torch.cat([a["tokens"], b["tokens"]])
    assert sample.batch_size == (4, 9)
    assert torch.equal(sample["tokens"], both[info["index"]])
    assert sample["attention_mask"].all()


def test_unpadded_batches_of_different_widths_need_a_pad_id():
    short = make_trajectory([5, 5], [3, 3], seed=2)
    with pytest.raises(
        ValueError, match="no padding to read the pad id from .* pass pad_token_id="
    ):
        pad_trajectories([unpadded(0), short])
    out = pad_trajectories([unpadded(0), short], pad_token_id=0)
    assert out.batch_size == (4, 9) and (out["tokens"][2:, -1] == 0).all()
