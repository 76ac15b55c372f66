"""What Medusa and EAGLE share: the target's hidden states carried between rounds, and the
static shape of their drafts (a chain of γ or a tree)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import Array

from ..adaptive import ChainControl
from ..tree import Tree
from .heads import HeadsConfig


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
    def from_prompt(cls, hidden: Array, prompt_lengths: Array, width: int) -> Features:
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
    """Base of the proposers that ride on the target (``specjax.draft.base.Rider``)."""

    config: HeadsConfig
    chain: int  # γ for a chain (ignored with a tree)
    tree: Tree | None = None
    # adaptive lengths (specjax/adaptive.py), chains of the methods registered adaptive=True
    survival_threshold: float | None = None
    budget: Any = None  # adaptive.Budget: the batch's verify budget

    rides_on_target: ClassVar[bool] = True
    # the threshold's and budget's numbers are passed per call (adaptive.split_tuning)
    tunable: ClassVar[bool] = True

    @property
    def adaptive(self) -> bool:
        """Lengths chosen per row and round: the engine passes ``active`` (rows generating)."""
        return self.survival_threshold is not None or self.budget is not None

    def control(self, params, sampling_params, active) -> ChainControl:
        """The chain's adaptive-length control, with the drafter's calibration (the identity
        when it ships none)."""
        return ChainControl(params["heads"].get("calibration"), self.survival_threshold,
                            self.budget, sampling_params.temperature == 0, active)

    @property
    def gamma(self) -> int:
        return self.chain if self.tree is None else self.tree.num_nodes - 1

    @property
    def depth(self) -> int:
        return self.chain if self.tree is None else self.tree.depth

    @property
    def draft_forwards_per_round(self) -> int:
        return self.depth

    @property
    def width(self) -> int:
        """Hidden states kept per round: the deepest accepted path plus its root."""
        return self.depth + 1


def check_heads(method: str, heads, target) -> HeadsConfig:
    """``heads``' config, after checking it is an sj.Heads of ``method`` built for a target of
    this one's width and vocabulary (ValueError naming what is wrong)."""
    from .heads import Heads
    if not isinstance(heads, Heads):
        raise ValueError(f"method {method!r} needs draft= an sj.Heads (sj.load_heads("
                         f"path, target)), got {type(heads).__name__}")
    c = heads.config
    if c.method != method:
        raise ValueError(f"method {method!r} but the heads are {c.method!r} heads")
    if (c.hidden_size, c.vocab_size) != (target.hidden_size, target.vocab_size):
        raise ValueError(f"the heads were built for hidden_size={c.hidden_size}, vocab_size="
                         f"{c.vocab_size}; the target has {target.hidden_size}, "
                         f"{target.vocab_size}")
    return c


_LIMITS = {"medusa": "the Medusa drafter has {n} heads, so it drafts at most {n} tokens deep",
           "mtp": "the MTP drafter has {n} modules, so it drafts at most {n} tokens deep",
           "dflash": "the block drafter was trained for blocks of up to {n} drafts"}


def spec_tree(spec, c: HeadsConfig) -> Tree | None:
    """The spec's tree (None for a chain), after checking that the drafter ``c`` can draft that
    deep (``max_depth``) and offer that many children per node (its draft vocabulary)."""
    tree = None if spec.tree is None else Tree(spec.tree)
    depth = spec.num_speculative_tokens if tree is None else tree.depth
    if c.max_depth is not None and depth > c.max_depth:
        raise ValueError(_LIMITS[c.method].format(n=c.max_depth) + "; got "
                         + (f"num_speculative_tokens={depth}" if tree is None
                            else f"a tree of depth {depth}"))
    if tree is not None and int(tree.children.shape[1]) > c.draft_vocab_size:
        raise ValueError(f"the tree has {int(tree.children.shape[1])} children per node, more "
                         f"than the drafter's {c.draft_vocab_size}-token draft vocabulary")
    return tree


def build(spec, heads, target):
    """The registry's builder for "medusa" and "eagle": the proposer for ``heads`` (an sj.Heads
    trained for this target), after checking it fits the target and the spec."""
    from .eagle import EagleProposer
    from .medusa import MedusaProposer
    c = check_heads(spec.method, heads, target)
    cls = MedusaProposer if c.method == "medusa" else EagleProposer
    return cls(c, spec.num_speculative_tokens, spec_tree(spec, c), spec.survival_threshold,
               spec.budget)
