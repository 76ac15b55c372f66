"""How fast XLA's CPU backend streams weights through a matrix product, by the weight's shape.

The bundled target's decode step reads 48 MiB of weights in about 2.7 ms (18 GB/s, about half of
what ``timing.memory_bandwidth`` measures), although one jitted chain of products over large
weights streams faster than that sum. This times, in one process and interleaved, chains of
products over the same total bytes (about 50 MB, more than the CPU's caches) with weights of
different shapes, at 1 and 5 rows (a decode step, a verify of 5), beside the bandwidth figure
the bench's roofline uses. The target's own shapes (hidden 384, MLP 1024, 2 key/value heads of
64, vocabulary 8,192) are among them. The chains' products depend on each other; a layer's
gate and up projections do not, so last it times twelve such pairs as two products and as one
product over the two weights side by side.

    .venv/bin/python experiments/matvec_shapes.py [--repeats 25]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import timing

SHAPES = [(384, 128), (384, 384), (384, 640), (384, 1024), (384, 2048), (384, 4096),
          (1024, 384), (384, 8192)]
TOTAL = 50 * 2 ** 20


def chain(shape, rows):
    """A jitted chain of products x @ W over weights of ``shape`` totalling about ``TOTAL``
    bytes, each product's input depending on the last (no reordering or overlap)."""
    n = max(1, TOTAL // (4 * shape[0] * shape[1]))
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(n)]
    x = jnp.ones((rows, shape[0]), jnp.float32)

    @jax.jit
    def run(x, weights):
        acc = jnp.float32(0)
        for w in weights:
            acc = acc + (x @ w)[0, 0]
            x = x + 1e-9 * acc
        return acc

    run(x, weights).block_until_ready()
    return (lambda: run(x, weights).block_until_ready()), n * 4 * shape[0] * shape[1], n


def gate_and_up(fused: bool, layers: int = 12, steps: int = 20):
    """``steps`` iterations of a loop over ``layers`` pairs of 384 x 1024 products of the same
    input, as a layer's gate and up projections: two products (independent of each other, so
    free to run side by side) or one over the two weights side by side (bitwise the same
    outputs). Returns a timer of one iteration."""
    rng = np.random.default_rng(1)
    gate = [jnp.asarray(rng.standard_normal((384, 1024), np.float32)) for _ in range(layers)]
    up = [jnp.asarray(rng.standard_normal((384, 1024), np.float32)) for _ in range(layers)]
    both = [jnp.concatenate([g, u], 1) for g, u in zip(gate, up)]
    x = jnp.ones((1, 384), jnp.float32)

    @jax.jit
    def run(x, gate, up, both):
        def body(_, x):
            for k in range(layers):
                y = x @ both[k] if fused else jnp.concatenate([x @ gate[k], x @ up[k]], 1)
                x = x + 1e-9 * y[:, :384] * y[:, 1024:1408]
            return x
        return jax.lax.fori_loop(0, steps, body, x)

    run(x, gate, up, both).block_until_ready()
    return (lambda: run(x, gate, up, both).block_until_ready()), steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args()
    cases = {(shape, rows): chain(shape, rows) for shape in SHAPES for rows in (1, 5)}
    pairs = {fused: gate_and_up(fused) for fused in (False, True)}
    samples = {k: [] for k in cases}
    for _ in range(args.repeats):
        for k, (run, _, _) in cases.items():
            t = time.perf_counter()
            run()
            samples[k].append(time.perf_counter() - t)
        for fused, (run, _) in pairs.items():
            t = time.perf_counter()
            run()
            samples.setdefault(fused, []).append(time.perf_counter() - t)
    bandwidth = timing.memory_bandwidth()
    print(f"jitted sum over 512 MiB: {bandwidth / 1e9:.1f} GB/s (the bench's roofline figure)")
    print(f"median of {args.repeats} interleaved repeats; weight K x N, products in the chain")
    for shape in SHAPES:
        line = f"  {shape[0]:5d} x {shape[1]:5d} ({cases[(shape, 1)][2]:3d})"
        for rows in (1, 5):
            run, nbytes, n = cases[(shape, rows)]
            s = statistics.median(samples[(shape, rows)])
            line += f"   {rows} row{'s' if rows > 1 else ' '}: {1e6 * s / n:7.1f} µs a product, " \
                    f"{nbytes / s / 1e9:5.1f} GB/s"
        print(line)
    apart, fused = (1e6 * statistics.median(samples[f]) / pairs[f][1] for f in (False, True))
    print(f"12 layers of gate and up (384 x 1024 each, one row), µs a step: two products "
          f"{apart:.0f}, one fused product {fused:.0f}")


if __name__ == "__main__":
    main()
