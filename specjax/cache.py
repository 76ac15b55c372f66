"""The KV cache: fixed-capacity buffers plus per-row lengths.

Contract: entries at index >= ``length[b]`` are garbage and invisible to attention,
except the slots of the chunk being written, which see each other through the intra-chunk mask.
Every value vector stored is finite (``storable``): a position whose values are not is stored
with zero values and NaN keys, so the queries that see it get NaN and no other query can meet a
non-finite value, whatever is left in dead slots.
Rollback is ``length = new_length``; nothing is zeroed or copied. Capacity S is static and chosen
by the engine, which refuses on the host any request that could write past it.

Sliding-window layers can keep only their window (``KVCache.init(..., span=)``): a ring of
R = window + span - 1 slots per such layer, where span is the most slots written past a committed
length before the next rollback (the largest prefill chunk or verify width). Virtual slot s (the
slot it would have in the full cache) lives at ring slot s mod R; attention maps each ring slot
back to the latest virtual slot it can hold and masks by that, so masks, rollback by length and
tree compaction mean what they mean in the full cache. A write never evicts an entry a later
query can see: the entries it overwrites are at least R slots behind it, and every query from
then on sits at or after the committed length, more than ``window - 1`` positions ahead of them.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from .config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    # [L, B, K, S, D]: every layer's keys and values, each kv head's slots together, the layout
    # attention reads them in (slots before heads, XLA transposed every layer's whole cache on
    # every step: 29% of a batch-16 decode step on a 2-core CPU); with rings, the full-attention
    # layers' only (L may be 0: the array still carries the capacity S in its shape)
    k: Array
    v: Array
    length: Array  # [B] int32: valid entries per row
    ring_k: Array | None = None  # [L_sliding, B, K, R, D]: the sliding layers' rings, or None
    ring_v: Array | None = None
    # which layers keep a ring (static), or None: none does
    rings: tuple[bool, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def init(cls, config: ModelConfig, batch: int, capacity: int,
             span: int | None = None) -> KVCache:
        """An empty cache of ``capacity`` slots per row. ``span`` (the most slots written past a
        committed length before the next rollback): the sliding layers keep rings of
        ``ring_size`` slots when that is smaller than the capacity."""
        for name, value in (("batch", batch), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"KVCache.init: {name} must be an int >= 1, got {value!r}")
        R = ring_size(config, capacity, span)
        dtype = jnp.dtype(config.dtype)
        K, D = config.num_key_value_heads, config.head_dim
        rings = None if R is None else tuple(config.layer_window(i) is not None
                                             for i in range(config.num_hidden_layers))
        full = jnp.zeros((config.num_hidden_layers - sum(rings or ()), batch, K, capacity, D),
                         dtype)
        ring = None if R is None else jnp.zeros((sum(rings), batch, K, R, D), dtype)
        return cls(k=full, v=full, length=jnp.zeros((batch,), jnp.int32), ring_k=ring,
                   ring_v=ring, rings=rings)

    @property
    def capacity(self) -> int:
        return self.k.shape[SLOTS]

    @property
    def ring(self) -> int | None:
        """R, the slots of each sliding layer's ring, or None (every layer keeps S)."""
        return None if self.ring_k is None else self.ring_k.shape[SLOTS]

    def layout(self, num_layers: int) -> tuple[tuple[bool, int], ...]:
        """``layer_layout`` of this cache's ``rings``."""
        return layer_layout(self.rings, num_layers)

    def rollback(self, length: Array) -> KVCache:
        """Keep the first ``length[b]`` entries of each row. Also used to advance after a write."""
        return dataclasses.replace(self, length=jnp.asarray(length, jnp.int32))


SLOTS = 3
"""The slot axis of a cache buffer [L, B, K, S, D]."""


def by_slot(buffer: Array) -> Array:
    """A cache buffer [L, B, K, S, D] as [L, B, S, K, D] (each slot's heads together), for
    reading entries slot by slot; its own inverse, so it also stores entries laid out slot by
    slot."""
    return jnp.swapaxes(buffer, 2, 3)


def ring_size(config: ModelConfig, capacity: int, span: int | None) -> int | None:
    """R = window + span - 1 slots for each sliding layer, or None when no layer slides, no span
    is given, or R would not be smaller than the capacity."""
    if span is None or not any(config.layer_window(i) is not None
                               for i in range(config.num_hidden_layers)):
        return None
    R = config.sliding_window + int(span) - 1
    return R if R < capacity else None


