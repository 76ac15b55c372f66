"""A draft with a tokenizer of its own that reads the target's tokens re-encoded: each accepted
target token becomes its spelling in the draft's tokens (sj.draft.token_spellings,
map_vocab(..., spelling=)), so the draft's cache holds the text in its own tokenization.

The tokenizers are built here: byte-level vocabularies over a few letters and the two bytes of
"é" (written "Ã©" in the byte alphabet), where the target has tokens the draft must spell with
two or three of its own, including a token that ends inside "é"."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from test_draft_vocab import (
    GREEDY,
    PROMPTS,
    _shifted_widen,
    _word_tokenizer,
    noisy,  # noqa: F401  (the fixture: the 32-token target, perturbed)
    permuted,
)
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
from specjax.cache import KVCache
from specjax.draft import draft_model
from specjax.model import forward

# 32 target tokens: the draft shares the first 12 and spells the other 20 with two or more.
TARGET_32 = ["a", "b", "c", "\u0120", "\u00c3", "\u00a9", "ab", "\u0120a", "ba", "ca", "bc",
             "<eos>", "abc", "\u00c3\u00a9", "\u0120ab", "cab", "aa", "bb", "cc", "\u0120b",
             "\u0120c", "\u0120\u00c3\u00a9", "\u00c3\u00a9a", "abab", "bca", "ac", "cb",
             "\u0120bc", "\u00a9a", "b\u00c3", "aab", "\u0120\u0120"]
DRAFT_OWN = ["zz", "qq", "xyz", "\u0120z"]  # the draft's tokens the target lacks


def tokenizer(tokens):
    return _word_tokenizer(tokens, tokenizers.pre_tokenizers.ByteLevel())


def written(tokens, ids):
    """The bytes a byte-level token list writes for ``ids``."""
    from specjax.draft.vocab import _byte_level_alphabet
    alphabet = _byte_level_alphabet()
    return b"".join(bytes(alphabet[c] for c in tokens[i]) for i in ids)


def spelled_pair(model, target_tokens, shared, seed=0):
    """``model`` (the target's shape) as a draft with its own tokenizer: its first ``shared``
    ids are the target's first ones in another order, then tokens of its own. Returns the
    draft tokenizer, the target tokenizer, the permuted draft model and the draft's tokens."""
    perm = np.random.default_rng(seed).permutation(shared)
    draft_tokens = [target_tokens[i] for i in perm] + DRAFT_OWN
    own = None if model is None else permuted(model, perm, len(draft_tokens), seed)
    return tokenizer(draft_tokens), tokenizer(target_tokens), own, draft_tokens


def test_spellings_write_each_target_token_in_draft_tokens():
    draft_tok, target_tok, _, draft_tokens = spelled_pair(None, TARGET_32, 12)
    spelling = sj.draft.token_spellings(draft_tok, target_tok, 32)
    assert spelling.shape == (32, 3)  # "ĠÃ©" takes three: "Ġ" "Ã" "©"
    for t in range(32):
        ids = spelling[t][spelling[t] >= 0]
        if TARGET_32[t] == "<eos>":
            assert ids.tolist() == [draft_tokens.index("<eos>")]
            continue
        assert written(draft_tokens, ids) == written(TARGET_32, [t]), (t, ids)
        shared = TARGET_32[t] in draft_tokens
        assert (len(ids) == 1) == shared, (TARGET_32[t], ids)
    assert spelling[TARGET_32.index("abab")].tolist() == [draft_tokens.index("ab")] * 2 + [-1]
    # the token that ends inside "é" ("b" and the first byte of é) is spelled too
    row = spelling[TARGET_32.index("b\u00c3")]
    assert written(draft_tokens, row[row >= 0]) == b"b\xc3"
    # a longer spelling than max_tokens keeps its start
    short = sj.draft.token_spellings(draft_tok, target_tok, 32, max_tokens=2)
    assert short.shape == (32, 2)
    np.testing.assert_array_equal(short, spelling[:, :2])
    with pytest.raises(ValueError, match="max_tokens=0"):
        sj.draft.token_spellings(draft_tok, target_tok, 32, max_tokens=0)


@pytest.fixture(scope="module")
def spelled(noisy):
    draft_tok, target_tok, own, draft_tokens = spelled_pair(noisy, TARGET_32, 12)
    draft = sj.draft.for_tokenizers(own, draft_tok, target_tok, 32)
    return draft, draft_tok, target_tok, own, draft_tokens


def reference_logits(draft, ids):
    """The draft's logits over its draft vocabulary (its shared tokens, or its whole one) after
    reading ``ids`` (its own) in one forward from an empty cache: what the chain's cache must
    reproduce."""
    n, width = len(ids), 128  # one shape for every text (causal: the padding is not read)
    assert n <= width
    logits, hidden, _ = forward(draft.model, jnp.asarray([list(ids) + [0] * (width - n)],
                                                         jnp.int32),
                                jnp.arange(width, dtype=jnp.int32)[None],
                                KVCache.init(draft.config, 1, width))
    return np.asarray(logits[0, n - 1] if draft.vocab is None
                      else draft.vocab.logits(hidden[0, n - 1]))


def started(target, draft, gamma, lengths, first, seed, S=64):
    """A chain proposer for ``draft`` at γ after its ``init`` on random prompts of ``lengths``
    tokens, with the first generated tokens ``first``: (proposer, state, history [B, S], each
    row's length)."""
    proposer = draft_model.build(sj.SpecConfig(method="draft_model",
                                               num_speculative_tokens=gamma), draft,
                                 target.config)
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    B, N = len(lengths), int(lengths.max())
    history = np.zeros((B, S), np.int32)
    for b in range(B):
        history[b, :lengths[b]] = rng.integers(0, 32, lengths[b])
    state = proposer.init(draft, jnp.asarray(history[:, :N]), jnp.asarray(lengths), S)
    history[np.arange(B), lengths] = first
    return proposer, state, history, lengths.copy()


@pytest.mark.parametrize("gamma", [1, 3])
def test_the_chain_reads_the_text_in_its_own_tokens(target, spelled, gamma):
    """Round after round, with every number of drafts accepted (0..γ) and corrections the
    draft cannot write in one token, each proposed q equals the draft's distribution after
    reading the whole text spelled in its tokens from scratch (one forward, no cache): the
    cache's bookkeeping (where each target token begins among the draft's slots) is right."""
    draft = spelled[0]
    spelling = np.asarray(draft.spelling)
    proposer, state, history, length = started(target, draft, gamma, [6, 2, 4], [13, 23, 2], 0)
    assert isinstance(proposer, draft_model.SpelledChainProposer)
    B = len(length)
    rng = np.random.default_rng(0)
    arrays = sampling.SamplingArrays(temperature=jnp.ones((B,), jnp.float32),
                                     top_k=jnp.zeros((B,), jnp.int32),
                                     top_p=jnp.ones((B,), jnp.float32))
    filters = sampling.Filters(greedy=False)
    seen_accepts = set()
    for round_ in range(8):
        keys = jax.random.split(jax.random.key(round_), B)
        out, state = proposer.propose(draft, state, jnp.asarray(history), jnp.asarray(length),
                                      keys, arrays, filters)
        tokens, q = np.asarray(out.tokens), np.asarray(out.probs)
        shared_ids = np.asarray(draft.vocab.ids)
        for b in range(B):
            text = [d for t in history[b, :length[b] + 1] for d in spelling[t] if d >= 0]
            for i in range(gamma):
                drafted = [int(np.asarray(draft.from_target)[t]) for t in tokens[b, :i]]
                want = jax.nn.softmax(reference_logits(draft, text + drafted))
                np.testing.assert_allclose(q[b, i, shared_ids], want, atol=2e-5,
                                           err_msg=f"round {round_} row {b} draft {i}")
        accepted = rng.integers(0, gamma + 1, B)
        for b in range(B):
            n = accepted[b]
            seen_accepts.add(int(n))
            history[b, length[b] + 1:length[b] + 1 + n] = tokens[b, :n]
            # a correction from the tokens the draft must spell (ids 12..31) or shares
            history[b, length[b] + 1 + n] = rng.integers(0, 32)
            length[b] += n + 1
    assert seen_accepts == set(range(gamma + 1))


def test_a_spelled_draft_is_greedy_exact(target, spelled):
    draft, draft_tok, target_tok, own, _ = spelled
    reference = sj.generate(target, PROMPTS, sampling=GREEDY)
    spec = sj.SpecConfig(method="draft_model", num_speculative_tokens=4)
    out = sj.generate(target, PROMPTS, sampling=GREEDY, draft=own, spec=spec,
                      tokenizer=target_tok, draft_tokenizer=draft_tok)
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    emitted = np.asarray(reference.tokens).ravel()
    assert (emitted >= 12).any()  # the target wrote tokens the draft has to spell
    assert out.stats.acceptance_rate > 0.1, out.stats.acceptance_rate


# -- the distribution, on the 8-token target of test_lossless ---------------------------------

TARGET_8 = ["a", "b", "\u00c3", "\u00a9", "<eos>", "ab", "\u00c3\u00a9", "b\u00c3"]


def spelled_8(models):
    target, drafts = models
    draft_tok, target_tok, own, _ = spelled_pair(drafts["close"], TARGET_8, 5, seed=3)
    return target, sj.draft.for_tokenizers(own, draft_tok, target_tok, 8)


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 5, 0.9)], ids=["T1", "T0.7-topk5-topp0.9"])
def test_a_spelled_draft_follows_the_target(models, t, k, p):
    """Five of the 8 target tokens shared, three spelled with two draft tokens each."""
    target, draft = spelled_8(models)
    assert int((np.asarray(draft.spelling) >= 0).sum(1).max()) == 2
    sampling_params = sj.SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=3)
    samples = generate_samples(target, draft, sampling_params,
                               sj.SpecConfig(num_speculative_tokens=3))
    assert g_test(samples, exact_joint(target, t, k, p)) > 1e-3


