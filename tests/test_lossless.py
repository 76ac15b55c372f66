"""End to end: the joint distribution of the first three generated tokens equals the target's.

Tens of thousands of rows share one prompt; each row is an independent sample (its own key). The
exact target distribution is built from sj.logits and the numpy reference of the sampling
filters. A G-test compares the two; deliberately broken acceptance rules must fail the same test.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import perturbed, ref_process, tiny_config, tiny_model
from scipy import stats as scipy_stats

import specjax as sj
from specjax import attention, engine, sampling, verify
from specjax.draft import draft_model

# 24,576 rows: every deliberately broken variant in the suite fails its G-test at p < 1e-6 with
# this many (most at p = 0 in float64), except one subtle one that takes more rows (``rows=``
# below; test_adaptive.py's drawn-draft scoring at T = 0.7). 24,576 is a batch bucket
# (specjax.engine.bucket): 25,000 rows ran padded to 32,768, a third more work for nothing.
V, N, PROMPT = 8, 24576, [1, 2, 3]


@pytest.fixture(scope="session")  # shared by the files that import it, as is tail_joints
def models():
    """The target, a close draft (the target with perturbed weights: about half the drafts are
    accepted, so accepted, recovered and bonus tokens all occur often) and a small independent
    draft of another shape (rarely accepted: mostly recovered tokens)."""
    target = tiny_model(seed=10, vocab_size=V, hidden_size=16, layers=2)
    close = sj.Model(target.config, perturbed(target.params, 12, 0.02))
    small = tiny_model(seed=11, vocab_size=V, hidden_size=8, layers=1, heads=1)
    return target, {"close": close, "small": small}


def exact_joint(target, t, k, p, prompt=PROMPT):
    """P(t1, t2, t3 | prompt) [V, V, V] under autoregressive sampling from the target."""
    prefixes = np.array([prompt + [a, b] for a, b in itertools.product(range(V), repeat=2)])
    logits = np.asarray(sj.logits(target, jnp.asarray(prefixes)), np.float64)  # [V*V, 5, V]
    n = len(prompt)
    p1 = ref_process(logits[0, n - 1], t, k, p)
    p2 = ref_process(logits[::V, n], t, k, p)  # [V(t1), V]
    p3 = ref_process(logits[:, n + 1], t, k, p).reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def pooled_pvalue(counts, probs):
    """p-value of a G-test of cell counts against cell probabilities (both flat), after
    asserting that no cell of probability 0 was drawn at all (filtered by top-k or top-p: one
    such draw is a broken rule, however few, so it is not left to the pooled statistic); the
    other cells expected fewer than 5 times are pooled into one."""
    zero = probs == 0
    assert counts[zero].sum() == 0, (
        f"{int(counts[zero].sum())} draws of token sequences with probability 0 (cells "
        f"{np.flatnonzero(zero & (counts > 0))[:8].tolist()})")
    counts, expected = counts[~zero], probs[~zero] * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if not small.any():
        obs, exp = obs[:-1], exp[:-1]
    return scipy_stats.power_divergence(obs, exp, lambda_="log-likelihood").pvalue


def g_test(samples, joint):
    """p-value of a G-test of samples [N, 3] against joint (``pooled_pvalue``)."""
    counts = np.zeros(V ** 3)
    np.add.at(counts, samples[:, 0] * V * V + samples[:, 1] * V + samples[:, 2], 1)
    return pooled_pvalue(counts, joint.ravel())


def tight_capacity(longest, max_new, spec):
    """The fewest cache slots a request needs: tens of thousands of rows run at that capacity
    (as a server fixes max_cache_len), not at the smallest tier."""
    spec = sj.SpecConfig.parse(spec)
    gamma = 0 if spec is None else (len(spec.tree) if spec.tree else spec.num_speculative_tokens)
    return longest + max_new + gamma


def sample_rows(target, draft, sampling, spec, seed=0, prompt=PROMPT, rows=N):
    """``rows`` copies of ``prompt`` sampled with ``spec``: the whole Generation (its stats say
    what the rounds proposed, in the same run whose tokens a test checks)."""
    out = sj.generate(target, [prompt] * rows, sampling=sampling, spec=spec, draft=draft,
                      key=seed,
                      max_cache_len=tight_capacity(len(prompt), sampling.max_new_tokens, spec))
    assert (out.lengths == 3).all()
    if spec is not None:
        assert out.stats.proposed_tokens > rows // 4  # speculation really happened
        assert out.stats.accepted_tokens > rows // 50
    return out


def generate_samples(target, draft, sampling, spec, seed=0, prompt=PROMPT, rows=N):
    return sample_rows(target, draft, sampling, spec, seed, prompt, rows).tokens


SETTINGS = [(1.0, 0, 1.0), (0.7, 5, 0.9)]


def first_three_pvalue(target, draft, spec, t, k, p, rows=N, *, with_stats=False):
    """The G-test p-value of the first three tokens sampled (``rows`` samples) with ``spec`` at
    temperature t, top-k k, top-p p against their exact joint distribution under the target;
    with_stats: (p-value, the sampling run's Stats)."""
    sampling = sj.SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=3)
    out = sample_rows(target, draft, sampling, spec, rows=rows)
    pvalue = g_test(out.tokens, exact_joint(target, t, k, p))
    return (pvalue, out.stats) if with_stats else pvalue


