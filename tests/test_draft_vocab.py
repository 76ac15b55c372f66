"""A draft model restricted to a draft vocabulary (sj.draft.restrict_vocab): it proposes only
tokens of the subset, reports q over the whole vocabulary (zero outside the subset), and decoding
stays greedy-exact and distribution-exact. A deliberately wrong q fails the same test."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import perturbed, ref_process, tiny_model
from test_lossless import (
    exact_joint,
    g_test,
    generate_samples,
    later_samples,
    models,  # noqa: F401  (the fixture: an 8-token target and drafts)
    tail_joints,  # noqa: F401  (the fixture: tokens 5-6's exact joints)
    tail_pvalues,
)

import specjax as sj
from specjax import sampling
from specjax.draft import draft_model, restrict_vocab

GREEDY = sj.SamplingParams(temperature=0.0, max_new_tokens=40)
PROMPTS = [[1, 5, 9], [2], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]]


@pytest.fixture(scope="module")
def noisy(target):
    """The target with perturbed weights: it agrees with the target often, not always."""
    return sj.Model(target.config, perturbed(target.params, 9, 0.03))


@pytest.fixture(scope="module")
def reference(target):
    return sj.generate(target, PROMPTS, sampling=GREEDY)


def half_of_the_target_tokens(target, reference):
    """16 of the 32 ids, holding about half of the tokens greedy decoding emits: the target's
    choice is often outside the draft vocabulary, so those drafts must be rejected."""
    counts = np.bincount(np.asarray(reference.tokens).ravel(), minlength=32)
    ranked = np.argsort(-counts, kind="stable")
    return np.sort(np.concatenate([ranked[:16:2], ranked[16::2][:8]]))


@pytest.mark.parametrize("spec", [dict(num_speculative_tokens=1), dict(num_speculative_tokens=4),
                                  dict(tree=((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))],
                         ids=["gamma1", "gamma4", "tree"])
def test_restricted_draft_is_greedy_exact(target, noisy, reference, spec):
    vocab = half_of_the_target_tokens(target, reference)
    out = sj.generate(target, PROMPTS, sampling=GREEDY, draft=restrict_vocab(noisy, vocab),
                      spec=sj.SpecConfig(method="draft_model", **spec))
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    assert 0.1 < out.stats.acceptance_rate < 0.9, out.stats.acceptance_rate
    emitted = np.asarray(reference.tokens).ravel()
    assert not np.isin(emitted, vocab).all()  # the target did emit tokens the draft cannot


@pytest.mark.parametrize("t,k,p,broken,whole", [(0.0, 0, 1.0, False, False),
                                               (0.8, 0, 1.0, False, False),
                                               (0.8, 3, 0.8, False, False),
                                               (0.8, 3, 0.8, True, False),
                                               (0.8, 3, 0.8, False, True)],
                         ids=["greedy", "T0.8", "T0.8-topk3-topp0.8", "broken", "whole-vocab"])
def test_proposals_come_from_the_draft_vocabulary(target, noisy, t, k, p, broken, whole,
                                                  monkeypatch):
    """Tokens in the subset; q over V sums to one, is zero outside the subset and equals the
    processed draft logits over the subset alone (temperature, top-k, top-p, against conftest's
    numpy reference), at every draft position given the drafts before it (the first from the
    catch-up forward, which computes the logits of its last position only). Deliberately broken,
    a q taken before top-k and top-p while the token was drawn after them (the q a Hugging Face
    candidate generator once returned) fails. ``whole``: the draft unrestricted (its LM head in
    the model's forward)."""
    if broken:
        real = draft_model.draw

        def unfiltered_q(logits, key, params, filters, vocab=None):
            token, _ = real(logits, key, params, filters, vocab)
            return token, sampling.process_logits(logits, params, sampling.Filters())
        monkeypatch.setattr(draft_model, "draw", unfiltered_q)
    vocab = np.arange(32) if whole else np.array([0, 3, 4, 7, 11, 12, 20, 21, 25, 31])
    draft = sj.DraftModel(noisy) if whole else restrict_vocab(noisy, vocab)
    proposer = draft_model.DraftModelProposer(draft.config, 3)
    B, P = 2, 5
    prompts = jnp.asarray([[1, 5, 9, 2, 6], [3, 1, 4, 0, 0]], jnp.int32)
    lengths = jnp.asarray([5, 3], jnp.int32)
    cache = proposer.init(draft, prompts, lengths, 32)
    history = jnp.zeros((B, 32), jnp.int32).at[:, :P].set(prompts)
    arrays = sampling.SamplingArrays(temperature=jnp.full((B,), t, jnp.float32),
                                     top_k=jnp.full((B,), k, jnp.int32),
                                     top_p=jnp.full((B,), p, jnp.float32))
    filters = sampling.Filters(top_k=k, top_p=p < 1.0, greedy=t == 0)
    out, _ = proposer.propose(draft, cache, history, lengths - 1,
                              jax.random.split(jax.random.key(0), B), arrays, filters)
    assert np.isin(np.asarray(out.tokens), vocab).all()
    if t == 0:
        assert out.probs is None
        return
    q = np.asarray(out.probs)  # [B, G, V]
    assert q.dtype == np.float32
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
    outside = np.setdiff1d(np.arange(32), vocab)
    assert (q[..., outside] == 0).all()
    tok = np.asarray(out.tokens)
    assert (np.take_along_axis(q, tok[..., None], -1) > 0).all()
    worst = 0.0
    for b in range(B):
        seq = np.concatenate([np.asarray(prompts[b, :lengths[b]]), tok[b]])
        logits = np.asarray(sj.logits(noisy, seq[None]))[0]  # [len, V]
        for i in range(tok.shape[1]):  # draft i given the prompt and drafts 0 .. i-1
            want = ref_process(logits[int(lengths[b]) - 1 + i, vocab], t, k, p)
            worst = max(worst, np.abs(q[b, i, vocab] - want).max())
    assert (worst > 0.05) if broken else (worst < 1e-4), worst


def test_bad_vocabularies_are_refused(target, draft):
    for vocab, message in [([], "non-empty"), ([0, 32], r"\[0, 32\)"), ([-1, 2], r"\[0, 32\)"),
                           ([1.5, 2.0], "token ids"), ([[1, 2]], "1-D"), ([3, 3], "repeated")]:
        with pytest.raises(ValueError, match=message):
            restrict_vocab(draft, vocab)
    with pytest.raises(ValueError, match="sj.Model"):
        restrict_vocab(draft.params, [1, 2])
    small = restrict_vocab(draft, [1, 2])
    with pytest.raises(ValueError, match="3 children.*2-token draft vocabulary"):
        sj.generate(target, [[1, 2]], sampling=GREEDY, draft=small,
                    spec=sj.SpecConfig(tree=((0,), (1,), (2,))))
    with pytest.raises(ValueError, match="save_model expects an sj.Model, got DraftModel"):
        sj.save_model(small, "/nonexistent/never-written")


def test_restricting_twice_replaces_the_subset(draft):
    twice = restrict_vocab(restrict_vocab(draft, [1, 2, 3]), [4, 5])
    assert twice.vocab_size == 2 and twice.model is draft
    assert sj.DraftModel(draft).vocab_size == 32
    np.testing.assert_array_equal(twice.vocab.ids, [4, 5])


def test_a_restricted_or_mapped_draft_caps_its_logits_as_the_model_does():
    """A model with a final logit soft-cap (Gemma 2) scores its draft vocabulary as its own
    forward does: restricted to all its ids, or mapped onto itself, the draft's logits are the
    model's (the cap was skipped: largest logit 5.5 against 0.5, softmaxes apart by 0.56;
    lossless still, the drawn q being the one verified, but accepting less)."""
    model = tiny_model(seed=3, vocab_size=16, final_logit_softcapping=0.5)
    tokens = jnp.asarray([[1, 4, 2, 7]])
    want = np.asarray(sj.logits(model, tokens))
    _, hidden, _ = sj.forward(model, tokens, jnp.arange(4)[None],
                              sj.KVCache.init(model.config, 1, 4))
    pairs = np.stack([np.arange(16)] * 2, axis=1)
    for draft in (restrict_vocab(model, np.arange(16)),
                  sj.draft.map_vocab(model, 16, pairs)):
        np.testing.assert_allclose(np.asarray(draft.vocab.logits(hidden)), want, atol=1e-5)
    assert np.abs(want).max() <= 0.5


# -- distributions: exact enumeration of the first three tokens on an 8-token vocabulary ------

V8_VOCAB = [0, 2, 3, 5, 6]  # 5 of the 8 ids


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 5, 0.9)], ids=["T1", "T0.7-topk5-topp0.9"])
def test_restricted_draft_follows_the_target(models, t, k, p):
    target, drafts = models
    sampling_params = sj.SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=3)
    samples = generate_samples(target, restrict_vocab(drafts["close"], V8_VOCAB),
                               sampling_params, sj.SpecConfig(num_speculative_tokens=3))
    assert g_test(samples, exact_joint(target, t, k, p)) > 1e-3


