"""The bundled target's forward with each layer's gate and up projections as one product over
both weights, against two products, both traced in one process.

``experiments/matvec_shapes.py`` found small products on this CPU streaming their weights far
below the machine's bandwidth, and a layer's gate and up taking less time as one product. This
is that change on the real model, without changing the library: a layer's ``gate_proj`` and
``up_proj`` kernels concatenated into one ``gate_up_proj`` kernel and ``specjax.model.MLP``
swapped (while tracing) for a module that runs it and splits its output. It times the one-token
decode step and the five-token verify forward both ways (``timing.forward_timer``, interleaved)
and checks the logits are bitwise the same.

    .venv/bin/python experiments/fused_mlp_ab.py [--repeats 60]
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import statistics

import flax.linen as nn
import jax.numpy as jnp

import specjax as sj
from specjax import model as model_lib
from specjax import timing

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


def fused(target: sj.Model) -> sj.Model:
    """``target`` with each layer's gate and up kernels side by side in one kernel."""
    layers = {}
    for i, layer in target.params["layers"].items():
        mlp = layer["mlp"]
        kernel = jnp.concatenate([mlp["gate_proj"]["kernel"], mlp["up_proj"]["kernel"]], 1)
        layers[i] = {**layer, "mlp": {"gate_up_proj": {"kernel": kernel},
                                      "down_proj": mlp["down_proj"]}}
    return sj.Model(target.config, {**target.params, "layers": layers})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args()
    target = sj.load_model(CKPT / "code-target")
    assert target.config.hidden_act == "silu" and not target.config.sandwich_norms
    variants = {"two products": (target, model_lib.MLP),
                "one product": (fused(target), FusedMLP)}
    separate = model_lib.MLP
    timers, logits = {}, {}
    tokens, positions = jnp.asarray([[5, 6, 7, 8, 9]]), jnp.arange(5)[None]
    try:
        for name, (model, module) in variants.items():
            model_lib.MLP = module  # read when the forward is traced
            for width in (1, 5):
                timers[(name, width)] = timing.forward_timer(model, width, 512, 200)
            logits[name] = model_lib.forward(model, tokens, positions,
                                             sj.KVCache.init(model.config, 1, 64))[0]
    finally:
        model_lib.MLP = separate
    samples = timing.interleaved(timers, args.repeats)
    us = {k: 1e6 * statistics.median(v) for k, v in samples.items()}
    same = bool(jnp.all(logits["two products"] == logits["one product"]))
    print(f"median of {args.repeats} interleaved repeats; logits bitwise the same: {same}")
    for width in (1, 5):
        a, b = us[("two products", width)], us[("one product", width)]
        print(f"  {width}-token forward: two products {a:6.0f} µs, one product {b:6.0f} µs, "
              f"one / two {b / a:.3f}")


if __name__ == "__main__":
    main()
