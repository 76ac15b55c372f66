"""The contract between proposers and the engine, and the steps proposers share.

A proposer is a frozen (hashable) object: it is part of the compiled program's static
configuration, chosen when the program is built, never by string dispatch inside traced code. Its
parameters (if any) are passed in as arguments, and its state (a draft cache, say) is a pytree
threaded through the decode loop. It never sees the verifier.

``history[b, :length[b] + 1]`` is the row's whole sequence so far (prompt and generated tokens);
``history[b, length[b]]`` is the last token, which the target has not yet seen. The engine never
tells a proposer what was accepted: the next ``propose`` sees it through ``length`` and ``history``
and rolls its own state back accordingly.

A proposer may offer fewer than γ drafts in a row (none included) through ``Draft.valid``; the
verifier treats the missing ones as never proposed (the row's next token is then drawn from the
target's own distribution at that position), so shapes stay static and nothing recompiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from .. import sampling
from ..sampling import Filters, SamplingArrays
from .vocab import DraftVocab


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Draft:
    """One round's drafts for every row."""

    # [B, G] int32 (a tree: nodes 1 .. N-1 in the tree's order); an id outside [0, V) (say -1)
    # counts as not proposed: never accepted, and the row draws from the target there
    tokens: Array
    # [B, G, V] float32: what each token was drawn from; None = point masses. A tree's [B, N, V]:
    # node i's row is the distribution its children were drawn from without replacement (a leaf's is
    # never read).
    probs: Array | None
    valid: Array | None = None  # [B, G] bool, a prefix per row: drafts really proposed; None = all
    # [B, G] float32, adaptive chains only (specjax/adaptive.py): the calibrated chance that draft
    # k is accepted given that the drafts before it were, predicted before it was drawn (scored
    # against the verdicts in Stats.calibration_error)
    predicted: Array | None = None
    # [] int32, adaptive chains only: the draft forwards this round really ran (steps skipped
    # once no row drafts are not counted; Stats.draft_calls)
    forwards: Array | None = None
    # [B, K] int32, ``Lookahead`` proposers only: tokens the target also runs in the verify
    # forward, at positions and with a mask of the proposer's own, never verified or emitted
    lookahead: Array | None = None


@runtime_checkable
class Proposer(Protocol):
    """What every proposer provides.

    ``gamma`` drafts per round (static). ``init`` runs once after the target's prefill, on the
    right-padded prompts [B, N] (N >= S whatever the prompt lengths, so they pick no program;
    prefill anything of its own in chunks up to the longest row, ``model.prefill_chunked``) with
    their lengths [B] and the cache capacity S, and returns the proposer's state (any pytree, or
    None). ``propose`` returns a round's ``Draft`` and the new
    state; keys [B] are this round's draft keys, one per row; sampling and filters are the
    request's, so a sampled draft can use the same processing as the target (its q must be the
    distribution its token was drawn from).
    """

    gamma: int

    def init(self, params: Any, prompts: Array, prompt_lengths: Array, capacity: int) -> Any:
        ...

    def propose(self, params: Any, state: Any, history: Array, length: Array, keys: Array,
                sampling_params: SamplingArrays, filters: Filters) -> tuple[Draft, Any]:
        ...


@runtime_checkable
class TreeProposer(Protocol):
    """A proposer whose drafts are the nodes of a static tree.

    ``tree`` is a specjax.tree.Tree (``gamma`` is its number of non-root nodes). After verification
    the engine calls ``commit(state, start [B], path [B, D], num_accepted [B])``, when the
    proposer has one, with the accepted nodes, so the proposer can compact its own cache as the
    engine compacts the target's."""

    tree: Any

    def commit(self, state: Any, start: Array, path: Array, num_accepted: Array) -> Any:
        ...


@runtime_checkable
class Rider(Protocol):
    """A proposer that drafts from the target's own hidden states (Medusa, EAGLE, dflash).

    For a rider the engine passes ``params = {"heads": its params, "target": target params}``,
    gives ``init`` the prompt's final-norm hidden states as a fifth argument
    (``init(params, prompts, prompt_lengths, capacity, hidden [B, N, E])``), and after every
    verification calls ``observe(state, start [B], hidden [B, W, E])`` with the target's hidden
    states along the round's accepted path (position start + j at index j; W = depth + 1; entries
    past the accepted path are stale). A rider with ``taps`` (target layer indices) gets the
    residual stream after those layers, concatenated [.., len(taps) * E], in place of the
    final-norm hidden states, in both."""

    rides_on_target: ClassVar[bool]

    def observe(self, state: Any, start: Array, hidden: Array) -> Any:
        ...


