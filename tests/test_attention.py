"""Attention that reads only live slots (specjax/attention.py): the blocked walk equals one dense
softmax on random caches, lengths, tree masks and sliding windows; nothing in a dead slot (inf,
NaN) ever reaches an output, in float32, bfloat16 and float16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

import specjax as sj
from specjax import attention
from specjax import cache as kv
from specjax.tree import Tree


def random_view(rng, B, T, S, W=None, window=None, tree=None):
    W = T if W is None else W
    length = rng.integers(W - T, S - T + 1, size=B).astype(np.int32)
    if tree is not None:
        chunk = np.broadcast_to(tree.ancestors, (B, T, W))
    else:
        chunk = np.tril(np.ones((T, W), bool), W - T) & (rng.random((B, T, W)) < 0.7)
        chunk |= np.eye(T, W, W - T, dtype=bool)  # every query sees its own slot
    positions = length[:, None] + np.arange(T)[None, :]
    return attention.View(jnp.asarray(length), jnp.asarray(chunk), jnp.asarray(positions),
                          window)


def numpy_attention(q, k, v, mask):
    """Reference: q [B, T, K, G, D], k, v [B, S, K, D], mask [B, T, S] (float64)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("btkgd,bskd->bkgts", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(np.asarray(mask)[:, None, None], scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bkgts,bskd->btkgd", w, np.where(np.isfinite(v), v, 0))


@pytest.mark.parametrize("S,block", [(16, 4), (13, 5), (24, 7), (12, 12)])
@pytest.mark.parametrize("kind", ["causal", "wide", "window", "tree"])
def test_blocked_equals_dense_and_numpy(S, block, kind):
    rng = np.random.default_rng(S * 31 + block)
    L, B, K, G, D = 3, 4, 2, 2, 8
    tree = Tree(((0,), (1,), (0, 0), (0, 1), (1, 0))) if kind == "tree" else None
    T = {"causal": 3, "wide": 2, "window": 3, "tree": tree.num_nodes if tree else 0}[kind]
    W = 5 if kind == "wide" else None
    view = random_view(rng, B, T, S, W=W, window=4 if kind == "window" else None, tree=tree)
    k_all = jnp.asarray(rng.normal(size=(L, B, S, K, D)), jnp.float32)
    v_all = jnp.asarray(rng.normal(size=(L, B, S, K, D)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(B, T, K, G, D)), jnp.float32)
    layer = jnp.int32(1)
    mask = view.mask(jnp.arange(S))
    want = numpy_attention(q, k_all[1], v_all[1], mask)
    k_all, v_all = kv.by_slot(k_all), kv.by_slot(v_all)  # as the cache stores them
    dense = attention.dense(q, k_all[1], v_all[1], mask)
    blocked = attention.blocked(q, k_all, v_all, layer, view, block)
    np.testing.assert_allclose(np.asarray(dense), want, atol=2e-5)
    np.testing.assert_allclose(np.asarray(blocked), want, atol=2e-5)


@pytest.mark.parametrize("short_by", [1, 2])
def test_the_comparison_catches_a_walk_that_stops_short(monkeypatch, short_by):
    """A blocked walk that skips the last block(s) (a trip count off by one or two) fails the
    test above."""
    fori_loop = jax.lax.fori_loop
    monkeypatch.setattr(jax.lax, "fori_loop",
                        lambda lo, hi, body, init: fori_loop(lo, hi - short_by, body, init))
    # the dense result still matches (checked first); the blocked one does not
    with pytest.raises(AssertionError, match="Not equal to tolerance") as failed:
        test_blocked_equals_dense_and_numpy(16, 4, "causal")
    assert "blocked" in "".join(str(entry.statement) for entry in failed.traceback[-3:])


@pytest.mark.parametrize("broken", [False, True])
def test_attention_reads_the_live_blocks_not_the_capacity(monkeypatch, broken):
    """A 4,096-slot cache holding 64 tokens: one token's attention walks ceil(65 / 256) = 1 block,
    not 16 (nor one dense softmax over every slot). Deliberately broken, a walk over the whole
    capacity (dense attention at any capacity) fails: the results would be the same, the work
    64 times larger."""
    if broken:
        monkeypatch.setattr(attention, "uses_dense", lambda capacity, T, block: True)
    trips = []
    fori_loop = jax.lax.fori_loop

    def counted(lo, hi, body, init):
        trips.append(int(hi) - int(lo))
        return fori_loop(lo, hi, body, init)
    monkeypatch.setattr(jax.lax, "fori_loop", counted)
    rng = np.random.default_rng(1)
    L, B, S, K, G, D = 1, 2, 4096, 1, 2, 4
    k_all = jnp.asarray(rng.normal(size=(L, B, S, K, D)), jnp.float32)
    v_all = jnp.asarray(rng.normal(size=(L, B, S, K, D)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(B, 1, K, G, D)), jnp.float32)
    view = attention.View(jnp.array([5, 64]), jnp.ones((B, 1, 1), bool),
                          jnp.array([[5], [64]]))
    out = attention.attend(q, kv.by_slot(k_all), kv.by_slot(v_all), jnp.int32(0), view, 256)
    want = numpy_attention(q, k_all[0], v_all[0], view.mask(jnp.arange(S)))
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)  # right either way
    assert (trips != [1]) if broken else (trips == [1]), trips


def test_a_row_does_not_depend_on_how_long_the_others_are():
    """Extra blocks walked for a longer neighbour add exactly nothing: bitwise the same."""
    rng = np.random.default_rng(0)
    L, S, K, G, D, T = 1, 40, 1, 2, 4, 1
    k_all = jnp.asarray(rng.normal(size=(L, 2, S, K, D)), jnp.float32)
    v_all = jnp.asarray(rng.normal(size=(L, 2, S, K, D)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(2, T, K, G, D)), jnp.float32)
    causal = jnp.ones((2, 1, 1), bool)
    short = attention.View(jnp.array([5, 6]), causal, jnp.array([[5], [6]]))
    long = attention.View(jnp.array([5, 38]), causal, jnp.array([[5], [38]]))
    k_all, v_all = kv.by_slot(k_all), kv.by_slot(v_all)
    a = attention.blocked(q, k_all, v_all, jnp.int32(0), short, 8)
    b = attention.blocked(q, k_all, v_all, jnp.int32(0), long, 8)
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))


