"""sj.generate: greedy exactness, per-row independence, limits, EOS, stats, compile reuse and
errors."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import perturbed, tiny_config, tiny_model, traces_and_compiles

import specjax as sj
from specjax import engine

PROMPTS = [[1, 5, 9], [2], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]]
GREEDY = sj.SamplingParams(temperature=0.0, max_new_tokens=40)


@pytest.fixture(scope="module")
def noisy_draft(target):
    """The target with perturbed weights: accepts some drafts and rejects others."""
    return sj.Model(target.config, perturbed(target.params, 9, 0.03))


@pytest.fixture(scope="module")
def greedy_reference(target):
    return sj.generate(target, PROMPTS, sampling=GREEDY)


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("which", ["small", "noisy"])
def test_greedy_speculative_equals_autoregressive(target, draft, noisy_draft, greedy_reference,
                                                  gamma, which):
    d = draft if which == "small" else noisy_draft
    out = sj.generate(target, PROMPTS, sampling=GREEDY, draft=d,
                      spec=sj.SpecConfig(method="draft_model", num_speculative_tokens=gamma))
    np.testing.assert_array_equal(out.tokens, greedy_reference.tokens)
    np.testing.assert_array_equal(out.lengths, [40, 40, 40])
    if which == "noisy":  # the case must exercise both acceptance and rejection
        assert 0.1 < out.stats.acceptance_rate < 0.95, out.stats.acceptance_rate


def test_greedy_reference_is_autoregressive_greedy(target, greedy_reference):
    """The baseline itself: each token is the argmax of sj.logits over the sequence so far."""
    for b, prompt in enumerate(PROMPTS):
        seq = list(prompt) + list(greedy_reference.tokens[b])
        logits = np.asarray(sj.logits(target, np.array([seq[:-1]])))[0]
        np.testing.assert_array_equal(logits[len(prompt) - 1:].argmax(-1),
                                      greedy_reference.tokens[b])


@pytest.mark.parametrize("gamma", [2, 5])
def test_draft_identical_to_target_accepts_everything(target, gamma):
    out = sj.generate(target, PROMPTS, sampling=sj.SamplingParams(temperature=0, max_new_tokens=31),
                      spec=sj.SpecConfig(num_speculative_tokens=gamma), draft=target)
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.mean_accepted_length == gamma + 1
    np.testing.assert_array_equal(out.stats.per_position_acceptance, np.ones(gamma))
    assert out.stats.num_rounds == -(-30 // (gamma + 1))  # 30 tokens after the first


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("broken", [False, True])
def test_a_draft_that_is_the_target_is_always_accepted_when_sampling(target, shape, broken,
                                                                    monkeypatch, fresh_programs):
    """Sampled drafts from the target itself (q = p) are accepted every time: a sampled draft
    passes with min(1, p/q). Lossless rules that throw acceptance away pass every distribution
    test, so this one looks at acceptance: deliberately broken, equality with a token drawn
    from the target (the chain), or a tree that forgets the q its children were drawn from
    (point-mass checks), both fail it."""
    from specjax import verify
    if broken and shape == "chain":
        monkeypatch.setattr(verify, "acceptance_probs",
                            lambda toks, q, p, valid=None: verify._draft_token_probs(
                                p[:, :toks.shape[1]], toks) * (1.0 if valid is None else valid))
    if broken and shape == "tree":
        real = verify.tree_sample
        monkeypatch.setattr(verify, "tree_sample", lambda *a: real(*a[:5], None))
    spec = (sj.SpecConfig(num_speculative_tokens=3) if shape == "chain"
            else sj.SpecConfig(tree=[[0], [1], [0, 0]]))
    out = sj.generate(target, PROMPTS * 4, spec=spec, draft=target, key=3,
                      sampling=sj.SamplingParams(temperature=0.8, top_k=5, max_new_tokens=31))
    every_position = out.stats.per_position_acceptance.min()
    assert (every_position < 0.9) if broken else (every_position > 0.99), \
        out.stats.per_position_acceptance


class _Traced(Exception):
    """Raised once the decode program is traced: what the test reads is known by then."""


# every proposer that draws its drafts from a distribution of its own, at T > 0, and what the
# verifier must be given: q (None: point masses, Medusa's top-ranked tokens by design)
SAMPLED_DRAFTERS = {
    "draft model": (dict(num_speculative_tokens=3), "draft", True),
    "draft vocabulary": (dict(num_speculative_tokens=3), "vocab", True),
    "draft-model tree": (dict(tree=((0,), (1,), (0, 0))), "draft", True),
    "draft-vocabulary tree": (dict(tree=((0,), (1,), (0, 0))), "vocab", True),
    "adaptive lengths": (dict(num_speculative_tokens=3, survival_threshold=0.3), "draft", True),
    "eagle": (dict(method="eagle", num_speculative_tokens=3), "eagle", True),
    "eagle tree": (dict(method="eagle", tree=((0,), (1,), (0, 0))), "eagle", True),
    "eagle adaptive lengths": (dict(method="eagle", num_speculative_tokens=3,
                                    survival_threshold=0.3), "eagle", True),
    "mtp": (dict(method="mtp", num_speculative_tokens=3), "mtp", True),
    "mtp adaptive lengths": (dict(method="mtp", num_speculative_tokens=3,
                                  survival_threshold=0.3), "mtp", True),
    "dflash": (dict(method="dflash", num_speculative_tokens=3), "dflash", True),
    "dflash tree": (dict(method="dflash", tree=((0,), (1,), (0, 0))), "dflash", True),
    "dflash adaptive lengths": (dict(method="dflash", num_speculative_tokens=3,
                                     survival_threshold=0.3), "dflash", True),
    "medusa": (dict(method="medusa", num_speculative_tokens=3), "medusa", False),
}


@pytest.mark.parametrize("name", SAMPLED_DRAFTERS)
def test_every_sampled_drafter_hands_its_q_to_the_verifier(target, draft, name, monkeypatch,
                                                           fresh_programs):
    """A drafter that samples its drafts must give the verifier the q it drew them from:
    without it the point-mass rule still keeps the output exactly the target's (every
    distribution test passes) but accepts a sampled draft with p(d) instead of min(1, p/q).
    The draft = target test above shows the loss for the draft model; heads cannot be the
    target, so here the decode program is traced (not compiled) at T = 0.8 and what reaches
    ``verify.rejection_sample`` / ``verify.tree_sample`` is read. (Proposers that dropped their
    q, one-off: ``base.stack_chain`` returning no q fails every chain but dflash's and Medusa's,
    adaptive ones included; ``base.expand_tree`` returning none fails the four trees.)"""
    from specjax import verify
    from specjax.draft import restrict_vocab
    spec, kind, with_q = SAMPLED_DRAFTERS[name]
    drafter = {"draft": draft, "vocab": None if kind != "vocab" else restrict_vocab(
        sj.DraftModel(draft), np.arange(0, 32, 2))}.get(kind)
    if drafter is None:
        drafter = sj.init_heads(target, kind, jax.random.key(3))
    given = []
    chain, tree = verify.rejection_sample, verify.tree_sample
    monkeypatch.setattr(verify, "rejection_sample", lambda keys, tokens, q, *a: (
        given.append(q), chain(keys, tokens, q, *a))[1])
    monkeypatch.setattr(verify, "tree_sample", lambda *a: (given.append(a[5]), tree(*a))[1])
    compile_stage = engine.Program.executable

    def traced_only(self, stage, *args):
        if stage == "decode":
            engine._STAGES[stage].lower(self.plan, *args)
            raise _Traced
        return compile_stage(self, stage, *args)
    monkeypatch.setattr(engine.Program, "executable", traced_only)
    with pytest.raises(_Traced):
        sj.generate(target, PROMPTS, spec=sj.SpecConfig(**spec), draft=drafter, key=1,
                    sampling=sj.SamplingParams(temperature=0.8, max_new_tokens=8))
    assert given and all((q is not None) == with_q for q in given), (name, given)


def test_a_proposer_that_calls_the_host_is_caught(target, monkeypatch, fresh_programs):
    """Every test module ends by checking the programs it compiled for calls to the host
    (conftest's host_round_trips): a proposer that looks its drafts up on the host each round,
    deliberately, is caught by that check."""
    from conftest import host_round_trips

    from specjax.draft import ngram
    real = ngram.NgramProposer.propose

    def on_the_host(self, params, state, history, length, *rest):
        jax.debug.callback(lambda n: None, length)  # e.g. a host-side index of the history
        return real(self, params, state, history, length, *rest)
    monkeypatch.setattr(ngram.NgramProposer, "propose", on_the_host)
    out = sj.generate(target, PROMPTS, spec="ngram", sampling=sj.SamplingParams(
        temperature=0, max_new_tokens=8))
    assert (out.lengths == 8).all()
    found = host_round_trips()
    assert found and all(x.startswith("NgramProposer") for x in found), found
    assert any(x.startswith("NgramProposer decode: ") for x in found), found
    engine.PROGRAMS.clear()  # caught: not left for fresh_programs' own check


def test_rows_do_not_depend_on_their_neighbours(target, draft):
    """Row 0 keeps its output when its neighbour changes (content, length, capacity tier).
    A row's key is folded from its index, so the same prompt at another index is another sample."""
    sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=24)
    spec = sj.SpecConfig(num_speculative_tokens=3)
    key = jax.random.key(5)
    a = sj.generate(target, [[1, 2, 3], [4, 4]], sampling=sampling, spec=spec, draft=draft, key=key)
    b = sj.generate(target, [[1, 2, 3], [7, 8, 9, 10, 11, 12]], sampling=sampling, spec=spec,
                    draft=draft, key=key)
    c = sj.generate(target, [[1, 2, 3], list(range(30))], sampling=sampling, spec=spec,
                    draft=draft, key=key, max_cache_len=96)  # another capacity: another program
    np.testing.assert_array_equal(a.tokens[0], b.tokens[0])
    np.testing.assert_array_equal(a.tokens[0], c.tokens[0])
    twice = sj.generate(target, [[1, 2, 3]] * 2, sampling=sampling, spec=spec, draft=draft,
                        key=key)  # one key for the call, not one random stream for every row
    np.testing.assert_array_equal(twice.tokens[0], a.tokens[0])
    assert not np.array_equal(twice.tokens[1], twice.tokens[0])