@runtime_checkable
class Lookahead(Protocol):
    """A tree proposer that adds positions of its own to the target's verify forward (lookahead
    decoding's Jacobi window): ``Draft.lookahead`` [B, K] are their tokens, at positions
    ``length + lookahead_depths`` [K] (static); each sees the cache, the root and the lookahead
    positions its row of ``lookahead_mask`` [K, K] (static, itself included) names, and no tree
    node sees them. After verification the engine calls ``observe_lookahead(state, seen [B,
    R])`` with the target's argmax at the R positions ``lookahead_read`` names (indices into
    the K, static; all K when the proposer has no ``lookahead_read``): the LM head runs only
    there. They are written to the cache past the tree and never kept: only the tree's nodes
    are verified."""

    lookahead_depths: np.ndarray
    lookahead_mask: np.ndarray

    def observe_lookahead(self, state: Any, seen: Array) -> Any:
        ...


def lookahead_width(proposer) -> int:
    """K: the positions a ``Lookahead`` proposer adds to each verify forward (0 for others)."""
    depths = getattr(proposer, "lookahead_depths", None)
    return 0 if depths is None else len(depths)


def lookahead_read(proposer) -> tuple[int, ...]:
    """The lookahead positions whose argmax a ``Lookahead`` proposer reads (all by default)."""
    read = getattr(proposer, "lookahead_read", None)
    return tuple(range(lookahead_width(proposer))) if read is None else tuple(read)


def rides_on_target(proposer) -> bool:
    """Whether a proposer is a ``Rider``."""
    return bool(getattr(proposer, "rides_on_target", False))


def is_tree(proposer) -> bool:
    """Whether a proposer drafts a tree (has a ``tree`` that is not None)."""
    return getattr(proposer, "tree", None) is not None


def check_proposer(proposer) -> None:
    """ValueError naming what a proposer given to ``generate`` lacks."""
    name = type(proposer).__name__
    gamma = getattr(proposer, "gamma", None)
    if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or gamma < 1:
        raise ValueError(f"proposer {name} must have an int gamma >= 1 (drafts per round), "
                         f"got {gamma!r}")
    for method in ("init", "propose"):
        if not callable(getattr(proposer, method, None)):
            raise ValueError(f"proposer {name} has no {method}() method (see "
                             f"specjax.draft.Proposer)")
    try:
        hash(proposer)
    except TypeError as e:
        raise ValueError(f"proposer {name} must be hashable (a frozen dataclass, say): it is "
                         f"part of the compiled program ({e})") from None
    tree = getattr(proposer, "tree", None)
    if tree is not None and gamma != tree.num_nodes - 1:
        raise ValueError(f"proposer {name} drafts a tree of {tree.num_nodes - 1} nodes but has "
                         f"gamma={gamma}: a tree proposer's gamma is its number of nodes")
    if rides_on_target(proposer) and not callable(getattr(proposer, "observe", None)):
        raise ValueError(f"proposer {name} rides on the target but has no observe() method")
    K = lookahead_width(proposer)
    if K:
        mask = np.asarray(getattr(proposer, "lookahead_mask", None))
        if tree is None or not callable(getattr(proposer, "observe_lookahead", None)) \
                or mask.shape != (K, K) or not mask.diagonal().all():
            raise ValueError(f"proposer {name} has lookahead_depths but is not a Lookahead "
                             f"tree proposer (a tree, a [K, K] lookahead_mask whose diagonal is "
                             f"True, and observe_lookahead())")


def draw(logits: Array, key: Array, sampling_params: SamplingArrays, filters: Filters,
         vocab: DraftVocab | None = None) -> tuple[Array, Array | None]:
    """One chain draft per row from logits [B, M] (over the draft vocabulary when ``vocab``).

    Returns (token ids [B] int32, q [B, M] or None). q is the processed distribution the token
    was drawn from, with the request's own temperature, top-k and top-p. Greedy calls propose the
    argmax as a point mass (q would be one-hot anyway), skipping the softmax and the draw."""
    return draw_scored(logits, key, sampling_params, filters, vocab, scored=False)[:2]


