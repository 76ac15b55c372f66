"""Model-free drafts: look the row's last n tokens up in its own prompt and generated text.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, find earlier occurrences of the
row's last n tokens; the tokens that followed the chosen occurrence are the draft (point masses:
q is None). Everything is array code with static shapes, inside the compiled loop: no host round
trip, unlike proposers that search on the host each step.

Which occurrence wins: the one with the longest available continuation (up to γ tokens), and
among those the most recent. Recent text is the likeliest to be continued the same way (the loop
body just written, the line being copied); preferring a full-length continuation first means a
run like "a a a a" still proposes γ tokens instead of the single token after its latest match.

How many tokens: the whole continuation, up to γ, unless ``length_factor`` is set; then a match
of n tokens proposes at most ceil(length_factor × n). A long match is likelier to go on matching
than a short one, so the draft grows with the evidence for it: with a large γ, a two-token match
proposes a few tokens and an eight-token match many (the rule of suffix-tree speculation).

Rows with no match propose nothing (``valid`` all False) and decode one token that round.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import Array

from .base import Draft
from .gate import GateState, gated


def lookup(history: Array, length: Array, gamma: int, n_min: int, n_max: int,
           length_factor: float | None = None) -> tuple[Array, Array]:
    """history [B, S] with each row's sequence in history[b, :length[b] + 1].

    Returns (tokens [B, γ] int32, valid [B, γ] bool): the continuation of the chosen earlier
    occurrence of the longest matching suffix (n_max .. n_min tokens), valid for as many tokens as
    the history holds after it (at most γ, and at most ceil(length_factor × n) for a match of n
    tokens when length_factor is given); all invalid when nothing matches.

    Candidates are indexed by the slot e where an occurrence ends (e < last, the row's last
    index). ``run[e]`` counts how many of the row's last tokens match backwards from e, capped at
    n_max (``match_runs``). The winner maximises (run length, available continuation, e) in that
    order, packed into one integer for one argmax.
    """
    B, S = history.shape
    last = length  # index of the row's last token
    rows = jnp.arange(B)
    ends = jnp.arange(S)[None, :]  # candidate occurrence ends e
    # an occurrence ends before the row's last token
    run = jnp.where(ends < last[:, None], match_runs(history, last_tokens(history, length, n_max),
                                                     n_max), 0)
    available = jnp.clip(last[:, None] - ends, 0, gamma)  # continuation length after e
    score = jnp.where(run >= n_min, (run * (gamma + 1) + available) * S + ends, -1)
    best = jnp.argmax(score, axis=1)  # [B]
    hit = jnp.max(score, axis=1) >= 0
    count = jnp.where(hit, available[rows, best], 0)
    if length_factor is not None:  # n ≤ n_max is static, so the caps are a static table
        caps = np.minimum(np.ceil(length_factor * np.arange(n_max + 1)), gamma)
        count = jnp.minimum(count, jnp.asarray(caps, jnp.int32)[run[rows, best]])
    tokens = history[rows[:, None], jnp.clip(best[:, None] + 1 + jnp.arange(gamma)[None, :],
                                             0, S - 1)]
    valid = jnp.arange(gamma)[None, :] < count[:, None]
    return jnp.where(valid, tokens, 0), valid


def last_tokens(history: Array, length: Array, n: int) -> Array:
    """Each row's last n tokens, newest first: [B, n] (-1 where the row is shorter)."""
    S = history.shape[1]
    back = length[:, None] - jnp.arange(n)[None, :]
    return jnp.where(back >= 0, jnp.take_along_axis(history, jnp.clip(back, 0, S - 1), axis=1),
                     -1)


def match_runs(source: Array, want: Array, n_max: int) -> Array:
    """For every position e of source [B, L] (or [L], shared by the rows): how many of the
    row's last tokens want [B, n_max] (newest first) match backwards from e, capped at n_max:
    [B, L]. A comparison of the source shifted right by i (a static slice) with the row's i-th
    last token, for i < n_max, so one pass scores every n at once. No match runs past the
    source's start, so a source shorter than n_max (a small cache, a short corpus) stops the
    comparisons at its length."""
    src = source if source.ndim == 2 else source[None, :]
    L = src.shape[1]
    run = jnp.zeros((want.shape[0], L), jnp.int32)
    matching = jnp.ones((want.shape[0], L), bool)
    for i in range(min(n_max, L)):
        shifted = jnp.pad(src[:, :L - i], ((0, 0), (i, 0)), constant_values=-1)
        matching &= (shifted == want[:, i:i + 1]) & (want[:, i:i + 1] >= 0)
        run += matching.astype(jnp.int32)
    return run


@dataclasses.dataclass(frozen=True)
class NgramProposer:
    gamma: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    prompt_lookup_length_factor: float | None = None
    acceptance_floor: float = 0.0  # rows propose while their acceptance is this high (gate.py)

    def init(self, params, prompts: Array, prompt_lengths: Array, capacity: int):
        # the lookup needs only the history; the gate (if any) keeps each row's acceptance
        return GateState.init(prompts.shape[0]) if self.acceptance_floor > 0 else None

    def propose(self, params, state, history: Array, length: Array, keys: Array,
                sampling_params, filters) -> tuple[Draft, GateState | None]:
        tokens, valid = lookup(history, length, self.gamma, self.prompt_lookup_min,
                               self.prompt_lookup_max, self.prompt_lookup_length_factor)
        draft = Draft(tokens, None, valid)
        return (draft, None) if state is None else gated(draft, state, length,
                                                         self.acceptance_floor)


def build(spec, draft, target):
    """The registry's builder for method "ngram" (it uses no draft model)."""
    if draft is not None:
        raise ValueError(f"method {spec.method!r} uses no draft model; drop draft=")
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                         spec.prompt_lookup_max, spec.prompt_lookup_length_factor, spec.floor)