def test_widen_puts_each_probability_at_its_id_and_zeros_elsewhere():
    rng = np.random.default_rng(4)
    ids = rng.choice(50, 12, replace=False)  # not sorted
    vocab = sj.DraftVocab(jnp.asarray(ids, jnp.int32), jnp.zeros((4, 12)))
    sub = rng.random((3, 2, 12)).astype(np.float32)
    want = np.zeros((3, 2, 50), np.float32)
    want[..., ids] = sub
    np.testing.assert_array_equal(np.asarray(vocab.widen(jnp.asarray(sub), 50)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(vocab.widen, static_argnums=1)(
        jnp.asarray(sub[0, 0]), 50)), want[0, 0])
    with pytest.raises(ValueError, match=r"must end in its 12 ids, got shape \(3, 2, 11\)"):
        vocab.widen(jnp.zeros((3, 2, 11)), 50)


def _shifted_widen(self, sub, vocab_size):
    """q written to the wrong ids (the subset rolled by one): the verifier sees a q that is not
    the distribution the drafts were drawn from."""
    full = jnp.zeros(sub.shape[:-1] + (vocab_size,), jnp.float32)
    return full.at[..., jnp.roll(self.ids, 1)].set(sub)


def test_a_wrong_q_fails_the_same_test(models, monkeypatch, fresh_programs):
    target, drafts = models
    monkeypatch.setattr(sj.DraftVocab, "widen", _shifted_widen)
    sampling_params = sj.SamplingParams(temperature=1.0, max_new_tokens=3)
    samples = generate_samples(target, restrict_vocab(drafts["close"], V8_VOCAB),
                               sampling_params, sj.SpecConfig(num_speculative_tokens=3))
    assert g_test(samples, exact_joint(target, 1.0, 0, 1.0)) < 1e-6