def _poison(cache, live, value):
    """Every slot at or past live[b] written with value, keys and values, as a write stores a
    broken position (``cache.write_chunk``), and the keys there overwritten with value too (a
    key is never weighted, only its score selected away, so any key may lie in a dead slot)."""
    L, B, K, S, D = cache.k.shape
    junk = jnp.full((L, B, S, K, D), value, cache.k.dtype)  # a chunk of S slots
    written = kv.write_chunk(cache.rollback(jnp.asarray(live)), junk, junk)
    slot = jnp.arange(S)[None, None, None, :, None]
    dead = slot >= jnp.asarray(live)[None, :, None, None, None]
    return sj.KVCache(jnp.where(dead, jnp.asarray(value, cache.k.dtype), written.k), written.v,
                      cache.length)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("block", [256, 4], ids=["dense", "blocked"])
def test_inf_and_nan_in_dead_slots_change_nothing(dtype, block):
    model = tiny_model(seed=4, dtype=dtype)
    tokens = jnp.array([[3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 8, 2, 8, 1]])
    cache = sj.KVCache.init(model.config, 2, 24)
    _, _, cache = sj.forward(model, tokens, jnp.broadcast_to(jnp.arange(7), (2, 7)), cache,
                             block=block)
    cache = cache.rollback(jnp.array([5, 3]))  # rows hold 5 and 3 tokens; the rest is dead
    chunk = jnp.array([[6, 6], [5, 5]])
    positions = jnp.array([[5, 6], [3, 4]])
    clean, _, _ = sj.forward(model, chunk, positions, cache, block=block)
    assert np.isfinite(np.asarray(clean)).all()
    for value in (jnp.inf, -jnp.inf, jnp.nan):
        # everything past the chunk's slots: the chunk itself is written by the forward
        poisoned = _poison(cache, cache.length + 2, value)
        got, _, _ = sj.forward(model, chunk, positions, poisoned, block=block)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(clean), err_msg=str(value))


