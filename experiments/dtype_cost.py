"""What bfloat16 costs on this machine against float32, and why.

The bundled target and draft (its draft vocabulary), each loaded twice: ``dtype="float32"`` and
``dtype="stored"`` (bfloat16). Timed, as medians of interleaved repeats in one process:

* the target's one-token decode step, its five-token verify forward (γ = 4), the draft's step;
* one matrix product the size of the target's output layer ([T, E] x [E, V]) in float32, in
  bfloat16, and in float32 from bfloat16 weights converted inside the program;
* what one jitted sum over 512 MiB of float32 reads per second, so each decode step is also shown
  as the weight bytes it reads per second against it (the roofline; the input embedding, of which
  a step reads one row, is not counted).

It also counts, in the compiled bfloat16 decode step, the instructions that convert a
weight-sized tensor from bfloat16 to float32: on a CPU without native bfloat16 arithmetic XLA
computes the products in float32 and pays the conversion on every step.

    .venv/bin/python experiments/dtype_cost.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax as sj
from specjax import timing

CAPACITY, CONTEXT = 256, 64


def matmul_timer(T: int, E: int, V: int, dtype: str, upcast: bool = False):
    key = jax.random.key(0)
    w = jax.random.normal(key, (E, V), jnp.dtype(dtype))
    x = jax.random.normal(key, (T, E), jnp.float32 if upcast else jnp.dtype(dtype))

    @jax.jit
    def run(x, w):
        def body(_, x):
            wf = w.astype(jnp.float32) if upcast else w
            y = x @ wf
            return x + y[:, :E].astype(x.dtype) * 1e-6
        return jax.lax.fori_loop(0, timing.INNER, body, x)

    run(x, w).block_until_ready()

    def timed() -> float:
        t0 = time.perf_counter()
        run(x, w).block_until_ready()
        return (time.perf_counter() - t0) / timing.INNER
    return timed


def weight_converts(model) -> int:
    """Instructions of the compiled decode step that write a float32 tensor of at least 64k
    elements named for a conversion (with layers stacked, as when this was first measured, XLA
    fused the slice of a layer's weight with its bfloat16 -> float32 convert:
    "convert_bitcast_fusion")."""
    from specjax.draft.draft_model import as_draft_model
    draft = as_draft_model(model)
    cache = sj.KVCache.init(draft.config, 1, CAPACITY).rollback(jnp.array([CONTEXT]))
    text = timing._chunks.lower(draft, jnp.ones((1, 1), jnp.int32), cache).compile().as_text()
    count = 0
    for dims in re.findall(r"%\S*convert\S* = f32\[([\d,]+)\]", text):
        if np.prod([int(d) for d in dims.split(",")]) >= 65536:
            count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    ckpt = sj.bundled().parent
    models = {d: (sj.load_model(ckpt / "code-target", d),
                  sj.load_draft_model(ckpt / "code-draft", d)) for d in ("float32", "stored")}
    cfg = models["float32"][0].config
    timers = {}
    for d, (target, draft) in models.items():
        name = "bfloat16" if d == "stored" else d
        timers[("decode step", name)] = timing.forward_timer(target, 1, CAPACITY, CONTEXT)
        timers[("verify, 5 tokens", name)] = timing.forward_timer(target, 5, CAPACITY, CONTEXT)
        timers[("draft step", name)] = timing.forward_timer(draft, 1, CAPACITY, CONTEXT)
    E, V = cfg.hidden_size, cfg.vocab_size
    for T in (1, 5):
        label = f"[{T},{E}]x[{E},{V}] product"
        timers[(label, "float32")] = matmul_timer(T, E, V, "float32")
        timers[(label, "bfloat16")] = matmul_timer(T, E, V, "bfloat16")
        timers[(label, "bf16 weights, f32 math")] = matmul_timer(T, E, V, "bfloat16", True)
    medians = timing.median_seconds(timers, args.repeats)
    bw = timing.memory_bandwidth()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind});"
          f" cache {CONTEXT} of {CAPACITY} slots; medians of {args.repeats} interleaved repeats")
    print(f"memory bandwidth (jitted sum over 512 MiB): {bw / 1e9:.1f} GB/s\n")
    print(f"{'what':34} {'variant':24} {'ms':>8} {'x float32':>10}")
    for (what, variant), s in medians.items():
        base = medians[(what, "float32")]
        print(f"{what:34} {variant:24} {s * 1e3:8.3f} {s / base:10.2f}")
    print()
    for d, (target, _) in models.items():
        nbytes = timing.step_weight_bytes(target)
        step = medians[("decode step", "bfloat16" if d == "stored" else d)]
        print(f"target decode step in {target.config.dtype}: {nbytes / 2**20:.1f} MiB of weights, "
              f"{nbytes / step / 1e9:.1f} GB/s = {nbytes / step / bw:.0%} of the roofline; "
              f"bf16->f32 weight converts in the step: {weight_converts(target)}")


if __name__ == "__main__":
    main()