NGRAM = dict(method="ngram", prompt_lookup_min=1, prompt_lookup_max=2)


def ngram_prompt(target):
    """A prompt built so that lookups match and are often accepted: PROMPT, the target's greedy
    continuation of it, then PROMPT again (whose earlier occurrence is followed by that
    continuation)."""
    greedy = sj.generate(target, [PROMPT], sampling=sj.SamplingParams(temperature=0,
                                                                      max_new_tokens=4))
    return PROMPT + [int(x) for x in greedy.tokens[0]] + PROMPT


def test_the_g_test_refuses_any_draw_of_probability_zero():
    """A few draws of sequences the filters give probability 0, among many drawn right, fail
    the test by themselves; pooled with the rare cells (as before), a G-test passed them."""
    rng = np.random.default_rng(0)
    joint = rng.random(V ** 3) ** 4 * (rng.random(V ** 3) < 0.3)  # most cells filtered out
    joint /= joint.sum()
    n = 24_576
    counts = rng.multinomial(n, joint).astype(float)
    assert pooled_pvalue(counts, joint) > 1e-3
    zero = np.flatnonzero(joint == 0)
    counts[rng.choice(zero, 20, replace=False)] += 1
    with pytest.raises(AssertionError, match="20 draws of token sequences with probability 0"):
        pooled_pvalue(counts, joint)
    expected = joint * counts.sum()
    small = expected < 5  # the pooling before: the 20 draws hide among the rare cells
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    assert scipy_stats.power_divergence(obs, exp, lambda_="log-likelihood").pvalue > 1e-3


@pytest.mark.parametrize("t,k,p", SETTINGS, ids=["T1", "T0.7-topk5-topp0.9"])
@pytest.mark.parametrize("gamma,which", [(None, None), (2, "close"), (3, "close"), (3, "small"),
                                         (2, "ngram"), (3, "ngram-factor")],
                         ids=["autoregressive", "gamma2-close", "gamma3-close", "gamma3-small",
                              "ngram", "ngram-factor"])
def test_first_three_tokens_follow_the_target(models, t, k, p, gamma, which):
    target, drafts = models
    draft = drafts.get(which)
    sampling = sj.SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=3)
    # ngram-factor: a match of n <= 2 tokens proposes at most n of the 3, so every round's
    # draft is cut short by the length factor
    lookup = {"ngram": NGRAM, "ngram-factor": dict(NGRAM, prompt_lookup_length_factor=1.0)}
    spec = None if gamma is None else sj.SpecConfig(num_speculative_tokens=gamma,
                                                    **lookup.get(which, {}))
    prompt = ngram_prompt(target) if which in lookup else PROMPT
    joint = exact_joint(target, t, k, p, prompt)
    samples = generate_samples(target, draft, sampling, spec, prompt=prompt)
    assert g_test(samples, joint) > 1e-3


