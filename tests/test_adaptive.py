"""Adaptive draft lengths (SpecConfig.survival_threshold): calibration, lossless per-row lengths
chosen on the draft side only, greedy equality, lengths 0..γ in one round, no recompilation,
bad input."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import perturbed, release_programs
from test_lossless import (  # noqa: F401
    SETTINGS,
    first_three_pvalue,
    later_samples,
    models,
    tail_joints,
    tail_pvalues,
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


def test_a_broken_calibration_file_is_refused_naming_it(tmp_path):
    """calibration.json that is not JSON, not an object, holds strings or booleans where numbers
    go, values float32 turns into inf or 0, or a fitted_for that is no fingerprint: a
    ValueError naming the file, not a bare JSONDecodeError or AttributeError, or a map that
    loads and fails later."""
    good = Calibration.of((2.0, -0.5), (0.7, 0.3)).to_json()
    path = tmp_path / adaptive.FILE
    for text, message in (("{'greedy': 1}", "is not valid JSON"),
                          ("", "is not valid JSON"),
                          ("[1, 2]", "must hold a JSON object, got list"),
                          (json.dumps({**good, "greedy": {"a": "2.5", "b": 0}}),
                           "greedy a must be a number"),
                          (json.dumps({**good, "greedy": {"a": True, "b": 0}}),
                           "greedy a must be a number"),
                          (json.dumps({**good, "sampled": {"a": 1e40, "b": 0}}),
                           "sampled \\(a, b\\) must be finite"),
                          (json.dumps({**good, "sampled": {"a": 1e-50, "b": 0}}),
                           "sampled \\(a, b\\) must be finite with a > 0"),
                          (json.dumps({**good, "fitted_for": "abc"}), "fitted_for must be"),
                          (json.dumps({**good, "fitted_for": {}}), "fitted_for must be")):
        path.write_text(text)
        with pytest.raises(ValueError, match=message) as raised:
            adaptive.load_calibration(tmp_path)
        assert str(path) in str(raised.value), raised.value
    path.write_text(json.dumps(good))
    np.testing.assert_allclose(adaptive.load_calibration(tmp_path).a[0, 0], 2.0)


def test_a_calibration_holds_a_map_per_draft_position(tmp_path):
    """Position k's drafts go through position k's (a, b); deeper positions than it holds take
    the last; the file keeps lists where positions differ and numbers where they do not, and a
    file of one (a, b) per mode (as fitted before positions) still loads."""
    c = Calibration.of(([1.0, 2.0], [0.0, -1.0]), (0.5, 0.3))
    conf = jnp.asarray([0.3, 0.7, 0.3])
    greedy = jnp.asarray([True, True, False])
    x = np.log(np.asarray(conf) / (1 - np.asarray(conf)))
    want = {1: [x[0], x[1], 0.5 * x[2] + 0.3], 2: [2 * x[0] - 1, 2 * x[1] - 1, 0.5 * x[2] + 0.3]}
    for position in (1, 2, 7, adaptive.POSITIONS + 5):
        np.testing.assert_allclose(np.asarray(c.predict(conf, greedy, position)),
                                   jax.nn.sigmoid(np.asarray(want[min(position, 2)])), rtol=1e-5)
    # the chain control asks position k's map at its k-th step
    control = adaptive.ChainControl(c, None, None, greedy, None)
    for _ in range(3):
        control.step(conf)
    predicted = np.asarray(control.arrays()[1])
    np.testing.assert_allclose(predicted[:, 0], jax.nn.sigmoid(np.asarray(want[1])), rtol=1e-5)
    np.testing.assert_allclose(predicted[:, 2], jax.nn.sigmoid(np.asarray(want[2])), rtol=1e-5)
    assert c.to_json() == {"greedy": {"a": [1.0, 2.0], "b": [0.0, -1.0]},
                           "sampled": {"a": 0.5, "b": pytest.approx(0.3)}}
    adaptive.save_calibration(c, tmp_path)
    loaded = adaptive.load_calibration(tmp_path)
    np.testing.assert_allclose(loaded.a, c.a)
    np.testing.assert_allclose(loaded.b, c.b)
    old = Calibration.from_json({"greedy": {"a": 1.5, "b": 0.1}, "sampled": {"a": 0.5, "b": 0}})
    assert np.asarray(old.a).shape == (2, adaptive.POSITIONS) and np.all(old.a[0] == 1.5)
    for bad in ([1.0] * (adaptive.POSITIONS + 1), "x", [], [[1.0]]):
        with pytest.raises(ValueError, match="greedy a must be a number or a list of 1 to 16"):
            Calibration.of((bad, 0.0), (1.0, 0.0))
    with pytest.raises(ValueError, match="sampled \\(a, b\\) must be finite with a > 0 .* "
                                         "got \\(\\[1.0, -1.0\\], 0.0\\)"):
        Calibration.of((1.0, 0.0), ([1.0, -1.0], 0.0))


def test_each_position_gets_its_own_fit_where_it_has_drafts_enough():
    """What calibrate_rounds fits per draft position: each position's own map from its binned
    points; a position with fewer than MIN_POSITION_DRAFTS drafts takes the one before it."""
    rng = np.random.default_rng(4)

    def points(a, b, n):
        c = rng.uniform(0.02, 0.98, n)
        y = (rng.random(n) < 1 / (1 + np.exp(-(a * np.log(c / (1 - c)) + b)))).astype(float)
        which = np.minimum((c * 20).astype(int), 19)
        m = np.bincount(which, minlength=20)
        keep = m > 0
        return np.stack([np.bincount(which, c, 20)[keep] / m[keep],
                         np.bincount(which, y, 20)[keep] / m[keep], m[keep]], axis=1)
    truths = [(2.0, -0.7), (0.7, 0.8), (3.0, 2.0)]
    fit = [points(*truths[0], 100000), points(*truths[1], 60000),
           points(*truths[2], adaptive.MIN_POSITION_DRAFTS - 1)]
    maps, pooled = adaptive.fit_positions(fit)
    for (a, b), (ta, tb) in zip(maps[:2], truths[:2]):
        assert abs(a - ta) < 0.15 and abs(b - tb) < 0.15, (maps, truths)
    assert maps[2] == maps[1]  # too few drafts: the position before it
    assert abs(pooled[0] - truths[0][0]) > 0.3  # one map for both fits neither
    maps, pooled = adaptive.fit_positions([fit[2], fit[0]])
    assert maps[0] == pooled and abs(maps[1][0] - 2.0) < 0.15
    # cross-validation picks a map per position where positions differ, one map where not
    differ = [[points(*truths[0], 20000), points(*truths[1], 20000)] for _ in range(2)]
    form, losses = adaptive.choose_form(*differ)
    assert form == "per position" and losses["one map"] > losses["per position"], losses
    alike = [[points(1.2, 0.3, 3000), points(1.2, 0.3, 1500), points(1.2, 0.3, 1500)]
             for _ in range(2)]
    form, losses = adaptive.choose_form(*alike)
    assert form == "one map", losses
    # a slope the data would make negative stays at the floor, with the intercept refitted
    c = rng.uniform(0.5, 0.99, 50000)
    y = (rng.random(c.size) < 1.2 - c).astype(float)  # accepted less when confident
    a, b = adaptive._fit_logistic(c, y)
    assert a == adaptive._MIN_SLOPE
    assert abs(np.mean(1 / (1 + np.exp(-(a * np.log(c / (1 - c)) + b)))) - y.mean()) < 0.01


def test_the_stats_count_each_draft_position_apart(models):
    """Stats.reliability_by_draft_position: with every draft verified, position k + 1 holds
    a draft in each row-round whose draft k was accepted, and its accepted drafts are those
    per_position_acceptance counts; pooled, the positions give Stats.reliability."""
    target, drafts = models  # a close draft: about half its drafts accepted
    sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=40)
    spec = sj.SpecConfig(num_speculative_tokens=3, survival_threshold=adaptive.EVERY_DRAFT)
    s = sj.generate(target, [[1, 2, 3]] * 8, sampling=sampling, spec=spec, draft=drafts["close"],
                    key=2).stats
    by = [np.asarray(b, np.float64).reshape(-1, 3) for b in s.reliability_by_draft_position]
    assert len(by) == 3
    drafts = [b[:, 2].sum() for b in by]
    accepted = [np.sum(b[:, 1] * b[:, 2]) for b in by]
    rounds = drafts[0]  # every row-round verifies its first draft
    np.testing.assert_allclose(accepted, np.asarray(s.per_position_acceptance) * rounds,
                               atol=1e-3)
    np.testing.assert_allclose(drafts[1:], accepted[:-1], atol=1e-3)
    assert 0 < accepted[-1] < drafts[-1] < drafts[0]  # some rejected at each depth
    pooled = np.asarray(s.reliability).reshape(-1, 3)
    assert pooled[:, 2].sum() == sum(drafts)


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


def test_the_fit_converges_where_many_confidences_sit_at_one():
    """A peaked draft gives many confidences of exactly 1.0 in float32 (one clipped logit): a
    plain Newton step from (1, 0) could run off to a ~ 1e6 there and save a map that predicts
    1 for everything. The fit must do at least as well as the map the data were drawn from, on
    the data's own cross-entropy."""
    def loss(a, b, x, y):
        z = a * x + b
        return np.mean(np.logaddexp(0.0, z) - y * z)
    for seed in range(40):
        rng = np.random.default_rng(seed)
        sure = rng.random(4000) < rng.uniform(0.1, 0.7)
        c = np.where(sure, 1 - 10 ** rng.uniform(-9, -2, 4000), rng.uniform(0.05, 0.95, 4000))
        c = c.astype(np.float32).astype(np.float64)
        x = adaptive._np_logit(c)
        ta, tb = rng.uniform(0.3, 1.5), rng.uniform(-1, 2)
        y = (rng.random(c.size) < 1 / (1 + np.exp(-(ta * x + tb)))).astype(float)
        a, b = adaptive._fit_logistic(c, y)
        assert loss(a, b, x, y) <= loss(ta, tb, x, y) + 1e-9, (seed, a, b, ta, tb)


