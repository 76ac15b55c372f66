"""The KV cache (specjax/cache.py), checked exactly against plain numpy references written here
slot by slot: init, rollback, per-row writes, the attention / sliding-window / causal masks, and
the tree commit (compact)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

from specjax import cache as kv
from specjax.tree import Tree

SEED_EXAMPLE = ((0,), (1,), (0, 0), (0, 1))  # nodes r, a, b, c, d (c, d children of a)
TREE = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))  # 7 nodes, depth 3


# -- numpy references -----------------------------------------------------------------------------

def ref_attention_mask(length, chunk_mask, capacity):
    """[B, T, S]: the chunk occupies slots len .. len+T-1; the window is the last W slots ending
    with the chunk. Before the window: visible. In it: chunk_mask. After the chunk: invisible."""
    length = np.asarray(length)
    chunk_mask = np.asarray(chunk_mask, bool)
    B = len(length)
    T, W = chunk_mask.shape[-2], chunk_mask.shape[-1]
    out = np.zeros((B, T, capacity), bool)
    for b in range(B):
        row_mask = chunk_mask[b] if chunk_mask.ndim == 3 else chunk_mask
        window_start = int(length[b]) + T - W
        chunk_end = int(length[b]) + T
        for t in range(T):
            for s in range(capacity):
                if s < window_start:
                    out[b, t, s] = True
                elif s < chunk_end:
                    out[b, t, s] = row_mask[t, s - window_start]
    return out


def ref_key_positions(length, positions, b, s):
    """Position held by slot s of row b, or None for a garbage slot past the chunk."""
    L, T = int(length[b]), positions.shape[1]
    if s < L:
        return s
    if s < L + T:
        return int(positions[b, s - L])
    return None


def random_cache(rng, L=2, B=4, S=12, K=2, D=3, dtype=jnp.float32):
    """A cache of random entries (drawn slot by slot, [L, B, S, K, D], stored [L, B, K, S, D])."""
    k = rng.normal(size=(L, B, S, K, D)).astype(np.float32)
    v = rng.normal(size=(L, B, S, K, D)).astype(np.float32)
    length = rng.integers(0, S, size=B).astype(np.int32)
    return kv.KVCache(k=kv.by_slot(jnp.asarray(k, dtype)), v=kv.by_slot(jnp.asarray(v, dtype)),
                      length=jnp.asarray(length))


# -- init / capacity / rollback -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_init_shapes_dtypes_and_zero_lengths(dtype):
    config = tiny_config(layers=3, heads=4, kv_heads=2, hidden_size=16, dtype=dtype)
    cache = kv.KVCache.init(config, batch=3, capacity=7)
    shape = (3, 3, 2, 7, config.head_dim)  # [L, B, K, S, D]
    assert cache.k.shape == shape and cache.v.shape == shape
    assert cache.k.dtype == jnp.dtype(dtype) and cache.v.dtype == jnp.dtype(dtype)
    assert cache.length.shape == (3,) and cache.length.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(cache.length), [0, 0, 0])
    assert not np.asarray(cache.k, np.float32).any() and not np.asarray(cache.v, np.float32).any()
    assert cache.capacity == 7


def test_rollback_changes_only_the_length():
    rng = np.random.default_rng(0)
    cache = random_cache(rng, B=3, S=9)
    k_before, v_before = np.asarray(cache.k).copy(), np.asarray(cache.v).copy()
    old_length = np.asarray(cache.length).copy()
    rolled = cache.rollback(np.array([2, 8, 0]))
    assert rolled.k is cache.k and rolled.v is cache.v  # nothing copied
    np.testing.assert_array_equal(np.asarray(rolled.k), k_before)
    np.testing.assert_array_equal(np.asarray(rolled.v), v_before)
    assert rolled.length.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(rolled.length), [2, 8, 0])
    np.testing.assert_array_equal(np.asarray(cache.length), old_length)  # original untouched
    assert rolled.capacity == cache.capacity == 9


# -- write ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("trailing,dtype,layered", [
    ((2, 3), jnp.float32, False), ((2, 3), jnp.bfloat16, False), ((), jnp.int32, False),
    ((2, 3), jnp.float32, True), ((2, 3), jnp.bfloat16, True)],
    ids=["write-f32", "write-bf16", "write-int32", "write_layer-f32", "write_layer-bf16"])
@pytest.mark.parametrize("rows", [1, 6, "1-past"])
def test_write_at_per_row_offsets(trailing, dtype, layered, rows):
    """[B, S, K, D] buffers and the [B, S] token history (``write``), and layer 1 of a cache
    buffer [L, B, K, S, D] (``write_layer``); new values are cast to the buffer's dtype
    (integer-valued data, so bfloat16 is exact). Slots at S or beyond are dropped, never clamped
    onto others."""
    rng = np.random.default_rng(1)
    L, S, T = 3, 10, 3
    # rows: from slot 0; in the middle; ending exactly at capacity; one slot left (two dropped);
    # wholly past the capacity (all dropped); overlapping the start of the history. "1-past":
    # a single row with one slot left (two dropped)
    start = {1: np.array([4], np.int32), "1-past": np.array([S - 1], np.int32),
             6: np.array([4, 0, S - T, S - 1, S + 2, 2], np.int32)}[rows]
    rows = len(start)
    shape = (L, rows, trailing[0], S, trailing[1]) if layered else (rows, S) + trailing
    buffer = rng.integers(-50, 50, size=shape).astype(np.float32)
    new = rng.integers(100, 200, size=(rows, T) + trailing).astype(np.float32)
    if layered:
        out = kv.write_layer(jnp.asarray(buffer, dtype), jnp.int32(1), jnp.asarray(new),
                             jnp.asarray(start))
    else:
        out = kv.write(jnp.asarray(buffer, dtype), jnp.asarray(new), jnp.asarray(start))
    assert out.shape == buffer.shape and out.dtype == jnp.dtype(dtype)
    expected = buffer.copy()
    row_view = np.swapaxes(expected[1], 1, 2) if layered else expected  # [B, S, ...] views
    for b in range(rows):
        for s in range(S):
            if start[b] <= s < start[b] + T:
                row_view[b, s] = new[b, s - start[b]]
    np.testing.assert_array_equal(np.asarray(out, np.float32), expected)
    assert (np.asarray(out, np.float32) != buffer).any()  # something was written


def test_write_layer_into_a_ring():
    """Layer 1 of a sliding layers' ring buffer [L, B, K, R, D] (R < the capacity S): virtual slot
    s lands at ring slot s mod R, and slots at S or beyond are dropped, never wrapped onto
    others."""
    rng = np.random.default_rng(2)
    L, B, K, R, D, S, T = 2, 4, 2, 5, 3, 12, 3
    start = np.array([0, 4, S - 2, S + 1], np.int32)  # in place; wrapping; one dropped; all
    buffer = rng.integers(-50, 50, (L, B, K, R, D)).astype(np.float32)
    new = rng.integers(100, 200, (B, T, K, D)).astype(np.float32)
    out = kv.write_layer(jnp.asarray(buffer), jnp.int32(1), jnp.asarray(new), jnp.asarray(start),
                         capacity=S)
    expected = buffer.copy()
    for b in range(B):
        for t in range(T):
            if start[b] + t < S:
                expected[1, b, :, (start[b] + t) % R] = new[b, t]
    np.testing.assert_array_equal(np.asarray(out), expected)
    assert (expected[1, 1] != buffer[1, 1]).any() and (expected[:, 3] == buffer[:, 3]).all()


@pytest.mark.parametrize("rings", [None, (True, False, True, True)], ids=["full", "rings"])
def test_write_chunk_writes_every_layer_at_each_row_length(rings):
    """``write_chunk`` (all layers of a buffer in one scatter) against a slot-by-slot reference:
    every layer, each row at its own length, slots past the capacity dropped; ring layers at
    virtual slot mod R, their slots past the capacity dropped too."""
    rng = np.random.default_rng(5)
    B, S, R, T, K, D = 4, 12, 6, 3, 2, 3
    layout = rings or (False,) * 3
    L = len(layout)
    full = rng.integers(-50, 50, (L - sum(layout), 2, B, S, K, D)).astype(np.float32)
    ring = rng.integers(-50, 50, (sum(layout), 2, B, R, K, D)).astype(np.float32)
    length = np.array([0, 5, S - 1, S + 1], np.int32)  # from 0; middle; one slot left; past
    new = rng.integers(100, 200, (2, L, B, T, K, D)).astype(np.float32)
    stored = lambda x: kv.by_slot(jnp.asarray(x))  # noqa: E731 ([L, B, S, K, D] drawn)
    cache = kv.KVCache(k=stored(full[:, 0]), v=stored(full[:, 1]),
                       length=jnp.asarray(length),
                       ring_k=stored(ring[:, 0]) if rings else None,
                       ring_v=stored(ring[:, 1]) if rings else None, rings=rings)
    out = kv.write_chunk(cache, jnp.asarray(new[0]), jnp.asarray(new[1]))
    want_full, want_ring = full.copy(), ring.copy()
    counts = [0, 0]
    for layer, is_ring in enumerate(layout):
        index = counts[is_ring]
        counts[is_ring] += 1
        for b in range(B):
            for t in range(T):
                s = length[b] + t
                if s >= S:
                    continue
                if is_ring:
                    want_ring[index, :, b, s % R] = new[:, layer, b, t]
                else:
                    want_full[index, :, b, s] = new[:, layer, b, t]
    np.testing.assert_array_equal(np.asarray(kv.by_slot(out.k)), want_full[:, 0])
    np.testing.assert_array_equal(np.asarray(kv.by_slot(out.v)), want_full[:, 1])
    if rings:
        np.testing.assert_array_equal(np.asarray(kv.by_slot(out.ring_k)), want_ring[:, 0])
        np.testing.assert_array_equal(np.asarray(kv.by_slot(out.ring_v)), want_ring[:, 1])
    np.testing.assert_array_equal(np.asarray(out.length), length + T)
    assert (want_full != full).any() and (not rings or (want_ring != ring).any())


# -- masks ----------------------------------------------------------------------------------------

def test_attention_mask_causal_chunk():
    rng = np.random.default_rng(2)
    B, T, S = 5, 4, 13
    length = rng.integers(0, S - T + 1, size=B).astype(np.int32)
    length[0], length[-1] = 0, S - T  # empty history; chunk ending at capacity
    mask = kv.attention_mask(jnp.asarray(length), kv.causal_mask(T), S)
    assert mask.shape == (B, T, S) and mask.dtype == jnp.bool_
    causal = np.array([[j <= i for j in range(T)] for i in range(T)])
    np.testing.assert_array_equal(np.asarray(mask), ref_attention_mask(length, causal, S))
    # spelled out: history + chunk up to and including itself
    for b in range(B):
        for t in range(T):
            visible = [s for s in range(S) if np.asarray(mask)[b, t, s]]
            assert visible == list(range(length[b] + t + 1))


@pytest.mark.parametrize("level", [1, 2])
def test_attention_mask_tree_level_window(level):
    """A draft expanding SEED_EXAMPLE level by level: the root sits at slot r, node i at r + i;
    the level's nodes are the chunk and the window covers every node written so far (W > T)."""
    tree = Tree(SEED_EXAMPLE)
    lo, hi = tree.levels[level - 1]
    chunk_mask = tree.ancestors[lo:hi, :hi]  # [T, W]
    T, W = hi - lo, hi
    assert W > T
    rng = np.random.default_rng(3 + level)
    B, S = 4, 12
    root = rng.integers(0, S - tree.num_nodes + 1, size=B).astype(np.int32)
    root[0] = 0
    length = root + lo  # the level is written right after the nodes before it
    mask = np.asarray(kv.attention_mask(jnp.asarray(length), jnp.asarray(chunk_mask), S))
    np.testing.assert_array_equal(mask, ref_attention_mask(length, chunk_mask, S))
    # spelled out: node i sees the history before the root and exactly its ancestors and itself
    for b in range(B):
        for t, i in enumerate(range(lo, hi)):
            ancestors = [j for j in range(tree.num_nodes) if tree.ancestors[i, j]]
            expected = list(range(root[b])) + [root[b] + j for j in ancestors]
            assert [s for s in range(S) if mask[b, t, s]] == expected