def draw_scored(logits: Array, key: Array, sampling_params: SamplingArrays, filters: Filters,
                vocab: DraftVocab | None = None, *, scored: bool = True
                ) -> tuple[Array, Array | None, Array | None]:
    """``draw``, plus each row's confidence in its draft [B] (``adaptive.confidence``; None
    when not ``scored``)."""
    if filters.greedy:
        index = sampling.argmax(logits)
        q = None
    else:
        q = sampling.process_logits(logits, sampling_params, filters)  # [B, M]
        index = sampling.sample(key, q)
    score = None
    if scored:  # from the distribution alone: what was known before the draw
        from ..adaptive import confidence
        score = confidence(logits, q, sampling_params.temperature)
    return (index if vocab is None else vocab.token_ids(index)), q, score


def stack_chain(tokens: list[Array], probs: list[Array | None], vocab: DraftVocab | None,
                vocab_size: int, valid: Array | None = None) -> Draft:
    """A chain's per-step tokens [B] and q's [B, M] as one Draft; q's are widened to [B, G, V]
    once per round (the verifier reads the whole vocabulary)."""
    tokens = jnp.stack(tokens, axis=1)  # [B, G]
    if probs[0] is None:
        return Draft(tokens, None, valid)
    q = jnp.stack(probs, axis=1)  # [B, G, M]
    return Draft(tokens, q if vocab is None else vocab.widen(q, vocab_size), valid)


def tree_candidates(logits: Array, width: int, key: Array, sampling_params: SamplingArrays,
                    filters: Filters, vocab: DraftVocab | None = None
                    ) -> tuple[Array, Array | None]:
    """The children of each of n tree nodes from the drafter's logits [B, n, M] after them:
    token ids [B, n, width] and what they were drawn from, q [B, n, M] or None.

    Greedy calls: the ``width`` top-ranked tokens, point masses (distinct, so a rejected child is
    never tried again); one is an argmax (XLA's CPU backend can lower ``top_k`` to a sort of the
    whole vocabulary: 2 ms a round at 8,192 tokens where only the top-ranked was read). Sampled
    calls: ``width`` draws without replacement from the processed q, verified with recursive
    rejection sampling (``verify.sampled_sibling_probs``). A sampled child passes with
    min(1, p'/q'), where a top-ranked point mass passes only with p'(token): against a drafter
    close to the target, far more often."""
    if filters.greedy:
        ids = (sampling.argmax(logits)[..., None] if width == 1
               else jax.lax.top_k(logits, width)[1])
        q = None
    else:
        q = sampling.process_logits(logits, sampling_params, filters)
        ids = sampling.sample_without_replacement(key, q, width)
    return (ids if vocab is None else vocab.token_ids(ids)), q


def expand_tree(tree, first: tuple[Array, Array | None],
                expand: Callable[[int, Array, np.ndarray], tuple[Array, Array | None]],
                vocab: DraftVocab | None = None, vocab_size: int | None = None
                ) -> tuple[Array, Array | None]:
    """Fill a static tree level by level from each node's candidates (``tree_candidates``).

    first: the candidates after the root, ids [B, 1, C] (best first when ranked) and q [B, 1, M]
    or None. For each depth d a node takes its parent's candidate at the node's rank;
    ``expand(d, level [B, n], parent [n])`` then returns the candidates after each of those n
    nodes: the level's first ``tree.expanded(d)`` nodes, up to its last one with children (the
    leaves after it need no draft forward; ``parent`` indexes the previous level; never called
    for the deepest level). Returns the
    nodes' tokens [B, N-1] in the tree's order and, with q's, the tree's [B, N, V] draft
    distributions (``Draft.probs``; q's over a draft vocabulary widened to the ``vocab_size``
    ids), else None."""
    if not isinstance(first, tuple):
        raise ValueError("expand_tree's first is (ids [B, 1, C], q [B, 1, M] or None), as "
                         "tree_candidates returns it; expand returns the same pair")
    ranked, q = first
    tokens, qs = [], [q]
    for d, (start, stop) in enumerate(tree.levels):
        first_parent = 0 if d == 0 else tree.levels[d - 1][0]
        parent = tree.parents[start:stop] - first_parent  # index inside the previous level
        level = ranked[:, parent, tree.ranks[start:stop]].astype(jnp.int32)  # [B, n]
        tokens.append(level)
        if d + 1 < tree.depth:  # the deepest level's children are never needed
            n = tree.expanded(d)  # nor those of the leaves that end a level
            ranked, q = expand(d, level[:, :n], parent[:n])
            if q is not None and n < stop - start:  # the leaves' rows: never read
                q = jnp.pad(q, ((0, 0), (0, stop - start - n), (0, 0)))
            qs.append(q)
    tokens = jnp.concatenate(tokens, axis=1)
    if qs[0] is None:
        return tokens, None
    B, M = qs[0].shape[0], qs[0].shape[-1]
    leaves = tree.num_nodes - sum(x.shape[1] for x in qs)
    q = jnp.concatenate(qs + [jnp.zeros((B, leaves, M), qs[0].dtype)], axis=1)  # [B, N, M]
    return tokens, (q if vocab is None else vocab.widen(q, vocab_size))


