"""Compile once, run any request: capacity tiers, chunked prefill, warm-up, and outputs that do
not change across tiers, chunk boundaries and attention block sizes."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import perturbed, release_programs, tiny_model

import specjax as sj
from specjax import attention, engine
from specjax.model import PREFILL_CHUNK

GREEDY = sj.SamplingParams(temperature=0, max_new_tokens=24)


@pytest.fixture(scope="module")
def long_pair():
    """A target and draft with a 600-token context, so tiers above one block exist."""
    target = tiny_model(seed=0, vocab_size=32, hidden_size=32, layers=2, heads=4, kv_heads=2,
                        max_pos=600)
    draft = tiny_model(seed=1, vocab_size=32, hidden_size=16, layers=1, heads=2, kv_heads=1,
                       max_pos=600)
    return target, draft


@pytest.fixture(scope="module")
def close_draft(long_pair):
    """A perturbed copy of long_pair's target: its drafts are accepted at every depth, and
    rejected too (the small draft's almost never are, so a greedy check with it would compare
    plain decoding with plain decoding)."""
    target = long_pair[0]
    return sj.Model(target.config, perturbed(target.params, 1, 0.05))


def engaged(stats, gamma: int) -> None:
    """The speculative path ran: drafts accepted at the deepest position, and rejected."""
    assert stats.per_position_acceptance[gamma - 1] > 0 and stats.rejecting_rounds > 0, stats


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, 32, size=n)) for n in lengths]


def test_capacity_tiers_and_max_cache_len(long_pair):
    cfg = long_pair[0].config
    assert engine.cache_capacity(cfg, 4, 10) == 256
    assert engine.cache_capacity(cfg, 4, 256) == 256
    assert engine.cache_capacity(cfg, 4, 257) == 604  # the 1024 tier, cut to what 600 can use
    # a long-context model past the last listed tier: 4 times a step, not its whole context
    # (a request of 262,145 slots on a 10M-token model took a 10M-slot cache)
    huge = dataclasses.replace(cfg, max_position_embeddings=10_000_000)
    assert engine.cache_capacity(huge, 4, 262_144) == 262_144
    assert engine.cache_capacity(huge, 4, 262_145) == 1_048_576
    assert engine.cache_capacity(huge, 4, 4_194_305) == 10_000_004  # 16M: cut to its context
    assert engine.cache_capacity(cfg, 0, 300, max_cache_len=300) == 300
    with pytest.raises(ValueError, match="max_cache_len=299 is too small"):
        engine.cache_capacity(cfg, 0, 300, max_cache_len=299)
    with pytest.raises(ValueError, match="max_cache_len=700 is more than the target can use"):
        engine.cache_capacity(cfg, 4, 10, max_cache_len=700)
    for bad in (0, -5, 2.5, "256", True):
        with pytest.raises(ValueError, match="max_cache_len must be a positive int"):
            engine.cache_capacity(cfg, 4, 10, max_cache_len=bad)


@pytest.mark.parametrize("method", ["draft_model", "ngram", "tree", "eagle", "medusa"])
def test_greedy_equal_across_tiers_chunks_and_blocks(long_pair, close_draft, monkeypatch,
                                                     method):
    """Rows of very different lengths in one batch: one exactly a prefill chunk long, one a token
    past it, a short one and one that crosses the 256-slot attention block while decoding. Every
    method equals autoregressive greedy decoding, in the dense tier (256) and in blocked ones
    (the draft model and the tree with a close draft: drafts accepted and rejected at every
    depth)."""
    target, draft = long_pair[0], close_draft
    short = prompts_of([PREFILL_CHUNK, PREFILL_CHUNK + 1, 3], seed=1)
    batch = short + prompts_of([250], seed=2)
    ref_short = sj.generate(target, short, sampling=GREEDY)
    ref = sj.generate(target, batch, sampling=GREEDY)
    assert ref.stats.capacity == 600 and ref_short.stats.capacity == 256  # the context for AR
    np.testing.assert_array_equal(ref.tokens[:3], ref_short.tokens)  # blocked = dense
    kw = {"draft_model": dict(spec=sj.SpecConfig(num_speculative_tokens=3), draft=draft),
          "ngram": dict(spec=sj.SpecConfig(method="ngram", num_speculative_tokens=3,
                                           prompt_lookup_min=1)),
          "tree": dict(spec=sj.SpecConfig(num_speculative_tokens=3, tree=[[0], [1], [0, 0]]),
                       draft=draft),
          "eagle": dict(spec=sj.SpecConfig(method="eagle", num_speculative_tokens=3),
                        draft=sj.init_heads(target, "eagle", jax.random.key(3))),
          "medusa": dict(spec=sj.SpecConfig(method="medusa", num_speculative_tokens=2),
                         draft=sj.init_heads(target, "medusa", jax.random.key(4),
                                             num_heads=2))}[method]
    out = sj.generate(target, batch, sampling=GREEDY, **kw)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    if method in ("draft_model", "tree"):
        engaged(out.stats, 3 if method == "draft_model" else 2)
    if method == "draft_model":  # a capacity of the caller's, two blocks with one live
        out = sj.generate(target, short, sampling=GREEDY, max_cache_len=400, **kw)
        assert out.stats.capacity == 400
        np.testing.assert_array_equal(out.tokens, ref_short.tokens)
    monkeypatch.setattr(attention, "BLOCK", 16)  # many blocks, a partial last one
    out = sj.generate(target, batch, sampling=GREEDY, **kw)
    np.testing.assert_array_equal(out.tokens, ref.tokens)


def test_eagle_prefill_in_chunks_equals_one_forward(long_pair):
    """The EAGLE head's cache after a chunked prefill holds what one forward over the whole
    prompt writes."""
    target, _ = long_pair
    heads = sj.init_heads(target, "eagle", jax.random.key(5))
    proposer = sj.draft.eagle.EagleProposer(heads.config, 3)
    rows = prompts_of([PREFILL_CHUNK * 2 + 5, 7], seed=3)
    P = len(rows[0])
    prompts = np.zeros((2, P), np.int32)
    for b, r in enumerate(rows):
        prompts[b, :len(r)] = r
    lengths = jax.numpy.asarray([len(r) for r in rows])
    _, hidden, _ = sj.prefill(target, jax.numpy.asarray(prompts))
    params = {"heads": heads.params, "target": target.params}
    state = proposer.init(params, jax.numpy.asarray(prompts), lengths, 256, hidden)
    nxt = np.concatenate([prompts[:, 1:], np.zeros((2, 1), np.int32)], axis=1)
    whole = sj.KVCache.init(heads.config.layer, 2, 256)
    _, whole = sj.draft.heads.eagle_forward(
        heads.config, heads.params["weights"], hidden,
        sj.draft.heads.embed(target.params, jax.numpy.asarray(nxt)),
        jax.numpy.broadcast_to(jax.numpy.arange(P), (2, P)), whole)
    assert list(np.asarray(state.cache.length)) == [P - 1, 6]
    for b, n in enumerate([P - 1, 6]):
        for got, want in [(state.cache.k, whole.k), (state.cache.v, whole.v)]:
            np.testing.assert_allclose(np.asarray(got[:, b, :, :n]), np.asarray(want[:, b, :, :n]),
                                       atol=2e-5)


def test_request_that_exactly_fills_max_cache_len(long_pair, close_draft):
    target, draft = long_pair[0], close_draft
    rows = prompts_of([40, 3], seed=4)
    spec = sj.SpecConfig(num_speculative_tokens=3)
    needed = 40 + GREEDY.max_new_tokens + 3
    out = sj.generate(target, rows, sampling=GREEDY, spec=spec, draft=draft,
                      max_cache_len=needed)
    ref = sj.generate(target, rows, sampling=GREEDY)
    np.testing.assert_array_equal(out.lengths, [24, 24])
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    engaged(out.stats, 3)
    with pytest.raises(ValueError, match=f"max_cache_len={needed - 1} is too small"):
        sj.generate(target, rows, sampling=GREEDY, spec=spec, draft=draft,
                    max_cache_len=needed - 1)


def mixed_request(rng, rows: int, longest: tuple[int, int], gamma: int, capacity: int):
    """Random prompts (the longest drawn from ``longest``), max_new_tokens filling at most
    ``capacity`` slots, and random sampling settings (temperature, top_k below the vocabulary,
    top_p, key)."""
    top = int(rng.integers(*longest))
    lengths = [top, *rng.integers(1, top + 1, size=rows - 1)]
    max_new = int(rng.integers(1, capacity - top - gamma + 1))
    sampling = sj.SamplingParams(temperature=float(rng.uniform(0.2, 1.5)),
                                 top_k=int(rng.integers(1, 32)),
                                 top_p=float(rng.uniform(0.5, 0.99)), max_new_tokens=max_new)
    seed, key = rng.integers(1 << 30, size=2)
    return prompts_of(lengths, seed=int(seed)), sampling, int(key)


def test_a_mixed_workload_compiles_once_per_tier(long_pair, fresh_programs):
    """Requests of random prompt lengths (across prefill chunks), max_new_tokens, row counts of
    one batch bucket (5 and 6 rows) and sampling settings: the first request of a capacity tier
    compiles, every later one of that tier runs its programs (a bucket per request would
    compile a program for nearly every one)."""
    target, draft = long_pair
    spec = sj.SpecConfig(num_speculative_tokens=3)
    rng = np.random.default_rng(3)
    per_tier = {}
    for tier, longest in [(256, (1, 200)), (603, (257, 500))]:  # 603: 600 + γ
        before = engine.compiled_programs()
        for i in range(6 if tier == 256 else 3):
            rows = int(rng.integers(5, 7))
            prompts, sampling, key = mixed_request(rng, rows, longest, 3, tier)
            out = sj.generate(target, prompts, spec=spec, draft=draft, key=key, sampling=sampling)
            assert out.stats.capacity == tier, (out.stats.capacity, tier)
            assert (out.stats.compile_seconds > 0) == (i == 0), (tier, i)
            assert out.tokens.shape == (rows, sampling.max_new_tokens)
            assert (out.lengths == sampling.max_new_tokens).all()
        per_tier[tier] = engine.compiled_programs() - before
    assert per_tier[256] == per_tier[603] > 0, per_tier


def test_warmup_compiles_what_generate_then_uses(long_pair, fresh_programs):
    target, draft = long_pair
    spec = sj.SpecConfig(num_speculative_tokens=2)
    sampling = sj.SamplingParams(temperature=0.8, max_new_tokens=30)
    done = sj.warmup(target, batch_size=2, prompt_tokens=20, sampling=sampling, spec=spec,
                     draft=draft)
    assert done.compiled == 2 and done.capacity == 256 and done.batch == 2
    assert done.compile_seconds > 0
    before = engine.compiled_programs()
    out = sj.generate(target, prompts_of([12, 3]), sampling=sampling, spec=spec, draft=draft)
    assert out.stats.compile_seconds == 0 and engine.compiled_programs() == before
    again = sj.warmup(target, batch_size=2, prompt_tokens=20, sampling=sampling, spec=spec,
                      draft=draft)
    assert again.compiled == 0 and again.compile_seconds == 0
    # stream (and stop strings) run the loop in segments, one more executable: stream=True
    # compiles it too, so the first stream compiles nothing
    streamed = sj.warmup(target, batch_size=2, prompt_tokens=20, sampling=sampling, spec=spec,
                         draft=draft, stream=True)
    assert streamed.compiled == 1 and streamed.compile_seconds > 0
    before = engine.compiled_programs()
    chunks = list(sj.stream(target, prompts_of([12, 3]), sampling=sampling, spec=spec,
                            draft=draft))
    assert chunks[-1].generation.stats.compile_seconds == 0
    assert engine.compiled_programs() == before
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        sj.warmup(target, batch_size=0)
    with pytest.raises(ValueError, match="max_cache_len=10 is too small"):
        sj.warmup(target, prompt_tokens=5, sampling=sampling, max_cache_len=10)


def test_stats_report_capacity_and_cache_bytes(long_pair):
    target, draft = long_pair
    out = sj.generate(target, prompts_of([4]), sampling=GREEDY, draft=draft,
                      spec=sj.SpecConfig(num_speculative_tokens=2))
    S = out.stats.capacity
    per_slot = sum(2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
                   for c in (target.config, draft.config))
    # K and V of both caches, and their int32 lengths
    assert S == 256 and out.stats.cache_bytes_per_row == per_slot * S + 2 * 4


def _cache_copies(target, draft, method="draft_model", **spec):
    """Instructions of a batch-2 decode loop (512 slots) that copy a whole KV cache buffer."""
    release_programs()
    sj.generate(target, prompts_of([5, 9]), sampling=GREEDY, max_cache_len=512,
                draft=draft if method == "draft_model" else None,
                spec=sj.SpecConfig(method=method, num_speculative_tokens=3, **spec))
    (decode,) = engine.PROGRAMS.programs()[-1].executables("decode")
    # a copy spanning all 512 slots (a block of the blocked attention spans 256)
    return [dims for dims in re.findall(r"= \w+\[([\d,]+)\]\S* copy\(", decode.as_text())
            if "512" in dims.split(",")]


def test_the_decode_loop_copies_no_cache_buffer(long_pair, monkeypatch, fresh_programs):
    """Writes update the caches in place for every batch size, so a step costs what is live,
    not the capacity. A vmapped per-row write (which moves the row axis to the front, and so
    copies the whole buffer at every write once B > 1) is caught by the same check."""
    target, draft = long_pair
    assert _cache_copies(target, draft) == []

    write_rows = sj.cache._write_rows

    def vmapped(buffer, new, start, layer, capacity=None, layers=False):
        T = new.shape[1]
        if layers:  # (all layers at once: left as it is)
            return write_rows(buffer, new, start, layer, capacity, layers)
        if layer is None:
            return jax.vmap(lambda b, x, s: b.at[s + jnp.arange(T)].set(x, mode="drop"))(
                buffer, new, start)
        # a row's [L, K, S, D]: layer ``layer``'s slots s .. s + T - 1 get x [T, K, D]
        return jax.vmap(lambda b, x, s: b.at[layer, :, s + jnp.arange(T)].set(x, mode="drop"),
                        in_axes=(1, 0, 0), out_axes=1)(buffer, new, start)
    monkeypatch.setattr(sj.cache, "_write_rows", vmapped)
    jax.clear_caches()
    assert _cache_copies(target, draft) != []


@pytest.mark.parametrize("method", ["ngram", "adaptive"])
def test_a_chain_with_per_row_lengths_copies_no_cache_buffer(long_pair, monkeypatch,
                                                             fresh_programs, method):
    """N-gram's and adaptive chains' verify width is chosen on the device: one loop per width,
    each writing the cache in place (``engine._rounds``). Choosing it inside the round by a
    ``lax.switch`` whose branches write the cache (as n-gram once did) made XLA copy the whole
    cache every round, and fails the same check."""
    target, draft = long_pair
    if method == "adaptive":
        assert _cache_copies(target, draft, "draft_model", survival_threshold=0.3) == []
    else:
        assert _cache_copies(target, None, "ngram") == []

    def written_inside(plan, target, request, state, chunk, draft, keys):
        branches = [lambda T=T: engine._verify_chain(plan, target, request, state, chunk, draft,
                                                     keys, T)
                    for T in range(1, plan.gamma + 2)]
        proposed = jnp.where(state.done, 0, jnp.sum(draft.valid, axis=1, dtype=jnp.int32))
        return jax.lax.switch(jnp.max(proposed), branches)
    if method == "adaptive":
        return
    monkeypatch.setattr(engine, "_verify_chain_any_length", written_inside)
    # rounds that propose their own drafts, so the width is chosen inside each
    monkeypatch.setattr(engine, "_per_row_lengths", lambda *args: False)
    jax.clear_caches()
    assert _cache_copies(target, None, "ngram") != []


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_dropped_programs_release_their_memory(long_pair, monkeypatch, fresh_programs):
    """Programs the cache drops are really freed: jax's own caches kept every executable (and
    its ~200 memory mappings; Linux allows a process 65,530), so a long-lived process cycling
    through request shapes crashed in the end. The program still held runs without compiling."""
    target, _ = long_pair
    monkeypatch.setattr(engine, "PROGRAMS", engine.ProgramCache(size=4))
    greedy = sj.SamplingParams(temperature=0, max_new_tokens=4)

    def call(capacity):
        return sj.generate(target, prompts_of([5]), sampling=greedy,
                           spec={"method": "ngram"}, max_cache_len=capacity)
    for capacity in (40, 41):
        call(capacity)
    steady = _mappings()
    for capacity in range(42, 48):  # 6 more plans, 12 more executables
        call(capacity)
    assert _mappings() < steady + 1000  # each plan held on would add about 400
    compiled = engine.compiled_programs()
    call(47)  # the most recent program is still held
    assert engine.compiled_programs() == compiled


def test_the_program_cache_keeps_the_process_under_its_mapping_budget(long_pair, monkeypatch,
                                                                       fresh_programs):
    """Each compiled program holds ~1,400-5,400 memory mappings, and Linux aborts a process at
    vm.max_map_count: after a compile, a lookup drops the least recently used programs until
    the process is back under the cache's budget, however few executables it holds."""
    target, _ = long_pair
    greedy = sj.SamplingParams(temperature=0, max_new_tokens=4)

    def call(capacity):
        return sj.generate(target, prompts_of([5]), sampling=greedy,
                           spec={"method": "ngram"}, max_cache_len=capacity)
    budget = _mappings() + 150  # less than one program's (about 400 here)
    monkeypatch.setattr(engine, "PROGRAMS", engine.ProgramCache(size=64, mappings=budget))
    for capacity in (40, 41, 42):
        call(capacity)
    # each lookup after a compile dropped the program before: only the last is held
    assert [p.plan.capacity for p in engine.PROGRAMS.programs()] == [42]
    assert _mappings() < budget + 1000  # one program over the budget, not three
    unbounded = engine.ProgramCache(size=64, mappings=None)
    monkeypatch.setattr(engine, "PROGRAMS", unbounded)
    for capacity in (43, 44, 45):
        call(capacity)
    assert len(unbounded.programs()) == 3  # the bound is what dropped them, not the size
    unbounded.bound()  # no budget: nothing to do
    assert len(unbounded.programs()) == 3
    unbounded.mappings = _mappings() - 1  # just over: one program dropped is enough
    unbounded.bound()
    assert [p.plan.capacity for p in unbounded.programs()] == [44, 45]
    unbounded.mappings = 0  # other compiled code filled the budget: bound() drops every
    unbounded.bound()  # program (the bench calls it after compiling its timers)
    assert unbounded.programs() == []
    assert abs(engine.memory_mappings() - _mappings()) < 50
    assert engine.mapping_budget() == int(open("/proc/sys/vm/max_map_count").read()) * 3 // 4
