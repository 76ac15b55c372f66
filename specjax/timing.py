"""Timing for benchmarks and experiments: one forward of a chunk, and interleaved medians.

Timings on a shared or noisy machine mean little on their own: compare variants timed in the
same process, interleaved (``median_seconds``), and report ratios beside the baseline.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import sampling
from .cache import KVCache
from .config import check_int

INNER = 16  # forwards per timed call: one dispatch is amortised, as inside the decode loop


@jax.jit
def _chunks(draft, tokens, cache: KVCache):
    """INNER dependent forwards of a T-token chunk at the same cache slots, in one program."""
    T = tokens.shape[1]
    positions = cache.length[:, None] + jnp.arange(T)[None, :]

    def body(_, carry):  # the cache is carried, so its writes happen in place as in generate
        tokens, c = carry
        logits, c = draft.logits(tokens, positions, c)  # a draft's own vocabulary
        return sampling.argmax(logits), c.rollback(cache.length)
    return jax.lax.fori_loop(0, INNER, body, (tokens, cache))[0]


def forward_timer(model, T: int, capacity: int, context: int,
                  batch: int = 1) -> Callable[[], float]:
    """A function timing one T-token forward (seconds) of ``model`` (an sj.Model, or an
    sj.DraftModel, which computes only its draft vocabulary's logits) for ``batch`` rows with
    the cache filled to ``context`` slots of ``capacity``. Compiles before returning."""
    from .draft.draft_model import as_draft_model
    for name, value, low in (("T", T, 1), ("capacity", capacity, 1), ("context", context, 0),
                             ("batch", batch, 1)):
        check_int(f"forward_timer's {name}", value, low)
    if context + T > capacity:  # the writes past the end would be dropped: another computation
        raise ValueError(f"forward_timer: context {context} + T {T} tokens do not fit a cache "
                         f"of capacity {capacity}")
    draft = as_draft_model(model)
    cache = KVCache.init(draft.config, batch, capacity).rollback(jnp.full((batch,), context))
    tokens = jnp.ones((batch, T), jnp.int32)
    # compiled ahead of time and held here, so clearing jax's caches never recompiles it
    chunks = _chunks.lower(draft, tokens, cache).compile()
    chunks(draft, tokens, cache).block_until_ready()

    def run() -> float:
        t0 = time.perf_counter()
        chunks(draft, tokens, cache).block_until_ready()
        return (time.perf_counter() - t0) / INNER
    return run


def timed(fn: Callable, *args, **kwargs) -> tuple[object, float]:
    """(fn(*args, **kwargs) with every array in it ready, wall seconds)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return out, time.perf_counter() - t0


def interleaved(timers: dict, repeats: int) -> dict[object, list[float]]:
    """Each timer (a function returning seconds) called ``repeats`` times, round-robin, so slow
    phases of the machine hit every variant alike. Returns the samples per timer."""
    samples = {k: [] for k in timers}
    for _ in range(repeats):
        for k, f in timers.items():
            samples[k].append(f())
    return samples


def median_seconds(timers: dict, repeats: int) -> dict:
    """Median of interleaved repeats of each timer."""
    return {k: statistics.median(v) for k, v in interleaved(timers, repeats).items()}


def step_weight_bytes(model) -> int:
    """Bytes of weights one decode step of ``model`` (an sj.Model) reads: every parameter but an
    untied input embedding, of which a step reads one row per token."""
    total = sum(x.nbytes for x in jax.tree.leaves(model.params))
    if model.config.tie_word_embeddings:  # the table is read whole, as the LM head
        return total
    return total - model.params["embed_tokens"]["embedding"].nbytes


def memory_bandwidth(mib: int = 512, repeats: int = 9) -> float:
    """Bytes per second the default device reads in one jitted sum over ``mib`` MiB of float32,
    median of ``repeats`` (after one compiling call): a practical figure for what a forward can
    stream, not the hardware's peak (one reduction may not use every core or channel)."""
    x = jnp.ones((mib * 2 ** 20 // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    timed(total, x)  # compile
    return x.nbytes / statistics.median(timed(total, x)[1] for _ in range(repeats))


def _repeated(stage: str):
    """INNER back-to-back calls of one round's ``stage`` ("round": the whole round_step,
    "propose": the proposer's propose alone) from the same state, in one program. Each call
    starts where the first did (length, history, keys; caches roll back to the length), so
    every call does the same work, and the carried caches are written in place as in
    ``generate``'s loop."""
    import dataclasses

    from . import engine

    def run(plan, width, target_params, draft_params, request, state):
        if stage == "propose":
            keys, _ = engine.round_keys(request.keys, state.step)

            def body(_, carry):
                draft_state, total = carry
                s = dataclasses.replace(state, draft_state=draft_state)
                draft, draft_state = engine._propose(plan, target_params, draft_params,
                                                     request, s, keys)
                # The drafts (tokens, q, valid) feed the result: a proposer whose state
                # does not change (n-gram, Medusa) would otherwise be dead code.
                for x in jax.tree.leaves(draft):
                    total = total + jnp.sum(x.astype(jnp.float32))
                return draft_state, total
            return jax.lax.fori_loop(0, INNER, body,
                                     (state.draft_state, jnp.zeros((), jnp.float32)))

        def body(_, carry):
            s, total = carry
            out = engine.round_step(plan, target_params, draft_params, request, s, width)
            # What the round decided feeds the result, so none of it is dead code.
            for x in jax.tree.leaves((out.history, out.length, out.num_generated, out.done,
                                      out.counters)):
                total = total + jnp.sum(x.astype(jnp.int32))
            return dataclasses.replace(
                out, history=state.history, length=state.length,
                num_generated=state.num_generated, done=state.done,
                cache=out.cache.rollback(state.length), counters=state.counters,
                step=state.step, pending=state.pending, idle=state.idle), total
        return jax.lax.fori_loop(0, INNER, body, (state, jnp.zeros((), jnp.int32)))
    # the plan's attention block; width: as round_step's
    return jax.jit(engine._with_blocks(run), static_argnums=(0, 1))


_REPEATED = {stage: _repeated(stage) for stage in ("round", "propose")}


def round_timers(target, prompt, *, sampling, spec=None, draft=None, proposer=None,
                 decoded: int = 64, key=0, max_cache_len: int | None = None,
                 allow_synthetic: bool = False, batch: int = 1, switch: bool = False,
                 width: int | None = None) -> dict[str, Callable[[], float]]:
    """Functions timing (seconds per call) one round of ``sj.generate``'s own program for the
    single row ``prompt`` after ``decoded`` tokens of it have been generated (so the caches hold
    prompt + decoded tokens): "round" is the whole round (propose, the target's verify forward,
    verification, bookkeeping; with no spec, one autoregressive step), "propose" the proposer's
    part alone (absent with no spec). Arguments as ``generate``'s (``sampling.max_new_tokens``
    must leave room for ``decoded`` tokens and a round). ``batch``: that many copies of the
    row, each with its own key. ``switch``: a chain with per-row lengths chooses the round's
    verify width inside the round (``engine.round_step`` with no width) instead of verifying
    at the width generate's loop picks for its drafts. ``width``: such a chain's round verifies
    at this width (one of ``engine.loop_widths(γ)``) whatever its drafts' lengths. Compiles
    before returning."""
    from . import engine

    rows, sampling, plan, target, draft_params, inputs = engine._prepare(
        target, [prompt] * batch, sampling, spec, draft, proposer, key, None, False, None,
        max_cache_len, allow_synthetic)
    params = target.params
    state = engine._STAGES["prefill"](plan, params, draft_params, inputs.prompts, inputs.lengths,
                                      inputs.request)
    def behind(state):  # rows still generating that have not reached ``decoded`` tokens
        done, generated = np.asarray(state.done[:batch]), np.asarray(state.num_generated[:batch])
        return bool(np.any(~done & (generated < decoded))), bool(done.all())

    while behind(state)[0]:
        state = engine._STAGES["round"](plan, params, draft_params, inputs.request, state)
    if behind(state)[1]:  # (finished rows still run in a batch's rounds: only all-done stops)
        raise ValueError(f"every row ended (EOS or max_new_tokens) before {decoded} tokens "
                         f"were decoded: nothing left to time")
    args = (params, draft_params, inputs.request, state)
    stages = ["round"] + (["propose"] if plan.proposer is not None else [])
    widths = engine.loop_widths(plan.gamma)
    if width is not None and (state.pending is None or switch or width not in widths):
        raise ValueError(f"width={width}: only a chain with per-row lengths (not switch=True) "
                         f"verifies at a chosen width, one of {list(widths)}")
    if width is None and state.pending is not None and not switch:
        # the width generate's loop verifies these pending drafts over
        width = widths[int(engine.verify_width(plan, state))]
    timers = {}
    for stage in stages:
        exe = _REPEATED[stage].lower(plan, width, *args).compile()
        timed(exe, *args)  # one run before any is timed, as forward_timer's

        def run(exe=exe) -> float:
            return timed(exe, *args)[1] / INNER
        run.executable = exe  # for inspection (cost_analysis(), as_text())
        run.width = width  # the verify width a per-row-length chain's round runs at (else None)
        timers[stage] = run
    return timers
