"""Bring your own proposer: docs/custom-proposers.md's example runs as written, stays lossless
(greedy equality, exact-enumeration distribution test), and a dishonest q fails the same test.
Also: the method registry, bad proposers refused before compiling, and a rider that offers fewer
than γ drafts in some rows."""

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_lossless import (
    PROMPT,
    N,
    exact_joint,
    g_test,
    models,  # noqa: F401  (the fixture: an 8-token target and drafts)
)

import specjax as sj
from specjax.draft.medusa import MedusaProposer

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "custom-proposers.md"
GREEDY = sj.SamplingParams(temperature=0, max_new_tokens=24)
PROMPTS = [[1, 5, 9], [2], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]]


def doc_example() -> dict:
    """The classes the guide defines, from its first python block, executed as written."""
    block = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    scope: dict = {}
    exec(compile(block, str(DOC), "exec"), scope)
    return scope


EXAMPLE = doc_example()
RepeatLast, FixedQ = EXAMPLE["RepeatLast"], EXAMPLE["FixedQ"]


@dataclasses.dataclass(frozen=True)
class ClaimsUniformQ(FixedQ):
    """Broken on purpose: samples from q but tells the verifier q is uniform."""

    def propose(self, q, state, history, length, keys, sampling, filters):
        draft, state = super().propose(q, state, history, length, keys, sampling, filters)
        uniform = jnp.full(draft.probs.shape, 1.0 / draft.probs.shape[-1])
        return sj.draft.Draft(draft.tokens, uniform), state


SKEWED = jnp.asarray([0.4, 0.25, 0.1, 0.1, 0.05, 0.05, 0.03, 0.02])  # q over the V = 8 ids


