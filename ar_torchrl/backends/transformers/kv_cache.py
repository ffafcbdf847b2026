"""A KV cache for our decode loop: preallocated per layer, written in place, rows can be dropped.

Hugging Face's ``DynamicCache`` grows by ``torch.cat`` at every decode step, which copies the whole
cache of every layer once per generated token (on CPU the largest single cost of decoding a small
model). :class:`PreallocatedLayer` allocates ``[batch, kv_heads, capacity, head_dim]`` once and writes
each step's keys/values in place; attention reads a view of the filled prefix. Finished rows can be
dropped from the batch (:meth:`PreallocatedLayer.batch_select_indices`), so the forward only runs
on rows that still generate.

:func:`decode_cache` puts such layers into a ``DynamicCache`` built from the model config, for the
full-attention layers only (sliding-window and other layer kinds keep Hugging Face's own classes).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["PreallocatedLayer", "decode_cache"]


class PreallocatedLayer(DynamicLayer):
    """A full-attention cache layer with room for ``capacity`` positions, filled in place.

    Behaves like ``DynamicLayer`` (same mask sizes: the filled length plus the query length) but
    ``update`` copies the new states into a preallocated buffer instead of concatenating, and
    returns views of the filled prefix.

    Args:
        capacity: most positions the layer holds (prompt width + new tokens).

    Example:
        >>> layer = PreallocatedLayer(capacity=8)
        >>> k, v = layer.update(torch.ones(2, 1, 3, 4), torch.zeros(2, 1, 3, 4))
        >>> k.shape, layer.get_seq_length()
        (torch.Size([2, 1, 3, 4]), 3)
        >>> k, v = layer.update(torch.ones(2, 1, 1, 4), torch.zeros(2, 1, 1, 4))
        >>> k.shape, layer.keys.data_ptr() == k.data_ptr()
        (torch.Size([2, 1, 4, 4]), True)
    """

    is_croppable = False

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = int(capacity)
        self._length = 0
        self._key_buf: torch.Tensor | None = None
        self._value_buf: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        batch, heads, _, _ = key_states.shape
        self._key_buf = key_states.new_empty(batch, heads, self.capacity, key_states.shape[-1])
        self._value_buf = value_states.new_empty(
            batch, heads, self.capacity, value_states.shape[-1]
        )
        self._length = 0
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H, q, D]`` states after the filled prefix; return the filled ``[B, H, n + q, D]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self._length, self._length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(
                f"PreallocatedLayer: {end} positions exceed the capacity of {self.capacity}; "
                "size the cache for prompt width + max_new_tokens"
            )
        self._key_buf[:, :, start:end] = key_states
        self._value_buf[:, :, start:end] = value_states
        self._length = end
        self.keys, self.values = self._key_buf[:, :, :end], self._value_buf[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (a copy of the filled prefix; the capacity is kept)."""
        if not self.is_initialized:
            return
        self._key_buf = self._key_buf[indices]
        self._value_buf = self._value_buf[indices]
        self.keys = self._key_buf[:, :, : self._length]
        self.values = self._value_buf[:, :, : self._length]

    def reset(self) -> None:
        self._key_buf = self._value_buf = None
        self._length = 0
        super().reset()


def decode_cache(config, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are :class:`PreallocatedLayer`.

    Args:
        config: the model config (``model.config``).
        capacity: positions per layer (prompt width + ``max_new_tokens``).

    Example:
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> cache = decode_cache(build_tiny_qwen3(99).config, capacity=16)
        >>> {type(layer).__name__ for layer in cache.layers}
        {'PreallocatedLayer'}
    """
    cache = DynamicCache(config=config)
    cache.layers = [
        PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer
        for layer in cache.layers
    ]
    return cache