@pytest.mark.parametrize("path", ["ngram", "tree", "broken"])
def test_a_row_keeps_what_it_accepts_whatever_its_neighbour_accepts(target, draft, path,
                                                                   monkeypatch, fresh_programs):
    """As above for n-gram's per-row lengths and a tree: a row's tokens do not depend on what
    its neighbour accepts. Advancing every row by the batch's fewest accepted tokens is
    lossless and greedy-exact (it only throws tokens away), so only this test sees it: a chain
    broken that way (deliberately) fails."""
    from conftest import verification_paths
    name = "chain" if path == "broken" else path
    spec, d = verification_paths(draft)[name]
    if path == "broken":
        real = engine._emit

        def batch_fewest(state, tokens, num_accepted, request):
            n_emit, hit_eos, history = real(state, tokens, num_accepted, request)
            fewest = jnp.min(jnp.where(state.done, tokens.shape[1], n_emit))
            return jnp.minimum(n_emit, fewest), hit_eos, history
        monkeypatch.setattr(engine, "_emit", batch_fewest)
    sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=24)
    row = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats, so n-gram lookup drafts
    run = lambda other: sj.generate(target, [row, other], sampling=sampling, spec=spec,  # noqa
                                    draft=d, key=5)
    a, b = run([4, 4]), run([7, 8, 9, 7, 8, 9, 7, 8, 9, 10])
    assert a.stats.accepted_tokens > 0 and b.stats.accepted_tokens > 0
    same = np.array_equal(a.tokens[0], b.tokens[0])
    assert (not same) if path == "broken" else same


