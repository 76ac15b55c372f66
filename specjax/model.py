"""A Llama-family decoder in Flax that reads and writes a KVCache.

RMSNorm, rotary position embeddings (Hugging Face's rotate-half layout), SwiGLU MLP and
grouped-query attention.

Each layer has its own parameters (``layers/<i>/...``, as Hugging Face names them), not one
array stacked over the layers: a layer loop over stacked weights (``nn.scan``) slices each
layer's weights out of the stack, and XLA on CPU copies that slice at every step before the
matrix product reads it, which made a decode step of the bundled target 1.09-1.25x as long
(docs/performance.md#layer-weights). The layers are unrolled in the program instead.

Parameter tree (names follow Hugging Face, kernels are [in, out]; i = 0 .. L-1)::

    embed_tokens/embedding                    [V, E]
    layers/<i>/input_layernorm/weight          [E]
    layers/<i>/self_attn/{q,k,v,o}_proj/kernel [E, H*D] ... [H*D, E]
    layers/<i>/post_attention_layernorm/weight [E]
    layers/<i>/mlp/{gate,up,down}_proj/kernel  [E, F] ... [F, E]
    norm/weight                               [E]
    lm_head/kernel                            [E, V]   (absent when tie_word_embeddings)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from . import attention
from . import cache as kv
from .cache import KVCache
from .config import ModelConfig, check_int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Model:
    """A config (static) and its parameters (a pytree of arrays)."""

    config: ModelConfig = dataclasses.field(metadata=dict(static=True))
    params: Any


class RMSNorm(nn.Module):
    """Llama's: normalised in float32, cast, times the weight. ``unit_offset`` (Gemma): times
    (1 + weight) in float32, then cast; the weight starts at 0."""

    eps: float
    dtype: Any
    unit_offset: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + weight.astype(jnp.float32))).astype(self.dtype)
        return (x32.astype(self.dtype) * weight).astype(self.dtype)


def norm(config: ModelConfig, name: str) -> RMSNorm:
    """The config's RMSNorm (Llama's, or Gemma's with a unit offset)."""
    return RMSNorm(config.rms_norm_eps, jnp.dtype(config.dtype), config.norm_unit_offset,
                   name=name)


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies [D/2] (host-side, float32), with the config's scaling applied."""
    D = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type == "default":
        pass
    elif scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        old = scaling.original_max_position_embeddings
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > old / scaling.low_freq_factor, inv_freq / scaling.factor,
                          inv_freq)
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= old / scaling.high_freq_factor) & (
            wavelen <= old / scaling.low_freq_factor)
        inv_freq = np.where(medium, blended, scaled)
    return inv_freq.astype(np.float32)


def rope_tables(positions: Array, config: ModelConfig) -> tuple[Array, Array]:
    """positions [B, T] -> cos, sin [B, T, D] (float32), HF layout: frequencies repeated twice."""
    inv_freq = jnp.asarray(inverse_frequencies(config))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, T, D]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x [B, T, heads, D] rotated by its token's position."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def _dense(config: ModelConfig, init_std: float, features: int, name: str,
           bias: bool = False) -> nn.Dense:
    dtype = jnp.dtype(config.dtype)
    return nn.Dense(features, use_bias=bias, dtype=dtype, param_dtype=dtype, name=name,
                    kernel_init=nn.initializers.normal(init_std))


