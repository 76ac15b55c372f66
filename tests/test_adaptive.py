"""Adaptive draft lengths (SpecConfig.survival_threshold): calibration, lossless per-row lengths
chosen on the draft side only, greedy equality, lengths 0..γ in one round, no recompilation,
bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_lossless import (  # noqa: F401
    PROMPT,
    SETTINGS,
    first_three_pvalue,
    models,
)

import specjax as sj
from specjax import adaptive, engine, verify
from specjax.adaptive import Calibration
from specjax.draft import draft_model
from specjax.draft.draft_model import DraftModel, DraftModelProposer
from specjax.sampling import Filters, SamplingArrays

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


# -- calibration --------------------------------------------------------------------------------

def test_calibration_is_order_preserving_and_round_trips(tmp_path):
    c = Calibration.of((2.0, -0.5), (0.7, 0.3))
    conf = jnp.asarray([[0.1, 0.5, 0.9], [0.1, 0.5, 0.9]])
    pred = np.asarray(c.predict(conf, jnp.asarray([True, False])))
    assert np.all(np.diff(pred, axis=1) > 0)  # a > 0: more confident, more likely accepted
    np.testing.assert_allclose(pred[0, 1], jax.nn.sigmoid(-0.5), rtol=1e-6)  # logit(0.5) = 0
    np.testing.assert_allclose(Calibration.identity().predict(conf, jnp.asarray([True, False])),
                               conf, rtol=1e-5)
    adaptive.save_calibration(c, tmp_path, {"note": "test"})
    loaded = adaptive.load_calibration(tmp_path)
    np.testing.assert_allclose(loaded.a, c.a)
    np.testing.assert_allclose(loaded.b, c.b)
    assert adaptive.load_calibration(tmp_path / "nothing") is None
    with pytest.raises(ValueError, match="a > 0 .* got \\(-1.0, 0.0\\)"):
        Calibration.of((-1.0, 0.0), (1.0, 0.0))


def test_the_fit_recovers_a_known_calibration():
    rng = np.random.default_rng(0)
    c = rng.uniform(0.02, 0.98, 20000)
    truth = 1 / (1 + np.exp(-(2.0 * np.log(c / (1 - c)) - 0.7)))
    y = (rng.random(c.size) < truth).astype(float)
    a, b = adaptive._fit_logistic(c, y)
    assert abs(a - 2.0) < 0.1 and abs(b + 0.7) < 0.1, (a, b)
    fitted = 1 / (1 + np.exp(-(a * np.log(c / (1 - c)) + b)))
    assert adaptive.expected_calibration_error(fitted, y) < 0.02
    assert adaptive.expected_calibration_error(c, y) > 0.05  # the raw confidence is not


def test_calibrate_fits_a_draft_model_on_held_out_rows(models, tmp_path):
    target, drafts = models
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, 8, 4)) for _ in range(16)]
    cal, report = adaptive.calibrate(target, drafts["close"], prompts, max_new_tokens=24)
    for mode in ("greedy", "sampled"):
        r = report[mode]
        assert r["samples"] > 300 and r["a"] > 0
        assert r["ece"] <= max(r["ece_raw"], 0.08), r  # fitted on other rows; no worse
        assert sum(b["count"] for b in r["reliability"]) > 0
    # shipped beside a draft model folder, it comes back with it
    sj.save_model(drafts["close"], tmp_path / "draft")
    adaptive.save_calibration(cal, tmp_path / "draft", report)
    loaded = sj.load_draft_model(tmp_path / "draft")
    np.testing.assert_allclose(loaded.calibration.a, cal.a)
    with pytest.raises(ValueError, match="at least 2 prompts"):
        adaptive.calibrate(target, drafts["close"], prompts[:1])


# -- losslessness -------------------------------------------------------------------------------

# per setting, a threshold at which the close draft's rows propose 0 to 3 drafts, varying round
# by round (its q is sharper at T = 0.7 with top-k and top-p)
THRESHOLD = {1.0: 0.5, 0.7: 0.8}


@pytest.mark.parametrize("t,k,p", SETTINGS, ids=["T1", "T0.7-topk5-topp0.9"])
def test_adaptive_lengths_follow_the_target(models, t, k, p):
    target, drafts = models
    spec = sj.SpecConfig(num_speculative_tokens=3, survival_threshold=THRESHOLD[t])
    assert first_three_pvalue(target, drafts["close"], spec, t, k, p) > 1e-3
    sampling = sj.SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=3)
    out = sj.generate(target, [PROMPT] * 512, sampling=sampling, spec=spec, draft=drafts["close"])
    lengths = out.stats.proposed_length_distribution
    assert lengths[0] > 0.02 and lengths[1:3].sum() > 0.1 and lengths[3] > 0.02, lengths


def peeking(rejection_sample):
    """Broken on purpose: lengths that look at the target. Each row proposes only the drafts
    the verifier is going to accept (learnt by verifying once with the same keys), so where a
    draft would be rejected the row's token comes from p instead of the residual."""
    def peek(keys, drafts, q, p, valid=None):
        first = rejection_sample(keys, drafts, q, p, valid)
        accepted = jnp.arange(drafts.shape[1])[None, :] < first.num_accepted[:, None]
        return rejection_sample(keys, drafts, q, p,
                                accepted if valid is None else accepted & valid)
    return peek


