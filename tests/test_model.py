"""The decoder and its cache: incremental decoding equals the full causal forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

import specjax as sj
from specjax import cache as kv


def test_attention_mask_matches_brute_force():
    rng = np.random.default_rng(0)
    B, T, S = 3, 4, 12
    length = np.array([0, 5, 8])
    chunk = rng.random((B, T, T)) < 0.5
    got = np.asarray(kv.attention_mask(jnp.asarray(length), jnp.asarray(chunk), S))
    for b in range(B):
        for i in range(T):
            for j in range(S):
                if j < length[b]:
                    want = True
                elif j < length[b] + T:
                    want = chunk[b, i, j - length[b]]
                else:
                    want = False
                assert got[b, i, j] == want, (b, i, j)


def test_write_places_rows_at_their_own_offsets():
    buf = jnp.zeros((2, 8, 1))
    new = jnp.ones((2, 3, 1)) * jnp.array([1.0, 2.0])[:, None, None]
    out = np.asarray(kv.write(buf, new, jnp.array([0, 4])))[..., 0]
    np.testing.assert_array_equal(out, [[1, 1, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 2, 2, 2, 0]])


@pytest.mark.parametrize("kw", [
    dict(),
    dict(tie_word_embeddings=True),
    dict(attention_bias=True),
    dict(heads=4, kv_heads=4),
    dict(heads=4, kv_heads=1, head_dim=6),
])
def test_incremental_decoding_equals_full_forward(kw):
    model = tiny_model(seed=3, **kw)
    B, T = 2, 9
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, model.config.vocab_size)
    full = np.asarray(sj.logits(model, tokens))
    assert full.shape == (B, T, model.config.vocab_size) and full.dtype == np.float32
    # prefill 4 tokens, then a chunk of 3, then single tokens, in a cache larger than needed
    cache = sj.KVCache.init(model.config, B, 24)
    pieces = []
    for lo, hi in [(0, 4), (4, 7), (7, 8), (8, 9)]:
        pos = jnp.broadcast_to(jnp.arange(lo, hi), (B, hi - lo))
        out, hidden, cache = sj.forward(model, tokens[:, lo:hi], pos, cache)
        assert hidden.shape == (B, hi - lo, model.config.hidden_size)
        pieces.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(pieces, 1), full, atol=1e-5, rtol=1e-5)
    assert list(np.asarray(cache.length)) == [T, T]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("broken", [False, True])
def test_bfloat16_models_give_float32_logits(tied, broken, monkeypatch, fresh_programs):
    """The LM head of a bfloat16 model accumulates and returns float32: logits rounded to
    bfloat16's 8 significant bits tie exactly often enough that a verify forward and a one-token
    forward part on greedy tokens. Most float32 logits are not bfloat16 numbers; a head computing
    in bfloat16 (deliberately broken) gives only bfloat16 numbers and fails."""
    from specjax import model as model_lib
    if broken:
        monkeypatch.setattr(model_lib, "_float32_dot", jax.lax.dot_general)
    half = sj.checkpoint.cast(tiny_model(seed=3, vocab_size=64, hidden_size=32,
                                         tie_word_embeddings=tied), "bfloat16")
    logits = np.asarray(sj.logits(half, np.arange(1, 9)[None]))
    assert logits.dtype == np.float32  # the broken head's too: the cast comes after it
    exact = logits == np.asarray(jnp.asarray(logits).astype(jnp.bfloat16).astype(jnp.float32))
    assert (exact.mean() == 1.0) if broken else (exact.mean() < 0.1), exact.mean()


def test_stale_entries_past_length_are_invisible():
    model = tiny_model(seed=4)
    B = 1
    tokens = jnp.array([[3, 1, 4, 1, 5]])
    cache = sj.KVCache.init(model.config, B, 16)
    pos = jnp.arange(5)[None]
    _, _, cache = sj.forward(model, tokens, pos, cache)
    # Roll back to 3 tokens: slots 3, 4 now hold garbage (the K/V of "1, 5").
    cache = cache.rollback(jnp.array([3]))
    got, _, _ = sj.forward(model, jnp.array([[9]]), jnp.array([[3]]), cache)
    want = sj.logits(model, jnp.array([[3, 1, 4, 9]]))[:, -1]
    np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(want), atol=1e-5)
    # Fill the garbage slots with huge values: still invisible.
    poisoned = sj.KVCache(cache.k.at[:, :, :, 3:].set(1e4), cache.v.at[:, :, :, 3:].set(1e4),
                          cache.length)
    got2, _, _ = sj.forward(model, jnp.array([[9]]), jnp.array([[3]]), poisoned)
    np.testing.assert_allclose(np.asarray(got2), np.asarray(got), atol=1e-6)


def test_forward_refuses_a_chunk_its_cache_cannot_hold():
    """sj.forward with concrete arrays: a chunk running past the cache's capacity (its writes
    dropped, its logits read from slots never written: silently wrong before), tokens and
    positions of other shapes, or rows the cache does not hold are refused by name."""
    model = tiny_model(seed=4)
    cache = sj.KVCache.init(model.config, 1, 6)
    _, _, cache = sj.forward(model, jnp.array([[3, 1, 4, 1, 5]]), jnp.arange(5)[None], cache)
    _, _, full = sj.forward(model, jnp.array([[9]]), jnp.array([[5]]), cache)  # slot 6 of 6
    for tokens, positions, c, message in (
            (jnp.array([[9]]), jnp.array([[6]]), full, "needs 7 slots; the cache holds 6"),
            (jnp.array([[9, 2]]), jnp.array([[5, 6]]), cache, "needs 7 slots; the cache holds 6"),
            (jnp.array([[9, 2]]), jnp.array([[5]]), cache, "both be \\[B, T\\]"),
            (jnp.array([[9], [2]]), jnp.array([[5], [5]]), cache, "2 rows; the cache holds 1")):
        with pytest.raises(ValueError, match=message):
            sj.forward(model, tokens, positions, c)
    # a mask narrower than the chunk (read its first tokens as history every query sees) or of
    # another shape (jax broadcasting errors), logits asked at an index past the chunk (clamped
    # to the last), ids outside the vocabulary (-2: another token's embedding; V: NaN logits;
    # -1 is generate's padding), and sj.prefill over a cache that already holds tokens (its
    # positions restarted at 0)
    two, at = (jnp.array([[9, 2]]), jnp.array([[5, 6]])), jnp.array([[5]])
    empty = sj.KVCache.init(model.config, 1, 8)
    for args, kw, message in (
            (two, dict(chunk_mask=jnp.ones((2, 1), bool)), "chunk_mask must be \\[T, W\\]"),
            (two, dict(chunk_mask=jnp.ones((3, 2, 2), bool)), "got \\(3, 2, 2\\) for B = 1"),
            (two, dict(logits_at=(2,)), "logits_at=\\(2,\\): chunk indices must be in "
                                        "\\[0, 2\\)"),
            ((jnp.array([[-2]]), at), {}, "tokens must be ids in \\[0, 16\\) \\(or -1 for "
                                          "padding\\), got -2..-2"),
            ((jnp.array([[16]]), at), {}, "tokens must be ids in \\[0, 16\\) .*got 16..16")):
        with pytest.raises(ValueError, match=message):
            sj.forward(model, *args, empty.rollback(jnp.array([5])), **kw)
    with pytest.raises(ValueError, match="prefill starts at position 0: it takes an empty "
                                         "cache, got one holding \\[5\\] tokens"):
        sj.prefill(model, jnp.array([[1, 2]]), cache)


def test_prefill_chunked_refuses_prompts_its_cache_or_array_cannot_hold():
    """sj.prefill_chunked with concrete arrays: a prompt longer than the cache (its last tokens
    were dropped and the logits wrong, the cache claiming 40 slots of 32), lengths past the
    prompts' width, and a chunk of 0 (a ZeroDivisionError) are refused by name."""
    from specjax.model import prefill_chunked
    model = tiny_model(seed=4)
    tokens = jnp.ones((2, 8), jnp.int32)
    ok = prefill_chunked(model, tokens, jnp.array([8, 3]), sj.KVCache.init(model.config, 2, 8))
    np.testing.assert_array_equal(ok[2].length, [8, 3])
    for lengths, capacity, chunk, message in (
            ([8, 3], 6, 4, "a prompt of 8 tokens does not fit a cache of capacity 6"),
            ([9, 3], 16, 4, "lengths must be in \\[0, 8\\] \\(the prompts' width\\), got "
                            "\\[9, 3\\]"),
            ([8, -1], 16, 4, "lengths must be in \\[0, 8\\]"),
            ([8, 3], 16, 0, "chunk must be an int >= 1, got 0")):
        with pytest.raises(ValueError, match=message):
            prefill_chunked(model, tokens, jnp.array(lengths),
                            sj.KVCache.init(model.config, 2, capacity), chunk=chunk)