class Attention(nn.Module):
    config: ModelConfig
    init_std: float
    sliding: bool = True  # False: a full-attention layer, which ignores the view's window

    @nn.compact
    def __call__(self, x, cos, sin, view, k_all, v_all, layer, block):
        cfg = self.config
        B, T, _ = x.shape
        H, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        dense = functools.partial(_dense, cfg, self.init_std, bias=cfg.attention_bias)
        q = dense(H * D, "q_proj")(x).reshape(B, T, H, D)
        k = dense(K * D, "k_proj")(x).reshape(B, T, K, D)
        v = dense(K * D, "v_proj")(x).reshape(B, T, K, D)
        if cfg.qk_norm:
            q = norm(cfg, "q_norm")(q)
            k = norm(cfg, "k_norm")(k)
        if not self.sliding and view.window is not None:
            view = dataclasses.replace(view, window=None, dense_mask=None)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = kv.storable(k, v)  # no non-finite value is ever stored or attended over
        chunk = None
        if view.chunk_in_cache:
            # Written in place into the whole cache [L, B, K, S, D]: carried through the layers,
            # the cache is never copied, so a step costs nothing per unused slot.
            k_all = kv.write_layer(k_all, layer, k, view.length, view.capacity)
            v_all = kv.write_layer(v_all, layer, v, view.length, view.capacity)
        else:  # the caller writes them (cache.write_chunk)
            chunk = (k.astype(k_all.dtype), v.astype(v_all.dtype))
        # Query heads grouped by the kv head they share: g indexes the H/K heads of a group.
        out = attention.attend(q.reshape(B, T, K, H // K, D), k_all, v_all, layer, view, block,
                               chunk, scale=(cfg.query_pre_attn_scalar or D) ** -0.5,
                               softcap=cfg.attn_logit_softcapping)
        out = _dense(cfg, self.init_std, cfg.hidden_size, "o_proj", bias=cfg.o_proj_bias)(
            out.reshape(B, T, H * D))
        return out, k_all, v_all, chunk


class MLP(nn.Module):
    config: ModelConfig
    init_std: float

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        dense = functools.partial(_dense, cfg, self.init_std)
        gate = dense(cfg.intermediate_size, "gate_proj")(x)
        up = dense(cfg.intermediate_size, "up_proj")(x)
        act = nn.silu if cfg.hidden_act == "silu" else functools.partial(nn.gelu,
                                                                         approximate=True)
        return dense(cfg.hidden_size, "down_proj")(act(gate) * up)


class DecoderLayer(nn.Module):
    """One layer: carry (x [B, T, E], k_all, v_all [L, B, K, S, D]), ``layer`` its index.
    Also returns the chunk's keys and values [B, T, K, D] when the view leaves them out of the
    cache (else None)."""

    config: ModelConfig
    init_std: float
    block: int = attention.BLOCK  # slots per attention block
    sliding: bool = True  # False: full attention whatever the view's window

    @nn.compact
    def __call__(self, carry, layer, cos, sin, view):
        x, k_all, v_all = carry
        cfg = self.config
        h = norm(cfg, "input_layernorm")(x)
        a, k_all, v_all, chunk = Attention(cfg, self.init_std, self.sliding, name="self_attn")(
            h, cos, sin, view, k_all, v_all, layer, self.block)
        if cfg.sandwich_norms:  # Gemma 2, 3: each block's output is normalised too
            x = x + norm(cfg, "post_attention_layernorm")(a)
            h = norm(cfg, "pre_feedforward_layernorm")(x)
            return (x + norm(cfg, "post_feedforward_layernorm")(
                MLP(cfg, self.init_std, name="mlp")(h)), k_all, v_all), chunk
        x = x + a
        h = norm(cfg, "post_attention_layernorm")(x)
        x = x + MLP(cfg, self.init_std, name="mlp")(h)
        return (x, k_all, v_all), chunk


class Layers(nn.Module):
    """The decoder layers, unrolled: layer i's parameters are ``layers/<i>/...``."""

    config: ModelConfig
    init_std: float
    block: int

    @nn.compact
    def __call__(self, carry, rope, view, layout=None, taps=()):
        """carry: (x, k, v, ring_k, ring_v) as in ``KVCache``; layout: where each layer's keys
        and values live (``cache.layer_layout``; None: layer i at index i of k, v). Also
        returns the residual stream after each layer in ``taps`` (0-based). rope: the (cos,
        sin) tables of the full layers, then of the sliding ones (the same when they share a
        RoPE)."""
        chunks, tapped = [], []
        cfg = self.config
        x, *stores = carry
        for i in range(cfg.num_hidden_layers):
            sliding = cfg.layer_window(i) is not None
            ring, index = (False, i) if layout is None else layout[i]
            cos, sin = rope[1] if sliding else rope[0]
            k, v = stores[2 * ring: 2 * ring + 2]
            (x, k, v), chunk = DecoderLayer(cfg, self.init_std, self.block, sliding,
                                            name=str(i))((x, k, v), index, cos, sin, view)
            stores[2 * ring: 2 * ring + 2] = k, v
            chunks.append(chunk)
            if i in taps:
                tapped.append(x)
        return (x, *stores), (None if chunks[0] is None else jax.tree.map(
            lambda *c: jnp.stack(c), *chunks)), tapped


def _float32_dot(*args, **kwargs):
    """lax.dot_general accumulating and returning float32 (the LM head)."""
    return jax.lax.dot_general(*args, **kwargs, preferred_element_type=jnp.float32)


class Decoder(nn.Module):
    """tokens [B, T] -> logits [B, T, V] (float32), hidden [B, T, E], updated k, v [L, B, K, S,
    D] (a view with ``chunk_in_cache=False``: the chunk's own k, v [L, B, T, K, D]), and the
    updated rings (ring_k, ring_v) when a ``rings`` layout is given (else None).
    ``stacked``: the layers as one ``nn.scan`` over weights stacked on a leading [L] axis, used
    only by ``init_model`` (so a seed draws the same weights as in specjax 0.1)."""

    config: ModelConfig
    init_std: float = 0.02
    block: int = attention.BLOCK
    stacked: bool = False
    # Layers whose outputs (the residual stream after them, 0-based) to return, concatenated,
    # in place of the final-norm hidden state (the block drafter reads several,
    # specjax/draft/dflash.py); () for the final-norm hidden state
    taps: tuple[int, ...] = ()
    # the chunk positions whose logits are computed (logits [B, len, V]); None: all of them
    logits_at: tuple[int, ...] | None = None

    # which layers keep a ring (``KVCache.rings``), or None
    rings: tuple[bool, ...] | None = None

    @nn.compact
    def __call__(self, tokens, view, k, v, ring_k=None, ring_v=None):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                         embedding_init=nn.initializers.normal(self.init_std), name="embed_tokens")
        x = embed(tokens)  # [B, T, E]
        if cfg.scale_embeddings:  # Gemma: by sqrt(E), rounded to the model dtype first
            x = x * jnp.asarray(cfg.hidden_size ** 0.5, jnp.float32).astype(dtype)
        cos, sin = rope_tables(view.positions, cfg)
        if self.stacked:
            if self.taps:
                raise ValueError("taps need the unrolled layers (stacked=False)")
            layers = nn.scan(
                DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
                length=cfg.num_hidden_layers)(cfg, self.init_std, self.block, name="layers")
            (x, k, v), chunks = layers((x, k, v), jnp.arange(cfg.num_hidden_layers), cos, sin,
                                       view)
        else:
            local = (cos, sin) if cfg.rope_local_theta is None else rope_tables(
                view.positions, cfg.local_rope())
            layout = kv.layer_layout(self.rings, cfg.num_hidden_layers)
            (x, k, v, ring_k, ring_v), chunks, tapped = Layers(
                cfg, self.init_std, self.block, name="layers")(
                (x, k, v, ring_k, ring_v), ((cos, sin), local), view, layout, self.taps)
        if chunks is not None:  # the chunk's keys and values, [L, B, T, K, D], for the caller
            k, v = chunks
        hidden = norm(cfg, "norm")(x)
        head_in = (hidden if self.logits_at is None
                   else hidden[:, np.asarray(self.logits_at, np.int32)])
        # The LM head accumulates and returns float32 whatever the model computes in: bfloat16
        # logits (8 significant bits) tie exactly at a few percent of the bundled target's
        # greedy tokens, where a verify forward and a one-token forward then choose apart.
        if cfg.tie_word_embeddings:  # [B, T, E] x [V, E] -> [B, T, V]
            logits = _float32_dot(head_in, embed.embedding, (((2,), (1,)), ((), ())))
        else:
            logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype,
                              kernel_init=nn.initializers.normal(self.init_std),
                              dot_general=_float32_dot, name="lm_head")(head_in)
        logits = attention.soft_cap(logits.astype(jnp.float32), cfg.final_logit_softcapping)
        if self.taps:
            hidden = jnp.concatenate(tapped, axis=-1)
        if self.rings is not None:
            return logits, hidden, k, v, (ring_k, ring_v)
        return logits, hidden, k, v


