"""Suffix decoding (issue 22): the on-device matching and tree against a plain Python reference
(random streams, a corpus that evicts), greedy equality with autoregressive decoding, the
distribution of sampled tokens (and a broken verifier that fails the same test), no
recompilation as the corpus fills, bad settings, and the corpus's save/load round trip."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from test_lossless import (  # noqa: F401
    PROMPT,
    N,
    _same_keys_every_round,
    exact_joint,
    g_test,
    later_samples,
    models,
    tail_joints,
    tail_pvalues,
)

import specjax as sj
from specjax import engine, verify
from specjax.draft import base, suffix
from specjax.tree import Tree

# -- the proposer against a reference -----------------------------------------------------------


def reference(tree: Tree, history, length, corpus, write, P, factor, min_prob, M, min_match=1,
              own_factor=None):
    """Per row, (tokens, valid) by the rule in specjax/draft/suffix.py, written plainly."""
    out_tokens, out_valid = [], []
    C, D = len(corpus), tree.depth
    for row, last in zip(history, length):
        S = len(row)
        want = [row[last - i] if last - i >= 0 else -1 for i in range(P)]

        def run(src, e, want=want):
            k = 0
            while k < P and e - k >= 0 and want[k] >= 0 and src[e - k] == want[k]:
                k += 1
            return k

        occ = []  # (score, match length, continuation)
        span = C + S
        own_longest = max((run(row, e) for e in range(last)), default=0)
        for e in range(S):
            r = run(row, e) if e < last else 0
            cont = []
            for j in range(1, D + 1):
                if e + j > last or (cont and cont[-1] < 0):
                    cont.append(-1)
                else:
                    cont.append(int(row[e + j]))
            occ.append((r * span + C + e, r, cont))
        for e in range(C):
            r = run(corpus, e)
            cont, ended = [], False
            for j in range(1, D + 1):
                t = int(corpus[e + j]) if e + j < C else -1
                ended = ended or t < 0
                cont.append(-1 if ended else t)
            occ.append((r * span + (e - write) % C, r, cont))
        occ.sort(key=lambda x: -x[0])
        occ = occ[:M]
        longest = occ[0][1]
        support = [o[1] == longest and longest >= min_match for o in occ]
        from_own = own_factor is not None and own_longest == longest
        cap = int(np.ceil((own_factor if from_own else factor) * longest))
        tokens, valid = fill_reference(tree, [o[2] for o in occ], support, min_prob, cap)
        out_tokens.append(tokens)
        out_valid.append(valid)
    return np.array(out_tokens), np.array(out_valid)


def fill_reference(tree: Tree, conts, support, min_prob=0.0, cap=None):
    """The breadth-first most-frequent fill (specjax.draft.base.fill_by_count), plainly:
    candidates' continuations conts [M][D], support [M] -> (tokens, valid) per node."""
    agree, count, ok, tokens, valid = {0: list(support)}, {0: sum(support)}, {0: True}, [], []
    for i, path in enumerate(tree.paths, start=1):
        d, rank, parent = len(path), path[-1], int(tree.parents[i])
        freq, order = {}, []
        for m, c in enumerate(conts):
            t = c[d - 1]
            if agree[parent][m] and t >= 0:
                if t not in freq:
                    order.append((t, m))
                freq[t] = freq.get(t, 0) + 1
        ranked = sorted(order, key=lambda tm: (-freq[tm[0]], tm[1]))
        token, n = (ranked[rank][0], freq[ranked[rank][0]]) if rank < len(ranked) else (0, 0)
        v = (ok[parent] and n > 0 and n / max(count[parent], 1) >= min_prob
             and (cap is None or d <= cap))
        agree[i] = [agree[parent][m] and conts[m][d - 1] == token for m in range(len(conts))]
        count[i], ok[i] = n, v
        tokens.append(token if v else 0)
        valid.append(v)
    return tokens, valid


TREES = [((0,), (0, 0), (0, 0, 0)), ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)),
         tuple(suffix.branching_tree(4).paths)]