@pytest.mark.parametrize("block", [256, 8], ids=["dense", "blocked"])
def test_the_poison_test_catches_values_stored_as_they_came(monkeypatch, block):
    """Without ``storable``, a dead slot's inf value is weighted by zero, 0 · inf is NaN, and
    the output turns NaN: the test above fails. (A block of 8 holds dead slots 4..7 the walk
    reads.)"""
    monkeypatch.setattr(kv, "storable", lambda k, v: (k, v))
    model = tiny_model(seed=4, dtype="float16")
    cache = sj.KVCache.init(model.config, 1, 16)
    _, _, cache = sj.forward(model, jnp.array([[3, 1, 4]]), jnp.arange(3)[None], cache)
    poisoned = _poison(cache, jnp.array([4]), jnp.inf)
    got, _, _ = sj.model._forward.__wrapped__(model, jnp.array([[5]]), jnp.array([[3]]),
                                              poisoned, None, block=block)
    assert np.isnan(np.asarray(got)).any()


def _chunk_with_a_broken_value(block, storable=None, monkeypatch=None):
    """A 4-token chunk whose third token's embedding is NaN: (outputs, clean outputs)."""
    model = tiny_model(seed=4)
    if storable is not None:
        monkeypatch.setattr(kv, "storable", storable)
    params = dict(model.params)
    params["embed_tokens"] = {"embedding": model.params["embed_tokens"]["embedding"]
                              .at[7].set(jnp.nan)}
    broken = sj.Model(model.config, params)
    cache = sj.KVCache.init(model.config, 1, 24)
    _, _, cache = sj.forward(model, jnp.array([[3, 1, 4]]), jnp.arange(3)[None], cache,
                             block=block)
    args = (jnp.array([[5, 2, 7, 6]]), jnp.arange(3, 7)[None], cache)
    got, _, _ = sj.model._forward.__wrapped__(broken, *args, None, block=block)
    clean, _, _ = sj.model._forward.__wrapped__(model, *args, None, block=block)
    return np.asarray(got), np.asarray(clean)


@pytest.mark.parametrize("block", [256, 4], ids=["dense", "blocked"])
def test_a_non_finite_value_in_a_chunk_reaches_only_the_queries_that_see_it(block):
    """A speculative chunk whose third token is broken (its key and value NaN): the first two
    positions are exactly the clean ones (the causal mask hides it from them), the rest NaN."""
    got, clean = _chunk_with_a_broken_value(block)
    np.testing.assert_array_equal(got[0, :2], clean[0, :2])
    assert np.isnan(got[0, 2:]).all(axis=-1).all()


def test_a_chunk_attended_as_it_came_leaks_nan_backwards(monkeypatch):
    """The broken variant (no ``storable``): the NaN reaches the first positions through a zero
    weight's 0 · NaN, and the test above fails."""
    got, clean = _chunk_with_a_broken_value(256, lambda k, v: (k, v), monkeypatch)
    assert np.isnan(got[0, :2]).any()