def test_attention_mask_per_row_chunk_mask():
    rng = np.random.default_rng(6)
    B, T, W, S = 4, 3, 5, 11
    chunk_mask = rng.random((B, T, W)) < 0.5
    length = rng.integers(W - T, S - T + 1, size=B).astype(np.int32)
    length[0], length[1] = W - T, S - T  # window starting at slot 0; chunk ending at capacity
    mask = kv.attention_mask(jnp.asarray(length), jnp.asarray(chunk_mask), S)
    assert mask.shape == (B, T, S)
    np.testing.assert_array_equal(np.asarray(mask), ref_attention_mask(length, chunk_mask, S))
    # the rows really differ, so a broadcast of one row's mask would fail
    assert len({chunk_mask[b].tobytes() for b in range(B)}) > 1


def test_window_mask_with_tree_positions():
    """Chunk = the whole TREE at positions length + depth (repeated positions); history slot s
    holds position s. Checked on every non-garbage slot, and combined with the attention mask
    (which hides garbage) on every slot."""
    tree = Tree(TREE)
    rng = np.random.default_rng(7)
    B, S, window = 4, 16, 3
    T = tree.num_nodes
    length = rng.integers(0, S - T + 1, size=B).astype(np.int32)
    length[0], length[-1] = 0, S - T
    positions = (length[:, None] + tree.depths[None, :]).astype(np.int32)  # [B, T]
    mask = np.asarray(kv.window_mask(jnp.asarray(length), jnp.asarray(positions), S, window))
    assert mask.shape == (B, T, S)
    attend = np.asarray(kv.attention_mask(jnp.asarray(length), jnp.asarray(tree.ancestors), S))
    ref_attend = ref_attention_mask(length, tree.ancestors, S)
    for b in range(B):
        for t in range(T):
            q = int(positions[b, t])
            for s in range(S):
                k = ref_key_positions(length, positions, b, s)
                if k is not None:
                    assert mask[b, t, s] == (q - k < window), (b, t, s)
                    ref_attend[b, t, s] &= q - k < window
    np.testing.assert_array_equal(attend & mask, ref_attend)