@pytest.mark.parametrize("paths", TREES, ids=["chain", "wide", "branching"])
@pytest.mark.parametrize("seed", range(6))
def test_the_proposer_matches_a_python_reference(paths, seed):
    rng = np.random.default_rng(seed)
    V, S, B = 4, 40, 6  # a small vocabulary: many matches, many ties
    big = seed >= 4  # a corpus of several blocks (suffix.BLOCK): the newest hits picked by block
    cache = suffix.SuffixCache(2500 if big else 48)
    for _ in range(rng.integers(3, 12) * (40 if big else 1)):  # usually more than fits: the
        cache.add([rng.integers(0, V, size=rng.integers(1, 14))])  # oldest are evicted
    history = rng.integers(0, V, size=(B, S)).astype(np.int32)
    length = rng.integers(0, S, size=B).astype(np.int32)
    P, factor, min_prob, M = int(rng.integers(1, 6)), float(rng.choice([0.5, 1.0, 2.0])), \
        float(rng.choice([0.0, 0.2, 0.5])), int(rng.choice([8, 64]))
    if big:  # many occurrences: a share threshold would often leave nothing to compare; 8
        min_prob, M = 0.0, 8  # kept, so 8 blocks of the 2,560 positions are looked at
    tree = Tree(paths)
    min_match = min(P, 1 + seed % 3)
    own_factor = [None, 3.0, 0.5][seed % 3]  # own-text matches drafting deeper, shallower, alike
    proposer = suffix.SuffixProposer(tree, P, factor, min_prob, M, min_match,
                                     own_spec_factor=own_factor)
    use_cache = seed % 2 == 0 or big
    params = cache.params if use_cache else None
    draft, _ = jax.jit(lambda p, h, n: proposer.propose(p, None, h, n, None, None, None))(
        params, jnp.asarray(history), jnp.asarray(length))
    want_tokens, want_valid = reference(
        tree, history, length, cache._tokens if use_cache else np.zeros(0, np.int32),
        cache._write, P, factor, min_prob, M, min_match, own_factor)
    np.testing.assert_array_equal(np.asarray(draft.valid), want_valid)
    np.testing.assert_array_equal(np.asarray(draft.tokens), want_tokens)
    assert want_valid.any()  # the case proposes something


@pytest.mark.parametrize("paths", [tuple((0,) * d for d in range(1, 6)), TREES[1]],
                         ids=["chain", "wide"])
def test_the_fill_matches_a_python_reference(paths):
    """fill_by_count alone (a chain takes its own, lexicographic route): 64 random cases of
    16 candidates over 3 tokens, where the most frequent continuation at depth >= 2 is often
    not the earliest candidate's."""
    tree, rng = Tree(paths), np.random.default_rng(7)
    B, M, D = 64, 16, 6
    conts = rng.integers(0, 3, size=(B, M, D))
    conts[rng.random((B, M, D)) < 0.05] = -1  # some continuations end early
    conts = np.where(np.cumsum(conts < 0, axis=2) > 0, -1, conts).astype(np.int32)
    support = rng.random((B, M)) < 0.7
    cap = rng.integers(0, D + 1, size=B).astype(np.int32)
    for min_share in (0.0, 0.4):
        tokens, valid = jax.jit(lambda c, s, k, ms=min_share: base.fill_by_count(
            tree, c, s, min_share=ms, depth_cap=k))(conts, support, cap)
        for b in range(B):
            want = fill_reference(tree, conts[b].tolist(), support[b].tolist(), min_share, cap[b])
            np.testing.assert_array_equal(np.asarray(tokens[b]), want[0])
            np.testing.assert_array_equal(np.asarray(valid[b]), want[1])
        assert np.asarray(valid)[:, 2:].any()  # deep nodes are proposed, so compared