def layer_layout(rings: tuple[bool, ...] | None, num_layers: int
                 ) -> tuple[tuple[bool, int], ...]:
    """Where each of num_layers layers keeps its keys and values: (in a ring, index in that
    array), in layer order; rings as ``KVCache.rings`` (None: every layer at its own index of the
    full array)."""
    out, counts = [], [0, 0]
    for ring in rings or (False,) * num_layers:
        out.append((ring, counts[ring]))
        counts[ring] += 1
    return tuple(out)


def ring_virtual(slots: Array, end: Array, size: int) -> Array:
    """The virtual slot each ring slot ``slots`` [n] holds when rows have written up to
    virtual slot end [B] (exclusive): the latest s < end with s = slot mod ``size``; negative
    where nothing was written there yet. [B, n]."""
    back = end[:, None] - 1 - slots[None, :]
    return slots[None, :] + size * jnp.floor_divide(back, size)


def write(buffer: Array, new: Array, start: Array) -> Array:
    """Write new [B, T, ...] into buffer [B, S, ...] at per-row offsets start [B].

    Entries that would land at slot S or beyond are dropped, never clamped onto valid ones (the
    engine also refuses on the host any request that could write past S; the last chunk of a
    prefill may run past it with padding only, and a finished row's rounds may too)."""
    return _write_rows(buffer, new, start, None)


def write_layer(buffer: Array, layer: Array, new: Array, start: Array,
                capacity: int | None = None) -> Array:
    """Write new [B, T, K, D] into layer ``layer`` of a cache buffer [L, B, K, S, D] at per-row
    offsets start [B] (as ``write``). A buffer of fewer slots than ``capacity`` is a ring:
    virtual slot s goes to s mod its size, those past the capacity are dropped."""
    return _write_rows(buffer, new, start, layer, capacity)


def storable(k: Array, v: Array) -> tuple[Array, Array]:
    """Keys and values k, v [..., K, D] as the cache stores them: where a position's value vector
    (of a kv head) is not finite, its values are zeros and its keys NaN.

    Attention selects masked scores away (``jnp.where``) but multiplies the values by the
    weights, and a masked slot's weight is exactly 0: 0 · inf or 0 · NaN is NaN, so a non-finite
    value left in a dead slot, or in a chunk position a query may not see yet, would reach the
    queries that must not see it. Stored this way, no value is ever non-finite, and a query
    that does see such a position gets a NaN score, hence NaN, as the unguarded product would
    have given it. Checking once at the write replaces a check of every slot read at every step
    (about 5% of a draft-model round on a CPU: experiments/results/2026-12-04-finite-at-write.md).
    """
    bad = ~jnp.all(jnp.isfinite(v), axis=-1, keepdims=True)
    return (jnp.where(bad, jnp.asarray(jnp.nan, k.dtype), k),
            jnp.where(bad, jnp.zeros((), v.dtype), v))


def write_chunk(cache: KVCache, k: Array, v: Array) -> KVCache:
    """Write a chunk's keys and values k, v [L, B, T, K, D] (``model.forward(write=False)``,
    every layer in order) at each row's length; the returned cache has length + T.

    One scatter per buffer for all its layers at once. A write per layer cost a scatter and a
    copy of the layer's slice for each layer and buffer: the bundled target's round that
    proposes nothing ran 534 XLA operations that way, 502 this way. Stored as ``storable``."""
    k, v = storable(k, v)
    layout = cache.layout(k.shape[0])
    out = {}
    for ring, names in ((False, ("k", "v")), (True, ("ring_k", "ring_v"))):
        layers = [i for i, (r, _) in enumerate(layout) if r == ring]
        if not layers:
            continue
        for name, new in zip(names, (k, v)):
            if len(layers) < len(layout):  # static indices: the layers this buffer keeps
                new = new[np.asarray(layers)]
            out[name] = _write_rows(getattr(cache, name), new, cache.length, None,
                                    cache.capacity, layers=True)
    return dataclasses.replace(cache, **out, length=cache.length + k.shape[2])


