"""MTP modules (method="mtp"): training, saving, greedy equality, distributions, their caches,
bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from test_adaptive import pairs_of_rows, scoring_the_drawn_token  # noqa: F401
from test_heads import (
    PROMPTS,
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
from specjax.draft import heads as heads_lib
from specjax.draft import mtp
from specjax.draft.mtp import MTPProposer, MTPState
from specjax.train.data import sample_batch
from specjax.train.heads import HeadsObjective, train_heads

K = 4  # modules


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    """Four MTP modules (a 28-token draft vocabulary of 32) trained briefly on the shared test
    target's own samples."""
    tokens = samples_of(target)
    drafter, evals = train_heads(target, "mtp", tokens, quick(steps=80),
                                 tmp_path_factory.mktemp("mtp"), num_heads=K,
                                 draft_vocab_size=28, heldout=tokens, progress=False)
    return {"tokens": tokens, "mtp": drafter, "evals": evals}


def test_training_reduces_the_loss(target, trained):
    d = trained["mtp"]
    assert d.config.num_heads == K and d.config.max_depth == K
    assert set(d.params["weights"]) == {str(i) for i in range(K)}
    fresh = heads_lib.init_heads(target, "mtp", jax.random.key(0), num_heads=K,
                                 vocab=d.vocab.ids)
    objective = HeadsObjective(fresh.config, target.config)
    aux = {"target": target.params, "vocab": fresh.vocab.ids}
    batch = jnp.asarray(sample_batch(trained["tokens"], 8, 32, 12345, 0))
    before = float(objective(fresh.params["weights"], batch, aux))
    after = float(objective(d.params["weights"], batch, aux))
    assert after < 0.9 * before, (before, after)


def test_save_load_round_trip_and_wrong_target(target, trained, tmp_path):
    d = trained["mtp"]
    sj.save_heads(d, tmp_path / "m", target)
    loaded = sj.load_heads(tmp_path / "m", target)
    assert loaded.config == d.config
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(d.params)):
        np.testing.assert_array_equal(a, b)
    other = tiny_model(seed=7, vocab_size=32, hidden_size=32, layers=2, heads=4, kv_heads=2,
                       max_pos=128)
    with pytest.raises(ValueError, match="trained for another target"):
        sj.load_heads(tmp_path / "m", other)


def test_bad_input_is_refused_by_name(target, trained):
    d = trained["mtp"]
    prompts = [[1, 2, 3]]
    with pytest.raises(ValueError, match="has 4 modules, so it drafts at most 4 tokens deep; "
                                         "got num_speculative_tokens=5"):
        sj.generate(target, prompts, spec=dict(method="mtp", num_speculative_tokens=5), draft=d)
    with pytest.raises(ValueError, match="tree is not supported with method 'mtp'"):
        sj.generate(target, prompts, spec=dict(method="mtp", tree=[[0], [1]]), draft=d)
    with pytest.raises(ValueError, match="method 'mtp' but the heads are 'eagle'"):
        sj.generate(target, prompts, spec=dict(method="mtp"),
                    draft=heads_lib.init_heads(target, "eagle", jax.random.key(0)))
    with pytest.raises(ValueError, match="an sj.Heads"):
        sj.generate(target, prompts, spec=dict(method="mtp"), draft=None)
    with pytest.raises(ValueError, match="a mtp drafter needs num_heads >= 1, got 0"):
        heads_lib.init_heads(target, "mtp", jax.random.key(0), num_heads=0)
    with pytest.raises(ValueError, match="intermediate_size=0"):
        heads_lib.init_heads(target, "mtp", jax.random.key(0), intermediate_size=0)


