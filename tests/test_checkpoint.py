"""Hugging Face import/export against the transformers reference, orbax round trips, errors."""

import json
import pathlib
import shutil
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import tiny_model

import specjax as sj
from specjax import checkpoint

V = 64
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              initializer_range=0.3)  # peaked distributions, so greedy ties are unlikely
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def hf_model(kind, seed=0, **overrides):
    torch.manual_seed(seed)
    kw = {**COMMON, **overrides}
    if kind == "llama":
        kw.setdefault("rope_scaling", LLAMA3_ROPE)
        cls, cfg = transformers.LlamaForCausalLM, transformers.LlamaConfig(rope_theta=5e5, **kw)
    elif kind == "llama-linear-bias":
        kw["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
        cls, cfg = transformers.LlamaForCausalLM, transformers.LlamaConfig(attention_bias=True,
                                                                          **kw)
    elif kind == "qwen2":
        cls, cfg = transformers.Qwen2ForCausalLM, transformers.Qwen2Config(tie_word_embeddings=True,
                                                                          **kw)
    elif kind == "qwen3":
        cls, cfg = transformers.Qwen3ForCausalLM, transformers.Qwen3Config(head_dim=16, **kw)
    elif kind == "mistral":
        cls, cfg = transformers.MistralForCausalLM, transformers.MistralConfig(
            **{"sliding_window": 8, **kw})
    elif kind == "qwen3-bias":
        cls, cfg = transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
            head_dim=16, attention_bias=True, **kw)
    else:
        raise ValueError(kind)
    model = cls(cfg).eval()
    # transformers starts biases at 0 and norm weights at 1, as we do: randomise every tensor so
    # that a dropped, swapped or transposed bias or norm cannot pass unnoticed.
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.0))
    return model


def saved(model, folder, **kw):
    model.save_pretrained(folder, **kw)
    return pathlib.Path(folder)


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.float().numpy()


TOKENS = np.random.default_rng(0).integers(0, V, (2, 24))
KINDS = ["llama", "llama-linear-bias", "qwen2", "qwen3", "qwen3-bias", "mistral"]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind, tmp_path):
    ref = hf_model(kind)
    model = sj.load_model(saved(ref, tmp_path))
    assert model.config.dtype == "float32"
    diff = np.abs(np.asarray(sj.logits(model, TOKENS)) - hf_logits(ref, TOKENS)).max()
    assert diff <= 1e-4, diff


def test_features_are_read_from_the_config(tmp_path):
    cfg = sj.load_model(saved(hf_model("llama"), tmp_path / "l")).config
    assert cfg.rope_scaling == sj.RopeScaling(rope_type="llama3", factor=8.0,
                                              original_max_position_embeddings=16)
    assert cfg.rope_theta == 5e5 and cfg.num_key_value_heads == 2
    q2 = sj.load_model(saved(hf_model("qwen2"), tmp_path / "q2")).config
    assert q2.tie_word_embeddings and q2.attention_bias and not q2.o_proj_bias
    q3 = sj.load_model(saved(hf_model("qwen3"), tmp_path / "q3")).config
    assert q3.qk_norm and q3.head_dim == 16
    assert sj.load_model(saved(hf_model("mistral"), tmp_path / "m")).config.sliding_window == 8


