"""Gemma 1, 2, 3 and Phi-3 against the transformers reference: logits, greedy decoding,
speculative greedy decoding (chains, and trees where no layer slides), export round trips,
refused variants. Distribution tests for a soft-capped and a sliding-window target are in
tests/test_lossless.py."""

import json
import pathlib

import jax
import numpy as np
import pytest
import torch
import transformers

import specjax as sj
from specjax import checkpoint

V = 97
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3)


def hf_config(family, **overrides):
    """A tiny random config of ``family`` whose every feature shows in the logits: heads of
    their own size, a query scale other than the head size, a window shorter than the test
    sequences, soft-caps that bite, local and global layers with RoPE bases of their own."""
    kw = {**COMMON, **overrides}
    if family == "gemma":
        return transformers.GemmaConfig(**{"num_hidden_layers": 2, "head_dim": 24, **kw})
    if family == "gemma2":
        return transformers.Gemma2Config(**{
            "num_hidden_layers": 3, "head_dim": 24, "query_pre_attn_scalar": 20,
            "sliding_window": 5, "attn_logit_softcapping": 3.0, "final_logit_softcapping": 4.0,
            **kw})
    if family == "gemma3":
        return transformers.Gemma3TextConfig(**{
            "num_hidden_layers": 3, "head_dim": 24, "query_pre_attn_scalar": 20,
            "sliding_window": 5, "sliding_window_pattern": 2, "rope_theta": 5e5,
            "rope_local_base_freq": 1000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            "final_logit_softcapping": 4.0, **kw})
    if family == "phi3":
        return transformers.Phi3Config(**{"num_hidden_layers": 2, "sliding_window": 5,
                                          "pad_token_id": 0, **kw})
    raise ValueError(family)


CLASSES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
           "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
FAMILIES = list(CLASSES)


def hf_model(family, seed=0, **overrides):
    """A transformers model with every tensor randomised (norm weights too: Gemma's start at 0,
    where (1 + w) and w would agree on nothing but a bug)."""
    torch.manual_seed(seed)
    cls = getattr(transformers, CLASSES[family])
    model = cls._from_config(hf_config(family, **overrides), attn_implementation="eager").eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.0))
    return model.float()


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens)), use_cache=False).logits.float().numpy()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each family saved by transformers: {family: (folder, model)}."""
    out = {}
    for family in FAMILIES:
        model = hf_model(family)
        folder = tmp_path_factory.mktemp(family)
        model.save_pretrained(folder)
        out[family] = (folder, model)
    return out


TOKENS = np.random.default_rng(0).integers(1, V, (2, 14))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, folders):
    folder, model = folders[family]
    ours = sj.load_model(folder)
    want = hf_logits(model, TOKENS)
    got = np.asarray(sj.model.logits(ours, TOKENS))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_each_family_feature_is_read(folders):
    cfg = {f: sj.load_model(folders[f][0]).config for f in FAMILIES}
    g1, g2, g3, phi = cfg["gemma"], cfg["gemma2"], cfg["gemma3"], cfg["phi3"]
    for c in (g1, g2, g3):
        assert c.norm_unit_offset and c.scale_embeddings and c.tie_word_embeddings
        assert c.hidden_act == "gelu_pytorch_tanh" and c.head_dim == 24
    assert not g1.sandwich_norms and g1.sliding_window is None and g1.layer_types is None
    assert g2.sandwich_norms and g2.attn_logit_softcapping == 3.0
    assert g2.final_logit_softcapping == 4.0 and g2.query_pre_attn_scalar == 20
    assert g2.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert g3.qk_norm and g3.sandwich_norms and g3.attn_logit_softcapping is None
    assert (g3.rope_theta, g3.rope_local_theta) == (5e5, 1000.0)
    assert g3.rope_scaling.rope_type == "linear" and g3.rope_scaling.factor == 4.0
    assert g3.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert g3.layer_rope(0).rope_theta == 1000.0 and g3.layer_rope(0).rope_scaling is None
    assert g3.layer_rope(1) is g3
    assert phi.sliding_window == 5 and phi.layer_types is None and phi.rms_norm_eps == 1e-5
    assert not (phi.norm_unit_offset or phi.scale_embeddings or phi.sandwich_norms)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_matches_transformers(family, folders):
    """Past the window (the prompt and the 16 new tokens span 3 windows), one token at a time
    from our cache against transformers' own generate."""
    folder, model = folders[family]
    prompt = TOKENS[0, :6]
    with torch.no_grad():
        want = model.generate(torch.tensor(prompt[None]), max_new_tokens=16, do_sample=False,
                              min_new_tokens=16, pad_token_id=0)[0, len(prompt):].numpy()
    out = sj.generate(sj.load_model(folder), [prompt.tolist()],
                      sampling=sj.SamplingParams(temperature=0, max_new_tokens=16))
    np.testing.assert_array_equal(out.tokens[0], want)


