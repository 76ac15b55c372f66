"""Sharded runs on 8 fake CPU devices. Not collected by the main pytest run (its name does not
start with test_): tests/test_sharding.py runs it in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8, set before jax is imported."""

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest
from conftest import perturbed, traces_and_compiles
from jax.sharding import PartitionSpec as P

import specjax as sj
from specjax import attention, checkpoint, compile_cache, engine, sharding

assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"

MESHES = [(1, 8), (2, 4), (8, 1)]
TARGET = sj.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                        max_position_embeddings=128)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [3] * 11]  # 3 rows: padded to the "data" size


@pytest.fixture(scope="module")
def models():
    target = sj.init_model(TARGET, jax.random.key(0), init_std=0.3)
    # a perturbed copy: drafts often accepted
    draft = sj.Model(TARGET, perturbed(target.params, 1, 0.05))
    # an (untrained) EAGLE head on the target: sharded runs must equal one device with it too
    eagle = sj.init_heads(target, "eagle", jax.random.key(2), init_std=0.3)
    return target, draft, eagle


def test_make_mesh():
    mesh = sj.make_mesh(data=2, model=4)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert dict(sj.make_mesh(data=2).shape) == {"data": 2, "model": 4}
    assert dict(sj.make_mesh().shape) == {"data": 1, "model": 8}
    for kw, message in [(dict(data=3), "does not divide the 8 devices"),
                        (dict(data=2, model=2), "= 4 devices, but 8 are visible"),
                        (dict(data=0), "data must be an int >= 1")]:
        with pytest.raises(ValueError, match=message):
            sj.make_mesh(**kw)
    with pytest.raises(ValueError, match="axes \\('data', 'model'\\)"):
        sj.generate(sj.init_model(TARGET, jax.random.key(0)), PROMPTS,
                    mesh=jax.make_mesh((8,), ("x",)))


# The table, written out by hand (not computed by specjax) for TARGET on 4 "model" devices.
LAYER = {  # each layer's parameters, layers/<i>/...
    "input_layernorm/weight": P(),
    "post_attention_layernorm/weight": P(),
    "self_attn/q_proj/kernel": P(None, "model"),
    "self_attn/k_proj/kernel": P(None, "model"),
    "self_attn/v_proj/kernel": P(None, "model"),
    "self_attn/o_proj/kernel": P("model", None),
    "mlp/gate_proj/kernel": P(None, "model"),
    "mlp/up_proj/kernel": P(None, "model"),
    "mlp/down_proj/kernel": P("model", None),
}
EXPECTED = {
    "embed_tokens/embedding": P("model", None),
    **{f"layers/{i}/{name}": spec for i in range(TARGET.num_hidden_layers)
       for name, spec in LAYER.items()},
    "norm/weight": P(),
    "lm_head/kernel": P(None, "model"),
}