def test_a_spelled_drafts_later_tokens_follow_the_target(models, tail_joints):
    """Tokens 5 and 6 of a mixed batch over several rounds: the draft's cache holds the kept
    text spelled in its own tokens (two for three of the target's), so rows drift apart in
    draft slots as well as in target slots."""
    target, draft = spelled_8(models)
    out = later_samples(target, draft, 3)
    assert out.stats.per_position_acceptance[1] > 0.02
    assert min(tail_pvalues(out.tokens, tail_joints)) > 1e-3


def test_a_spelled_draft_with_a_wrong_q_fails(models, monkeypatch, fresh_programs):
    target, draft = spelled_8(models)
    monkeypatch.setattr(sj.DraftVocab, "widen", _shifted_widen)
    samples = generate_samples(target, draft, sj.SamplingParams(temperature=1.0,
                                                                max_new_tokens=3),
                               sj.SpecConfig(num_speculative_tokens=3))
    assert g_test(samples, exact_joint(target, 1.0, 0, 1.0)) < 1e-6


def test_bad_spellings_are_refused(target, spelled):
    _, _, _, own, _ = spelled
    pairs = [[0, 3], [1, 4]]
    for spelling, message in [(np.zeros((31, 2), np.int32), r"\[32, K\]"),
                              (np.full((32, 2), 0.5), r"\[32, K\]"),
                              (np.full((32, 2), 99), r"outside \[0, 16\)"),
                              (np.full((32, 2), -2), r"outside \[0, 16\)"),
                              (np.tile([-1, 0], (32, 1)), "row 0 must start"),
                              (np.tile([0, -1, 1], (32, 1)), "row 0 must start")]:
        with pytest.raises(ValueError, match=message):
            sj.draft.map_vocab(own, 32, pairs, spelling=spelling)