def _draft(family, tmp_path):
    """A draft of the same family and vocabulary, another size."""
    small = hf_model(family, seed=1, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
    small.save_pretrained(tmp_path / "draft")
    return sj.load_model(tmp_path / "draft")


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_greedy_equals_autoregressive(family, folders, tmp_path):
    target = sj.load_model(folders[family][0])
    draft = _draft(family, tmp_path)
    prompts = [TOKENS[0, :6].tolist(), TOKENS[1, :3].tolist()]
    sampling = sj.SamplingParams(temperature=0, max_new_tokens=20)
    want = sj.generate(target, prompts, sampling=sampling).tokens
    specs = [sj.SpecConfig(method="draft_model", num_speculative_tokens=3),
             sj.SpecConfig(method="ngram", num_speculative_tokens=3)]
    if target.config.sliding_window is None:  # trees and sliding windows: see test_tree
        specs.append(sj.SpecConfig(method="draft_model",
                                   tree=((0,), (1,), (0, 0), (1, 0), (0, 0, 0))))
    for spec in specs:
        got = sj.generate(target, prompts, sampling=sampling, spec=spec,
                          draft=draft if spec.method == "draft_model" else None).tokens
        np.testing.assert_array_equal(got, want, err_msg=str(spec))


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_export_round_trips_through_transformers(family, folders, tmp_path):
    """Ours -> Hugging Face folder -> transformers: the same logits; and back."""
    ours = sj.load_model(folders[family][0])
    sj.save_model(ours, tmp_path / "out", format="hf")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == [CLASSES[family]]
    reloaded = getattr(transformers, CLASSES[family]).from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval().float()
    want = np.asarray(sj.model.logits(ours, TOKENS))
    np.testing.assert_allclose(hf_logits(reloaded, TOKENS), want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())
    back = sj.load_model(tmp_path / "out")
    assert back.config == ours.config
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(ours.params)):
        np.testing.assert_array_equal(a, b)


def test_a_multimodal_gemma3_loads_its_language_model(tmp_path):
    """Gemma 3 from 4B up ships as Gemma3ForConditionalGeneration: the language model's config
    is its text_config, its tensors are language_model.*; the vision tower's are skipped. On
    text alone the logits are transformers' (the vocabulary's image tokens left out)."""
    text = {**COMMON, "num_hidden_layers": 2, "head_dim": 24, "query_pre_attn_scalar": 20,
            "sliding_window": 5, "sliding_window_pattern": 2}
    text.pop("initializer_range")
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, image_token_index=96,
                                       boi_token_index=94, eoi_token_index=95,
                                       initializer_range=0.3)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration._from_config(
        config, attn_implementation="eager").eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.0))
    model.save_pretrained(tmp_path / "mm")
    ours = sj.load_model(tmp_path / "mm")
    assert ours.config.qk_norm and ours.config.sandwich_norms and ours.config.vocab_size == V
    tokens = TOKENS % 90  # text only
    want = hf_logits(model.float(), tokens)
    np.testing.assert_allclose(np.asarray(sj.model.logits(ours, tokens)), want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())


def test_phi3_exports_as_an_equivalent_mistral(folders, tmp_path):
    """Phi-3's fused projections are split on load; its export is the same model in Mistral's
    layout (a window on every layer, SwiGLU, Llama's norms), which transformers reads as is."""
    ours = sj.load_model(folders["phi3"][0])
    sj.save_model(ours, tmp_path / "out", format="hf")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [
        "MistralForCausalLM"]
    mistral = transformers.MistralForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval().float()
    want = hf_logits(folders["phi3"][1], TOKENS)
    np.testing.assert_allclose(hf_logits(mistral, TOKENS), want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())


def test_sharded_load_reads_each_part_of_phi3s_fused_tensors(folders):
    """With a mesh, each device reads only its part; for Phi-3 that part lies inside a fused
    tensor. One device here: the whole model through the same fetch path."""
    mesh = sj.make_mesh(1)
    ours = sj.load_model(folders["phi3"][0], mesh=mesh)
    want = hf_logits(folders["phi3"][1], TOKENS)
    np.testing.assert_allclose(np.asarray(sj.model.logits(ours, TOKENS)), want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())