def _flat(params):
    return {"/".join(k.key for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def test_params_are_sharded_as_the_table_says(models):
    target, _, _ = models
    mesh = sj.make_mesh(data=2, model=4)
    placed = _flat(sj.shard(target, mesh).params)
    assert set(placed) == set(EXPECTED)
    for name, leaf in placed.items():
        spec = EXPECTED[name]
        assert leaf.sharding.spec == spec, name
        split = [i for i, axis in enumerate(spec) if axis == "model"]
        shard_shape = list(leaf.shape)
        for i in split:
            shard_shape[i] //= 4
        assert {tuple(s.data.shape) for s in leaf.addressable_shards} == {tuple(shard_shape)}
    drafted = _flat(sj.shard(target, mesh, replicate=True).params)
    assert all(leaf.sharding.spec == P() for leaf in drafted.values())


def test_heads_that_do_not_divide_are_replicated():
    cfg = sj.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=64)
    placed = _flat(sj.shard(sj.init_model(cfg, jax.random.key(0)), sj.make_mesh(1, 8)).params)
    assert placed["layers/0/self_attn/k_proj/kernel"].sharding.spec == P()
    assert placed["layers/0/self_attn/q_proj/kernel"].sharding.spec == P(None, "model")


def test_the_cache_is_split_by_rows_and_kv_heads():
    """The KV cache [L, B, K, S, D]: rows over "data", kv heads over "model", slots whole."""
    assert sharding.cache_spec(TARGET, sj.make_mesh(2, 4)) == P(None, "data", "model", None, None)


SPECS = {"autoregressive": None, "chain": sj.SpecConfig(num_speculative_tokens=3),
         "tree": sj.SpecConfig(tree=((0,), (1,), (0, 0), (0, 1), (1, 0))),
         "ngram": sj.SpecConfig(method="ngram", num_speculative_tokens=3),
         "draft-vocab": sj.SpecConfig(num_speculative_tokens=3),  # a draft cut to half the ids
         "eagle": sj.SpecConfig(method="eagle", num_speculative_tokens=3)}


# every mesh with a chain; every method on the mixed mesh and the tree on the widest "model" axis.
# Sampling (T = 1) on every case; greedy, a program of its own (argmax verdicts over sharded
# logits), on the mixed mesh's chain and EAGLE and the widest axis's tree (each compile on 8
# devices costs seconds).
GREEDY_TOO = {((2, 4), "chain"), ((2, 4), "eagle"), ((1, 8), "tree")}
CASES = ([(mesh, "chain") for mesh in MESHES]
         + [((2, 4), name) for name in SPECS if name != "chain"]
         + [((1, 8), "tree")])


@pytest.mark.parametrize("mesh_shape,name", CASES)
def test_sharded_output_equals_single_device(models, mesh_shape, name):
    data, model = mesh_shape
    target, draft, eagle = models
    spec = SPECS[name]
    d = None if spec is None else (draft if spec.needs_draft_model
                                   else eagle if spec.needs_heads else None)
    if name == "draft-vocab":
        d = sj.draft.restrict_vocab(draft, np.arange(0, draft.config.vocab_size, 2))
    mesh = sj.make_mesh(data=data, model=model)
    temperatures = (0.0, 1.0) if (mesh_shape, name) in GREEDY_TOO else (1.0,)
    for temperature in temperatures:
        sampling = sj.SamplingParams(temperature=temperature, max_new_tokens=16)
        one = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=d, key=7)
        many = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=d, key=7,
                           mesh=mesh)
        np.testing.assert_array_equal(many.tokens, one.tokens)
        assert many.tokens.shape == (3, 16)  # padding rows dropped
        if spec is not None:
            assert many.stats.accepted_tokens == one.stats.accepted_tokens


# The other proposers on the mixed mesh, each at the temperature where these tiny random models
# accept some of its drafts: a proposer that went wrong only on a mesh (its own arrays laid out
# or gathered differently) changes what is accepted, not the tokens, so the counts are compared
# too and must be nonzero.
PROPOSERS = {
    "medusa": (sj.SpecConfig(method="medusa", num_speculative_tokens=3), 0.0),
    "dflash": (sj.SpecConfig(method="dflash", num_speculative_tokens=3), 1.0),
    "mtp": (sj.SpecConfig(method="mtp", num_speculative_tokens=3), 1.0),
    "suffix": (sj.SpecConfig(method="suffix", num_speculative_tokens=3), 0.0),
    "lookahead": (sj.SpecConfig(method="lookahead", num_speculative_tokens=2), 0.0),
    "adaptive": (sj.SpecConfig(num_speculative_tokens=3, survival_threshold=0.3), 1.0),
}


def _heads(target, method: str, key: int):
    """Random heads of ``method`` with every weight perturbed: Medusa's residual starts at zero,
    which makes heads of any seed propose alike."""
    heads = sj.init_heads(target, method, jax.random.key(key), init_std=0.3)
    weights = perturbed(heads.params["weights"], key + 100, 0.1)
    return dataclasses.replace(heads, params=dict(heads.params, weights=weights))


@pytest.mark.parametrize("name", PROPOSERS)
def test_every_proposer_sharded_equals_single_device(models, name):
    target, draft, _ = models
    spec, temperature = PROPOSERS[name]
    d = (_heads(target, name, 3) if spec.needs_heads
         else draft if spec.needs_draft_model else None)
    sampling = sj.SamplingParams(temperature=temperature, max_new_tokens=16)
    one = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=d, key=7)
    many = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=d, key=7,
                       mesh=sj.make_mesh(data=2, model=4))
    np.testing.assert_array_equal(many.tokens, one.tokens)
    assert one.stats.accepted_tokens > 0, name  # else the counts below compare nothing
    assert many.stats.accepted_tokens == one.stats.accepted_tokens
    assert many.stats.proposed_tokens == one.stats.proposed_tokens


@pytest.mark.parametrize("mesh_shape,name", [((2, 4), "chain"), ((8, 1), "tree"),
                                             ((2, 4), "eagle")])
