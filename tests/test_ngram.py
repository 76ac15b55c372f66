"""N-gram prompt lookup: the on-device lookup against a plain Python reference, greedy exactness
with per-row draft lengths, and exact verification with partial drafts."""

import itertools
import math
import re

import jax.numpy as jnp
import numpy as np
import pytest
from test_verify import Tables, V, round_then_target

import specjax as sj
from specjax import verify
from specjax.draft import ngram


def reference_lookup(seq, gamma, n_min, n_max, length_factor=None):
    """seq: the row's whole sequence (last token included). Documented rule: longest suffix
    first; among its earlier occurrences, the longest continuation (<= γ), then the latest; with
    length_factor, a match of n tokens keeps at most ceil(length_factor × n) of it."""
    L = len(seq) - 1
    for n in range(n_max, n_min - 1, -1):
        if n > L:  # the suffix must have an earlier occurrence ending before the last token
            continue
        suffix = seq[L - n + 1:]
        best = None
        for j in range(0, L - n + 1):
            if seq[j:j + n] == suffix:
                cont = seq[j + n:j + n + gamma]
                key = (len(cont), j)
                if best is None or key > best[0]:
                    best = (key, cont)
        if best is not None:
            return best[1] if length_factor is None else best[1][:math.ceil(length_factor * n)]
    return []


@pytest.mark.parametrize("vocab,gamma,n_min,n_max,factor", [
    (3, 4, 2, 4, None), (2, 3, 1, 3, None), (5, 5, 2, 2, None), (4, 1, 1, 4, None),
    (2, 8, 1, 6, 1.5), (3, 7, 1, 4, 0.5), (2, 6, 2, 5, 1.0)])
def test_lookup_matches_reference(vocab, gamma, n_min, n_max, factor):
    rng = np.random.default_rng(vocab * 10 + gamma)
    S, B = 48, 64
    history = np.full((B, S), -1, np.int32)  # garbage after each row's end
    lengths = rng.integers(0, S - 1, size=B)
    seqs = []
    for b in range(B):
        seq = list(rng.integers(0, vocab, size=lengths[b] + 1))
        history[b, :len(seq)] = seq
        history[b, len(seq):] = rng.integers(0, vocab, size=S - len(seq))  # stale tokens
        seqs.append(seq)
    tokens, valid = ngram.lookup(jnp.asarray(history), jnp.asarray(lengths, jnp.int32), gamma,
                                 n_min, n_max, factor)
    tokens, valid = np.asarray(tokens), np.asarray(valid)
    found, capped = 0, 0
    for b, seq in enumerate(seqs):
        seq = [int(t) for t in seq]
        want = reference_lookup(seq, gamma, n_min, n_max, factor)
        k = int(valid[b].sum())
        assert valid[b, :k].all() and not valid[b, k:].any()  # a prefix
        assert list(tokens[b, :k]) == want, (b, seq)
        found += k > 0
        capped += len(reference_lookup(seq, gamma, n_min, n_max)) > k
    assert 0 < found < B  # both cases occur
    assert (capped > 0) == (factor is not None)  # the cap bites (short matches) only with one


def test_lookup_edge_cases():
    h = jnp.asarray([[1, 2, 3, 1, 2, 0, 0, 0], [4, 4, 4, 4, 4, 0, 0, 0], [1, 2, 9, 9, 9, 9, 9, 9]])
    tokens, valid = ngram.lookup(h, jnp.asarray([4, 4, 1]), 3, 2, 3)
    # row 0: suffix "1 2" occurs at 0, followed by "3 1 2" (truncated at the end: 3 available)
    assert list(np.asarray(tokens[0])[np.asarray(valid[0])]) == [3, 1, 2]
    # row 1: "4 4 4" occurs at 0 and 1; occurrence 0 has the longer continuation (2 vs 1)
    assert list(np.asarray(tokens[1])[np.asarray(valid[1])]) == [4, 4]
    # row 2: two tokens, nothing earlier to match
    assert not np.asarray(valid[2]).any()
    # a length factor: a 2-token match keeps ceil(0.75 × 2) = 2 of its 3 tokens, a 3-token
    # match ceil(0.75 × 3) = 3 of 3
    h = jnp.asarray([[1, 2, 3, 1, 2, 0, 0, 0], [5, 1, 2, 6, 7, 8, 5, 1, 2]][0:1])
    tokens, valid = ngram.lookup(h, jnp.asarray([4]), 3, 2, 3, 0.75)
    assert list(np.asarray(tokens[0])[np.asarray(valid[0])]) == [3, 1]
    h = jnp.asarray([[5, 1, 2, 6, 7, 8, 5, 1, 2]])
    tokens, valid = ngram.lookup(h, jnp.asarray([8]), 3, 2, 3, 0.75)
    assert list(np.asarray(tokens[0])[np.asarray(valid[0])]) == [6, 7, 8]


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5], [2], [7, 7, 7, 7, 7, 7], [5, 9, 2, 6, 5, 3]]