@pytest.mark.parametrize("length", [40, 128, 1000, 3000])
def test_newest_hits_are_the_newest(length):
    """suffix.newest_hits against a plain count: the M newest hits, ranked newest first, for
    sparse and dense hits over one block or many (and a length that is not a whole block)."""
    rng = np.random.default_rng(length)
    for density in (0.002, 0.05, 0.5):
        hit = rng.random((5, length)) < density
        hit[0] = False  # a row without hits
        for M in (1, 4, 16):
            rank, slot, seen = jax.jit(suffix.newest_hits, static_argnums=1)(hit, M)
            rank, slot = np.asarray(rank), np.asarray(slot)
            np.testing.assert_array_equal(np.asarray(seen), hit.sum(axis=1))
            for b in range(5):
                want = np.flatnonzero(hit[b])[::-1][:M]
                kept = rank[b] < M
                np.testing.assert_array_equal(np.sort(rank[b][kept]), np.arange(want.size))
                np.testing.assert_array_equal(slot[b][kept][np.argsort(rank[b][kept])], want)


def test_the_cache_evicts_the_oldest_and_keeps_documents_whole():
    cache = suffix.SuffixCache(16, vocab_size=10)
    cache.add([[1, 2, 3, 4, 5], [6, 7, 8]])  # slots 0-5, 6-9
    assert list(cache._tokens[:10]) == [1, 2, 3, 4, 5, -1, 6, 7, 8, -1]
    cache.add([[9, 9, 9, 9, 9, 9, 9]])  # does not fit after slot 10: starts over at 0
    assert list(cache._tokens[:8]) == [9] * 7 + [-1] and list(cache._tokens[10:]) == [-1] * 6
    assert cache._tokens[8] == 8  # an older document's tail survives until overwritten
    cache.add([list(range(10)) * 3])  # longer than the ring: its last 15 tokens
    assert list(cache._tokens) == [5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1]
    with pytest.raises(ValueError, match="token id 12 is outside"):
        cache.add([[1, 12]])


# -- end to end ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=3, vocab_size=24, hidden_size=32, layers=2, heads=4, kv_heads=2,
                      max_pos=256)


def test_a_history_or_corpus_shorter_than_the_deepest_match_decodes(target):
    """The matcher looks back up to suffix_decoding_max_tree_depth (24) tokens: with a tight
    max_cache_len or a small corpus its source is shorter than that, and it used to compare
    copies shifted past the source's start (failing to trace: shapes [B, 16] against [B, 32]).
    Greedy output equals autoregressive decoding in both."""
    prompts = [[1, 2, 3, 1, 2], [4, 5]]
    greedy = sj.SamplingParams(temperature=0, max_new_tokens=8)
    ar = sj.generate(target, prompts, sampling=greedy)
    spec = sj.SpecConfig(method="suffix", num_speculative_tokens=3)
    out = sj.generate(target, prompts, sampling=greedy, spec=spec, max_cache_len=5 + 8 + 3)
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    small = sj.draft.SuffixCache(16)  # the smallest corpus allowed
    small.add([[1, 2, 3, 4]])
    out = sj.generate(target, prompts, sampling=greedy, spec=spec, draft=small)
    np.testing.assert_array_equal(out.tokens, ar.tokens)


def test_greedy_suffix_equals_autoregressive_and_never_recompiles(target):
    prompts = [[1, 2, 3, 4, 5, 6, 1, 2, 3], [7, 8], [4, 4, 4, 4, 9]]
    greedy = sj.SamplingParams(temperature=0, max_new_tokens=40)
    ar = sj.generate(target, prompts, sampling=greedy)
    cache = sj.draft.SuffixCache(512)
    spec = sj.SpecConfig(method="suffix", num_speculative_tokens=5)
    lengths = []
    for call in range(4):  # the corpus fills with the outputs; nothing recompiles
        out = sj.generate(target, prompts, sampling=greedy, spec=spec, draft=cache)
        np.testing.assert_array_equal(out.tokens, ar.tokens)
        lengths.append(out.stats.mean_accepted_length)
        if call == 0:
            compiled = engine.compiled_programs()
    assert engine.compiled_programs() == compiled
    assert len(cache) == 3 * 4 * 40
    assert lengths[1] > lengths[0] + 1  # the earlier outputs are drafted from
    tree = sj.SpecConfig(method="suffix", tree=((0,), (1,), (0, 0), (0, 0, 0)),
                         suffix_decoding_min_token_prob=0.0, suffix_decoding_max_spec_factor=3.0)
    out = sj.generate(target, prompts, sampling=greedy, spec=tree)  # no corpus: own text only
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    streamed = list(sj.stream(target, prompts, sampling=greedy, spec=spec, draft=cache))
    np.testing.assert_array_equal(streamed[-1].generation.tokens, ar.tokens)
    end = cache._write - 1  # stream added its outputs too: the last one ends at the write point
    np.testing.assert_array_equal(cache._tokens[end - 40:end], ar.tokens[2])