def test_rows_with_different_lengths_in_one_cache():
    model = tiny_model(seed=5)
    a, b = [2, 7, 1, 8, 2, 8], [3, 1, 4]
    cache = sj.KVCache.init(model.config, 2, 16)
    prompts = jnp.array([a, b + [0, 0, 0]])
    _, _, cache = sj.forward(model, prompts, jnp.broadcast_to(jnp.arange(6), (2, 6)), cache)
    cache = cache.rollback(jnp.array([6, 3]))
    nxt = jnp.array([[5], [9]])
    got, _, _ = sj.forward(model, nxt, jnp.array([[6], [3]]), cache)
    np.testing.assert_allclose(np.asarray(got[0, 0]),
                               np.asarray(sj.logits(model, jnp.array([a + [5]]))[0, -1]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1, 0]),
                               np.asarray(sj.logits(model, jnp.array([b + [9]]))[0, -1]), atol=1e-5)


def test_tree_mask_sees_only_ancestors():
    """Seed example: nodes [r, a, b, c, d]; a, b follow r; c, d follow a. Positions are depths."""
    model = tiny_model(seed=6)
    hist = [4, 2]
    r, a, b, c, d = 7, 3, 9, 1, 5
    cache = sj.KVCache.init(model.config, 1, 16)
    _, _, cache = sj.forward(model, jnp.array([hist]), jnp.array([[0, 1]]), cache)
    mask = jnp.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                      [1, 1, 0, 0, 1]], bool)
    depth = jnp.array([[0, 1, 1, 2, 2]]) + 2
    got, _, _ = sj.forward(model, jnp.array([[r, a, b, c, d]]), depth, cache, mask)
    for node, path in [(2, [r, b]), (3, [r, a, c]), (4, [r, a, d])]:
        want = sj.logits(model, jnp.array([hist + path]))[0, -1]
        np.testing.assert_allclose(np.asarray(got[0, node]), np.asarray(want), atol=1e-5)


