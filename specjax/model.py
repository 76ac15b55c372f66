"""A Llama-family decoder in Flax that reads and writes a KVCache.

RMSNorm, rotary position embeddings (Hugging Face's rotate-half layout), SwiGLU MLP and
grouped-query attention. Layers are stacked with ``nn.scan``, so every parameter of a layer has a
leading [L] axis and the program compiles once per layer shape, not once per layer.

Parameter tree (names follow Hugging Face, kernels are [in, out])::

    embed_tokens/embedding                 [V, E]
    layers/input_layernorm/weight          [L, E]
    layers/self_attn/{q,k,v,o}_proj/kernel [L, E, H*D] ... [L, H*D, E]
    layers/post_attention_layernorm/weight [L, E]
    layers/mlp/{gate,up,down}_proj/kernel  [L, E, F] ... [L, F, E]
    norm/weight                            [E]
    lm_head/kernel                         [E, V]   (absent when tie_word_embeddings)
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

from . import cache as kv
from .cache import KVCache
from .config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Model:
    """A config (static) and its parameters (a pytree of arrays)."""

    config: ModelConfig = dataclasses.field(metadata=dict(static=True))
    params: Any


class RMSNorm(nn.Module):
    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x: Array) -> Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32.astype(self.dtype) * weight).astype(self.dtype)


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

    @nn.compact
    def __call__(self, x, cos, sin, mask, k_cache, v_cache, start):
        cfg = self.config
        B, T, _ = x.shape
        H, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        dtype = jnp.dtype(cfg.dtype)
        dense = functools.partial(_dense, cfg, self.init_std, bias=cfg.attention_bias)
        q = dense(H * D, "q_proj")(x).reshape(B, T, H, D)
        k = dense(K * D, "k_proj")(x).reshape(B, T, K, D)
        v = dense(K * D, "v_proj")(x).reshape(B, T, K, D)
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_norm_eps, dtype, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, dtype, name="k_norm")(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache = kv.write(k_cache, k, start)  # [B, S, K, D]
        v_cache = kv.write(v_cache, v, start)
        # Query heads grouped by the kv head they share: h indexes the H/K heads of a group.
        q = q.reshape(B, T, K, H // K, D)
        scores = jnp.einsum("btkhd,bskd->bkhts", q, k_cache,
                            preferred_element_type=jnp.float32) * (D ** -0.5)
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(dtype)  # [B, K, H/K, T, S]
        out = jnp.einsum("bkhts,bskd->btkhd", weights, v_cache).reshape(B, T, H * D)
        out = _dense(cfg, self.init_std, cfg.hidden_size, "o_proj", bias=cfg.o_proj_bias)(out)
        return out, k_cache, v_cache


class MLP(nn.Module):
    config: ModelConfig
    init_std: float

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        dense = functools.partial(_dense, cfg, self.init_std)
        gate = dense(cfg.intermediate_size, "gate_proj")(x)
        up = dense(cfg.intermediate_size, "up_proj")(x)
        return dense(cfg.hidden_size, "down_proj")(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    config: ModelConfig
    init_std: float

    @nn.compact
    def __call__(self, x, k_cache, v_cache, cos, sin, mask, start):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        h = RMSNorm(cfg.rms_norm_eps, dtype, name="input_layernorm")(x)
        a, k_cache, v_cache = Attention(cfg, self.init_std, name="self_attn")(
            h, cos, sin, mask, k_cache, v_cache, start)
        x = x + a
        h = RMSNorm(cfg.rms_norm_eps, dtype, name="post_attention_layernorm")(x)
        x = x + MLP(cfg, self.init_std, name="mlp")(h)
        return x, (k_cache, v_cache)


class Decoder(nn.Module):
    """tokens [B, T] -> logits [B, T, V] (float32), hidden [B, T, E], updated k, v [L, B, S, K,
    D]."""

    config: ModelConfig
    init_std: float = 0.02

    @nn.compact
    def __call__(self, tokens, positions, mask, k, v, start):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                         embedding_init=nn.initializers.normal(self.init_std), name="embed_tokens")
        x = embed(tokens)  # [B, T, E]
        cos, sin = rope_tables(positions, cfg)
        layers = nn.scan(
            DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
            in_axes=(0, 0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_hidden_layers)(cfg, self.init_std, name="layers")
        x, (k, v) = layers(x, k, v, cos, sin, mask, start)
        hidden = RMSNorm(cfg.rms_norm_eps, dtype, name="norm")(x)
        if cfg.tie_word_embeddings:
            logits = embed.attend(hidden)
        else:
            logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype,
                              kernel_init=nn.initializers.normal(self.init_std),
                              name="lm_head")(hidden)
        return logits.astype(jnp.float32), hidden, k, v


def init_model(config: ModelConfig, key: Array, init_std: float = 0.02) -> Model:
    """Random parameters, every weight drawn from N(0, init_std²) (norm weights are ones)."""
    T = 1
    cache = KVCache.init(config, 1, T)
    tokens = jnp.zeros((1, T), jnp.int32)
    variables = jax.jit(Decoder(config, init_std).init)(
        key, tokens, jnp.zeros((1, T), jnp.int32), jnp.ones((1, T, T), bool), cache.k, cache.v,
        cache.length)
    return Model(config, variables["params"])


@jax.jit
def forward(model: Model, tokens: Array, positions: Array, cache: KVCache,
            chunk_mask: Array | None = None) -> tuple[Array, Array, KVCache]:
    """Run a chunk of T tokens through the model, reading and extending the cache.

    tokens, positions: [B, T] int32 (positions are per token, so a tree's nodes use their depth).
    chunk_mask: [T, T] or [B, T, T], True where token i may see token j of the chunk; None = causal.
    A wider [T, W] / [B, T, W] mask also covers the W - T slots written just before the chunk
    (see ``cache.attention_mask``; a tree drafted level by level uses it).
    The chunk is written at slots cache.length .. cache.length + T - 1 and the returned cache has
    length + T; callers roll it back to what they accept.

    Returns logits [B, T, V] float32, final-norm hidden states [B, T, E], and the new cache.
    """
    T = tokens.shape[1]
    if chunk_mask is None:
        chunk_mask = kv.causal_mask(T)
    mask = kv.attention_mask(cache.length, chunk_mask, cache.capacity)
    if model.config.sliding_window is not None:
        mask &= kv.window_mask(cache.length, positions, cache.capacity,
                               model.config.sliding_window)
    logits, hidden, k, v = Decoder(model.config).apply(
        {"params": model.params}, tokens, positions, mask, cache.k, cache.v, cache.length)
    return logits, hidden, KVCache(k, v, cache.length + T)


def prefill(model: Model, tokens: Array, cache: KVCache | None = None
            ) -> tuple[Array, Array, KVCache]:
    """A whole sequence from position 0: tokens [B, T] at positions 0 .. T-1, causal, written
    into ``cache`` (an empty cache of capacity >= T; None: one of capacity T).

    The one full-sequence forward: prompts in the engine and in proposers, training losses.
    Returns logits [B, T, V] float32, hidden [B, T, E] and the cache (length T; callers roll
    right-padded rows back to their lengths)."""
    B, T = tokens.shape
    if cache is None:
        cache = KVCache.init(model.config, B, T)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return forward(model, tokens, positions, cache)


@jax.jit
def _full_logits(model: Model, tokens: Array) -> Array:
    return prefill(model, tokens)[0]


def logits(model: Model, tokens) -> Array:
    """Plain full-causal forward without a cache: tokens [B, T] -> logits [B, T, V] float32."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2 or tokens.shape[1] == 0:
        raise ValueError(f"tokens must be [B, T] with T >= 1, got shape {tokens.shape}")
    return _full_logits(model, tokens)
