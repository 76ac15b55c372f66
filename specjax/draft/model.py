"""Drafts from an independent small model with its own KV cache.

Each round the draft runs γ forwards: one two-token forward, then γ - 1 single-token forwards. The first forward re-feeds the token before the last one, at slot length - 1:

* if the previous round rejected a draft, that slot already holds exactly this token (recomputed,
  identical), and rewriting it also rolls back everything after it;
* if the previous round accepted all γ drafts, the draft model never saw its own last draft d_γ
  (it only proposed it), and this write is how it catches up, without a data-dependent shape.

So the draft cache never needs to be told what was accepted: rollback is setting its length to
length - 1 before the write.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array

from .. import model as model_lib
from .. import sampling
from ..cache import KVCache, compact
from ..config import ModelConfig
from ..tree import Tree
from . import Draft


@dataclasses.dataclass(frozen=True)
class DraftModelProposer:
    config: ModelConfig  # the draft model's config (same vocabulary as the target)
    gamma: int  # drafts per round

    def init(self, params, prompts: Array, prompt_lengths: Array, capacity: int) -> KVCache:
        """Prefill the draft cache with the prompts [B, P] (right-padded)."""
        B, P = prompts.shape
        positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
        cache = KVCache.init(self.config, B, capacity)
        _, _, cache = model_lib.forward(model_lib.Model(self.config, params), prompts, positions,
                                        cache)
        return cache.rollback(prompt_lengths)

    def propose(self, params, cache: KVCache, history: Array, length: Array, keys: Array,
                sampling_params: sampling.SamplingArrays, filters: sampling.Filters
                ) -> tuple[Draft, KVCache]:
        draft = model_lib.Model(self.config, params)
        rows = jnp.arange(history.shape[0])
        prev, last = history[rows, length - 1], history[rows, length]
        step_keys = jax.vmap(lambda k: jax.random.split(k, self.gamma))(keys)  # [B, G]

        # Two-token catch-up forward at slots length-1, length (see module docstring).
        cache = cache.rollback(length - 1)
        logits, _, cache = model_lib.forward(
            draft, jnp.stack([prev, last], 1), jnp.stack([length - 1, length], 1), cache)
        def draw(logits, key):
            """The next draft and the distribution it was drawn from; greedy calls propose the
            argmax as a point mass (q is one-hot anyway), skipping the softmax and the draw."""
            if filters.greedy:
                return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
            q = sampling.process_logits(logits, sampling_params, filters)  # [B, V]
            return sampling.sample(key, q), q

        token, q = draw(logits[:, -1], step_keys[:, 0])

        # γ - 1 single-token forwards, unrolled (γ is static and small): a lax.scan here carries
        # the draft cache through a loop, which measured slower per round on a CPU.
        tokens, probs = [token], [q]
        for i in range(1, self.gamma):
            logits, _, cache = model_lib.forward(draft, token[:, None], (length + i)[:, None],
                                                 cache)
            token, q = draw(logits[:, 0], step_keys[:, i])
            tokens.append(token)
            probs.append(q)
        tokens = jnp.stack(tokens, axis=1)  # [B, G]
        probs = None if probs[0] is None else jnp.stack(probs, axis=1)  # [B, G, V]
        return Draft(tokens, probs), cache


@dataclasses.dataclass(frozen=True)
class DraftTreeProposer:
    """The draft model expanding a static tree level by level (one draft forward per depth).

    The round starts with the chain proposer's two-token catch-up forward, whose last position
    ranks the root's children. Then for each depth d < D, the nodes at depth d are fed in one
    forward at positions length + d, written at their tree slots (node i at slot length + i)
    under the tree's ancestor mask (``cache.attention_mask`` with a window covering the tree
    so far), and their logits rank their own children. A node's children are the draft's
    top-ranked tokens after it: rank r = the r-th largest logit (the order of its processed
    distribution wherever that is non-zero; greedy rows still get distinct runner-up children).
    Drafts are point masses, verified with the tree rule (``verify.tree_sample``).

    After verification the engine calls ``commit``, which moves the accepted path's entries to
    consecutive slots, so the next round's catch-up sees the cache a chain would have left.
    """

    config: ModelConfig
    tree: Tree

    @property
    def gamma(self) -> int:
        return self.tree.num_nodes - 1  # drafts per round: every non-root node

    def init(self, params, prompts: Array, prompt_lengths: Array, capacity: int) -> KVCache:
        return DraftModelProposer(self.config, 1).init(params, prompts, prompt_lengths, capacity)

    def propose(self, params, cache: KVCache, history: Array, length: Array, keys: Array,
                sampling_params: sampling.SamplingArrays, filters: sampling.Filters
                ) -> tuple[Draft, KVCache]:
        draft = model_lib.Model(self.config, params)
        tree = self.tree
        B = history.shape[0]
        rows = jnp.arange(B)
        prev, last = history[rows, length - 1], history[rows, length]
        ranks, parents, ancestors = tree.ranks, tree.parents, tree.ancestors
        width = int(tree.children.shape[1])

        cache = cache.rollback(length - 1)
        logits, _, cache = model_lib.forward(
            draft, jnp.stack([prev, last], 1), jnp.stack([length - 1, length], 1), cache)
        ranked = [jax.lax.top_k(logits[:, -1:], width)[1]]  # per level: [B, nodes, width]
        tokens = []  # per level: [B, nodes]
        for d, (start, stop) in enumerate(tree.levels):
            first_parent = 0 if d == 0 else tree.levels[d - 1][0]
            parent = parents[start:stop] - first_parent  # index inside the previous level
            level = ranked[d][:, parent, ranks[start:stop]].astype(jnp.int32)  # [B, n]
            tokens.append(level)
            if d + 1 < tree.depth:  # the deepest level's children are never needed
                n = stop - start
                positions = jnp.broadcast_to((length + d + 1)[:, None], (B, n))
                logits, _, cache = model_lib.forward(
                    draft, level, positions, cache.rollback(length + start),
                    chunk_mask=jnp.asarray(ancestors[start:stop, :stop]))
                ranked.append(jax.lax.top_k(logits, width)[1])
        return Draft(jnp.concatenate(tokens, axis=1), None), cache

    def commit(self, cache: KVCache, start: Array, path: Array, num_accepted: Array) -> KVCache:
        """Move the accepted path's draft entries next to each other (the length is reset by the
        next ``propose``)."""
        return compact(cache, start, path, num_accepted)
