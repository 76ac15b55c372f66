"""Lookahead decoding: the target drafts for itself by Jacobi iteration, in the same forward
that verifies (Fu et al., 2024). No draft model, no training, no corpus.

Every round the target's verify forward carries two branches:

* the **verification branch**: the static tree (``shape``; by default G chains of depth N - 1
  with distinct first tokens) filled with the pool's n-grams that start with the row's last
  token, the most frequent continuation first; verified as any point-mass tree is;
* the **lookahead branch**: a window of guesses, N - 1 levels of W tokens. Level l, column i
  sits at depth i + l + 1 after the row's last token and sees level 0's columns up to i and the
  levels above it in column i: a chain along level 0 with a stack hanging off each column, so
  each column's stack runs along consecutive positions. The target's argmax at level N - 2
  (the last) of column i continues that column: the column's N - 1 tokens and it form an
  n-gram, added to the pool (unless the pool holds it already). Then every level moves up one
  (level 0 is dropped) and the argmaxes become the last level: with one token accepted a round,
  each guess keeps its absolute position, as in Jacobi iteration, and a guess that converges
  is a token the target would write there.

Neither branch sees the other (``Lookahead`` in specjax/draft/base.py), so the verification
is exactly the tree verification of the pool's candidates: the output follows the target's
distribution at any temperature, and greedy output equals autoregressive decoding's. The window
is only ever a source of guesses; it is written to the cache past the tree and dropped.

The pool is a per-row ring of ``pool_size`` n-grams on the device, seeded with the prompt's
last n-grams (so text that repeats the prompt is found from the first round) and fed W
n-grams a round by the window, the oldest overwritten first; all shapes are static.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from ..tree import Tree
from .base import MAX_CANDIDATES, Draft, check_fanout, fill_by_count


def chains(count: int, depth: int) -> Tree:
    """G = ``count`` chains of ``depth`` tokens from the root, with distinct first tokens (the
    default verification shape): the G most frequent next tokens among the pool's n-grams that
    start with the row's last token, each continued by its most frequent continuation."""
    return Tree([(r,) + (0,) * d for r in range(count) for d in range(depth)])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LookaheadState:
    window: Array  # [B, N - 1, W] int32: the guesses, level by level
    pool: Array  # [B, P, N] int32: n-grams, -1 where empty
    write: Array  # [B] int32: the pool slot written next