def test_rounds_deeper_than_a_calibration_holds_share_its_last_map(monkeypatch):
    """A chain longer than POSITIONS (16) is fitted with its deeper drafts pooled into the
    last position's points, the map they are predicted by (not a fit that fails at the end)."""
    deep = [np.full((1, 3), [0.5, 0.5, float(k + 1)]) for k in range(20)]
    monkeypatch.setattr(engine, "generate", lambda *a, **k: type("Out", (), dict(
        stats=type("Stats", (), dict(reliability_by_draft_position=deep)))))
    points = adaptive.round_points(None, Calibration.identity(), [[1]], method="draft_model",
                                   gamma=20, temperature=0.0)
    assert len(points) == adaptive.POSITIONS
    assert [p[0, 2] for p in points[:15]] == list(range(1, 16))
    np.testing.assert_array_equal(points[-1][:, 2], np.arange(16, 21))
    maps, _ = adaptive.fit_positions(points)
    assert len(maps) == adaptive.POSITIONS
    Calibration.of(([a for a, _ in maps], [b for _, b in maps]), (1.0, 0.0))  # fits in one


def test_the_weighted_fit_recovers_a_known_calibration_from_bins():
    """What calibrate_rounds fits: the engine's binned points (mean confidence, fraction
    accepted, drafts), each weighted by its drafts."""
    rng = np.random.default_rng(0)
    c = rng.uniform(0.02, 0.98, 200000)
    truth = 1 / (1 + np.exp(-(2.0 * np.log(c / (1 - c)) - 0.7)))
    y = (rng.random(c.size) < truth).astype(float)
    which = np.minimum((c * 20).astype(int), 19)
    n = np.bincount(which, minlength=20)
    points = np.stack([np.bincount(which, c) / n, np.bincount(which, y) / n, n], axis=1)
    a, b = adaptive._fit_logistic(points[:, 0], points[:, 1], weights=points[:, 2])
    assert abs(a - 2.0) < 0.15 and abs(b + 0.7) < 0.15, (a, b)
    # unweighted, the sparse bins pull it elsewhere: the weights matter
    skewed = points.copy()
    skewed[:10, 2] *= 100
    assert abs(adaptive._fit_logistic(*skewed[:, :2].T, weights=skewed[:, 2])[1]
               - adaptive._fit_logistic(*skewed[:, :2].T)[1]) > 1e-3


def test_calibrate_fits_a_draft_model_on_held_out_rows(models, tmp_path):
    target, drafts = models
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, 8, 4)) for _ in range(16)]
    cal, report = adaptive.calibrate(target, drafts["close"], prompts, max_new_tokens=24)
    for mode in ("greedy", "sampled"):
        r = report[mode]
        assert r["samples"] > 300 and r["a"] > 0
        # fitted on other rows: no worse than the raw confidence (up to the noise of a fit on
        # a few hundred drafts)
        assert r["ece"] <= r["ece_raw"] + 0.01, r
        assert sum(b["count"] for b in r["reliability"]) > 0
    # shipped beside a draft model folder, it comes back with it
    sj.save_model(drafts["close"], tmp_path / "draft")
    adaptive.save_calibration(cal, tmp_path / "draft", report)
    loaded = sj.load_draft_model(tmp_path / "draft")
    np.testing.assert_allclose(loaded.calibration.a, cal.a)
    with pytest.raises(ValueError, match="at least 2 prompts"):
        adaptive.calibrate(target, drafts["close"], prompts[:1])


def test_calibration_prompts_end_at_definitions_in_files_the_bench_does_not_use(tmp_path):
    import json

    from specjax.train import pair
    texts = {"mine.py": "import os\n\n\ndef a():\n    pass\n\nclass C:\n    async def b(self):\n",
             "asyncio/subprocess.py": "x = 1\ndef benched():\n"}  # a bench prompt's file
    for name, text in texts.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    prompts = adaptive.definition_prompts(list(texts.values()), 3, lines=3)
    assert prompts == ["\n\ndef a():\n", "\nclass C:\n    async def b(self):\n",
                       "x = 1\ndef benched():\n"]
    with pytest.raises(ValueError, match="3 function definitions .* fewer than the 4 prompts"):
        adaptive.definition_prompts(list(texts.values()), 4)
    (tmp_path / "corpus.json").write_text(json.dumps({"root": str(tmp_path),
                                                      "heldout": list(texts)}))

    class Chars:  # a tokenizer: one id per character
        encode = staticmethod(lambda text: [ord(c) for c in text])
    got = pair.calibration_prompts(tmp_path, Chars, 2)
    assert ["".join(map(chr, x)) for x in got] == [
        "import os\n\n\ndef a():\n",
        "import os\n\n\ndef a():\n    pass\n\nclass C:\n    async def b(self):\n"]


# -- losslessness -------------------------------------------------------------------------------

# per setting, a threshold at which the close draft's rows propose 0 to 3 drafts, varying round
# by round (its q is sharper at T = 0.7 with top-k and top-p)
THRESHOLD = {1.0: 0.5, 0.7: 0.8}


@pytest.fixture
def pairs_of_rows(monkeypatch, fresh_programs):
    """Rows share their verified width in pairs, not across the whole batch: the distribution
    tests draw thousands of rows in one batch, where some row nearly always wants every draft
    and the widths would almost never vary. In pairs they vary as in a batch of two."""
    monkeypatch.setattr(adaptive, "WIDTH_GROUP", 2)


