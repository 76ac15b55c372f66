"""Attention over the KV cache that reads only the live slots.

A chunk of T queries attends to the cache slots its mask allows (``View``). Two ways compute the
same thing:

* ``dense``: one softmax over all S slots. Used when the cache is a single block (S <= block) or
  the chunk fills it (a full-sequence forward, as in training, where every slot is live and the
  backward pass needs a static loop), and for a sliding layer's ring of at most two blocks (all
  of a wrapped ring is live: ``ring_is_dense``).
* ``blocked``: the cache is walked in blocks of ``block`` slots with an online softmax (running
  maximum, running sum, running weighted values, as in flash-decoding), from slot 0 up to the
  batch's longest live row only. The trip count is computed on the device, so a step's cost
  follows what is live, not the capacity: a 4096-slot cache holding 64 tokens costs one block.

Both are exact for every row whatever the others hold: a block a row cannot see adds exactly zero
to its sums (its weights are selected to 0, its maximum is unchanged), so a row's result never
depends on how many blocks the longest row needed.

Masked slots never leak: scores are *selected* (``jnp.where``), never added to or multiplied by a
mask, so any key left in a dead slot is harmless, and every value vector attended over is finite,
because the cache stores a position whose values are not as zero values with NaN keys
(``cache.storable``, applied by the model before it writes or attends over a chunk). So an inf or
NaN from a broken position, left in a dead slot or in a chunk position a query may not see yet,
cannot turn a zero weight's 0 · inf into NaN (in float32, bfloat16 or float16), and a query that
does see it gets NaN, as the unguarded product would have given it.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from jax import Array

BLOCK = 256
"""Cache slots per attention block (a static size; the number of blocks walked is dynamic). The
engine records it in each program's plan when it plans one."""

_block = [None]  # the block size set by ``blocks_of`` while a program is traced


@contextlib.contextmanager
def blocks_of(block: int):
    """Trace the forwards inside with ``block`` slots per attention block (the engine wraps each
    compiled stage in it with its plan's block, so proposers' forwards use the same)."""
    saved = _block[0]
    _block[0] = int(block)
    try:
        yield
    finally:
        _block[0] = saved


def current_block() -> int:
    """The block size forwards traced now use: ``blocks_of``'s, else BLOCK."""
    return BLOCK if _block[0] is None else _block[0]

_NEG = float(jnp.finfo(jnp.float32).min)  # a masked score: finite, so NEG - NEG is 0, not NaN


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class View:
    """Which cache slots each of a chunk's T queries may attend to.

    The chunk's tokens are written at slots length .. length + T - 1; ``chunk_mask`` [B, T, W]
    (W >= T) covers the last W slots ending with the chunk (see ``cache.attention_mask``), every
    earlier slot is history and visible, every later one is dead. With a sliding window, a key
    more than ``window - 1`` positions behind its query is hidden too."""

    length: Array  # [B] int32: the chunk's first slot
    chunk_mask: Array  # [B, T, W] bool
    positions: Array  # [B, T] int32: the queries' positions
    window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    dense_mask: Array | None = None  # [B, T, S]: the whole mask, computed once for every layer
    #   when attention is dense (``uses_dense``)
    # False: the chunk is not written into the cache; its keys and values are passed to
    # ``attend`` apart (``chunk=``), the cache is read for the history only (slots < length), and
    # chunk_mask is [B, T, T] over the chunk alone. The caller writes them afterwards
    # (``cache.write_chunk``): a write inside a ``lax.switch`` branch made XLA copy the whole cache.
    chunk_in_cache: bool = dataclasses.field(default=True, metadata=dict(static=True))
    # S, the cache's capacity in virtual slots: a layer's buffer of fewer slots is a ring
    # (``cache.KVCache.ring_k``); None: no layer has one
    capacity: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def live(self) -> Array:
        """[] int32: slots the longest row uses after the chunk is written (not written: the
        history's)."""
        return jnp.max(self.length) + (self.chunk_mask.shape[1] if self.chunk_in_cache else 0)

    def mask(self, slots: Array) -> Array:
        """[B, T, n] bool for the cache slot indices ``slots`` [n] or per row [B, n]."""
        from . import cache as kv
        if self.chunk_in_cache:
            mask = kv.attention_mask(self.length, self.chunk_mask, slots)
        else:  # the history alone
            B, T = self.positions.shape
            slots = slots if slots.ndim == 2 else slots[None, :]
            mask = jnp.broadcast_to((slots < self.length[:, None])[:, None, :],
                                    (B, T, slots.shape[1]))
        if self.window is not None:
            mask &= kv.window_mask(self.length, self.positions, slots, self.window)
        return mask

    def ring_mask(self, slots: Array, size: int) -> Array:
        """``mask`` for the slots [n] of a ring of ``size`` slots: each read as the virtual slot
        it holds now (``cache.ring_virtual``); slots never written are hidden."""
        from . import cache as kv
        end = self.length + (self.chunk_mask.shape[1] if self.chunk_in_cache else 0)
        virtual = kv.ring_virtual(slots, end, size)  # [B, n]
        return self.mask(virtual) & (virtual >= 0)[:, None, :]

    def chunk_visible(self) -> Array:
        """[B, T, T]: which of the chunk's own tokens each query sees, when the chunk is passed
        apart from the cache (``chunk_in_cache=False``)."""
        mask = self.chunk_mask
        if self.window is not None:
            mask &= (self.positions[:, :, None] - self.positions[:, None, :]) < self.window
        return mask