@pytest.mark.parametrize("gamma,which", [(3, "close"), (2, "ngram")])
def test_first_three_tokens_follow_the_target_with_attention_in_blocks(models, monkeypatch, gamma,
                                                                       which):
    """The same test with 4-slot attention blocks: every round walks several blocks."""
    monkeypatch.setattr(attention, "BLOCK", 4)
    target, drafts = models
    t, k, p = SETTINGS[1]
    sampling = sj.SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=3)
    spec = sj.SpecConfig(num_speculative_tokens=gamma, **(NGRAM if which == "ngram" else {}))
    prompt = ngram_prompt(target) if which == "ngram" else PROMPT
    samples = generate_samples(target, drafts.get(which), sampling, spec, prompt=prompt)
    assert g_test(samples, exact_joint(target, t, k, p, prompt)) > 1e-3


# bfloat16 on XLA's CPU backend rounds differently once a matmul is large: the tiny target's
# logits over 640 or more rows differ from those over 64 by up to 0.19, while forwards of 1 to
# 5 tokens over 64 rows agree bit for bit. The reference enumerates 64 prefixes, so the sampler
# runs 64 rows a call, and both see the same target.
HALF_BATCH = 64


@pytest.fixture(scope="module")
def half_models(models):
    """The same target and close draft computing in bfloat16 (probabilities stay float32)."""
    target, drafts = models
    return (sj.checkpoint.cast(target, "bfloat16"),
            {"close": sj.checkpoint.cast(drafts["close"], "bfloat16")})


# Both settings for the draft model; the autoregressive and n-gram programs at the one with
# every filter on (their float32 twins run at both; each case here is 625 calls).
@pytest.mark.parametrize("t,k,p,gamma,which", [
    (*SETTINGS[0], 3, "close"), (*SETTINGS[1], 3, "close"), (*SETTINGS[1], None, None),
    (*SETTINGS[1], 2, "ngram"), (*SETTINGS[1], "tree", "close")],
    ids=["T1-gamma3-close", "T0.7-topk5-topp0.9-gamma3-close", "T0.7-topk5-topp0.9-autoregressive",
         "T0.7-topk5-topp0.9-ngram", "T0.7-topk5-topp0.9-tree-close"])
def test_bfloat16_models_follow_the_target(half_models, t, k, p, gamma, which):
    """bfloat16 models: the sample follows the bfloat16 target's own distribution (its logits
    from a full forward; a verify forward rounds a little differently, far below what the test
    can see). The tree: sampled candidates verified under the tree's attention mask."""
    target, drafts = half_models
    sampling = sj.SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=3)
    spec = None if gamma is None else sj.SpecConfig(
        **({"tree": ((0,), (1,), (0, 0), (0, 0, 0))} if gamma == "tree"
           else {"num_speculative_tokens": gamma}), **(NGRAM if which == "ngram" else {}))
    prompt = ngram_prompt(target) if which == "ngram" else PROMPT
    samples = small_batch_samples(target, drafts.get(which), sampling, spec, prompt)
    assert g_test(samples, exact_joint(target, t, k, p, prompt)) > 1e-3