# -- a text that spells longer than the draft's cache --------------------------------------------

def _spelled_length(draft, ids):
    return int((np.asarray(draft.spelling)[np.asarray(ids)] >= 0).sum())


def test_a_text_spelled_past_the_draft_cache_keeps_the_output(target, spelled, monkeypatch,
                                                              fresh_programs):
    """With one draft slot per target token, prompts of tokens the draft spells with two or
    three overflow the draft cache at prefill and every round after: the draft reads the
    text's start and its newest tokens, and the output is still the target's greedy one."""
    draft, draft_tok, target_tok, _, _ = spelled
    monkeypatch.setattr(draft_model, "SPELLED_SLOTS", 1)
    prompts = [list(range(12, 31)) * 3, [2], [12, 13, 14]]
    reference = sj.generate(target, prompts, sampling=GREEDY)
    spec = sj.SpecConfig(method="draft_model", num_speculative_tokens=4)
    out = sj.generate(target, prompts, sampling=GREEDY, draft=draft, spec=spec,
                      max_cache_len=len(prompts[0]) + GREEDY.max_new_tokens + 4)
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    # the cache really overflowed: the catch-up may start at one slot per target slot at most,
    # fewer than the first row's prompt spelled
    assert _spelled_length(draft, prompts[0]) > out.stats.capacity, out.stats.capacity
    assert out.stats.acceptance_rate > 0.05, out.stats.acceptance_rate


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "wrong-q"])
def test_a_spelled_draft_past_its_cache_follows_the_target(models, monkeypatch, fresh_programs,
                                                           broken):
    """The 8-token target with a prompt whose spelling overflows a one-slot-per-token draft
    cache: the first three tokens keep their exact joint distribution (and a q that is not the
    one drafts were drawn from is caught)."""
    target, draft = spelled_8(models)
    monkeypatch.setattr(draft_model, "SPELLED_SLOTS", 1)
    if broken:
        monkeypatch.setattr(sj.DraftVocab, "widen", _shifted_widen)
    prompt = [5, 6, 7, 5, 6, 7, 5]  # 14 draft tokens, for 7 + 3 + 3 target slots
    assert _spelled_length(draft, prompt) == 14
    samples = generate_samples(target, draft, sj.SamplingParams(temperature=1.0,
                                                                max_new_tokens=3),
                               sj.SpecConfig(num_speculative_tokens=3), prompt=prompt)
    p = g_test(samples, exact_joint(target, 1.0, 0, 1.0, prompt=prompt))
    assert (p < 1e-6) if broken else (p > 1e-3), p


