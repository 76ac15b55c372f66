"""The gate of model-free proposers (specjax/draft/gate.py): a row of n-gram or suffix drafts
proposes only while its running rate of rounds whose first draft was accepted is at least the
floor. Its estimate against a Python reference; greedy output equal to autoregressive
decoding; and the first three tokens' distribution with a floor high enough that whether a row
proposes depends on the round before (lengths that peek at the target fail the same test)."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_adaptive import peeking
from test_lossless import (
    NGRAM,
    SETTINGS,
    exact_joint,
    g_test,
    generate_samples,
    later_samples,
    models,  # noqa: F401  (the fixture: an 8-token target and drafts)
    ngram_prompt,
    tail_joints,  # noqa: F401  (the fixture: tokens 5-6's exact joints)
    tail_pvalues,
)

import specjax as sj
from specjax import verify
from specjax.draft import gate
from specjax.draft.base import Draft


def test_the_estimate_follows_a_python_reference():
    """Rounds of random lookups and random outcomes (rows accepting 0..γ of what they proposed,
    rows that stop advancing): each row's estimate and what it may propose, round by round."""
    rng = np.random.default_rng(0)
    B, G, floor = 6, 4, 0.5
    state = gate.GateState.init(B)
    length = rng.integers(3, 9, B).astype(np.int32)
    estimate, proposed, last = np.ones(B), np.zeros(B, bool), np.zeros(B, np.int64)
    closed = opened_after_closing = 0
    for _ in range(60):
        valid = rng.random((B, G)) < 0.7
        valid &= np.cumprod(valid, axis=1).astype(bool)  # a prefix per row, as lookups give
        draft, state = gate.gated(Draft(jnp.zeros((B, G), jnp.int32), None, jnp.asarray(valid)),
                                  state, jnp.asarray(length), floor)
        for b in range(B):  # the reference
            accepted = length[b] - last[b] - 1
            if proposed[b] and accepted >= 0:
                estimate[b] += gate.WEIGHT * (float(accepted >= 1) - estimate[b])
            else:
                estimate[b] += gate.RECOVERY * (1 - estimate[b])
        allowed = estimate >= floor
        np.testing.assert_allclose(np.asarray(state.estimate), estimate, rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(draft.valid), valid & allowed[:, None])
        closed += int((~allowed & valid.any(1)).sum())
        proposed, last = np.asarray(draft.valid).any(1), length.copy()
        # the round's outcome: a proposing row accepts 0..its drafts, then one more token; a
        # row that has stopped (a third of the rows from round 30) does not advance
        n = np.asarray(draft.valid).sum(1)
        take = np.where(rng.random(B) < 0.35, 0, rng.integers(0, n + 1))
        advance = np.where(np.arange(B) < 2 if _ >= 30 else np.zeros(B, bool), 0, take + 1)
        opened_after_closing += int((allowed & (estimate < 0.6)).sum())
        length = (length + advance).astype(np.int32)
    assert closed > 10 and opened_after_closing > 0, (closed, opened_after_closing)


def _spec(method, floor, gamma=2):
    lookup = NGRAM if method == "ngram" else dict(method="suffix",
                                                  suffix_decoding_max_tree_depth=4)
    return sj.SpecConfig(num_speculative_tokens=gamma, acceptance_floor=floor, **lookup)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_gated_drafts_keep_greedy_output(models, method):
    """A floor of 0.5 closes a row after three rejected first drafts in a row, for about 15
    rounds, and rows open again and have drafts accepted: fewer drafts proposed than with no
    gate, the same tokens as autoregressive decoding. (At 0.78, a row closed after one
    rejection and hardly any draft was accepted afterwards: plain decoding against itself.)"""
    target, _ = models
    prompts = [ngram_prompt(target), [1, 2, 3, 1, 2], [4, 5, 6, 7, 4, 5, 6]]
    greedy = sj.SamplingParams(temperature=0.0, max_new_tokens=50)
    reference = sj.generate(target, prompts, sampling=greedy)
    ungated = sj.generate(target, prompts, sampling=greedy, spec=_spec(method, 0.0))
    gated = sj.generate(target, prompts, sampling=greedy, spec=_spec(method, 0.5))
    np.testing.assert_array_equal(gated.tokens, reference.tokens)
    np.testing.assert_array_equal(ungated.tokens, reference.tokens)
    assert gated.stats.proposed_tokens < ungated.stats.proposed_tokens, (
        gated.stats.proposed_tokens, ungated.stats.proposed_tokens)
    assert gated.stats.accepted_tokens >= 10 and gated.stats.rejecting_rounds > 0, gated.stats


@pytest.mark.parametrize("t,k,p", SETTINGS, ids=["T1", "T0.7-topk5-topp0.9"])
@pytest.mark.parametrize("broken", [False, True], ids=["gated", "gated-and-peeking"])
def test_gated_ngram_follows_the_target(models, monkeypatch, fresh_programs, t, k, p, broken):
    """With a floor of 0.9 a row's second round proposes only if its first round's first draft
    was accepted; the first three tokens keep their exact joint distribution. The same lengths
    chosen by peeking at the target's verdict are caught."""
    target, _ = models
    prompt = ngram_prompt(target)
    sampling = sj.SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=3)
    if broken:
        monkeypatch.setattr(verify, "rejection_sample", peeking(verify.rejection_sample))
    samples = generate_samples(target, None, sampling, _spec("ngram", 0.9), prompt=prompt)
    pvalue = g_test(samples, exact_joint(target, t, k, p, prompt))
    if broken:
        assert pvalue < 1e-6, pvalue
        return
    assert pvalue > 1e-3, pvalue
    # the gate acted: fewer drafts than without it on the same rows and keys
    rows = [prompt] * 2000
    gated = sj.generate(target, rows, sampling=sampling, spec=_spec("ngram", 0.9), key=0)
    ungated = sj.generate(target, rows, sampling=sampling, spec=_spec("ngram", 0.0), key=0)
    assert gated.stats.proposed_tokens < 0.95 * ungated.stats.proposed_tokens


def test_gated_ngram_later_tokens_follow_the_target(models, tail_joints):
    """Tokens 5 and 6 of a mixed batch over several rounds, with a floor that switches rows'
    drafting off and on again as their running rate moves."""
    target, _ = models
    out = later_samples(target, None, 2, **NGRAM, acceptance_floor=0.5)
    ungated = later_samples(target, None, 2, **NGRAM)
    assert 0 < out.stats.proposed_tokens < 0.95 * ungated.stats.proposed_tokens
    assert min(tail_pvalues(out.tokens, tail_joints)) > 1e-3


def test_the_floor_is_checked():
    for bad in (-0.1, 1.5, float("nan"), "0.2"):
        with pytest.raises(ValueError, match="acceptance_floor"):
            sj.SpecConfig(method="ngram", acceptance_floor=bad)
    with pytest.raises(ValueError, match="acceptance_floor is for methods 'ngram' and 'suffix'"):
        sj.SpecConfig(method="draft_model", acceptance_floor=0.2)
    assert sj.SpecConfig(method="suffix").floor == gate.ACCEPTANCE_FLOOR
    assert sj.SpecConfig(method="ngram", acceptance_floor=0).floor == 0.0
