"""What Medusa and EAGLE share: the target's hidden states carried between rounds, and the
static shape of their drafts (a chain of γ or a tree)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import Array

from ..drafter import DrafterConfig
from ..tree import Tree


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Features:
    """The target's hidden states from the last verification, for proposers that ride on it.

    feats[b, j] is the final-norm hidden state at position start[b] + j, along the accepted path
    (entries past what was accepted are stale and never read). A round starting at length[b]
    needs the one at position length[b] - 1: the state that produced the row's last token."""

    feats: Array  # [B, W, E]
    start: Array  # [B] int32

    @classmethod
    def from_prompt(cls, hidden: Array, prompt_lengths: Array, width: int) -> "Features":
        """After prefill: the last prompt position's state, at index 0."""
        B = hidden.shape[0]
        last = hidden[jnp.arange(B), prompt_lengths - 1]  # [B, E]
        feats = jnp.zeros((B, width, hidden.shape[-1]), hidden.dtype).at[:, 0].set(last)
        return cls(feats, prompt_lengths - 1)

    def last(self, length: Array) -> Array:
        """[B, E]: the hidden state at position length - 1."""
        index = jnp.clip(length - 1 - self.start, 0, self.feats.shape[1] - 1)
        return self.feats[jnp.arange(self.feats.shape[0]), index]



@dataclasses.dataclass(frozen=True)
class RiderProposer:
    """Base of the proposers that ride on the target (see specjax.draft)."""

    config: DrafterConfig
    chain: int  # γ for a chain (ignored with a tree)
    tree: Tree | None = None

    rides_on_target: ClassVar[bool] = True

    @property
    def gamma(self) -> int:
        return self.chain if self.tree is None else self.tree.num_nodes - 1

    @property
    def depth(self) -> int:
        return self.chain if self.tree is None else self.tree.depth

    @property
    def width(self) -> int:
        """Hidden states kept per round: the deepest accepted path plus its root."""
        return self.depth + 1