def stack_layers(params: dict, num_layers: int) -> dict:
    """``params`` with the per-layer trees ``layers/<i>/...`` stacked into one tree of [L, ...]
    arrays (the layout of specjax checkpoints before version 2)."""
    per_layer = [params["layers"][str(i)] for i in range(num_layers)]
    return {**params, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)}


def unstack_layers(params: dict, num_layers: int) -> dict:
    """The inverse of ``stack_layers``."""
    stacked = params["layers"]
    return {**params, "layers": {str(i): jax.tree.map(lambda x, i=i: x[i], stacked)
                                 for i in range(num_layers)}}


def view(cache: KVCache, positions: Array, chunk_mask: Array | None, window: int | None,
         block: int = attention.BLOCK, write: bool = True) -> attention.View:
    """What a chunk of T tokens at ``positions`` [B, T], written at cache.length, may see (with
    the whole mask computed once, outside the layers, when attention is dense). ``write=False``:
    the chunk is not written (``attention.View.chunk_in_cache``); chunk_mask must be [T, T]."""
    B, T = positions.shape
    if chunk_mask is None:
        chunk_mask = kv.causal_mask(T)
    if not write and chunk_mask.shape[-1] != T:
        raise ValueError(f"a chunk kept out of the cache sees only itself: its mask must be "
                         f"[T, T], got {chunk_mask.shape} for T = {T}")
    chunk_mask = jnp.broadcast_to(chunk_mask, (B,) + chunk_mask.shape[-2:])
    out = attention.View(cache.length, chunk_mask, positions, window, chunk_in_cache=write,
                         capacity=None if cache.rings is None else cache.capacity)
    if attention.uses_dense(cache.capacity, T, block):
        out = dataclasses.replace(out, dense_mask=out.mask(jnp.arange(cache.capacity)))
    return out


