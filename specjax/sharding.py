"""Sharded runs: a ("data", "model") device mesh and where every array lives on it.

The target is split tensor-parallel over "model" (attention heads and MLP width, Megatron style:
column-parallel in, row-parallel out, one all-reduce per block), the batch over "data". JAX's SPMD
partitioner does the rest: ``generate`` runs the same program with sharded inputs. The partition
rules, one line per parameter (shapes as in specjax/model.py, layers stacked on a leading L)::

    parameter                        shape          spec
    embed_tokens/embedding           [V, E]         (model, -)      vocabulary rows split
    layers/*_layernorm/weight        [L, E]         replicated
    layers/self_attn/q_proj/kernel   [L, E, H*D]    (-, -, model)   query heads split
    layers/self_attn/k_proj/kernel   [L, E, K*D]    (-, -, model)   kv heads split (replicated
    layers/self_attn/v_proj/kernel   [L, E, K*D]    (-, -, model)     when K % model != 0)
    layers/self_attn/{q,k,v}_proj/bias [L, *]       (-, model)      as their kernels
    layers/self_attn/o_proj/kernel   [L, H*D, E]    (-, model, -)   row-parallel
    layers/self_attn/o_proj/bias     [L, E]         replicated
    layers/self_attn/{q,k}_norm/weight [L, D]       replicated
    layers/mlp/{gate,up}_proj/kernel [L, E, F]      (-, -, model)   MLP width split
    layers/mlp/down_proj/kernel      [L, F, E]      (-, model, -)   row-parallel
    norm/weight                      [E]            replicated
    lm_head/kernel                   [E, V]         (-, model)      vocabulary columns split

    KV cache k, v                    [L, B, S, K, D] (-, data, -, model, -)  as k_proj
    per-row arrays (tokens, lengths, keys, ...)   [B, ...]   (data, ...)

Embedding and LM head are split over the vocabulary rather than replicated: they are the largest
single tensors (V·E each), the LM head's matmul then runs in parallel, and the logits'
all-gather is [B, T, V], small next to the weights. Measured (experiments/sharded_memory.py, a
160M target with a 32k vocabulary on 8 devices): 76 MiB of target weights per device split, 295
MiB with these two replicated. Drafts are small and replicated on every device (``shard(...,
replicate=True)``), so drafting needs no communication at all.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import ModelConfig
from .model import Model

DATA, MODEL = "data", "model"

# (regex over the "/"-joined parameter path, spec); the first match wins.
RULES: tuple[tuple[str, P], ...] = (
    (r"embed_tokens/embedding$", P(MODEL, None)),
    (r"layers/self_attn/[qkv]_proj/kernel$", P(None, None, MODEL)),
    (r"layers/self_attn/[qkv]_proj/bias$", P(None, MODEL)),
    (r"layers/self_attn/o_proj/kernel$", P(None, MODEL, None)),
    (r"layers/mlp/(gate|up)_proj/kernel$", P(None, None, MODEL)),
    (r"layers/mlp/down_proj/kernel$", P(None, MODEL, None)),
    (r"lm_head/kernel$", P(None, MODEL)),
    (r".*", P()),  # norms, o_proj bias: replicated
)
KV_RULE = r"layers/self_attn/[kv]_proj/"  # replicated when kv heads do not divide over "model"


def make_mesh(data: int = 1, model: int | None = None, devices=None) -> Mesh:
    """A ("data", "model") mesh over all visible devices (or ``devices``). ``model=None`` takes
    what ``data`` leaves. The axes use automatic sharding propagation (``AxisType.Auto``)."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    for name, value in (("data", data), ("model", model)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"make_mesh: {name} must be an int >= 1, got {value!r}")
    if model is None:
        if n % data:
            raise ValueError(f"make_mesh: data={data} does not divide the {n} devices")
        model = n // data
    if data * model != n:
        raise ValueError(f"make_mesh: data={data} x model={model} = {data * model} devices, but "
                         f"{n} are visible; choose counts whose product is {n}")
    grid = np.array(devices).reshape(data, model)
    return Mesh(grid, (DATA, MODEL),
                axis_types=(jax.sharding.AxisType.Auto, jax.sharding.AxisType.Auto))


def _check_mesh(mesh) -> None:
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != (DATA, MODEL):
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes ('data', 'model') "
                         f"(sj.make_mesh), got {mesh!r}")


def param_spec(path: str, config: ModelConfig, model_size: int) -> P:
    """The PartitionSpec of one parameter (its "/"-joined path) on a mesh with model_size
    devices on the "model" axis; dimensions that do not divide are replicated."""
    if re.search(KV_RULE, path) and config.num_key_value_heads % model_size:
        return P()
    if re.search(r"self_attn/q_proj", path) and config.num_attention_heads % model_size:
        return P()
    if re.search(r"self_attn/o_proj/kernel", path) and config.num_attention_heads % model_size:
        return P()
    for pattern, spec in RULES:
        if re.search(pattern, path):
            sizes = {"embed_tokens/embedding": config.vocab_size, "lm_head": config.vocab_size,
                     "mlp/": config.intermediate_size}
            for key, size in sizes.items():
                if key in path and size % model_size:
                    return P()
            return spec
    return P()


def _paths(tree, prefix=()):
    if isinstance(tree, dict):
        return {k: _paths(v, prefix + (k,)) for k, v in tree.items()}
    return "/".join(prefix)


def param_shardings(config: ModelConfig, params_tree, mesh: Mesh, replicate: bool = False):
    """NamedShardings for a params tree (arrays or ShapeDtypeStructs) of ``config``."""
    _check_mesh(mesh)
    model_size = mesh.shape[MODEL]
    return jax.tree.map(
        lambda path: NamedSharding(mesh, P() if replicate else param_spec(path, config,
                                                                          model_size)),
        _paths(params_tree))


def shard(model: Model, mesh: Mesh, replicate: bool = False) -> Model:
    """The model with its parameters placed on the mesh by the table above (``replicate=True``:
    a full copy on every device, for drafts)."""
    if not isinstance(model, Model):
        raise ValueError(f"shard expects an sj.Model, got {type(model).__name__}")
    shardings = param_shardings(model.config, model.params, mesh, replicate)
    return Model(model.config, jax.tree.map(jax.device_put, model.params, shardings))


def cache_spec(config: ModelConfig, mesh: Mesh) -> P:
    """KV cache [L, B, S, K, D]: rows over "data", kv heads over "model" (when they divide)."""
    heads = MODEL if config.num_key_value_heads % mesh.shape[MODEL] == 0 else None
    return P(None, DATA, None, heads, None)


def rows(mesh: Mesh, ndim: int) -> NamedSharding:
    """Per-row arrays [B, ...]: split over "data"."""
    return NamedSharding(mesh, P(DATA, *([None] * (ndim - 1))))


def constrain(x: Any, mesh: Mesh | None, spec: P) -> Any:
    """with_sharding_constraint when running on a mesh; the identity otherwise."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