def small_batch_samples(target, draft, sampling, spec, prompt=PROMPT, batch=HALF_BATCH):
    """N samples from calls of ``batch`` rows each, every call with its own key."""
    capacity = tight_capacity(len(prompt), sampling.max_new_tokens, spec)
    outs = [sj.generate(target, [prompt] * batch, sampling=sampling, spec=spec, draft=draft,
                        key=i, max_cache_len=capacity) for i in range(N // batch)]
    assert all((o.lengths == 3).all() for o in outs)
    if spec is not None:
        assert sum(o.stats.accepted_tokens for o in outs) > N // 50
    return np.concatenate([o.tokens for o in outs])


def fails_the_g_test(target, draft, setting, gamma, samples=None) -> None:
    """A (deliberately broken) chain of ``gamma`` drafts at ``setting`` (t, k, p) fails the
    first-three-tokens G-test: p < 1e-6. ``samples``: generate_samples or small_batch_samples."""
    t, k, p = setting
    sampling = sj.SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=3)
    got = (samples or generate_samples)(target, draft, sampling,
                                        sj.SpecConfig(num_speculative_tokens=gamma))
    assert g_test(got, exact_joint(target, t, k, p)) < 1e-6


def test_a_broken_rule_fails_the_bfloat16_test(half_models, monkeypatch, fresh_programs):
    target, drafts = half_models
    monkeypatch.setattr(verify, "acceptance_probs", _sqrt_acceptance)
    fails_the_g_test(target, drafts["close"], SETTINGS[0], 3, small_batch_samples)


def _recover_from_p(draft_tokens, draft_probs, target_probs, valid=None):
    return target_probs  # on rejection, draw from p instead of the residual max(0, p - q)


def _sqrt_acceptance(draft_tokens, draft_probs, target_probs, valid=None):
    # accept with probability sqrt(p(d)), ignoring q: accepts too often
    return verify._draft_token_probs(target_probs[:, :draft_tokens.shape[1]], draft_tokens) ** 0.5


@pytest.mark.parametrize("broken", ["recover_from_p", "sqrt_acceptance"])
@pytest.mark.parametrize("t,k,p", SETTINGS, ids=["T1", "T0.7-topk5-topp0.9"])
def test_broken_rules_fail_the_same_test(models, monkeypatch, fresh_programs, broken, t, k, p):
    target, drafts = models
    if broken == "recover_from_p":
        monkeypatch.setattr(verify, "recovery_probs", _recover_from_p)
    else:
        monkeypatch.setattr(verify, "acceptance_probs", _sqrt_acceptance)
    fails_the_g_test(target, drafts["close"], (t, k, p), 2)


_honest_draw_scored = draft_model.draw_scored


def _q_without_filters(logits, key, sampling_params, filters, vocab=None, *, scored=True):
    """Drafts drawn from the filtered q, but the q reported is the temperature's alone (no top-k,
    no top-p): the verifier checks them against a distribution they were not drawn from."""
    index, q, score = _honest_draw_scored(logits, key, sampling_params, filters, vocab,
                                          scored=scored)
    if q is not None:
        q = sampling.process_logits(logits, sampling_params, sampling.Filters())
    return index, q, score


def _draft_keys_twice(keys, step):
    draft_keys, _ = _honest_round_keys(keys, step)
    return draft_keys, draft_keys  # the verifier's uniforms are the draft's own draws' numbers


@pytest.mark.parametrize("broken", ["q_without_filters", "draft_keys_verify"])
def test_a_q_or_key_that_is_not_what_the_draft_used_fails_the_same_test(
        models, monkeypatch, fresh_programs, broken):
    """Two PITFALLS kept as tests: a draft model reporting q before top-k/top-p while drawing
    after them, and a round verifying with the random numbers it drafted with. Both fail the
    first-three-tokens G-test at T = 0.7 with top-k 5 and top-p 0.9."""
    target, drafts = models
    if broken == "q_without_filters":
        monkeypatch.setattr(draft_model, "draw_scored", _q_without_filters)
        monkeypatch.setattr(draft_model, "draw", lambda *a, **kw: _q_without_filters(
            *a, **kw, scored=False)[:2])
    else:
        monkeypatch.setattr(engine, "round_keys", _draft_keys_twice)
    fails_the_g_test(target, drafts["close"], SETTINGS[1], 2)


@pytest.fixture(scope="module")
def gemma2_like():
    """A target with Gemma 2's features: soft-capped attention scores and logits (caps that bite:
    the weights are large), a 2-token window on its first layer and full attention on its second,
    sandwich norms with a unit offset, scaled embeddings, GeGLU, its own query scale; and a close
    draft (the same model perturbed)."""
    cfg = tiny_config(vocab_size=V, hidden_size=16, layers=2, sliding_window=2,
                      layer_types=("sliding_attention", "full_attention"),
                      attn_logit_softcapping=1.5, final_logit_softcapping=2.5,
                      query_pre_attn_scalar=5.0, sandwich_norms=True, norm_unit_offset=True,
                      scale_embeddings=True, hidden_act="gelu_pytorch_tanh")
    target = sj.init_model(cfg, jax.random.key(20), init_std=0.5)
    close = sj.Model(cfg, perturbed(target.params, 21, 0.02))
    return target, close


@pytest.mark.parametrize("which,t,k,p", [("close", *SETTINGS[0]), ("close", *SETTINGS[1]),
                                         ("ngram", *SETTINGS[1]), ("tree", *SETTINGS[1])],
                         ids=["close-T1", "close-T0.7-topk5-topp0.9", "ngram-T0.7-topk5-topp0.9",
                              "tree-T0.7-topk5-topp0.9"])
def test_a_soft_capped_sliding_window_target_is_followed(gemma2_like, t, k, p, which):
    """Within three tokens of a three-token prompt the window already hides keys, and both caps
    change every distribution (checked: without them the exact joint differs). The tree is
    deeper than the window. (Rings, which a sliding layer keeps past 64 + window slots, sample
    exactly what the whole cache samples: tests/test_ring.py.)"""
    target, close = gemma2_like
    sampling = sj.SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=3)
    spec = sj.SpecConfig(num_speculative_tokens=2, **(NGRAM if which == "ngram" else {}))
    if which == "tree":
        spec = sj.SpecConfig(tree=((0,), (1,), (0, 0), (1, 0), (0, 0, 0)))
    prompt = ngram_prompt(target) if which == "ngram" else PROMPT
    joint = exact_joint(target, t, k, p, prompt)
    plain = sj.Model(dataclasses.replace(target.config, attn_logit_softcapping=None,
                                         final_logit_softcapping=None, layer_types=None,
                                         sliding_window=None), target.params)
    assert np.abs(exact_joint(plain, t, k, p, prompt) - joint).max() > 1e-3
    samples = generate_samples(target, None if which == "ngram" else close, sampling, spec,
                               prompt=prompt)
    assert g_test(samples, joint) > 1e-3


