"""Proposers: one file each, one protocol.

A proposer is a frozen (hashable) dataclass: it is part of the compiled program's static
configuration, chosen when the program is built, never by string dispatch inside traced code. Its
parameters (if any) are passed in as arguments, and its state (a draft cache, say) is a pytree
threaded through the decode loop. It never sees the verifier.

Protocol::

    gamma: int                                   # drafts per round (static)
    init(params, prompts [B, P], prompt_lengths [B], capacity) -> state
    propose(params, state, history [B, S], length [B], keys [B], sampling, filters)
        -> (Draft, state)

Tree proposers also carry ``tree`` (a specjax.tree.Tree; ``gamma`` is its number of non-root
nodes, and ``Draft.tokens`` holds nodes 1 .. N-1 in the tree's order) and
``commit(state, start [B], path [B, D], num_accepted [B]) -> state``, called after verification
with the accepted nodes, so the proposer can compact its own cache as the engine compacts the
target's.

Proposers that ride on the target (``rides_on_target = True``: Medusa, EAGLE) draft from the
target's own hidden states instead of a model of their own. For them the engine passes
``params = {"drafter": ..., "target": target params}``, gives ``init`` the prompt's hidden states
(``init(params, prompts, prompt_lengths, capacity, hidden [B, P, E])``), and after every
verification calls ``observe(state, start [B], hidden [B, W, E])`` with the target's hidden states
along the round's accepted path (position start + j at index j; W = depth + 1). Both keep them in a
``Features`` state.

A proposer may offer fewer than γ drafts in a row (none included) through ``Draft.valid``; the
verifier treats the missing ones as never proposed (the row's next token is then drawn from the
target's own distribution at that position), so shapes stay static and nothing recompiles.

``history[b, :length[b] + 1]`` is the row's whole sequence so far (prompt and generated tokens);
``history[b, length[b]]`` is the last token, which the target has not yet seen. The engine never
tells a proposer what was accepted: the next ``propose`` sees it through ``length`` and ``history``
and rolls its own state back accordingly.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Draft:
    tokens: Array  # [B, G] int32
    probs: Array | None  # [B, G, V] float32 distributions the tokens were drawn from; None = point mass
    valid: Array | None = None  # [B, G] bool, a prefix per row: drafts actually proposed; None = all


from .model import DraftModelProposer, DraftTreeProposer, load_draft, restrict_vocab  # noqa: E402
from .ngram import NgramProposer  # noqa: E402
from .rider import Features  # noqa: E402
from .medusa import MedusaProposer  # noqa: E402
from .eagle import EagleProposer  # noqa: E402

__all__ = ["Draft", "Features", "DraftModelProposer", "DraftTreeProposer", "NgramProposer",
           "MedusaProposer", "EagleProposer", "load_draft", "restrict_vocab"]
