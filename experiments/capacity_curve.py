"""What a decode step costs against the cache's capacity and its live length.

The bundled target (float32 unless --dtype), one-token forwards timed INNER at a time inside one
compiled loop (as in the decode loop), medians of interleaved repeats. For each capacity S and
live length n (tokens already in the cache):

* blocked   the attention specjax runs: blocks of ``attention.BLOCK`` slots up to the live length
* dense     one softmax over all S slots (what every step paid before the blocked attention)

Ratios are against the blocked step at the smallest capacity with the same live length.

    .venv/bin/python experiments/capacity_curve.py [--repeats 15] [--dtype float32] [--batch 2]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import specjax as sj
from specjax import attention, timing

CAPACITIES = (128, 256, 512, 1024, 2048, 4096)
LIVE = (64, 2000)
INNER = 16


def step_timer(model, capacity: int, live: int, block: int, batch: int = 1):
    @jax.jit
    def run(params, tokens, cache):
        m = sj.Model(model.config, params)
        positions = cache.length[:, None]

        def body(_, carry):
            tokens, c = carry
            logits, _, c = sj.forward(m, tokens, positions, c, block=block)
            return jnp.argmax(logits, -1).astype(jnp.int32), c.rollback(cache.length)
        return jax.lax.fori_loop(0, INNER, body, (tokens, cache))[0]

    cache = sj.KVCache.init(model.config, batch, capacity).rollback(jnp.full((batch,), live))
    tokens = jnp.ones((batch, 1), jnp.int32)
    run(model.params, tokens, cache).block_until_ready()

    def timed() -> float:
        t0 = time.perf_counter()
        run(model.params, tokens, cache).block_until_ready()
        return (time.perf_counter() - t0) / INNER
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=2,
                        help="also the 64-live curve for this many rows (blocked only)")
    args = parser.parse_args()
    target = sj.load_model(sj.bundled("code-target"), args.dtype)
    timers = {}
    for live in LIVE:
        for S in CAPACITIES:
            if live < S:
                timers[("blocked", live, S)] = step_timer(target, S, live, attention.BLOCK)
                timers[("dense", live, S)] = step_timer(target, S, live, S)
    if args.batch > 1:
        for S in CAPACITIES:
            timers[("batch", 64, S)] = step_timer(target, S, 64, attention.BLOCK, args.batch)
    ms = {k: 1e3 * v for k, v in timing.median_seconds(timers, args.repeats).items()}
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; bundled target in {args.dtype}; "
          f"block {attention.BLOCK} slots; medians of {args.repeats} interleaved repeats")
    print("| live tokens | capacity | blocked step ms | vs smallest | dense step ms | "
          "vs smallest |\n| ---: | ---: | ---: | ---: | ---: | ---: |")
    for live in LIVE:
        sizes = [S for S in CAPACITIES if live < S]
        base_b, base_d = ms[("blocked", live, sizes[0])], ms[("blocked", live, sizes[0])]
        for S in sizes:
            b, d = ms[("blocked", live, S)], ms[("dense", live, S)]
            print(f"| {live} | {S} | {b:.3f} | {b / base_b:.2f}x | {d:.3f} | {d / base_d:.2f}x |")
    if args.batch > 1:
        print("\n| rows | live tokens | capacity | blocked step ms | vs smallest |\n"
              "| ---: | ---: | ---: | ---: | ---: |")
        base = ms[("batch", 64, CAPACITIES[0])]
        for S in CAPACITIES:
            b = ms[("batch", 64, S)]
            print(f"| {args.batch} | 64 | {S} | {b:.3f} | {b / base:.2f}x |")
    b64, b2000 = ms[("blocked", 64, 4096)], ms[("blocked", 2000, 4096)]
    print(f"capacity 4096: a step with 2000 live tokens costs {b2000 / b64:.2f}x the step with 64")


if __name__ == "__main__":
    main()