# -- a draft whose vocabulary is the first ids of the target's (sj.draft.shared_prefix) --------

def first_ids(model, n):
    """``model`` cut to its first n ids: the embedding's rows and the LM head's columns."""
    params = dict(model.params)
    params["embed_tokens"] = {"embedding": params["embed_tokens"]["embedding"][:n]}
    if "lm_head" in params:
        params["lm_head"] = {"kernel": params["lm_head"]["kernel"][:, :n]}
    return sj.Model(dataclasses.replace(model.config, vocab_size=n), params)


@pytest.mark.parametrize("spec", [dict(num_speculative_tokens=4),
                                  dict(tree=((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))],
                         ids=["gamma4", "tree"])
def test_a_shorter_vocabulary_draft_is_greedy_exact(target, noisy, reference, spec):
    """A 24-id draft for the 32-id target: drafts only among its ids, reads the target's later
    ids as the fallback, and decodes exactly as the target alone."""
    short = first_ids(noisy, 24)
    emitted = np.asarray(reference.tokens).ravel()
    assert (emitted >= 24).any()  # the target emits ids the draft does not have
    for draft in (sj.draft.shared_prefix(short, 32),
                  sj.draft.shared_prefix(restrict_vocab(short, np.arange(0, 24, 2)), 32)):
        out = sj.generate(target, PROMPTS, sampling=GREEDY, draft=draft,
                          spec=sj.SpecConfig(method="draft_model", **spec))
        np.testing.assert_array_equal(out.tokens, reference.tokens)
        assert out.stats.accepted_tokens > 0


def test_a_shorter_vocabulary_needs_to_be_declared(target, noisy):
    short = first_ids(noisy, 24)
    with pytest.raises(ValueError, match=r"!= target vocab_size 32.*draft_tokenizer=.*"
                                         r"shared_prefix\(draft, 32\)"):
        sj.generate(target, PROMPTS, sampling=GREEDY, draft=short,
                    spec=sj.SpecConfig(num_speculative_tokens=2))
    with pytest.raises(ValueError, match="target_vocab_size=16 must be an int >= .* 24"):
        sj.draft.shared_prefix(short, 16)
    with pytest.raises(ValueError, match="fallback=24"):
        sj.draft.shared_prefix(short, 32, fallback=24)
    with pytest.raises(ValueError, match="made for a target of vocab_size 40"):
        sj.generate(target, PROMPTS, sampling=GREEDY, draft=sj.draft.shared_prefix(short, 40),
                    spec=sj.SpecConfig(num_speculative_tokens=2))


@pytest.mark.parametrize("tree,t,k,p", [(None, 1.0, 0, 1.0), (None, 0.7, 5, 0.9),
                                        (((0,), (1,), (0, 0), (0, 0, 0)), 0.7, 5, 0.9)],
                         ids=["chain-T1", "chain-T0.7-topk5-topp0.9", "tree-T0.7-topk5-topp0.9"])
def test_a_shorter_vocabulary_draft_follows_the_target(models, t, k, p, tree):
    """A 6-id draft for the 8-id target, at T = 1 and with top-k/top-p."""
    target, drafts = models
    sampling_params = sj.SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=3)
    spec = sj.SpecConfig(num_speculative_tokens=3) if tree is None else sj.SpecConfig(tree=tree)
    samples = generate_samples(target, sj.draft.shared_prefix(first_ids(drafts["close"], 6), 8),
                               sampling_params, spec)
    assert g_test(samples, exact_joint(target, t, k, p)) > 1e-3


