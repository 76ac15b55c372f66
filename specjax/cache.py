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

    The engine guarantees start + T <= S on the host; ``dynamic_update_slice`` would otherwise
    clamp the offset and silently overwrite valid entries.
    """
    def one(buf, x, s):
        return jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), s, axis=0)
    return jax.vmap(one)(buffer, new, start)


def attention_mask(length: Array, chunk_mask: Array, capacity: int) -> Array:
    """Which cache slots each new token may attend to: [B, T, S] bool.

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
    B, T, W = length.shape[0], chunk_mask.shape[-2], chunk_mask.shape[-1]
    chunk_mask = jnp.broadcast_to(chunk_mask, (B, T, W))
    slot = jnp.arange(capacity)[None, :]  # [1, S]
    offset = slot - (length[:, None] + T - W)  # [B, S]: index of the slot inside the window
    in_window = (offset >= 0) & (offset < W)
    gathered = jnp.take_along_axis(
        chunk_mask, jnp.broadcast_to(jnp.clip(offset, 0, W - 1)[:, None, :], (B, T, capacity)),
        axis=2)  # [B, T, S]
    return (offset < 0)[:, None, :] | (in_window[:, None, :] & gathered)


def window_mask(length: Array, positions: Array, capacity: int, window: int) -> Array:
    """Sliding-window attention: [B, T, S], True where the key's position is within the last
    ``window`` positions of the query's (q - k < window). History slot s holds position s; the
    chunk's slots hold the chunk's own positions."""
    T = positions.shape[1]
    slot = jnp.arange(capacity)[None, :]
    offset = slot - length[:, None]  # [B, S]
    chunk_pos = jnp.take_along_axis(positions, jnp.clip(offset, 0, T - 1), axis=1)
    key_pos = jnp.where((offset >= 0) & (offset < T), chunk_pos, slot)  # [B, S]
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
