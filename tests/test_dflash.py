"""The block drafter (method="dflash"): training, saving, greedy equality, distributions, its
cache, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from test_adaptive import pairs_of_rows, scoring_the_drawn_token  # noqa: F401
from test_heads import (
    PROMPTS,
    TREE,
    adaptive_greedy_stats,
    adaptive_pvalue,
    differs_when_verification_accepts_everything,
    greedy_rounds,
    quick,
    reporting_uniform_q,
    samples_of,
)
from test_lossless import (  # noqa: F401
    SETTINGS,
    first_three_pvalue,
    later_samples,
    models,
    tail_joints,
    tail_pvalues,
)

import specjax as sj
from specjax import attention
from specjax.draft import dflash
from specjax.draft import heads as heads_lib
from specjax.draft.dflash import DFlashProposer
from specjax.train.data import sample_batch
from specjax.train.heads import HeadsObjective, train_heads

BLOCK = 6


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    """A two-layer block drafter (blocks of up to 6, a 28-token draft vocabulary) trained
    briefly on the shared test target's own samples."""
    tokens = samples_of(target)
    drafter, evals = train_heads(target, "dflash", tokens, quick(steps=120),
                                 tmp_path_factory.mktemp("dflash"), block_size=BLOCK,
                                 draft_vocab_size=28, heldout=tokens, progress=False)
    return {"tokens": tokens, "dflash": drafter, "evals": evals}


def test_training_reduces_the_loss_and_resumes(target, trained, tmp_path):
    d = trained["dflash"]
    assert d.config.taps == (0, 1) and d.config.block_size == BLOCK
    fresh = heads_lib.init_heads(target, "dflash", jax.random.key(0), block_size=BLOCK,
                                 vocab=d.vocab.ids)
    objective = HeadsObjective(fresh.config, target.config)
    aux = {"target": target.params, "vocab": fresh.vocab.ids}
    batch = jnp.asarray(sample_batch(trained["tokens"], 8, 32, 12345, 0))
    before = float(objective(fresh.params["weights"], batch, aux))
    after = float(objective(d.params["weights"], batch, aux))
    assert after < 0.95 * before, (before, after)
    # resumed training reaches the weights of an uninterrupted run
    cfg = quick(steps=4, seed=3)
    run = lambda name, **kw: train_heads(  # noqa: E731
        target, "dflash", trained["tokens"], cfg, tmp_path / name, block_size=BLOCK,
        progress=False, **kw)[0]
    whole = run("whole")
    run("split", max_seconds=0)
    resumed = run("split")
    for a, b in zip(jax.tree.leaves(resumed.params["weights"]),
                    jax.tree.leaves(whole.params["weights"])):
        np.testing.assert_array_equal(a, b)


def test_save_load_round_trip_and_wrong_target(target, trained, tmp_path):
    d = trained["dflash"]
    sj.save_heads(d, tmp_path / "d", target)
    loaded = sj.load_heads(tmp_path / "d", target)
    assert loaded.config == d.config
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(d.params)):
        np.testing.assert_array_equal(a, b)
    other = tiny_model(seed=7, vocab_size=32, hidden_size=32, layers=2, heads=4, kv_heads=2,
                       max_pos=128)
    with pytest.raises(ValueError, match="trained for another target"):
        sj.load_heads(tmp_path / "d", other)


def test_bad_input_is_refused_by_name(target, trained):
    d = trained["dflash"]
    prompts = [[1, 2, 3]]
    with pytest.raises(ValueError, match="blocks of up to 6 drafts; got num_speculative_tokens=7"):
        sj.generate(target, prompts, spec=dict(method="dflash", num_speculative_tokens=7),
                    draft=d)
    with pytest.raises(ValueError, match="blocks of up to 6 drafts; got a tree of depth 7"):
        sj.generate(target, prompts, spec=dict(method="dflash", tree=[[0] * i for i in
                                                                       range(1, 8)]), draft=d)
    with pytest.raises(ValueError, match="29 children per node, more than the drafter's "
                                         "28-token draft vocabulary"):
        sj.generate(target, prompts, spec=dict(method="dflash", tree=[[i] for i in range(29)]),
                    draft=d)
    with pytest.raises(ValueError, match="method 'dflash' but the heads are 'eagle'"):
        sj.generate(target, prompts, spec=dict(method="dflash"),
                    draft=heads_lib.init_heads(target, "eagle", jax.random.key(0)))
    with pytest.raises(ValueError, match="taps must be ascending distinct layer indices in "
                                         "\\[0, 2\\), got \\(0, 2\\)"):
        heads_lib.init_heads(target, "dflash", jax.random.key(0), taps=(0, 2))
    with pytest.raises(ValueError, match="got \\(1, 0\\)"):
        heads_lib.init_heads(target, "dflash", jax.random.key(0), taps=(1, 0))
    with pytest.raises(ValueError, match="num_layers must be an int >= 1, got 0"):
        heads_lib.init_heads(target, "dflash", jax.random.key(0), num_layers=0)
    for bad in (0, 17, 2.5, True):  # not an int of [1, 16] (2.5 and True were kept, and saved)
        with pytest.raises(ValueError, match=f"an int block_size in \\[1, 16\\] .* got "
                                             f"block_size={bad!r}"):
            heads_lib.init_heads(target, "dflash", jax.random.key(0), block_size=bad)
    deeper = tiny_model(seed=0, vocab_size=32, hidden_size=32, layers=3, heads=4, kv_heads=2,
                        max_pos=128)
    reads_layer_2 = heads_lib.init_heads(deeper, "dflash", jax.random.key(0), taps=(2,))
    with pytest.raises(ValueError, match="reads target layers \\(2,\\); the target has 2"):
        sj.generate(target, prompts, spec=dict(method="dflash"), draft=reads_layer_2)