def _edit_config(folder: pathlib.Path, tmp_path, **changes) -> pathlib.Path:
    import shutil
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    d = json.loads((out / "config.json").read_text())
    d.update(changes)
    (out / "config.json").write_text(json.dumps(d))
    return out


def test_unsupported_variants_are_refused_by_name(folders, tmp_path):
    phi = folders["phi3"][0]
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                "rope_theta": 10000.0}
    with pytest.raises(checkpoint.CheckpointError, match="long-context RoPE.*longrope"):
        sj.load_model(_edit_config(phi, tmp_path / "a", rope_parameters=longrope))
    with pytest.raises(checkpoint.CheckpointError, match="partial_rotary_factor=0.5"):
        sj.load_model(_edit_config(phi, tmp_path / "b", partial_rotary_factor=0.5))
    gemma2 = folders["gemma2"][0]
    with pytest.raises(checkpoint.CheckpointError, match="hidden_act 'relu'"):
        sj.load_model(_edit_config(gemma2, tmp_path / "c", hidden_activation="relu"))
    with pytest.raises(checkpoint.CheckpointError, match="needs a text_config"):
        sj.load_model(_edit_config(folders["gemma3"][0], tmp_path / "d",
                                   architectures=["Gemma3ForConditionalGeneration"]))
    with pytest.raises(checkpoint.CheckpointError, match="layer_types"):
        sj.load_model(_edit_config(gemma2, tmp_path / "e", layer_types=["full_attention"]))
    with pytest.raises(checkpoint.CheckpointError, match="hidden_act 'gelu'"):  # exact GELU
        sj.load_model(_edit_config(gemma2, tmp_path / "f", hidden_activation="gelu"))
    with pytest.raises(checkpoint.CheckpointError, match="sliding_window_pattern must be"):
        sj.load_model(_edit_config(folders["gemma3"][0], tmp_path / "g", layer_types=None,
                                   sliding_window_pattern=0))


def test_configs_check_the_new_fields():
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2)
    with pytest.raises(ValueError, match="hidden_act must be one of"):
        sj.ModelConfig(**base, hidden_act="relu")
    with pytest.raises(ValueError, match="attn_logit_softcapping must be a finite number > 0"):
        sj.ModelConfig(**base, attn_logit_softcapping=0.0)
    with pytest.raises(ValueError, match="layer_types must list"):
        sj.ModelConfig(**base, layer_types=("full_attention",), sliding_window=4)
    with pytest.raises(ValueError, match="sliding_window is None"):
        sj.ModelConfig(**base, layer_types=("full_attention", "sliding_attention"))
    cfg = sj.ModelConfig(**base, layer_types=["sliding_attention", "full_attention"],
                         sliding_window=4, rope_local_theta=100.0)
    assert cfg.layer_types == ("sliding_attention", "full_attention")  # hashable
    assert [cfg.layer_window(i) for i in range(2)] == [4, None]
    hash(cfg)
    with pytest.raises(ValueError, match="mixes full and sliding layers"):
        checkpoint.hf_architecture(sj.ModelConfig(**base, sliding_window=4, layer_types=(
            "sliding_attention", "full_attention")))
    with pytest.raises(ValueError, match="Gemma's .* come together"):
        checkpoint.hf_architecture(sj.ModelConfig(**base, norm_unit_offset=True))


def test_orbax_round_trip_keeps_the_family_fields(tmp_path):
    cfg = sj.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, sliding_window=3,
                         layer_types=("sliding_attention", "full_attention"),
                         attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                         query_pre_attn_scalar=12.0, sandwich_norms=True, norm_unit_offset=True,
                         scale_embeddings=True, hidden_act="gelu_pytorch_tanh",
                         rope_local_theta=100.0,
                         rope_scaling=sj.RopeScaling(rope_type="linear", factor=2.0))
    model = sj.init_model(cfg, jax.random.key(0))
    sj.save_model(model, tmp_path / "m")
    back = sj.load_model(tmp_path / "m")
    assert back.config == cfg
    np.testing.assert_array_equal(np.asarray(sj.model.logits(back, TOKENS % 32)),
                                  np.asarray(sj.model.logits(model, TOKENS % 32)))