def test_window_mask_chain_chunk():
    """A plain chunk at positions length .. length + T - 1 behaves like slot positions."""
    B, T, S, window = 3, 4, 10, 2
    length = np.array([0, 3, S - T], np.int32)
    positions = length[:, None] + np.arange(T)[None, :]
    mask = np.asarray(kv.window_mask(jnp.asarray(length), jnp.asarray(positions), S, window))
    for b in range(B):
        for t in range(T):
            for s in range(length[b] + T):
                assert mask[b, t, s] == (positions[b, t] - s < window), (b, t, s)


@pytest.mark.parametrize("T", [1, 4])
def test_causal_mask(T):
    mask = kv.causal_mask(T)
    assert mask.shape == (T, T) and mask.dtype == jnp.bool_
    expected = np.zeros((T, T), bool)
    for i in range(T):
        for j in range(T):
            expected[i, j] = j <= i
    np.testing.assert_array_equal(np.asarray(mask), expected)


# -- compact --------------------------------------------------------------------------------------

# TREE nodes: 0 root, 1 (0,), 2 (1,), 3 (0,0), 4 (0,1), 5 (1,0), 6 (0,0,0)
COMPACT_ROWS = [  # (start, path [depth 1, 2, 3], num_accepted)
    (0, [1, 3, 6], 3),   # full depth, every entry already in place except depths 2, 3
    (2, [2, 5, 4], 2),   # second branch; path[2] is padding past num_accepted
    (5, [1, 4, 6], 2),   # start + num_nodes == S: the tree ends exactly at capacity
    (1, [2, 5, 6], 0),   # nothing accepted: nothing moves (padding must be ignored)
    (3, [2, 4, 6], 1),   # one accepted
]


