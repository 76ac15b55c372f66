"""Sharded runs: a ("data", "model") device mesh and where every array lives on it.

The target is split tensor-parallel over "model" (attention heads and MLP width, Megatron style:
column-parallel in, row-parallel out, one all-reduce per block), the batch over "data". JAX's SPMD
partitioner does the rest: ``generate`` runs the same program with sharded inputs.

Every array dimension has a logical name (``PARAM_AXES``, ``CACHE_AXES``), and one table maps the
names to mesh axes (``RULES``; pass another as ``rules=`` to ``shard``, ``param_shardings`` or
``cache_spec`` to try another layout). With the default table, one line per parameter (shapes
as in specjax/model.py, <i> the layer)::

    parameter                            shape          spec
    embed_tokens/embedding               [V, E]         (model, -)      vocabulary rows split
    layers/<i>/*_layernorm/weight        [E]            replicated
    layers/<i>/self_attn/q_proj/kernel   [E, H*D]       (-, model)      query heads split
    layers/<i>/self_attn/k_proj/kernel   [E, K*D]       (-, model)      kv heads split (replicated
    layers/<i>/self_attn/v_proj/kernel   [E, K*D]       (-, model)        when K % model != 0)
    layers/<i>/self_attn/{q,k,v}_proj/bias [*]          (model,)        as their kernels
    layers/<i>/self_attn/o_proj/kernel   [H*D, E]       (model, -)      row-parallel
    layers/<i>/self_attn/o_proj/bias     [E]            replicated
    layers/<i>/self_attn/{q,k}_norm/weight [D]          replicated
    layers/<i>/mlp/{gate,up}_proj/kernel [E, F]         (-, model)      MLP width split
    layers/<i>/mlp/down_proj/kernel      [F, E]         (model, -)      row-parallel
    norm/weight                          [E]            replicated
    lm_head/kernel                       [E, V]         (-, model)      vocabulary columns split

    KV cache k, v                        [L, B, K, S, D] (-, data, model, -, -)  as k_proj
    per-row arrays (tokens, lengths, keys, ...)   [B, ...]   (data, ...)

Embedding and LM head are split over the vocabulary rather than replicated: they are the largest
single tensors (V·E each), the LM head's matmul then runs in parallel, and the logits'
all-gather is [B, T, V], small next to the weights. Measured (experiments/sharded_memory.py, a
160M target with a 32k vocabulary on 8 devices): 76 MiB of target weights per device split, 295
MiB with these two replicated. Drafts are small and replicated on every device (``shard(...,
replicate=True)``), so drafting needs no communication at all.
"""

from __future__ import annotations

import numbers
import re
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .config import ModelConfig
from .model import Model

DATA, MODEL = "data", "model"

# Every array dimension has a logical name; RULES maps names to mesh axes, and a name it leaves
# out is replicated. Parameters (path regex over the "/"-joined path, first match wins):
PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed_tokens/embedding$", ("vocab", "embed")),
    (r"layers/\d+/self_attn/q_proj/kernel$", ("embed", "q_heads")),
    (r"layers/\d+/self_attn/[kv]_proj/kernel$", ("embed", "kv_heads")),
    (r"layers/\d+/self_attn/q_proj/bias$", ("q_heads",)),
    (r"layers/\d+/self_attn/[kv]_proj/bias$", ("kv_heads",)),
    (r"layers/\d+/self_attn/o_proj/kernel$", ("q_heads", "embed")),
    (r"layers/\d+/mlp/(gate|up)_proj/kernel$", ("embed", "mlp")),
    (r"layers/\d+/mlp/down_proj/kernel$", ("mlp", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),
)
CACHE_AXES = ("layers", "batch", "kv_heads", "cache", "head_dim")  # KV cache k, v
ROW_AXES = ("batch",)  # per-row arrays [B, ...]: the rest replicated

RULES: dict[str, str] = {"batch": DATA, "vocab": MODEL, "q_heads": MODEL, "kv_heads": MODEL,
                         "mlp": MODEL}
"""The default table: logical axis -> mesh axis (Megatron tensor parallelism over "model")."""


def _sizes(config: ModelConfig) -> dict[str, int]:
    """The size each logical axis is split by: a name whose size does not divide the mesh axis
    is replicated (heads, not head x head_dim, so a head is never cut)."""
    return {"vocab": config.vocab_size, "q_heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads, "mlp": config.intermediate_size,
            "embed": config.hidden_size, "layers": config.num_hidden_layers,
            "head_dim": config.head_dim}


LOGICAL_AXES = frozenset({a for _, axes in PARAM_AXES for a in axes}
                         | set(CACHE_AXES) | set(ROW_AXES))


def check_rules(rules, mesh_shape) -> None:
    """A rules table maps logical axis names (``LOGICAL_AXES``) to axes of the mesh, or to None
    (replicated); a typo on either side would otherwise replicate silently or fail deep in JAX."""
    if not isinstance(rules, dict):
        raise ValueError(f"rules must be a dict of logical axis -> mesh axis, got {rules!r}")
    for name, axis in rules.items():
        if name not in LOGICAL_AXES:
            raise ValueError(f"rules names an unknown logical axis {name!r}; the logical axes "
                             f"are {sorted(LOGICAL_AXES)}")
        if axis is not None and axis not in mesh_shape:
            raise ValueError(f"rules maps {name!r} to {axis!r}, not an axis of the mesh "
                             f"{tuple(mesh_shape)}; use one of them or None (replicated)")