@pytest.mark.parametrize("t,k,p", SETTINGS, ids=["T1", "T0.7-topk5-topp0.9"])
def test_adaptive_lengths_follow_the_target(models, pairs_of_rows, t, k, p):
    target, drafts = models
    spec = sj.SpecConfig(num_speculative_tokens=3, survival_threshold=THRESHOLD[t])
    pvalue, stats = first_three_pvalue(target, drafts["close"], spec, t, k, p, with_stats=True)
    assert pvalue > 1e-3
    lengths = stats.proposed_length_distribution  # of the rounds whose samples were tested
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
def test_lengths_that_peek_at_the_target_fail_the_same_test(models, monkeypatch, pairs_of_rows,
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
                                                                 pairs_of_rows, t, k, p):
    target, drafts = models
    monkeypatch.setattr(draft_model, "draw_scored", scoring_the_drawn_token(
        draft_model.draw_scored))
    spec = sj.SpecConfig(num_speculative_tokens=3, survival_threshold=THRESHOLD[t])
    # the subtlest broken variant in the suite: at T = 0.7, 24,576 rows give p = 4e-6 and
    # 36,864 (a batch bucket, as N is) p = 3e-8
    assert first_three_pvalue(target, drafts["close"], spec, t, k, p, rows=36864) < 1e-6


@pytest.fixture(scope="module")
def close(target):
    """A perturbed copy of the target: greedy, about half its first drafts are accepted and a
    few of its fourth, so adaptive rows stop at different depths, accept and are rejected (the
    session's small draft accepts almost nothing here, and a greedy check with it would compare
    plain decoding with plain decoding)."""
    return sj.Model(target.config, perturbed(target.params, 1, 0.03))


def engaged(stats) -> None:
    """The speculative path ran: drafts accepted, beyond the first too, and rejected."""
    assert stats.accepted_tokens > 0 and stats.rejecting_rounds > 0, stats
    assert stats.per_position_acceptance[1] > 0, stats.per_position_acceptance


@pytest.mark.parametrize("threshold", [0.05, 0.3, 0.9])
def test_greedy_equals_autoregressive(target, close, threshold):
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=40)
    ref = sj.generate(target, PROMPTS, sampling=sampling)
    spec = sj.SpecConfig(num_speculative_tokens=4, survival_threshold=threshold)
    out = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=close)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    engaged(out.stats)
    full = sj.generate(target, PROMPTS, sampling=sampling, spec=dict(num_speculative_tokens=4),
                       draft=close)
    assert out.stats.proposed_tokens < full.stats.proposed_tokens


@pytest.mark.parametrize("spec", [
    dict(num_speculative_tokens=4, survival_threshold=0.05),
    dict(num_speculative_tokens=4, verify_costs=(1.0, 1.02, 1.05, 1.1, 1.2), draft_cost=0.05)],
    ids=["lengths", "budget-with-rests"])
def test_the_decode_program_proposes_in_one_place(target, close, monkeypatch, fresh_programs,
                                                  spec):
    """The decode loop verifies over one forward per width (1, 2, 3, 5 at γ = 4) but proposes
    the next round's drafts in one place, rests or not: the proposal, a round's largest part to
    trace and compile, is traced twice in all (the prefill's first proposal and the decode
    loop's), not once per width (the program 1.8-3 times as large) and again for a rest's end.
    The programs are test_greedy_equals_autoregressive[0.05]'s and
    test_budget_greedy_equals_autoregressive[cheap]'s, with the same output."""
    traced = []
    propose_next = engine._propose_next

    def counted(*args):
        traced.append(args[0].gamma)
        return propose_next(*args)
    monkeypatch.setattr(engine, "_propose_next", counted)
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=40)
    out = sj.generate(target, PROMPTS, sampling=sampling, spec=sj.SpecConfig(**spec),
                      draft=close)
    assert len(adaptive.loop_widths(4)) == 4
    assert traced == [4, 4], f"the proposal was traced {len(traced)} times"
    ref = sj.generate(target, PROMPTS, sampling=sampling)
    np.testing.assert_array_equal(out.tokens, ref.tokens)


def test_one_row_skips_the_draft_steps_it_does_not_need(target):
    """A single row drafting with the target itself (accepted, and confident to varying
    degrees): rounds stop after k <= γ - 2 drafts, the draft forwards counted are fewer than γ a
    round, and greedy output is still the autoregressive one over many such rounds. Each later
    draft step is a conditional in the program itself (a step run on every round, with only its
    count conditional, fails that)."""
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=40)
    spec = sj.SpecConfig(num_speculative_tokens=4, survival_threshold=0.3)
    for prompt in PROMPTS:
        ref = sj.generate(target, [prompt], sampling=sampling)
        out = sj.generate(target, [prompt], sampling=sampling, spec=spec, draft=target)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        assert out.stats.proposed_length_distribution[:3].sum() > 0.2, out.stats
        assert out.stats.mean_accepted_length > 1.5, out.stats
        # the draft forwards counted are those run: the first of every round, and a later one
        # only while the row still drafts (at least one per draft proposed, and fewer than γ a
        # round when rounds stop early)
        s = out.stats
        assert 1 + s.proposed_tokens <= s.draft_calls
        assert s.draft_calls < 1 + 4 * s.num_rounds, s
    # the count above follows the same predicate as the branch; the program must branch on it
    B, G = 2, 4
    proposer = DraftModelProposer(target.config, G, survival_threshold=0.3)
    d = DraftModel(target, None, None)
    prompts, lengths = jnp.zeros((B, 16), jnp.int32), jnp.full((B,), 4, jnp.int32)
    cache = proposer.init(d, prompts, lengths, 16)
    sampling_arrays = SamplingArrays(temperature=jnp.zeros((B,)), top_k=jnp.zeros((B,), jnp.int32),
                                     top_p=jnp.ones((B,)))
    text = jax.jit(proposer.propose, static_argnums=6).lower(
        d, cache, prompts, lengths, jax.random.split(jax.random.key(0), B), sampling_arrays,
        Filters(greedy=True), None).as_text()
    assert text.count("stablehlo.case") >= G - 1, text.count("stablehlo.case")


# -- shapes and programs ------------------------------------------------------------------------

def test_rows_get_every_length_from_0_to_gamma_in_one_round(target, draft, monkeypatch):
    """One round of the proposer on 64 rows. Each row on its own (WIDTH_GROUP 1): its lengths
    span 0 .. γ, each a prefix. In pairs, each row gets the longer of its pair's own lengths;
    across the batch (the default), every row still generating gets the longest, and a
    finished row none. The drafts drawn are the same at every scope."""
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
    active = jnp.asarray(np.arange(B) % 7 != 3)

    def one_round(group):  # a new trace per scope: the group is read when tracing
        monkeypatch.setattr(adaptive, "WIDTH_GROUP", group)
        out, _ = jax.jit(proposer.propose, static_argnums=6)(
            d, cache, prompts, lengths, jax.random.split(jax.random.key(0), B), sampling,
            Filters(greedy=False), active)
        valid = np.asarray(out.valid)
        counts = valid.sum(axis=1)
        assert np.all(valid == (np.arange(G)[None, :] < counts[:, None]))  # prefixes
        return np.asarray(out.tokens), counts

    tokens, own = one_round(1)
    assert set(own[np.asarray(active)].tolist()) == set(range(G + 1)), np.bincount(own)
    assert not own[~np.asarray(active)].any()
    in_pairs = one_round(2)
    np.testing.assert_array_equal(in_pairs[0], tokens)
    np.testing.assert_array_equal(
        in_pairs[1], np.repeat(own.reshape(-1, 2).max(axis=1), 2) * np.asarray(active))
    batch = one_round(None)
    np.testing.assert_array_equal(batch[0], tokens)
    np.testing.assert_array_equal(batch[1], own.max() * np.asarray(active))