@pytest.mark.parametrize("t,k,p", SETTINGS, ids=["T1", "T0.7-topk5-topp0.9"])
def test_lengths_that_peek_at_the_target_fail_the_same_test(models, monkeypatch, fresh_programs,
                                                            t, k, p):
    target, drafts = models
    monkeypatch.setattr(verify, "rejection_sample", peeking(verify.rejection_sample))
    spec = sj.SpecConfig(num_speculative_tokens=3, survival_threshold=THRESHOLD[t])
    assert first_three_pvalue(target, drafts["close"], spec, t, k, p) < 1e-6


def scoring_the_drawn_token(draw_scored):
    """Broken on purpose: lengths that look at the draft they keep. A sampled draft is scored
    by q(token) of the token drawn, so likely draws are kept more often than unlikely ones and
    the drafts verified are no longer distributed as the q reported."""
    def scored(logits, key, sampling_params, filters, vocab=None, *, scored=True):
        tokens, q, score = draw_scored(logits, key, sampling_params, filters, vocab,
                                       scored=scored)
        if q is not None and score is not None:  # (the test's draft has no draft vocabulary)
            score = jnp.take_along_axis(q, tokens[:, None], axis=-1)[:, 0]
        return tokens, q, score
    return scored


@pytest.mark.parametrize("t,k,p", SETTINGS, ids=["T1", "T0.7-topk5-topp0.9"])
def test_lengths_that_look_at_the_drawn_draft_fail_the_same_test(models, monkeypatch,
                                                                 fresh_programs, t, k, p):
    target, drafts = models
    monkeypatch.setattr(draft_model, "draw_scored", scoring_the_drawn_token(
        draft_model.draw_scored))
    spec = sj.SpecConfig(num_speculative_tokens=3, survival_threshold=THRESHOLD[t])
    assert first_three_pvalue(target, drafts["close"], spec, t, k, p) < 1e-6


@pytest.mark.parametrize("threshold", [0.05, 0.3, 0.9])
def test_greedy_equals_autoregressive(target, draft, threshold):
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=40)
    ref = sj.generate(target, PROMPTS, sampling=sampling)
    spec = sj.SpecConfig(num_speculative_tokens=4, survival_threshold=threshold)
    out = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=draft)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    full = sj.generate(target, PROMPTS, sampling=sampling, spec=dict(num_speculative_tokens=4),
                       draft=draft)
    assert out.stats.proposed_tokens < full.stats.proposed_tokens


