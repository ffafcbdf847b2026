"""The env's prompt order: seeded epochs without replacement, resumable."""

from __future__ import annotations

import torch

__all__ = ["EpochSampler"]


class EpochSampler:
    """Seeded sampler without replacement: a new permutation each epoch; resumable.

    Example:
        >>> s = EpochSampler(5, seed=0)
        >>> a = s.draw(3); state = s.state_dict(); b = s.draw(4)
        >>> s.load_state_dict(state); b == s.draw(4), sorted(a + b[:2])
        (True, [0, 1, 2, 3, 4])
    """

    def __init__(self, size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.cursor = 0, 0

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=gen).tolist()

    def draw(self, k: int) -> list[int]:
        """Next ``k`` indices (crossing into the next epoch when this one runs out)."""
        out: list[int] = []
        while len(out) < k:
            order = self._order()
            take = order[self.cursor : self.cursor + k - len(out)]
            out += take
            self.cursor += len(take)
            if self.cursor == self.size:
                self.epoch, self.cursor = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.epoch, self.cursor = state["seed"], state["epoch"], state["cursor"]
