"""Draft vocabularies: a proposer that drafts only from M of the target's V token ids.

A small draft spends most of each step in its vocabulary projection (the bundled draft's LM head
is 73% of the weights a step multiplies by; EAGLE and Medusa project through the target's whole
LM head). Cutting the head to the M most frequent tokens of the training data (the idea of FR-Spec
and EAGLE-3) makes each draft step much cheaper. It stays lossless: q is zero outside the subset
(renormalised over it), and the verifier corrects any q.

``DraftVocab`` is a pytree of two arrays, ids [M] and the head's columns for them [E, M]: the
draft model and the heads drafters each carry one beside their weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from ..model import Model


def lm_head(model: Model) -> Array:
    """A model's LM head as [E, V] (the embedding's transpose when tied)."""
    p = model.params
    if model.config.tie_word_embeddings:
        return p["embed_tokens"]["embedding"].T
    return p["lm_head"]["kernel"]


def check_vocab(vocab, vocab_size: int) -> np.ndarray:
    """A draft vocabulary as int32 [M], or ValueError: it must be distinct ids in [0, V)."""
    ids = np.asarray(vocab)
    if (ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer)
            or ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"a draft vocabulary must be a non-empty 1-D list of token ids in "
                         f"[0, {vocab_size}), got {_describe(ids)}")
    if np.unique(ids).size != ids.size:
        raise ValueError("the draft vocabulary has repeated token ids")
    return ids.astype(np.int32)


def _describe(ids: np.ndarray) -> str:
    if ids.size == 0 or ids.ndim != 1 or not np.issubdtype(ids.dtype, np.number):
        return f"an array of shape {ids.shape} and dtype {ids.dtype}"
    return f"{ids.size} ids from {ids.min()} to {ids.max()} ({ids.dtype})"


def frequent_tokens(tokens: np.ndarray, vocab_size: int, size: int) -> np.ndarray:
    """The ``size`` most frequent ids of a token stream (ties: the smaller id), sorted by id."""
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
    return np.sort(order[:size]).astype(np.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftVocab:
    """The M token ids a proposer may draft and the LM head columns that score them."""

    ids: Array  # [M] int32, ids into the target's vocabulary
    head: Array  # [E, M], the LM head's columns for ids

    @classmethod
    def of(cls, model: Model, vocab) -> DraftVocab:
        """The draft vocabulary ``vocab`` (checked ids) over ``model``'s LM head."""
        ids = check_vocab(vocab, model.config.vocab_size)
        ids = jnp.asarray(ids, jnp.int32)
        return cls(ids, jnp.take(lm_head(model), ids, axis=1))

    @property
    def size(self) -> int:
        """M."""
        return int(self.ids.shape[0])

    def logits(self, h: Array) -> Array:
        """Features [..., E] -> logits over the draft vocabulary [..., M] (float32)."""
        return jnp.einsum("...e,em->...m", h.astype(self.head.dtype), self.head,
                          preferred_element_type=jnp.float32)

    def token_ids(self, index: Array) -> Array:
        """Indices into the draft vocabulary -> token ids (int32)."""
        return self.ids[index].astype(jnp.int32)

    def widen(self, sub: Array, vocab_size: int) -> Array:
        """Probabilities over the draft vocabulary [..., M] -> [..., V], zero elsewhere."""
        full = jnp.zeros(sub.shape[:-1] + (vocab_size,), jnp.float32)
        return full.at[..., self.ids].set(sub)
