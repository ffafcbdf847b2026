"""TokenGAE's truncation default beside TorchRL's ``GAE`` (the docstring's claim, pinned)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.objectives.value import GAE

from ar_torchrl.objectives import TokenGAE


def truncated_rows(seed: int, rows: int = 3, length: int = 6) -> TensorDict:
    """Rows cut by length (done, not terminated, at the last token; every token trained), with
    ``("next", "state_value")`` the value of the following state (``V_{t+1}``, then ``V_boot``)."""
    g = torch.Generator().manual_seed(seed)
    value = torch.randn(rows, length, 1, generator=g)
    boot = torch.randn(rows, 1, 1, generator=g)
    reward = torch.zeros(rows, length, 1)
    reward[:, -1] = torch.randn(rows, 1, generator=g)
    done = torch.zeros(rows, length, 1, dtype=torch.bool)
    done[:, -1] = True
    return TensorDict(
        {
            "state_value": value,
            "loss_mask": torch.ones(rows, length, dtype=torch.bool),
            "attention_mask": torch.ones(rows, length, dtype=torch.bool),
            "next": {
                "state_value": torch.cat([value[:, 1:], boot], 1),
                "reward": reward,
                "done": done,
                "terminated": torch.zeros_like(done),
            },
        },
        [rows, length],
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("gamma", "lmbda"), [(1.0, 0.95), (0.9, 0.8)])
def test_truncated_rows_torchrl_bootstraps_token_gae_does_not_by_default(seed, gamma, lmbda):
    td = truncated_rows(seed)
    theirs = GAE(gamma=gamma, lmbda=lmbda, value_network=None)(td.clone())["advantage"]
    boot = TokenGAE(gamma=gamma, lmbda=lmbda, bootstrap_truncated=True)(td.clone())["advantage"]
    ours = TokenGAE(gamma=gamma, lmbda=lmbda)(td.clone())["advantage"]
    torch.testing.assert_close(boot, theirs, rtol=1e-5, atol=1e-5)
    # the default values the state after the cut at 0: gamma * (gamma * lmbda)^k * V_boot less
    steps_to_end = torch.arange(td.batch_size[1] - 1, -1, -1, dtype=torch.float32)
    v_boot = td["next", "state_value"][:, -1:, 0]
    gap = gamma * (gamma * lmbda) ** steps_to_end * v_boot
    torch.testing.assert_close((theirs - ours).squeeze(-1), gap, rtol=1e-5, atol=1e-5)
    assert float((theirs - ours).abs().max()) > 0.05