def test_changing_lengths_and_calibrations_do_not_recompile(target, draft):
    sampling = sj.SamplingParams(temperature=0.8, max_new_tokens=24)
    spec = sj.SpecConfig(num_speculative_tokens=4, survival_threshold=0.2)
    sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=draft)
    compiled = engine.PROGRAMS.compiled
    recalibrated = DraftModel(draft, None, Calibration.of((3.0, 1.0), (0.5, -1.0)))
    for d, key in ((draft, 1), (recalibrated, 2)):
        out = sj.generate(target, PROMPTS[::-1], sampling=sampling, spec=spec, draft=d, key=key)
        assert out.stats.compile_seconds == 0 and engine.PROGRAMS.compiled == compiled, key


def test_other_thresholds_and_budgets_reuse_the_program_with_their_own_numbers(
        target, draft, monkeypatch, fresh_programs):
    """A threshold's and a budget's numbers are data of the call (adaptive.Tuning): a call with
    other numbers has the plan (the compile key) of the first and runs its program, and gets
    what a program compiled with its own numbers gives (the same tokens, drafts proposed and
    lengths). Numbers kept in the plan, as before, make another plan per value and fail."""
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=24)
    budget = dict(num_speculative_tokens=4, draft_cost=0.05, idle_rounds=0)
    families = [[sj.SpecConfig(num_speculative_tokens=4, survival_threshold=t)
                 for t in (0.05, 0.6)],
                [sj.SpecConfig(verify_costs=c, **budget)
                 for c in ((1.0, 1.02, 1.05, 1.1, 1.2), (1.0, 1.4, 1.9, 2.5, 3.0))]]

    def plan(spec):
        return engine._prepare(target, PROMPTS, sampling, spec, draft, None, 0, None, None,
                               None, None)[2]

    def seen(spec):
        out = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=draft)
        return (out.tokens.tolist(), out.stats.proposed_tokens,
                list(out.stats.proposed_length_distribution))
    with monkeypatch.context() as m:  # the numbers in the plan, as before
        m.setattr(adaptive, "split_tuning", lambda proposer: (proposer, None))
        assert all(plan(a) != plan(b) for a, b in families)  # a program per value
        own = [seen(b) for _, b in families]  # the second value's own program
    release_programs()
    for (first, second), want in zip(families, own):
        assert plan(first) == plan(second)
        before = seen(first)
        compiled = engine.PROGRAMS.compiled
        got = seen(second)
        assert got == want and engine.PROGRAMS.compiled == compiled, second
        assert got[1] != before[1]  # the numbers differ where it shows: drafts proposed


def test_a_budget_passed_per_call_decides_as_the_same_budget_compiled_in(draft):
    """The budget a call passes (a float32 table of its costs, rounded once from float64) makes
    the decisions the same numbers compiled in make, on random inputs at every position; a
    proposer already split (PER_CALL) is refused by name."""
    budget = adaptive.Budget.of((1.0, 1.137, 1.291, 1.5537, 1.9), 0.0731, round_cost=0.313)
    proposer = DraftModelProposer(draft.config, 4, 0.3, budget)
    static, tuning = adaptive.split_tuning(proposer)
    assert static.budget is adaptive.PER_CALL and static.survival_threshold is adaptive.PER_CALL
    assert tuning.costs.shape == (5,) and tuning.costs.dtype == np.float32  # the table alone
    # each cost as the float32 constant compiling it in gives (summed in float32 on the
    # device, cost(1) here would come out one ulp lower: 1.5230999 against 1.5231)
    np.testing.assert_array_equal(
        jax.jit(lambda t: [adaptive.tuned(static, t).budget.cost(k) for k in range(5)])(tuning),
        np.asarray([budget.cost(k) for k in range(5)], np.float32))

    @jax.jit
    def both(tuning, expected, survival, predicted, alive):
        per_call = adaptive.tuned(static, tuning).budget
        return [(budget.widen(expected, survival, predicted, alive, k),
                 per_call.widen(expected, survival, predicted, alive, k)) for k in range(1, 5)]
    rng = np.random.default_rng(0)
    for _ in range(20):
        args = (jnp.asarray([rng.uniform(1, 6)], jnp.float32),
                jnp.asarray(rng.uniform(0, 1, 6), jnp.float32),
                jnp.asarray(rng.uniform(0, 1, 6), jnp.float32), jnp.asarray(rng.random(6) < 0.8))
        for compiled_in, per_call in both(tuning, *args):
            assert bool(compiled_in[0]) == bool(per_call[0])
            np.testing.assert_array_equal(compiled_in[1], per_call[1])
    with pytest.raises(ValueError, match="DraftModelProposer.*PER_CALL"):
        adaptive.split_tuning(static)


def test_bad_settings_are_refused_by_name(target, draft):
    for a, b in ((jnp.asarray([1.0, 1.0]), jnp.zeros((2,))),  # one map, not one per position
                 (-jnp.ones((2, adaptive.POSITIONS)), jnp.zeros((2, adaptive.POSITIONS)))):
        with pytest.raises(ValueError, match="calibration must hold a \\[2, 16\\] > 0"):
            sj.generate(target, PROMPTS, spec=sj.SpecConfig(survival_threshold=0.5),
                        draft=DraftModel(draft, None, Calibration(a, b)))
    for bad in (0, 1, 1.5, -0.1, "0.5", True):
        with pytest.raises(ValueError, match="survival_threshold must be in \\(0, 1\\)"):
            sj.SpecConfig(survival_threshold=bad)
    with pytest.raises(ValueError, match="for chains of method draft_model, medusa, eagle, "
                                         "dflash, mtp; got method 'ngram'"):
        sj.SpecConfig(method="ngram", survival_threshold=0.5)
    with pytest.raises(ValueError, match="got method 'draft_model' with a tree"):
        sj.SpecConfig(tree=((0,), (1,)), survival_threshold=0.5)


# -- the batch's verify budget ------------------------------------------------------------------

def budget_reference(predicted, active, threshold, budget):
    """numpy: which positions the rule of adaptive.Budget proposes, from the calibrated
    per-position predictions [B, G], the active rows [B], a threshold and a Budget."""
    B, G = predicted.shape
    survival = np.cumprod(predicted, axis=1)
    valid = np.zeros((B, G), bool)
    alive, wants = active.copy(), active.copy()
    expected = max(active.sum(), 1)
    for k in range(1, G + 1):
        # a row wants draft k while its own survival holds; the batch verifies it in every
        # row still generating while some row wants it
        wants = wants & (survival[:, k - 1] >= (threshold or 0))
        alive = alive & wants.any()
        s, p = survival[alive, k - 1], predicted[alive, k - 1]
        # every width w >= k, drafts after k projected at draft k's own predicted chance
        rates = [(expected + sum((s * p ** j).sum() for j in range(w - k + 1))) / budget.cost(w)
                 for w in range(k, G + 1)]
        if max(rates) <= expected / budget.cost(k - 1):
            break
        expected += s.sum()
        valid[:, k - 1] = alive
    return valid


def control_valid(scores, greedy, active, threshold, budget, calibration=None):
    control = adaptive.ChainControl(calibration, threshold, budget, greedy, active)
    for k in range(scores.shape[1]):
        control.step(scores[:, k])
    return np.asarray(control.arrays()[0])


def lookahead_valid(scores, greedy, active, threshold, budget, calibration=None):
    """Broken on purpose: the width that maximises the round's expected tokens per cost over
    every position, chosen after all the drafts are drawn, so whether draft k is verified
    depends on the confidences after it, which depend on draft k itself."""
    predicted = np.asarray((calibration or Calibration.identity()).predict(scores, greedy))
    full = budget_reference(predicted, np.asarray(active), threshold,
                            adaptive.Budget((1.0,) * (scores.shape[1] + 1)))  # every position
    survival = np.cumprod(predicted, axis=1) * full
    expected = np.asarray(active).sum() + np.concatenate([[0], np.cumsum(survival.sum(0))])
    best = int(np.argmax([expected[k] / budget.cost(k) for k in range(scores.shape[1] + 1)]))
    return full & (np.arange(scores.shape[1])[None, :] < best)