def soft_cap(x: Array, cap: float | None) -> Array:
    """x squashed into (-cap, cap) by cap · tanh(x / cap) (Gemma 2's attention scores and final
    logits); x itself when cap is None."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def _scores(q: Array, k: Array, scale: float | None, softcap: float | None) -> Array:
    """q [B, T, K, G, D] against k [B, K, n, D]: [B, K, G, T, n] float32 scores, times ``scale``
    (None: D ** -0.5), then soft-capped to (-softcap, softcap) by softcap * tanh(s / softcap)
    when given (Gemma 2). Masking comes after."""
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32) * (
        q.shape[-1] ** -0.5 if scale is None else scale)
    return soft_cap(scores, softcap)


def dense(q: Array, k: Array, v: Array, mask: Array, scale: float | None = None,
          softcap: float | None = None) -> Array:
    """q [B, T, K, G, D] (G query heads per kv head), k, v [B, K, S, D], mask [B, T, S] ->
    [B, T, K, G, D] in q's dtype. Softmax in float32; scores as ``_scores``."""
    scores = jnp.where(mask[:, None, None], _scores(q, k, scale, softcap), _NEG)
    # exp(NEG - max) is exactly 0 (every query sees at least its own slot, so max is a real score)
    weights = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bksd->bkgtd", weights, v)
    return jnp.moveaxis(out, 3, 1)  # [B, T, K, G, D]


def _fold(carry, q: Array, k: Array, v: Array, mask: Array, scale: float | None = None,
          softcap: float | None = None):
    """One online-softmax step: (running peak, total, weighted values) with the keys k and
    values v [B, K, n, D] folded in, of which each query sees those mask [B, T, n] allows."""
    peak, total, acc = carry
    scores = _scores(q, k, scale, softcap)
    visible = mask[:, None, None]
    scores = jnp.where(visible, scores, _NEG)
    new_peak = jnp.maximum(peak, jnp.max(scores, axis=-1))
    weights = jnp.where(visible, jnp.exp(scores - new_peak[..., None]), 0.0)
    carried = jnp.exp(peak - new_peak)
    total = total * carried + jnp.sum(weights, axis=-1)
    acc = acc * carried[..., None] + jnp.einsum(
        "bkgts,bksd->bkgtd", weights.astype(q.dtype), v, preferred_element_type=jnp.float32)
    return new_peak, total, acc