def test_a_shorter_vocabulary_draft_with_a_wrong_q_fails(models, monkeypatch, fresh_programs):
    target, drafts = models
    monkeypatch.setattr(sj.DraftVocab, "widen", _shifted_widen)
    sampling_params = sj.SamplingParams(temperature=1.0, max_new_tokens=3)
    samples = generate_samples(target, sj.draft.shared_prefix(first_ids(drafts["close"], 6), 8),
                               sampling_params, sj.SpecConfig(num_speculative_tokens=3))
    assert g_test(samples, exact_joint(target, 1.0, 0, 1.0)) < 1e-6


# -- a draft with a vocabulary of its own: the shared tokens mapped (sj.draft.map_vocab) ------

def permuted(model, perm, size, seed=0):
    """A copy of ``model`` speaking its own ids: its id d is the model's id perm[d] for
    d < len(perm) (the shared tokens); ids len(perm) .. size - 1 are tokens of its own (random
    rows)."""
    rng = np.random.default_rng(seed)
    params = dict(model.params)
    emb = np.asarray(params["embed_tokens"]["embedding"])
    extra = size - len(perm)
    params["embed_tokens"] = {"embedding": jnp.asarray(np.concatenate(
        [emb[perm], rng.normal(0, emb.std(), (extra, emb.shape[1]))]).astype(emb.dtype))}
    if "lm_head" in params:
        head = np.asarray(params["lm_head"]["kernel"])
        params["lm_head"] = {"kernel": jnp.asarray(np.concatenate(
            [head[:, perm], rng.normal(0, head.std(), (head.shape[0], extra))], 1
        ).astype(head.dtype))}
    return sj.Model(dataclasses.replace(model.config, vocab_size=size), params)