SUFFIX_TREE = ((0,), (1,), (0, 0), (0, 0, 0), (1, 0))


def suffix_samples(target, t, k, p, shape=SUFFIX_TREE, defaults=False):
    """N rows of PROMPT, 3 tokens each, drafted from a corpus of the target's own continuations
    of PROMPT (drafts often right, two candidates at the first steps). The proposer is passed
    directly (as a custom one would be), with 16 occurrences a round: the same code as
    method="suffix" (whose SpecConfig route the greedy test runs), cheaper for many rows.
    ``defaults``: with SpecConfig's pruning and gate (min_token_prob 0.1, acceptance floor
    gate.ACCEPTANCE_FLOOR) instead of neither."""
    sampling = sj.SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=4)
    docs = sj.generate(target, [PROMPT] * 12, sampling=sampling, key=99)
    cache = sj.draft.SuffixCache(128)
    cache.add([PROMPT + list(map(int, row)) for row in docs.tokens])
    spec = sj.SpecConfig(method="suffix")
    proposer = suffix.SuffixProposer(
        Tree(shape), max_depth=4, candidates=16,
        min_token_prob=spec.suffix_decoding_min_token_prob if defaults else 0.0,
        acceptance_floor=spec.floor if defaults else 0.0)
    out = sj.generate(target, [PROMPT] * N, proposer=proposer, draft=cache.params, key=0,
                      sampling=dataclasses.replace(sampling, max_new_tokens=3),
                      max_cache_len=len(PROMPT) + 3 + len(shape))
    assert (out.lengths == 3).all()
    assert out.stats.proposed_tokens > N and out.stats.accepted_tokens > N // 10
    return out.tokens


@pytest.mark.parametrize("t,k,p,shape,defaults", [
    (1.0, 0, 1.0, SUFFIX_TREE, False), (0.7, 5, 0.9, SUFFIX_TREE, False),
    (0.7, 5, 0.9, ((0,), (0, 0), (0, 0, 0)), False), (0.7, 5, 0.9, SUFFIX_TREE, True)],
    ids=["T1-tree", "T0.7-topk5-topp0.9-tree", "T0.7-topk5-topp0.9-chain",
         "T0.7-topk5-topp0.9-tree-pruned-gated"])
def test_first_three_tokens_follow_the_target_with_suffix_drafts(models, t, k, p,  # noqa: F811
                                                                  shape, defaults):
    """Also with method="suffix"'s defaults: nodes pruned below a share of 0.1 and the
    acceptance gate (which closes a row's drafting when its acceptance falls)."""
    target, _ = models
    assert g_test(suffix_samples(target, t, k, p, shape, defaults),
                  exact_joint(target, t, k, p)) > 1e-3


def test_a_verifier_that_keeps_rejected_siblings_fails_with_suffix_drafts(
        models, monkeypatch, fresh_programs):  # noqa: F811
    """The same test with the sibling rule broken (a rejected point-mass sibling's token left in
    the residual): suffix trees have siblings, and the test catches it."""
    target, _ = models
    monkeypatch.setattr(verify, "_remove", lambda p, token, where: p)
    t, k, p = 1.0, 0, 1.0
    assert g_test(suffix_samples(target, t, k, p), exact_joint(target, t, k, p)) < 1e-6


# -- settings, errors, persistence --------------------------------------------------------------