@pytest.mark.parametrize("gamma", [1, 2, K])
def test_greedy_equals_autoregressive(target, trained, gamma):
    """PROMPTS hold a one-token prompt: modules deeper than the prompt start at position 0."""
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=40)
    ref = sj.generate(target, PROMPTS, sampling=sampling)
    out = sj.generate(target, PROMPTS, sampling=sampling,
                      spec=dict(method="mtp", num_speculative_tokens=gamma),
                      draft=trained["mtp"])
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert out.stats.mean_accepted_length > 1.1, out.stats
    if gamma > 1:  # the deeper modules' drafts are accepted too
        assert out.stats.per_position_acceptance[1] > 0.02, out.stats
    assert out.stats.draft_calls == 1 + out.stats.num_rounds * gamma  # prefill, one per module


def test_greedy_check_fails_when_verification_accepts_everything(target, trained, monkeypatch,
                                                                 fresh_programs):
    assert differs_when_verification_accepts_everything(
        target, trained["mtp"], dict(method="mtp", num_speculative_tokens=3), monkeypatch)


def test_adaptive_greedy_equals_autoregressive(target, trained):
    """Adaptive lengths: rows verify fewer drafts where the modules are unsure, the output stays
    greedy decoding's, and every module still runs every round."""
    stats = adaptive_greedy_stats(target, trained["mtp"], "mtp", K, ADAPTIVE)
    assert stats.draft_calls == 1 + stats.num_rounds * K


# -- the modules' caches ------------------------------------------------------------------------

def test_caches_hold_the_teacher_forced_chain_after_each_round(target, trained):
    """After every round, each module's cache up to its last final entry, and the outputs it
    saved for the next module, equal the chain run from scratch over the accepted sequence with
    the target's own features and the true tokens (what training computes)."""
    check_caches(target, trained["mtp"])


def stale_saved(propose):
    """Broken on purpose: the outputs a module saves for the next round are never updated."""
    def keep(self, params, state, history, length, keys, sampling_params, filters):
        draft, new = propose(self, params, state, history, length, keys, sampling_params,
                             filters)
        return draft, MTPState(new.caches, state.saved, new.features)
    return keep


@pytest.mark.parametrize("broken", ["features", "saved"])
def test_cache_check_fails_with_stale_inputs(target, trained, monkeypatch, fresh_programs,
                                             broken):
    """Controls: modules that keep the prefill's features instead of the verifier's, or that
    never refresh the outputs saved between rounds, leave caches unlike the from-scratch chain
    (the saved outputs themselves are not compared here: the caches must show it)."""
    if broken == "features":
        monkeypatch.setattr(MTPProposer, "observe", lambda self, state, start, hidden: state)
    else:
        monkeypatch.setattr(MTPProposer, "propose", stale_saved(MTPProposer.propose))
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        check_caches(target, trained["mtp"], check_saved=False)


def reference_chain(target, d, seq):
    """The modules over one sequence [n] with true tokens: each module's cache and outputs
    (entry j reads tokens up to j + k only)."""
    n = len(seq)
    seq = jnp.asarray(seq)[None]
    _, h, _ = sj.forward(target, seq, jnp.arange(n)[None], sj.KVCache.init(target.config, 1, n))
    caches, outs = [], []
    for k in range(1, d.config.num_heads + 1):
        tokens = jnp.pad(seq[:, k:], ((0, 0), (0, k)))[:, :n]
        h, cache = heads_lib.eagle_forward(
            d.config, d.params["weights"][str(k - 1)], h, heads_lib.embed(target.params, tokens),
            jnp.arange(n)[None], sj.KVCache.init(d.config.layer, 1, n))
        caches.append(cache)
        outs.append(h[0])
    return caches, outs


