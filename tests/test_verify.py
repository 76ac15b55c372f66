"""Verification rules, checked exactly by enumerating every draft outcome on a tiny vocabulary.

One round followed by plain target sampling up to γ + 1 tokens must give exactly the target's
joint distribution over those γ + 1 tokens. The enumeration uses the implementation's own
``acceptance_probs`` and ``recovery_probs``; ``rejection_sample`` is then checked to draw from
exactly those probabilities.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ref_process
from scipy import stats as scipy_stats

from specjax import verify

V = 4
PARAMS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.8, 3, 1.0), (1.0, 0, 0.7), (0.6, 3, 0.8), (0.0, 0, 1.0)]


class Tables:
    """Random conditional distributions p(. | prefix), q(. | prefix) for prefixes up to γ."""

    def __init__(self, gamma, sampling, seed=0):
        rng = np.random.default_rng(seed)
        self.gamma = gamma
        self.p = {}
        self.q = {}
        for n in range(gamma + 1):
            for prefix in itertools.product(range(V), repeat=n):
                self.p[prefix] = ref_process(rng.normal(size=V) * 2, *sampling).astype(np.float32)
                self.q[prefix] = ref_process(rng.normal(size=V) * 2, *sampling).astype(np.float32)

    def target_joint(self):
        G = self.gamma
        joint = np.zeros((V,) * (G + 1))
        for seq in itertools.product(range(V), repeat=G + 1):
            joint[seq] = np.prod([float(self.p[seq[:i]][seq[i]]) for i in range(G + 1)])
        return joint

    def batch(self, drafts):
        """Arrays for verify: draft_tokens [B, G], draft_probs [B, G, V], target_probs [B, G+1,
        V]."""
        G = self.gamma
        toks = np.array(drafts, np.int32).reshape(len(drafts), G)
        q = np.stack([[self.q[tuple(d[:k])] for k in range(G)] for d in toks])
        p = np.stack([[self.p[tuple(d[:k])] for k in range(G + 1)] for d in toks])
        return jnp.asarray(toks), jnp.asarray(q), jnp.asarray(p)


def round_then_target(tables, drafts, weights, accept, recover):
    """Distribution over γ + 1 tokens: one verification round with drafts (each with its weight),
    then tokens drawn from the target until γ + 1 tokens exist."""
    G = tables.gamma
    out = np.zeros((V,) * (G + 1))
    accept, recover = np.asarray(accept, np.float64), np.asarray(recover, np.float64)
    for b, d in enumerate(drafts):
        survive = 1.0
        for n in range(G + 1):  # n drafts accepted
            stop = survive * ((1 - accept[b, n]) if n < G else 1.0)
            if n < G:
                survive *= accept[b, n]
            if stop == 0:
                continue
            for t in range(V):
                mass = weights[b] * stop * recover[b, n, t]
                if mass == 0:
                    continue
                head = tuple(d[:n]) + (t,)
                for tail in itertools.product(range(V), repeat=G - n):
                    seq = head + tail
                    tail_p = np.prod([float(tables.p[seq[:i]][seq[i]])
                                      for i in range(len(head), G + 1)])
                    out[seq] += mass * tail_p
    return out


def sampled_round(tables, accept_fn=verify.acceptance_probs, recover_fn=verify.recovery_probs):
    drafts = list(itertools.product(range(V), repeat=tables.gamma))
    toks, q, p = tables.batch(drafts)
    weights = [np.prod([float(tables.q[d[:k]][d[k]]) for k in range(tables.gamma)]) for d in drafts]
    return round_then_target(tables, drafts, weights, accept_fn(toks, q, p), recover_fn(toks, q, p))


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("sampling", PARAMS)
def test_sampled_drafts_are_exact(gamma, sampling):
    tables = Tables(gamma, sampling, seed=gamma)
    got = sampled_round(tables)
    np.testing.assert_allclose(got, tables.target_joint(), atol=1e-6)


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("sampling", PARAMS)
def test_point_mass_drafts_are_exact_for_any_draft(gamma, sampling):
    tables = Tables(gamma, sampling, seed=10 + gamma)
    expected = tables.target_joint()
    # Every possible deterministic draft, each on its own, must leave the output distribution exact.
    for d in itertools.product(range(V), repeat=gamma):
        toks, _, p = tables.batch([d])
        got = round_then_target(tables, [d], [1.0], verify.acceptance_probs(toks, None, p),
                                verify.recovery_probs(toks, None, p))
        np.testing.assert_allclose(got, expected, atol=1e-6, err_msg=f"draft {d}")


def _resample_from_p(toks, q, p):  # the classic bug: on rejection draw from p, not the residual
    return jnp.asarray(p)


def _inverted_ratio(toks, q, p):  # min(1, q/p) instead of min(1, p/q)
    return verify.acceptance_probs(toks, jnp.asarray(p)[:, :-1], jnp.concatenate(
        [q, p[:, -1:]], axis=1))


def _soft_q_for_point_mass(toks, q, p):  # treating an argmax draft as if q were soft
    return verify.acceptance_probs(toks, q, p)


@pytest.mark.parametrize("broken", ["resample_from_p", "inverted_ratio"])
def test_enumeration_catches_broken_rules(broken):
    tables = Tables(2, (1.0, 0, 1.0), seed=2)
    if broken == "resample_from_p":
        got = sampled_round(tables, recover_fn=_resample_from_p)
    else:
        got = sampled_round(tables, accept_fn=_inverted_ratio)
    assert np.abs(got - tables.target_joint()).max() > 1e-2


def test_enumeration_catches_soft_q_rule_for_point_mass_drafts():
    tables = Tables(2, (1.0, 0, 1.0), seed=3)
    d = (0, 1)
    toks, q, p = tables.batch([d])
    got = round_then_target(tables, [d], [1.0], _soft_q_for_point_mass(toks, q, p),
                            verify.recovery_probs(toks, None, p))
    assert np.abs(got - tables.target_joint()).max() > 1e-2


def _first_draft_acceptance(tables, accept_fn):
    """The chance that a draft drawn from q at the first position is accepted, exactly."""
    drafts = [(d,) + (0,) * (tables.gamma - 1) for d in range(V)]
    toks, q, p = tables.batch(drafts)
    accept = np.asarray(accept_fn(toks, q, p), np.float64)[:, 0]
    return float(np.dot(np.asarray(tables.q[()], np.float64), accept))


def _equality_rule(toks, q, p):  # sample the target's token, accept a sampled draft if equal
    return verify.acceptance_probs(toks, None, p)


@pytest.mark.parametrize("sampling", [s for s in PARAMS if s[0] > 0])
def test_sampled_drafts_are_accepted_as_often_as_any_lossless_rule_can(sampling):
    """A sampled draft is accepted with probability sum_x min(p(x), q(x)), the most any lossless
    rule reaches; equality with a token drawn from the target (also lossless) reaches only
    sum_x p(x) q(x). The distribution tests cannot tell the two apart: this one can."""
    tables = Tables(1, sampling, seed=21)
    # a draft that overlaps the target (filters can leave two random ones disjoint)
    tables.q[()] = (0.5 * (tables.p[()] + tables.q[()])).astype(np.float32)
    p, q = (np.asarray(t[()], np.float64) for t in (tables.p, tables.q))
    best = np.minimum(p, q).sum()
    assert _first_draft_acceptance(tables, verify.acceptance_probs) == pytest.approx(best,
                                                                                   abs=1e-6)
    # the equality rule, deliberately: the same test fails it
    assert _first_draft_acceptance(tables, _equality_rule) < best - 0.02


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sample_draws_what_the_rule_says(point_mass):
    """rejection_sample's (num_accepted, last token) frequencies match the analytic ones."""
    G, N = 3, 60000
    tables = Tables(G, (1.0, 0, 1.0), seed=5)
    d = (1, 2, 0)
    toks, q, p = tables.batch([d])
    q = None if point_mass else q
    a = np.asarray(verify.acceptance_probs(toks, q, p), np.float64)[0]
    r = np.asarray(verify.recovery_probs(toks, q, p), np.float64)[0]
    expected = np.zeros((G + 1, V))
    survive = 1.0
    for n in range(G + 1):
        expected[n] = survive * ((1 - a[n]) if n < G else 1.0) * r[n]
        survive *= a[n] if n < G else 1.0
    keys = jax.random.split(jax.random.key(11), N)
    bt = lambda x: None if x is None else jnp.broadcast_to(x, (N,) + x.shape[1:])  # noqa: E731
    verdict = verify.rejection_sample(keys, bt(toks), bt(q), bt(p))
    tokens, n_acc = np.asarray(verdict.tokens), np.asarray(verdict.num_accepted)
    # Format: accepted drafts, then one recovered/bonus token, then -1.
    for row, n in zip(tokens[:200], n_acc[:200]):
        assert list(row[:n]) == list(d[:n]) and row[n] >= 0 and (row[n + 1:] == -1).all()
    last = tokens[np.arange(N), n_acc]
    counts = np.zeros((G + 1, V))
    np.add.at(counts, (n_acc, last), 1)
    keep = expected.ravel() * N >= 5
    assert counts.ravel()[~keep].sum() <= max(10, 3 * expected.ravel()[~keep].sum() * N)
    f_obs = counts.ravel()[keep]
    f_exp = expected.ravel()[keep] * N
    f_exp *= f_obs.sum() / f_exp.sum()
    assert scipy_stats.chisquare(f_obs, f_exp).pvalue > 1e-3