def init_model(config: ModelConfig, key: Array, init_std: float = 0.02) -> Model:
    """Random parameters: every weight matrix drawn from N(0, init_std²), biases zero, norm
    weights one (zero with ``norm_unit_offset``, which scales by 1 + weight).
    ``key``: a ``jax.random.key`` (or a raw PRNGKey), or an int seed, as ``generate`` takes."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config must be an sj.ModelConfig, got {type(config).__name__}")
    if isinstance(init_std, bool) or not isinstance(init_std, (int, float, np.floating,
                                                               np.integer)) \
            or not np.isfinite(init_std) or init_std < 0:
        raise ValueError(f"init_std must be a finite number >= 0, got {init_std!r}")
    if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
        key = jax.random.key(int(key))
    elif not isinstance(key, (jax.Array, np.ndarray)):
        raise ValueError(f"key must be a jax.random.key or an int seed, got "
                         f"{type(key).__name__}")
    return Model(config, _init_params(config, float(init_std), key))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_params(config: ModelConfig, init_std: float, key: Array):
    """The parameters of init_model: one program per (config, init_std), traced and compiled
    once per process however often a model of that config is made (checkpoint loading builds
    its template from it too)."""
    cache = KVCache.init(config, 1, 1)
    tokens, positions = jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32)
    stacked = Decoder(config, init_std, stacked=True).init(
        key, tokens, view(cache, positions, None, None), cache.k, cache.v)
    return unstack_layers(stacked["params"], config.num_hidden_layers)


def check_taps(config: ModelConfig, taps) -> tuple[int, ...]:
    """``taps`` as a tuple of ascending layer indices in [0, L) (the order their outputs are
    concatenated in), or ValueError naming it."""
    taps = tuple(taps)
    L = config.num_hidden_layers
    if (list(taps) != sorted(set(taps)) or any(isinstance(t, bool) or not isinstance(t, int)
                                               or not 0 <= t < L for t in taps)):
        raise ValueError(f"taps must be ascending distinct layer indices in [0, {L}), got "
                         f"{taps!r}")
    return taps


def check_span(config: ModelConfig, cache: KVCache, width: int) -> None:
    """Refuse a chunk spanning ``width`` slots (its tokens, or its mask's window) that is wider
    than the cache's rings were made for: its writes would evict entries its own queries see."""
    if cache.ring is not None:
        span = cache.ring - config.sliding_window + 1
        if width > span:
            raise ValueError(f"a chunk spanning {width} slots is wider than this cache's "
                             f"sliding-window rings allow ({span}): create the cache with "
                             f"KVCache.init(..., span={width}) or more")


@functools.lru_cache(maxsize=16)
def abstract_params(config: ModelConfig):
    """The parameter tree ``init_model(config)`` makes, as shapes and dtypes (traced, not run)."""
    return jax.eval_shape(lambda k: init_model(config, k).params, jax.random.key(0))


def check_chunk(tokens, positions, cache: KVCache) -> None:
    """Called with concrete arrays (not inside a trace): refuse tokens and positions that are not
    [B, T] alike with B the cache's rows, and a chunk that would run past the cache's capacity
    (its writes would be dropped and its logits computed from slots that were never written)."""
    shape = getattr(tokens, "shape", ())
    if len(shape) != 2 or getattr(positions, "shape", None) != shape:
        raise ValueError(f"tokens and positions must both be [B, T], got shapes {shape} and "
                         f"{getattr(positions, 'shape', None)}")
    if shape[0] != cache.length.shape[0]:
        raise ValueError(f"tokens hold {shape[0]} rows; the cache holds {cache.length.shape[0]}")
    if isinstance(cache.length, jax.core.Tracer):
        return
    longest = int(np.max(np.asarray(cache.length))) if shape[0] else 0
    if longest + shape[1] > cache.capacity:
        raise ValueError(f"a chunk of {shape[1]} tokens after {longest} cached ones needs "
                         f"{longest + shape[1]} slots; the cache holds {cache.capacity} (make it "
                         f"with KVCache.init(..., capacity) of at least that)")


def check_ids(tokens, vocab_size: int) -> None:
    """Concrete tokens only: every id in [0, vocab_size), or -1, the padding generate's own
    buffers hold (read as a token: keep it where no position you read can see it, past the
    end of a causal pass). An id past the vocabulary gave NaN logits; one below -1 another
    token's embedding."""
    if isinstance(tokens, jax.core.Tracer) or not getattr(tokens, "size", 0):
        return
    low, high = int(np.min(np.asarray(tokens))), int(np.max(np.asarray(tokens)))
    if low < -1 or high >= vocab_size:
        raise ValueError(f"tokens must be ids in [0, {vocab_size}) (or -1 for padding), got "
                         f"{low}..{high}")


def forward(model: Model, tokens: Array, positions: Array, cache: KVCache,
            chunk_mask: Array | None = None, *, block: int | None = None, write: bool = True,
            taps: tuple[int, ...] = (), logits_at: tuple[int, ...] | None = None
            ) -> tuple[Array, Array, KVCache]:
    """Run a chunk of T tokens through the model, reading and extending the cache.

    tokens, positions: [B, T] int32 (positions are per token, so a tree's nodes use their depth).
    chunk_mask: [T, T] or [B, T, T], True where token i may see token j of the chunk; None = causal.
    A wider [T, W] / [B, T, W] mask also covers the W - T slots written just before the chunk
    (see ``cache.attention_mask``; a tree drafted level by level uses it).
    The chunk is written at slots cache.length .. cache.length + T - 1 and the returned cache has
    length + T; callers roll it back to what they accept. Attention reads the cache in blocks of
    ``block`` slots up to the longest row's length (``specjax.attention``), so the cost follows
    the live length, not the capacity (None: ``attention.current_block()``).

    Returns logits [B, T, V] float32, final-norm hidden states [B, T, E], and the new cache.

    ``write=False`` leaves the cache untouched and returns, in its place, the chunk's keys and
    values (k, v) [L, B, T, K, D] for ``cache.write_chunk``: attention reads the history from the
    cache and the chunk from them (chunk_mask then [T, T] or [B, T, T]). Inside a ``lax.switch``
    branch, writing the cache made XLA copy all of it, in every round.

    ``taps`` (layer indices): return, in place of the final-norm hidden states, the residual
    stream after each of those layers, concatenated: [B, T, len(taps) * E].

    ``logits_at`` (chunk indices, static): compute the logits at those positions only, [B,
    len(logits_at), V] in that order (a lookahead window's inner guesses need none).
    """
    block = attention.current_block() if block is None else block
    T = tokens.shape[1] if len(getattr(tokens, "shape", ())) == 2 else None
    if logits_at is not None:
        logits_at = tuple(int(i) for i in logits_at)
        if T is not None and any(not 0 <= i < T for i in logits_at):  # clamped silently before
            raise ValueError(f"logits_at={logits_at}: chunk indices must be in [0, {T})")
    if chunk_mask is not None and T is not None:
        shape, B = tuple(chunk_mask.shape), tokens.shape[0]
        if not (len(shape) in (2, 3) and shape[-2] == T and shape[-1] >= T
                and (len(shape) == 2 or shape[0] in (1, B))):
            raise ValueError(f"chunk_mask must be [T, W] or [B, T, W] with W >= T (the W - T "
                             f"slots written just before the chunk, then the chunk), got "
                             f"{shape} for B = {B}, T = {T}")
    check_span(model.config, cache, tokens.shape[1] if chunk_mask is None else max(
        tokens.shape[1], chunk_mask.shape[-1]))
    check_chunk(tokens, positions, cache)
    check_ids(tokens, model.config.vocab_size)
    return _forward(model, tokens, positions, cache, chunk_mask, block=block, write=write,
                    taps=check_taps(model.config, taps), logits_at=logits_at)


@functools.partial(jax.jit, static_argnames=("block", "write", "taps", "logits_at"))
def _forward(model: Model, tokens: Array, positions: Array, cache: KVCache,
             chunk_mask: Array | None, *, block: int, write: bool = True, taps=(),
             logits_at=None) -> tuple[Array, Array, KVCache | tuple[Array, Array]]:
    T = tokens.shape[1]
    out = Decoder(model.config, block=block, taps=taps, logits_at=logits_at,
                  rings=cache.rings).apply(
        {"params": model.params}, tokens,
        view(cache, positions, chunk_mask, model.config.sliding_window, block, write),
        cache.k, cache.v, cache.ring_k, cache.ring_v)
    logits, hidden, k, v = out[:4]
    if not write:
        return logits, hidden, (k, v)
    ring_k, ring_v = out[4] if cache.rings is not None else (None, None)
    return logits, hidden, dataclasses.replace(cache, k=k, v=v, ring_k=ring_k, ring_v=ring_v,
                                               length=cache.length + T)


def prefill(model: Model, tokens: Array, cache: KVCache | None = None
            ) -> tuple[Array, Array, KVCache]:
    """A whole sequence from position 0: tokens [B, T] at positions 0 .. T-1, causal, written
    into ``cache`` (an empty cache of capacity >= T; None: one of capacity T).

    The full-sequence forward of training losses and ``logits`` (prompts in the engine and in
    proposers go through ``prefill_chunked``). Returns logits [B, T, V] float32, hidden
    [B, T, E] and the cache (length T; callers roll right-padded rows back to their lengths)."""
    B, T = tokens.shape
    if cache is None:
        cache = KVCache.init(model.config, B, T)
    elif not isinstance(cache.length, jax.core.Tracer) and np.any(np.asarray(cache.length)):
        raise ValueError(f"prefill starts at position 0: it takes an empty cache, got one "
                         f"holding {np.asarray(cache.length).tolist()} tokens (roll it back "
                         f"with cache.rollback, or continue it with sj.forward)")
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return forward(model, tokens, positions, cache)


PREFILL_CHUNK = 64
"""Prompt tokens per prefill forward: prompts of any length share one compiled prefill."""


def over_chunks(fn, init, lengths: Array, chunk: int):
    """``carry = fn(carry, start)`` for start = 0, chunk, 2·chunk, ... below max(lengths): a loop
    whose trip count is computed on the device, so the prompt length picks no program."""
    blocks = (jnp.max(lengths) + chunk - 1) // chunk
    return jax.lax.fori_loop(0, blocks, lambda i, carry: fn(carry, i * chunk), init)


def padding_start(start: Array, lengths: Array) -> Array:
    """Where each row writes a prefill chunk starting at ``start``: there, or, for a row whose
    prompt has ended, right after its prompt. Padding written further on would, in a sliding
    layer's ring, evict entries the row still sees."""
    return jnp.minimum(start, lengths)


def prefill_chunked(model: Model, tokens: Array, lengths: Array, cache: KVCache,
                    chunk: int = PREFILL_CHUNK, keep_hidden: bool = False,
                    taps: tuple[int, ...] = ()) -> tuple[Array, Array | None, KVCache]:
    """Prefill right-padded prompts tokens [B, N] (lengths [B]) into an empty ``cache``,
    ``chunk`` tokens per forward, only as many chunks as the longest row needs. Chunk slots past
    the cache's capacity (padding only) are dropped.

    Returns each row's last logits [B, V] (float32, at position lengths - 1), the final-norm
    hidden states [B, N, E] when ``keep_hidden`` (entries past a row's length are padding;
    with ``taps``, the tapped layers' outputs [B, N, len(taps) * E] as in ``forward``), and the
    cache rolled back to ``lengths``."""
    B, N = tokens.shape
    check_int("prefill_chunked's chunk", chunk, 1)
    if not isinstance(lengths, jax.core.Tracer):  # called with concrete arrays: check them
        longest = int(np.max(np.asarray(lengths))) if B else 0
        if B and (longest > N or int(np.min(np.asarray(lengths))) < 0):
            raise ValueError(f"prefill_chunked: lengths must be in [0, {N}] (the prompts' "
                             f"width), got {np.asarray(lengths).tolist()}")
        if longest > cache.capacity:  # its tokens past the capacity would be dropped
            raise ValueError(f"prefill_chunked: a prompt of {longest} tokens does not fit a "
                             f"cache of capacity {cache.capacity}")
    chunk = min(chunk, N)
    tokens = jnp.pad(tokens, ((0, 0), (0, -N % chunk)))
    rows = jnp.arange(B)
    dtype = jnp.dtype(model.config.dtype)
    width = model.config.hidden_size * max(1, len(taps))
    hidden0 = jnp.zeros((B, tokens.shape[1], width), dtype) if keep_hidden else None

    def step(carry, start):
        last, hidden_all, cache = carry
        piece = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
        positions = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
        logits, hidden, cache = forward(model, piece, positions,
                                        cache.rollback(padding_start(start, lengths)), taps=taps)
        index = lengths - 1 - start
        here = (index >= 0) & (index < chunk)
        last = jnp.where(here[:, None], logits[rows, jnp.clip(index, 0, chunk - 1)], last)
        if hidden_all is not None:
            hidden_all = jax.lax.dynamic_update_slice_in_dim(hidden_all, hidden, start, axis=1)
        return last, hidden_all, cache

    init = (jnp.zeros((B, model.config.vocab_size), jnp.float32), hidden0, cache)
    last, hidden, cache = over_chunks(step, init, lengths, chunk)
    return last, (None if hidden is None else hidden[:, :N]), cache.rollback(lengths)


@jax.jit
def _full_logits(model: Model, tokens: Array) -> Array:
    return prefill(model, tokens)[0]


def logits(model: Model, tokens) -> Array:
    """Plain full-causal forward without a cache: tokens [B, T] -> logits [B, T, V] float32.
    Token ids are checked (integers in [0, V)) unless traced. Positions past the model's
    max_position_embeddings are computed (RoPE extends to them), as measurements of a model's
    quality beyond its trained length need."""
    if not isinstance(tokens, jax.core.Tracer):
        ids = np.asarray(tokens)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"tokens must be integer token ids, got dtype {ids.dtype}")
        if ids.ndim == 2 and ids.size:
            bad = ids[(ids < 0) | (ids >= model.config.vocab_size)]
            if bad.size:
                raise ValueError(f"tokens hold token id {int(bad[0])} outside [0, "
                                 f"{model.config.vocab_size})")
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2 or tokens.shape[1] == 0:
        raise ValueError(f"tokens must be [B, T] with T >= 1, got shape {tokens.shape}")
    return _full_logits(model, tokens)
