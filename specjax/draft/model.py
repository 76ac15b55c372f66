"""Drafts from an independent small model with its own KV cache.

Each round the draft runs γ forwards: one two-token forward, then γ - 1 single-token forwards. The first forward re-feeds the token before the last one, at slot length - 1:

* if the previous round rejected a draft, that slot already holds exactly this token (recomputed,
  identical), and rewriting it also rolls back everything after it;
* if the previous round accepted all γ drafts, the draft model never saw its own last draft d_γ
  (it only proposed it), and this write is how it catches up, without a data-dependent shape.

So the draft cache never needs to be told what was accepted: rollback is setting its length to
length - 1 before the write.

A draft model may propose from a subset of the vocabulary (``restrict_vocab``, the idea of
FR-Spec): its LM head is cut to the M columns of that subset. A small draft spends most of each
step in the vocabulary projection (the bundled draft's LM head is 73% of the weights a step
multiplies by), so each step gets much cheaper. It stays lossless: q is zero outside the subset
(renormalised over it), and the verifier corrects any q.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from .. import drafter as drafter_lib
from .. import model as model_lib
from .. import sampling
from ..cache import KVCache, compact
from ..config import ModelConfig
from ..model import Model
from ..tree import Tree
from . import Draft

DRAFT_VOCAB = "draft_vocab"
"""The params entry ``restrict_vocab`` adds: {"vocab": [M] token ids, "head": [E, M]}."""


def restrict_vocab(draft: Model, vocab) -> Model:
    """``draft`` proposing only from the token ids ``vocab`` (for example the M most frequent
    tokens of its training data: ``sj.drafter.frequent_tokens``).

    Returns the model with its LM head's columns for ``vocab`` added to its params under
    ``DRAFT_VOCAB``; as a draft (``sj.generate(..., draft=)``) it computes only those M logits.
    The full head stays in place, so the model still runs on its own, but it is not saved
    (``sj.save_model`` refuses it: save the model before restricting it)."""
    if not isinstance(draft, Model):
        raise ValueError(f"restrict_vocab expects an sj.Model, got {type(draft).__name__}")
    vocab = drafter_lib.check_vocab(vocab, draft.config.vocab_size)
    whole = unrestricted(draft)
    return Model(draft.config, {**whole.params,
                                DRAFT_VOCAB: drafter_lib.vocab_head(whole, vocab)})


def unrestricted(draft: Model) -> Model:
    """The draft with its whole vocabulary again (the identity for one never restricted)."""
    return Model(draft.config, {k: v for k, v in draft.params.items() if k != DRAFT_VOCAB})


VOCAB_FILE = "draft_vocab.npy"
"""A draft model folder may ship its draft vocabulary here (token ids, as ``np.save`` writes)."""


def load_draft(path, dtype: str | None = None, *, full_vocab: bool = False) -> Model:
    """``sj.load_model(path, dtype)``, restricted to the draft vocabulary the folder ships in
    ``draft_vocab.npy`` unless there is none or ``full_vocab`` is set."""
    import pathlib

    from ..checkpoint import load_model
    model = load_model(path, dtype)
    file = pathlib.Path(path) / VOCAB_FILE
    if full_vocab or not file.exists():
        return model
    try:
        vocab = np.load(file)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the draft vocabulary {file}: {e}") from e
    try:
        return restrict_vocab(model, vocab)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from e


def draft_vocab_size(draft: Model) -> int:
    """M: how many tokens the draft can propose (its vocab_size unless restricted)."""
    sub = draft.params.get(DRAFT_VOCAB)
    return draft.config.vocab_size if sub is None else int(sub["vocab"].shape[0])


def forward_draft(draft: Model, tokens: Array, positions: Array, cache: KVCache,
                  chunk_mask: Array | None = None) -> tuple[Array, KVCache]:
    """A draft forward: logits over its draft vocabulary [B, T, M] and the extended cache. With a
    restricted vocabulary the full-vocabulary logits are never used, and the compiler drops
    them."""
    logits, hidden, cache = model_lib.forward(draft, tokens, positions, cache, chunk_mask)
    sub = draft.params.get(DRAFT_VOCAB)
    if sub is not None:
        logits = drafter_lib.draft_logits(sub, hidden)
    return logits, cache


def _token_ids(draft: Model, index: Array) -> Array:
    """Indices into the draft vocabulary -> token ids (the identity when unrestricted)."""
    sub = draft.params.get(DRAFT_VOCAB)
    return index if sub is None else sub["vocab"][index]


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
        logits, cache = forward_draft(
            draft, jnp.stack([prev, last], 1), jnp.stack([length - 1, length], 1), cache)
        def draw(logits, key):
            """The next draft and the distribution it was drawn from (over the draft vocabulary);
            greedy calls propose the argmax as a point mass (q is one-hot anyway), skipping the
            softmax and the draw."""
            if filters.greedy:
                return _token_ids(draft, jnp.argmax(logits, axis=-1).astype(jnp.int32)), None
            q = sampling.process_logits(logits, sampling_params, filters)  # [B, M]
            return _token_ids(draft, sampling.sample(key, q)), q

        token, q = draw(logits[:, -1], step_keys[:, 0])

        # γ - 1 single-token forwards, unrolled (γ is static and small): a lax.scan here carries
        # the draft cache through a loop, which measured slower per round on a CPU.
        tokens, probs = [token], [q]
        for i in range(1, self.gamma):
            logits, cache = forward_draft(draft, token[:, None], (length + i)[:, None], cache)
            token, q = draw(logits[:, 0], step_keys[:, i])
            tokens.append(token)
            probs.append(q)
        tokens = jnp.stack(tokens, axis=1)  # [B, G]
        if probs[0] is None:
            return Draft(tokens, None), cache
        probs = jnp.stack(probs, axis=1)  # [B, G, M]
        if DRAFT_VOCAB in params:  # widen to [B, G, V] once per round, for the verifier
            probs = drafter_lib.scatter_vocab(params[DRAFT_VOCAB], probs, self.config.vocab_size)
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

        def top(logits):  # the draft's `width` best token ids after each node
            return _token_ids(draft, jax.lax.top_k(logits, width)[1])

        cache = cache.rollback(length - 1)
        logits, cache = forward_draft(
            draft, jnp.stack([prev, last], 1), jnp.stack([length - 1, length], 1), cache)
        ranked = [top(logits[:, -1:])]  # per level: [B, nodes, width]
        tokens = []  # per level: [B, nodes]
        for d, (start, stop) in enumerate(tree.levels):
            first_parent = 0 if d == 0 else tree.levels[d - 1][0]
            parent = parents[start:stop] - first_parent  # index inside the previous level
            level = ranked[d][:, parent, ranks[start:stop]].astype(jnp.int32)  # [B, n]
            tokens.append(level)
            if d + 1 < tree.depth:  # the deepest level's children are never needed
                n = stop - start
                positions = jnp.broadcast_to((length + d + 1)[:, None], (B, n))
                logits, cache = forward_draft(
                    draft, level, positions, cache.rollback(length + start),
                    chunk_mask=jnp.asarray(ancestors[start:stop, :stop]))
                ranked.append(top(logits))
        return Draft(jnp.concatenate(tokens, axis=1), None), cache

    def commit(self, cache: KVCache, start: Array, path: Array, num_accepted: Array) -> KVCache:
        """Move the accepted path's draft entries next to each other (the length is reset by the
        next ``propose``)."""
        return compact(cache, start, path, num_accepted)