@pytest.mark.parametrize("rule,causal", [(control_valid, True), (lookahead_valid, False)],
                         ids=["ChainControl", "broken-lookahead"])
def test_whether_draft_k_is_verified_never_depends_on_what_follows(rule, causal):
    """Lossless needs the decision for position k to be made before draft k is drawn: from
    the confidences at positions 1 .. k only. Changing the confidences after k must leave the
    decisions up to k as they were; a rule that picks the width after seeing every position
    breaks this (and so would bias which drafts reach the verifier)."""
    rng = np.random.default_rng(0)
    B, G = 6, 5
    # a forward over two tokens costs much more than one, wider ones little more (as where
    # widths are padded to a tile): one draft does not pay for itself, several together may
    budget = adaptive.Budget.of([1.0, 1.8, 1.85, 1.9, 1.95, 2.0], 0.02)
    greedy = jnp.asarray(rng.random(B) < 0.5)
    active = jnp.asarray([True, True, True, True, False, True])
    broke = 0
    for _ in range(200):
        scores = jnp.asarray(rng.uniform(0.3, 1.0, (B, G)), jnp.float32)
        valid = rule(scores, greedy, active, 0.05, budget)
        for k in range(G - 1):
            later = scores.at[:, k + 1:].set(jnp.asarray(rng.uniform(0.3, 1.0, (B, G - k - 1)),
                                                         jnp.float32))
            same = np.array_equal(rule(later, greedy, active, 0.05, budget)[:, :k + 1],
                                  valid[:, :k + 1])
            broke += not same
        if causal:
            assert not valid[~np.asarray(active)].any()  # finished rows draft nothing
            ref = budget_reference(np.asarray(Calibration.identity().predict(scores, greedy)),
                                   np.asarray(active), 0.05, budget)
            np.testing.assert_array_equal(valid, ref)
    assert (broke == 0) if causal else (broke > 0), broke


def test_the_proposer_follows_the_budget_rule_row_by_row(draft, monkeypatch):
    """One round on 64 rows at mixed temperatures: the verified positions are exactly those the
    reference rule picks from the proposer's own predictions, and the width falls as verifying
    gets dearer, down to none. With rows sharing widths in pairs (WIDTH_GROUP 2, as the
    distribution tests run), each pair gets what the rule gives a batch of those two rows."""
    B, G, P = 64, 4, 6
    rng = np.random.default_rng(5)
    prompts = jnp.asarray(rng.integers(0, 32, (B, 32)), jnp.int32)
    lengths = jnp.full((B,), P, jnp.int32)
    sampling = SamplingArrays(temperature=jnp.linspace(0.0, 1.5, B),
                              top_k=jnp.zeros((B,), jnp.int32), top_p=jnp.ones((B,)))
    active = jnp.asarray(rng.random(B) < 0.8)
    d = DraftModel(draft, None, Calibration.of((1.0, 0.5), (1.0, 1.0)))
    widths = []
    for slope in (0.02, 0.3, 1.0, 3.0):
        budget = adaptive.Budget.of([1 + slope * k for k in range(G + 1)], 0.05)
        proposer = DraftModelProposer(draft.config, G, survival_threshold=0.1, budget=budget)
        cache = proposer.init(d, prompts, lengths, 32)
        out, _ = jax.jit(proposer.propose, static_argnums=6)(
            d, cache, prompts, lengths, jax.random.split(jax.random.key(0), B), sampling,
            Filters(greedy=False), active)
        valid, predicted = np.asarray(out.valid), np.asarray(out.predicted)
        np.testing.assert_array_equal(
            valid, budget_reference(predicted, np.asarray(active), 0.1, budget))
        widths.append(int(valid.sum(axis=1).max()))
    assert widths[0] == G and widths[-1] == 0 and widths == sorted(widths, reverse=True), widths
    monkeypatch.setattr(adaptive, "WIDTH_GROUP", 2)  # read when tracing: a new trace
    budget = adaptive.Budget.of([1 + 0.3 * k for k in range(G + 1)], 0.05)
    proposer = DraftModelProposer(draft.config, G, survival_threshold=0.1, budget=budget)
    out, _ = jax.jit(proposer.propose, static_argnums=6)(
        d, cache, prompts, lengths, jax.random.split(jax.random.key(0), B), sampling,
        Filters(greedy=False), active)
    valid, predicted = np.asarray(out.valid), np.asarray(out.predicted)
    pairs = np.concatenate([budget_reference(predicted[i:i + 2], np.asarray(active[i:i + 2]),
                                             0.1, budget) for i in range(0, B, 2)])
    np.testing.assert_array_equal(valid, pairs)
    assert len(set(valid.sum(axis=1).tolist())) > 2  # pairs of other widths in one round


# priced so that pairs of rows verify 1, 2 or 3 drafts (about 0.34, 0.13, 0.53 of the rounds)
BUDGET = dict(num_speculative_tokens=3, verify_costs=(1.0, 1.5, 2.0, 2.5), draft_cost=0.1)


def test_budget_lengths_follow_the_target(models, pairs_of_rows):
    """The verify budget alone (no threshold), each pair of rows its own budget (as in a batch
    of two), the verified lengths varying from pair to pair."""
    target, drafts = models
    t, k, p = SETTINGS[1]
    pvalue, stats = first_three_pvalue(target, drafts["close"], sj.SpecConfig(**BUDGET), t, k, p,
                                       with_stats=True)
    assert pvalue > 1e-3
    lengths = stats.proposed_length_distribution
    assert lengths[1:3].sum() > 0.1 and lengths[3] > 0.02 and lengths[3] < 0.9, lengths


def test_a_budget_that_weighs_the_drawn_draft_fails_the_same_test(models, monkeypatch,
                                                                    pairs_of_rows):
    """The same, with each draft's confidence taken from the token drawn (q(token)), which the
    budget's predictions then read: which drafts are verified depends on what they are."""
    target, drafts = models
    monkeypatch.setattr(draft_model, "draw_scored", scoring_the_drawn_token(
        draft_model.draw_scored))
    t, k, p = SETTINGS[1]
    assert first_three_pvalue(target, drafts["close"], sj.SpecConfig(**BUDGET), t, k, p) < 1e-6


@pytest.mark.parametrize("costs", [(1.0, 1.02, 1.05, 1.1, 1.2), (1.0, 1.4, 1.9, 2.5, 3.0),
                                   (1.0, 3.0, 5.0, 7.0, 9.0)], ids=["cheap", "dear", "plain"])
def test_budget_greedy_equals_autoregressive(target, close, costs):
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=40)
    ref = sj.generate(target, PROMPTS, sampling=sampling)
    spec = sj.SpecConfig(num_speculative_tokens=4, verify_costs=costs, draft_cost=0.05)
    out = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=close)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    lengths = out.stats.proposed_length_distribution
    if costs[1] > 2:  # no draft pays for a forward three times a step: plain decoding
        assert lengths[0] == 1 and out.stats.proposed_tokens == 0
    else:
        assert lengths[0] < 1 and out.stats.proposed_tokens > 0
        assert out.stats.accepted_tokens > 0 and out.stats.rejecting_rounds > 0, out.stats