@pytest.mark.parametrize("spec", [dict(num_speculative_tokens=4),
                                  dict(tree=((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))],
                         ids=["gamma4", "tree"])
def test_a_draft_with_its_own_vocabulary_is_greedy_exact(target, noisy, reference, spec):
    """A 28-id draft sharing 24 tokens with the 32-id target, in another order."""
    perm = np.random.default_rng(1).permutation(32)[:24]
    own = permuted(noisy, perm, 28)
    pairs = np.stack([np.arange(24), perm], 1)
    draft = sj.draft.map_vocab(own, 32, pairs)
    out = sj.generate(target, PROMPTS, sampling=GREEDY, draft=draft,
                      spec=sj.SpecConfig(method="draft_model", **spec))
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    # the map is what makes it agree: the same draft with its pairs shuffled is read wrongly
    wrong = sj.draft.map_vocab(own, 32, np.stack([np.arange(24), np.roll(perm, 5)], 1))
    misread = sj.generate(target, PROMPTS, sampling=GREEDY, draft=wrong,
                          spec=sj.SpecConfig(method="draft_model", **spec))
    np.testing.assert_array_equal(misread.tokens, reference.tokens)  # still exact
    assert out.stats.acceptance_rate > 2 * misread.stats.acceptance_rate, (
        out.stats.acceptance_rate, misread.stats.acceptance_rate)


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 5, 0.9)], ids=["T1", "T0.7-topk5-topp0.9"])
def test_a_draft_with_its_own_vocabulary_follows_the_target(models, t, k, p):
    """A 7-id draft sharing 5 of the 8-id target's tokens, permuted."""
    target, drafts = models
    perm = np.array([4, 0, 7, 2, 5])
    draft = sj.draft.map_vocab(permuted(drafts["close"], perm, 7), 8,
                               np.stack([np.arange(5), perm], 1))
    sampling_params = sj.SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=3)
    samples = generate_samples(target, draft, sampling_params,
                               sj.SpecConfig(num_speculative_tokens=3))
    assert g_test(samples, exact_joint(target, t, k, p)) > 1e-3


@pytest.mark.parametrize("which", ["restricted", "own-vocabulary"])
def test_later_tokens_follow_the_target_in_a_mixed_batch(models, tail_joints, which):
    """Tokens 5 and 6 of rows alternating between two prompt lengths, several rounds: the draft
    catches up on accepted, recovered and bonus tokens it could not have proposed (3 of the 8
    ids are outside its vocabulary)."""
    target, drafts = models
    if which == "restricted":
        draft = restrict_vocab(drafts["close"], V8_VOCAB)
    else:
        perm = np.array([4, 0, 7, 2, 5])
        draft = sj.draft.map_vocab(permuted(drafts["close"], perm, 7), 8,
                                   np.stack([np.arange(5), perm], 1))
    out = later_samples(target, draft, 3)
    assert out.stats.per_position_acceptance[1] > 0.02  # rounds with 2+ accepted drafts occur
    assert min(tail_pvalues(out.tokens, tail_joints)) > 1e-3


def test_a_draft_with_its_own_vocabulary_and_a_wrong_q_fails(models, monkeypatch,
                                                             fresh_programs):
    target, drafts = models
    perm = np.array([4, 0, 7, 2, 5])
    draft = sj.draft.map_vocab(permuted(drafts["close"], perm, 7), 8,
                               np.stack([np.arange(5), perm], 1))
    monkeypatch.setattr(sj.DraftVocab, "widen", _shifted_widen)
    samples = generate_samples(target, draft, sj.SamplingParams(temperature=1.0,
                                                                max_new_tokens=3),
                               sj.SpecConfig(num_speculative_tokens=3))
    assert g_test(samples, exact_joint(target, 1.0, 0, 1.0)) < 1e-6