MAX_CANDIDATES = 16
"""The occurrences a suffix or lookahead round ranks continuations from (the newest or longest
matches first): a tree node can have at most this many children there."""


def check_fanout(shape, candidates: int, owner: str) -> None:
    """A tree ``shape`` whose nodes have at most ``candidates`` children (ValueError naming
    ``owner`` otherwise): more could never be filled, and ranking them fails in JAX."""
    fanout = int(shape.children.shape[1])
    if fanout > candidates:
        raise ValueError(f"{owner}: the tree gives a node {fanout} children, more than the "
                         f"{candidates} candidates it ranks continuations from")


def rank_by_count(tokens: Array, support: Array, ranks: int) -> tuple[Array, Array]:
    """The ``ranks`` most frequent tokens among the supported candidates' tokens [B, M] (ties:
    the earlier candidate) -> (token ids [B, ranks], counts [B, ranks]; 0 and 0 past the
    distinct tokens found). Negative tokens never count."""
    M = tokens.shape[1]
    ok = support & (tokens >= 0)
    same = (tokens[:, :, None] == tokens[:, None, :]) & ok[:, None, :]  # [B, m, m']
    freq = jnp.sum(same, axis=2)  # candidates sharing m's token
    first = ~jnp.any(same & (jnp.arange(M)[None, None, :] < jnp.arange(M)[None, :, None]), axis=2)
    key = jnp.where(ok & first, freq * M + (M - 1 - jnp.arange(M))[None, :], -1)
    if ranks == 1:  # a max and the index reaching it: XLA's CPU top_k sorts
        top = jnp.max(key, axis=1, keepdims=True)
        index = jnp.argmax(key == top, axis=1)[:, None]
    else:
        top, index = jax.lax.top_k(key, ranks)
    found = top >= 0
    ids = jnp.where(found, jnp.take_along_axis(tokens, index, axis=1), 0)
    return ids, jnp.where(found, top // M, 0)


def fill_by_count(tree, continuations: Array, support: Array, *, min_share: float = 0.0,
                  depth_cap: Array | None = None) -> tuple[Array, Array]:
    """Fill a static tree (specjax.tree.Tree) from candidate continuations [B, M, D] (D >= the
    tree's depth; negative = none), of which support [B, M] count, best first.

    Breadth first: a node of child rank r is the r-th most frequent token at its depth among
    the supported candidates that agree with its parent's path (ties: the earlier candidate).
    It is proposed only where its parent is, at least one candidate supports it, its share of
    its parent's candidates is at least ``min_share``, and its depth is at most ``depth_cap``
    [B] (when given). Returns the nodes' tokens [B, N-1] int32 (0 where not proposed) and
    valid [B, N-1]: the point-mass drafts of suffix decoding and lookahead decoding."""
    if all(path == (0,) * len(path) for path in tree.paths):
        return _fill_chain(tree.depth, continuations, support, min_share, depth_cap)
    return _fill_tree(tree, continuations, support, min_share, depth_cap)


def _fill_tree(tree, continuations: Array, support: Array, min_share: float,
               depth_cap: Array | None) -> tuple[Array, Array]:
    """fill_by_count for any tree: node by node, breadth first."""
    B = continuations.shape[0]
    parents = [int(x) for x in tree.parents]
    widths = np.zeros(tree.num_nodes, np.int64)
    for i, path in enumerate(tree.paths, start=1):
        widths[parents[i]] = max(widths[parents[i]], path[-1] + 1)
    agree, count, valid_at, ranked = {0: support}, {0: jnp.sum(support, axis=1)}, \
        {0: jnp.ones((B,), bool)}, {}
    tokens, valid = [], []
    for i, path in enumerate(tree.paths, start=1):
        d, rank, parent = len(path), path[-1], parents[i]
        if parent not in ranked:
            ranked[parent] = rank_by_count(continuations[:, :, d - 1], agree[parent],
                                           int(widths[parent]))
        ids, counts = ranked[parent]
        token, n = ids[:, rank], counts[:, rank]
        v = valid_at[parent] & (n > 0) & (n / jnp.maximum(count[parent], 1) >= min_share)
        if depth_cap is not None:
            v &= d <= depth_cap
        agree[i] = agree[parent] & (continuations[:, :, d - 1] == token[:, None])
        count[i], valid_at[i] = n, v
        tokens.append(jnp.where(v, token, 0))
        valid.append(v)
    return jnp.stack(tokens, 1).astype(jnp.int32), jnp.stack(valid, 1)


def _fill_chain(depth: int, continuations: Array, support: Array, min_share: float,
                depth_cap: Array | None) -> tuple[Array, Array]:
    """fill_by_count for a chain, without a chain of reductions (each a pair of operations on a
    CPU, and a round's proposer would be dozens of them).

    Candidate m's class at depth d is the supported candidates whose continuation agrees with
    m's through depth d, and key[m, d] ranks it: its size, then its earliest member (-1 where
    m itself is unsupported or has no token at d). Filling node by node picks, inside the class
    of node d - 1, the class with the best key at d; so the chain is the continuation of the
    candidate whose keys are lexicographically largest (compared over [B, M, M, D] at once),
    and node d's count is that candidate's class size at d."""
    B, M, _ = continuations.shape
    cont = continuations[:, :, :depth]
    ok = support[:, :, None] & (cont >= 0)  # [B, M, D]
    same = cont[:, :, None, :] == cont[:, None, :, :]  # [B, m, m', D]
    agree = [same[..., 0]]
    for d in range(1, depth):  # agreeing through depth d (a cumulative AND, unrolled)
        agree.append(agree[-1] & same[..., d])
    members = jnp.stack(agree, axis=3) & ok[:, None, :, :]  # m' in m's class at depth d
    size = jnp.sum(members, axis=2)  # [B, M, D]
    earliest = jnp.min(jnp.where(members, jnp.arange(M)[None, None, :, None], M), axis=2)
    key = jnp.where(ok, size * M + (M - 1 - earliest), -1)  # [B, M, D]
    a, b = key[:, :, None, :], key[:, None, :, :]
    at_least = jnp.ones((B, M, M), bool)  # m's keys >= m''s from depth d on (lexicographic)
    for d in reversed(range(depth)):
        at_least = (a[..., d] > b[..., d]) | ((a[..., d] == b[..., d]) & at_least)
    best = jnp.min(jnp.where(jnp.all(at_least, axis=2), jnp.arange(M)[None, :], M), axis=1)
    rows = jnp.arange(B)
    tokens = cont[rows, best]  # [B, D]
    count = jnp.where(key[rows, best] >= 0, key[rows, best] // M, 0)
    parent = jnp.concatenate([jnp.sum(support, axis=1)[:, None], count[:, :-1]], axis=1)
    fine = (count > 0) & (count / jnp.maximum(parent, 1) >= min_share)
    if depth_cap is not None:
        fine &= jnp.arange(1, depth + 1)[None, :] <= depth_cap[:, None]
    first_bad = jnp.min(jnp.where(fine, depth, jnp.arange(depth)[None, :]), axis=1)
    valid = jnp.arange(depth)[None, :] < first_bad[:, None]
    return jnp.where(valid, tokens, 0).astype(jnp.int32), valid