@pytest.mark.parametrize("gamma,lo,hi,factor", [(2, 1, 2, None), (4, 2, 4, None),
                                               (6, 1, 3, None), (8, 1, 4, 1.5)])
def test_greedy_ngram_equals_autoregressive(target, gamma, lo, hi, factor):
    sampling = sj.SamplingParams(temperature=0, max_new_tokens=48)
    ref = sj.generate(target, PROMPTS, sampling=sampling)
    spec = sj.SpecConfig(method="ngram", num_speculative_tokens=gamma, prompt_lookup_min=lo,
                         prompt_lookup_max=hi, prompt_lookup_length_factor=factor)
    out = sj.generate(target, PROMPTS, sampling=sampling, spec=spec)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    s = out.stats
    assert s.draft_calls == 0 and 0 < s.proposal_rate < 1
    assert s.accepted_tokens > 0 and s.proposed_tokens < gamma * s.num_rounds * len(PROMPTS)


def test_ngram_spec_errors(target, draft):
    with pytest.raises(ValueError, match="uses no draft model"):
        sj.generate(target, [[1, 2]], spec={"method": "ngram"}, draft=draft)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        sj.SpecConfig(method="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        sj.SpecConfig(method="ngram", prompt_lookup_min=0)
    for bad in (0, -1.5, float("nan"), float("inf"), "2", True):
        with pytest.raises(ValueError, match=r"prompt_lookup_length_factor .*got " + re.escape(
                repr(bad))):
            sj.SpecConfig(method="ngram", prompt_lookup_length_factor=bad)
    # n-gram options given to another method are refused as the suffix and lookahead ones are
    # (prompt_lookup_min/max were accepted and ignored: a typo of the method ran another one)
    for method, option in [("draft_model", dict(prompt_lookup_length_factor=1.5)),
                           ("draft_model", dict(prompt_lookup_max=8)),
                           ("suffix", dict(prompt_lookup_min=3))]:
        name, value = next(iter(option.items()))
        with pytest.raises(ValueError, match=f"SpecConfig.{name}={value!r} is an option of "
                                             f"method 'ngram', not '{method}'"):
            sj.SpecConfig(method=method, **option)
    spec = sj.SpecConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                               '"prompt_lookup_min": 1, "prompt_lookup_max": 2}')
    assert spec.prompt_lookup_max == 2 and not spec.needs_draft_model


@pytest.mark.parametrize("point_mass", [True, False])
@pytest.mark.parametrize("sampling", [(1.0, 0, 1.0), (0.7, 3, 0.9), (0.0, 0, 1.0)])
def test_partial_drafts_are_exact(point_mass, sampling):
    """Every draft and every per-row draft length k in 0..γ: one round then target sampling gives
    the target's joint distribution exactly."""
    G = 3
    tables = Tables(G, sampling, seed=21)
    expected = tables.target_joint()
    drafts = list(itertools.product(range(V), repeat=G))
    toks, q, p = tables.batch(drafts)
    q = None if point_mass else q
    weights = ([1.0] * len(drafts) if point_mass else
               [np.prod([float(tables.q[d[:i]][d[i]]) for i in range(G)]) for d in drafts])
    for k in range(G + 1):
        valid = jnp.broadcast_to(jnp.arange(G) < k, toks.shape)
        a = verify.acceptance_probs(toks, q, p, valid)
        r = verify.recovery_probs(toks, q, p, valid)
        if point_mass:
            for i, d in enumerate(drafts):
                got = round_then_target(tables, [d], [1.0], a[i:i + 1], r[i:i + 1])
                np.testing.assert_allclose(got, expected, atol=1e-6, err_msg=f"{d} k={k}")
        else:
            got = round_then_target(tables, drafts, weights, a, r)
            np.testing.assert_allclose(got, expected, atol=1e-6, err_msg=f"k={k}")


def test_ignoring_validity_in_recovery_is_caught():
    """Recovering from the residual at a position that proposed nothing biases the output."""
    G = 2
    tables = Tables(G, (1.0, 0, 1.0), seed=22)
    d = (1, 2)
    toks, _, p = tables.batch([d])
    valid = jnp.asarray([[False, False]])
    a = verify.acceptance_probs(toks, None, p, valid)
    broken = verify.recovery_probs(toks, None, p)  # forgets that nothing was proposed
    got = round_then_target(tables, [d], [1.0], a, broken)
    assert np.abs(got - tables.target_joint()).max() > 1e-2
