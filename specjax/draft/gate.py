"""Knowing when not to draft, for proposers whose drafts cost nothing to make (n-gram, suffix).

A model-free draft costs no forward, but verifying it does: each extra position widens the
target's forward (about 0.07 of a decode step a position on a CPU, more at large batch). Where
the row's text does not repeat, and at high temperature, its drafts are mostly rejected and a
round that verifies them costs more than the token it gains: at T = 1 on the held-out prompts
n-gram ran at 0.91× and suffix at 0.83× of autoregressive speed, while a round that proposes
nothing costs what a decode step does.

So each row keeps a running estimate of how often its proposing rounds had their first draft
accepted, and proposes only while that estimate is at least a floor (``SpecConfig.
acceptance_floor``; ``ACCEPTANCE_FLOOR`` by default):

* a round that proposed moves the estimate ``WEIGHT`` of the way to 1 (first draft accepted) or
  to 0 (rejected);
* a round that did not (gated, or nothing matched) moves it ``RECOVERY`` of the way back to 1,
  so a gated row tries again after a while (at the default floor, a rejection at an estimate
  of 0.2-0.27 takes it to 0.15-0.2, gated for one to seven rounds: it proposes again two to
  eight rounds after the rejected one).

Lossless: whether a row proposes depends only on how many tokens earlier rounds accepted (from
the lengths the proposer is called with), never on the target's output at the positions it is
about to verify; a draft that is proposed is verified exactly as without the gate (the proof of
docs/adaptive.md for lengths chosen from past rounds). ``tests/test_gate.py`` checks the
estimate against a Python reference, greedy equality, and G-tests, where lengths that peek at
the target fail.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array

from .base import Draft

ACCEPTANCE_FLOOR = 0.2  # the default floor; 0 turns the gate off
WEIGHT = 0.25  # how far a proposing round moves the estimate
RECOVERY = 0.01  # how far a round without drafts moves it back toward 1
START = 1.0  # the estimate before a row's first proposing round


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GateState:
    """Per row: the length the last drafts were proposed at, whether any were, and the running
    rate of proposing rounds whose first draft was accepted."""

    length: Array  # [B] int32
    proposed: Array  # [B] bool
    estimate: Array  # [B] float32

    @classmethod
    def init(cls, batch: int) -> GateState:
        return cls(jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool),
                   jnp.full((batch,), START, jnp.float32))


def updated(state: GateState, length: Array) -> Array:
    """The estimate [B] after the round that ended at ``length`` [B]: the round before accepted
    length - state.length - 1 drafts (a row that did not advance, finished, counts as a round
    without drafts)."""
    accepted = length - state.length - 1
    drafted = state.proposed & (accepted >= 0)
    hit = (accepted >= 1).astype(jnp.float32)
    e = state.estimate
    return jnp.where(drafted, e + WEIGHT * (hit - e), e + RECOVERY * (1.0 - e))


def gated(draft: Draft, state: GateState, length: Array, floor: float
          ) -> tuple[Draft, GateState]:
    """``draft`` (with per-row ``valid``) with the rows whose estimate is below ``floor``
    proposing nothing, and the state for the next round."""
    estimate = updated(state, length)
    valid = draft.valid & (estimate >= floor)[:, None]
    return (dataclasses.replace(draft, valid=valid),
            GateState(length.astype(jnp.int32), jnp.any(valid, axis=1), estimate))


__all__ = ["ACCEPTANCE_FLOOR", "GateState", "gated", "updated"]