def _attend_over_a_broken_value(storable):
    """One kv head, slots 0..3 written through ``storable``; slot 2's value is inf, its key
    finite. Queries 0..3, each seeing the slots up to its own: [T, D] outputs."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 4, 1, 1, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 4, 1, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 4, 1, 8)), jnp.float32).at[0, 2, 0, 3].set(jnp.inf)
    k, v = storable(k, v)
    mask = jnp.tril(jnp.ones((4, 4), bool))[None]
    return np.asarray(attention.dense(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2),
                                      mask))[0, :, 0, 0]  # [B, K, S, D] as in the cache


def test_a_query_that_sees_a_non_finite_value_gets_nan():
    """Stored as ``storable`` stores them, a value that overflowed under a finite key still
    makes the queries that see it NaN, and leaves the others finite."""
    out = _attend_over_a_broken_value(kv.storable)
    assert np.isfinite(out[:2]).all() and np.isnan(out[2:]).all()
    # zeroing the value alone, the key kept, would hide the overflow from the queries that see it
    hidden = _attend_over_a_broken_value(lambda k, v: (k, jnp.where(jnp.isfinite(v), v, 0)))
    assert np.isfinite(hidden).all()


def test_the_model_is_the_same_blocked_or_dense():
    model = tiny_model(seed=3, heads=4, kv_heads=2)
    B, T = 2, 19
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, model.config.vocab_size)
    full = np.asarray(sj.logits(model, tokens))
    for block in (4, 5, 256):
        cache = sj.KVCache.init(model.config, B, 24)
        pieces = []
        for lo, hi in [(0, 6), (6, 13), (13, 14), (14, 19)]:
            pos = jnp.broadcast_to(jnp.arange(lo, hi), (B, hi - lo))
            out, _, cache = sj.forward(model, tokens[:, lo:hi], pos, cache, block=block)
            pieces.append(np.asarray(out))
        np.testing.assert_allclose(np.concatenate(pieces, 1), full, atol=2e-5, err_msg=block)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("block", [256, 4], ids=["dense", "blocked"])
def test_chunked_prefill_equals_one_forward(window, block):
    """Chunks of 4, 5, 11 and 12 tokens into 16 slots: the last chunk of 5 or 11 runs past the
    capacity (padding only, dropped)."""
    model = tiny_model(seed=6, sliding_window=window)
    rows = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [4, 5], [7, 7, 7, 7, 7]]
    lengths = jnp.array([len(r) for r in rows])
    tokens = jnp.array([r + [0] * (16 - len(r)) for r in rows])
    for chunk in (4, 5, 11, 12):
        cache = sj.KVCache.init(model.config, 3, 16)
        with attention.blocks_of(block):
            last, hidden, cache = sj.model.prefill_chunked(model, tokens, lengths, cache, chunk,
                                                           keep_hidden=True)
        assert np.isfinite(np.asarray(hidden)).all()
        assert list(np.asarray(cache.length)) == [15, 2, 5]
        for b, r in enumerate(rows):
            want_logits, want_hidden, _ = sj.prefill(model, jnp.array([r]))
            np.testing.assert_allclose(np.asarray(last[b]), np.asarray(want_logits[0, -1]),
                                       atol=2e-5)
            np.testing.assert_allclose(np.asarray(hidden[b, :len(r)]),
                                       np.asarray(want_hidden[0]), atol=2e-5)


def _chunk_apart_mismatch(window, block) -> float:
    """The largest difference between a chunk's forward written into the cache and the same
    chunk kept out of it (``write=False``, written after by ``cache.write_chunk``): logits,
    and every cache slot up to the chunk's end. Rows of different lengths; 0 when equal."""
    model = tiny_model(seed=7, sliding_window=window)
    B, S, T = 2, 24, 4
    rows = [list(range(3, 16)), [5, 9, 2]]  # lengths 13 and 3
    lengths = jnp.array([len(r) for r in rows])
    prompts = jnp.array([r + [0] * (16 - len(r)) for r in rows])
    chunk = jax.random.randint(jax.random.key(2), (B, T), 0, model.config.vocab_size)
    positions = lengths[:, None] + jnp.arange(T)[None, :]
    with attention.blocks_of(block):
        _, _, cache = sj.model.prefill_chunked(model, prompts, lengths,
                                               sj.KVCache.init(model.config, B, S), 5)
        want, want_hidden, written = sj.forward(model, chunk, positions, cache)
        got, got_hidden, (k, v) = sj.forward(model, chunk, positions, cache, write=False)
    after = sj.cache.write_chunk(cache, k, v)
    worst = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in ((got, want), (got_hidden, want_hidden)))
    assert list(np.asarray(after.length)) == list(np.asarray(written.length))
    for b in range(B):
        end = int(lengths[b]) + T
        for x, y in ((after.k, written.k), (after.v, written.v)):
            worst = max(worst, float(np.max(np.abs(np.asarray(x[:, b, :, :end]) -
                                                   np.asarray(y[:, b, :, :end])))))
    return worst


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("block", [256, 4], ids=["dense", "blocked"])
def test_a_chunk_kept_out_of_the_cache_gives_the_same_forward(window, block):
    """What a switch over verify widths runs (engine._verify_chain_any_length): the history
    read from the cache, the chunk from its own keys and values, written afterwards."""
    assert _chunk_apart_mismatch(window, block) < 2e-5


@pytest.mark.parametrize("block", [256, 4], ids=["dense", "blocked"])
def test_the_comparison_catches_a_chunk_that_sees_its_future(monkeypatch, fresh_programs,
                                                             block):
    """A chunk kept apart whose tokens see the whole chunk (no causal mask among them) fails."""
    monkeypatch.setattr(attention.View, "chunk_visible",
                        lambda self: jnp.ones_like(self.chunk_mask))
    assert _chunk_apart_mismatch(None, block) > 1e-3


def test_a_chunk_kept_apart_must_see_only_itself():
    model = tiny_model(seed=7)
    cache = sj.KVCache.init(model.config, 1, 16)
    with pytest.raises(ValueError, match=r"\[T, T\]"):
        sj.forward(model, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32), cache,
                   jnp.ones((2, 3), bool), write=False)