def compact_inputs(seed=8):
    tree = Tree(TREE)
    rng = np.random.default_rng(seed)
    B, S = len(COMPACT_ROWS), 12
    assert max(r[0] for r in COMPACT_ROWS) + tree.num_nodes == S
    cache = random_cache(rng, L=2, B=B, S=S, K=2, D=3)
    start = np.array([r[0] for r in COMPACT_ROWS], np.int32)
    path = np.array([r[1] for r in COMPACT_ROWS], np.int32)
    num_accepted = np.array([r[2] for r in COMPACT_ROWS], np.int32)
    assert ((path >= 1) & (path < tree.num_nodes)).all()  # padding is in range too
    for b in range(B):  # each row's accepted prefix is a real root-to-node path of the tree
        for j in range(num_accepted[b]):
            assert tree.depths[path[b, j]] == j + 1
            assert tree.parents[path[b, j]] == (path[b, j - 1] if j else 0)
    return cache, start, path, num_accepted


def compact_mismatches(compact_fn, cache, start, path, num_accepted):
    """Run compact_fn and compare to the reference; returns the (what, b, slot) that differ."""
    k0, v0 = (np.asarray(kv.by_slot(x)).copy() for x in (cache.k, cache.v))  # [L, B, S, K, D]
    length0 = np.asarray(cache.length).copy()
    out = compact_fn(cache, jnp.asarray(start), jnp.asarray(path), jnp.asarray(num_accepted))
    bad = []
    if not np.array_equal(np.asarray(out.length), length0):
        bad.append(("length", None, None))
    for name, before, after in (("k", k0, np.asarray(kv.by_slot(out.k))),
                                ("v", v0, np.asarray(kv.by_slot(out.v)))):
        if after.shape != before.shape:
            bad.append((name + " shape", None, None))
            continue
        _, B, S = before.shape[:3]
        for b in range(B):
            for s in range(S):
                j = s - int(start[b])
                if 1 <= j <= int(num_accepted[b]):  # reads come from the original cache
                    want = before[:, b, int(start[b]) + int(path[b, j - 1])]
                else:
                    want = before[:, b, s]
                if not np.array_equal(after[:, b, s], want):
                    bad.append((name, b, s))
    return bad