def _write_rows(buffer: Array, new: Array, start: Array, layer: Array | None,
                capacity: int | None = None, layers: bool = False) -> Array:
    """buffer [B, S, ...] with row b's slots start[b] .. start[b] + T - 1 set to new [B, T, ...];
    slots past S dropped. With ``layer``: a cache buffer [L, B, K, S, D], whose layer ``layer``
    gets new [B, T, K, D]; ``layers``: new is [L, B, T, K, D], written into every layer at once.
    A cache buffer of fewer slots than ``capacity`` is a ring (``KVCache.ring_k``): slot s is
    written at s mod its size, and slots past the capacity are dropped.

    One scatter whose batch dimension is the row: XLA updates the buffer in place, whatever the
    batch, and a mesh that splits the rows moves nothing between devices. (A vmapped
    ``.at[].set`` moves the row axis to the front, and for B > 1 that transpose copied the whole
    cache on every write: 12.8x the step at 4096 slots, B = 2, in experiments/capacity_curve.py.)
    """
    B, T = new.shape[1:3] if layers else new.shape[:2]
    step = jnp.arange(T, dtype=jnp.int32)[None, :]
    slots = (start[:, None] + step).astype(jnp.int32)
    cached = layer is not None or layers  # a cache buffer [L, B, K, S, D]
    size = buffer.shape[SLOTS if cached else 1]
    ring = capacity is not None and size < capacity
    if ring:  # each past the capacity to its own slot past the ring, dropped
        slots = jnp.where(slots < capacity, slots % size, size + step)
    window = tuple(range(2, new.ndim))  # the dimensions written whole: K, D (and L)
    if layers:  # [L, B, T, K, D] into [L, B, K, S, D]
        index, row, indexed, window = slots[..., None], 1, (SLOTS,), (0, 3, 4)
    elif layer is None:
        index, row, indexed = slots[..., None], 0, (1,)
    else:  # [B, T, K, D] into layer ``layer`` of [L, B, K, S, D]
        layer_ids = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (B, T))
        index, row, indexed = jnp.stack([layer_ids, slots], axis=-1), 1, (0, SLOTS)
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=window, inserted_window_dims=indexed,
        scatter_dims_to_operand_dims=indexed, operand_batching_dims=(row,),
        scatter_indices_batching_dims=(0,))
    return jax.lax.scatter(buffer, index, new.astype(buffer.dtype), dims,
                           indices_are_sorted=not ring, unique_indices=True,
                           mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def _slots(slots) -> Array:
    """[1, n] or [B, n] slot indices from an int S (all of 0 .. S - 1), [n] or [B, n]."""
    slots = jnp.arange(slots, dtype=jnp.int32) if isinstance(slots, int) else slots
    return slots if slots.ndim == 2 else slots[None, :]


def attention_mask(length: Array, chunk_mask: Array, slots: int | Array) -> Array:
    """Which cache slots each new token may attend to: [B, T, n] bool for the slot indices
    ``slots`` [n] or per row [B, n] (an int S: all of 0 .. S - 1).

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
    n = slots.shape[1]
    chunk_mask = jnp.broadcast_to(chunk_mask, (B, T, W))
    offset = slots - (length[:, None] + T - W)  # [B, n]: index inside the window
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
    offset = slots - length[:, None]  # [B, n]
    chunk_pos = jnp.take_along_axis(positions, jnp.clip(offset, 0, T - 1), axis=1)
    key_pos = jnp.where((offset >= 0) & (offset < T), chunk_pos, slots)  # [B, n]
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
    before any write. Rings move the same virtual slots (a tree's nodes span fewer slots than
    a ring holds, so none of them is evicted).
    """
    B, D = path.shape
    depth = jnp.arange(1, D + 1)[None, :]
    dst = start[:, None] + depth  # [B, D]
    src = jnp.where(depth <= num_accepted[:, None], start[:, None] + path, dst)
    rows = jnp.arange(B)[:, None]

    def move(buf, ring=False):  # [L, B, K, S or R, D]
        to, fro = dst, src
        if ring:  # virtual slots to ring slots; those past the capacity dropped
            R = buf.shape[SLOTS]
            to = jnp.where(dst < cache.capacity, dst % R, R + depth)
            fro = src % R
        # (the row and slot indices, apart, lead both sides alike)
        return buf.at[:, rows, :, to].set(buf[:, rows, :, fro], mode="drop")
    out = dataclasses.replace(cache, k=move(cache.k), v=move(cache.v))
    if cache.ring_k is None:
        return out
    return dataclasses.replace(out, ring_k=move(cache.ring_k, True),
                               ring_v=move(cache.ring_v, True))