def test_bad_vocabulary_maps_are_refused(noisy):
    own = first_ids(noisy, 24)
    for pairs, message in [([[0, 1], [0, 2]], "repeat a draft id"),
                           ([[0, 1], [1, 1]], "repeat a target id"),
                           ([[24, 1]], r"draft id outside \[0, 24\)"),
                           ([[0, 32]], r"target id outside \[0, 32\)"),
                           ([], "non-empty"), ([[0.5, 1.0]], "ints")]:
        with pytest.raises(ValueError, match=message):
            sj.draft.map_vocab(own, 32, pairs)
    mapped = sj.draft.map_vocab(own, 32, [[0, 3], [1, 4]])
    with pytest.raises(ValueError, match="restrict it first"):
        restrict_vocab(mapped, [0, 1])
    with pytest.raises(ValueError, match="already maps"):
        sj.draft.map_vocab(mapped, 32, [[0, 3]])
    with pytest.raises(ValueError, match="no pair's draft id"):
        sj.draft.map_vocab(restrict_vocab(own, [5, 6]), 32, [[0, 3]])


def _word_tokenizer(tokens, pre_tokenizer):
    import tokenizers
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {t: i for i, t in enumerate(tokens)}, unk_token=tokens[0]))
    backend.pre_tokenizer = pre_tokenizer
    backend.add_special_tokens(["<eos>"])
    return sj.Tokenizer(backend, None, ())


def test_token_pairs_match_tokens_by_their_bytes():
    """A byte-level vocabulary (Ġ for a space, byte characters) against a SentencePiece-style one
    (▁ for a space, <0xNN> byte pieces): the same bytes pair up, whatever the spelling; special
    tokens pair with special tokens only."""
    import tokenizers
    byte_level = _word_tokenizer(["<unk>", "\u0120the", "the", "A", "\u0120x", "<eos>"],
                                 tokenizers.pre_tokenizers.ByteLevel())
    piece = _word_tokenizer(["<unk>", "x", "\u2581the", "<0x41>", "the", "q"],
                            tokenizers.pre_tokenizers.Metaspace())
    pairs = {tuple(p) for p in sj.draft.token_pairs(piece, byte_level).tolist()}
    # <unk> (a plain token in both), "▁the" = "Ġthe", "<0x41>" = "A", "the", and the special
    # <eos> (id 5 of the byte-level one: adding a special token that is already in the
    # vocabulary keeps its id)
    assert pairs == {(0, 0), (2, 1), (3, 3), (4, 2), (6, 5)}, pairs


def _plain_word_tokenizer(tokens):
    """A WordLevel tokenizer over ``tokens`` (id = position), no special tokens, no EOS."""
    import tokenizers
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {t: i for i, t in enumerate(tokens)}, unk_token=tokens[0]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return sj.Tokenizer(backend, None, ())