def test_the_guide_shows_runnable_calls():
    """The guide's second block (generate with proposer=) runs as written too."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    scope = dict(EXAMPLE)
    exec(compile(blocks[1], str(DOC), "exec"), scope)
    out = scope["out"]  # FixedQ's, sampled: its drafts were verified, some accepted
    assert out.tokens.shape == (1, 64) and out.stats.proposed_tokens > 0
    assert 0 < out.stats.acceptance_rate <= 1
    # the block's greedy call gives what autoregressive decoding gives on the block's target
    target, greedy = scope["target"], scope["greedy"]
    got = sj.generate(target, [[1, 2, 3]], sampling=greedy, proposer=scope["RepeatLast"](gamma=3))
    np.testing.assert_array_equal(got.tokens, sj.generate(target, [[1, 2, 3]],
                                                          sampling=greedy).tokens)


@pytest.mark.parametrize("which", ["repeat", "fixed_q"])
def test_greedy_equals_autoregressive(target, which):
    proposer, params = ((RepeatLast(gamma=3), None) if which == "repeat"
                        else (FixedQ(gamma=2), jnp.full((32,), 1 / 32)))
    want = sj.generate(target, PROMPTS, sampling=GREEDY)
    got = sj.generate(target, PROMPTS, sampling=GREEDY, proposer=proposer, draft=params)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert got.stats.proposed_tokens > 0


def _samples(target, proposer, params):
    out = sj.generate(target, [PROMPT] * N, sampling=sj.SamplingParams(max_new_tokens=3),
                      proposer=proposer, draft=params, key=0,
                      max_cache_len=len(PROMPT) + 3 + proposer.gamma)
    assert (out.lengths == 3).all()
    assert out.stats.accepted_tokens > N // 50  # drafts were really accepted and rejected
    return out.tokens


@pytest.mark.parametrize("which", ["repeat", "fixed_q"])
def test_first_three_tokens_follow_the_target(models, which):  # noqa: F811
    target, _ = models
    proposer, params = ((RepeatLast(gamma=2), None) if which == "repeat"
                        else (FixedQ(gamma=2), SKEWED))
    assert g_test(_samples(target, proposer, params), exact_joint(target, 1.0, 0, 1.0)) > 1e-3


def test_a_dishonest_q_fails_the_same_test(models):  # noqa: F811
    target, _ = models
    samples = _samples(target, ClaimsUniformQ(gamma=2), SKEWED)
    assert g_test(samples, exact_joint(target, 1.0, 0, 1.0)) < 1e-6


# -- sj.testing: the same check, offered to users ----------------------------------------------

@pytest.mark.parametrize("settings", [(1.0, 0, 1.0), (0.7, 5, 0.9), (0.0, 0, 1.0)])
def test_the_offered_exact_joint_is_the_suites(models, settings):  # noqa: F811
    from conftest import ref_process
    target, _ = models
    t, k, p = settings
    sampling = sj.SamplingParams(temperature=t, top_k=k, top_p=p)
    joint = sj.testing.exact_joint(target, PROMPT, sampling)
    np.testing.assert_allclose(joint, exact_joint(target, t, k, p), rtol=1e-9, atol=1e-15)
    assert joint.sum() == pytest.approx(1.0)
    logits = np.random.default_rng(0).normal(size=(6, 8)) * 3
    np.testing.assert_allclose(sj.testing.reference_probs(logits, t, k, p),
                               ref_process(logits, t, k, p), rtol=1e-12)


def test_the_offered_p_value_is_the_chi_squared_laws():
    import scipy.stats
    for x, df in ((0.5, 1), (3.0, 2), (30.0, 20), (80.0, 40), (400.0, 300), (5.0, 100)):
        assert sj.testing._chi2_sf(x, df) == pytest.approx(scipy.stats.chi2.sf(x, df),
                                                           rel=1e-9, abs=1e-300)


def test_the_guides_lossless_check_runs_as_written_and_catches_a_dishonest_q(models):  # noqa: F811
    """The guide's sj.testing block passes its honest proposer; the same call with a proposer
    that reports the uniform q fails; a draw the target cannot make (cut by top-k) gives 0."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    block = next(b for b in blocks if "sj.testing.lossless_pvalue" in b)
    scope = dict(EXAMPLE)
    exec(compile("\n".join(line[3:] for line in block.splitlines()), str(DOC), "exec"), scope)
    assert scope["p"] > 1e-6
    target, _ = models
    sampling = sj.SamplingParams(temperature=0.8, top_k=5)
    lying = sj.testing.lossless_pvalue(target, PROMPT, sampling=sampling,
                                       proposer=ClaimsUniformQ(gamma=2), draft=SKEWED)
    assert lying < 1e-6, lying
    joint = sj.testing.exact_joint(target, PROMPT, sampling)
    likely = np.array(np.unravel_index(np.argmax(joint), joint.shape))
    impossible = np.argwhere(joint == 0)[0]
    assert sj.testing.g_test(np.array([likely] * 99), joint) > 0
    assert sj.testing.g_test(np.array([likely] * 99 + [impossible]), joint) == 0.0
    with pytest.raises(ValueError, match="give a temperature > 0"):
        sj.testing.lossless_pvalue(target, PROMPT, sampling=sj.SamplingParams(temperature=0))
    big = sj.init_model(sj.ModelConfig(vocab_size=300, hidden_size=8, intermediate_size=16,
                                       num_hidden_layers=1, num_attention_heads=1), 0)
    with pytest.raises(ValueError, match="300 \\*\\* 3 = 27,000,000 sequences"):
        sj.testing.exact_joint(big, PROMPT, sampling)


# -- the registry -----------------------------------------------------------------------------

@pytest.fixture
def repeat_last_method():
    def build(spec, draft, target_config):
        if draft is not None:
            raise ValueError("repeat_last uses no draft; drop draft=")
        return RepeatLast(gamma=spec.num_speculative_tokens)
    sj.draft.register("repeat_last", build)
    yield
    sj.draft.unregister("repeat_last")


def test_a_registered_method_is_a_spec_method(target, repeat_last_method):
    assert "repeat_last" in sj.draft.names()
    spec = sj.SpecConfig(method="repeat_last", num_speculative_tokens=2)
    want = sj.generate(target, PROMPTS, sampling=GREEDY)
    got = sj.generate(target, PROMPTS, sampling=GREEDY, spec=spec)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert got.stats.proposal_rate == 1.0 and got.stats.proposed_tokens > 0  # γ every round
    with pytest.raises(ValueError, match="repeat_last uses no draft"):
        sj.generate(target, PROMPTS, sampling=GREEDY, spec=spec, draft=target)
    with pytest.raises(ValueError, match="tree is not supported with method 'repeat_last'"):
        sj.SpecConfig(method="repeat_last", tree=[[0]])


