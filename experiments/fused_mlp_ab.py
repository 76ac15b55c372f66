"""The bundled target's and draft's forwards with each layer's projections fused (gate and up as
one product; with ``--qkv`` also q, k and v as one), against the model as it is, in one process.

``experiments/matvec_shapes.py`` found small products on this CPU streaming their weights far
below the machine's bandwidth, and a layer's gate and up taking less time as one product. This
is that change on the real models, without changing the library: the kernels concatenated along
their output axis (``gate_up_proj``, ``qkv_proj``) and ``specjax.model.MLP`` (and with ``--qkv``
``specjax.model.Attention``) swapped while tracing for modules that run one product and split its
output. It times one-token forwards (a decode step) and wider ones (a verify; the draft's
catch-up) both ways (``timing.forward_timer``, interleaved) and reports whether the logits are
bitwise the same.

    .venv/bin/python experiments/fused_mlp_ab.py [--qkv] [--repeats 60]
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import statistics

import flax.linen as nn
import jax
import jax.numpy as jnp

import specjax as sj
from specjax import attention, timing
from specjax import cache as kv
from specjax import model as model_lib

CKPT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"


class FusedMLP(nn.Module):
    """model.MLP (SiLU) with gate and up as one product over [gate | up]."""

    config: sj.ModelConfig
    init_std: float

    @nn.compact
    def __call__(self, x):
        cfg, F = self.config, self.config.intermediate_size
        dense = functools.partial(model_lib._dense, cfg, self.init_std)
        both = dense(2 * F, "gate_up_proj")(x)
        return dense(cfg.hidden_size, "down_proj")(nn.silu(both[..., :F]) * both[..., F:])


class FusedAttention(model_lib.Attention):
    """model.Attention (no q/k norms) with q, k and v as one product over [q | k | v]."""

    @nn.compact
    def __call__(self, x, cos, sin, view, k_all, v_all, layer, block):
        cfg = self.config
        B, T, _ = x.shape
        H, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        y = model_lib._dense(cfg, self.init_std, (H + 2 * K) * D, "qkv_proj",
                             bias=cfg.attention_bias)(x)
        q = y[..., :H * D].reshape(B, T, H, D)
        k = y[..., H * D:(H + K) * D].reshape(B, T, K, D)
        v = y[..., (H + K) * D:].reshape(B, T, K, D)
        q, k = model_lib.apply_rope(q, cos, sin), model_lib.apply_rope(k, cos, sin)
        k, v = kv.storable(k, v)
        chunk = None
        if view.chunk_in_cache:
            k_all = kv.write_layer(k_all, layer, k, view.length, view.capacity)
            v_all = kv.write_layer(v_all, layer, v, view.length, view.capacity)
        else:
            chunk = (k.astype(k_all.dtype), v.astype(v_all.dtype))
        out = attention.attend(q.reshape(B, T, K, H // K, D), k_all, v_all, layer, view, block,
                               chunk, scale=(cfg.query_pre_attn_scalar or D) ** -0.5,
                               softcap=cfg.attn_logit_softcapping)
        out = model_lib._dense(cfg, self.init_std, cfg.hidden_size, "o_proj",
                               bias=cfg.o_proj_bias)(out.reshape(B, T, H * D))
        return out, k_all, v_all, chunk


def fused(model: sj.Model, qkv: bool) -> sj.Model:
    """``model`` with each layer's gate and up kernels (and q, k, v) side by side in one."""
    def joined(block, names):
        return {"kernel": jnp.concatenate([block[n]["kernel"] for n in names], 1)}
    layers = {}
    for i, layer in model.params["layers"].items():
        mlp, attn = layer["mlp"], layer["self_attn"]
        layers[i] = {**layer, "mlp": {"gate_up_proj": joined(mlp, ("gate_proj", "up_proj")),
                                      "down_proj": mlp["down_proj"]}}
        if qkv:
            layers[i]["self_attn"] = {"qkv_proj": joined(attn, ("q_proj", "k_proj", "v_proj")),
                                      "o_proj": attn["o_proj"]}
    return sj.Model(model.config, {**model.params, "layers": layers})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qkv", action="store_true", help="fuse q, k and v too")
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args()
    models = {"target": (sj.load_model(CKPT / "code-target"), (1, 5, 9)),
              "draft": (sj.load_model(CKPT / "code-draft"), (1, 5))}
    for model, _ in models.values():
        cfg = model.config
        assert cfg.hidden_act == "silu" and not cfg.sandwich_norms and not cfg.qk_norm
    separate = (model_lib.MLP, model_lib.Attention)
    modules = {"apart": separate,
               "fused": (FusedMLP, FusedAttention if args.qkv else model_lib.Attention)}
    timers, logits = {}, {}
    tokens, positions = jnp.asarray([[5, 6, 7, 8, 9]]), jnp.arange(5)[None]
    try:
        for name, (mlp, attn) in modules.items():
            jax.clear_caches()  # the forwards are traced again with the modules swapped
            model_lib.MLP, model_lib.Attention = mlp, attn  # read when a forward is traced
            for who, (model, widths) in models.items():
                m = model if name == "apart" else fused(model, args.qkv)
                for width in widths:
                    timers[(who, width, name)] = timing.forward_timer(m, width, 512, 200)
                logits[(who, name)] = model_lib.forward(m, tokens, positions,
                                                        sj.KVCache.init(m.config, 1, 64))[0]
    finally:
        model_lib.MLP, model_lib.Attention = separate
    samples = timing.interleaved(timers, args.repeats)
    us = {k: 1e6 * statistics.median(v) for k, v in samples.items()}
    fusing = "gate/up and q/k/v" if args.qkv else "gate/up"
    print(f"{fusing} fused; median of {args.repeats} interleaved repeats")
    for who, (_, widths) in models.items():
        same = bool(jnp.all(logits[(who, "apart")] == logits[(who, "fused")]))
        print(f"{who} (logits bitwise the same: {same})")
        for width in widths:
            a, b = us[(who, width, "apart")], us[(who, width, "fused")]
            print(f"  {width}-token forward: apart {a:6.0f} µs, fused {b:6.0f} µs, "
                  f"fused / apart {b / a:.3f}")


if __name__ == "__main__":
    main()