def test_compact_matches_reference():
    cache, start, path, num_accepted = compact_inputs()
    assert compact_mismatches(kv.compact, cache, start, path, num_accepted) == []


def _compact_without_cut(cache, start, path, num_accepted):
    return kv.compact(cache, start, path, jnp.full_like(num_accepted, path.shape[1]))


def _compact_off_by_one(cache, start, path, num_accepted):
    return kv.compact(cache, start - 1, path, num_accepted)


def _compact_k_only(cache, start, path, num_accepted):
    return dataclasses.replace(kv.compact(cache, start, path, num_accepted), v=cache.v)


@pytest.mark.parametrize("broken", [_compact_without_cut, _compact_off_by_one, _compact_k_only],
                         ids=["no_num_accepted_cut", "off_by_one", "v_not_moved"])
def test_compact_checker_catches_broken_variants(broken):
    cache, start, path, num_accepted = compact_inputs()
    bad = compact_mismatches(broken, cache, start, path, num_accepted)
    assert bad, "the checker accepted a broken compact"
    if broken is _compact_without_cut:  # exactly the rows whose padding was wrongly used
        assert {b for _, b, _ in bad} == {b for b, r in enumerate(COMPACT_ROWS)
                                          if any(p != j + 1 for j, p in enumerate(r[1][r[2]:],
                                                                                   r[2]))}