@pytest.mark.parametrize("gamma", [1, 3, BLOCK])
def test_greedy_equals_autoregressive(target, trained, gamma):
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=40)
    ref = sj.generate(target, PROMPTS, sampling=sampling)
    out = sj.generate(target, PROMPTS, sampling=sampling,
                      spec=dict(method="dflash", num_speculative_tokens=gamma),
                      draft=trained["dflash"])
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert out.stats.accepted_tokens > 0 and out.stats.draft_calls == 1 + out.stats.num_rounds


def test_adaptive_greedy_equals_autoregressive(target, trained):
    """Adaptive lengths: rows verify fewer drafts where the block is unsure, and the output
    stays greedy decoding's."""
    adaptive_greedy_stats(target, trained["dflash"], "dflash", BLOCK, ADAPTIVE)


def test_greedy_tree_equals_autoregressive(target, trained):
    """A tree: every node at depth d takes position d + 1's top-ranked tokens as children."""
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=40)
    ref = sj.generate(target, PROMPTS, sampling=sampling)
    out = sj.generate(target, PROMPTS, sampling=sampling, spec=dict(method="dflash", tree=TREE),
                      draft=trained["dflash"])
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert out.stats.mean_accepted_length > 1.1, out.stats


def test_greedy_check_fails_when_verification_accepts_everything(target, trained, monkeypatch,
                                                                 fresh_programs):
    assert differs_when_verification_accepts_everything(
        target, trained["dflash"], dict(method="dflash", num_speculative_tokens=3), monkeypatch)


# -- the drafter's cache ------------------------------------------------------------------------

def test_cache_holds_the_targets_features_after_each_round(target, trained):
    """After every round, the drafter's cache up to the round's start equals injecting the
    target's tapped features of the accepted sequence from scratch."""
    check_cache(target, trained["dflash"])


def test_cache_check_fails_without_the_verifiers_features(target, trained, monkeypatch,
                                                          fresh_programs):
    """Control: a drafter that keeps its prefill features instead of the verifier's fails it."""
    monkeypatch.setattr(DFlashProposer, "observe", lambda self, state, start, hidden: state)
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        check_cache(target, trained["dflash"])


def check_cache(target, d):
    multi = 0
    for old, state in greedy_rounds(target, d, DFlashProposer(d.config, 3)):
        length = np.asarray(state.length)
        multi += int(np.sum(length - old >= 2))
        for b in range(len(PROMPTS)):
            seq = jnp.asarray(state.history[b:b + 1])
            n = seq.shape[1]
            _, feats, _ = sj.forward(target, seq, jnp.arange(n)[None],
                                     sj.KVCache.init(target.config, 1, n), taps=d.config.taps)
            ref = dflash.inject(d.config, d.params["weights"], feats,
                                sj.KVCache.init(d.config.layer, 1, n))
            upto = old[b]  # the round injected the features up to slot old - 1
            cache = state.draft_state.cache
            for got, want in ((cache.k, ref.k), (cache.v, ref.v)):
                np.testing.assert_allclose(got[:, b, :, :upto], want[:, 0, :, :upto], rtol=1e-5,
                                           atol=1e-4)
            f = state.draft_state.features
            got = np.asarray(f.feats[b, :length[b] - f.start[b]])
            np.testing.assert_allclose(got, feats[0, f.start[b]:length[b]], rtol=1e-5,
                                       atol=2e-4)  # features run to about 50
    assert multi > 0