def test_one_row_skips_the_draft_steps_it_does_not_need(target):
    """A single row drafting with the target itself (accepted, and confident to varying
    degrees): whenever it stops after k <= γ - 2 drafts, the remaining draft steps take the
    skipped branch (nothing written that a later round reads); greedy output is still the
    autoregressive one over many such rounds."""
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=40)
    spec = sj.SpecConfig(num_speculative_tokens=4, survival_threshold=0.3)
    for prompt in PROMPTS:
        ref = sj.generate(target, [prompt], sampling=sampling)
        out = sj.generate(target, [prompt], sampling=sampling, spec=spec, draft=target)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        assert out.stats.proposed_length_distribution[:3].sum() > 0.2, out.stats
        assert out.stats.mean_accepted_length > 1.5, out.stats


# -- shapes and programs ------------------------------------------------------------------------

def test_rows_get_every_length_from_0_to_gamma_in_one_round(target, draft):
    """One round of the proposer on 64 rows: its lengths span 0 .. γ, each a prefix."""
    B, G, P = 64, 4, 6
    rng = np.random.default_rng(3)
    prompts = jnp.asarray(rng.integers(0, 32, (B, 32)), jnp.int32)
    lengths = jnp.full((B,), P, jnp.int32)
    # rows sampled at temperatures from 0.05 to 1.5: the sharper a row's q, the more confident
    d = DraftModel(draft, None, Calibration.of((1.0, 0.0), (1.0, 1.0)))
    proposer = DraftModelProposer(draft.config, G, survival_threshold=0.3)
    cache = proposer.init(d, prompts, lengths, 32)
    sampling = SamplingArrays(temperature=jnp.linspace(0.05, 1.5, B),
                              top_k=jnp.zeros((B,), jnp.int32),
                              top_p=jnp.ones((B,)))
    out, _ = jax.jit(proposer.propose, static_argnums=6)(
        d, cache, prompts, lengths, jax.random.split(jax.random.key(0), B), sampling,
        Filters(greedy=False))
    valid = np.asarray(out.valid)
    counts = valid.sum(axis=1)
    assert set(counts.tolist()) == set(range(G + 1)), np.bincount(counts)
    assert np.all(valid == (np.arange(G)[None, :] < counts[:, None]))  # prefixes


def test_changing_lengths_and_calibrations_do_not_recompile(target, draft):
    sampling = sj.SamplingParams(temperature=0.8, max_new_tokens=24)
    spec = sj.SpecConfig(num_speculative_tokens=4, survival_threshold=0.2)
    sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=draft)
    compiled = engine.PROGRAMS.compiled
    recalibrated = DraftModel(draft, None, Calibration.of((3.0, 1.0), (0.5, -1.0)))
    for d, key in ((draft, 1), (recalibrated, 2)):
        out = sj.generate(target, PROMPTS[::-1], sampling=sampling, spec=spec, draft=d, key=key)
        assert out.stats.compile_seconds == 0 and engine.PROGRAMS.compiled == compiled, key


def test_bad_settings_are_refused_by_name(target, draft):
    with pytest.raises(ValueError, match="calibration must hold a \\[2\\] > 0"):
        sj.generate(target, PROMPTS, spec=sj.SpecConfig(survival_threshold=0.5),
                    draft=DraftModel(draft, None, Calibration(jnp.asarray([-1.0, 1.0]),
                                                              jnp.zeros((2,)))))
    for bad in (0, 1, 1.5, -0.1, "0.5", True):
        with pytest.raises(ValueError, match="survival_threshold must be in \\(0, 1\\)"):
            sj.SpecConfig(survival_threshold=bad)
    with pytest.raises(ValueError, match="for chains of method draft_model; got method "
                                         "'ngram'"):
        sj.SpecConfig(method="ngram", survival_threshold=0.5)
    with pytest.raises(ValueError, match="got method 'draft_model' with a tree"):
        sj.SpecConfig(tree=((0,), (1,)), survival_threshold=0.5)
