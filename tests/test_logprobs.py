"""SamplingParams.logprobs: for every emitted token, the target's log-probability of it and its
top-k alternatives, equal (to float tolerance) to a teacher-forced full forward over the output,
for autoregressive decoding and every verification path (chain, n-gram lengths, tree), greedy
and sampled, raw and processed; a variant that reads the wrong position fails."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ref_process, verification_paths

import specjax as sj
from specjax import engine

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
NEW, K = 14, 3


def reference(target, prompt, tokens, mode="raw", t=1.0, k=0, p=1.0):
    """Teacher-forced: log-probabilities [n] of the generated tokens and the top-K of each
    position's distribution [n, K], from sj.logits over prompt + output (float64)."""
    seq = np.asarray(list(prompt) + list(tokens))
    logits = np.asarray(sj.logits(target, jnp.asarray(seq[None])), np.float64)[0]
    at = logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]
    if mode == "raw" or t == 0:  # a greedy row's processed logprobs are the raw ones
        lp = at - at.max(-1, keepdims=True)
        lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    else:
        with np.errstate(divide="ignore"):
            lp = np.log(ref_process(at, t, k, p))
    return lp[np.arange(len(tokens)), tokens], np.sort(lp, axis=-1)[:, ::-1][:, :K], lp


def check(target, out, mode="raw", t=1.0, k=0, p=1.0):
    # float32 logits of a teacher-forced forward and the loop's differ by ~1e-6; processed at a
    # temperature below 1, by that over T
    atol = 2e-4 / (t if mode == "processed" and 0 < t < 1 else 1)
    for b, prompt in enumerate(PROMPTS):
        n = int(out.lengths[b])
        token, top, lp = reference(target, prompt, out.tokens[b, :n], mode, t, k, p)
        got = out.logprobs
        np.testing.assert_allclose(got.token[b, :n], token, atol=atol)
        np.testing.assert_allclose(got.top[b, :n], top, atol=atol)
        # the ids name those values (ties aside: compare the values the ids point at)
        picked = np.take_along_axis(lp, got.top_ids[b, :n], axis=1)
        np.testing.assert_allclose(picked, top, atol=atol)
        assert np.isnan(got.token[b, n:]).all() and (got.top_ids[b, n:] == -1).all()


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["autoregressive", "chain", "ngram", "tree",
                                    "lookahead", "suffix"])
def test_raw_logprobs_equal_a_teacher_forced_forward(target, draft, method, temperature):
    spec, d = verification_paths(draft)[method]
    out = sj.generate(target, PROMPTS, spec=spec, draft=d, key=2, sampling=sj.SamplingParams(
        temperature=temperature, max_new_tokens=NEW, logprobs=K, eos_token_id=7))
    assert out.logprobs.top_ids.shape == (len(PROMPTS), NEW, K)
    check(target, out)
    if spec is not None:
        assert out.stats.accepted_tokens > 0


def test_processed_logprobs_are_those_drawn_from(target, draft):
    t, k, p = 0.7, 5, 0.9
    out = sj.generate(target, PROMPTS, spec=sj.SpecConfig(num_speculative_tokens=3), draft=draft,
                      key=5, sampling=sj.SamplingParams(temperature=t, top_k=k, top_p=p,
                                                        max_new_tokens=NEW, logprobs=K,
                                                        logprobs_mode="processed"))
    check(target, out, "processed", t, k, p)
    assert np.isfinite(out.logprobs.token[:, 0]).all()  # drawn tokens are never filtered out


@pytest.mark.parametrize("t,k,p", [(0.02, 0, 1.0), (0.05, 5, 0.9), (0.0, 0, 1.0)],
                         ids=["T0.02", "T0.05-topk5-topp0.9", "greedy"])
def test_processed_logprobs_keep_probabilities_below_float32s_range(target, draft, t, k, p):
    """At a low temperature most alternatives' processed probabilities (e^-100 and less) are
    0 in float32: their logprobs are still their values (computed from the scaled logits), not
    -inf, and the top ids rank them as the model does. A greedy row, whose token is no draw,
    reports the model's own distribution."""
    out = sj.generate(target, PROMPTS, spec=sj.SpecConfig(num_speculative_tokens=3), draft=draft,
                      key=5, sampling=sj.SamplingParams(temperature=t, top_k=k, top_p=p,
                                                        max_new_tokens=NEW, logprobs=K,
                                                        logprobs_mode="processed"))
    check(target, out, "processed", t, k, p)
    if k == 0:
        assert np.isfinite(out.logprobs.top[:, 0]).all()
    if t == 0.02:
        assert (out.logprobs.top[:, 0, -1] < -104).all()  # below float32's smallest probability


def test_greedy_speculation_gives_autoregressive_logprobs(target, draft):
    sampling = sj.SamplingParams(temperature=0, max_new_tokens=NEW, logprobs=K)
    ar = sj.generate(target, PROMPTS, sampling=sampling)
    for spec, d in list(verification_paths(draft).values())[1:]:
        out = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=d)
        np.testing.assert_array_equal(out.tokens, ar.tokens)
        np.testing.assert_allclose(out.logprobs.token, ar.logprobs.token, atol=2e-5)
        np.testing.assert_allclose(out.logprobs.top, ar.logprobs.top, atol=2e-5)


def test_logprobs_of_the_wrong_position_fail(target, draft, monkeypatch, fresh_programs):
    """Broken on purpose: each token given the distribution one position later."""
    real = engine._logprobs

    def shifted(plan, request, logits, tokens):
        return real(plan, request, jnp.roll(logits, -1, axis=1), tokens)
    monkeypatch.setattr(engine, "_logprobs", shifted)
    out = sj.generate(target, PROMPTS, spec=sj.SpecConfig(num_speculative_tokens=3),
                      draft=draft, sampling=sj.SamplingParams(temperature=0, max_new_tokens=NEW,
                                                              logprobs=K))
    with pytest.raises(AssertionError):
        check(target, out)


def test_streamed_logprobs_and_no_recompile_for_other_values(target, draft):
    spec = sj.SpecConfig(num_speculative_tokens=3)
    sampling = sj.SamplingParams(temperature=0.9, max_new_tokens=NEW, logprobs=K)
    out = sj.generate(target, PROMPTS, spec=spec, draft=draft, key=1, sampling=sampling)
    last = list(sj.stream(target, PROMPTS, spec=spec, draft=draft, key=1,
                          sampling=sampling))[-1].generation
    np.testing.assert_array_equal(last.logprobs.top_ids, out.logprobs.top_ids)
    np.testing.assert_array_equal(last.logprobs.token, out.logprobs.token)
    plain = sj.generate(target, PROMPTS, spec=spec, draft=draft, key=1,
                        sampling=sj.SamplingParams(temperature=0.9, max_new_tokens=NEW))
    assert plain.logprobs is None
    np.testing.assert_array_equal(plain.tokens, out.tokens)  # logprobs change no token


def test_bad_logprobs_settings_are_refused_by_name():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="logprobs must be an int"):
            sj.SamplingParams(logprobs=bad)
    with pytest.raises(ValueError, match="logprobs_mode must be 'raw' or 'processed'"):
        sj.SamplingParams(logprobs=1, logprobs_mode="logits")