def test_greedy_rows_accept_exactly_the_argmax():
    p = jnp.asarray(np.eye(V, dtype=np.float32)[[2, 0, 3]])[None]  # argmax path 2, 0, then bonus 3
    for draft, expect_n, expect in [((2, 0), 2, [2, 0, 3]), ((2, 1), 1, [2, 0, -1]),
                                    ((1, 0), 0, [2, -1, -1])]:
        toks = jnp.asarray([draft], jnp.int32)
        q = jnp.asarray(np.eye(V, dtype=np.float32)[list(draft)])[None]
        for qq in (q, None):
            v = verify.rejection_sample(jax.random.split(jax.random.key(0), 1), toks, qq, p)
            assert int(v.num_accepted[0]) == expect_n
            assert list(np.asarray(v.tokens[0])) == expect


def _greedy_cases(seed=0, B=64, G=4, vocab=5):
    """Random drafts that agree with the argmax path for a random prefix, random valid prefixes."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(B, G + 1, vocab)).astype(np.float32)
    argmax = logits.argmax(-1)
    agree = rng.integers(0, G + 1, size=B)  # drafts equal the argmax before this index
    drafts = np.where(np.arange(G)[None] < agree[:, None], argmax[:, :G],
                      rng.integers(0, vocab, size=(B, G)))
    valid = np.arange(G)[None] < rng.integers(0, G + 1, size=B)[:, None]
    return (jnp.asarray(logits), jnp.asarray(argmax, jnp.int32), jnp.asarray(drafts, jnp.int32),
            jnp.asarray(valid))


@pytest.mark.parametrize("with_valid", [False, True])
def test_greedy_verdict_equals_the_rule_on_one_hots(with_valid):
    """The engine's greedy fast path gives the verdict of rejection_sample on one-hot p, for
    every row (drafts agreeing with the argmax for 0..γ positions, any valid prefix)."""
    logits, argmax, drafts, valid = _greedy_cases()
    valid = valid if with_valid else None
    one_hot = jax.nn.one_hot(argmax, logits.shape[-1], dtype=jnp.float32)
    keys = jax.random.split(jax.random.key(1), drafts.shape[0])
    want = verify.rejection_sample(keys, drafts, None, one_hot, valid)
    got = verify.greedy_verdict(drafts, argmax, valid)
    np.testing.assert_array_equal(got.num_accepted, want.num_accepted)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert 0 < int(jnp.sum(want.num_accepted)) < drafts.size  # both outcomes occur


def test_greedy_verdict_comparison_catches_ignored_validity():
    """Control: a fast path that forgets the valid mask accepts drafts that were never proposed,
    and the comparison above sees it."""
    logits, argmax, drafts, valid = _greedy_cases()
    one_hot = jax.nn.one_hot(argmax, logits.shape[-1], dtype=jnp.float32)
    keys = jax.random.split(jax.random.key(1), drafts.shape[0])
    want = verify.rejection_sample(keys, drafts, None, one_hot, valid)
    broken = verify.greedy_verdict(drafts, argmax, None)
    assert not np.array_equal(broken.num_accepted, want.num_accepted)


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("bad", [-1, V])
def test_ids_outside_the_vocabulary_count_as_not_proposed(shape, point_mass, bad):
    """A proposer's id outside [0, V) (a -1 for "no draft", or V) is never accepted or emitted:
    the row's first token is drawn from the target's p, as without drafts. Before, -1 read p and
    q at token V - 1 (take_along_axis wraps): with p = [.1, .2, .3, .4] the chain emitted -1 as
    its first token in about 40% of rows and drew token 3 too rarely."""
    from specjax.tree import Tree
    N = 40_000
    p = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    target = jnp.asarray(np.broadcast_to(p, (N, 3, V)))
    q = jnp.asarray(np.broadcast_to(np.full(V, 0.25, np.float32), (N, 3, V)))
    drafts = jnp.broadcast_to(jnp.asarray([bad, 3], jnp.int32), (N, 2))
    keys = jax.random.split(jax.random.key(3), N)
    if shape == "chain":
        v = verify.rejection_sample(keys, drafts, None if point_mass else q[:, :2], target)
    else:  # a chain-shaped tree: root -> node 1 -> node 2
        v = verify.tree_sample(keys, Tree([(0,), (0, 0)]), drafts, target,
                               draft_probs=None if point_mass else q)
        assert (np.asarray(v.path) == 0).all()
    assert (np.asarray(v.num_accepted) == 0).all()
    first = np.asarray(v.tokens[:, 0])
    assert ((first >= 0) & (first < V)).all(), np.unique(first)
    counts = np.bincount(first, minlength=V)
    assert scipy_stats.chisquare(counts, p * N).pvalue > 1e-3, counts