def test_the_stats_score_the_calibration_on_the_calls_own_drafts(target):
    """Drafting with the target itself, greedy: every verified draft is accepted, so each
    reliability bin's measured acceptance is 1 and the calibration error is 1 - the mean
    prediction; the per-row mean lengths are those of the counters."""
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=30)
    spec = sj.SpecConfig(num_speculative_tokens=4, survival_threshold=0.3)
    out = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=target)
    s = out.stats
    assert s.reliability and all(acc == 1.0 for _, acc, _ in s.reliability), s.reliability
    n = sum(c for _, _, c in s.reliability)
    mean_pred = sum(p * c for p, _, c in s.reliability) / n
    assert abs(s.calibration_error - (1 - mean_pred)) < 1e-5
    assert n == s.accepted_tokens  # every draft verified was reached and accepted
    assert s.mean_proposed_by_row.shape == (len(PROMPTS),)
    # the rows share their rounds, so the mean over rows of each row's drafts a round is the
    # drafts a round per row
    np.testing.assert_allclose(np.mean(s.mean_proposed_by_row),
                               s.proposed_tokens / (s.num_rounds * len(PROMPTS)), rtol=1e-6)
    plain = sj.generate(target, PROMPTS, sampling=sampling, spec=dict(num_speculative_tokens=4),
                        draft=target)
    assert np.isnan(plain.stats.calibration_error) and plain.stats.reliability == ()
    np.testing.assert_allclose(plain.stats.mean_proposed_by_row, 4.0)


def test_bad_budgets_are_refused_by_name():
    for bad in ((1.0, 2.0), (1.0, -1.0, 2.0, 3.0, 4.0), (1.0, float("nan"), 1, 1, 1), "1,2",
                (1.0, True, 1.0, 1.0, 1.0),
                (1e-320, 1.0, 1.0, 1.0, 1.0)):  # over the first: inf in float32
        with pytest.raises(ValueError, match="verify_costs must be 5 \\(γ \\+ 1\\) finite"):
            sj.SpecConfig(num_speculative_tokens=4, verify_costs=bad)
    with pytest.raises(ValueError, match="draft_cost must be a finite number >= 0"):
        sj.SpecConfig(num_speculative_tokens=1, verify_costs=(1, 2), draft_cost=-0.1)
    with pytest.raises(ValueError, match="draft_cost=0.1 needs verify_costs"):
        sj.SpecConfig(draft_cost=0.1)
    with pytest.raises(ValueError, match="verify_costs .* got method 'ngram'"):
        sj.SpecConfig(method="ngram", num_speculative_tokens=1, verify_costs=(1, 2))
    with pytest.raises(ValueError, match="round_cost must be a finite number >= 0"):
        sj.SpecConfig(num_speculative_tokens=1, verify_costs=(1, 2), round_cost=-1.0)
    with pytest.raises(ValueError, match="round_cost=0.2 needs verify_costs"):
        sj.SpecConfig(round_cost=0.2)
    for bad in (0.0, -1.0, float("inf"), float("nan"), True, "1.1"):
        with pytest.raises(ValueError, match="decline_cost must be a finite number > 0"):
            sj.SpecConfig(num_speculative_tokens=1, verify_costs=(1, 2), decline_cost=bad)
    with pytest.raises(ValueError, match="decline_cost=1.1 needs verify_costs"):
        sj.SpecConfig(decline_cost=1.1)
    spec = sj.SpecConfig.parse('{"num_speculative_tokens": 2, "verify_costs": [2, 3, 4]}')
    assert spec.budget == adaptive.Budget((1.0, 1.5, 2.0), 0.0)
    spec = sj.SpecConfig.parse('{"num_speculative_tokens": 2, "verify_costs": [2, 3, 4], '
                               '"draft_cost": 0.1, "round_cost": 0.3}')
    assert spec.budget == adaptive.Budget((1.0, 1.5, 2.0), 0.1, 0.3)
    # numpy numbers (what a measurement gives) are numbers
    spec = sj.SpecConfig(num_speculative_tokens=2, verify_costs=tuple(np.float32([2, 3, 4])),
                         draft_cost=np.float32(0.25), round_cost=np.float64(0.5))
    assert spec.budget == adaptive.Budget((1.0, 1.5, 2.0), 0.25, 0.5)
    # a round verifying none: 1 + c, or the decline cost given (in the first cost's units)
    assert spec.budget.cost(0) == 1.25
    declined = dataclasses.replace(spec, decline_cost=np.float64(1.05)).budget
    assert declined == adaptive.Budget((1.0, 1.5, 2.0), 0.25, 0.5, 1.05)
    assert declined.cost(0) == 1.05 and declined.cost(1) == spec.budget.cost(1)


def test_a_rounds_fixed_cost_is_paid_by_rounds_that_draft():
    """The fixed part of a round that drafts (o) is paid once whatever its width, and not at all
    by a round without drafts (1 + c). So with confident drafts under forward costs where one
    more draft barely pays, a growing o first widens the rounds that draft (each extra draft
    shares it), and past some o no round drafts at all; each width is the reference rule's."""
    B, G = 8, 4
    scores = jnp.asarray(np.random.default_rng(2).uniform(0.75, 0.95, (B, G)), jnp.float32)
    greedy, active = jnp.ones((B,), bool), jnp.ones((B,), bool)
    widths = []
    for o in (0.0, 0.3, 20.0):
        budget = adaptive.Budget.of([1.0, 1.5, 2.1, 2.8, 3.6], 0.02, round_cost=o)
        assert budget.cost(0) == 1.02 and budget.cost(2) == o + 0.06 + 2.1  # 3 draft steps
        valid = control_valid(scores, greedy, active, None, budget)
        ref = budget_reference(np.asarray(Calibration.identity().predict(scores, greedy)),
                               np.asarray(active), None, budget)
        np.testing.assert_array_equal(valid, ref)
        widths.append(int(valid.sum(axis=1).max()))
    assert 0 < widths[0] < widths[1] and widths[2] == 0, widths



def test_a_round_is_charged_the_forward_its_loop_runs():
    """The decode loop has a forward of each of loop_widths(γ) only (1, 2, 3, 5, 9 at γ = 8), so
    a round verifying k drafts pays the narrowest of them holding k + 1 tokens: three or four
    drafts the five-token forward, five to eight the nine-token one. Charged the forward over
    k + 1 tokens instead, the budget would take a fifth draft for a quarter step more where it
    pays four more tokens' worth of forward, and stop where a sixth to eighth draft come free."""
    assert engine.loop_widths(8) == adaptive.loop_widths(8) == (1, 2, 3, 5, 9)
    v = [1.0 + 0.25 * n for n in range(9)]
    budget = adaptive.Budget.of(v, 0.02, round_cost=0.1)
    held = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 6: 8, 7: 8, 8: 8}  # k drafts: the forward over n + 1
    assert budget.cost(0) == pytest.approx(1.02)
    for k, n in held.items():
        assert budget.cost(k) == pytest.approx(0.1 + 0.02 * min(k + 1, 8) + v[n]), k
    # the rule with it, rows equally confident: a round stops at the end of a loop's width
    # (charged k + 1 tokens, confidences 0.74, 0.8, 0.88 and 0.92 took 3, 3, 5 and 7 drafts)
    B, G = 4, 8
    greedy, active = jnp.ones((B,), bool), jnp.ones((B,), bool)
    for p, want in ((0.6, 2), (0.74, 2), (0.8, 4), (0.88, 4), (0.92, 8), (0.97, 8)):
        valid = control_valid(jnp.full((B, G), p, jnp.float32), greedy, active, None, budget)
        assert int(valid.sum(axis=1).max()) == want, (p, valid.sum(axis=1))