def test_a_broken_rule_fails_the_soft_capped_target_test(gemma2_like, monkeypatch,
                                                         fresh_programs):
    target, close = gemma2_like
    monkeypatch.setattr(verify, "acceptance_probs", _sqrt_acceptance)
    sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=3)
    samples = generate_samples(target, close, sampling, sj.SpecConfig(num_speculative_tokens=2))
    assert g_test(samples, exact_joint(target, 1.0, 0, 1.0)) < 1e-6


# Later tokens: six new tokens need several rounds, so target-cache rollback, the draft's catch-up
# after a fully accepted round and per-row progress in a batch of mixed prompt lengths all shape
# the sample. Rows alternate between two prompts of different lengths.
PROMPTS = ([1, 2, 3], [4, 5, 6, 7, 1, 2])
LATER = dict(temperature=0.9, top_k=6)


def exact_tail_joint(target, prompt, t, k):
    """P(t5, t6 | prompt) [V, V] under autoregressive sampling, by enumerating t1..t5."""
    n = len(prompt)
    seqs = np.array([prompt + list(s) for s in itertools.product(range(V), repeat=5)])
    logits = np.asarray(sj.logits(target, jnp.asarray(seqs)), np.float64)  # [V^5, n+5, V]
    probs = ref_process(logits[:, n - 1:], t, k)  # [V^5, 6, V]: p(t_i | t_<i) for i = 1..6
    steps = [probs[:, i][np.arange(len(seqs)), seqs[:, n + i]] for i in range(5)]
    prefix = np.prod(steps, axis=0)  # P(t1..t5) for each enumerated row
    joint = np.zeros((V, V))
    np.add.at(joint, seqs[:, n + 4], prefix[:, None] * probs[:, 5])
    return joint