def test_attention_in_blocks_sharded_equals_single_device(models, monkeypatch, mesh_shape,
                                                          name):
    """With 8-slot attention blocks every round walks several blocks (a dynamic trip count over
    dynamic slices of a sharded cache), and prefill chunks run past the capacity."""
    monkeypatch.setattr(attention, "BLOCK", 8)
    target, draft, eagle = models
    spec = SPECS[name]
    d = eagle if spec.needs_heads else draft
    mesh = sj.make_mesh(data=mesh_shape[0], model=mesh_shape[1])
    for temperature in (0.0,) if name == "chain" else (1.0,):
        sampling = sj.SamplingParams(temperature=temperature, max_new_tokens=16)
        one = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=d, key=7,
                          max_cache_len=60)
        many = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=d, key=7,
                           mesh=mesh, max_cache_len=60)
        np.testing.assert_array_equal(many.tokens, one.tokens)
        assert many.stats.accepted_tokens == one.stats.accepted_tokens


def _collectives(ops):
    """(op, dtype, elements) of each collective in the last compiled program's decode loop."""
    (decode,) = engine.PROGRAMS.programs()[-1].executables("decode")
    pattern = r"= (\w+)\[([\d,]*)\]\S* (" + "|".join(ops) + r")\("
    found = re.findall(pattern, decode.as_text())
    return [(op, dtype, int(np.prod([int(x) for x in dims.split(",") if x])))
            for dtype, dims, op in found]


def test_rows_split_over_data_move_no_cache_between_devices(models):
    """On a data-only mesh every row lives on one device: the decode loop gathers no activation
    or cache entry (a cache write is a scatter whose batch dimension is the row), at most a few
    token ids per row."""
    target, draft, _ = models
    mesh = sj.make_mesh(data=8, model=1)
    engine.PROGRAMS.clear()
    sj.generate(target, PROMPTS, draft=draft, spec=sj.SpecConfig(num_speculative_tokens=3),
                sampling=sj.SamplingParams(temperature=0, max_new_tokens=8), mesh=mesh)
    for op, dtype, size in _collectives(("all-gather", "all-to-all")):
        assert dtype.startswith(("s32", "u32", "pred")) and size <= 8 * 8, (op, dtype, size)


def test_no_full_weight_gathers_inside_the_loop(models):
    """Collectives in the compiled decode loop move activations only: none is as large as the
    smallest tensor-parallel weight (per layer)."""
    target, draft, _ = models
    mesh = sj.make_mesh(data=1, model=8)
    engine.PROGRAMS.clear()
    sj.generate(target, PROMPTS, draft=draft, spec=sj.SpecConfig(num_speculative_tokens=3),
                sampling=sj.SamplingParams(temperature=0, max_new_tokens=8), mesh=mesh)
    collectives = _collectives(("all-gather", "all-to-all", "all-reduce"))
    assert collectives, "expected tensor-parallel collectives in the sharded program"
    smallest_weight = TARGET.hidden_size * TARGET.hidden_size  # q_proj per layer: E x H*D
    for op, dtype, size in collectives:
        assert size < smallest_weight, (op, dtype, size)


@pytest.mark.parametrize("fmt", ["orbax", "hf"])
def test_sharded_load_equals_unsharded(models, tmp_path, fmt, monkeypatch):
    target, _, _ = models
    sj.save_model(target, tmp_path / "m", format=fmt)
    mesh = sj.make_mesh(data=2, model=4)
    plain = _flat(sj.load_model(tmp_path / "m").params)
    reads = []  # Hugging Face files: each device reads only its slice (safetensors' slices)
    get_slice = checkpoint.SafetensorsFile.get_slice
    monkeypatch.setattr(checkpoint.SafetensorsFile, "get_slice", lambda self, name, index: (
        reads.append((name, index)) or get_slice(self, name, index)))
    monkeypatch.setattr(checkpoint.SafetensorsFile, "get", None)  # no whole-tensor read
    sharded = _flat(sj.load_model(tmp_path / "m", mesh=mesh).params)
    monkeypatch.undo()
    if fmt == "hf":
        q = [i for name, i in reads if name == "model.layers.0.self_attn.q_proj.weight"]
        rows = sorted({(i[0].start, i[0].stop) for i in q})
        assert len(q) == 8 and rows == [(k * 16, (k + 1) * 16) for k in range(4)], q
    replicated = _flat(sj.load_model(tmp_path / "m", mesh=mesh, replicate=True).params)
    for name, leaf in sharded.items():
        assert leaf.sharding.spec == EXPECTED[name], name
        assert replicated[name].sharding.spec == P()
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(plain[name]))
        np.testing.assert_array_equal(np.asarray(replicated[name]), np.asarray(plain[name]))