def test_bad_settings_and_caches_are_refused(target, tmp_path):
    prompts = [[1, 2, 3]]
    for key, value, message in [
            ("suffix_decoding_max_tree_depth", 0, "max_tree_depth must be an int >= 1"),
            ("suffix_decoding_max_tree_depth", 40, "max_tree_depth=40 is beyond"),
            ("suffix_decoding_max_spec_factor", 0.0, "max_spec_factor must be a finite"),
            ("suffix_decoding_own_spec_factor", float("inf"), "own_spec_factor must be a finite"),
            ("suffix_decoding_min_token_prob", 1.5, "min_token_prob must be in"),
            ("suffix_decoding_min_match_length", 0, "min_match_length must be an int >= 1"),
            ("suffix_decoding_min_match_length", 30, "min_match_length=30 is longer than")]:
        with pytest.raises(ValueError, match=message):
            sj.SpecConfig(method="suffix", **{key: value})
    with pytest.raises(ValueError, match="capacity_tokens must be an int in"):
        sj.draft.SuffixCache(8)
    other = sj.draft.SuffixCache(64, vocab_size=50000)
    with pytest.raises(ValueError, match="50000-token vocabulary; the target has 24"):
        sj.generate(target, prompts, spec={"method": "suffix"}, draft=other)
    with pytest.raises(ValueError, match="takes a sj.draft.SuffixCache"):
        sj.generate(target, prompts, spec={"method": "suffix"}, draft=target)
    with pytest.raises(ValueError, match="include_prompts must be a bool, got 'no'"):
        sj.draft.SuffixCache(64, include_prompts="no")
    unsized = sj.draft.SuffixCache(64)
    with pytest.raises(ValueError, match="token id -5 in SuffixCache.add"):
        unsized.add([[1, -5, 2]])
    unsized.add([[1, 2, 30]])  # no vocabulary yet: the target's is adopted on first use
    with pytest.raises(ValueError, match="holds token id 30, outside the target's vocabulary"):
        sj.generate(target, prompts, spec={"method": "suffix"}, draft=unsized)
    # a call refused after the cache was checked leaves it without a vocabulary (it adopted
    # the first target's, and then refused every other as "holding" its tokens)
    empty = sj.draft.SuffixCache(64)
    with pytest.raises(ValueError, match="max_cache_len=4 is too small"):
        sj.generate(target, prompts, spec={"method": "suffix"}, draft=empty, max_cache_len=4)
    assert empty.vocab_size is None
    sj.generate(target, prompts, spec={"method": "suffix"}, draft=empty,
                sampling=sj.SamplingParams(max_new_tokens=2))
    assert empty.vocab_size == 24 and len(empty) == 2
    # trees the method cannot fill, options of another method, proposers built directly
    with pytest.raises(ValueError, match="method 'suffix': the tree gives a node 17 children, "
                                         "more than the 16 candidates"):
        sj.SpecConfig(method="suffix", tree=[[i] for i in range(17)])
    with pytest.raises(ValueError, match="lookahead_window=4 is an option of method "
                                         "'lookahead', not 'suffix'"):
        sj.SpecConfig(method="suffix", lookahead_window=4)
    with pytest.raises(ValueError, match="suffix_decoding_max_tree_depth=8 is an option of "
                                         "method 'suffix', not 'ngram'"):
        sj.SpecConfig(method="ngram", suffix_decoding_max_tree_depth=8)
    from specjax.draft.suffix import SuffixProposer, chain
    for kw, message in ((dict(candidates=0), "candidates must be an int >= 1, got 0"),
                        (dict(max_depth=0), "max_depth must be an int >= 1"),
                        (dict(min_token_prob=2.0), "min_token_prob must be in \\[0, 1\\]"),
                        (dict(max_spec_factor=float("nan")), "max_spec_factor must be a finite"),
                        (dict(candidates=2, shape=sj.tree.Tree([[0], [1], [2]])),
                         "a node 3 children, more than the 2 candidates")):
        with pytest.raises(ValueError, match=message):
            SuffixProposer(**{"shape": chain(3), **kw})