def test_old_style_config_keys(tmp_path):
    """rope_theta + rope_scaling {"type": ...} + torch_dtype, as older checkpoints write them."""
    ref = hf_model("llama")
    folder = saved(ref, tmp_path)
    d = json.loads((folder / "config.json").read_text())
    d.pop("rope_parameters", None)
    d.pop("dtype", None)
    d["rope_theta"] = 5e5
    d["rope_scaling"] = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    d["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(d))
    assert sj.load_model(folder, dtype="stored").config.dtype == "bfloat16"  # from torch_dtype
    model = sj.load_model(folder, dtype="float32")
    assert model.config.rope_scaling.rope_type == "llama3"
    diff = np.abs(np.asarray(sj.logits(model, TOKENS)) - hf_logits(ref, TOKENS)).max()
    assert diff <= 1e-4


def test_sharded_checkpoint(tmp_path):
    ref = hf_model("qwen3")
    folder = saved(ref, tmp_path, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").exists()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    model = sj.load_model(folder)
    diff = np.abs(np.asarray(sj.logits(model, TOKENS)) - hf_logits(ref, TOKENS)).max()
    assert diff <= 1e-4


@pytest.mark.parametrize("torch_dtype,name", [(torch.bfloat16, "bfloat16"),
                                              (torch.float16, "float16")])
def test_half_precision_weights_and_casting(torch_dtype, name, tmp_path):
    ref = hf_model("llama").to(torch_dtype)
    folder = saved(ref, tmp_path)
    model = sj.load_model(folder, dtype="stored")
    assert model.config.dtype == name
    assert all(x.dtype == np.dtype(name) for x in jax.tree.leaves(model.params))
    up = sj.load_model(folder, dtype="float32")
    assert up.config.dtype == "float32"
    want = ref.model.layers[1].mlp.up_proj.weight.detach().float().numpy().T
    np.testing.assert_array_equal(np.asarray(up.params["layers"]["1"]["mlp"]["up_proj"]["kernel"]),
                                  want)
    # Computed in float32 from the same rounded weights, logits match the reference's float32.
    # (Reloaded, not ref.float(): casting a torch model also rounds its RoPE frequency buffer.)
    ref32 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    diff = np.abs(np.asarray(sj.logits(up, TOKENS)) - hf_logits(ref32, TOKENS)).max()
    assert diff <= 1e-4


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].numpy()


def test_greedy_generate_matches_transformers(tmp_path):
    ref = hf_model("llama", seed=0)
    small = hf_model("llama", seed=1, num_hidden_layers=1, hidden_size=16, intermediate_size=32)
    target = sj.load_model(saved(ref, tmp_path / "t"))
    draft = sj.load_model(saved(small, tmp_path / "d"))
    prompts = [[1, 5, 9, 2], [7], list(range(3, 15))]
    n = 24
    sampling = sj.SamplingParams(temperature=0, max_new_tokens=n)
    ar = sj.generate(target, prompts, sampling=sampling)
    spec = sj.generate(target, prompts, sampling=sampling, draft=draft,
                       spec=sj.SpecConfig(num_speculative_tokens=3))
    for b, prompt in enumerate(prompts):
        want = hf_greedy(ref, prompt, n)
        np.testing.assert_array_equal(ar.tokens[b], want)
        np.testing.assert_array_equal(spec.tokens[b], want)


def test_orbax_round_trip(tmp_path):
    model = tiny_model(seed=3, qk_norm=True, attention_bias=True, tie_word_embeddings=True,
                       rope_scaling=sj.RopeScaling(rope_type="linear", factor=2.0))
    sj.save_model(model, tmp_path / "m")
    back = sj.load_model(tmp_path / "m")
    assert back.config == model.config
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(back.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(model.params) == jax.tree.structure(back.params)
    half = sj.load_model(tmp_path / "m", dtype="bfloat16")
    assert half.config.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(half.params)} == {jnp.dtype(jnp.bfloat16)}
    # saving over an existing checkpoint replaces it
    other = sj.Model(model.config, jax.tree.map(lambda x: x + 1, model.params))
    sj.save_model(other, tmp_path / "m")
    again = sj.load_model(tmp_path / "m")
    for a, b in zip(jax.tree.leaves(other.params), jax.tree.leaves(again.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))



def test_a_version_1_orbax_checkpoint_with_stacked_layers_still_loads(tmp_path):
    """Checkpoints written before version 2 stacked each layer weight on a leading [L] axis:
    they load into the per-layer layout, value for value; an unknown version is refused."""
    import orbax.checkpoint as ocp

    from specjax.model import stack_layers
    model = tiny_model(seed=5, layers=3)
    sj.save_model(model, tmp_path / "m")
    meta_path = tmp_path / "m" / checkpoint.SPECJAX_FILE
    meta = json.loads(meta_path.read_text())
    assert meta["version"] == checkpoint.ORBAX_VERSION == 2
    shutil.rmtree(tmp_path / "m" / "params")
    ckpt = ocp.StandardCheckpointer()
    ckpt.save((tmp_path / "m" / "params").resolve(), stack_layers(model.params, 3))
    ckpt.wait_until_finished()
    meta_path.write_text(json.dumps({**meta, "version": 1}))
    mesh = sj.make_mesh()
    for back in (sj.load_model(tmp_path / "m", dtype="stored"),
                 sj.load_model(tmp_path / "m", dtype="stored", mesh=mesh),
                 sj.load_model(tmp_path / "m", dtype="stored", mesh=mesh, replicate=True)):
        assert jax.tree.structure(back.params) == jax.tree.structure(model.params)
        for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(back.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    meta_path.write_text(json.dumps({**meta, "version": 7}))
    with pytest.raises(sj.CheckpointError, match="version 7"):
        sj.load_model(tmp_path / "m")

@pytest.mark.parametrize("features", [
    dict(),
    dict(tie_word_embeddings=True, attention_bias=True),  # Qwen2
    dict(qk_norm=True, head_dim=6),  # Qwen3
    dict(attention_bias=True, o_proj_bias=True,
         rope_scaling=sj.RopeScaling(rope_type="llama3", factor=4.0,
                                     original_max_position_embeddings=16)),  # Llama
    dict(sliding_window=5),  # Mistral
    dict(qk_norm=True, attention_bias=True, o_proj_bias=True),  # Qwen3 with biases
])
def test_hf_export_loads_in_transformers(features, tmp_path):
    model = tiny_model(seed=4, **features)
    # random norm weights and biases, each its own (seeded by its whole path: an export that
    # swapped two of them, say k_proj's and v_proj's biases, must change the logits), so the
    # export's names and layouts are all exercised
    model = sj.Model(model.config, jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.3 * jax.random.normal(
            jax.random.key(zlib.crc32(jax.tree_util.keystr(path).encode())), x.shape)
        if path[-1].key in ("bias", "weight") else x, model.params))
    sj.save_model(model, tmp_path, format="hf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = np.random.default_rng(1).integers(0, 16, (2, 12))
    diff = np.abs(np.asarray(sj.logits(model, tokens)) - hf_logits(ref, tokens)).max()
    assert diff <= 1e-4, diff
    assert type(ref).__name__ == checkpoint.hf_architecture(model.config)
    again = sj.load_model(tmp_path)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(again.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- errors -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return saved(hf_model("llama"), tmp_path_factory.mktemp("llama"))


def copy(folder, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(folder, dst)
    return dst


def rewrite_weights(folder, change):
    f = checkpoint.SafetensorsFile(folder / "model.safetensors")
    tensors = {n: np.array(f.get(n)) for n in f.entries}
    del f
    change(tensors)
    checkpoint.write_safetensors(folder / "model.safetensors", tensors)


def test_missing_folder_and_files(tmp_path, llama_folder):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sj.load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither a Hugging Face model"):
        sj.load_model(tmp_path / "empty")
    folder = copy(llama_folder, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        sj.load_model(folder)


def test_unsupported_architecture_is_named(tmp_path, llama_folder):
    folder = copy(llama_folder, tmp_path)
    d = json.loads((folder / "config.json").read_text())
    d["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(d))
    with pytest.raises(sj.CheckpointError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM, "
                                                 "MistralForCausalLM, Qwen2ForCausalLM"):
        sj.load_model(folder)


def test_unsupported_rope_scaling(tmp_path, llama_folder):
    folder = copy(llama_folder, tmp_path)
    d = json.loads((folder / "config.json").read_text())
    d["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    (folder / "config.json").write_text(json.dumps(d))
    with pytest.raises(sj.CheckpointError, match="'yarn' is not supported"):
        sj.load_model(folder)


def test_missing_tensor_is_named(tmp_path, llama_folder):
    folder = copy(llama_folder, tmp_path)
    rewrite_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(sj.CheckpointError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        sj.load_model(folder)


def test_wrong_shape_is_named(tmp_path, llama_folder):
    folder = copy(llama_folder, tmp_path)
    rewrite_weights(folder, lambda t: t.update(
        {"model.norm.weight": np.ones(31, np.float32)}))
    with pytest.raises(sj.CheckpointError, match=r"'model.norm.weight'.*\(31,\), expected \(32,\)"):
        sj.load_model(folder)


def test_truncated_and_corrupt_files(tmp_path, llama_folder):
    folder = copy(llama_folder, tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 100])
    with pytest.raises(sj.CheckpointError, match="truncated"):
        sj.load_model(folder)
    path.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(sj.CheckpointError, match="corrupt"):
        sj.load_model(folder)
    path.write_bytes(b"\x01")
    with pytest.raises(sj.CheckpointError, match="truncated"):
        sj.load_model(folder)


def test_index_naming_a_missing_shard(tmp_path):
    folder = saved(hf_model("qwen3"), tmp_path, max_shard_size="40KB")
    next(folder.glob("model-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="shard files that are missing"):
        sj.load_model(folder)


def test_extra_tensors_and_unsupported_features_are_refused(tmp_path, llama_folder):
    folder = copy(llama_folder, tmp_path)
    rewrite_weights(folder, lambda t: t.update({"model.layers.0.mlp.up_proj.bias":
                                                np.zeros(64, np.float32)}))
    with pytest.raises(sj.CheckpointError, match="have no place.*up_proj.bias"):
        sj.load_model(folder)
    for key, value, message in [("mlp_bias", True, "mlp_bias"),
                                ("hidden_act", "gelu", "hidden_act 'gelu'")]:
        d = json.loads((llama_folder / "config.json").read_text())
        d[key] = value
        (folder / "config.json").write_text(json.dumps(d))
        with pytest.raises(sj.CheckpointError, match=message):
            sj.load_model(folder)
    d = json.loads((llama_folder / "config.json").read_text())
    del d["vocab_size"]
    (folder / "config.json").write_text(json.dumps(d))
    with pytest.raises(sj.CheckpointError, match="lacks the key 'vocab_size'"):
        sj.load_model(folder)


def test_a_window_as_long_as_the_context_still_slides_beyond_it(tmp_path):
    """A Mistral whose window equals its context: sj.logits past the context (a measurement of
    quality beyond the trained length) slides as transformers does. The window was dropped
    (relative difference 1.2 at 40 tokens)."""
    ref = hf_model("mistral", sliding_window=16, max_position_embeddings=16)
    model = sj.load_model(saved(ref, tmp_path))
    assert model.config.sliding_window == 16
    tokens = np.random.default_rng(1).integers(0, V, (1, 40))
    diff = np.abs(np.asarray(sj.logits(model, tokens)) - hf_logits(ref, tokens)).max()
    assert diff <= 1e-4, diff


def test_a_window_in_a_llama_config_is_ignored_as_transformers_ignores_it(tmp_path):
    """A Llama config.json that carries sliding_window (smaller than the tokens) attends to every
    position in transformers; so it does here. Mistral's window is read (the kinds above)."""
    ref = hf_model("llama")
    folder = saved(ref, tmp_path)
    d = json.loads((folder / "config.json").read_text())
    d["sliding_window"] = 4
    (folder / "config.json").write_text(json.dumps(d))
    ref = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    model = sj.load_model(folder)
    assert model.config.sliding_window is None
    diff = np.abs(np.asarray(sj.logits(model, TOKENS)) - hf_logits(ref, TOKENS)).max()
    assert diff <= 1e-4, diff


def test_keys_a_config_leaves_out_mean_what_transformers_reads_them_as():
    """Configs with keys left out or in the other format (transformers 5's nested
    rope_parameters), parsed as transformers' own config classes read them: no silent
    difference. Each case failed before: full attention for a Mistral without sliding_window
    (transformers: 4096); llama3 RoPE without original_max_position_embeddings at 8192
    (transformers: the model's max_position_embeddings); Gemma 3's nested RoPE without thetas
    at 1e6 / 1e4 (transformers: the top-level ones); Gemma 1 applying a query scale and logit
    soft-cap its transformers class never reads; Phi-3 RoPE on part of each head, given inside
    rope_parameters, taken as whole-head RoPE (now refused, as at the top level)."""
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    mistral = checkpoint.config_from_hf({**base, "architectures": ["MistralForCausalLM"]})
    hf = transformers.MistralConfig(**base)
    assert (mistral.sliding_window, mistral.max_position_embeddings) == (
        hf.sliding_window, hf.max_position_embeddings) == (4096, 131072)
    assert checkpoint.config_from_hf({**base, "architectures": ["MistralForCausalLM"],
                                      "sliding_window": None}).sliding_window is None
    rope = {k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}
    llama = checkpoint.config_from_hf({**base, "architectures": ["LlamaForCausalLM"],
                                       "max_position_embeddings": 512, "rope_scaling": rope})
    hf = transformers.LlamaConfig(**base, max_position_embeddings=512, rope_scaling=dict(rope))
    assert llama.rope_scaling.original_max_position_embeddings == hf.rope_parameters[
        "original_max_position_embeddings"] == 512
    gemma3 = checkpoint.config_from_hf({
        **base, "architectures": ["Gemma3ForCausalLM"], "head_dim": 8, "rope_theta": 5e5,
        "rope_local_base_freq": 2e4, "rope_parameters": {
            "full_attention": {"rope_type": "default"},
            "sliding_attention": {"rope_type": "default"}}})
    assert (gemma3.rope_theta, gemma3.rope_local_theta) == (5e5, 2e4)
    gemma = checkpoint.config_from_hf({**base, "architectures": ["GemmaForCausalLM"],
                                       "head_dim": 8, "num_key_value_heads": 4,
                                       "query_pre_attn_scalar": 144,
                                       "final_logit_softcapping": 30.0})
    assert gemma.query_pre_attn_scalar is None and gemma.final_logit_softcapping is None
    # llama3 RoPE without original_max_position_embeddings nor max_position_embeddings: the
    # context's default (was 8192); Gemma 3's nested llama3 RoPE: its context (was 8192)
    llama = checkpoint.config_from_hf({**base, "architectures": ["LlamaForCausalLM"],
                                       "rope_scaling": rope})
    hf = transformers.LlamaConfig(**base, rope_scaling=dict(rope))
    assert llama.rope_scaling.original_max_position_embeddings == hf.rope_parameters[
        "original_max_position_embeddings"] == 2048
    gemma3 = checkpoint.config_from_hf({
        **base, "architectures": ["Gemma3ForCausalLM"], "head_dim": 8,
        "max_position_embeddings": 512, "rope_parameters": {
            "full_attention": {"rope_type": "llama3", **{k: v for k, v in rope.items()
                                                         if k != "rope_type"}},
            "sliding_attention": {"rope_type": "default"}}})
    assert gemma3.rope_scaling.original_max_position_embeddings == 512
    # both forms in one file: transformers reads rope_scaling whole (rope_parameters won here)
    both = checkpoint.config_from_hf({**base, "architectures": ["LlamaForCausalLM"],
                                      "rope_scaling": {"type": "linear", "factor": 2.0},
                                      "rope_parameters": {"rope_type": "default"}})
    hf = transformers.LlamaConfig(**base, rope_scaling={"type": "linear", "factor": 2.0},
                                  rope_parameters={"rope_type": "default"})
    assert (both.rope_scaling.rope_type, both.rope_scaling.factor) == (
        hf.rope_parameters["rope_type"], hf.rope_parameters["factor"]) == ("linear", 2.0)
    # kv heads and head size left out: each family's own defaults (Mistral 8, Qwen 32 kv heads,
    # Qwen3 head_dim 128), not the attention heads (a load then failed on a tensor's shape)
    wide = {**{k: v for k, v in base.items() if k != "num_key_value_heads"},
            "num_attention_heads": 32, "hidden_size": 64}
    for arch, cls in [("MistralForCausalLM", transformers.MistralConfig),
                      ("Qwen2ForCausalLM", transformers.Qwen2Config),
                      ("Qwen3ForCausalLM", transformers.Qwen3Config)]:
        ours, hf = checkpoint.config_from_hf({**wide, "architectures": [arch]}), cls(**wide)
        assert ours.num_key_value_heads == hf.num_key_value_heads, arch
        assert ours.head_dim == (getattr(hf, "head_dim", None) or 64 // 32), arch
    with pytest.raises(checkpoint.CheckpointError, match="partial_rotary_factor=0.75"):
        checkpoint.config_from_hf({**base, "architectures": ["Phi3ForCausalLM"],
                                   "rope_parameters": {"rope_type": "default",
                                                       "partial_rotary_factor": 0.75}})


def test_qwen_partial_sliding_window_is_refused(tmp_path):
    folder = saved(hf_model("qwen2"), tmp_path)
    d = json.loads((folder / "config.json").read_text())
    d.update(use_sliding_window=True, sliding_window=8)
    (folder / "config.json").write_text(json.dumps(d))
    with pytest.raises(sj.CheckpointError, match="use_sliding_window"):
        sj.load_model(folder)


def test_export_refuses_configs_transformers_cannot_express(tmp_path):
    for kw, message in (
            (dict(sliding_window=4, attention_bias=True, o_proj_bias=True),
             "MistralForCausalLM has no attention biases"),
            (dict(sliding_window=4, qk_norm=True),
             r"a sliding window with these features \(Qwen3ForCausalLM\) has no Hugging Face"),
            (dict(o_proj_bias=True), "attention_bias=False, o_proj_bias=True")):
        model = tiny_model(**kw)
        with pytest.raises(ValueError, match=message):
            sj.save_model(model, tmp_path / "x", format="hf")
        assert not (tmp_path / "x").exists()  # refused before writing anything


def test_saving_replaces_an_earlier_save_of_the_other_format(tmp_path):
    a, b = tiny_model(seed=1), tiny_model(seed=2)
    sj.save_model(a, tmp_path)
    (tmp_path / "README.md").write_text("kept")
    sj.save_model(b, tmp_path, format="hf", eos_token_id=3)
    loaded = sj.load_model(tmp_path)
    np.testing.assert_array_equal(np.asarray(loaded.params["norm"]["weight"]),
                                  np.asarray(b.params["norm"]["weight"]))
    assert not (tmp_path / "specjax.json").exists() and (tmp_path / "README.md").exists()
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 3
    sj.save_model(a, tmp_path)
    assert not (tmp_path / "config.json").exists() and (tmp_path / "specjax.json").exists()


def test_one_dtype_rule(tmp_path):
    """auto: float32 on CPU, the checkpoint's dtype on GPU and TPU; stored keeps it everywhere;
    a dtype name casts. The command line's --dtype takes the same values with the same default."""
    from specjax.checkpoint import compute_dtype
    for platform, auto in [("cpu", "float32"), ("gpu", None), ("tpu", None)]:
        assert compute_dtype(None, platform) == compute_dtype("auto", platform) == auto
        assert compute_dtype("stored", platform) is None
        assert compute_dtype("float16", platform) == "float16"
    sj.save_model(sj.checkpoint.cast(tiny_model(), "bfloat16"), tmp_path / "m")
    auto = compute_dtype("auto", jax.default_backend()) or "bfloat16"  # float32 on CPU
    assert sj.load_model(tmp_path / "m").config.dtype == auto
    assert sj.load_model(tmp_path / "m", dtype="auto").config.dtype == auto
    # with a mesh, the platform of its devices
    assert sj.load_model(tmp_path / "m", mesh=sj.make_mesh()).config.dtype == auto
    stored = sj.load_model(tmp_path / "m", dtype="stored")
    assert stored.config.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(stored.params)} == {np.dtype("bfloat16")}
    from specjax import cli
    for command in ("generate", "bench"):
        assert cli.build_parser().parse_args([command]).dtype == "auto"
    # loaded on a CPU (float32) and saved back: as it is held, or as asked
    for fmt in ("orbax", "hf"):
        for dtype, want in [(None, auto), ("bfloat16", "bfloat16"), (jnp.float16, "float16")]:
            sj.save_model(sj.load_model(tmp_path / "m"), tmp_path / fmt, format=fmt, dtype=dtype)
            again = sj.load_model(tmp_path / fmt, dtype="stored")
            assert again.config.dtype == want, (fmt, dtype)
            assert {x.dtype for x in jax.tree.leaves(again.params)} == {np.dtype(want)}
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "hf").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes  # safetensors' own: 0o600
    with pytest.raises(ValueError, match="save_model's dtype must be .* got 'stored'"):
        sj.save_model(stored, tmp_path / "x", dtype="stored")


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="dtype must be one of .* got 'int8'"):
        sj.load_model(tmp_path, dtype="int8")
    # a model passed where the dtype goes (load_draft_model(path, target)): named by its type,
    # not a dump of its weights
    with pytest.raises(ValueError, match=r"dtype must be one of .* got a specjax\.model\.Model$"):
        sj.load_draft_model(tmp_path, tiny_model())
    model = tiny_model()
    with pytest.raises(ValueError, match="format must be 'orbax' or 'hf', got 'gguf'"):
        sj.save_model(model, tmp_path, format="gguf")


LOAD_AND_MEASURE = """
import sys
import jax, jax.numpy as jnp
import specjax as sj
def status(key):  # VmRSS / VmHWM (peak) of this process, bytes; ru_maxrss survives exec
    line = next(l for l in open("/proc/self/status") if l.startswith(key))
    return int(line.split()[1]) * 1024
jnp.ones(4).block_until_ready()
before = status("VmRSS")
model = sj.load_model(sys.argv[1])
jax.block_until_ready(model.params)
print(before, status("VmHWM"))
"""


def test_loading_never_holds_a_second_full_copy_on_the_host(tmp_path):
    """Loading a 300 MB checkpoint raises the process's peak memory by about one copy of the
    model, not two: tensors are read one at a time and each parameter is placed before the next
    one is read (a loader that reads every tensor first and then converts holds two copies)."""
    import subprocess
    import sys
    cfg = sj.ModelConfig(vocab_size=1024, hidden_size=512, intermediate_size=1536,
                         num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=4)
    model = sj.init_model(cfg, jax.random.key(0))
    sj.save_model(model, tmp_path, format="hf")
    size = sum(x.nbytes for x in jax.tree.leaves(model.params))
    del model
    out = subprocess.run([sys.executable, "-c", LOAD_AND_MEASURE, str(tmp_path)], check=True,
                         capture_output=True, text=True).stdout.split()
    before, peak = int(out[-2]), int(out[-1])
    assert size > 100e6
    # One copy, plus the largest parameter (a quarter of this model) in flight, plus slack; a
    # loader holding every tensor before converting measured 2.4 here, this one 1.4.
    assert peak - before < 1.75 * size, (peak - before) / size


@pytest.mark.parametrize("fmt", ["hf", "orbax"])
def test_export_with_a_tokenizer_loads_everywhere(tmp_path, fmt, capsys):
    """save_model(..., tokenizer=) writes the tokenizer files: transformers' AutoTokenizer (hf),
    sj.load_tokenizer and `specjax generate --target` read the folder, with its BOS/EOS."""
    import tokenizers

    from specjax import cli
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator(["def f(x):\n    return x\n"] * 20, tokenizers.trainers.BpeTrainer(
        vocab_size=270, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    tok = sj.Tokenizer(bpe, bos_token_id=0, eos_token_ids=(1,))
    model = tiny_model(seed=3, vocab_size=300, max_pos=128)
    sj.save_model(model, tmp_path / "m", format=fmt, tokenizer=tok)
    again = sj.load_tokenizer(tmp_path / "m")
    text = "def f(x):\n    return x"
    assert again.encode(text) == tok.encode(text)
    assert again.bos_token_id == 0 and again.eos_token_ids == (1,)
    if fmt == "hf":
        hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
        assert (hf.bos_token, hf.eos_token) == ("<s>", "</s>")
        assert json.loads((tmp_path / "m" / "generation_config.json").read_text()) == {
            "bos_token_id": 0, "eos_token_id": 1}
    assert cli.main(["generate", "--target", str(tmp_path / "m"), "--method", "none",
                     "--prompt", "def f(x):", "--max-new-tokens", "6", "--no-stream"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("def f(x):")
    assert len(tok.encode(printed)) > len(tok.encode("def f(x):"))  # and went on
    with pytest.raises(ValueError, match="more than the model's vocab_size 16"):
        sj.save_model(tiny_model(seed=3), tmp_path / "small", tokenizer=tok)


@pytest.mark.parametrize("fmt", ["orbax", "hf"])
def test_a_save_keeps_the_eos_ids_of_the_save_it_replaces(tmp_path, fmt):
    """BOS/EOS ids live in generation_config.json, which a save owns. An orbax save deleted it
    and wrote none, so an HF folder converted in place lost every EOS id but the tokenizer's
    one (a Llama-3-instruct folder keeps <|eot_id|> only there), and ids passed to an orbax
    save were dropped. Now both formats write them, and a save given none keeps the old ones."""
    model = tiny_model(seed=4)
    sj.save_model(model, tmp_path, format="hf", bos_token_id=0, eos_token_id=[5, 7])
    generation = lambda: json.loads((tmp_path / "generation_config.json").read_text())  # noqa
    sj.save_model(sj.load_model(tmp_path), tmp_path, format=fmt)  # converted in place
    assert generation() == {"bos_token_id": 0, "eos_token_id": [5, 7]}
    sj.save_model(model, tmp_path, format=fmt, eos_token_id=np.int64(9))  # given: these
    assert generation() == {"eos_token_id": 9}
    sj.save_model(model, tmp_path, format="hf", eos_token_id=12)
    sj.save_model(tiny_model(seed=5, vocab_size=8), tmp_path, format=fmt)
    assert not (tmp_path / "generation_config.json").exists()  # 12 is not a token of this one


def test_bad_ids_and_dtypes_for_a_save_are_named(tmp_path):
    model = tiny_model(seed=4)  # 16 tokens
    for kw, message in [(dict(bos_token_id=-3), "bos_token_id must be a token id in \\[0, 16\\), "
                                                "got -3"),
                        (dict(eos_token_id=[1000, True]), "eos_token_id must be token ids in "
                                                          "\\[0, 16\\), got \\[1000, True\\]"),
                        (dict(eos_token_id=[]), "eos_token_id must be token ids"),
                        (dict(dtype=np.float64), "save_model's dtype must be 'float32', "
                                                 "'bfloat16', 'float16' or None")]:
        with pytest.raises(ValueError, match=message):
            sj.save_model(model, tmp_path / "m", **kw)
        assert not (tmp_path / "m").exists()


def test_saving_through_a_link_or_from_inside_the_folder(tmp_path, monkeypatch):
    """A folder given by a symbolic link is saved where it points (the link was replaced by a
    real folder and the old weights stayed behind, with a stray temporary link); a process
    working inside the folder still can after the swap (its cwd was the replaced folder, gone);
    a folder named like a glob pattern touches no other folder's backups."""
    a, b = tiny_model(seed=1), tiny_model(seed=2)
    sj.save_model(a, tmp_path / "real", format="hf")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    sj.save_model(b, tmp_path / "link", format="hf")
    assert (tmp_path / "link").is_symlink()
    np.testing.assert_array_equal(np.asarray(sj.load_model(tmp_path / "real").params["norm"]
                                             ["weight"]), np.asarray(b.params["norm"]["weight"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    monkeypatch.chdir(tmp_path / "real")
    sj.save_model(a, ".", format="hf")
    assert pathlib.Path.cwd() == tmp_path / "real" and pathlib.Path("config.json").exists()
    monkeypatch.chdir(tmp_path)
    backup = tmp_path / f".m1{sj.files.OLD}0a1b2c3d"  # another folder's earlier save
    shutil.copytree(tmp_path / "real", backup)
    sj.save_model(b, tmp_path / "m[12]", format="hf")
    assert backup.is_dir() and (backup / "config.json").exists()
