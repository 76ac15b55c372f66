"""The roofline of a target's forward: bytes and FLOPs against what this device measures.

Speculation pays because a forward over a few tokens costs about what a one-token step costs:
both read every weight once, and at small batch reading weights, not arithmetic, sets the time.
That holds until the forward's B × T tokens make it compute-bound (the B(γ + 1) threshold of the
speculative-decoding literature). ``report`` measures where that happens here rather than
assuming it: for each batch B and forward width T it times the target's forward (the cache
filled to ``context`` slots) and sets beside it

* the bytes it must move: every weight a step reads once (``timing.step_weight_bytes``) and the
  cache's keys and values for B rows of ``context`` slots, against the memory bandwidth one
  jitted sum measures (``timing.memory_bandwidth``);
* the FLOPs it must do: 2 per weight per token for the products (the LM head included, the
  input embedding's lookup not), and 4 · heads · head_dim per attended slot per token per layer
  for attention, against the peak one jitted matrix product measures (``peak_flops``).

The knee of batch B is the first width whose forward costs more than 1.25 of that batch's
one-token step: below it verifying γ + 1 = T tokens is nearly free.

    report = sj.roofline.report(target, batches=(1, 8, 32), context=96, capacity=256)
    print(sj.roofline.format_report(report))
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from . import timing
from .config import check_int
from .model import Model

WIDTHS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16)
KNEE = 1.25  # a forward costing more than this many one-token steps is no longer nearly free


def peak_flops(dtype: str = "float32", n: int | None = None, repeats: int = 5) -> float:
    """FLOPs per second of a chain of 8 jitted n × n matrix products in ``dtype`` on the default
    device (n: 1024 on CPU, 8192 elsewhere), median of ``repeats`` after one compiling call: a
    practical peak, as ``timing.memory_bandwidth`` is a practical bandwidth."""
    n = n or (1024 if jax.default_backend() == "cpu" else 8192)
    dt = jnp.dtype(dtype)
    w = (jax.random.normal(jax.random.key(0), (n, n), jnp.float32) / n ** 0.5).astype(dt)

    @jax.jit
    def chain(x, w):
        return jax.lax.fori_loop(0, 8, lambda _, x: x @ w, x)
    x = jnp.ones((n, n), dt)
    timing.timed(chain, x, w)  # compile
    seconds = statistics.median(timing.timed(chain, x, w)[1] for _ in range(repeats))
    return 8 * 2 * n ** 3 / seconds


def forward_cost(model: Model, batch: int, width: int, context: int) -> dict:
    """What one forward of ``width`` tokens for ``batch`` rows must move and compute with the
    cache holding ``context`` slots: weight_bytes, kv_bytes, flops. Activations are left out,
    the float32 logits among them (batch · width · V · 4 bytes, written and read: at batch 32,
    width 16 of a 128,256-token vocabulary about a fifth of a 1B model's weight bytes), so the
    widest cells' bytes are understated."""
    cfg = model.config
    itemsize = jnp.dtype(cfg.dtype).itemsize
    L, K, H, D = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads,
                  cfg.head_dim)
    tokens = batch * width
    product_weights = cfg.num_params - cfg.vocab_size * cfg.hidden_size * (
        0 if cfg.tie_word_embeddings else 1)  # a tied table is the LM head's weights
    attended = context + (width + 1) / 2  # the cache, then the chunk causally
    return dict(weight_bytes=timing.step_weight_bytes(model),
                kv_bytes=batch * L * 2 * K * D * context * itemsize,
                flops=2 * product_weights * tokens + 4 * L * H * D * attended * tokens)