def test_generate_pairs_a_draft_with_its_own_tokenizer(target, noisy, reference):
    """generate(..., draft_tokenizer=) maps the draft by its tokenizer: the same output and
    acceptance as map_vocab with the true pairs; refused without the target's tokenizer or for
    a method without a draft model; the target's own tokenizer leaves the draft as it is."""
    perm = np.random.default_rng(1).permutation(32)[:24]
    words = [f"w{i}" for i in range(32)]
    target_tok = _plain_word_tokenizer(words)
    draft_tok = _plain_word_tokenizer([words[i] for i in perm] + [f"own{i}" for i in range(4)])
    own = permuted(noisy, perm, 28)
    spec = sj.SpecConfig(method="draft_model", num_speculative_tokens=4)
    out = sj.generate(target, PROMPTS, sampling=GREEDY, draft=own, spec=spec,
                      tokenizer=target_tok, draft_tokenizer=draft_tok)
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    by_hand = sj.generate(target, PROMPTS, sampling=GREEDY, spec=spec,
                          draft=sj.draft.map_vocab(own, 32, np.stack([np.arange(24), perm], 1)))
    assert out.stats.acceptance_rate == by_hand.stats.acceptance_rate > 0.1
    assert sj.draft.for_tokenizers(own, draft_tok, target_tok, 32) is \
        sj.draft.for_tokenizers(own, draft_tok, target_tok, 32)  # paired once
    assert sj.draft.for_tokenizers(noisy, target_tok, target_tok, 32) is not None
    assert isinstance(sj.draft.for_tokenizers(noisy, target_tok, target_tok, 32), sj.DraftModel)
    assert sj.draft.for_tokenizers(noisy, target_tok, target_tok, 32).from_target is None
    # one tokenizer on both sides, models with rows past its ids (Qwen: 151,936 rows for
    # 151,665 ids): the draft as it is, not mapped (an LM-head copy and the spelled chain)
    fewer = _plain_word_tokenizer(words[:28])
    assert sj.draft.for_tokenizers(noisy, fewer, fewer, 32).from_target is None
    with pytest.raises(ValueError, match="pass the target's tokenizer="):
        sj.generate(target, PROMPTS, sampling=GREEDY, draft=own, spec=spec,
                    draft_tokenizer=draft_tok)
    with pytest.raises(ValueError, match="draft_tokenizer= is for a draft model.*ngram"):
        sj.generate(target, PROMPTS, sampling=GREEDY, spec=sj.SpecConfig(method="ngram"),
                    tokenizer=target_tok, draft_tokenizer=draft_tok)
    with pytest.raises(ValueError, match="must be an sj.Tokenizer"):
        sj.generate(target, PROMPTS, sampling=GREEDY, draft=own, spec=spec,
                    tokenizer=target_tok, draft_tokenizer="gpt2")
    with pytest.raises(ValueError, match="share no token"):
        sj.generate(target, PROMPTS, sampling=GREEDY, draft=own, spec=spec, tokenizer=target_tok,
                    draft_tokenizer=_plain_word_tokenizer([f"x{i}" for i in range(28)]))


def test_vocab_coverage_is_the_mass_on_the_shared_tokens(target, noisy):
    """The two masses against a plain numpy computation over the models' full logits."""
    perm = np.random.default_rng(1).permutation(32)[:24]
    own = permuted(noisy, perm, 28)
    draft = sj.draft.map_vocab(own, 32, np.stack([np.arange(24), perm], 1))
    sequences = [[1, 5, 9, 2], [3, 1, 4, 1, 5, 9, 2, 6]]
    got = sj.draft.vocab_coverage(target, draft, sequences)

    def mass(model, ids, shared):
        logits = np.asarray(sj.model.logits(model, np.asarray([ids])), np.float64)[0]
        p = np.exp(logits - logits.max(-1, keepdims=True))
        return (p[:, shared].sum(-1) / p.sum(-1)).sum()
    inverse = {int(t): d for d, t in enumerate(perm)}
    want_t = sum(mass(target, s, perm) for s in sequences) / 12
    want_d = sum(mass(own, [inverse.get(t, 0) for t in s], np.arange(24)) for s in sequences) / 12
    assert got["positions"] == 12 and got["shared_tokens"] == 24
    np.testing.assert_allclose([got["target_mass"], got["draft_mass"]], [want_t, want_d],
                               rtol=1e-4)
    assert 0.3 < got["target_mass"] < 0.99 and 0.3 < got["draft_mass"] < 0.99
    whole = sj.draft.shared_prefix(noisy, 32)  # every token shared: all the mass
    np.testing.assert_allclose(list(sj.draft.vocab_coverage(target, whole, sequences).values())[:2],
                               [1.0, 1.0], rtol=1e-5)
    with pytest.raises(ValueError, match="needs a draft mapped"):
        sj.draft.vocab_coverage(target, noisy, sequences)