def blocked(q: Array, k_all: Array, v_all: Array, layer: Array, view: View,
            block: int, chunk: tuple[Array, Array] | None = None, scale: float | None = None,
            softcap: float | None = None) -> Array:
    """Attention of q [B, T, K, G, D] over layer ``layer`` of k_all, v_all [L, B, K, S, D],
    block by block up to ``view.live``, then over ``chunk``'s keys and values [B, K, T, D] when
    they are not in the cache. The last block is read ending at slot S when S is not a multiple
    of ``block``; the slots it shares with the block before are masked out."""
    B, T, K, G, D = q.shape
    S = k_all.shape[3]
    ring = is_ring(S, view)

    def body(i, carry):
        first = i * block
        start = jnp.minimum(first, S - block)
        k = jax.lax.dynamic_slice(k_all, (layer, 0, 0, start, 0), (1, B, K, block, D))[0]
        v = jax.lax.dynamic_slice(v_all, (layer, 0, 0, start, 0), (1, B, K, block, D))[0]
        slots = start + jnp.arange(block, dtype=jnp.int32)
        mask = view.ring_mask(slots, S) if ring else view.mask(slots)
        mask &= (slots >= first)[None, None, :]  # [B, T, n]
        return _fold(carry, q, k, v, mask, scale, softcap)

    # a ring's slots are all live once it has wrapped
    blocks = ((jnp.minimum(view.live, S) if ring else view.live) + block - 1) // block
    init = (jnp.full((B, K, G, T), _NEG, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
            jnp.zeros((B, K, G, T, D), jnp.float32))
    carry = jax.lax.fori_loop(0, blocks, body, init)
    if chunk is not None:
        carry = _fold(carry, q, *chunk, view.chunk_visible(), scale, softcap)
    _, total, acc = carry
    # a query sees at least its own slot, unless it is padding written past the capacity (a
    # prefill's last chunk) under a sliding window: its output is never read, but keep it finite
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]
    return jnp.moveaxis(out, 3, 1).astype(q.dtype)  # [B, T, K, G, D]


def uses_dense(capacity: int, T: int, block: int) -> bool:
    """Whether attention over ``capacity`` slots for a chunk of T is one dense softmax: the cache
    is a single block, or the chunk fills it (a full-sequence forward)."""
    return capacity <= block or capacity == T


def ring_is_dense(slots: int, block: int) -> bool:
    """Whether attention over a ring of ``slots`` slots is one dense softmax: when it spans at
    most two blocks. Once a ring has wrapped, every slot is live, so walking it block by block
    skips nothing, and over two blocks the walk's loop, its block copies and its overlapping last
    block cost more than one softmax (the bundled draft's 319-slot ring: its propose 0.66-0.84
    of the time); the scores take at most twice a block's memory."""
    return slots <= 2 * block


def is_ring(slots: int, view: View) -> bool:
    """Whether a layer buffer of ``slots`` slots is a ring (fewer than the cache's capacity)."""
    return view.capacity is not None and slots < view.capacity


def attend(q: Array, k_all: Array, v_all: Array, layer: Array, view: View,
           block: int, chunk: tuple[Array, Array] | None = None, *, scale: float | None = None,
           softcap: float | None = None) -> Array:
    """q [B, T, K, G, D] over layer ``layer`` of the cache k_all, v_all [L, B, K, S, D] (the
    chunk already written, or passed as ``chunk`` = its keys and values [B, T, K, D] when
    ``view.chunk_in_cache`` is False), by ``view``; dense when ``uses_dense`` (a ring: when
    ``ring_is_dense``). Scores are scaled by ``scale`` (None: D ** -0.5) and soft-capped by
    ``softcap`` (None: not). A buffer of fewer slots than ``view.capacity`` is a ring
    (``View.ring_mask``)."""
    S, T = k_all.shape[3], q.shape[1]
    if (chunk is None) != view.chunk_in_cache:
        raise ValueError("pass the chunk's keys and values exactly when the view says they are "
                         "not in the cache")
    if chunk is not None:  # [B, K, T, D], as the cache holds them
        chunk = tuple(jnp.swapaxes(x, 1, 2) for x in chunk)
    ring = is_ring(S, view)
    if uses_dense(S, T, block) or (ring and ring_is_dense(S, block)):
        k = jax.lax.dynamic_index_in_dim(k_all, layer, axis=0, keepdims=False)
        v = jax.lax.dynamic_index_in_dim(v_all, layer, axis=0, keepdims=False)
        mask = view.dense_mask
        if ring:
            mask = view.ring_mask(jnp.arange(S, dtype=jnp.int32), S)
        elif mask is None:
            mask = view.mask(jnp.arange(S, dtype=jnp.int32))
        if chunk is not None:
            k, v = (jnp.concatenate([x, c.astype(x.dtype)], axis=2) for x, c in zip((k, v), chunk))
            mask = jnp.concatenate([mask, view.chunk_visible()], axis=2)
        return dense(q, k, v, mask, scale, softcap)
    return blocked(q, k_all, v_all, layer, view, block, chunk, scale, softcap)