def report(model: Model, *, batches=(1, 8, 32), widths=WIDTHS, context: int = 64,
           capacity: int | None = None, repeats: int = 7, bandwidth: float | None = None,
           flops: float | None = None, log=None) -> dict:
    """Time ``model``'s forward at every (batch, width), interleaved, median of ``repeats``;
    return the grid with its bytes, FLOPs and the fractions of the measured bandwidth and peak
    they reach, each batch's knee, and the measured bandwidth and peak (pass ``bandwidth`` /
    ``flops`` to reuse earlier measurements)."""
    widths = sorted(set(int(w) for w in widths) | {1})
    batches = sorted(set(int(b) for b in batches))
    if min(widths) < 1 or min(batches) < 1:
        raise ValueError(f"batches and widths must be >= 1, got {batches} and {widths}")
    # before anything compiles: a negative context reported negative KV bytes, and no
    # repeats failed after every forward had compiled
    for name, value, low in (("context", context, 0), ("repeats", repeats, 1)):
        check_int(f"roofline report's {name}", value, low)
    capacity = capacity or context + max(widths) + 1
    if context + max(widths) > capacity:
        raise ValueError(f"capacity {capacity} cannot hold context {context} + width "
                         f"{max(widths)}")
    log = log or (lambda msg: None)
    t0 = time.perf_counter()
    timers = {(b, w): timing.forward_timer(model, w, capacity, context, batch=b)
              for b in batches for w in widths}
    log(f"roofline: compiled {len(timers)} forwards in {time.perf_counter() - t0:.0f} s")
    seconds = timing.median_seconds(timers, repeats)
    bandwidth = bandwidth or timing.memory_bandwidth()
    flops = flops or peak_flops(model.config.dtype)
    cells = []
    for b in batches:
        for w in widths:
            cost = forward_cost(model, b, w, context)
            s = seconds[(b, w)]
            cells.append(dict(batch=b, width=w, tokens=b * w, ms=1e3 * s,
                              steps=s / seconds[(b, 1)],  # in this batch's one-token steps
                              bandwidth_fraction=(cost["weight_bytes"] + cost["kv_bytes"])
                              / s / bandwidth,
                              flops_fraction=cost["flops"] / s / flops, **cost))
    knees = {}
    for b in batches:
        over = [c["width"] for c in cells if c["batch"] == b and c["steps"] > KNEE]
        knees[b] = min(over) if over else None
    return dict(context=context, capacity=capacity, dtype=model.config.dtype,
                bandwidth_bytes_per_second=bandwidth, peak_flops_per_second=flops,
                knee_steps=KNEE, knee_width={str(b): k for b, k in knees.items()},
                knee_tokens={str(b): None if k is None else b * k for b, k in knees.items()},
                cells=cells)


def format_report(r: dict) -> str:
    """The report as a table: a row per width, per batch its time, its cost in that batch's
    one-token steps, and the fractions of the bandwidth and of the peak FLOPs it reaches."""
    batches = sorted({c["batch"] for c in r["cells"]})
    widths = sorted({c["width"] for c in r["cells"]})
    cell = {(c["batch"], c["width"]): c for c in r["cells"]}
    lines = [f"roofline ({r['dtype']}, cache at {r['context']} slots): bandwidth "
             f"{r['bandwidth_bytes_per_second'] / 1e9:.1f} GB/s and peak "
             f"{r['peak_flops_per_second'] / 1e12:.2f} TFLOP/s as measured here; per batch: ms, "
             f"cost in that batch's one-token steps, % of bandwidth (weights + KV) / % of peak "
             f"FLOPs", ""]
    col = 28
    lines.append(f"{'width':>5}" + "".join(f"{'batch ' + str(b):>{col}}" for b in batches))
    for w in widths:
        lines.append(f"{w:5d}" + "".join(
            f"{cell[b, w]['ms']:9.2f} {cell[b, w]['steps']:5.2f}x "
            f"{cell[b, w]['bandwidth_fraction']:5.0%}/{cell[b, w]['flops_fraction']:<4.0%}"
            .rjust(col) for b in batches))
    for b in batches:
        knee = r["knee_width"][str(b)]
        lines.append(f"batch {b}: " + (
            f"verifying stops being nearly free (over {r['knee_steps']} steps) at width {knee},"
            f" {b * knee} tokens per forward" if knee else
            f"every width up to {widths[-1]} costs at most {r['knee_steps']} steps"))
    return "\n".join(lines)
