"""Why a round with a drafter costs more than its parts timed alone, on a CPU: the parts share
the last-level cache.

A part timed alone (the bench's verify forward, a proposer's propose) repeats in a loop, so
whatever of its weights the CPU cache holds is still there next time. In a round, the drafter's
weights and the target's take turns and evict each other. This times the target's 5-token
verify forward in a loop that also reads N MiB of other memory between forwards, against the
forward alone and the read alone: ``extra`` is what the forward lost to the read.

    python experiments/cache_interference.py
"""

from __future__ import annotations

import pathlib
import statistics
import time

import jax
import jax.numpy as jnp

import specjax as sj
from specjax import timing
from specjax.cache import KVCache
from specjax.model import forward

CKPT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"
INNER = 10


def main() -> None:
    target = sj.load_model(CKPT / "code-target")
    context, T = 400, 5
    cache = KVCache.init(target.config, 1, 1024).rollback(jnp.array([context]))
    tokens = jnp.ones((1, T), jnp.int32)
    positions = context + jnp.arange(T)[None]

    @jax.jit
    def both(params, cache, tokens, other):
        model = sj.Model(target.config, params)

        def body(i, carry):
            tok, c, acc = carry
            logits, _, c = forward(model, tok, positions, c)
            acc = acc + jnp.sum(other * (1 + i.astype(jnp.float32)))  # read all of it
            return sj.sampling.argmax(logits), c.rollback(cache.length), acc
        tok, _, acc = jax.lax.fori_loop(0, INNER, body, (tokens, cache, 0.0))
        return acc + jnp.sum(tok)  # the forwards feed the result: none is dead code

    @jax.jit
    def alone(other):
        return jax.lax.fori_loop(
            0, INNER, lambda i, a: a + jnp.sum(other * (1 + i.astype(jnp.float32))), 0.0)

    def timed(f, *args) -> float:
        f(*args).block_until_ready()
        samples = []
        for _ in range(9):
            t0 = time.perf_counter()
            f(*args).block_until_ready()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples) / INNER * 1e6

    sizes = (0, 2, 8, 16, 32)
    runs: dict[int, list] = {mb: [] for mb in sizes}
    for _ in range(3):  # interleaved repeats
        for mb in sizes:
            other = jnp.ones((max(mb * 262144, 1),), jnp.float32)
            runs[mb].append((timed(both, target.params, cache, tokens, other), timed(alone, other)))
    base = statistics.median(r[0] for r in runs[0])
    print(f"target verify forward ({T} tokens at {context}), float32 weights "
          f"{timing.step_weight_bytes(target) / 2**20:.0f} MiB; medians of 3 repeats x 9")
    for mb in sizes:
        with_read = statistics.median(r[0] for r in runs[mb])
        read = statistics.median(r[1] for r in runs[mb])
        print(f"  {mb:3d} MiB read between forwards: forward + read {with_read:7.0f} µs, "
              f"read alone {read:6.0f} µs, forward alone {base:6.0f} µs: "
              f"extra {with_read - base - read:6.0f} µs ({(with_read - read) / base - 1:+.0%})")


if __name__ == "__main__":
    main()