@pytest.mark.parametrize("path", ["autoregressive", "chain", "ngram", "tree", "lookahead",
                                  "suffix", "host-loop"])
def test_generate_is_one_prefill_and_one_decode_call(target, draft, path, monkeypatch):
    """On every verification path, a generate call runs two programs on the device, the prefill
    and the whole decode loop, never a round at a time from the host (which would read each
    round's ``done`` back: a host sync per round). A Program.run rewritten as a host loop over
    rounds (deliberately) fails; its tokens are the same, so only this test sees it."""
    from conftest import verification_paths
    spec, d = verification_paths(draft)["chain" if path == "host-loop" else path]
    calls = []
    call = engine.Program.call

    def counted(self, stage, *args):
        calls.append(stage)
        return call(self, stage, *args)
    monkeypatch.setattr(engine.Program, "call", counted)
    if path == "host-loop":
        def run(self, target_params, draft_params, inputs):
            state = self.prefill(target_params, draft_params, inputs.prompts, inputs.lengths,
                                 inputs.request)
            while not bool(np.all(np.asarray(state.done))):
                state = self.step(target_params, draft_params, inputs.request, state)
            return state, engine.Timing(0.0, 0.0, 0.0)
        monkeypatch.setattr(engine.Program, "run", run)
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=12)
    out = sj.generate(target, [[1, 2, 3, 1, 2, 3], [4, 5]], sampling=sampling, spec=spec,
                      draft=d)
    ref = sj.generate(target, [[1, 2, 3, 1, 2, 3], [4, 5]], sampling=sampling)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    first = calls[:len(calls) - 2]  # the call under test, then the reference's two
    if path == "host-loop":
        assert first[0] == "prefill" and first.count("round") > 1, first
    else:
        assert first == ["prefill", "decode"], first


def test_same_key_same_output_other_key_other_output(target, draft):
    sampling = sj.SamplingParams(temperature=0.9, top_k=10, max_new_tokens=24)
    spec = {"method": "draft_model", "num_speculative_tokens": 3}
    run = lambda k: sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=draft,  # noqa
                                key=jax.random.key(k)).tokens
    np.testing.assert_array_equal(run(1), run(1))
    assert not np.array_equal(run(1), run(2))


def test_request_that_exactly_fills_the_context_works(target, draft):
    max_pos = target.config.max_position_embeddings
    prompt = [[7] * (max_pos - 20), [1, 2]]
    sampling = sj.SamplingParams(temperature=0, max_new_tokens=20)
    spec = sj.SpecConfig(num_speculative_tokens=4)
    out = sj.generate(target, prompt, sampling=sampling, spec=spec, draft=draft)
    ref = sj.generate(target, prompt, sampling=sampling)
    np.testing.assert_array_equal(out.lengths, [20, 20])
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        sj.generate(target, [[7] * (max_pos - 19)], sampling=sampling, spec=spec, draft=draft)


def test_second_call_with_same_shapes_does_not_compile(target, draft, fresh_programs):
    spec = sj.SpecConfig(num_speculative_tokens=3)
    first = sj.generate(target, [[1, 2, 3], [4, 5]], draft=draft, spec=spec,
                        sampling=sj.SamplingParams(temperature=0.8, max_new_tokens=20))
    before = engine.compiled_programs()
    # Other prompts, temperature, max_new_tokens, EOS ids and key: arrays, not shapes.
    second = sj.generate(target, [[9, 9, 9, 9], [8]], draft=draft, spec=spec, key=3,
                         sampling=sj.SamplingParams(temperature=0.5, max_new_tokens=17,
                                                    eos_token_id=[4, 5]))
    assert engine.compiled_programs() == before
    assert second.stats.compile_seconds == 0.0 and second.tokens.shape == (2, 17)
    # Batch sizes are bucketed (1, 2, 3, 4, 6, 8, ...): 5 and 6 rows share a program.
    sampling = sj.SamplingParams(temperature=0.8, max_new_tokens=20)
    five = sj.generate(target, [[1], [2], [3], [4], [5]], draft=draft, spec=spec,
                       sampling=sampling, key=0)
    after_five = engine.compiled_programs()
    six = sj.generate(target, [[1], [2], [3], [4], [5], [6]], draft=draft, spec=spec,
                      sampling=sampling, key=0)
    assert engine.compiled_programs() == after_five
    assert five.tokens.shape == (5, 20) and six.tokens.shape == (6, 20)
    np.testing.assert_array_equal(five.tokens, six.tokens[:5])
    assert first.stats.compile_seconds > 0  # the first call did compile, and said so


def test_eos_stops_each_row_and_pads(target, draft, greedy_reference):
    eos = int(greedy_reference.tokens[0, 6])
    sampling = sj.SamplingParams(temperature=0, max_new_tokens=40, eos_token_id=[eos, 31])
    for kw in (dict(), dict(spec=sj.SpecConfig(num_speculative_tokens=4), draft=draft)):
        out = sj.generate(target, PROMPTS, sampling=sampling, **kw)
        for b in range(len(PROMPTS)):
            ref = list(greedy_reference.tokens[b])
            stops = [i for i, t in enumerate(ref) if t in (eos, 31)]
            n = stops[0] + 1 if stops else 40
            assert out.lengths[b] == n
            assert list(out.tokens[b, :n]) == ref[:n]
            assert (out.tokens[b, n:] == -1).all()
        assert out.lengths[0] <= 7
        # rows that stop early leave the rounds after: the rates count each row's own rounds
        s = out.stats
        assert s.num_rounds < s.row_rounds < len(PROMPTS) * s.num_rounds
        np.testing.assert_allclose(s.mean_accepted_length * s.row_rounds, np.sum(out.lengths - 1))


