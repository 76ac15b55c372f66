"""EAGLE: a one-layer head that drafts in the target's feature space (see specjax/draft/heads.py).

Its cache slot t holds the pair (f_t, x_{t+1}) at position t: the target's feature at t and the
token after it. The pair's output is the predicted feature at t + 1, whose logits guess x_{t+2}.

Each round starts with one catch-up forward over the previous round's W pairs, rewritten from slot
``start`` with the target's true features along the accepted path and the tokens now in the
history. That replaces the features the head had predicted for the tokens that were accepted, and
its output at the row's last accepted index (position length - 1, token x_L) is the feature that
ranks d_1. The cache is then rolled back to ``length``; everything written past it is garbage.
After prefill the state holds only the last prompt position (W = 1 worth of data), so the first
catch-up writes just the pair (f_{L-1}, x_L).

* chain: γ - 1 single-pair forwards, the pair (predicted feature, draft) at slot length - 1 + i.
  Drafts are sampled from the head's processed distribution q (argmax point masses when greedy),
  so the verifier uses the sampled-draft rule.
* tree: the tree's levels are expanded one forward each, as the draft-model tree does: node i's
  pair (its parent's predicted feature, its token) goes at slot length - 1 + i, at its parent's
  position length + depth - 1, under the ancestor mask; a node's children are the head's
  top-ranked tokens after it (point masses) when greedy, draws without replacement from its q when
  sampled (``base.tree_candidates``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array

from .. import sampling
from ..cache import KVCache
from ..model import PREFILL_CHUNK, over_chunks
from .base import Draft, draw, draw_scored, expand_tree, stack_chain, tree_candidates
from .heads import eagle_forward, embed
from .rider import Features, RiderProposer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EagleState:
    cache: KVCache  # the head's own one-layer cache
    features: Features


@dataclasses.dataclass(frozen=True)
class EagleProposer(RiderProposer):
    def init(self, params, prompts: Array, prompt_lengths: Array, capacity: int,
             hidden: Array) -> EagleState:
        """Write the prompt's pairs (f_t, x_{t+1}), t < length - 1, chunk by chunk; keep
        f_{length-1}."""
        B, P = prompts.shape
        chunk = min(PREFILL_CHUNK, P)
        pad = ((0, 0), (0, -P % chunk + 1))  # one more column: the token after the last
        nxt, feats = jnp.pad(prompts, pad)[:, 1:], jnp.pad(hidden, pad + ((0, 0),))[:, :-1]
        cache = KVCache.init(self.config.layer, B, capacity)

        def step(cache, start):
            piece = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=1)  # noqa: E731
            positions = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
            return eagle_forward(
                self.config, params["heads"]["weights"], piece(feats),
                embed(params["target"], piece(nxt)), positions,
                cache.rollback(jnp.full((B,), start, jnp.int32)))[1]

        cache = over_chunks(step, cache, prompt_lengths, chunk)
        return EagleState(cache.rollback(prompt_lengths - 1),
                          Features.from_prompt(hidden, prompt_lengths, self.width))

    def observe(self, state: EagleState, start: Array, hidden: Array) -> EagleState:
        return EagleState(state.cache, Features(hidden, start))

    def _catch_up(self, params, state: EagleState, history: Array, length: Array
                  ) -> tuple[Array, KVCache]:
        """Rewrite the last round's pairs with true features; the predicted feature at
        position length [B, E] and the cache rolled back to length."""
        f = state.features
        B, W, _ = f.feats.shape
        S = history.shape[1]
        rows = jnp.arange(B)[:, None]
        offsets = jnp.arange(W, dtype=jnp.int32)[None, :]
        nxt = history[rows, jnp.minimum(f.start[:, None] + 1 + offsets, S - 1)]  # [B, W]
        out, cache = eagle_forward(
            self.config, params["heads"]["weights"], f.feats,
            embed(params["target"], nxt), f.start[:, None] + offsets,
            state.cache.rollback(f.start))
        index = jnp.clip(length - 1 - f.start, 0, W - 1)
        return out[jnp.arange(B), index], cache.rollback(length)

    def propose(self, params, state: EagleState, history: Array, length: Array, keys: Array,
                sampling_params: sampling.SamplingArrays, filters: sampling.Filters,
                active: Array | None = None) -> tuple[Draft, EagleState]:
        p, cfg = params["heads"], self.config
        g, cache = self._catch_up(params, state, history, length)
        if self.tree is not None:
            return self._tree(params, state, g, cache, length, keys, sampling_params, filters)
        step_keys = jax.vmap(lambda k: jax.random.split(k, self.chain))(keys)  # [B, G]
        if self.adaptive:
            return self._adaptive(params, state, g, cache, length, step_keys, sampling_params,
                                  filters, active)
        vocab = p["vocab"]
        # Processed and sampled over the M draft-vocabulary columns: the same distribution as
        # over all V with -inf outside (those tokens get probability zero under temperature,
        # top-k and top-p alike), without a V-wide softmax per draft.
        token, q = draw(vocab.logits(g), step_keys[:, 0], sampling_params, filters, vocab)
        tokens, probs = [token], [q]
        for i in range(1, self.chain):  # unrolled, as the draft model's chain
            position = (length - 1 + i)[:, None]
            out, cache = eagle_forward(
                cfg, p["weights"], g[:, None], embed(params["target"], token)[:, None],
                position, cache)
            g = out[:, 0]
            token, q = draw(vocab.logits(g), step_keys[:, i], sampling_params, filters, vocab)
            tokens.append(token)
            probs.append(q)
        return (stack_chain(tokens, probs, vocab, cfg.vocab_size),
                EagleState(cache, state.features))

    def _adaptive(self, params, state: EagleState, g: Array, cache: KVCache, length: Array,
                  step_keys: Array, sampling_params: sampling.SamplingArrays,
                  filters: sampling.Filters, active: Array | None
                  ) -> tuple[Draft, EagleState]:
        """The chain with adaptive lengths (specjax/adaptive.py): each draft's confidence read
        from the head's distribution before the draw, and the head's steps skipped (a
        ``lax.cond``) once no row drafts on; the skipped branch leaves the cache as it was (its
        slots past every row's proposals are never read)."""
        p, cfg = params["heads"], self.config
        vocab = p["vocab"]
        control = self.control(params, sampling_params, active)
        token, q, score = draw_scored(vocab.logits(g), step_keys[:, 0], sampling_params, filters,
                                      vocab)
        control.step(score)
        tokens, probs = [token], [q]

        def step(i, g, token, q, score, cache):
            out, cache = eagle_forward(
                cfg, p["weights"], g[:, None], embed(params["target"], token)[:, None],
                (length - 1 + i)[:, None], cache)
            g = out[:, 0]
            return (g, *draw_scored(vocab.logits(g), step_keys[:, i], sampling_params, filters,
                                    vocab)), cache

        def skip(i, g, token, q, score, cache):
            return (g, token, q, jnp.zeros_like(score)), cache

        for i in range(1, self.chain):
            (g, token, q, score), cache = jax.lax.cond(control.drafting(), step, skip, i, g,
                                                       token, q, score, cache)
            control.step(score)
            tokens.append(token)
            probs.append(q)
        valid, predicted = control.arrays()
        chain = stack_chain(tokens, probs, vocab, cfg.vocab_size, valid)
        return (dataclasses.replace(chain, predicted=predicted, forwards=control.forwards),
                EagleState(cache, state.features))

    def _tree(self, params, state: EagleState, g: Array, cache: KVCache, length: Array,
              keys: Array, sampling_params: sampling.SamplingArrays,
              filters: sampling.Filters) -> tuple[Draft, EagleState]:
        p, tree = params["heads"], self.tree
        vocab = p["vocab"]
        B = g.shape[0]
        base = length - 1  # the slot of the root's pair (f_{L-1}, x_L), written by the catch-up
        feats = g[:, None]  # the predicted features of the level being expanded [B, n, E]

        def top(g, d=0):  # the candidates depth d's nodes need: top-ranked or sampled
            level_keys = jax.vmap(lambda k: jax.random.fold_in(k, d))(keys)
            return tree_candidates(vocab.logits(g), tree.ranks_under(d), level_keys,
                                   sampling_params, filters, vocab)

        def expand(d, level, parent):  # level: the nodes at depth d + 1 that have children
            nonlocal cache, feats
            start = tree.levels[d][0]
            stop = start + level.shape[1]
            positions = jnp.broadcast_to((length + d)[:, None], (B, stop - start))  # the parents'
            feats, cache = eagle_forward(
                self.config, p["weights"], feats[:, parent], embed(params["target"], level),
                positions, cache.rollback(base + start),
                chunk_mask=jnp.asarray(tree.ancestors[start:stop, :stop]))
            return top(feats, d + 1)

        tokens, q = expand_tree(tree, top(g[:, None]), expand, vocab, self.config.vocab_size)
        return Draft(tokens, q), EagleState(cache, state.features)