def tail_pvalues(samples, joints):
    pvalues = []
    for i, joint in enumerate(joints):
        rows = samples[i::2]
        counts = np.zeros(V * V)
        np.add.at(counts, rows[:, 4] * V + rows[:, 5], 1)
        pvalues.append(pooled_pvalue(counts, joint.ravel()))
    return pvalues


def later_samples(target, draft, gamma, seed=1, slack=0, rows=N, **spec):
    """``rows`` rows alternating between PROMPTS, 6 new tokens each, at the fewest cache slots
    the request needs (plus ``slack``, for proposers that keep slots of their own)."""
    sampling = sj.SamplingParams(max_new_tokens=6, **LATER)
    spec = sj.SpecConfig(num_speculative_tokens=gamma, **spec)
    out = sj.generate(target, [list(PROMPTS[i % 2]) for i in range(rows)], sampling=sampling,
                      spec=spec, draft=draft, key=seed,
                      max_cache_len=tight_capacity(max(map(len, PROMPTS)), 6, spec) + slack)
    assert (out.lengths == 6).all() and out.stats.num_rounds >= 3
    return out


@pytest.fixture(scope="session")  # an enumeration of 32,768 sequences, done once a worker
def tail_joints(models):
    target, _ = models
    return [exact_tail_joint(target, list(p), LATER["temperature"], LATER["top_k"])
            for p in PROMPTS]


@pytest.mark.parametrize("gamma,block", [(1, None), (3, 4)])
def test_later_tokens_follow_the_target_in_a_mixed_batch(models, tail_joints, monkeypatch, gamma,
                                                         block):
    if block is not None:  # rows of different lengths walk different numbers of blocks
        monkeypatch.setattr(attention, "BLOCK", block)
    target, drafts = models
    out = later_samples(target, drafts["close"], gamma)
    if gamma == 3:  # fully accepted rounds (and so the draft's catch-up) must occur often
        assert out.stats.per_position_acceptance[-1] > 0.05
    assert min(tail_pvalues(out.tokens, tail_joints)) > 1e-3