def test_a_request_asked_again_finds_its_answer_with_include_prompts(target):
    """include_prompts=True keeps each row's prompt and output as one document, so the same
    request asked again drafts its earlier answer from its first round (kept apart, the prompt's
    end was followed by a separator and drafted nothing); greedy output unchanged."""
    prompt = [int(x) for x in np.random.default_rng(5).integers(0, 24, 30)]
    greedy = sj.SamplingParams(temperature=0, max_new_tokens=40)
    spec = dict(method="suffix", num_speculative_tokens=8)
    plain = sj.generate(target, [prompt], sampling=greedy)
    rounds = {}
    for include in (True, False):
        cache = sj.draft.SuffixCache(256, include_prompts=include)
        first = sj.generate(target, [prompt], sampling=greedy, spec=spec, draft=cache)
        again = sj.generate(target, [prompt], sampling=greedy, spec=spec, draft=cache)
        for out in (first, again):
            np.testing.assert_array_equal(out.tokens, plain.tokens)
        rounds[include] = again.stats.num_rounds
        if include:  # one document: the prompt, then its output
            held = list(cache._tokens[:len(prompt) + 40])
            assert held == prompt + [int(t) for t in plain.tokens[0]]
    assert rounds[True] <= 40 // 9 + 1 < rounds[False], rounds  # 8 drafts + 1 token a round


def test_the_corpus_survives_a_save_and_load(tmp_path):
    cache = sj.draft.SuffixCache(32, vocab_size=24, include_prompts=True)
    cache.add([[1, 2, 3], [4, 5, 6, 7] * 5, [8, 9]])
    cache.save(tmp_path / "corpus")
    back = sj.draft.SuffixCache.load(tmp_path / "corpus")
    np.testing.assert_array_equal(back._tokens, cache._tokens)
    assert (back._write, back.vocab_size, back.include_prompts) == (cache._write, 24, True)
    np.save(tmp_path / "corpus" / "tokens.npy", np.full(32, 99, np.int32))
    with pytest.raises(ValueError, match="ids outside the vocabulary"):
        sj.draft.SuffixCache.load(tmp_path / "corpus")
    with pytest.raises(ValueError, match="is not a saved SuffixCache"):
        sj.draft.SuffixCache.load(tmp_path / "nothing")
    # damaged metadata: refused naming the folder, never a KeyError or a ring read from the
    # middle of a document
    cache.save(tmp_path / "corpus")
    meta_path = tmp_path / "corpus" / "suffix_cache.json"
    meta = json.loads(meta_path.read_text())
    for damaged, message in (({k: v for k, v in meta.items() if k != "write"},
                              "needs the format and capacity_tokens"),
                             ([1, 2], "must hold a JSON object"),
                             ({**meta, "write": "x"}, "write='x' is not where"),
                             ({**meta, "write": 3.0}, "write=3.0 is not where"),
                             ({**meta, "write": 1}, "write=1 is not where a document")):
        meta_path.write_text(json.dumps(damaged))
        with pytest.raises(ValueError, match=message):
            sj.draft.SuffixCache.load(tmp_path / "corpus")


@pytest.mark.parametrize("broken", [False, True], ids=["honest", "reused-round-keys"])
def test_later_tokens_follow_the_target_with_suffix_drafts(models, tail_joints,  # noqa: F811
                                                           monkeypatch, broken, fresh_programs):
    """Tokens 5 and 6 of rows alternating between two prompt lengths, method="suffix" with its
    defaults (the row's own text its corpus, pruned trees, the gate): several rounds, so the
    suffix state carried from round to round is in play. With the same random numbers in every
    round the same test fails."""
    target, _ = models
    if broken:
        monkeypatch.setattr(engine, "round_keys", _same_keys_every_round)
    out = later_samples(target, None, 3, method="suffix")
    assert out.stats.accepted_tokens > 0
    pvalue = min(tail_pvalues(out.tokens, tail_joints))
    assert (pvalue < 1e-6) if broken else (pvalue > 1e-3), pvalue
