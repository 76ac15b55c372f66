"""Medusa: K heads on the target's last hidden state guess the next K tokens in one matmul.

Round start: the row's last token x_L was produced by the target from h_{L-1}. Head k applied to
h_{L-1} guesses x_{L+k}, so heads 1 .. γ give the chain d_1 .. d_γ. The heads do not see each
other's guesses, which is what makes them cheap (one [K, E] x [E, M] projection per round, no
draft cache) and also what limits how deep they stay right.

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

from .. import drafter as drafter_lib
from .. import sampling
from . import Draft
from .rider import Features, RiderProposer


@dataclasses.dataclass(frozen=True)
class MedusaProposer(RiderProposer):
    def init(self, params, prompts: Array, prompt_lengths: Array, capacity: int,
             hidden: Array) -> Features:
        return Features.from_prompt(hidden, prompt_lengths, self.width)

    def observe(self, state: Features, start: Array, hidden: Array) -> Features:
        return Features(hidden, start)

    def propose(self, params, state: Features, history: Array, length: Array, keys: Array,
                sampling_params: sampling.SamplingArrays, filters: sampling.Filters
                ) -> tuple[Draft, Features]:
        p = params["drafter"]
        h = state.last(length)  # [B, E]
        heads = drafter_lib.medusa_heads(p["weights"], h)[:, :self.depth]  # [B, d, E]
        logits = drafter_lib.draft_logits(p, heads)  # [B, d, M]
        vocab = p["vocab"]
        if self.tree is None:
            return Draft(vocab[jnp.argmax(logits, axis=-1)].astype(jnp.int32), None), state
        tree = self.tree
        width = int(tree.children.shape[1])
        ranked = jax.lax.top_k(logits, width)[1]  # [B, d, width]
        depths, ranks = tree.depths[1:], tree.ranks[1:]
        tokens = vocab[ranked[:, depths - 1, ranks]]  # [B, N-1]
        return Draft(tokens.astype(jnp.int32), None), state