def logical_spec(axes, config: ModelConfig, mesh_shape: dict, rules: dict | None = None) -> P:
    """The PartitionSpec of an array whose dimensions have the logical names ``axes``."""
    if rules is None:
        rules = RULES
    else:
        check_rules(rules, mesh_shape)
    sizes = _sizes(config)
    spec = []
    for name in axes:
        axis = rules.get(name) if name is not None else None
        if axis is not None and name in sizes and sizes[name] % mesh_shape[axis]:
            axis = None
        spec.append(axis)
    return P(*spec) if any(a is not None for a in spec) else P()


def make_mesh(data: int = 1, model: int | None = None, devices=None) -> Mesh:
    """A ("data", "model") mesh over all visible devices (or ``devices``). ``model=None`` takes
    what ``data`` leaves. The axes use automatic sharding propagation (``AxisType.Auto``)."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if n == 0:
        raise ValueError("make_mesh: devices is empty: give at least one device")
    if len({id(d) for d in devices}) < n:
        raise ValueError(f"make_mesh: devices lists a device more than once: {devices!r}")
    for name, value in (("data", data), ("model", model)):
        if value is not None and (isinstance(value, (bool, np.bool_))
                                  or not isinstance(value, numbers.Integral) or value < 1):
            raise ValueError(f"make_mesh: {name} must be an int >= 1, got {value!r}")
    data, model = int(data), None if model is None else int(model)
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


def check_mesh(mesh) -> None:
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != (DATA, MODEL):
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes ('data', 'model') "
                         f"(sj.make_mesh), got {mesh!r}")
    # jax.make_mesh makes Explicit axes by default (JAX 0.7 on); the engine places arrays with
    # sharding constraints, which only Auto axes take
    types = getattr(mesh, "axis_types", None) or ()
    if any(t != jax.sharding.AxisType.Auto for t in types):
        raise ValueError(f"mesh axes must be Auto, got axis_types={tuple(types)!r} (jax.make_mesh "
                         f"makes Explicit ones by default): build it with sj.make_mesh, or "
                         f"jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * 2)")


def param_axes(path: str) -> tuple[str | None, ...]:
    """The logical axis names of one parameter ("/"-joined path); () when all are replicated."""
    for pattern, axes in PARAM_AXES:
        if re.search(pattern, path):
            return axes
    return ()


def param_spec(path: str, config: ModelConfig, model_size: int, rules: dict | None = None,
               data_size: int = 1) -> P:
    """The PartitionSpec of one parameter on a mesh of data_size x model_size devices."""
    return logical_spec(param_axes(path), config, {DATA: data_size, MODEL: model_size}, rules)


def _paths(tree, prefix=()):
    if isinstance(tree, dict):
        return {k: _paths(v, prefix + (k,)) for k, v in tree.items()}
    return "/".join(prefix)


def param_shardings(config: ModelConfig, params_tree, mesh: Mesh, replicate: bool = False,
                    rules: dict | None = None):
    """NamedShardings for a params tree (arrays or ShapeDtypeStructs) of ``config``."""
    check_mesh(mesh)
    sizes = dict(model_size=mesh.shape[MODEL], data_size=mesh.shape[DATA])
    return jax.tree.map(
        lambda path: NamedSharding(mesh, P() if replicate else param_spec(path, config,
                                                                          rules=rules, **sizes)),
        _paths(params_tree))


def shard(model: Model, mesh: Mesh, replicate: bool = False, rules: dict | None = None) -> Model:
    """The model with its parameters placed on the mesh by ``rules`` (default ``RULES``;
    ``replicate=True``: a full copy on every device, for drafts)."""
    if not isinstance(model, Model):
        raise ValueError(f"shard expects an sj.Model, got {type(model).__name__}")
    shardings = param_shardings(model.config, model.params, mesh, replicate, rules)
    return Model(model.config, jax.tree.map(jax.device_put, model.params, shardings))


def placed_on(model: Model, mesh: Mesh) -> bool:
    """Whether every parameter already lives on ``mesh`` (placed by ``shard``, any rules)."""
    return all(isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh
               for x in jax.tree.leaves(model.params))


def cache_spec(config: ModelConfig, mesh: Mesh, rules: dict | None = None) -> P:
    """KV cache [L, B, K, S, D]: rows over "data", kv heads over "model" (when they divide)."""
    spec = logical_spec(CACHE_AXES, config, dict(mesh.shape), rules)
    return spec if len(spec) else P(*([None] * len(CACHE_AXES)))


def rows(mesh: Mesh, ndim: int, rules: dict | None = None) -> NamedSharding:
    """Per-row arrays [B, ...]: split over "data"."""
    if rules is not None:
        check_rules(rules, dict(mesh.shape))
    axis = (RULES if rules is None else rules).get(ROW_AXES[0])
    return NamedSharding(mesh, P(axis, *([None] * (ndim - 1))))


def constrain(x: Any, mesh: Mesh | None, spec: P) -> Any:
    """with_sharding_constraint when running on a mesh; the identity otherwise."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