# -- distributions ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dflash(models, tmp_path_factory):
    """test_lossless's V = 8 target with a briefly trained block drafter (blocks of up to 4)."""
    target, _ = models
    tokens = samples_of(target, rows=32, length=60)
    return target, train_heads(target, "dflash", tokens, quick(steps=30),
                               tmp_path_factory.mktemp("v8dflash"), block_size=4,
                               progress=False)[0]


@pytest.mark.parametrize("t,k,p", SETTINGS, ids=["T1", "T0.7-topk5-topp0.9"])
@pytest.mark.parametrize("gamma,block", [(2, None), (4, 4)], ids=["gamma2", "gamma4-in-blocks"])
def test_first_three_tokens_follow_the_target(tiny_dflash, monkeypatch, t, k, p, gamma, block):
    """block=4: the target's and the drafter's attention walk their caches in 4-slot blocks."""
    if block is not None:
        monkeypatch.setattr(attention, "BLOCK", block)
    target, d = tiny_dflash
    spec = sj.SpecConfig(method="dflash", num_speculative_tokens=gamma)
    assert first_three_pvalue(target, d, spec, t, k, p) > 1e-3


SMALL_TREE = ((0,), (1,), (0, 0), (1, 0), (0, 1))


@pytest.mark.parametrize("t,k,p", SETTINGS, ids=["T1", "T0.7-topk5-topp0.9"])
def test_tree_first_three_tokens_follow_the_target(tiny_dflash, t, k, p):
    """Sampled trees: each depth's children drawn without replacement from that position's q,
    shared by the nodes of the level, verified by recursive rejection sampling."""
    target, d = tiny_dflash
    spec = sj.SpecConfig(method="dflash", tree=SMALL_TREE)
    assert first_three_pvalue(target, d, spec, t, k, p) > 1e-3


@pytest.mark.parametrize("t,k,p", SETTINGS, ids=["T1", "T0.7-topk5-topp0.9"])
@pytest.mark.parametrize("spec", [dict(num_speculative_tokens=2), dict(tree=SMALL_TREE)],
                         ids=["chain", "tree"])
def test_reporting_the_wrong_q_fails_the_same_test(tiny_dflash, monkeypatch, fresh_programs,
                                                   t, k, p, spec):
    """A block drafter that samples from q but reports a uniform q to the verifier is not
    lossless; the distribution test must see it."""
    target, d = tiny_dflash
    monkeypatch.setattr(DFlashProposer, "propose", reporting_uniform_q(DFlashProposer.propose))
    spec = sj.SpecConfig(method="dflash", **spec)
    assert first_three_pvalue(target, d, spec, t, k, p) < 1e-6


# thresholds at which the trained drafter's rows verify different numbers of drafts (greedy,
# the V = 32 target) and the V = 8 drafter's rows 1 or 2 (T = 0.7, top-k 5)
ADAPTIVE, TINY_ADAPTIVE = 0.02, 0.15


def test_adaptive_lengths_follow_the_target(tiny_dflash, pairs_of_rows):
    """Draft j's confidence is read from position j's distribution, which no draft depends on."""
    target, d = tiny_dflash
    assert adaptive_pvalue(target, d, "dflash", TINY_ADAPTIVE, t=0.7) > 1e-3


def test_lengths_that_look_at_the_drawn_draft_fail_the_same_test(tiny_dflash, monkeypatch,
                                                                 pairs_of_rows):
    target, d = tiny_dflash
    monkeypatch.setattr(dflash, "draw_scored", scoring_the_drawn_token(dflash.draw_scored))
    assert adaptive_pvalue(target, d, "dflash", TINY_ADAPTIVE, t=0.7, lengths_vary=False) < 1e-6


@pytest.mark.parametrize("spec", [dict(num_speculative_tokens=3), dict(tree=SMALL_TREE)],
                         ids=["chain3", "tree"])
def test_later_tokens_follow_the_target_in_a_mixed_batch(tiny_dflash, tail_joints, spec):
    """Tokens 5 and 6 of rows alternating between two prompt lengths: several rounds, so the
    features handed from one verification to the next round's block are in play (with a tree:
    those of the path the verifier took)."""
    target, d = tiny_dflash
    spec = dict(spec)
    out = later_samples(target, d, spec.pop("num_speculative_tokens", None), method="dflash",
                        **spec)
    assert out.stats.per_position_acceptance[1] > 0.02
    assert min(tail_pvalues(out.tokens, tail_joints)) > 1e-3