def check_caches(target, d, gamma=3, check_saved=True):
    multi = 0
    for old, state in greedy_rounds(target, d, MTPProposer(d.config, gamma)):
        length = np.asarray(state.length)
        multi += int(np.sum(length - old >= 2))
        s = state.draft_state
        for b in range(len(PROMPTS)):
            # the whole history row: causal, so its first entries are those of the accepted
            # text, and one shape serves every row and round (one compile)
            caches, outs = reference_chain(target, d, np.asarray(state.history[b]))
            for k in range(1, gamma + 1):
                upto = max(old[b] - k + 1, 0)  # final entries j <= old - k
                got, want = s.caches[k - 1], caches[k - 1]
                for g, w in ((got.k, want.k), (got.v, want.v)):
                    np.testing.assert_allclose(g[:, b, :, :upto], w[:, 0, :, :upto], rtol=1e-4,
                                               atol=2e-4)
                if check_saved and k < gamma and old[b] - k >= 0:  # module k's output at old - k
                    np.testing.assert_allclose(s.saved[b, k - 1], outs[k - 1][old[b] - k],
                                               rtol=1e-4, atol=2e-4)
    assert multi > 0


# -- distributions ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_mtp(models, tmp_path_factory):
    """test_lossless's V = 8 target with three briefly trained MTP modules."""
    target, _ = models
    tokens = samples_of(target, rows=32, length=60)
    return target, train_heads(target, "mtp", tokens, quick(steps=30),
                               tmp_path_factory.mktemp("v8mtp"), num_heads=3,
                               progress=False)[0]


@pytest.mark.parametrize("t,k,p", SETTINGS, ids=["T1", "T0.7-topk5-topp0.9"])
@pytest.mark.parametrize("gamma,block", [(2, None), (3, 4)], ids=["gamma2", "gamma3-in-blocks"])
def test_first_three_tokens_follow_the_target(tiny_mtp, monkeypatch, t, k, p, gamma, block):
    """block=4: the target's and the modules' attention walk their caches in 4-slot blocks."""
    if block is not None:
        monkeypatch.setattr(attention, "BLOCK", block)
    target, d = tiny_mtp
    spec = sj.SpecConfig(method="mtp", num_speculative_tokens=gamma)
    assert first_three_pvalue(target, d, spec, t, k, p) > 1e-3


@pytest.mark.parametrize("t,k,p", SETTINGS, ids=["T1", "T0.7-topk5-topp0.9"])
def test_reporting_the_wrong_q_fails_the_same_test(tiny_mtp, monkeypatch, fresh_programs,
                                                   t, k, p):
    """Modules that sample from q but report a uniform q to the verifier are not lossless; the
    distribution test must see it."""
    target, d = tiny_mtp
    monkeypatch.setattr(MTPProposer, "propose", reporting_uniform_q(MTPProposer.propose))
    spec = sj.SpecConfig(method="mtp", num_speculative_tokens=2)
    assert first_three_pvalue(target, d, spec, t, k, p) < 1e-6


# a threshold at which the trained modules' rows verify different numbers of drafts (greedy,
# the V = 32 target) and the V = 8 modules' rows 1 or 2 (T = 0.8, top-k 5)
ADAPTIVE, TINY_ADAPTIVE = 0.02, 0.2


def test_adaptive_lengths_follow_the_target(tiny_mtp, pairs_of_rows):
    """Module k's confidence is read from its distribution before its draw."""
    target, d = tiny_mtp
    assert adaptive_pvalue(target, d, "mtp", TINY_ADAPTIVE) > 1e-3


def test_lengths_that_look_at_the_drawn_draft_fail_the_same_test(tiny_mtp, monkeypatch,
                                                                 pairs_of_rows):
    target, d = tiny_mtp
    monkeypatch.setattr(mtp, "draw_scored", scoring_the_drawn_token(mtp.draw_scored))
    assert adaptive_pvalue(target, d, "mtp", TINY_ADAPTIVE, lengths_vary=False) < 1e-6


def test_later_tokens_follow_the_target_in_a_mixed_batch(tiny_mtp, tail_joints):
    """Tokens 5 and 6 of rows alternating between two prompt lengths: several rounds, so the
    states handed between rounds (features, saved module outputs) are in play."""
    target, d = tiny_mtp
    out = later_samples(target, d, 3, method="mtp")
    assert out.stats.per_position_acceptance[1] > 0.02
    assert min(tail_pvalues(out.tokens, tail_joints)) > 1e-3