def test_autoregressive_stats(target):
    out = sj.generate(target, [[1, 2]], sampling=sj.SamplingParams(temperature=0, max_new_tokens=9))
    s = out.stats
    assert np.isnan(s.acceptance_rate) and s.mean_accepted_length == 1.0
    assert s.num_rounds == 8 and s.target_calls == 9 and s.draft_calls == 0
    assert s.generated_tokens == 9 and s.per_position_acceptance.shape == (0,)


@pytest.mark.parametrize("spec", [None, "chain"])
def test_acceptance_by_context_position(spec):
    """Two rows, one starting at position 20 and one at 300, 30 new tokens each: every round of
    the first counts in the 0-256 bin, every round of the second in 256-512; the bins add up to
    the call's row-rounds and mean accepted length."""
    model = tiny_model(seed=2, vocab_size=32, max_pos=600)
    prompts = [[1 + i % 30 for i in range(20)], [1 + i % 29 for i in range(300)]]
    kw = {} if spec is None else dict(spec=sj.SpecConfig(num_speculative_tokens=3),
                                      draft=tiny_model(seed=3, vocab_size=32, max_pos=600))
    out = sj.generate(model, prompts, sampling=sj.SamplingParams(temperature=0,
                                                                 max_new_tokens=30), **kw)
    bins = out.stats.accepted_length_by_position
    assert [(lo, hi) for lo, hi, _, _ in bins] == [(0, 256), (256, 512)]
    if spec is None:  # one token a round: 29 rounds after the prefill's token, per row
        assert [(m, n) for _, _, m, n in bins] == [(1.0, 29), (1.0, 29)]
    row_rounds = sum(n for *_, n in bins)
    assert out.stats.row_rounds == row_rounds
    emitted = sum(m * n for _, _, m, n in bins)
    np.testing.assert_allclose(emitted / row_rounds, out.stats.mean_accepted_length)
    assert ("by context position 0-256: " in str(out.stats)) == (spec is not None)


def test_speculative_stats_are_consistent(target, noisy_draft):
    gamma = 4
    out = sj.generate(target, PROMPTS, sampling=sj.SamplingParams(temperature=0.8,
                                                                  max_new_tokens=30),
                      spec=sj.SpecConfig(num_speculative_tokens=gamma), draft=noisy_draft)
    s = out.stats
    assert s.draft_calls == 1 + gamma * s.num_rounds and s.target_calls == 1 + s.num_rounds
    assert 0 < s.acceptance_rate < 1
    # Per-position acceptance is a survival curve, and its sum is the mean accepted drafts.
    assert all(np.diff(s.per_position_acceptance) <= 1e-12)
    np.testing.assert_allclose(s.per_position_acceptance.sum() + 1, s.mean_accepted_length)
    np.testing.assert_allclose(s.acceptance_rate, s.accepted_tokens / s.proposed_tokens)
    assert s.decode_tokens_per_second > 0 and s.prefill_seconds > 0


def test_max_new_tokens_one(target, draft):
    out = sj.generate(target, PROMPTS, sampling=sj.SamplingParams(temperature=0, max_new_tokens=1),
                      spec=sj.SpecConfig(num_speculative_tokens=2), draft=draft)
    np.testing.assert_array_equal(out.lengths, [1, 1, 1])
    s = out.stats
    assert s.num_rounds == 0
    # no round: the per-round rates are undefined, all of them (the distributions read 0 beside
    # a nan mean accepted length, as if every draft had been rejected)
    assert np.isnan(s.mean_accepted_length) and np.isnan(s.alpha)
    for name in ("per_position_acceptance", "accepted_length_distribution",
                 "proposed_length_distribution"):
        assert np.isnan(getattr(s, name)).all(), name


def test_a_fresh_seed_is_broadcast_only_over_a_mesh_of_several_processes(target, monkeypatch):
    """key=None in a multi-process run: a call on a mesh over several processes takes the
    first process's seed (all must draw alike, and all call); a call off such a mesh, which
    one process may make alone, draws its own and waits for no other (it hung before)."""
    from jax.experimental import multihost_utils

    def no_other_process(x):
        raise AssertionError("waited for the other processes")
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", no_other_process)
    out = sj.generate(target, [[1, 2]], sampling=sj.SamplingParams(max_new_tokens=3))
    assert out.lengths[0] == 3
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda x: np.int64(5))
    np.testing.assert_array_equal(jax.random.key_data(engine._as_key(None, shared=True)),
                                  jax.random.key_data(engine._as_key(5)))


def test_keys_and_numpy_values_are_accepted(target):
    sampling = sj.SamplingParams(temperature=np.float32(0.9), top_k=np.int64(8),
                                 max_new_tokens=np.int32(6), eos_token_id=np.array([30, 31]))
    assert sampling.top_k == 8 and type(sampling.top_k) is int and sampling.eos_token_id == (30, 31)
    runs = [sj.generate(target, [[1, 2]], sampling=sampling, key=k).tokens
            for k in (3, np.int64(3), jax.random.key(3), jax.random.PRNGKey(3))]
    for r in runs[1:]:
        np.testing.assert_array_equal(r, runs[0])
    with pytest.raises(ValueError, match="single PRNG key"):
        sj.generate(target, [[1, 2]], sampling=sampling, key=jax.random.split(jax.random.key(0)))
    with pytest.raises(ValueError, match="key must be"):
        sj.generate(target, [[1, 2]], sampling=sampling, key="seed")


def test_spec_config_parsing():
    assert sj.SpecConfig.parse(None) is None
    want = sj.SpecConfig(method="draft_model", num_speculative_tokens=3)
    assert sj.SpecConfig.parse({"method": "draft_model", "num_speculative_tokens": 3}) == want
    assert sj.SpecConfig.parse(json.dumps({"num_speculative_tokens": 3})) == want
    with pytest.raises(ValueError, match="unknown speculative config keys"):
        sj.SpecConfig.parse({"num_speculative_tokenz": 3})
    with pytest.raises(ValueError, match="JSON"):
        sj.SpecConfig.parse("{num_speculative_tokens: 3")


