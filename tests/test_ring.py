"""Sliding layers that keep only their window (rings, specjax/cache.py).

A model whose sliding layers keep rings computes what it computes with the whole cache: through
chunked prefill (rows of different lengths), verify chunks rolled back by length, chunks kept out
of the cache and written after, and tree commits, well past the point where the rings wrap. The
engine uses rings: its greedy tokens and log-probabilities equal those of the whole cache, chains
and trees. Each comparison fails for a ring one slot too small.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import release_programs, tiny_model

import specjax as sj
from specjax import attention, engine
from specjax import cache as kv
from specjax.tree import Tree

WINDOW = 5
KINDS = ("sliding_attention", "full_attention", "sliding_attention")
TREE = Tree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))  # 7 nodes with the root
CHUNK = 16  # the prefill chunk, the largest write: rings of WINDOW + CHUNK - 1 = 20 slots


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, vocab_size=32, hidden_size=32, layers=3, heads=4, kv_heads=2,
                      max_pos=256, sliding_window=WINDOW, layer_types=KINDS)


def _trace(model, span, block, rounds=24, seed=0):
    """Logits and hidden states through a chunked prefill of rows of 70 and 9 tokens, then
    ``rounds`` rounds of a 4-token chain (written, or kept apart and written after) or a tree
    (compacted along a random path), each rolled back to a random accepted length. Returns the
    outputs, in order, and the cache."""
    rng = np.random.default_rng(seed)
    B, S, V = 2, 192, model.config.vocab_size
    lengths = jnp.array([70, 9])
    prompts = jnp.asarray(rng.integers(0, V, (B, 80)), jnp.int32)
    cache = sj.KVCache.init(model.config, B, S, span=span)
    outs = []
    with attention.blocks_of(block):
        last, hidden, cache = sj.model.prefill_chunked(model, prompts, lengths, cache, CHUNK,
                                                       keep_hidden=True)
        outs += [last, jnp.where(jnp.arange(80)[None, :, None] < lengths[:, None, None],
                                 hidden, 0)]
        for r in range(rounds):
            kind = ("chain", "apart", "tree")[r % 3]
            length = cache.length
            T = TREE.num_nodes if kind == "tree" else 4
            tokens = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
            depths = TREE.depths if kind == "tree" else np.arange(T)
            positions = length[:, None] + jnp.asarray(depths, jnp.int32)[None, :]
            mask = jnp.asarray(TREE.ancestors) if kind == "tree" else None
            if kind == "apart":
                logits, _, (k, v) = sj.forward(model, tokens, positions, cache, write=False)
                cache = kv.write_chunk(cache, k, v)
            else:
                logits, _, cache = sj.forward(model, tokens, positions, cache, mask)
            outs.append(logits)
            if kind == "tree":  # a random root-to-node path of the tree, cut at random
                leaf = rng.integers(1, TREE.num_nodes, B)
                path = np.zeros((B, TREE.depth), np.int32)
                for b in range(B):
                    node = int(leaf[b])
                    while node:
                        path[b, TREE.depths[node] - 1] = node
                        node = TREE.parents[node]
                accepted = np.array([rng.integers(0, TREE.depths[n] + 1) for n in leaf])
                cache = kv.compact(cache, length, jnp.asarray(path), jnp.asarray(accepted))
                cache = cache.rollback(length + 1 + jnp.asarray(accepted, jnp.int32))
            else:
                cache = cache.rollback(length + jnp.asarray(rng.integers(1, T + 1, B),
                                                            jnp.int32))
    return [np.asarray(x) for x in outs], cache


def _mismatch(model, block, span=CHUNK) -> float:
    """Largest difference between the outputs with rings and with the whole cache."""
    want, full = _trace(model, None, block)
    got, ringed = _trace(model, span, block)
    assert full.ring is None and ringed.ring is not None and ringed.ring < full.capacity
    assert int(ringed.length.max()) > 3 * ringed.ring  # the rings wrapped several times
    return max(float(np.max(np.abs(a - b))) for a, b in zip(got, want))


# block 256: every layer dense; 12: the 20-slot rings dense over two blocks
# (attention.ring_is_dense), the 192-slot full layer walked in blocks; 8: both walked in blocks
BLOCKS = pytest.mark.parametrize("block", [256, 12, 8], ids=["dense", "ring-dense", "blocked"])


def test_which_rings_attend_densely():
    assert attention.ring_is_dense(20, 12) and not attention.ring_is_dense(20, 8)


@BLOCKS
def test_rings_compute_what_the_whole_cache_computes(model, block):
    assert _mismatch(model, block) < 1e-4


@pytest.mark.parametrize("broken", ["ring_too_small", "padding_at_start"])
@BLOCKS
def test_the_comparison_catches_broken_rings(model, monkeypatch, fresh_programs, block, broken):
    """A ring one slot smaller than window + span - 1 (let past the check that refuses it), or a
    prefill that writes a finished row's padding at the chunk's start (it evicts what the row's
    next tokens see)."""
    if broken == "ring_too_small":
        monkeypatch.setattr(sj.model, "check_span", lambda *a: None)
        size = kv.ring_size
        monkeypatch.setattr(kv, "ring_size",
                            lambda *a: None if size(*a) is None else size(*a) - 1)
    else:
        monkeypatch.setattr(sj.model, "padding_start", lambda start, lengths: jnp.full_like(
            lengths, start))
    assert _mismatch(model, block) > 1e-2


def test_only_sliding_layers_keep_rings_of_window_plus_span(model):
    cache = sj.KVCache.init(model.config, 3, 192, span=16)
    assert cache.k.shape == (1, 3, 2, 192, 8) and cache.ring_k.shape == (2, 3, 2, 20, 8)
    assert cache.rings == (True, False, True) and cache.capacity == 192
    assert cache.layout(3) == ((True, 0), (False, 0), (True, 1))
    # no rings without a span, without sliding layers, or when a ring would not be smaller
    assert sj.KVCache.init(model.config, 3, 192).ring is None
    assert sj.KVCache.init(model.config, 3, 20, span=16).ring is None
    plain = dataclasses.replace(model.config, sliding_window=None, layer_types=None)
    assert sj.KVCache.init(plain, 3, 192, span=16).ring is None
    every = dataclasses.replace(model.config, layer_types=None)  # Mistral: every layer slides
    cache = sj.KVCache.init(every, 3, 192, span=16)
    assert cache.k.shape[0] == 0 and cache.capacity == 192 and cache.ring_k.shape[0] == 3


GREEDY = sj.SamplingParams(temperature=0.0, max_new_tokens=60, logprobs=2)
SAMPLED = sj.SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=60, logprobs=2)


def test_a_chunk_wider_than_the_rings_allow_is_refused(model):
    cache = sj.KVCache.init(model.config, 1, 192, span=4)  # rings of 5 + 4 - 1 = 8
    tokens = jnp.zeros((1, 5), jnp.int32)
    with pytest.raises(ValueError, match=r"span=5"):
        sj.forward(model, tokens, jnp.arange(5)[None], cache)
    sj.forward(model, tokens[:, :4], jnp.arange(4)[None], cache)  # within the span


def _generate(model, draft, spec, monkeypatch, rings: bool, sampling=GREEDY):
    release_programs()  # the ring is not part of the plan: compile again
    with monkeypatch.context() as patch:
        if not rings:
            patch.setattr(kv, "ring_size", lambda *a: None)
        prompts = [list(range(1, 31)) * 3, [4, 5, 6]]  # 90 and 3 tokens
        return sj.generate(model, prompts, draft=draft, spec=spec, sampling=sampling, key=3)


@pytest.mark.parametrize("spec,sampling", [(None, GREEDY), ("chain", GREEDY), ("tree", GREEDY),
                                           ("chain", SAMPLED), ("tree", SAMPLED)],
                         ids=["greedy", "chain-greedy", "tree-greedy", "chain-T0.7-topk-topp",
                              "tree-T0.7-topk-topp"])
def test_the_engine_with_rings_decodes_as_with_the_whole_cache(model, monkeypatch,
                                                               fresh_programs, spec, sampling):
    """90 + 60 tokens through rings of 5 + 64 - 1 slots (the engine's prefill chunk is the
    largest write): the same tokens and log-probabilities as with the whole cache, and less
    cache memory. Sampled with the same key, the same tokens too: what the whole cache samples
    follows the target (the G-tests of tests/test_lossless.py), so what rings sample does."""
    draft = sj.init_model(dataclasses.replace(model.config, num_hidden_layers=1,
                                              layer_types=None), jax.random.key(9),
                          init_std=0.5) if spec else None
    spec = None if spec is None else sj.SpecConfig(
        method="draft_model", **({"tree": ((0,), (1,), (0, 0), (0, 0, 0))} if spec == "tree"
                                 else {"num_speculative_tokens": 3}))
    got = _generate(model, draft, spec, monkeypatch, True, sampling)
    want = _generate(model, draft, spec, monkeypatch, False, sampling)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs.token, want.logprobs.token, atol=1e-4)
    assert got.stats.cache_bytes_per_row < want.stats.cache_bytes_per_row


@pytest.mark.parametrize("broken,spec", [("span", "chain"), ("compact", "tree")])
def test_the_engine_comparison_catches_broken_rings(model, monkeypatch, fresh_programs, broken,
                                                    spec):
    """Rings sized for a round's writes but not for the prefill chunk's (let past the check that
    refuses it), or a tree commit that leaves the rings alone: the engine's tokens differ from the
    whole cache's."""
    if broken == "span":
        monkeypatch.setattr(engine.Plan, "span", property(lambda plan: plan.gamma + 1))
        monkeypatch.setattr(sj.model, "check_span", lambda *a: None)
    else:
        compact = kv.compact
        monkeypatch.setattr(kv, "compact", lambda cache, *a: dataclasses.replace(
            compact(cache, *a), ring_k=cache.ring_k, ring_v=cache.ring_v))
    with pytest.raises(AssertionError, match="not equal"):
        test_the_engine_with_rings_decodes_as_with_the_whole_cache(model, monkeypatch, None,
                                                                   spec, GREEDY)
