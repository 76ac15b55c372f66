"""What reading a layer out of the stacked KV cache costs: attention over one stacked buffer
[L, B, K, S, D] (as ``KVCache`` holds it) against the same over L separate buffers [B, K, S, D],
in a loop that carries the cache and writes a slot of every layer each step, as a decode loop
does.

XLA's CPU backend passes a product only whole buffers, so ``dynamic_index_in_dim(cache, layer)``
(the dense path) and each block of the blocked walk (``--walk``: one 256-slot block of a
1024-slot cache) are copied out of the stacked buffer before the score and value products read
them; a layer kept in a buffer of its own can be read in place by the dense path. Both variants
compute the same attention (bitwise): L = 6 layers of the bundled target's shape (2 kv heads, 3
query heads each, head size 64), each layer's output feeding the next query, 20 steps a call,
median of 15 interleaved calls; microseconds per layer.

    .venv/bin/python experiments/attention_buffers.py [--batches 1,16] [--widths 1,5] [--walk]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

L, K, S, D, G = 6, 2, 256, 64, 3


def attend(q, k, v):
    w = jax.nn.softmax(jnp.einsum("btkgd,bksd->bkgts", q, k), axis=-1)
    return q + 0.01 * jnp.moveaxis(jnp.einsum("bkgts,bksd->bkgtd", w, v), 3, 1)


def stacked(q, k_all, v_all):  # [L, B, K, S, D]: each layer copied out first
    for layer in range(L):
        q = attend(q, jax.lax.dynamic_index_in_dim(k_all, layer, 0, False),
                   jax.lax.dynamic_index_in_dim(v_all, layer, 0, False))
    return q


def separate(q, ks, vs):  # L buffers [B, K, S, D]: read in place
    for layer in range(L):
        q = attend(q, ks[layer], vs[layer])
    return q


def walk_stacked(q, k_all, v_all, start):  # one 256-slot block of a 1024-slot stacked cache
    for layer in range(L):
        q = attend(q, jax.lax.dynamic_slice(k_all, (layer, 0, 0, start, 0), (1, *q_rows(q)))[0],
                   jax.lax.dynamic_slice(v_all, (layer, 0, 0, start, 0), (1, *q_rows(q)))[0])
    return q


def walk_separate(q, ks, vs, start):
    for layer in range(L):
        q = attend(q, jax.lax.dynamic_slice(ks[layer], (0, 0, start, 0), q_rows(q)),
                   jax.lax.dynamic_slice(vs[layer], (0, 0, start, 0), q_rows(q)))
    return q


def q_rows(q):
    return (q.shape[0], K, S, D)  # a block of S slots


def _write(buf, new, slot, layer=None):
    """new [B, K, D] into slot ``slot`` of a layer (of a stacked buffer when ``layer`` given)."""
    if layer is None:
        return jax.lax.dynamic_update_slice(buf, new[:, :, None], (0, 0, slot, 0))
    return jax.lax.dynamic_update_slice(buf, new[None, :, :, None], (layer, 0, 0, slot, 0))


def chained(f, separate_buffers):
    """20 steps, each writing the query's first head into every layer's slot i (so the cache is
    carried and changes, as in a decode loop, and nothing is loop-invariant), then attending."""
    def step(i, carry):
        x, k, v = carry
        new = x[:, 0, :, 0]  # [B, K, D]
        if separate_buffers:
            k = tuple(_write(b, new, i) for b in k)
            v = tuple(_write(b, new, i) for b in v)
        else:
            for layer in range(L):
                k, v = _write(k, new, i, layer), _write(v, new, i, layer)
        return f(x, k, v, *rest), k, v
    rest = ()

    def run(q, k, v, *a):
        nonlocal rest
        rest = a
        return jax.lax.fori_loop(0, 20, step, (q, k, v))  # the cache returned: updated in place
    return jax.jit(run, donate_argnums=(1, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--widths", default="1,5", help="query tokens a forward (1: a decode step)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--walk", action="store_true",
                    help="the blocked walk's case: one block read from a 4-block cache")
    args = ap.parse_args()
    for B in map(int, args.batches.split(",")):
        for T in map(int, args.widths.split(",")):
            slots = 4 * S if args.walk else S
            k = jax.random.normal(jax.random.key(0), (L, B, K, slots, D))
            v = jax.random.normal(jax.random.key(1), (L, B, K, slots, D))
            q = jax.random.normal(jax.random.key(2), (B, T, K, G, D))
            start = (jnp.int32(0),) if args.walk else ()
            def args_of(name, q=q, k=k, v=v, start=start):  # fresh buffers each call (donated)
                if name == "stacked":
                    return q, k + 0, v + 0, *start
                return q, tuple(k + 0), tuple(v + 0), *start
            runs = {"stacked": chained(walk_stacked if args.walk else stacked, False),
                    "separate": chained(walk_separate if args.walk else separate, True)}
            outs = {name: f(*args_of(name))[0].block_until_ready() for name, f in runs.items()}
            same = bool(jnp.array_equal(outs["stacked"], outs["separate"]))
            times = {name: [] for name in runs}
            for _ in range(args.repeats):
                for name, f in runs.items():
                    a = jax.block_until_ready(args_of(name))
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(*a))
                    times[name].append((time.perf_counter() - t0) / 20 / L * 1e6)
            st, se = (statistics.median(times[n]) for n in ("stacked", "separate"))
            print(f"batch {B:3d}, {T} query tokens: stacked {st:7.1f} µs a layer, separate "
                  f"{se:7.1f} µs (÷ {se / st:.2f}); bitwise the same: {same}")


if __name__ == "__main__":
    main()
