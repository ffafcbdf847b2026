"""A KV cache for our decode loop: preallocated per layer, written in place, rows can be dropped.

Hugging Face's ``DynamicCache`` grows by ``torch.cat`` at every decode step, which copies the whole
cache of every layer once per generated token (on CPU the largest single cost of decoding a small
model). :class:`PreallocatedLayer` allocates ``[batch, kv_heads, capacity, head_dim]`` once and writes
each step's keys/values in place; attention reads a view of the filled prefix. Finished rows can be
dropped from the batch (:meth:`PreallocatedLayer.batch_select_indices`), so the forward only runs
on rows that still generate.

:func:`decode_cache` puts such layers into a ``DynamicCache`` built from the model config, for the
full-attention layers only (sliding-window and other layer kinds keep Hugging Face's own classes).

Multi-turn episodes keep their cache between turns (:class:`~ar_torchrl.backends.EpisodeCache`):
:func:`kept_states` takes each row's real positions out of a decoded batch (a :class:`KeptState`:
the token ids they hold and per layer ``[kv_heads, n, head_dim]`` keys and values; views of the
batch's buffers where the row's positions are contiguous, as the decode loop lays them out), and
:func:`load_kept` writes the kept states of the next turn's rows, left-padded, as the prefilled
prefix of a new cache: the turn then forwards only the tokens each context added.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = [
    "KeptState",
    "PreallocatedLayer",
    "decode_cache",
    "keeps_episodes",
    "kept_states",
    "load_kept",
]


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

    def load_prefix(
        self, rows: list[tuple[torch.Tensor, torch.Tensor] | None], used: list[int], width: int
    ) -> None:
        """Fill an empty layer's first ``width`` positions: row ``i`` gets the first ``used[i]``
        positions of its ``(keys, values)`` (``[kv_heads, >= used[i], head_dim]``) right-aligned
        at ``width``, zeros before them (``None`` or ``used[i] == 0``: all zeros). One copy per
        row into the preallocated buffers (no padded intermediate).

        Example:
            >>> layer = PreallocatedLayer(capacity=5)
            >>> k = torch.ones(1, 3, 2)
            >>> layer.load_prefix([(k, 2 * k), None], used=[2, 0], width=3)
            >>> layer.get_seq_length(), layer.keys[:, 0, :, 0].tolist()
            (3, [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
        """
        if self.is_initialized and self._length:
            raise RuntimeError("PreallocatedLayer.load_prefix: the layer already holds positions")
        if width > self.capacity:
            raise RuntimeError(
                f"PreallocatedLayer: a prefix of {width} positions exceeds the capacity of "
                f"{self.capacity}"
            )
        keys, values = next(r for r in rows if r is not None)
        heads = keys.shape[0]
        self.lazy_initialization(
            keys.new_empty(len(rows), heads, 0, keys.shape[-1]),
            values.new_empty(len(rows), heads, 0, values.shape[-1]),
        )
        for i, (row, n) in enumerate(zip(rows, used)):
            for buf, part in ((self._key_buf, 0), (self._value_buf, 1)):
                if n < width:  # padding: masked out, but never garbage
                    buf[i, :, : width - n].zero_()
                if n:
                    buf[i, :, width - n : width] = row[part][:, :n]
        self._length = width
        self.keys, self.values = self._key_buf[:, :, :width], self._value_buf[:, :, :width]

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


def keeps_episodes(cache: DynamicCache) -> bool:
    """Whether every layer of ``cache`` is a :class:`PreallocatedLayer` (then rows can be kept)."""
    return bool(cache.layers) and all(type(layer) is PreallocatedLayer for layer in cache.layers)


@dataclass
class KeptState:
    """What a decoded row leaves for its episode's next turn.

    Attributes:
        ids: the token ids whose keys/values are kept: the context the turn started from and its
            sampled tokens but the last (sampled, never forwarded).
        layers: per cache layer, ``(keys, values)`` of those tokens, ``[kv_heads, len(ids), head_dim]``.

    Example:
        >>> state = KeptState([4, 5, 6], [(torch.zeros(1, 3, 2), torch.zeros(1, 3, 2))])
        >>> state.reusable([4, 5, 6, 7, 8]), state.reusable([4, 5, 6]), state.reusable([4, 9, 6, 7])
        (3, 2, 0)
    """

    ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    def reusable(self, context: list[int]) -> int:
        """How many leading positions of ``context`` this state holds (at least one token of
        ``context`` is left to forward, whose logits give the next token; 0: not its prefix)."""
        n = len(self.ids)
        if context[:n] == self.ids[: len(context)]:
            return min(n, len(context) - 1)
        return 0


def kept_states(
    cache: DynamicCache, rows: list[int], mask: torch.Tensor
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The real (``mask == 1``) filled positions of batch rows ``rows`` of ``cache``, in order.

    A row whose real columns are contiguous (what the decode loop leaves: left padding, then the
    row's tokens) gets views of the cache's buffers, no copy (they keep the buffers alive, and
    stay valid: a :class:`PreallocatedLayer` only writes after its filled prefix, and dropping
    rows allocates new buffers). The other rows get one indexed copy per layer and part for them
    all (their real columns moved to the end of a ``[R, kv_heads, n, head_dim]`` copy, ``n`` the
    most real columns of such a row), each row's state a view of its last ``n_row`` columns.

    Args:
        cache: a decoded cache whose layers are all :class:`PreallocatedLayer`.
        rows: the batch rows to copy.
        mask: ``[B, >= filled]`` the attention mask of the batch (1: a real token).

    Returns:
        per row, per layer ``(keys, values)`` ``[kv_heads, n_row, head_dim]``.

    Example:
        >>> cache = decode_cache(__import__("ar_torchrl").models.tiny.build_tiny_qwen3(99).config, 4)
        >>> for layer in cache.layers:
        ...     _ = layer.update(torch.randn(2, 1, 3, 8), torch.randn(2, 1, 3, 8))
        >>> out = kept_states(cache, [1, 0], torch.tensor([[1, 0, 1], [0, 1, 1]]))
        >>> out[0][0][0].shape, torch.equal(out[0][0][0], cache.layers[0].keys[1, :, 1:])
        (torch.Size([1, 2, 8]), True)
        >>> out[0][0][0].data_ptr() == cache.layers[0].keys[1, :, 1:].data_ptr()  # a view
        True
        >>> torch.equal(out[1][0][0], cache.layers[0].keys[0, :, [0, 2]])  # a hole: a copy
        True
    """
    filled = cache.layers[0].get_seq_length()
    index = torch.tensor(rows, device=mask.device)
    real = mask[index, :filled].bool()
    flag = real.to(torch.int8)
    counts_t = real.sum(-1)
    first_t = flag.argmax(-1)  # the first real column (0 where none)
    end_t = filled - flag.flip(-1).argmax(-1)  # one past the last real column
    contiguous_t = (end_t - first_t == counts_t) | (counts_t == 0)
    counts, first, contiguous = counts_t.tolist(), first_t.tolist(), contiguous_t.tolist()
    out: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in rows]
    holey = [i for i, c in enumerate(contiguous) if not c]
    if holey:  # one indexed copy for the rows with holes
        sub = torch.tensor(holey, device=mask.device)
        n = max(counts[i] for i in holey)
        # a stable sort puts each row's masked columns first, its real ones last, in their order
        cols = torch.argsort(flag[sub], dim=-1, stable=True)[:, filled - n :]
        heads = torch.arange(cache.layers[0].keys.shape[1], device=mask.device)
        at = (index[sub][:, None, None], heads[None, :, None], cols[:, None, :])  # [R', H, n]
    for layer in cache.layers:
        for i, (r, f, c, ok) in enumerate(zip(rows, first, counts, contiguous)):
            if ok:
                out[i].append((layer.keys[r, :, f : f + c], layer.values[r, :, f : f + c]))
        if holey:
            pair = [buf[at] for buf in (layer.keys, layer.values)]  # one copy each: [R', H, n, D]
            for j, i in enumerate(holey):
                out[i].append((pair[0][j, :, n - counts[i] :], pair[1][j, :, n - counts[i] :]))
    return out


def load_kept(cache: DynamicCache, states: list[KeptState | None], used: list[int]) -> torch.Tensor:
    """Write the first ``used[i]`` kept positions of every row, left-padded, as the cache's prefix.

    Args:
        cache: a fresh cache of :class:`PreallocatedLayer` layers (its capacity counts the prefix).
        states: per batch row, its episode's kept state (``None``: nothing kept).
        used: per row, the kept positions to use (``0`` where ``states[i]`` is ``None``).

    Returns:
        ``[B, W0]`` long mask of the prefix (``W0 = max(used)``; 1 on the loaded positions).

    Padding positions hold zeros (masked out: they never take part in attention).
    """
    width = max(used)
    some = next(s for s in states if s is not None)
    device = some.layers[0][0].device
    mask = torch.arange(width, device=device) >= width - torch.tensor(used, device=device)[:, None]
    for layer_index, layer in enumerate(cache.layers):
        rows = [
            s.layers[layer_index] if s is not None and n else None for s, n in zip(states, used)
        ]
        layer.load_prefix(rows, used, width)
    return mask.long()