def test_a_layout_of_the_callers_own_is_kept_and_exact(models):
    """Another rules table (the vocabulary replicated, the model width split over "data") placed
    with sj.shard: generate keeps that placement, and the output equals one device's."""
    target, draft, _ = models
    mesh = sj.make_mesh(data=2, model=4)
    rules = {**{k: v for k, v in sharding.RULES.items() if k != "vocab"}, "embed": "data"}
    placed = sj.shard(target, mesh, rules=rules)
    flat = _flat(placed.params)
    assert flat["embed_tokens/embedding"].sharding.spec == P(None, "data")
    assert flat["layers/1/mlp/up_proj/kernel"].sharding.spec == P("data", "model")
    assert sharding.placed_on(placed, mesh) and not sharding.placed_on(target, mesh)
    kept, _ = engine.place(placed, None, mesh)
    assert _flat(kept.params)["embed_tokens/embedding"].sharding.spec == P(None, "data")
    sampling = sj.SamplingParams(temperature=0, max_new_tokens=12)
    spec = sj.SpecConfig(num_speculative_tokens=3)
    one = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=draft)
    many = sj.generate(placed, PROMPTS, sampling=sampling, spec=spec, draft=draft, mesh=mesh)
    np.testing.assert_array_equal(many.tokens, one.tokens)