def test_a_round_is_charged_the_draft_steps_it_runs(target):
    """A draft model's round that verifies k < γ drafts has run k + 1 draft steps (the one
    that scored draft k + 1 decided against it), γ at k = γ, and one at k = 0: what
    Budget.cost charges, counted from the chain's own forwards over rounds of every length. A
    drafter whose drafting costs the same every round (MTP, Medusa, the block drafter) is
    charged it once, by rounds verifying no draft too."""
    B, G = 1, 4
    d = DraftModel(target, None, None)
    prompts = jnp.asarray(np.random.default_rng(0).integers(0, 32, (B, 16)), jnp.int32)
    sampling_arrays = SamplingArrays(temperature=jnp.zeros((B,)),
                                     top_k=jnp.zeros((B,), jnp.int32), top_p=jnp.ones((B,)))
    steps = {}  # drafts verified -> draft steps run
    for c in (0.0, 0.05, 0.3):
        budget = adaptive.Budget.of([1.0, 1.02, 1.04, 1.06, 1.08], c)
        proposer = DraftModelProposer(target.config, G, budget=budget)
        cache = proposer.init(d, prompts, jnp.full((B,), 4, jnp.int32), 32)
        propose = jax.jit(proposer.propose, static_argnums=6)
        for length in range(3, 15):
            chain, _ = propose(d, cache, prompts, jnp.full((B,), length, jnp.int32),
                               jax.random.split(jax.random.key(0), B), sampling_arrays,
                               Filters(greedy=True), None)
            k, run = int(chain.valid.sum()), int(chain.forwards)
            steps.setdefault(k, set()).add(run)
            if c:  # the budget's own charge for the draft steps of a round of k drafts
                v = budget.verify_costs[next(w for w in adaptive.loop_widths(G) if w > k) - 1]
                assert budget.cost(k) - (budget.round_cost if k else 0) - v == \
                    pytest.approx(c * run), (k, run)
    assert len(steps) >= 3 and all(v == {min(k + 1, G) if k else 1} for k, v in steps.items()), \
        steps
    spec = sj.SpecConfig(method="mtp", num_speculative_tokens=G,
                         verify_costs=(1.0, 1.1, 1.2, 1.3, 1.4), draft_cost=0.2, round_cost=0.1)
    fixed = spec.budget
    assert not fixed.sequential and sj.SpecConfig(
        method="eagle", num_speculative_tokens=G, verify_costs=(1.0, 1.1, 1.2, 1.3, 1.4)
    ).budget.sequential
    assert fixed.cost(0) == pytest.approx(1.2)
    for k, n in ((1, 2), (2, 3), (3, 5), (4, 5)):
        assert fixed.cost(k) == pytest.approx(0.1 + 0.2 + spec.verify_costs[n - 1]), k


def test_a_partial_last_group_gets_the_rule_of_its_own_rows(monkeypatch):
    """With rows sharing widths in pairs, five rows make two pairs and a row alone: each group
    gets what the reference rule gives a batch of its own rows (the last one padded, never
    counted as a row)."""
    monkeypatch.setattr(adaptive, "WIDTH_GROUP", 2)
    B, G = 5, 4
    rng = np.random.default_rng(4)
    budget = adaptive.Budget.of([1.0, 1.5, 2.0, 2.5, 3.0], 0.1)
    greedy, active = jnp.ones((B,), bool), jnp.asarray([True, True, True, False, True])
    for _ in range(5):
        scores = jnp.asarray(rng.uniform(0.3, 1.0, (B, G)), jnp.float32)
        valid = control_valid(scores, greedy, active, 0.05, budget)
        predicted = np.asarray(Calibration.identity().predict(scores, greedy))
        want = np.concatenate([budget_reference(predicted[i:i + 2], np.asarray(active[i:i + 2]),
                                                0.05, budget) for i in (0, 2, 4)])
        np.testing.assert_array_equal(valid, want)

# -- rests: rounds that skip the draft after the budget declines ----------------------------------

def declining_before(step):
    """Draft-side only, like a budget under load: the proposals of the rounds before ``step``
    verify no draft in any row (decided from the round number, never from the target)."""
    def wrap(propose):
        def declined(plan, target_params, draft_params, request, state, keys):
            draft, draft_state = propose(plan, target_params, draft_params, request, state, keys)
            if draft.valid is not None:
                draft = dataclasses.replace(draft, valid=draft.valid & (state.step >= step))
            return draft, draft_state
        return declined
    return wrap


@pytest.fixture
def one_long_rest(monkeypatch, fresh_programs):
    """The first proposal declines and the rounds then rest 4 rounds (not 1, 2, 4, ... after
    two declines), and the draft rejoins one token a forward: a rest long enough to need the
    rejoin, early enough for the exact distributions of the first six tokens."""
    monkeypatch.setattr(engine, "_propose", declining_before(1)(engine._propose))
    monkeypatch.setattr(engine, "REST_AFTER", 1)
    monkeypatch.setattr(engine, "FIRST_REST", 4)
    monkeypatch.setattr(draft_model, "REJOIN_WIDTH", 1)


REST_SPEC = dict(verify_costs=(1.0, 1.02, 1.05, 1.1), draft_cost=0.02, idle_rounds=4)


def test_later_tokens_after_a_rest_follow_the_target(models, tail_joints, one_long_rest):
    """Tokens 2-5 come from rest rounds, then the draft rejoins and token 6 comes from a round
    that verifies drafts: the fifth and sixth tokens follow the target."""
    target, drafts = models
    out = later_samples(target, drafts["close"], 3, **REST_SPEC)
    assert out.stats.rested_rounds == 4 and out.stats.accepted_tokens > 0, out.stats
    assert min(tail_pvalues(out.tokens, tail_joints)) > 1e-3


def test_a_rest_that_peeks_at_the_target_fails_the_same_test(models, tail_joints, monkeypatch,
                                                             one_long_rest):
    target, drafts = models
    monkeypatch.setattr(verify, "rejection_sample", peeking(verify.rejection_sample))
    out = later_samples(target, drafts["close"], 3, **REST_SPEC)
    assert out.stats.rested_rounds == 4
    assert min(tail_pvalues(out.tokens, tail_joints)) < 1e-6


def test_a_rejoined_draft_reads_what_it_missed(target, one_long_rest):
    """Drafting with the target itself, greedy, after a rest every verified draft is still
    accepted, and the output is autoregressive decoding's."""
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=40)
    ref = sj.generate(target, PROMPTS, sampling=sampling)
    spec = sj.SpecConfig(num_speculative_tokens=3, **REST_SPEC)
    out = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=target)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert out.stats.rested_rounds == 4 and out.stats.proposed_tokens > 20
    assert out.stats.acceptance_rate == 1.0, out.stats


def reads_nothing(self, params, cache, history, read, length):
    """Broken on purpose: a rejoin that marks the missed tokens read without reading them."""
    return cache, jnp.maximum(read, length - 2)


@pytest.mark.parametrize("broken", [False, True], ids=["rejoin", "reads-nothing"])
def test_the_rejoin_leaves_the_cache_a_prefill_of_the_same_tokens_leaves(draft, broken):
    """Rows that read through different positions, rejoined a few tokens a forward up to their
    lengths: the draft's keys and values below each row's length - 1 are those of a prefill of
    the whole text (a row already there keeps its own). A rejoin that reads nothing fails."""
    rng = np.random.default_rng(0)
    B, S, G = 3, 48, 3
    history = jnp.asarray(rng.integers(0, 32, (B, S)), jnp.int32)
    read = jnp.asarray([4, 9, 30], jnp.int32)  # the last positions each row's draft read
    length = jnp.asarray([29, 20, 31], jnp.int32)  # each row's newest position
    proposer = DraftModelProposer(draft.config, G, None, None, 32, idle_rounds=16)
    params = draft_model.as_draft_model(draft)
    cache = proposer.init(params, history, read + 1, S)
    # a prefill computes the whole padded chunk: what lies past each row's read is noise here
    past = (jnp.arange(S)[None, :] > read[:, None])[None, :, None, :, None]  # [L, B, K, S, D]
    noise = jnp.asarray(rng.normal(size=cache.k.shape), cache.k.dtype)
    cache = dataclasses.replace(cache, k=jnp.where(past, noise, cache.k),
                                v=jnp.where(past, -noise, cache.v))
    while bool(jnp.any(proposer.behind(read, length))):
        cache, read = (reads_nothing(proposer, params, cache, history, read, length) if broken
                       else proposer.rejoin(params, cache, history, read, length))
    assert np.all(np.asarray(read) >= np.asarray(length) - 2)
    whole = proposer.init(params, history, length - 1, S)
    near = [np.allclose(cache.k[:, b, :, :n], whole.k[:, b, :, :n], atol=1e-5)
            and np.allclose(cache.v[:, b, :, :n], whole.v[:, b, :, :n], atol=1e-5)
            for b, n in enumerate(np.asarray(length) - 1)]
    assert near == ([False, False, True] if broken else [True] * B), near