class _Letters:
    """A tokenizer of the 32-token test vocabulary: token i is the letter chr(97 + i % 26)."""

    vocab_size = 32
    eos_token_ids = ()

    def encode(self, text):
        return [(ord(c) - 97) % 32 for c in text]

    def decode(self, ids):
        return "".join(chr(97 + int(i) % 26) for i in ids)


BAD_INPUTS = [
    ("empty prompt", dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    ("no prompts", dict(prompts=[]), "prompts is empty"),
    ("token too big", dict(prompts=[[1, 32]]), "token id 32 outside"),
    ("negative token", dict(prompts=[[-1, 2]]), "token id -1 outside"),
    ("string prompt", dict(prompts=["hello"]), "string"),
    ("too long", dict(prompts=[[1] * 100], sampling=sj.SamplingParams(max_new_tokens=29)),
     "max_position_embeddings=128"),
    ("no draft", dict(spec=sj.SpecConfig(), draft=None), "needs a draft model"),
    ("draft without spec", dict(spec=None), "spec is None"),
    ("eos out of vocab", dict(sampling=sj.SamplingParams(eos_token_id=99)), "eos_token_id 99"),
    ("spec not a config", dict(spec=3), "spec must be"),
    ("draft not a model", dict(draft="small"), "draft must be an sj.Model"),
    ("tokenizer not a Tokenizer", dict(tokenizer="gpt2"),
     "tokenizer must be an sj.Tokenizer.*vocab_size.*got str"),
    ("seed beyond 64 bits", dict(key=2 ** 64), "key seed 18446744073709551616 is outside"),
    ("float ids in one prompt", dict(prompts=[1, 2.0]),
     r"prompts must hold integer token ids, got \[1, 2.0\] \(dtype float64\)"),
    ("a 0-d array", dict(prompts=np.array(5)), "prompts must be a list of token-id lists, got "
     "ndarray"),
    ("bytes with a tokenizer", dict(prompts=b"def", tokenizer=_Letters()),
     "prompts must be a string, a list of strings or a list of token-id lists, got bytes"),
    ("None with a tokenizer", dict(prompts=None, tokenizer=_Letters()),
     "a list of token-id lists, got NoneType"),
    ("allow_synthetic not a bool", dict(allow_synthetic="no"),
     "allow_synthetic must be True or False, got 'no'"),
    ("return_text not a bool", dict(return_text="no"),
     "return_text must be True or False, got 'no'"),
]


@pytest.mark.parametrize("name,kw,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_before_compiling(target, draft, name, kw, message):
    args = dict(prompts=[[1, 2]], sampling=sj.SamplingParams(max_new_tokens=4),
                spec=sj.SpecConfig(num_speculative_tokens=2), draft=draft)
    args.update(kw)
    before = engine.compiled_programs()
    with pytest.raises(ValueError, match=message):
        sj.generate(target, args.pop("prompts"), **args)
    assert engine.compiled_programs() == before


def test_more_logprobs_than_the_vocabulary_holds_are_refused_before_compiling():
    small = tiny_model(seed=2, vocab_size=16, max_pos=128)
    sampling = sj.SamplingParams(max_new_tokens=4, logprobs=20)
    before = engine.compiled_programs()
    with pytest.raises(ValueError, match="logprobs=20 exceeds the target's vocab_size 16"):
        sj.generate(small, [[1, 2]], sampling=sampling)
    assert engine.compiled_programs() == before


def test_settings_beyond_what_runs_are_refused_when_made(target, tmp_path):
    with pytest.raises(ValueError, match=r"top_k must be at most 2,147,483,647 \(token ids are "
                                         r"int32\), got 1099511627776"):
        sj.SamplingParams(top_k=2 ** 40)
    with pytest.raises(ValueError, match="num_speculative_tokens=1000000000; at most 64"):
        sj.SpecConfig(num_speculative_tokens=10 ** 9)
    for method in ("suffix", "lookahead"):
        with pytest.raises(ValueError, match=f"num_speculative_tokens=17; method '{method}' "
                                             "drafts a tree that deep.*at most 16 levels"):
            sj.SpecConfig(method=method, num_speculative_tokens=17)
    assert sj.SpecConfig(method="suffix", num_speculative_tokens=16).num_speculative_tokens == 16
    # 20 nodes over two levels (16 children at most, what suffix and lookahead rank): a
    # tree's γ counts nodes
    wide = tuple((i,) for i in range(16)) + tuple((0, j) for j in range(4))
    for method in ("suffix", "lookahead"):
        assert sj.SpecConfig(method=method, tree=wide).num_speculative_tokens == 20
    with pytest.raises(ValueError, match="target must be an sj.Model"):
        sj.load_heads(tmp_path, "x")


def test_params_that_are_not_the_configs_are_refused_by_path(target):
    """A Model built by hand with another config's params, or with a weight too many: named by
    its path before anything is traced (a flax shape error, or an AttributeError in the
    program's signature, before); a mapping of prompts is refused as one, not read by keys."""
    narrow = dataclasses.replace(target.config, hidden_size=target.config.hidden_size // 2,
                                 head_dim=None)
    for model, message in (
            (sj.Model(narrow, target.params), "params do not match its config at "
                                              "\\['embed_tokens'\\]\\['embedding'\\]: "
                                              "shape \\(32, 32\\), the config makes \\(32, 16\\)"),
            (sj.Model(target.config, {**target.params, "extra": 1}),
             "at \\['extra'\\]: not in the config"),
            (sj.Model(target.config, {k: v for k, v in target.params.items() if k != "norm"}),
             "at \\['norm'\\]\\['weight'\\]: missing")):
        with pytest.raises(ValueError, match=message):
            sj.generate(model, [[1, 2]])
    with pytest.raises(ValueError, match="prompts must be a list of token-id lists, got dict"):
        sj.generate(target, {"a": [1, 2]})


def test_a_ragged_prompt_is_refused_by_its_index(target):
    for prompt, shown in (([1, [2, 3]], r"\[1, \[2, 3\]\]"),
                          ([[1, 2], [3, 4]], r"\[\[1, 2\], \[3, 4\]\]")):
        with pytest.raises(ValueError,
                           match=f"prompt 1 must be a flat list of token ids, got {shown}"):
            sj.generate(target, [[1, 2], prompt])


def test_target_must_be_a_model_and_draft_context_is_checked(target):
    with pytest.raises(ValueError, match="target must be an sj.Model"):
        sj.generate(target.params, [[1]])
    short = tiny_model(seed=2, vocab_size=32, max_pos=16)
    with pytest.raises(ValueError, match="draft's max_position_embeddings=16"):
        sj.generate(target, [[1] * 10], sampling=sj.SamplingParams(max_new_tokens=10),
                    spec=sj.SpecConfig(), draft=short)


def test_draft_with_another_vocabulary_is_refused(target):
    other = tiny_model(seed=2, vocab_size=48, max_pos=128)
    with pytest.raises(ValueError, match="draft vocab_size 48 != target vocab_size 32"):
        sj.generate(target, [[1]], spec=sj.SpecConfig(), draft=other)


@pytest.mark.parametrize("kw,message", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), r"top_k must be an int >= 0, or -1 .*got -2"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(eos_token_id=[1, -2]), "eos_token_id"), (dict(eos_token_id=list(range(9))), "at most 8"),
    (dict(temperature="hot"), "temperature"), (dict(top_k=2.5), "top_k"),
    # below float32's smallest normal it would reach the device as 0: only token 0 left
    (dict(top_p=1e-40), r"top_p must be in \[1.2e-38, 1\]"),
    (dict(stop={"a": 1}), "stop must be a non-empty string or a list of them"),
])
def test_bad_sampling_params(kw, message):
    with pytest.raises(ValueError, match=message):
        sj.SamplingParams(**kw)


