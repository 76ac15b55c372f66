"""Medusa: K heads on the target's last hidden state guess the next K tokens in one matmul.

Round start: the row's last token x_L was produced by the target from h_{L-1}. Head k applied to
h_{L-1} guesses x_{L+k}, so heads 1 .. γ give the chain d_1 .. d_γ. The heads do not see each
other's guesses, which is what makes them cheap (per round, γ [E, E] head matmuls and one
[γ, E] x [E, M] projection, no draft cache) and also what limits how deep they stay right.

Drafts are the heads' top-ranked tokens, point masses at every temperature (verified with the
point-mass rule, so sampling stays exact). With a tree, a node at depth d with rank r is the r-th
most likely token of head d, whatever its parent: Medusa's trees are cartesian products of the
heads' top candidates, pruned by the static topology.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array

from .. import sampling
from .base import Draft
from .heads import medusa_heads
from .rider import Features, RiderProposer


@dataclasses.dataclass(frozen=True)
class MedusaProposer(RiderProposer):
    @property
    def draft_forwards_per_round(self) -> int:
        return 1  # every head at once

    def init(self, params, prompts: Array, prompt_lengths: Array, capacity: int,
             hidden: Array) -> Features:
        return Features.from_prompt(hidden, prompt_lengths, self.width)

    def observe(self, state: Features, start: Array, hidden: Array) -> Features:
        return Features(hidden, start)

    def propose(self, params, state: Features, history: Array, length: Array, keys: Array,
                sampling_params: sampling.SamplingArrays, filters: sampling.Filters,
                active: Array | None = None) -> tuple[Draft, Features]:
        p = params["heads"]
        h = state.last(length)  # [B, E]
        # only the heads this round uses (γ may be fewer than the drafter's K)
        heads = medusa_heads(jax.tree.map(lambda w: w[:self.depth], p["weights"]), h)  # [B, d, E]
        vocab = p["vocab"]
        logits = vocab.logits(heads)  # [B, d, M]
        if self.tree is None:
            tokens = vocab.token_ids(sampling.argmax(logits))
            if not self.adaptive:
                return Draft(tokens, None), state
            # Adaptive lengths: head k's confidence is the largest probability of its softmax
            # (its draft, a point mass, is that argmax), known from h alone; no draft steps to
            # skip, the heads run in one projection.
            control = self.control(params, sampling_params, active)
            top = jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)
            for k in range(self.depth):
                control.step(top[:, k])
            valid, predicted = control.arrays()
            return Draft(tokens, None, valid, predicted), state
        tree = self.tree
        width = int(tree.children.shape[1])
        ranked = jax.lax.top_k(logits, width)[1]  # [B, d, width]
        depths, ranks = tree.depths[1:], tree.ranks[1:]
        tokens = vocab.token_ids(ranked[:, depths - 1, ranks])  # [B, N-1]
        return Draft(tokens, None), state