def test_the_built_in_methods_come_from_the_registry():
    assert sj.draft.names()[:4] == ("draft_model", "ngram", "medusa", "eagle")
    with pytest.raises(ValueError, match="unknown; known methods: draft_model, ngram"):
        sj.SpecConfig(method="nope")
    with pytest.raises(ValueError, match="identifier"):
        sj.draft.register("two words", lambda spec, draft, target: None)


# -- bad proposers are refused before anything compiles ----------------------------------------

@dataclasses.dataclass  # not frozen: unhashable
class Mutable:
    gamma: int = 2

    def init(self, params, prompts, prompt_lengths, capacity):
        return None

    def propose(self, params, state, history, length, keys, sampling, filters):
        raise AssertionError("never traced")


@dataclasses.dataclass(frozen=True)
class NoPropose:
    gamma: int = 2

    def init(self, params, prompts, prompt_lengths, capacity):
        return None


@pytest.mark.parametrize("proposer,message", [
    (Mutable(), "must be hashable"), (NoPropose(), "no propose"),
    (RepeatLast(gamma=0), "gamma >= 1"), (RepeatLast(gamma=True), "gamma >= 1")])
def test_bad_proposers_are_refused(target, proposer, message):
    before = sj.engine.compiled_programs()
    with pytest.raises(ValueError, match=message):
        sj.generate(target, PROMPTS, sampling=GREEDY, proposer=proposer)
    assert sj.engine.compiled_programs() == before


@dataclasses.dataclass(frozen=True)
class HalfPrecisionQ(FixedQ):
    """Broken on purpose: reports its q in bfloat16."""

    def propose(self, q, state, history, length, keys, sampling, filters):
        draft, state = super().propose(q, state, history, length, keys, sampling, filters)
        return sj.draft.Draft(draft.tokens, draft.probs.astype(jnp.bfloat16)), state


@dataclasses.dataclass(frozen=True)
class ShortDraft(RepeatLast):
    """Broken on purpose: one draft fewer than its gamma."""

    def propose(self, params, state, history, length, keys, sampling, filters):
        draft, state = super().propose(params, state, history, length, keys, sampling, filters)
        return sj.draft.Draft(draft.tokens[:, 1:], None), state


@pytest.mark.parametrize("proposer,message", [
    (HalfPrecisionQ(gamma=2), r"HalfPrecisionQ.propose returned Draft.probs in bfloat16; they "
                              r"must be float32"),
    (ShortDraft(gamma=3), r"ShortDraft.propose returned Draft.tokens int32\[3, 2\]; expected "
                          r"integer token ids \[B, gamma\] = \[3, 3\]")])
def test_drafts_of_the_wrong_kind_are_refused_before_compiling(target, proposer, message):
    before = sj.engine.compiled_programs()
    with pytest.raises(ValueError, match=message):
        sj.generate(target, PROMPTS, sampling=sj.SamplingParams(max_new_tokens=8),
                    proposer=proposer, draft=jnp.full((32,), 1 / 32))
    assert sj.engine.compiled_programs() == before


def test_spec_and_proposer_together_are_refused(target):
    with pytest.raises(ValueError, match="either spec= or proposer="):
        sj.generate(target, PROMPTS, spec=sj.SpecConfig(method="ngram"), proposer=RepeatLast())


# -- a rider offering fewer than γ drafts ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PartialMedusa(MedusaProposer):
    """Medusa heads, but row b offers only (length + b) % (γ + 1) of its γ drafts (none at
    times): the engine verifies per-row draft lengths and still hands the target's features
    back to the rider."""

    def propose(self, params, state, history, length, keys, sampling, filters):
        draft, state = super().propose(params, state, history, length, keys, sampling, filters)
        B, G = draft.tokens.shape
        count = (length + jnp.arange(B)) % (G + 1)
        valid = jnp.arange(G)[None, :] < count[:, None]
        return sj.draft.Draft(draft.tokens, draft.probs, valid), state


def test_a_rider_with_fewer_drafts_equals_autoregressive(target):
    heads = sj.init_heads(target, "medusa", jax.random.key(0), num_heads=3)
    want = sj.generate(target, PROMPTS, sampling=GREEDY)
    got = sj.generate(target, PROMPTS, sampling=GREEDY,
                      proposer=PartialMedusa(heads.config, 3), draft=heads.params)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    s = got.stats
    assert 0 < s.proposed_tokens < 3 * s.num_rounds * len(PROMPTS)  # really partial
    assert 0 < s.proposal_rate < 1