@pytest.mark.parametrize("costs", [(1.0, 3.0, 5.0, 7.0, 9.0), (1.0, 1.4, 1.9, 2.5, 3.0)],
                         ids=["plain", "dear"])
def test_rests_skip_the_draft_and_keep_greedy_equal(target, draft, costs):
    """Under costs where drafting never or seldom pays, the rounds rest (by default, with a
    budget): the output is autoregressive decoding's, in chunks streamed or not, and the draft
    runs fewer forwards than without rests."""
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=40)
    ref = sj.generate(target, PROMPTS, sampling=sampling)
    runs = {}
    for idle in (None, 0):
        spec = sj.SpecConfig(num_speculative_tokens=4, verify_costs=costs, draft_cost=0.05,
                             idle_rounds=idle)
        runs[idle] = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=draft)
        np.testing.assert_array_equal(runs[idle].tokens, ref.tokens)
    rested, never = runs[None].stats, runs[0].stats
    assert rested.rested_rounds > rested.num_rounds // 2 and never.rested_rounds == 0
    assert rested.draft_calls < never.draft_calls * 0.7, (rested, never)
    spec = sj.SpecConfig(num_speculative_tokens=4, verify_costs=costs, draft_cost=0.05)
    chunks = list(sj.stream(target, PROMPTS, sampling=sampling, spec=spec, draft=draft,
                            rounds_per_chunk=3))
    np.testing.assert_array_equal(chunks[-1].generation.tokens, ref.tokens)


def test_bad_rests_are_refused_by_name():
    costs = dict(num_speculative_tokens=1, verify_costs=(1, 2))
    for bad in (-1, 1.5, True, "4", 10**6):
        with pytest.raises(ValueError, match="idle_rounds must be an int in \\[0, 1024\\]"):
            sj.SpecConfig(idle_rounds=bad, **costs)
    with pytest.raises(ValueError, match="idle_rounds=4 rests .* got method 'ngram'"):
        sj.SpecConfig(method="ngram", num_speculative_tokens=2, idle_rounds=4)
    with pytest.raises(ValueError, match="idle_rounds=4 .* got method 'draft_model' without"):
        sj.SpecConfig(idle_rounds=4)
    assert sj.SpecConfig(**costs).rests == 16 and sj.SpecConfig().rests == 0
    assert sj.SpecConfig(idle_rounds=0, **costs).rests == 0
    assert sj.SpecConfig(survival_threshold=0.5, idle_rounds=8).rests == 8


def test_measure_costs_times_forwards_steps_and_rounds(target, draft, monkeypatch):
    from specjax import timing
    honest_rounds, chains = timing.round_timers, []
    monkeypatch.setattr(timing, "round_timers", lambda *a, spec=None, **kw: (
        chains.append(spec and spec.num_speculative_tokens),
        honest_rounds(*a, spec=spec, **kw))[1])
    # the timers run as they are; the seconds they give are replaced by chosen ones, so every
    # figure derived from them is pinned: a step 2 ms, forwards of 2 and 3 tokens 1.2 and 1.3
    # steps, the bare draft forward 0.05, a plain round 0.1 beyond its forward, and rounds of
    # 1 and 2 drafts built of o = 0.3, c = 0.12 and their verify forwards of 2 and 3 tokens
    # (plus the plain round's 0.1)
    step, timed = 0.002, []
    chosen = {1: 1.0, 2: 1.2, 3: 1.3, "draft": 0.05, "plain": 1.1,
              ("round", 1): 0.3 + 0.12 + 1.2 + 0.1, ("round", 2): 0.3 + 0.24 + 1.3 + 0.1}
    honest_median = timing.median_seconds
    monkeypatch.setattr(timing, "median_seconds", lambda timers, repeats: (
        timed.append(set(honest_median(timers, repeats))),
        {k: chosen[k] * step for k in timers})[1])
    costs = adaptive.measure_costs(target, draft, batch_size=2, gamma=2, context=16, repeats=1)
    assert timed == [set(chosen)]
    assert costs.verify_costs == pytest.approx([1.0, 1.2, 1.3])
    assert costs.draft_cost == pytest.approx(0.12) and costs.round_cost == pytest.approx(0.3)
    assert chains == [1, 2, None]  # rounds of chains of 1 and γ drafts, and a plain step
    # a round verifying none: a decode step and the bare draft forward (not the in-round c)
    assert costs.decline_cost == pytest.approx(1.05) and costs.cost(0) == pytest.approx(1.05)
    monkeypatch.setattr(timing, "median_seconds", honest_median)
    # 5 rows: the forwards are timed at the 6 generate runs (its batch bucket), as its rounds
    honest, rows = timing.forward_timer, []
    monkeypatch.setattr(timing, "forward_timer", lambda *a, batch, **kw: (
        rows.append(batch), honest(*a, batch=batch, **kw))[1])
    heads_only = adaptive.measure_costs(target, None, batch_size=5, gamma=2, context=16,
                                        repeats=1)
    assert heads_only.draft_cost == 0 and heads_only.round_cost == 0
    assert heads_only.decline_cost is None and heads_only.cost(0) == 1.0
    assert rows == [6, 6, 6] == [engine.bucket(5, minimum=1)] * 3


def test_round_costs_come_from_rounds_of_one_and_gamma_drafts():
    """Rounds that cost o + c·g + v_g (g = 1 and γ) give back the c and o they were built of;
    a slope below the draft's bare forward (noise) is charged the bare forward, o is never
    negative, and with one chain only (γ = 1) c is the bare forward."""
    verify = [1.0, 1.1, 1.15, 1.2, 1.3]
    rounds = {g: 0.3 + 0.12 * g + verify[g] for g in (1, 4)}
    assert adaptive.fit_round_costs(rounds, verify, 0.05) == pytest.approx((0.12, 0.3))
    # the bare forward (0.05) with the rest of the γ round put into o, as until 2026-12-07,
    # priced the round of one draft 0.21 steps above what it costs
    o_before = rounds[4] - verify[4] - 4 * 0.05
    assert o_before + 0.05 + verify[1] - rounds[1] == pytest.approx(0.21)
    flat = {1: 1.5, 4: 1.5 + verify[4] - verify[1]}  # no cost per draft at all: noise
    assert adaptive.fit_round_costs(flat, verify, 0.05) == pytest.approx((0.05, 1.5 - 0.05 - 1.1))
    assert adaptive.fit_round_costs({1: 1.0, 4: 2.0}, verify, 0.05)[1] == 0.0
    assert adaptive.fit_round_costs({1: 1.5}, verify[:2], 0.05) == pytest.approx(
        (0.05, 1.5 - 0.05 - 1.1))


def test_confidence_is_the_largest_probability():
    """Greedy rows: the largest probability of the softmax of the logits (a -inf logit is a
    zero, a row of equal logits gives 1/M); sampled rows: the largest probability of q."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, 50)) * 3
    logits[1, :25] = -np.inf
    logits[2] = 0.5
    q = rng.dirichlet(np.ones(50), size=4)
    temperature = jnp.asarray([0.0, 0.0, 0.0, 0.8])
    got = np.asarray(adaptive.confidence(jnp.asarray(logits, jnp.float32),
                                         jnp.asarray(q, jnp.float32), temperature))
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.where(np.asarray(temperature) == 0, p.max(-1), q.max(-1))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[2] == pytest.approx(1 / 50, rel=1e-5)
    np.testing.assert_allclose(np.asarray(adaptive.confidence(jnp.asarray(logits, jnp.float32),
                                                              None, temperature)),
                               p.max(-1), rtol=1e-5)
