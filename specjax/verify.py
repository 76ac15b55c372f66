"""Lossless verification of a chain of drafts: pure functions with a static γ.

Three kinds of output token (the vLLM vocabulary):

* **accepted**: a draft token d_k that passed its test;
* **recovered**: drawn at the first rejection, from what the target wants that the draft did not
  offer;
* **bonus**: drawn from p_{γ+1} when all γ drafts passed.

Rules (Leviathan et al. 2023; Chen et al. 2023):

* sampled drafts (q given): accept d_k with probability min(1, p_k(d_k) / q_k(d_k)); recover
  from norm(max(0, p_k - q_k));
* point-mass drafts (q is None: n-gram lookup, argmax drafters): accept with probability
  p_k(d_k); recover from p_k with d_k removed and renormalised;
* greedy rows need no rule of their own: their p is one-hot, so both rules accept exactly when the
  draft equals the target's argmax and otherwise recover that argmax.

Either way a position's output is distributed as p_k, so the emitted sequence has the target's
distribution. ``acceptance_probs`` and ``recovery_probs`` expose the rule as probabilities, which
the tests enumerate exactly; ``rejection_sample`` draws from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array

from . import sampling


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verdict:
    tokens: Array  # [B, G+1] int32: accepted drafts, then the recovered or bonus token, then -1
    num_accepted: Array  # [B] int32 in [0, G]; the row emits num_accepted + 1 tokens
    path: Array | None = None  # trees: [B, D] the accepted node at each depth (0 past the end)
    # greedy plans: [B, G+1] whether the target's choice at each position was a near tie
    # (sampling.near_ties), counted for the tokens a row emits (Stats.greedy_near_ties)
    near_ties: Array | None = None
    # SamplingParams.logprobs: for each token of ``tokens``, the target's log-probability of it
    # [B, G+1] and its top-k ids and log-probabilities [B, G+1, K] (engine._logprobs)
    logprobs: tuple[Array, Array, Array] | None = None
    # [B, G+1] bool: the target's logits that decided each token were finite (the engine stops
    # a row at its first non-finite one: a NaN or inf must never become a token)
    finite: Array | None = None


def _in_vocabulary(draft_tokens: Array, V: int, valid: Array | None) -> Array:
    """``valid`` [B, G] (None: all) and-ed with whether each id is a token, in [0, V): an id
    outside (a proposer's -1 for "no draft") counts as not proposed. Indexing p or q by it
    would wrap (-1 reads token V - 1) or read NaN, and accept or reject it by numbers that are
    not its own; as not proposed, the row draws from p there, as autoregressive decoding does."""
    ok = (draft_tokens >= 0) & (draft_tokens < V)
    return ok if valid is None else valid & ok


def _draft_token_probs(probs: Array, tokens: Array) -> Array:
    """probs [B, G, V], tokens [B, G] -> probs[b, k, tokens[b, k]]: [B, G]."""
    return jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]


def acceptance_probs(draft_tokens: Array, draft_probs: Array | None, target_probs: Array,
                     valid: Array | None = None) -> Array:
    """Probability of accepting each draft, given that all before it were accepted: [B, G].

    draft_tokens [B, G]; draft_probs [B, G, V] or None (point-mass drafts); target_probs
    [B, G+1, V]; valid [B, G] (a prefix per row) or None: drafts not proposed are never accepted.
    """
    G = draft_tokens.shape[1]
    p = _draft_token_probs(target_probs[:, :G], draft_tokens)
    if draft_probs is None:
        accept = p
    else:
        q = _draft_token_probs(draft_probs, draft_tokens)
        # q(d) > 0 for any token the draft sampled; the guard only keeps the division finite.
        accept = jnp.minimum(1.0, p / jnp.maximum(q, jnp.finfo(jnp.float32).tiny))
    return accept if valid is None else jnp.where(valid, accept, 0.0)


def recovery_probs(draft_tokens: Array, draft_probs: Array | None, target_probs: Array,
                   valid: Array | None = None) -> Array:
    """The distribution the row's last token is drawn from, for each stopping point: [B, G+1, V].

    Index k < G: the recovered-token distribution after rejecting draft k. Index G: p_{G+1}, for the
    bonus token. Where the residual has no mass (p_k == q_k, so rejection has probability 0) the
    row falls back to p_k, which is never used but keeps the array a distribution. Where draft k
    was not proposed (valid False) nothing was rejected: the row draws from p_k itself, exactly as
    autoregressive decoding would.
    """
    G = draft_tokens.shape[1]
    p = target_probs[:, :G]
    if draft_probs is None:
        residual = jnp.where(jax.nn.one_hot(draft_tokens, p.shape[-1], dtype=bool), 0.0, p)
    else:
        residual = jnp.maximum(p - draft_probs, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p)
    if valid is not None:
        residual = jnp.where(valid[..., None], residual, p)
    return jnp.concatenate([residual, target_probs[:, G:]], axis=1)


def _recovery_at(k: Array, draft_tokens: Array, draft_probs: Array | None,
                 target_probs: Array, valid: Array | None) -> Array:
    """Row b of ``recovery_probs`` at index k[b] alone: [B, V]. Only the stopping point drawn
    from is computed (the residuals at the other G positions, their normalisation and the join
    cost about 1% of a sampled batch-1 round on a CPU), by ``recovery_probs`` itself on that one
    position: its
    draft, q and p, and the bonus index G as a draft not proposed (drawn from p itself, as
    ``recovery_probs`` draws index G)."""
    B, G = draft_tokens.shape
    if G == 0:  # nothing drafted: the bonus distribution
        return target_probs[:, 0]
    rows = jnp.arange(B)
    at = jnp.minimum(k, G - 1)
    proposed = k < G
    if valid is not None:
        proposed &= valid[rows, at]
    p = target_probs[rows, k][:, None]  # [B, 1, V]
    q = None if draft_probs is None else draft_probs[rows, at][:, None]
    return recovery_probs(draft_tokens[rows, at][:, None], q, jnp.concatenate([p, p], axis=1),
                          proposed[:, None])[:, 0]


def rejection_sample(keys: Array, draft_tokens: Array, draft_probs: Array | None,
                     target_probs: Array, valid: Array | None = None) -> Verdict:
    """One verification round for a batch of chains.

    keys [B] (one per row); draft_tokens [B, G]; draft_probs [B, G, V] or None for point-mass
    drafts; target_probs [B, G+1, V], the processed target distributions at the γ+1 positions;
    valid [B, G] or None: per-row draft lengths (a row with k valid drafts accepts at most k).
    """
    B, G = draft_tokens.shape
    valid = _in_vocabulary(draft_tokens, target_probs.shape[-1], valid)
    accept_p = acceptance_probs(draft_tokens, draft_probs, target_probs, valid)  # [B, G]
    split = jax.vmap(jax.random.split)(keys)  # [B, 2]
    u = jax.vmap(lambda k: jax.random.uniform(k, (G,)))(split[:, 0])  # [B, G] in [0, 1)
    accepted = u < accept_p
    num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1).astype(jnp.int32)  # [B]
    last = sampling.sample(split[:, 1], _recovery_at(num_accepted, draft_tokens, draft_probs,
                                                     target_probs, valid))  # recovered or bonus
    index = jnp.arange(G + 1)[None, :]
    padded = jnp.concatenate([draft_tokens, jnp.zeros((B, 1), draft_tokens.dtype)], axis=1)
    tokens = jnp.where(index < num_accepted[:, None], padded, -1)
    tokens = jnp.where(index == num_accepted[:, None], last[:, None].astype(tokens.dtype), tokens)
    return Verdict(tokens.astype(jnp.int32), num_accepted)


def greedy_verdict(draft_tokens: Array, target_tokens: Array, valid: Array | None = None
                   ) -> Verdict:
    """``rejection_sample`` for calls where every row is greedy, without distributions.

    draft_tokens [B, G]; target_tokens [B, G+1], the argmax of the target's logits at each
    position; valid as in ``rejection_sample``. With one-hot p both rules accept draft k exactly
    when it equals the target's argmax (and was proposed), and the row's last token, recovered or
    bonus, is the argmax at its position: the same verdict, from [B, G+1] integers instead of
    [B, G+1, V] probabilities and a draw.
    """
    G = draft_tokens.shape[1]
    match = draft_tokens == target_tokens[:, :G]
    if valid is not None:
        match &= valid
    num_accepted = jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)
    index = jnp.arange(G + 1)[None, :]
    tokens = jnp.where(index <= num_accepted[:, None], target_tokens, -1)
    return Verdict(tokens.astype(jnp.int32), num_accepted)


# -- trees ---------------------------------------------------------------------------------------

def _remove(p: Array, token: Array, where: Array) -> Array:
    """p [B, V] with token [B] removed and renormalised, in rows where ``where`` [B]; rows whose
    remaining mass is zero (probability-0 events) keep p."""
    cut = jnp.where(jax.nn.one_hot(token, p.shape[-1], dtype=bool), 0.0, p)
    mass = jnp.sum(cut, axis=-1, keepdims=True)
    cut = cut / jnp.where(mass > 0, mass, 1.0)
    return jnp.where(where[:, None] & (mass > 0), cut, p)


def sibling_probs(p: Array, child_tokens: Array, child_valid: Array) -> tuple[Array, Array]:
    """The tree rule at one node: children tried in rank order against the target's p [B, V].

    child_tokens, child_valid [B, C]. Child c (reached only if children 0..c-1 were rejected) is
    accepted with probability p_c(token_c), where p_c is p with the tokens of the rejected earlier
    siblings removed and renormalised. Returns (accept [B, C], residual [B, V]): the conditional
    acceptance probabilities (0 for invalid children) and p with every valid child's token removed,
    from which the row's token is drawn when all are rejected. Either way the node's output token
    is distributed as p (the proof is the chain's point-mass rule applied once per sibling).
    """
    accept = []
    for c in range(child_tokens.shape[1]):
        tok, ok = child_tokens[:, c], child_valid[:, c]
        accept.append(jnp.where(ok, jnp.take_along_axis(p, tok[:, None], axis=1)[:, 0], 0.0))
        p = _remove(p, tok, ok)
    if not accept:  # a leaf
        return jnp.zeros(child_tokens.shape, p.dtype), p
    return jnp.stack(accept, axis=1), p


def sampled_sibling_probs(p: Array, q: Array, child_tokens: Array, child_valid: Array
                          ) -> tuple[Array, Array]:
    """Recursive rejection sampling at one node (Jeon et al., 2024): children drawn from the
    draft's q [B, V] without replacement, in order, tried in that order against the target's p
    [B, V].

    Child c was drawn from q_c, q with children 0..c-1 removed and renormalised. Reached only if
    children 0..c-1 were rejected, it is accepted with probability min(1, p_c(x_c) / q_c(x_c)),
    where p_0 = p and each rejection leaves p_{c+1} = norm(max(p_c - q_c, 0)). Returns (accept
    [B, C], residual [B, V]) as ``sibling_probs`` does. Each step is the chain's rule with
    target p_c and draft q_c, and given the earlier draws x_c is q_c-distributed, so the token
    a step passes on is p_c-distributed and the node's output is distributed as p. A child that
    is invalid (never drawn), or that q_c gives probability 0 (q had fewer tokens than the node
    has children), is skipped: accept 0, nothing updated."""
    accept = []
    for c in range(child_tokens.shape[1]):
        tok = child_tokens[:, c]
        p_x = jnp.take_along_axis(p, tok[:, None], axis=1)[:, 0]
        q_x = jnp.take_along_axis(q, tok[:, None], axis=1)[:, 0]
        ok = child_valid[:, c] & (q_x > 0)
        accept.append(jnp.where(ok, jnp.minimum(1.0, p_x / jnp.where(ok, q_x, 1.0)), 0.0))
        rest = jnp.maximum(p - q, 0.0)
        mass = jnp.sum(rest, axis=-1, keepdims=True)
        # mass 0: p <= q everywhere, so p == q and the child was accepted for sure
        p = jnp.where(ok[:, None] & (mass > 0), rest / jnp.where(mass > 0, mass, 1.0), p)
        # q_{c+1}: x_c removed; no mass left (every token q had was drawn) leaves all zeros,
        # so any later child counts as not drawn
        cut = jnp.where(jax.nn.one_hot(tok, q.shape[-1], dtype=bool), 0.0, q)
        left = jnp.sum(cut, axis=-1, keepdims=True)
        q = jnp.where(ok[:, None], cut / jnp.where(left > 0, left, 1.0), q)
    if not accept:  # a leaf
        return jnp.zeros(child_tokens.shape, p.dtype), p
    return jnp.stack(accept, axis=1), p


def _walk(tree, draft_tokens: Array, valid: Array | None, V: int | None,
          accept: Callable[[int, Array, Array, Array], Array]) -> tuple[Array, Array, Array, Array]:
    """From the root, each depth tries the current node's children and moves to the first one
    ``accept(d, node [B], kid_tokens [B, C], kid_ok [B, C]) -> hit [B, C]`` takes (``kid_ok``:
    the child exists and was proposed; a hit must imply it); a row stops at the first node none
    of whose children is taken. Returns the node each row ends at [B], whether it moved at every
    depth (reached a leaf) [B], the accepted node at each depth [B, D] (0 past the end) and the
    accepted tokens [B, D] (-1 past the end). A node whose id is not in [0, V) counts as not
    proposed (``_in_vocabulary``); V None (greedy: a child is taken only when it equals the
    target's argmax, always a token) skips that check."""
    B = draft_tokens.shape[0]
    rows = jnp.arange(B)
    children = jnp.asarray(tree.children)  # [N, C]
    tokens = jnp.concatenate([jnp.zeros((B, 1), draft_tokens.dtype), draft_tokens], axis=1)
    ok = jnp.ones((B, tree.num_nodes), bool)
    if V is not None:
        valid = _in_vocabulary(draft_tokens, V, valid)
    if valid is not None:
        ok = ok.at[:, 1:].set(valid)
    node = jnp.zeros((B,), jnp.int32)
    alive = jnp.ones((B,), bool)
    path, out = [], []
    for d in range(tree.depth):
        kids = children[node]  # [B, C]
        safe = jnp.maximum(kids, 0)
        hit = accept(d, node, tokens[rows[:, None], safe], (kids >= 0) & ok[rows[:, None], safe])
        first = jnp.argmax(hit, axis=1)
        moved = alive & jnp.any(hit, axis=1)
        node = jnp.where(moved, kids[rows, first], node)
        path.append(jnp.where(moved, node, 0))
        out.append(jnp.where(moved, tokens[rows, node], -1))
        alive = moved
    return node, alive, jnp.stack(path, axis=1), jnp.stack(out, axis=1)


def _tree_verdict(path: Array, out: Array, last: Array) -> Verdict:
    """The round's tokens: the accepted ones, then ``last`` [B] (recovered or bonus)."""
    num_accepted = jnp.sum(out >= 0, axis=1).astype(jnp.int32)
    index = jnp.arange(out.shape[1] + 1)[None, :]
    emitted = jnp.concatenate([out, jnp.full((out.shape[0], 1), -1, jnp.int32)], axis=1)
    emitted = jnp.where(index == num_accepted[:, None], last[:, None], emitted)
    return Verdict(emitted.astype(jnp.int32), num_accepted, path)


def tree_sample(keys: Array, tree, draft_tokens: Array, target_probs: Array,
                valid: Array | None = None, draft_probs: Array | None = None) -> Verdict:
    """One verification round for a batch of trees.

    tree: a specjax.tree.Tree with N nodes (static); draft_tokens [B, N-1], the tokens of nodes
    1 .. N-1; target_probs [B, N, V], the processed target distribution after each node (node 0 is
    the root, the row's last token); valid [B, N-1] or None: nodes a proposer did not fill are
    never accepted; draft_probs [B, N, V] or None: row i the distribution node i's children were
    drawn from without replacement (recursive rejection sampling, ``sampled_sibling_probs``),
    None for point masses (deterministic candidates, ``sibling_probs``). From the root, each
    depth tries the current node's children and moves to the accepted one; the round stops at
    the first node whose children are all rejected, drawing the row's last token from that
    node's residual, or at a leaf, drawing the bonus token from its p. Greedy rows (one-hot p)
    follow the longest path that matches the target's argmax. Returns tokens [B, D+1],
    num_accepted [B] and the accepted nodes path [B, D].
    """
    B, D = draft_tokens.shape[0], tree.depth
    rows = jnp.arange(B)
    split = jax.vmap(jax.random.split)(keys)
    u = jax.vmap(lambda k: jax.random.uniform(k, (D, tree.children.shape[1])))(split[:, 0])
    residuals = []  # each depth's residual after rejecting every child of the node there

    def accept(d, node, kid_tokens, kid_ok):
        if draft_probs is None:
            a, residual = sibling_probs(target_probs[rows, node], kid_tokens, kid_ok)
        else:
            a, residual = sampled_sibling_probs(target_probs[rows, node],
                                                draft_probs[rows, node], kid_tokens, kid_ok)
        residuals.append(residual)
        return u[:, d] < a  # [B, C]; a is 0 for invalid children

    node, leaf, path, out = _walk(tree, draft_tokens, valid, target_probs.shape[-1], accept)
    # a row that stops at depth k (k accepted) draws from depth k's residual; a leaf's bonus
    # token from the leaf's p
    stopped = jnp.minimum(jnp.sum(out >= 0, axis=1), D - 1)
    final_p = jnp.where(leaf[:, None], target_probs[rows, node],
                        jnp.stack(residuals, axis=1)[rows, stopped])
    return _tree_verdict(path, out, sampling.sample(split[:, 1], final_p))


def greedy_tree_verdict(tree, draft_tokens: Array, target_tokens: Array,
                        valid: Array | None = None) -> Verdict:
    """``tree_sample`` for calls where every row is greedy, without distributions:
    target_tokens [B, N], the argmax of the target's logits after each node. With one-hot p a
    point-mass child is accepted exactly when its token is the argmax at its parent (the first
    such child; the residual after rejecting the others is the same one-hot), and the row's last
    token is the argmax where it stops: the same verdict, from [B, N] integers instead of
    [B, N, V] probabilities, residuals and a draw."""
    rows = jnp.arange(draft_tokens.shape[0])

    def accept(d, node, kid_tokens, kid_ok):
        return kid_ok & (kid_tokens == target_tokens[rows, node][:, None])

    node, _, path, out = _walk(tree, draft_tokens, valid, None, accept)
    return _tree_verdict(path, out, target_tokens[rows, node])
