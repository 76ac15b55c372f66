"""Model-free drafts: look the row's last n tokens up in its own prompt and generated text.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, find earlier occurrences of the
row's last n tokens; the tokens that followed the chosen occurrence are the draft (point masses:
q is None). Everything is array code with static shapes, inside the compiled loop: no host round
trip, unlike proposers that search on the host each step.

Which occurrence wins: the one with the longest available continuation (up to γ tokens), and
among those the most recent. Recent text is the likeliest to be continued the same way (the loop
body just written, the line being copied); preferring a full-length continuation first means a
run like "a a a a" still proposes γ tokens instead of the single token after its latest match.

Rows with no match propose nothing (``valid`` all False) and decode one token that round.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import Array

from . import Draft


def lookup(history: Array, length: Array, gamma: int, n_min: int, n_max: int
           ) -> tuple[Array, Array]:
    """history [B, S] with each row's sequence in history[b, :length[b] + 1].

    Returns (tokens [B, γ] int32, valid [B, γ] bool): the continuation of the chosen earlier
    occurrence of the longest matching suffix (n_max .. n_min tokens), valid for as many tokens as
    the history holds after it (at most γ); all invalid when nothing matches.
    """
    B, S = history.shape
    last = length  # index of the row's last token
    rows = jnp.arange(B)[:, None]
    starts = jnp.arange(S)[None, :]  # candidate occurrence starts j
    tokens = jnp.zeros((B, gamma), jnp.int32)
    count = jnp.zeros((B,), jnp.int32)
    found = jnp.zeros((B,), bool)
    for n in range(n_max, n_min - 1, -1):  # longest suffix first
        suffix_start = last - n + 1  # [B]
        match = (starts <= last[:, None] - n) & (suffix_start[:, None] >= 0)  # ends before last
        for k in range(n):
            want = history[jnp.arange(B), jnp.clip(suffix_start + k, 0, S - 1)]  # [B]
            have = history[rows, jnp.clip(starts + k, 0, S - 1)]  # [B, S]
            match &= have == want[:, None]
        available = jnp.minimum(gamma, last[:, None] + 1 - (starts + n))  # continuation length
        score = jnp.where(match, available * S + starts, -1)
        best = jnp.argmax(score, axis=1)  # [B]
        hit = jnp.max(score, axis=1) >= 0
        take = hit & ~found
        cont = history[rows, jnp.clip(best[:, None] + n + jnp.arange(gamma)[None, :], 0, S - 1)]
        tokens = jnp.where(take[:, None], cont, tokens)
        count = jnp.where(take, jnp.take_along_axis(available, best[:, None], 1)[:, 0], count)
        found |= hit
    valid = jnp.arange(gamma)[None, :] < count[:, None]
    return jnp.where(valid, tokens, 0), valid


@dataclasses.dataclass(frozen=True)
class NgramProposer:
    gamma: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def init(self, params, prompts: Array, prompt_lengths: Array, capacity: int):
        return None  # stateless: everything it needs is in the history

    def propose(self, params, state, history: Array, length: Array, keys: Array,
                sampling_params, filters) -> tuple[Draft, None]:
        tokens, valid = lookup(history, length, self.gamma, self.prompt_lookup_min,
                               self.prompt_lookup_max)
        return Draft(tokens, None, valid), None