def test_bfloat16_later_tokens_follow_the_target(half_models):
    """Tokens 5 and 6 of a mixed batch over several rounds with the bfloat16 target and close
    draft (calls of HALF_BATCH rows, as the bfloat16 cases above; N / 2 rows in all, a call
    costs more than a row), against the bfloat16 target's exact joint: its caches, written and
    rolled back in bfloat16 across rounds."""
    target, drafts = half_models
    joints = [exact_tail_joint(target, list(p), LATER["temperature"], LATER["top_k"])
              for p in PROMPTS]
    outs = [later_samples(target, drafts["close"], 3, seed=i, rows=HALF_BATCH)
            for i in range(N // 2 // HALF_BATCH)]
    assert np.mean([o.stats.per_position_acceptance[-1] for o in outs]) > 0.05
    assert min(tail_pvalues(np.concatenate([o.tokens for o in outs]), joints)) > 1e-3


def test_later_tokens_with_ngram_drafts_in_a_mixed_batch(models, tail_joints):
    target, _ = models
    out = later_samples(target, None, 3, **NGRAM)
    assert 0 < out.stats.proposal_rate < 1 and out.stats.accepted_tokens > 0
    assert min(tail_pvalues(out.tokens, tail_joints)) > 1e-3


def _same_keys_every_round(keys, step):
    return _honest_round_keys(keys, step * 0)


_honest_round_keys = engine.round_keys


def test_reused_round_keys_fail_the_later_token_test(models, tail_joints, monkeypatch,
                                                     fresh_programs):
    """The PITFALL "the same random number reused across rounds" must not pass unnoticed."""
    target, drafts = models
    monkeypatch.setattr(engine, "round_keys", _same_keys_every_round)
    out = later_samples(target, drafts["close"], 1)
    assert min(tail_pvalues(out.tokens, tail_joints)) < 1e-6


_honest_recovery = verify.recovery_probs


def _recovery_ignoring_valid(draft_tokens, draft_probs, target_probs, valid=None):
    return _honest_recovery(draft_tokens, draft_probs, target_probs)  # as if all were proposed


def test_ngram_with_broken_partial_draft_handling_fails(models, monkeypatch, fresh_programs):
    target, _ = models
    monkeypatch.setattr(verify, "recovery_probs", _recovery_ignoring_valid)
    prompt = ngram_prompt(target)
    sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=3)
    samples = generate_samples(target, None, sampling,
                               sj.SpecConfig(num_speculative_tokens=2, **NGRAM), prompt=prompt)
    assert g_test(samples, exact_joint(target, 1.0, 0, 1.0, prompt)) < 1e-6


def eos_joint(joint, eos):
    """The joint of the first three tokens when ``eos`` ends a row: [V + 1] ** 3, index V for a
    position after the row ended (the tokens -1 there)."""
    out = np.zeros((V + 1,) * 3)
    for seq in itertools.product(range(V), repeat=3):
        cut = seq.index(eos) + 1 if eos in seq else 3
        out[seq[:cut] + (V,) * (3 - cut)] += joint[seq]
    return out


def _eos_checked_last_only(real):
    def emit(state, tokens, num_accepted, request):  # accepted drafts are not checked for EOS
        history = real(state, tokens, num_accepted, request)[2]
        drafts = jnp.arange(tokens.shape[1])[None, :] < num_accepted[:, None]
        n_emit, hit_eos, _ = real(state, jnp.where(drafts, V + 7, tokens), num_accepted, request)
        return n_emit, hit_eos, history
    return emit


@pytest.mark.parametrize("broken", [False, True], ids=["eos", "eos-checked-last-only"])
def test_rows_that_end_at_eos_follow_the_target(models, monkeypatch, fresh_programs, broken):
    """Rows that stop at an EOS token, which the drafts propose and the rounds accept among
    their tokens: the first three positions (empty after the EOS) follow the target's joint
    with every row ended at its first EOS. Deliberately broken, a round that checks only its
    last token for EOS (an accepted draft's EOS let through, the row going on) fails."""
    target, drafts = models
    if broken:
        monkeypatch.setattr(engine, "_emit", _eos_checked_last_only(engine._emit))
    joint = exact_joint(target, 1.0, 0, 1.0)
    # the id whose ending at position 2 (after an accepted draft, or recovered) is likeliest
    eos = max(range(V), key=lambda e: eos_joint(joint, e)[:V, e, V].sum())
    spec = sj.SpecConfig(num_speculative_tokens=3)
    sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=3, eos_token_id=eos)
    out = sj.generate(target, [PROMPT] * N, sampling=sampling, spec=spec, draft=drafts["close"],
                      key=5, max_cache_len=tight_capacity(len(PROMPT), 3, spec))
    tokens = np.where(out.tokens < 0, V, out.tokens)
    assert 0.1 < (out.lengths < 3).mean() < 0.9 and (out.lengths == 2).mean() > 0.05
    assert out.stats.accepted_tokens > N // 4
    counts = np.zeros((V + 1) ** 3)
    np.add.at(counts, (tokens[:, 0] * (V + 1) + tokens[:, 1]) * (V + 1) + tokens[:, 2], 1)
    expected = eos_joint(joint, eos).ravel()
    if broken:
        with pytest.raises(AssertionError, match="probability 0"):
            pooled_pvalue(counts, expected)
    else:
        assert pooled_pvalue(counts, expected) > 1e-3
