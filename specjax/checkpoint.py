"""Checkpoints: Hugging Face folders (config.json + safetensors) and orbax folders.

Hugging Face weights are read tensor by tensor from safetensors files (with the safetensors
package), cast and placed on the device one parameter at a time, so a multi-GB model is never
held twice in host memory; on a mesh each device reads only its own slice of each tensor. Every
check (files, architecture, names, shapes, file integrity) runs before the model is returned:
nothing half-loaded escapes.

Name mapping (our parameter path -> Hugging Face tensor name)::

    embed_tokens/embedding          model.embed_tokens.weight
    layers/<i>/.../kernel [in,out]  model.layers.<i>.....weight [out,in]   (transposed)
    layers/<i>/.../bias             model.layers.<i>.....bias
    layers/<i>/.../weight           model.layers.<i>.....weight            (norms)
    norm/weight                     model.norm.weight
    lm_head/kernel                  lm_head.weight                          (transposed)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import numbers
import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, for safetensors' reads)
import numpy as np

from . import files
from .config import ModelConfig, RopeScaling
from .files import read_json_object
from .model import Model, abstract_params, stack_layers, unstack_layers

log = logging.getLogger(__name__)

ORBAX_VERSION = 2
"""specjax.json "version" that save_model writes. Version 1 (specjax 0.1) stacked the layers on a
leading [L] axis; load_model still reads it."""

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
                "Gemma3ForCausalLM": "gemma3_text", "Phi3ForCausalLM": "phi3"}
GEMMAS = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Hugging Face's defaults for keys a family's config.json may leave out
_FAMILY_DEFAULTS = {
    "GemmaForCausalLM": dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576,
                             num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=16,
                             head_dim=256, tie_word_embeddings=True, max_position_embeddings=8192),
    "Gemma2ForCausalLM": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                              num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                              head_dim=256, tie_word_embeddings=True, max_position_embeddings=8192,
                              query_pre_attn_scalar=256, sliding_window=4096,
                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    # a multimodal Gemma 3's text_config often lists only what differs from these
    "Gemma3ForCausalLM": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                              num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                              head_dim=256, tie_word_embeddings=True,
                              max_position_embeddings=131072, query_pre_attn_scalar=256,
                              sliding_window=4096, final_logit_softcapping=None),
    "Phi3ForCausalLM": dict(max_position_embeddings=4096, rms_norm_eps=1e-5),
    # transformers' MistralConfig: a config without the keys slides over 4096 positions
    "MistralForCausalLM": dict(sliding_window=4096, max_position_embeddings=131072,
                               num_key_value_heads=8),
    "Qwen2ForCausalLM": dict(max_position_embeddings=32768, num_key_value_heads=32),
    "Qwen3ForCausalLM": dict(max_position_embeddings=32768, num_key_value_heads=32,
                             head_dim=128),
}
MULTIMODAL = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "language_model.",
                                                 ("vision_tower.", "multi_modal_projector."))}
"""Multimodal classes whose language model loads alone: (its text class, the prefix of its
tensor names, the prefixes of the other towers' tensors, which are skipped)."""
# GeGLU's activation names per family: Gemma rewrites "gelu" to the tanh form, Gemma 2 and 3
# would compute an exact GELU for it (refused)
_GELU_TANH = {"GemmaForCausalLM": ("gelu_pytorch_tanh", "gelu"),
              "Gemma2ForCausalLM": ("gelu_pytorch_tanh",),
              "Gemma3ForCausalLM": ("gelu_pytorch_tanh",)}
_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                 "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SPECJAX_FILE = "specjax.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file or tensor."""


# ---------------------------------------------------------------------------------------------
# safetensors, through the safetensors package; its errors are re-raised naming the file.

class SafetensorsFile:
    """A safetensors file whose header safetensors has checked against the file's size. Each read
    opens the file for that tensor (or slice) alone and closes it, so the memory map's touched
    pages are not held across the whole load (they would count as the process's memory)."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        with self._open() as f:
            self.entries = {name: (f.get_slice(name).get_dtype(),
                                   tuple(f.get_slice(name).get_shape())) for name in f.keys()}

    def _open(self):
        from safetensors import SafetensorError, safe_open
        try:
            return safe_open(self.path, framework="numpy")
        except SafetensorError as e:
            raise CheckpointError(f"{self.path} is corrupt or truncated (safetensors: {e})"
                                  ) from None

    def _read(self, name: str, index: tuple[slice, ...] | None) -> np.ndarray:
        from safetensors import SafetensorError
        try:
            with self._open() as f:
                x = f.get_tensor(name) if index is None else f.get_slice(name)[index]
        except (SafetensorError, TypeError, ValueError) as e:
            raise CheckpointError(f"{self.path}: cannot read tensor {name!r} "
                                  f"({self.entries[name][0]}: {e})") from None
        return np.array(x)  # owns its memory once the file is closed

    def get(self, name: str) -> np.ndarray:
        """One tensor, read from disk into a fresh array."""
        return self._read(name, None)

    def get_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The part ``index`` (one slice per axis) of a tensor, reading only those bytes' rows."""
        return self._read(name, index)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]


def write_safetensors(path: pathlib.Path, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Write tensors (numpy, any of the safetensors dtypes) to one file (through a temporary
    sibling, renamed into place)."""
    from safetensors.numpy import save_file
    arrays = {name: np.ascontiguousarray(a) for name, a in tensors.items()}

    def write(tmp):
        save_file(arrays, tmp, metadata=metadata or {"format": "pt"})
        os.chmod(tmp, files.new_file_mode())  # as the folder's other files, not 0o600
    try:
        files.write_atomic(path, b"", writer=write)
    except (ValueError, TypeError, OSError) as e:
        raise ValueError(f"cannot write {path} with safetensors: {e}") from e


# ---------------------------------------------------------------------------------------------
# Config translation.

def _rope_from_hf(d: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from a config with ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (older)."""
    # transformers takes rope_scaling whole when a config has both (older keys win there)
    params = d.get("rope_parameters") or {}
    merged = d.get("rope_scaling") or params
    theta = float(merged.get("rope_theta", params.get("rope_theta", d.get("rope_theta", 10000.0))))
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ("linear", "llama3"):
        raise CheckpointError(f"RoPE scaling type {kind!r} is not supported; supported: "
                              f"default, linear, llama3")
    fields = {f.name for f in dataclasses.fields(RopeScaling)}
    kw = {k: v for k, v in merged.items() if k in fields and k != "rope_type"}
    if kind == "llama3" and "original_max_position_embeddings" not in kw:
        # what transformers fills in: the model's context (its default too, as config_from_hf's)
        kw["original_max_position_embeddings"] = d.get("max_position_embeddings", 2048)
    return theta, RopeScaling(rope_type=kind, **kw)


def _gemma3_rope(d: dict, source: str) -> tuple[float, RopeScaling | None, float]:
    """Gemma 3: (global base, global scaling, local base), from ``rope_parameters`` keyed by layer
    type (transformers 5) or ``rope_theta`` / ``rope_scaling`` (global) and
    ``rope_local_base_freq`` (older)."""
    params = d.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise CheckpointError(f"{source}: RoPE scaling on the sliding layers "
                                  f"({local.get('rope_type', local.get('type'))!r}) is not "
                                  f"supported")
        # a nested entry without its theta takes the top-level one, as transformers does
        theta, scaling = _rope_from_hf({"rope_parameters": {
            "rope_theta": d.get("rope_theta", 1e6), **full},
            "max_position_embeddings": d.get("max_position_embeddings", 131072)})
        return theta, scaling, float(local.get("rope_theta", d.get("rope_local_base_freq", 1e4)))
    theta, scaling = _rope_from_hf({"rope_theta": 1e6, **d})
    return theta, scaling, float(d.get("rope_local_base_freq", 1e4))


def _layer_types(d: dict, arch: str, layers: int) -> list[str] | None:
    """Per-layer attention kinds: the config's ``layer_types``, or the family's default pattern
    (Gemma 2: layers 0, 2, 4, ... slide; Gemma 3: all but every ``sliding_window_pattern``-th
    (6))."""
    kinds = d.get("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != layers or any(
                k not in ("full_attention", "sliding_attention") for k in kinds):
            raise CheckpointError(f"layer_types must list full_attention or sliding_attention "
                                  f"for each of the {layers} layers, got {kinds!r}")
        return kinds
    if arch == "Gemma2ForCausalLM":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if arch == "Gemma3ForCausalLM":
        pattern = d.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise CheckpointError(f"sliding_window_pattern must be an int >= 1, got {pattern!r}")
        return ["sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(layers)]
    return None


def config_from_hf(d: dict, dtype: str | None = None, source: str = "config.json"
                   ) -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json dict (source names it in errors)."""
    if not isinstance(d, dict):
        raise CheckpointError(f"{source} does not hold a JSON object")
    d, _ = language_model(d, source)
    arch = hf_config_architecture(d, source)
    d = {**_FAMILY_DEFAULTS.get(arch, {}), **d}
    gemma = arch in GEMMAS
    # Gemma reads hidden_act ("gelu" meaning the tanh form); Gemma 2 and 3 hidden_activation
    act = d.get("hidden_activation" if arch in GEMMAS[1:] else "hidden_act",
                "gelu_pytorch_tanh" if gemma else "silu")
    if gemma and act in _GELU_TANH[arch]:
        act = "gelu_pytorch_tanh"
    elif gemma or act not in ("silu", "swish"):
        raise CheckpointError(f"{source}: hidden_act {act!r} is not supported (only silu, and "
                              f"gelu_pytorch_tanh for Gemma)")
    else:
        act = "silu"
    if d.get("mlp_bias"):
        raise CheckpointError(f"{source}: mlp_bias is not supported")
    if arch == "Phi3ForCausalLM":
        kind = (d.get("rope_scaling") or d.get("rope_parameters") or {}).get(
            "rope_type", (d.get("rope_scaling") or {}).get("type", "default"))
        if kind in ("longrope", "su", "yarn"):
            raise CheckpointError(f"{source}: Phi-3's long-context RoPE ({kind!r}, the 128k "
                                  f"models) is not supported; the 4k-context models load")
        partial = next((x["partial_rotary_factor"] for x in (
            d, d.get("rope_parameters") or {}, d.get("rope_scaling") or {})
            if "partial_rotary_factor" in x), 1.0)
        if partial != 1.0:
            raise CheckpointError(f"{source}: partial_rotary_factor={partial!r} (RoPE on part "
                                  f"of each head) is not supported")
    if d.get("use_bidirectional_attention"):
        raise CheckpointError(f"{source}: use_bidirectional_attention=true is not supported")
    local_theta = None
    if arch == "Gemma3ForCausalLM":
        theta, scaling, local_theta = _gemma3_rope(d, source)
    else:
        theta, scaling = _rope_from_hf(d)
    if dtype is None:
        stored = d.get("dtype") or d.get("torch_dtype") or "float32"
        if stored not in _TORCH_DTYPES:
            raise CheckpointError(f"{source}: dtype {stored!r} is not supported; supported: "
                                  f"float32, bfloat16, float16")
        dtype = _TORCH_DTYPES[stored]
    bias = bool(d.get("attention_bias", False))
    max_pos = d.get("max_position_embeddings", 2048)
    window = d.get("sliding_window")
    # Llama attends to every position whatever its config says (transformers reads no window
    # for it); a window makes it Mistral
    if arch == "LlamaForCausalLM":
        window = None
    if arch.startswith("Qwen"):
        # Qwen slides only on some layers (layer_types / max_window_layers): not supported.
        if d.get("use_sliding_window", False):
            raise CheckpointError(f"{source}: use_sliding_window=true (sliding attention on some "
                                  f"layers) is not supported")
        window = None
    layer_types = None
    if gemma:  # a window per layer kind, kept even when it spans the context (Gemma 3's sliding
        #        layers have their own RoPE either way)
        try:
            layer_types = _layer_types(d, arch, d["num_hidden_layers"])
        except KeyError as e:
            raise CheckpointError(f"{source} lacks the key {e.args[0]!r}") from None
        except CheckpointError as e:
            raise CheckpointError(f"{source}: {e}") from None
        if layer_types is not None and "sliding_attention" not in layer_types:
            window = None
    elif not window:  # kept at or past the context too: sj.logits beyond it still slides, as
        window = None  # transformers does (in generate's contexts it never binds; no ring)
    if arch == "GemmaForCausalLM":
        window = None
    try:
        return ModelConfig(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim"), max_position_embeddings=max_pos, rope_theta=theta,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama, Mistral, Qwen3 and Gemma
            # put attention_bias on all four projections.
            attention_bias=True if arch == "Qwen2ForCausalLM" else bias,
            o_proj_bias=False if arch == "Qwen2ForCausalLM" else bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"), rope_scaling=scaling,
            sliding_window=window, dtype=dtype, hidden_act=act, scale_embeddings=gemma,
            norm_unit_offset=gemma, sandwich_norms=arch in GEMMAS[1:],
            query_pre_attn_scalar=d.get("query_pre_attn_scalar") if arch in GEMMAS[1:] else None,
            # Gemma 3 keeps attn_logit_softcapping in its config but never applies it
            attn_logit_softcapping=d.get("attn_logit_softcapping")
            if arch == "Gemma2ForCausalLM" else None,
            final_logit_softcapping=d.get("final_logit_softcapping")
            if arch in GEMMAS[1:] else None,
            layer_types=layer_types if window is not None else None,
            rope_local_theta=local_theta if window is not None else None)
    except KeyError as e:
        raise CheckpointError(f"{source} lacks the key {e.args[0]!r}") from None
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None


def language_model(d: dict, source: str = "config.json") -> tuple[dict, str]:
    """A config.json dict of a multimodal model reduced to its language model's (the
    ``text_config``, with the top level's dtype), and the prefix of that model's tensor names;
    any other config as it is, with no prefix."""
    archs = d.get("architectures") or []
    multimodal = next((a for a in archs if a in MULTIMODAL), None)
    if multimodal is None:
        return d, ""
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{source}: a {multimodal} config needs a text_config object")
    arch, prefix, _ = MULTIMODAL[multimodal]
    dtype = {k: d[k] for k in ("dtype", "torch_dtype") if k in d}
    return {**dtype, **text, "architectures": [arch]}, prefix


def hf_config_architecture(d: dict, source: str = "config.json") -> str:
    """The supported Hugging Face class a config.json dict names (its ``architectures``, else its
    ``model_type``); CheckpointError naming it if none is supported."""
    archs = d.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None and not archs:  # no architectures list: go by model_type
        arch = {v: k for k, v in _MODEL_TYPES.items()}.get(d.get("model_type"))
    if arch is None:
        raise CheckpointError(f"{source}: unsupported architecture {archs or d.get('model_type')!r}"
                              f"; supported: {', '.join(ARCHITECTURES + tuple(MULTIMODAL))}")
    return arch


def _gemma_architecture(cfg: ModelConfig) -> str:
    """The Gemma class with exactly this config's features; ValueError naming what none has."""
    if not (cfg.norm_unit_offset and cfg.scale_embeddings
            and cfg.hidden_act == "gelu_pytorch_tanh"):
        raise ValueError(f"no Hugging Face class has this mix of features: Gemma's (RMSNorm with "
                         f"a unit offset, scaled embeddings, GeGLU) come together, this config "
                         f"has norm_unit_offset={cfg.norm_unit_offset}, scale_embeddings="
                         f"{cfg.scale_embeddings}, hidden_act={cfg.hidden_act!r}")
    if cfg.attention_bias != cfg.o_proj_bias:
        raise ValueError("Gemma puts attention_bias on q/k/v and o_proj together")
    if not cfg.sandwich_norms:
        extra = [n for n in ("qk_norm", "query_pre_attn_scalar", "attn_logit_softcapping",
                             "final_logit_softcapping", "sliding_window", "rope_local_theta")
                 if getattr(cfg, n)]
        if extra:
            raise ValueError(f"GemmaForCausalLM (no sandwich norms) has none of {extra}")
        return "GemmaForCausalLM"
    if cfg.qk_norm:
        if cfg.attn_logit_softcapping is not None:
            raise ValueError("Gemma3ForCausalLM does not soft-cap attention scores "
                             "(attn_logit_softcapping must be None)")
        if cfg.rope_local_theta is None and cfg.rope_scaling is not None \
                and cfg.sliding_window is not None:
            raise ValueError("Gemma3ForCausalLM scales only the full layers' RoPE; this config "
                             "scales the sliding layers' too (rope_local_theta is None)")
        return "Gemma3ForCausalLM"
    if cfg.rope_local_theta is not None:
        raise ValueError("Gemma2ForCausalLM has one RoPE for every layer (rope_local_theta must "
                         "be None)")
    return "Gemma2ForCausalLM"


def hf_architecture(cfg: ModelConfig) -> str:
    """The Hugging Face class that has exactly this config's features; ValueError if none has."""
    if (cfg.norm_unit_offset or cfg.scale_embeddings or cfg.sandwich_norms
            or cfg.hidden_act != "silu" or cfg.query_pre_attn_scalar is not None
            or cfg.attn_logit_softcapping is not None or cfg.final_logit_softcapping is not None
            or cfg.rope_local_theta is not None):
        return _gemma_architecture(cfg)
    if cfg.qk_norm:
        arch = "Qwen3ForCausalLM"
    elif cfg.attention_bias and not cfg.o_proj_bias:
        arch = "Qwen2ForCausalLM"
    else:
        arch = "MistralForCausalLM" if cfg.sliding_window else "LlamaForCausalLM"
    if arch != "Qwen2ForCausalLM" and cfg.attention_bias != cfg.o_proj_bias:
        raise ValueError(f"{arch} puts attention_bias on q/k/v and o_proj together; this config "
                         f"has attention_bias={cfg.attention_bias}, o_proj_bias={cfg.o_proj_bias}")
    if cfg.sliding_window and arch != "MistralForCausalLM":
        raise ValueError(f"a sliding window with these features ({arch}) has no Hugging Face "
                         f"equivalent")
    if cfg.layer_types is not None and "full_attention" in cfg.layer_types:
        raise ValueError(f"{arch} slides on every layer or none; this config mixes full and "
                         f"sliding layers (layer_types) without Gemma's features")
    if arch == "MistralForCausalLM" and cfg.attention_bias:
        raise ValueError("MistralForCausalLM has no attention biases")
    return arch


def _plain(x: float) -> float | int:
    """A whole float as an int (transformers' Gemma configs type query_pre_attn_scalar int)."""
    return int(x) if float(x).is_integer() else x


def config_to_hf(cfg: ModelConfig) -> dict:
    arch = hf_architecture(cfg)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope.update(dataclasses.asdict(cfg.rope_scaling))
    d = {
        "architectures": [arch], "model_type": _MODEL_TYPES[arch],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": cfg.hidden_act,
        "attention_bias": cfg.o_proj_bias, "dtype": cfg.dtype, "torch_dtype": cfg.dtype,
    }
    if cfg.rope_scaling is not None:
        d["rope_scaling"] = rope
    if arch == "MistralForCausalLM":
        d["sliding_window"] = cfg.sliding_window
    if arch.startswith("Qwen"):
        d["use_sliding_window"] = False
    if arch in GEMMAS[1:]:
        L = cfg.num_hidden_layers
        d.update(hidden_activation=cfg.hidden_act,
                 query_pre_attn_scalar=_plain(cfg.query_pre_attn_scalar or cfg.head_dim),
                 attn_logit_softcapping=cfg.attn_logit_softcapping,
                 final_logit_softcapping=cfg.final_logit_softcapping,
                 sliding_window=cfg.sliding_window or cfg.max_position_embeddings,
                 layer_types=list(cfg.layer_types or (
                     ["sliding_attention"] * L if cfg.sliding_window else ["full_attention"] * L)))
    if arch == "Gemma3ForCausalLM":
        del d["rope_theta"]
        d["rope_parameters"] = {"full_attention": rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}}
        d.pop("rope_scaling", None)
    return d


# ---------------------------------------------------------------------------------------------
# Parameter names.

def _leaves(tree, prefix=()) -> Iterator[tuple[tuple[str, ...], Any]]:
    if isinstance(tree, dict):
        for k in sorted(tree):
            yield from _leaves(tree[k], prefix + (k,))
    else:
        yield prefix, tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def hf_name(path: tuple[str, ...]) -> tuple[str, bool]:
    """(Hugging Face tensor name, transposed?) for one of our parameter paths."""
    last = path[-1]
    suffix = "bias" if last == "bias" else "weight"
    if path[0] == "lm_head":
        return "lm_head.weight", True
    return f"model.{'.'.join(path[:-1])}.{suffix}", last == "kernel"


def _fused_part(path: tuple[str, ...], cfg: ModelConfig
                ) -> tuple[str, tuple[int, int, int]] | None:
    """Phi-3 stores q, k, v as one ``qkv_proj`` and gate, up as one ``gate_up_proj`` ([out, in],
    parts stacked along out in that order): (its name, (our first row, our rows, all rows)) for
    one of our kernels, None for the others."""
    if len(path) != 5 or path[-1] != "kernel":
        return None
    H, K, D, F = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                  cfg.intermediate_size)
    prefix = f"model.layers.{path[1]}"
    parts = {("self_attn", "q_proj"): ("self_attn.qkv_proj", 0, H * D, (H + 2 * K) * D),
             ("self_attn", "k_proj"): ("self_attn.qkv_proj", H * D, K * D, (H + 2 * K) * D),
             ("self_attn", "v_proj"): ("self_attn.qkv_proj", (H + K) * D, K * D, (H + 2 * K) * D),
             ("mlp", "gate_proj"): ("mlp.gate_up_proj", 0, F, 2 * F),
             ("mlp", "up_proj"): ("mlp.gate_up_proj", F, F, 2 * F)}
    if (path[2], path[3]) not in parts:
        return None
    name, first, rows, total = parts[path[2], path[3]]
    return f"{prefix}.{name}.weight", (first, rows, total)


# ---------------------------------------------------------------------------------------------
# Loading and saving.

def _weight_files(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """tensor name -> file, from model.safetensors or model.safetensors.index.json."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.exists():  # as transformers does, a single file wins over an index
        return {name: single for name in SafetensorsFile(single).entries}
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index ({e})") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
        inside = folder.resolve()
        for f in sorted(set(weight_map.values())):  # a file of this folder, nothing else
            where = (folder / f).resolve()
            if pathlib.PurePath(f).is_absolute() or ".." in pathlib.PurePath(f).parts \
                    or where.parent != inside:
                raise CheckpointError(f"{index} names the shard file {f!r}, which is not a file "
                                      f"of {folder}: refused")
        missing = sorted({f for f in weight_map.values() if not (folder / f).exists()})
        if missing:
            raise FileNotFoundError(f"{index} names shard files that are missing: {missing}")
        return {name: folder / f for name, f in weight_map.items()}
    raise FileNotFoundError(f"{folder} has no model.safetensors or model.safetensors.index.json")


Fetch = Callable[[tuple[slice, ...] | None], np.ndarray]
"""Reads one parameter in our layout and dtype: the whole of it (None) or one part (a slice per
axis), reading only that part of the file."""


def _load_hf(folder: pathlib.Path, dtype: str | None,
             place: Callable[[tuple[str, ...], tuple[int, ...], Fetch, ModelConfig], Any]
             ) -> Model:
    config_path = folder / "config.json"
    hf_config = read_json_object(config_path, error=CheckpointError)
    cfg = config_from_hf(hf_config, dtype, str(config_path))
    text_config, prefix = language_model(hf_config)
    fused = hf_config_architecture(text_config) == "Phi3ForCausalLM"
    skipped = next((MULTIMODAL[a][2] for a in hf_config.get("architectures") or []
                    if a in MULTIMODAL), ())
    files = {p: SafetensorsFile(p) for p in sorted(set(_weight_files(folder).values()))}
    where = {name: f for f in files.values() for name in f.entries}
    target_dtype = np.dtype(jnp.dtype(cfg.dtype))
    used: set[str] = set()

    def fetcher(name: str, shape: tuple[int, ...], transpose: bool,
                part: tuple[int, int, int] | None) -> Fetch:
        """part: (first row, rows, all rows) of a fused [out, in] tensor that is ours."""
        if name not in where:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {folder}")
        f = where[name]
        want = shape[::-1] if transpose else shape
        if part is not None:
            want = (part[2],) + tuple(want[1:])
        if f.shape(name) != tuple(want):
            raise CheckpointError(f"tensor {name!r} in {f.path.name} has shape {f.shape(name)}, "
                                  f"expected {tuple(want)}")
        used.add(name)

        def fetch(index):
            if index is None and part is None:
                x = f.get(name)
            else:  # the file holds [out, in] where we hold [in, out]
                index = tuple(slice(None) for _ in shape) if index is None else tuple(index)
                index = index[::-1] if transpose else index
                if part is not None:  # our rows of the fused tensor
                    rows = range(part[1])[index[0]]
                    index = (slice(part[0] + rows.start, part[0] + rows.stop),) + index[1:]
                x = f.get_slice(name, index)
            return (x.T if transpose else x).astype(target_dtype)
        return fetch

    params: dict = {}
    for path, leaf in _leaves(abstract_params(cfg)):
        name, transpose = hf_name(path)
        part = _fused_part(path, cfg) if fused else None
        if part is not None:
            name, part = part
        _set(params, path, place(path, leaf.shape,
                                 fetcher(prefix + name, leaf.shape, transpose, part), cfg))
    ignorable = {prefix + "lm_head.weight"} if cfg.tie_word_embeddings else set()
    unused = sorted(n for n in set(where) - used - ignorable
                    if not n.endswith("rotary_emb.inv_freq") and not n.startswith(skipped))
    if unused:
        raise CheckpointError(f"{len(unused)} tensors in {folder} have no place in a "
                              f"{hf_architecture(cfg)} with this config, e.g. {unused[:3]}")
    return Model(cfg, params)


def _orbax():
    import orbax.checkpoint as ocp
    return ocp


def _load_orbax(folder: pathlib.Path, dtype: str | None, mesh=None,
                replicate: bool = False) -> Model:
    """Restore a ``save_model`` folder. On a mesh every array is restored straight into its
    place (split by the sharding rules, or whole on every device with ``replicate``): restoring
    to the default device and moving it after fails when the mesh spans several processes."""
    meta_path = folder / SPECJAX_FILE
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != "specjax":
            raise CheckpointError(f"{meta_path} is not a specjax checkpoint description")
        raw = dict(meta["config"])
        if raw.get("rope_scaling") is not None:
            raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
        cfg = ModelConfig(**raw)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{meta_path} is not a valid specjax checkpoint description "
                              f"({type(e).__name__}: {e})") from None
    version = meta.get("version")
    if version not in (1, ORBAX_VERSION):
        raise CheckpointError(f"{meta_path}: version {version!r} is not one this specjax reads "
                              f"(1 or {ORBAX_VERSION})")
    params_dir = (folder / "params").resolve()
    if not params_dir.exists():
        raise FileNotFoundError(f"{folder} has {SPECJAX_FILE} but no params/ folder")
    ckpt = _orbax().StandardCheckpointer()
    abstract = abstract_params(cfg)
    if version == 1:  # layers stacked on a leading axis: restored whole, then split per layer
        stacked = jax.eval_shape(lambda p: stack_layers(p, cfg.num_hidden_layers), abstract)
        if mesh is not None:  # whole on every device, then placed by the rules
            from jax.sharding import NamedSharding, PartitionSpec
            whole = NamedSharding(mesh, PartitionSpec())
            stacked = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                  sharding=whole), stacked)
        try:
            params = ckpt.restore(params_dir, stacked)
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise CheckpointError(f"{params_dir} does not match {meta_path} ({e})") from None
        model = Model(cfg, unstack_layers(params, cfg.num_hidden_layers))
        if mesh is not None:
            from .sharding import shard
            model = shard(model, mesh, replicate=replicate)
        return cast(model, dtype) if dtype else model
    if mesh is not None:  # each device reads only its own shards (all of them with replicate)
        from .sharding import param_shardings
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                abstract, param_shardings(cfg, abstract, mesh, replicate))
    try:
        params = ckpt.restore(params_dir, abstract)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CheckpointError(f"{params_dir} does not match {meta_path} ({e})") from None
    model = Model(cfg, params)
    return cast(model, dtype) if dtype else model


def cast(model: Model, dtype: str) -> Model:
    """The same model with parameters (and compute) in another dtype."""
    cfg = dataclasses.replace(model.config, dtype=dtype)
    params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), model.params)
    return Model(cfg, params)


DTYPES = ("auto", "stored", "float32", "bfloat16", "float16")
"""What ``load_model(dtype=)`` accepts; None means "auto"."""


def compute_dtype(dtype: str | None, platform: str) -> str | None:
    """The dtype a model loaded with ``dtype`` computes in on ``platform`` ("cpu", "gpu",
    "tpu"), or None for the checkpoint's own.

    "auto" (or None): float32 on CPU, the checkpoint's dtype elsewhere. On a CPU without native
    bfloat16 arithmetic XLA converts the weights inside every step (the bundled target's decode
    step: 1.40x as long, docs/performance.md#dtype); GPUs and TPUs compute in bfloat16 natively,
    in half the memory. "stored" keeps the checkpoint's dtype everywhere; a dtype name (or a
    dtype object, jnp.float32) casts to it."""
    if dtype is not None and not isinstance(dtype, str):  # jnp.float32, np.dtype("bfloat16")
        try:
            dtype = jnp.dtype(dtype).name
        except TypeError:
            pass  # refused below, by its own repr
    if dtype is not None and dtype not in DTYPES:
        shown = repr(dtype)
        if len(shown) > 80:  # a model or an array passed where the dtype goes: name its type
            shown = f"a {type(dtype).__module__}.{type(dtype).__qualname__}"
        raise ValueError(f"dtype must be one of {', '.join(map(repr, DTYPES))} or None, "
                         f"got {shown}")
    if dtype in (None, "auto"):
        return "float32" if platform == "cpu" else None
    return None if dtype == "stored" else dtype


def load_model(path: str | os.PathLike, dtype: str | None = None, *, mesh=None,
               replicate: bool = False) -> Model:
    """Load a model folder: a Hugging Face folder (``config.json`` plus ``model.safetensors`` or a
    sharded ``model.safetensors.index.json``) or a folder written by ``save_model``.

    dtype: None or "auto" computes in float32 on CPU and in the checkpoint's dtype on GPU and TPU
    (the platform of ``mesh``'s devices, else JAX's default backend); "stored" keeps the
    checkpoint's dtype; "float32", "bfloat16" or "float16" casts. Sampling and verification
    always work on float32 probabilities, whatever the model computes in.
    Architectures: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
    GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM, and the language
    model of a Gemma3ForConditionalGeneration (docs/checkpoints.md).
    mesh: an ``sj.make_mesh`` mesh places the parameters straight into the sharded layout of
    specjax/sharding.py (``replicate=True``: a full copy per device, for drafts): orbax restores
    each device's shards directly; Hugging Face tensors are read one at a time and each device
    receives only its slice.
    """
    folder = pathlib.Path(path)
    if mesh is not None:
        from .sharding import check_mesh
        check_mesh(mesh)
    platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    dtype = compute_dtype(dtype, platform)
    files.recover_folder(folder)  # a save cut between its two renames (not on Linux)
    if folder.is_file():
        raise FileNotFoundError(f"{folder} is a file: give the model folder that holds it "
                                f"({folder.parent})")
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    if (folder / SPECJAX_FILE).exists():
        return _load_orbax(folder, dtype, mesh, replicate)
    if (folder / "config.json").exists():
        if mesh is None:  # one parameter at a time on the host
            return _load_hf(folder, dtype,
                            lambda path, shape, fetch, cfg: jax.device_put(fetch(None)))
        from jax.sharding import NamedSharding, PartitionSpec

        from .sharding import param_spec

        def place(path, shape, fetch, cfg):
            if replicate:  # read once, a full copy on every device
                return jax.device_put(fetch(None), NamedSharding(mesh, PartitionSpec()))
            s = NamedSharding(mesh, param_spec("/".join(path), cfg, mesh.shape["model"]))
            return jax.make_array_from_callback(shape, s, fetch)  # each device reads its part
        return _load_hf(folder, dtype, place)
    raise FileNotFoundError(f"{folder} holds neither a Hugging Face model (config.json) nor a "
                            f"specjax checkpoint ({SPECJAX_FILE})")


def save_model(model: Model, path: str | os.PathLike, format: str = "orbax", *,
               bos_token_id: int | None = None,
               eos_token_id: int | list[int] | None = None, tokenizer=None,
               dtype: str | None = None) -> None:
    """Save a model folder. format="orbax": params through orbax plus ``specjax.json``;
    format="hf": ``config.json`` and ``model.safetensors`` that ``transformers`` loads as is. Both:
    ``generation_config.json`` when BOS/EOS ids are given, or a tokenizer has them. With
    ``tokenizer=`` (an ``sj.Tokenizer``): also ``tokenizer.json`` and ``tokenizer_config.json``,
    so ``transformers.AutoTokenizer``, ``sj.load_tokenizer`` and ``specjax generate --target``
    read the folder. The new save replaces an earlier one (of either format) in one atomic swap:
    interrupted at any point, the folder holds the complete earlier save or the complete new one
    (``specjax/files.py``). Files of the user's in the folder (a README, a tokenizer when none is
    given) are kept, and so are the BOS/EOS ids the earlier save recorded when none are given
    (in ``generation_config.json``, written in both formats). A folder that is a symbolic
    link is saved where it points.

    dtype: store the parameters in this dtype ("float32", "bfloat16", "float16" or a dtype
    object); None stores them as the model holds them (a bfloat16 checkpoint loaded on a CPU
    computes in float32 and so saves twice its size unless given "bfloat16")."""
    folder = pathlib.Path(path)
    if dtype is not None:
        try:  # compute_dtype's own message would offer "auto" and "stored", refused here
            name = compute_dtype(dtype, "cpu")
        except ValueError:
            name = None
        if name is None or (isinstance(dtype, str) and dtype in ("auto", "stored")):
            raise ValueError(f"save_model's dtype must be 'float32', 'bfloat16', 'float16' or "
                             f"None, got {dtype!r}")
        if isinstance(model, Model):
            model = cast(model, name)
    if tokenizer is not None:
        from .tokenizer import Tokenizer, save_tokenizer
        if not isinstance(tokenizer, Tokenizer):
            raise ValueError(f"tokenizer must be an sj.Tokenizer (sj.load_tokenizer), got "
                             f"{type(tokenizer).__name__}")
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the "
                             f"model's vocab_size {model.config.vocab_size}")
        if bos_token_id is None:
            bos_token_id = tokenizer.bos_token_id
        if eos_token_id is None and tokenizer.eos_token_ids:
            eos_token_id = list(tokenizer.eos_token_ids)
            eos_token_id = eos_token_id[0] if len(eos_token_id) == 1 else eos_token_id
    if format not in ("orbax", "hf"):
        raise ValueError(f"format must be 'orbax' or 'hf', got {format!r}")
    if not isinstance(model, Model):
        raise ValueError(f"save_model expects an sj.Model, got {type(model).__name__} (for a "
                         f"draft model with a draft vocabulary, save its .model and the vocabulary "
                         f"ids beside it as draft_vocab.npy)")
    cfg = model.config
    if bos_token_id is None and eos_token_id is None and tokenizer is None:
        try:  # a save over a save keeps them, unless they are not this model's tokens
            bos_token_id, eos_token_id = _check_ids(*_folder_ids(folder), cfg.vocab_size)
        except ValueError:
            pass
    bos_token_id, eos_token_id = _check_ids(bos_token_id, eos_token_id, cfg.vocab_size)
    arch = hf_architecture(cfg) if format == "hf" else None  # refuse before writing anything
    with files.replace_folder(folder, _model_file) as tmp:
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp, cfg.max_position_embeddings)
        if bos_token_id is not None or eos_token_id is not None:  # load_tokenizer reads them
            generation = {k: v for k, v in (("bos_token_id", bos_token_id),
                                            ("eos_token_id", eos_token_id)) if v is not None}
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if format == "orbax":
            with _orbax().StandardCheckpointer() as ckpt:  # waits for its threads, even when
                ckpt.save((tmp / "params").resolve(), model.params, force=True)  # interrupted
            meta = {"format": "specjax", "version": ORBAX_VERSION,
                    "config": dataclasses.asdict(model.config)}
            (tmp / SPECJAX_FILE).write_text(json.dumps(meta, indent=2) + "\n")
            return
        hf = config_to_hf(cfg)
        assert hf["architectures"] == [arch]
        if bos_token_id is not None:
            hf["bos_token_id"] = bos_token_id
        if eos_token_id is not None:
            hf["eos_token_id"] = eos_token_id
        tensors = {}
        for path_, leaf in _leaves(model.params):
            leaf = np.asarray(jax.device_get(leaf))
            name, transpose = hf_name(path_)
            tensors[name] = leaf.T if transpose else leaf
        write_safetensors(tmp / "model.safetensors", tensors)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def _folder_ids(folder: pathlib.Path) -> tuple[Any, Any]:
    """The BOS and EOS ids a model folder records (config.json, then generation_config.json
    over it, as load_tokenizer reads them); (None, None) where it records none. Its
    generation_config.json is the save's own, replaced by the next: without this a save over an
    earlier one (an HF folder converted in place) lost the EOS ids its tokenizer needs."""
    bos = eos = None
    for name in ("config.json", "generation_config.json"):
        f = folder / name
        if f.is_file():
            record = files.read_json_object(f)
            bos = record.get("bos_token_id", bos)
            eos = record.get("eos_token_id", eos)
    return bos, eos


def _check_ids(bos, eos, vocab_size: int) -> tuple[Any, Any]:
    """BOS and EOS ids as plain ints (EOS: one, or a list), or None; each a token of the
    model."""
    def checked(name, value, many):
        if value is None:
            return None
        ids = list(value) if many and isinstance(value, (list, tuple)) else [value]
        if not ids or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool)
                              and 0 <= i < vocab_size for i in ids):
            raise ValueError(f"{name} must be {'token ids' if many else 'a token id'} in "
                             f"[0, {vocab_size}), got {value!r}")
        return [int(i) for i in ids] if isinstance(value, (list, tuple)) else int(value)
    return checked("bos_token_id", bos, False), checked("eos_token_id", eos, True)


def _model_file(name: str) -> bool:
    """Whether a folder entry belongs to a save of either format (replaced by the next save,
    so stale weights can never be loaded); anything else in the folder is the user's."""
    return name in (SPECJAX_FILE, "config.json", "generation_config.json", "model.safetensors",
                    "model.safetensors.index.json", "params") or (
        name.startswith("model-") and name.endswith(".safetensors"))