@dataclasses.dataclass(frozen=True)
class LookaheadProposer:
    """Lookahead decoding (see the module docstring). ``shape``: the verification tree (its
    depth is N - 1); ``window``: W; ``pool_size``: n-grams kept per row; ``candidates``: the
    pool's most recent matching n-grams counted when filling the shape."""

    shape: Tree
    window: int = 1
    pool_size: int = 64
    candidates: int = MAX_CANDIDATES

    def __post_init__(self):  # built directly, as a custom proposer may be: checked as well
        from ..config import _require_int
        for name in ("window", "pool_size", "candidates"):
            _require_int(self, name, getattr(self, name), 1)
        if self.pool_size < self.window:  # a round's n-grams would share slots
            raise ValueError(f"LookaheadProposer.pool_size={self.pool_size} is smaller than the "
                             f"window={self.window} n-grams a round adds")
        check_fanout(self.shape, min(self.candidates, self.pool_size), "LookaheadProposer")

    @property
    def gamma(self) -> int:
        return self.shape.num_nodes - 1

    @property
    def tree(self) -> Tree:
        return self.shape

    @property
    def ngram(self) -> int:
        """N: an n-gram is the row's last token and N - 1 continuation tokens."""
        return self.shape.depth + 1

    @functools.cached_property
    def _layout(self) -> tuple[np.ndarray, np.ndarray]:
        L, W = self.ngram - 1, self.window
        level, column = np.divmod(np.arange(L * W), W)  # node k = level * W + column
        depths = (column + level + 1).astype(np.int32)
        sees_level0 = (level[None, :] == 0) & (column[None, :] <= column[:, None])
        sees_stack = (column[None, :] == column[:, None]) & (level[None, :] <= level[:, None])
        mask = sees_level0 | sees_stack
        for x in (depths, mask):
            x.setflags(write=False)
        return depths, mask

    @property
    def lookahead_depths(self) -> np.ndarray:
        return self._layout[0]

    @property
    def lookahead_mask(self) -> np.ndarray:
        return self._layout[1]

    @property
    def lookahead_read(self) -> tuple[int, ...]:
        """Only the last level's argmaxes are read (the LM head runs for those alone)."""
        L, W = self.ngram - 1, self.window
        return tuple(range((L - 1) * W, L * W))

    def init(self, params, prompts: Array, prompt_lengths: Array, capacity: int
             ) -> LookaheadState:
        B, L, W, N, P = prompts.shape[0], self.ngram - 1, self.window, self.ngram, self.pool_size
        rows = jnp.arange(B)[:, None]
        n = jnp.maximum(prompt_lengths, 1)[:, None]
        back = (jnp.arange(L * W)[None, :] % n)  # the prompt's last tokens, newest first
        window = prompts[rows, n - 1 - back].reshape(B, L, W)
        # the prompt's last P n-grams (newest in the slot before the write point)
        start = prompt_lengths[:, None] - N - jnp.arange(P)[::-1][None, :]  # [B, P]
        grams = prompts[rows[:, :, None], jnp.clip(start, 0)[:, :, None] + jnp.arange(N)]
        grams = jnp.where((start >= 0)[:, :, None], grams, -1)
        return LookaheadState(window.astype(jnp.int32), grams.astype(jnp.int32),
                              jnp.zeros((B,), jnp.int32))

    def propose(self, params, state: LookaheadState, history: Array, length: Array, keys: Array,
                sampling_params, filters) -> tuple[Draft, LookaheadState]:
        B, P = history.shape[0], self.pool_size
        root = history[jnp.arange(B), length]
        age = (state.write[:, None] - 1 - jnp.arange(P)[None, :]) % P  # 0: the newest
        match = (state.pool[:, :, 0] == root[:, None]) & (state.pool[:, :, 0] >= 0)
        top, index = jax.lax.top_k(jnp.where(match, P - age, -1), min(self.candidates, P))
        continuations = jnp.take_along_axis(state.pool, index[:, :, None], axis=1)[:, :, 1:]
        tokens, valid = fill_by_count(self.shape, continuations, top >= 0)
        guesses = state.window.reshape(B, -1)
        return Draft(tokens, None, valid, lookahead=guesses), state

    def observe_lookahead(self, state: LookaheadState, seen: Array) -> LookaheadState:
        last = seen  # [B, W]: the last level's argmaxes, each column's continuation
        grams = jnp.concatenate([jnp.swapaxes(state.window, 1, 2), last[:, :, None]], axis=2)
        pool, write = add_ngrams(state.pool, state.write, grams)
        window = jnp.concatenate([state.window[:, 1:], last[:, None]], axis=1)
        return LookaheadState(window, pool, write)


def add_ngrams(pool: Array, write: Array, grams: Array) -> tuple[Array, Array]:
    """Add n-grams grams [B, W, N] to each row's ring pool [B, P, N] at its write point [B],
    skipping those the pool holds already and repeats among them (the first kept), the oldest
    overwritten first. Returns the pool and the new write points."""
    B, W, _ = grams.shape
    P = pool.shape[1]
    held = jnp.any(jnp.all(grams[:, :, None] == pool[:, None], axis=3), axis=2)  # [B, W]
    same = jnp.all(grams[:, :, None] == grams[:, None], axis=3)  # [B, w, w']
    earlier = jnp.any(same & (jnp.arange(W)[None, None, :] < jnp.arange(W)[None, :, None]), axis=2)
    keep = ~held & ~earlier
    slot = jnp.where(keep, (write[:, None] + jnp.cumsum(keep, axis=1) - 1) % P, P)
    pool = pool.at[jnp.arange(B)[:, None], slot].set(grams, mode="drop")
    return pool, (write + jnp.sum(keep, axis=1, dtype=jnp.int32)) % P


def build(spec, draft, target):
    """The registry's builder for method "lookahead" (it uses no draft model)."""
    if draft is not None:
        raise ValueError(f"method {spec.method!r} uses no draft model; drop draft=")
    shape = (Tree(spec.tree) if spec.tree is not None
             else chains(spec.lookahead_candidates, spec.num_speculative_tokens))
    return LookaheadProposer(shape, spec.lookahead_window, spec.lookahead_pool_size)


__all__ = ["LookaheadProposer", "LookaheadState", "chains", "add_ngrams"]
