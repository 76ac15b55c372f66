"""Lossless verification of a chain of drafts: pure functions with a static γ.

Three kinds of output token (the vLLM vocabulary):

* **accepted**: a draft token d_k that passed its test;
* **recovered**: drawn at the first rejection, from what the target wants that the draft did not
  offer;
* **bonus**: drawn from p_{γ+1} when all γ drafts passed.

Rules (Leviathan et al. 2023; Chen et al. 2023):

* sampled drafts (q given): accept d_k with probability min(1, p_k(d_k) / q_k(d_k)); recover
  from norm(max(0, p_k - q_k));
* point-mass drafts (q is None: n-gram lookup, argmax drafters): accept with probability
  p_k(d_k); recover from p_k with d_k removed and renormalised;
* greedy rows need no rule of their own: their p is one-hot, so both rules accept exactly when the
  draft equals the target's argmax and otherwise recover that argmax.

Either way a position's output is distributed as p_k, so the emitted sequence has the target's
distribution. ``acceptance_probs`` and ``recovery_probs`` expose the rule as probabilities, which
the tests enumerate exactly; ``rejection_sample`` draws from them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array

from . import sampling


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verdict:
    tokens: Array  # [B, G+1] int32: accepted drafts, then the recovered or bonus token, then -1
    num_accepted: Array  # [B] int32 in [0, G]; the row emits num_accepted + 1 tokens


def _draft_token_probs(probs: Array, tokens: Array) -> Array:
    """probs [B, G, V], tokens [B, G] -> probs[b, k, tokens[b, k]]: [B, G]."""
    return jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]


def acceptance_probs(draft_tokens: Array, draft_probs: Array | None, target_probs: Array,
                     valid: Array | None = None) -> Array:
    """Probability of accepting each draft, given that all before it were accepted: [B, G].

    draft_tokens [B, G]; draft_probs [B, G, V] or None (point-mass drafts); target_probs
    [B, G+1, V]; valid [B, G] (a prefix per row) or None: drafts not proposed are never accepted.
    """
    G = draft_tokens.shape[1]
    p = _draft_token_probs(target_probs[:, :G], draft_tokens)
    if draft_probs is None:
        accept = p
    else:
        q = _draft_token_probs(draft_probs, draft_tokens)
        # q(d) > 0 for any token the draft sampled; the guard only keeps the division finite.
        accept = jnp.minimum(1.0, p / jnp.maximum(q, jnp.finfo(jnp.float32).tiny))
    return accept if valid is None else jnp.where(valid, accept, 0.0)


def recovery_probs(draft_tokens: Array, draft_probs: Array | None, target_probs: Array,
                   valid: Array | None = None) -> Array:
    """The distribution the row's last token is drawn from, for each stopping point: [B, G+1, V].

    Index k < G: the recovered-token distribution after rejecting draft k. Index G: p_{G+1}, for the
    bonus token. Where the residual has no mass (p_k == q_k, so rejection has probability 0) the
    row falls back to p_k, which is never used but keeps the array a distribution. Where draft k
    was not proposed (valid False) nothing was rejected: the row draws from p_k itself, exactly as
    autoregressive decoding would.
    """
    G = draft_tokens.shape[1]
    p = target_probs[:, :G]
    if draft_probs is None:
        residual = jnp.where(jax.nn.one_hot(draft_tokens, p.shape[-1], dtype=bool), 0.0, p)
    else:
        residual = jnp.maximum(p - draft_probs, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p)
    if valid is not None:
        residual = jnp.where(valid[..., None], residual, p)
    return jnp.concatenate([residual, target_probs[:, G:]], axis=1)


def rejection_sample(keys: Array, draft_tokens: Array, draft_probs: Array | None,
                     target_probs: Array, valid: Array | None = None) -> Verdict:
    """One verification round for a batch of chains.

    keys [B] (one per row); draft_tokens [B, G]; draft_probs [B, G, V] or None for point-mass
    drafts; target_probs [B, G+1, V], the processed target distributions at the γ+1 positions;
    valid [B, G] or None: per-row draft lengths (a row with k valid drafts accepts at most k).
    """
    B, G = draft_tokens.shape
    accept_p = acceptance_probs(draft_tokens, draft_probs, target_probs, valid)  # [B, G]
    recover_p = recovery_probs(draft_tokens, draft_probs, target_probs, valid)  # [B, G+1, V]
    split = jax.vmap(jax.random.split)(keys)  # [B, 2]
    u = jax.vmap(lambda k: jax.random.uniform(k, (G,)))(split[:, 0])  # [B, G] in [0, 1)
    accepted = u < accept_p
    num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1).astype(jnp.int32)  # [B]
    last_p = jnp.take_along_axis(recover_p, num_accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    last = sampling.sample(split[:, 1], last_p)  # recovered or bonus token
    index = jnp.arange(G + 1)[None, :]
    padded = jnp.concatenate([draft_tokens, jnp.zeros((B, 1), draft_tokens.dtype)], axis=1)
    tokens = jnp.where(index < num_accepted[:, None], padded, -1)
    tokens = jnp.where(index == num_accepted[:, None], last[:, None].astype(tokens.dtype), tokens)
    return Verdict(tokens.astype(jnp.int32), num_accepted)