@pytest.mark.parametrize("kw,message", [
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(method="medusa2"), "method 'medusa2' is unknown"),
    (dict(method="ngram", prompt_lookup_max=10 ** 8), "prompt_lookup_max must be at most 64"),
])
def test_bad_spec_config(kw, message):
    with pytest.raises(ValueError, match=message):
        sj.SpecConfig(**kw)


def test_ids_as_numpy_and_jax_scalars_are_taken():
    """0-d integer arrays are ids as the Python ints they hold, wherever the API takes ids."""
    sampling = sj.SamplingParams(eos_token_id=jnp.int32(2), stop_token_ids=[np.array(3)])
    assert sampling.eos_token_id == (2,) and sampling.stop_token_ids == ((3,),)
    assert sj.SamplingParams(eos_token_id=[np.int64(4), jnp.int32(5)]).eos_token_id == (4, 5)


def test_helpers_outside_generate_refuse_bad_input_by_name(target, tmp_path):
    """sj.logits, sj.init_model, sj.make_mesh, sj.init_heads, sj.load_model and KVCache.init:
    a clear ValueError (a missing folder: FileNotFoundError) naming the bad value."""
    for tokens, message in (([[1, 2, 99]], r"token id 99 outside \[0, 32\)"),
                            ([[1, -5]], "token id -5 outside"),
                            ([[1.7, 2.2]], "integer token ids, got dtype float64")):
        with pytest.raises(ValueError, match=message):
            sj.logits(target, tokens)
    seeded = sj.init_model(target.config, 7)  # an int seed, as generate takes
    keyed = sj.init_model(target.config, jax.random.key(7))
    for a, b in zip(jax.tree.leaves(seeded.params), jax.tree.leaves(keyed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for args, message in (((dict(a=1), 0), "config must be an sj.ModelConfig, got dict"),
                          ((target.config, "seed"), "key must be a jax.random.key or an int "
                                                    "seed, got str"),
                          ((target.config, 0, float("nan")), "init_std must be a finite "
                                                             "number >= 0, got nan")):
        with pytest.raises(ValueError, match=message):
            sj.init_model(*args)
    with pytest.raises(ValueError, match="devices is empty"):
        sj.make_mesh(devices=[])
    with pytest.raises(ValueError, match="lists a device more than once"):
        sj.make_mesh(devices=[jax.devices()[0]] * 2)
    assert dict(sj.make_mesh(data=np.int64(1)).shape) == {"data": 1, "model": 1}
    mesh = sj.make_mesh()
    for rules, message in (({"mpl": "model"}, "unknown logical axis 'mpl'"),
                           ({"mlp": "tensor"}, "maps 'mlp' to 'tensor', not an axis of the mesh"),
                           ([("mlp", "model")], "rules must be a dict")):
        with pytest.raises(ValueError, match=message):
            sj.shard(target, mesh, rules=rules)
    assert sj.sharding.placed_on(sj.shard(target, mesh, rules={"mlp": None, "batch": "data"}),
                                 mesh)
    with pytest.raises(ValueError, match="num_heads must be an int, got 2.5"):
        sj.init_heads(target, "medusa", jax.random.key(0), num_heads=2.5)
    with pytest.raises(ValueError, match="dtype must be 'float32', 'bfloat16' or 'float16', "
                                         "got 'int8'"):
        sj.init_heads(target, "medusa", jax.random.key(0), dtype="int8")
    with pytest.raises(ValueError, match="capacity must be an int >= 1, got -1"):
        sj.KVCache.init(target.config, 1, -1)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="config.json is a file: give the model folder"):
        sj.load_model(tmp_path / "config.json")
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
        sj.load_model(tmp_path, mesh="x")


def test_stats_print_as_a_short_summary(target, draft):
    spec = sj.SpecConfig(num_speculative_tokens=3)
    stats = sj.generate(target, [[1, 2, 3], [4]], spec=spec, draft=draft,
                        sampling=sj.SamplingParams(max_new_tokens=20)).stats
    text = str(stats)
    assert text == repr(stats) and "array(" not in text and len(text.splitlines()) <= 6
    assert f"acceptance rate {stats.acceptance_rate:.3f} ({stats.accepted_tokens} of " \
           f"{stats.proposed_tokens} drafts)" in text
    assert text.startswith(f"Stats: {stats.generated_tokens} tokens in {stats.num_rounds} rounds")
    plain = str(sj.generate(target, [[1, 2, 3]], sampling=sj.SamplingParams(max_new_tokens=5))
                .stats)
    assert "no drafts proposed" in plain and "acceptance rate" not in plain
    assert plain.startswith("Stats: 5 tokens in 4 rounds, 5 target and 0 draft forwards")
    one = str(sj.generate(target, [[1, 2, 3]], sampling=sj.SamplingParams(max_new_tokens=2))
              .stats)  # a count of one in the singular
    assert one.startswith("Stats: 2 tokens in 1 round, 2 target and 0 draft forwards"), one


def run_round_by_round(target, prompts, sampling, spec, draft, ahead: bool):
    """generate's rounds driven from the host, one compiled round at a time: ``ahead`` False
    proposes each round's drafts at its start and picks its verify width by a switch (the
    reference); True verifies the drafts the round before proposed, at the width the decode
    loop would pick (``engine.verify_width``). Returns the final history and lengths."""
    import functools
    _, _, plan, model, draft_params, inputs = engine._prepare(
        target, prompts, sampling, spec, draft, None, 0, None, False, None, None)
    prefill = jax.jit(engine._with_blocks(functools.partial(engine.prefill_state, ahead=ahead)),
                      static_argnums=0)
    step = jax.jit(engine._with_blocks(engine.round_step), static_argnums=(0, 5))
    state = prefill(plan, model.params, draft_params, inputs.prompts, inputs.lengths,
                    inputs.request)
    assert (state.pending is not None) == ahead
    widths = set()
    while not np.asarray(state.done).all():
        width = None if not ahead else engine.loop_widths(plan.gamma)[
            int(engine.verify_width(plan, state))]
        widths.add(width)
        state = step(plan, model.params, draft_params, inputs.request, state, width)
    return np.asarray(state.history), np.asarray(state.num_generated), widths


@pytest.mark.parametrize("method,temperature", [("ngram", 0.0), ("ngram", 1.0),
                                                ("adaptive", 0.8)])
def test_drafts_proposed_a_round_ahead_give_the_rounds_of_a_round_by_round_run(
        target, draft, method, temperature):
    """A chain with per-row lengths proposes each round's drafts at the end of the round before
    and the decode loop verifies them in one of its loops of fixed widths (``engine._rounds``).
    Those are the same rounds, with the same keys, as proposing at a round's start and choosing
    its width inside it: the tokens equal, greedy and sampled, and over rounds of several
    widths; and the compiled loop gives what rounds driven from the host give."""
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    sampling = sj.SamplingParams(temperature=temperature, max_new_tokens=24)
    spec = (sj.SpecConfig(method="ngram", num_speculative_tokens=4,
                          prompt_lookup_min=1, prompt_lookup_max=2) if method == "ngram" else
            sj.SpecConfig(num_speculative_tokens=4, survival_threshold=0.3))
    d = None if method == "ngram" else draft
    ref = run_round_by_round(target, prompts, sampling, spec, d, ahead=False)
    ahead = run_round_by_round(target, prompts, sampling, spec, d, ahead=True)
    np.testing.assert_array_equal(ahead[1], ref[1])
    np.testing.assert_array_equal(ahead[0], ref[0])
    assert len(ahead[2]) >= 2, ahead[2]  # rounds of more than one width
    out = sj.generate(target, prompts, sampling=sampling, spec=spec, draft=d, key=0)
    for b, n in enumerate(ref[1]):
        start = len(prompts[b])
        np.testing.assert_array_equal(out.tokens[b, :n], ref[0][b, start:start + n])


def test_a_tiny_temperature_speculates_as_greedy_decoding_does():
    """At T = 1e-10 the target and the draft are one-hots on their argmaxes, so the sampled
    verifier accepts exactly the drafts greedy verification accepts, and the tokens are greedy
    decoding's. (A draft q of NaN there, from a softmax that overflowed, rejected every draft
    while the tokens stayed right.)"""
    target = tiny_model(seed=0, vocab_size=2048, max_pos=64)
    draft = tiny_model(seed=0, vocab_size=2048, max_pos=64, layers=1)
    spec = sj.SpecConfig(num_speculative_tokens=3)
    runs = {t: sj.generate(target, [[1, 2, 3]], spec=spec, draft=draft, key=0,
                           sampling=sj.SamplingParams(temperature=t, max_new_tokens=12))
            for t in (0.0, 1e-10)}
    np.testing.assert_array_equal(runs[1e-10].tokens, runs[0.0].tokens)
    assert runs[0.0].stats.accepted_tokens > 0
    assert runs[1e-10].stats.accepted_tokens == runs[0.0].stats.accepted_tokens


class _Chars:
    """Token i is chr(97 + i): a tokenizer for a 32-token model, with EOS ``eos_token_id`` in
    Hugging Face's spelling (an int), not sj.Tokenizer's ``eos_token_ids``."""

    vocab_size = 32

    def __init__(self, eos_token_id=None):
        self.eos_token_id = eos_token_id

    def encode(self, text):
        return [ord(c) - 97 for c in text]

    def decode(self, ids):
        return "".join(chr(97 + int(i)) for i in ids)


def test_what_users_pass_first_is_understood(target):
    """One flat list (or 1-D array) of ids is one prompt; a tokenizer implies decoded text unless
    return_text=False; a tokenizer's EOS in Hugging Face's spelling (eos_token_id, an int, here
    id 0, which a truthiness test lost) is the default stop; key=None draws fresh randomness each
    call while a key reproduces."""
    greedy = sj.SamplingParams(temperature=0, max_new_tokens=8)
    listed = sj.generate(target, [[3, 4, 5]], sampling=greedy)
    for one in ([3, 4, 5], np.asarray([3, 4, 5], np.int64), (3, 4, 5)):
        out = sj.generate(target, one, sampling=greedy)
        np.testing.assert_array_equal(out.tokens, listed.tokens)
    tok = _Chars()
    out = sj.generate(target, "def", sampling=greedy, tokenizer=tok)
    assert out.text == [tok.decode(out.tokens[0, :out.lengths[0]])]
    assert sj.generate(target, "def", sampling=greedy, tokenizer=tok,
                       return_text=False).text is None
    # the first greedy token as EOS: the row stops there
    eos = int(out.tokens[0, 0])
    stopped = sj.generate(target, "def", sampling=greedy, tokenizer=_Chars(eos_token_id=eos))
    assert stopped.lengths[0] == 1
    assert engine.tokenizer_eos(_Chars(eos_token_id=0)) == (0,)
    one = sj.generate(target, [3, 4], sampling=sj.SamplingParams(temperature=0, max_new_tokens=1))
    assert one.stats.num_rounds == 0 and "no decode rounds" in str(one.stats)
    assert "tokens/s" not in str(one.stats)  # not "0.0 tokens/s" for a decode that never ran
    sampled = sj.SamplingParams(temperature=1.0, max_new_tokens=16)
    flat = tiny_model(seed=0, vocab_size=32, init_std=0.02)  # near-uniform: draws differ
    fresh = [sj.generate(flat, [[1, 2]], sampling=sampled).tokens for _ in range(2)]
    assert not np.array_equal(*fresh)
    seeded = [sj.generate(flat, [[1, 2]], sampling=sampled, key=5).tokens for _ in range(2)]
    np.testing.assert_array_equal(*seeded)


def test_settings_in_the_spellings_users_bring():
    """vLLM's top_k=-1 is "off"; 0-d arrays pass where numbers do; a bare method name is a spec;
    vLLM's "model" key says how to pass a draft in Python; dtype objects name their dtype; a
    batch given to decode says to decode rows."""
    import jax.numpy as jnp

    from specjax import checkpoint
    from specjax.tokenizer import Tokenizer
    p = sj.SamplingParams(temperature=jnp.float32(0.5), top_k=-1, top_p=np.float32(0.5),
                          max_new_tokens=np.array(5))
    assert (p.temperature, p.top_k, p.top_p, p.max_new_tokens) == (0.5, 0, 0.5, 5)
    assert all(type(x) in (int, float) for x in (p.temperature, p.top_k, p.max_new_tokens))
    for bad in (dict(top_k=-2), dict(temperature=jnp.asarray([0.5]))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            sj.SamplingParams(**bad)
    assert sj.SpecConfig.parse("ngram") == sj.SpecConfig(method="ngram")
    with pytest.raises(ValueError, match="not valid JSON nor a method name"):
        sj.SpecConfig.parse("ngarm")
    with pytest.raises(ValueError, match=r"'model' \('folder'\).*sj.load_draft_model"):
        sj.SpecConfig.parse({"model": "folder", "num_speculative_tokens": 3})
    assert checkpoint.compute_dtype(jnp.float32, "gpu") == "float32"
    assert checkpoint.compute_dtype(np.dtype("float16"), "cpu") == "float16"
    with pytest.raises(ValueError, match="got 'int32'"):
        checkpoint.compute_dtype(jnp.int32, "cpu")
    tok = Tokenizer.__new__(Tokenizer)  # decode refuses a batch before touching its backend
    with pytest.raises(ValueError, match=r"one row of token ids.*tok.decode\(row\)"):
        tok.decode(np.zeros((2, 3), np.int32))


def test_a_repeated_call_traces_and_compiles_nothing(target, draft):
    """The second call of the same shapes runs what the first compiled: no jitted function is
    built per call (each would trace, and compile or read the disk cache, at every request).
    The sharded suite checks the same on a mesh, with a broken variant."""
    kw = dict(draft=draft, spec=sj.SpecConfig(num_speculative_tokens=3),
              sampling=sj.SamplingParams(temperature=0.8, top_k=5, logprobs=2,
                                         stop_token_ids=[[3, 4]], max_new_tokens=10))
    sj.generate(target, [[1, 2, 3], [4, 5, 6, 7]], **kw)
    with traces_and_compiles() as seen:
        sj.generate(target, [[9, 8], [7, 6, 5, 4, 3]], **kw)  # other prompts, a fresh seed
    assert seen == []


@pytest.mark.parametrize("top_k,compiled", [(1, 64), (50, 64), (64, 64), (65, 256), (256, 256),
                                            (257, 1000), (999, 1000), (0, 0), (1000, 0)])
def test_top_k_compiles_the_smallest_bound_that_holds_it(top_k, compiled):
    """A program's static top-k size is the smallest of TOP_K_BOUNDS holding the request's
    top_k (a top_k of 50 must not pay for ranking 256), the whole vocabulary above them, and
    off at 0 or V; values within one bound share the program's plan."""
    config = tiny_config(vocab_size=1000)
    plan, _ = engine.plan_program(config, None, [np.arange(3)],
                                  sj.SamplingParams(temperature=0.8, top_k=top_k), None)
    assert plan.filters.top_k == compiled
    if compiled == 64:
        other, _ = engine.plan_program(config, None, [np.arange(3)],
                                       sj.SamplingParams(temperature=0.8, top_k=17), None)
        assert other == plan
