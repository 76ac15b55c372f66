"""Logits -> the processed float32 distribution used everywhere; sampling from it.

``process_logits`` is the only place where temperature, top-k and top-p are applied. The draft's
q, the target's p in verification, the recovered and bonus tokens and the autoregressive baseline
all come from it, so a draft can never be sampled from one distribution and checked against
another (PITFALLS: "Losing losslessness").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array


@dataclasses.dataclass(frozen=True)
class Filters:
    """Which filters the compiled program contains. Static, so a call that uses neither top-k
    nor top-p does not pay for the vocabulary sorts; the filter values themselves are arrays."""

    top_k: bool = False
    top_p: bool = False


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters as device arrays, all [B]."""

    temperature: Array  # [B] float32; 0 marks a greedy row
    top_k: Array  # [B] int32; 0 = off
    top_p: Array  # [B] float32; 1 = off


def _per_row(x: Array, logits: Array) -> Array:
    """[B] -> [B, 1, ..., 1] broadcastable against logits[B, ..., V] without the V axis."""
    return x.reshape(x.shape + (1,) * (logits.ndim - 1 - x.ndim))


def process_logits(logits: Array, params: SamplingArrays, filters: Filters = Filters()) -> Array:
    """Turn logits [B, ..., V] into probabilities [B, ..., V] (float32, rows sum to 1).

    Order: temperature, then top-k, then top-p on the renormalised top-k distribution. Tokens tied
    with the k-th largest logit are all kept (as Hugging Face does), so the result never depends on
    how a sort breaks ties. Greedy rows (temperature == 0) get a one-hot on the first argmax,
    selected by an explicit mask, never through a sentinel temperature.
    """
    x = logits.astype(jnp.float32)
    temperature = _per_row(params.temperature, x)[..., None]
    greedy = temperature == 0
    x = x / jnp.where(greedy, 1.0, temperature)
    V = x.shape[-1]
    if filters.top_k:
        k = _per_row(params.top_k, x)[..., None]
        k = jnp.where((k <= 0) | (k > V), V, k)
        descending = -jnp.sort(-x, axis=-1)
        kth = jnp.take_along_axis(descending, k - 1, axis=-1)  # [B, ..., 1]
        x = jnp.where(x < kth, -jnp.inf, x)
    probs = jax.nn.softmax(x, axis=-1)
    if filters.top_p:
        top_p = _per_row(params.top_p, x)[..., None]
        descending = -jnp.sort(-probs, axis=-1)
        mass_before = jnp.cumsum(descending, axis=-1) - descending
        # Keep a token if the mass of strictly more likely tokens is below top_p; the smallest
        # kept probability is the threshold, and ties with it are kept too.
        keep = (mass_before < top_p) | (top_p >= 1.0)
        threshold = jnp.min(jnp.where(keep, descending, jnp.inf), axis=-1, keepdims=True)
        probs = jnp.where(probs < threshold, 0.0, probs)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
    return jnp.where(greedy, one_hot, probs)


def sample(keys: Array, probs: Array) -> Array:
    """Draw one token per row: keys [B], probs [B, V] -> tokens [B] int32.

    Each row uses its own key, so a row's draw never depends on its neighbours. Zero-probability
    tokens are never drawn (log 0 = -inf), which also keeps one-hot (greedy) rows exact.
    """
    draw = lambda key, p: jax.random.categorical(key, jnp.log(p))  # noqa: E731
    return jax.vmap(draw)(keys, probs).astype(jnp.int32)
