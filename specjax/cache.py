"""The KV cache: fixed-capacity buffers plus per-row lengths.

Contract: entries at index >= ``length[b]`` are garbage and invisible to attention,
except the slots of the chunk being written, which see each other through the intra-chunk mask.
Rollback is ``length = new_length``; nothing is zeroed or copied. Capacity S is static and chosen
by the engine, which refuses on the host any request that could write past it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array

from .config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: Array  # [L, B, S, K, D]
    v: Array  # [L, B, S, K, D]
    length: Array  # [B] int32: valid entries per row

    @classmethod
    def init(cls, config: ModelConfig, batch: int, capacity: int) -> KVCache:
        shape = (config.num_hidden_layers, batch, capacity, config.num_key_value_heads,
                 config.head_dim)
        zeros = jnp.zeros(shape, jnp.dtype(config.dtype))
        return cls(k=zeros, v=zeros, length=jnp.zeros((batch,), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def rollback(self, length: Array) -> KVCache:
        """Keep the first ``length[b]`` entries of each row. Also used to advance after a write."""
        return dataclasses.replace(self, length=jnp.asarray(length, jnp.int32))


def write(buffer: Array, new: Array, start: Array) -> Array:
    """Write new [B, T, ...] into buffer [B, S, ...] at per-row offsets start [B].

    Entries that would land at slot S or beyond are dropped, never clamped onto valid ones (the
    engine also refuses on the host any request that could write past S; the last chunk of a
    prefill may run past it with padding only, and a finished row's rounds may too)."""
    return _write_rows(buffer, new, start, None)


def write_layer(buffer: Array, layer: Array, new: Array, start: Array) -> Array:
    """``write`` into layer ``layer`` of buffer [L, B, S, ...]."""
    return _write_rows(buffer, new, start, layer)


def write_chunk(cache: KVCache, k: Array, v: Array) -> KVCache:
    """Write a chunk's keys and values k, v [L, B, T, K, D] (``model.forward(write=False)``) at
    each row's length, every layer; the returned cache has length + T."""
    for layer in range(k.shape[0]):
        cache = dataclasses.replace(cache, k=write_layer(cache.k, layer, k[layer], cache.length),
                                    v=write_layer(cache.v, layer, v[layer], cache.length))
    return cache.rollback(cache.length + k.shape[2])


def _write_rows(buffer: Array, new: Array, start: Array, layer: Array | None) -> Array:
    """buffer [(L,) B, S, ...] with row b's slots start[b] .. start[b] + T - 1 (of layer
    ``layer`` when given) set to new [B, T, ...]; slots past S dropped.

    One scatter whose batch dimension is the row: XLA updates the buffer in place, whatever the
    batch, and a mesh that splits the rows moves nothing between devices. (A vmapped
    ``.at[].set`` moves the row axis to the front, and for B > 1 that transpose copied the whole
    cache on every write: 12.8x the step at 4096 slots, B = 2, in experiments/capacity_curve.py.)
    """
    B, T = new.shape[:2]
    slots = (start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    if layer is None:
        index, row, indexed = slots[..., None], 0, (1,)
    else:
        layers = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (B, T))
        index, row, indexed = jnp.stack([layers, slots], axis=-1), 1, (0, 2)
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(2, new.ndim)), inserted_window_dims=indexed,
        scatter_dims_to_operand_dims=indexed, operand_batching_dims=(row,),
        scatter_indices_batching_dims=(0,))
    return jax.lax.scatter(buffer, index, new.astype(buffer.dtype), dims,
                           indices_are_sorted=True, unique_indices=True,
                           mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def _slots(slots) -> Array:
    return jnp.arange(slots, dtype=jnp.int32) if isinstance(slots, int) else slots


def attention_mask(length: Array, chunk_mask: Array, slots: int | Array) -> Array:
    """Which cache slots each new token may attend to: [B, T, n] bool for the slot indices
    ``slots`` [n] (an int S: all of 0 .. S - 1).

    The chunk's T tokens are written at slots length[b] .. length[b] + T - 1. chunk_mask is
    [T, W] or [B, T, W] with W >= T: it covers a window of the last W slots ending with the chunk
    (slots length + T - W .. length + T - 1). A query sees every slot before the window (the
    history) and, inside the window, the slots chunk_mask allows::

        history      window = chunk (causal chunk_mask, T = W = 3)      garbage
        0 .. len-1   len  len+1 len+2                                  len+3 .. S-1
        1 1 1 1      1    0     0                                      0 0 0
        1 1 1 1      1    1     0                                      0 0 0
        1 1 1 1      1    1     1                                      0 0 0

    W > T lets a chunk see part of what was written before it selectively: a draft expanding a
    tree level by level writes each level after the earlier ones and must see only its own
    ancestors among them (the tree's ancestor mask rows for the level, all columns so far).
    """
    slots = _slots(slots)
    B, T, W = length.shape[0], chunk_mask.shape[-2], chunk_mask.shape[-1]
    n = slots.shape[0]
    chunk_mask = jnp.broadcast_to(chunk_mask, (B, T, W))
    offset = slots[None, :] - (length[:, None] + T - W)  # [B, n]: index inside the window
    in_window = (offset >= 0) & (offset < W)
    gathered = jnp.take_along_axis(
        chunk_mask, jnp.broadcast_to(jnp.clip(offset, 0, W - 1)[:, None, :], (B, T, n)),
        axis=2)  # [B, T, n]
    return (offset < 0)[:, None, :] | (in_window[:, None, :] & gathered)


def window_mask(length: Array, positions: Array, slots: int | Array, window: int) -> Array:
    """Sliding-window attention: [B, T, n], True where the key's position is within the last
    ``window`` positions of the query's (q - k < window). History slot s holds position s; the
    chunk's slots hold the chunk's own positions."""
    slots = _slots(slots)
    T = positions.shape[1]
    offset = slots[None, :] - length[:, None]  # [B, n]
    chunk_pos = jnp.take_along_axis(positions, jnp.clip(offset, 0, T - 1), axis=1)
    key_pos = jnp.where((offset >= 0) & (offset < T), chunk_pos, slots[None, :])  # [B, n]
    return (positions[:, :, None] - key_pos[:, None, :]) < window


def causal_mask(T: int) -> Array:
    """[T, T] lower-triangular mask: token i sees tokens 0..i of its chunk."""
    return jnp.tril(jnp.ones((T, T), bool))


def compact(cache: KVCache, start: Array, path: Array, num_accepted: Array) -> KVCache:
    """Tree commit: move an accepted path's entries to consecutive slots after its root.

    start [B]: the slot of the tree's root; node i was written at slot start + i. path [B, D]: the
    accepted node at depths 1 .. D, of which the first num_accepted [B] count. Afterwards slot
    start + j holds the entry of path[:, j - 1] for j <= num_accepted, as if the accepted tokens
    had been decoded one after another. The length is left alone (callers set it). Sources are
    never before their destination (a node at depth j has index >= j), and every read happens
    before any write.
    """
    B, D = path.shape
    depth = jnp.arange(1, D + 1)[None, :]
    dst = start[:, None] + depth  # [B, D]
    src = jnp.where(depth <= num_accepted[:, None], start[:, None] + path, dst)
    rows = jnp.arange(B)[:, None]

    def move(buf):  # [L, B, S, K, D]
        return buf.at[:, rows, dst].set(buf[:, rows, src])
    return dataclasses.replace(cache, k=move(cache.k), v=move(cache.v))