def test_sharded_families_load_and_decode_as_one_device(tmp_path, monkeypatch):
    """Phi-3 (fused q/k/v and gate/up tensors: each device reads its part of them) and Gemma 2
    (sandwich norms, soft-caps, local and global layers) from transformers folders: placed on a
    2 x 4 mesh, the same weights as one device, and the same greedy output, also for a row whose
    sliding layers' rings (window + 63 slots) wrap."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                  initializer_range=0.3)
    configs = {"phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config(
                   sliding_window=6, pad_token_id=0, **common)),
               "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
                   head_dim=16, query_pre_attn_scalar=12, sliding_window=4,
                   attn_logit_softcapping=3.0, final_logit_softcapping=5.0, **common))}
    mesh = sj.make_mesh(data=2, model=4)
    sampling = sj.SamplingParams(temperature=0, max_new_tokens=12)
    for name, (cls, config) in configs.items():
        torch.manual_seed(0)
        model = cls._from_config(config).eval()
        with torch.no_grad():
            for _, p in model.named_parameters():
                p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.0))
        model.save_pretrained(tmp_path / name)
        plain = sj.load_model(tmp_path / name)
        reads = []
        get_slice = checkpoint.SafetensorsFile.get_slice
        monkeypatch.setattr(checkpoint.SafetensorsFile, "get_slice",
                            lambda self, n, index, reads=reads, get_slice=get_slice: (
                                reads.append((n, index)) or get_slice(self, n, index)))
        sharded = sj.load_model(tmp_path / name, mesh=mesh)
        monkeypatch.undo()
        for key, leaf in _flat(sharded.params).items():
            np.testing.assert_array_equal(np.asarray(leaf), np.asarray(_flat(plain.params)[key]),
                                          err_msg=f"{name}: {key}")
        if name == "phi3":  # q's 8 heads x 8 dims in rows 0..63 of qkv_proj, 16 per device
            q = sorted({(i[0].start, i[0].stop) for n, i in reads
                        if n == "model.layers.0.self_attn.qkv_proj.weight" and i[0].stop <= 64})
            assert q == [(k * 16, (k + 1) * 16) for k in range(4)], q
        prompts = PROMPTS + [[(7 * i) % 64 for i in range(80)]]
        want = sj.generate(plain, prompts, sampling=sampling).tokens
        got = sj.generate(sharded, prompts, sampling=sampling, mesh=mesh).tokens
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("broken", [False, True], ids=["cached", "broken-jit-per-call"])
def test_a_repeated_call_on_a_mesh_traces_nothing(models, monkeypatch, broken):
    """Everything a call on a mesh compiles (its rows' keys laid out over the mesh included) is
    reused by the next call of the same shapes: nothing is traced again. A jitted function built
    afresh in each call (as the keys' once were) traces every call and fails."""
    target, _, _ = models
    if broken:
        monkeypatch.setattr(engine, "_wrap_keys", lambda impl, s: jax.jit(
            functools.partial(jax.random.wrap_key_data, impl=impl), out_shardings=s))
    mesh = sj.make_mesh(data=2, model=4)
    sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=4)
    sj.generate(target, PROMPTS, sampling=sampling, key=1, mesh=mesh)
    with traces_and_compiles() as traced:
        sj.generate(target, PROMPTS, sampling=sampling, key=2, mesh=mesh)
    assert (traced != []) == broken, traced


def test_programs_over_several_cpu_devices_skip_the_disk_cache(models, monkeypatch, tmp_path):
    """A program over several CPU devices loaded from a disk cache sometimes deadlocked (its
    devices in different collectives until XLA aborted: the MTP case above, 4 of 16 runs from a
    filled cache), so specjax compiles those afresh: nothing of the mesh run is written to its
    folder, while the same call on one device is."""
    target, _, _ = models
    folder = tmp_path / "xla"
    folder.mkdir()
    monkeypatch.setattr(compile_cache, "_chosen", str(folder))
    monkeypatch.setattr(compile_cache, "MIN_COMPILE_SECONDS", 0)
    sampling = sj.SamplingParams(temperature=0, max_new_tokens=4)
    mesh = sj.make_mesh(data=2, model=4)
    assert not compile_cache.disk_cached(mesh.devices.flat)
    assert compile_cache.disk_cached(jax.devices()[:1])
    engine.PROGRAMS.clear()
    sharded = sj.generate(target, PROMPTS, sampling=sampling, mesh=mesh,
                          spec=sj.SpecConfig(method="ngram", num_speculative_tokens=2))
    assert engine.PROGRAMS and not list(folder.iterdir())
    one = sj.generate(target, PROMPTS, sampling=sampling,
                      spec=sj.SpecConfig(method="ngram", num_speculative_tokens=2))
    assert list(folder.iterdir())  # one device: stored
    np.testing.assert_array_equal(sharded.tokens, one.tokens)
    engine.PROGRAMS.clear()


class Digits:
    """A tokenizer for TARGET's 64 ids: id i is the character chr(48 + i)."""

    vocab_size = 64
    eos_token_ids = ()

    def encode(self, text):
        return [ord(c) - 48 for c in text]

    def decode(self, ids):
        return "".join(chr(48 + int(i)) for i in ids)


@pytest.mark.parametrize("mesh_shape,name", [((2, 4), "chain"), ((8, 1), "autoregressive")])
def test_streams_and_stop_strings_on_a_mesh_equal_one_device(models, mesh_shape, name):
    """sj.stream (a segment of rounds at a time, one executable for every segment) and stop
    strings (matched between segments) on meshes that split rows: the same chunks, tokens and
    text as one device. Each segment once met state laid out otherwise than the prefill left
    it (per-row counters replicated, then split by rows) and failed from the second segment."""
    target, draft, _ = models
    spec, d = (sj.SpecConfig(num_speculative_tokens=3), draft) if name == "chain" else (None, None)
    mesh = sj.make_mesh(data=mesh_shape[0], model=mesh_shape[1])
    sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=16)
    one = list(sj.stream(target, PROMPTS, sampling=sampling, spec=spec, draft=d, key=7,
                         rounds_per_chunk=1))
    many = list(sj.stream(target, PROMPTS, sampling=sampling, spec=spec, draft=d, key=7,
                          rounds_per_chunk=1, mesh=mesh))
    assert len(many) == len(one) > 3
    for a, b in zip(many, one):
        assert [list(t) for t in a.tokens] == [list(t) for t in b.tokens]
    np.testing.assert_array_equal(many[-1].generation.tokens, one[-1].generation.tokens)
    program = engine.PROGRAMS.programs()[-1]
    assert len(program.executables("segment")) == 1  # one layout from the first segment on
    tok = Digits()
    text = tok.decode(one[-1].generation.tokens[1, 4:6])
    stopped = sj.SamplingParams(temperature=1.0, max_new_tokens=16, stop=[text])
    want = sj.generate(target, PROMPTS, sampling=stopped, spec=spec, draft=d, key=7,
                       tokenizer=tok)
    got = sj.generate(target, PROMPTS, sampling=stopped, spec=spec, draft=d, key=7,
                      tokenizer=tok, mesh=mesh)
    assert got.text == want.text and want.lengths[1] <= 6
    np.testing.assert_array_equal(got.tokens, want.tokens)


def test_a_mesh_of_explicit_axes_is_refused_by_name(models):
    """jax.make_mesh's default axes are Explicit (JAX 0.7 on), which the engine's sharding
    constraints cannot take: refused before anything compiles, naming the fix."""
    target, _, _ = models
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    with traces_and_compiles() as traced, pytest.raises(ValueError, match="mesh axes must be Auto"):
        sj.generate(target, PROMPTS, sampling=sj.SamplingParams(max_new_tokens=2), mesh=mesh)
    assert traced == []
    auto = jax.make_mesh((2, 4), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    assert sj.generate(target, PROMPTS, sampling=sj.SamplingParams(max_new_tokens=2),
                       mesh=auto).tokens.shape == (3, 2)
