"""GRPOAdvantage's reward key: the same key name as TokenGAE's (read under "next")."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from ar_torchrl.objectives import GRPOAdvantage, RLOOAdvantage, TokenGAE


def batch(reward_key: str = "reward") -> TensorDict:
    mask = torch.tensor([[False, True, True]] * 4)
    reward = torch.zeros(4, 3, 1)
    reward[:, -1, 0] = torch.tensor([1.0, -1.0, 0.5, 0.0])
    return TensorDict(
        {
            "loss_mask": mask,
            "prompt_id": torch.tensor([[0] * 3, [0] * 3, [1] * 3, [1] * 3]),
            "state_value": torch.zeros(4, 3, 1),
            "next": {
                reward_key: reward,
                "done": mask.unsqueeze(-1) & torch.tensor([False, False, True]).view(1, 3, 1),
                "terminated": torch.zeros(4, 3, 1, dtype=torch.bool),
            },
        },
        [4, 3],
    )


@pytest.mark.parametrize("cls", [GRPOAdvantage, RLOOAdvantage])
def test_one_reward_key_name_for_every_advantage_module(cls):
    assert cls().tensor_keys.reward == TokenGAE().tensor_keys.reward == "reward"
    assert cls().in_keys[0] == ("next", "reward")
    default = cls()(batch())["advantage"]
    module, gae = cls().set_keys(reward="score"), TokenGAE()
    gae.set_keys(reward="score")  # TorchRL's set_keys (returns None)
    assert module.reward_key == ("next", "score") and module.in_keys[0] == ("next", "score")
    renamed = batch("score")
    torch.testing.assert_close(module(renamed.clone())["advantage"], default)
    assert gae(renamed)["advantage"][:, -1, 0].tolist() == [1.0, -1.0, 0.5, 0.0]  # V = 0
    with pytest.raises(KeyError, match=r"missing key \('next', 'score'\)"):
        module(batch())


def test_the_full_reward_path_is_a_deprecated_spelling():
    with pytest.warns(DeprecationWarning, match=r"set_keys\(reward='score'\)"):
        module = GRPOAdvantage().set_keys(reward=("next", "score"))
    assert module.tensor_keys.reward == "score" and module.reward_key == ("next", "score")
    torch.testing.assert_close(
        module(batch("score"))["advantage"], GRPOAdvantage()(batch())["advantage"]
    )
    nested = GRPOAdvantage().set_keys(reward=("shaped", "r"))  # a nested name: no warning
    assert nested.reward_key == ("next", "shaped", "r")