def test_causality_and_position_dependence():
    model = tiny_model(seed=7)
    x = jnp.array([[1, 2, 3, 4]])
    y = jnp.array([[1, 2, 3, 9]])
    np.testing.assert_allclose(np.asarray(sj.logits(model, x)[:, :3]),
                               np.asarray(sj.logits(model, y)[:, :3]), atol=1e-6)
    # RoPE is relative: shifting every position leaves logits unchanged, spreading them does not.
    cache = sj.KVCache.init(model.config, 1, 8)
    base = np.asarray(sj.logits(model, x))
    shifted, _, _ = sj.forward(model, x, jnp.arange(4)[None] + 3, cache)
    spread, _, _ = sj.forward(model, x, jnp.arange(4)[None] * 2, cache)
    np.testing.assert_allclose(np.asarray(shifted), base, atol=1e-4)
    assert np.abs(np.asarray(spread) - base)[:, 1:].max() > 1e-3


def test_config_validation_and_defaults():
    cfg = sj.ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2)
    assert cfg.num_key_value_heads == 2 and cfg.head_dim == 4
    model = sj.init_model(cfg, jax.random.key(0))
    n = sum(x.size for x in jax.tree.leaves(model.params))
    assert n == cfg.num_params
    with pytest.raises(ValueError, match="num_key_value_heads"):
        sj.ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                       num_attention_heads=3, num_key_value_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="dtype"):
        sj.ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                       num_attention_heads=2, dtype="float8")
    with pytest.raises(ValueError, match="vocab_size"):
        sj.ModelConfig(vocab_size=0, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                       num_attention_heads=2)
    with pytest.raises(ValueError, match="shape"):
        sj.logits(model, jnp.zeros((3,), jnp.int32))


def test_config_switches_dtypes_and_infinities():
    """A switch given as a string was read by its truth ("false" tied the embeddings); a dtype
    object was stored as given (equal configs hashed apart, so compiled programs were not
    shared, and config_to_hf failed on JSON); an infinite epsilon or RoPE base was accepted
    (every norm output 0)."""
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2)
    plain = sj.ModelConfig(**base)
    for dtype in (np.dtype("float32"), np.float32, jnp.float32):
        cfg = sj.ModelConfig(**base, dtype=dtype)
        assert cfg.dtype == "float32" and hash(cfg) == hash(plain) and cfg == plain
    assert sj.ModelConfig(**base, dtype=jnp.bfloat16).dtype == "bfloat16"
    assert sj.ModelConfig(**base, qk_norm=np.bool_(True)).qk_norm is True
    for bad, message in [(dict(tie_word_embeddings="false"), "tie_word_embeddings must be True "
                                                             "or False, got 'false'"),
                         (dict(qk_norm=1), "qk_norm must be True or False, got 1"),
                         (dict(rms_norm_eps=float("inf")), "rms_norm_eps must be a finite"),
                         (dict(rope_theta=float("inf")), "rope_theta must be a finite"),
                         (dict(dtype=np.float64), "dtype must be one of .* got 'float64'")]:
        with pytest.raises(ValueError, match=f"ModelConfig.{message}"):
            sj.ModelConfig(**base, **bad)
    with pytest.raises(ValueError, match="RopeScaling.factor must be a finite number > 0"):
        sj.RopeScaling(rope_type="linear", factor=float("inf"))


def test_a_config_is_initialised_by_one_program_however_often():
    """init_model compiles once per (config, init_std): checkpoint loading and training build
    templates from it many times a process. Keys still give different weights."""
    from specjax import model
    cfg = sj.ModelConfig(vocab_size=40, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2)
    before = model._init_params._cache_size()
    a, b, c = (sj.init_model(cfg, jax.random.key(k)) for k in (0, 1, 0))
    assert model._init_params._cache_size() == before + 1
    sj.init_model(cfg, jax.random.key(0), init_std=0.5)
    assert model._init_params._cache_size() == before + 2
    emb = lambda m: np.asarray(m.params["embed_tokens"]["embedding"])  # noqa: E731
    np.testing.assert_array_equal(emb(a), emb(c))
    assert not np.array_equal(emb(a), emb(b))