def test_past_the_cache_the_catch_up_starts_at_its_last_usable_slot(target, spelled, monkeypatch):
    """With one slot per target token and tokens the draft spells with two or three, the text
    outgrows the cache within a few rounds: from then on each catch-up starts at the limit (the
    slot it reads its newest token from never passes it), and the drafts' q stay distributions."""
    draft = spelled[0]
    monkeypatch.setattr(draft_model, "SPELLED_SLOTS", 1)
    gamma, S = 3, 40
    proposer, state, history, length = started(target, draft, gamma, [6, 2], [13, 23], 0, S=S)
    limit = proposer.limit(state.cache.capacity)
    arrays = sampling.SamplingArrays(temperature=jnp.ones((2,), jnp.float32),
                                     top_k=jnp.zeros((2,), jnp.int32),
                                     top_p=jnp.ones((2,), jnp.float32))
    rng = np.random.default_rng(1)
    at_limit = 0
    while length.max() + gamma + 2 < S:
        keys = jax.random.split(jax.random.key(int(length.sum())), 2)
        out, state = proposer.propose(draft, state, jnp.asarray(history), jnp.asarray(length),
                                      keys, arrays, sampling.Filters(greedy=False))
        read = np.asarray((np.asarray(draft.spelling)[history[np.arange(2), length]] >= 0).sum(1))
        start = np.asarray(state.after) - read  # where this catch-up read the newest token
        assert (start <= limit).all(), (start, limit)
        at_limit += int((start == limit).sum())
        q = np.asarray(out.probs)
        assert np.isfinite(q).all() and np.allclose(q.sum(-1), 1, atol=1e-5)
        for b in range(2):  # no draft accepted, a correction the draft spells with 2 or 3
            history[b, length[b] + 1] = rng.integers(12, 32)
            length[b] += 1
    assert at_limit > 5, at_limit
