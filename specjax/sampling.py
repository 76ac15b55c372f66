"""Logits -> the processed float32 distribution used everywhere; sampling from it.

``process_logits`` is the only place where temperature, top-k and top-p are applied. The draft's
q, the target's p in verification, the recovered and bonus tokens and the autoregressive baseline
all come from it, so a draft can never be sampled from one distribution and checked against
another.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array


@dataclasses.dataclass(frozen=True)
class Filters:
    """Which filters the compiled program contains. Static, so a call that uses neither top-k
    nor top-p pays for no vocabulary sort; the filter values themselves are arrays.

    top_k: 0 = no top-k filter; otherwise a static upper bound on every row's top_k, so the
    filter takes ``lax.top_k`` of that many logits instead of sorting the whole vocabulary.
    """

    top_k: int = 0
    top_p: bool = False
    # Every row is greedy (the call's temperature is 0): distributions are one-hots of the argmax,
    # with no softmax, and a draft model proposes its argmax as a point mass instead of sampling.
    greedy: bool = False
    # Every row's top-k is on (generate: all rows share one request's settings), so top-p's
    # threshold always lies among top-k's candidates: no branch to search past them (a branch
    # whose condition, over rows split across devices, is an all-reduce every call). False
    # (rows may turn top-k off): the branch is there.
    top_k_every_row: bool = False

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters as device arrays, all [B]."""

    temperature: Array  # [B] float32; 0 marks a greedy row
    top_k: Array  # [B] int32; 0 = off
    top_p: Array  # [B] float32; 1 = off


def argmax(x: Array) -> Array:
    """The index of the first maximum along the last axis, int32: what ``jnp.argmax`` returns,
    NaN included (a NaN counts as the maximum and the first one wins).

    Computed as a max, then a min over the indices that reach it: two plain reductions, which
    XLA vectorises on CPU, where ``jnp.argmax``'s paired (value, index) reduction is not. Over
    8,192 logits this CPU took 36 µs for one position and 187 µs for five with ``jnp.argmax``,
    3 and 15 µs this way (experiments/results/2026-12-01-round-profile.md)."""
    peak = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    hit = (x == peak) | jnp.isnan(x)  # a NaN peak equals nothing: then the NaNs are the hits
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


# How close the runner-up logit may come to the top one, relative to max(1, |top|), for a greedy
# choice to count as a near tie, by the dtype the model computes in. Forwards of different
# widths (a one-token step, a γ + 1 verify) round their hidden states differently: on the
# bundled target, with logits around 8, the same position's logits differed by up to 1.3e-5 in
# float32 (2^-19 relative) and 0.05 in bfloat16 (2^-7), so a margin below these can fall either
# way. The tolerances sit at or above those; they are measured on one model, not bounds.
TIE_TOLERANCE = {"float32": 2.0 ** -16, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}


def near_ties(logits: Array, dtype: str) -> Array:
    """logits [..., V] (float32) -> [...] bool: whether another logit lies within
    ``TIE_TOLERANCE[dtype] * max(1, |top|)`` of the top one, where the greedy choice depends on
    the forward's rounding (exact ties always go to the smaller id, ``argmax``)."""
    peak = jnp.max(logits, axis=-1, keepdims=True)
    tol = TIE_TOLERANCE[dtype] * jnp.maximum(1.0, jnp.abs(peak))
    return jnp.sum(logits >= peak - tol, axis=-1) >= 2


def _per_row(x: Array, logits: Array) -> Array:
    """[B] -> [B, 1, ..., 1] broadcastable against logits[B, ..., V] without the V axis."""
    return x.reshape(x.shape + (1,) * (logits.ndim - 1 - x.ndim))


def prefix_sum(x: Array, block: int = 32) -> Array:
    """``jnp.cumsum(x, axis=-1)`` in two levels: running sums inside blocks of ``block``, plus
    the running total of the blocks before. XLA's CPU backend lowers a long cumsum to a
    reduce-window whose cost grows with the length times the window (over 1,024 values, most of
    a top-p threshold's time); short ones are cheap. The sums round differently from one
    sequential sum, and stay non-decreasing over non-negative x (each block starts from the
    very value the block before ends on)."""
    *lead, n = x.shape
    if n <= 2 * block:
        return jnp.cumsum(x, axis=-1)
    blocks = jnp.cumsum(jnp.pad(x, [(0, 0)] * len(lead) + [(0, -n % block)]).reshape(
        *lead, -1, block), axis=-1)
    ends = jnp.cumsum(blocks[..., -1], axis=-1)  # the running total at each block's end
    before = jnp.concatenate([jnp.zeros_like(ends[..., :1]), ends[..., :-1]], axis=-1)
    return (blocks + before[..., None]).reshape(*lead, -1)[..., :n]


TOP_P_CANDIDATES = 64
"""Top-p without top-k first looks for its threshold among this many likeliest tokens: one
``lax.top_k``, 15 µs over 8,192 logits on a 2-core CPU (k = 256: 52 µs, 1,024: 208 µs), where
sorting all of them took 1.1-1.3 ms. Only when some row keeps all of them (a flat distribution)
is the threshold searched for over the whole vocabulary (``_top_p_bisected``)."""


def _top_p_bisected(probs: Array, top_p: Array) -> Array:
    """Top-p's threshold over all of probs [..., V] without sorting: the smallest probability v
    whose strictly more likely mass, sum(p for p > v), is below top_p, found by bisection over
    the bit patterns of non-negative float32 (ordered as the integers they read as), 31 passes
    over the vocabulary. That mass is what a sorted list gives before v's first occurrence, so
    this keeps what ``_top_p_threshold`` over the sorted vocabulary keeps (sums in another
    order round apart only where the mass meets top_p within float32 rounding). [..., 1]."""
    def mass_above(bits):
        t = jax.lax.bitcast_convert_type(bits, jnp.float32)[..., None]
        return jnp.sum(jnp.where(probs > t, probs, 0.0), axis=-1)

    def halve(_, bounds):
        lo, hi = bounds  # the answer lies in [lo, hi]; mass_above(hi) < top_p
        mid = lo + (hi - lo) // 2
        below = mass_above(mid) < top_p[..., 0]
        return jnp.where(below, lo, mid + 1), jnp.where(below, mid, hi)

    hi = jax.lax.bitcast_convert_type(jnp.max(probs, axis=-1), jnp.int32)  # mass above: 0
    _, hi = jax.lax.fori_loop(0, 31, halve, (jnp.zeros_like(hi), hi))
    threshold = jax.lax.bitcast_convert_type(hi, jnp.float32)[..., None]
    return jnp.where(top_p >= 1.0, 0.0, threshold)


def _top_p_threshold(descending: Array, peak: Array, total: Array, top_p: Array
                     ) -> tuple[Array, Array]:
    """Top-p's threshold from the likeliest logits, in descending order (all V, or the first n):
    (the smallest kept probability [..., 1], whether it lies among them [...]). A token is kept
    when the mass of strictly more likely tokens is below top_p, ties with the threshold too.
    Over the first n only, the threshold is right unless the n-th is kept as well (covered
    False); with top-k on, any kept token beyond its kmax ties the k-th logit, so the threshold
    found among them is right either way."""
    sorted_probs = jnp.exp(descending - peak) / total
    mass_before = prefix_sum(sorted_probs) - sorted_probs
    keep = mass_before < top_p
    threshold = jnp.min(jnp.where(keep, sorted_probs, jnp.inf), axis=-1, keepdims=True)
    # top_p >= 1 keeps every token, also those beyond the first n
    return jnp.where(top_p >= 1.0, 0.0, threshold), ~keep[..., -1] | (top_p[..., 0] >= 1.0)


def process_logits(logits: Array, params: SamplingArrays,
                   filters: Filters = Filters()) -> Array:
    """Turn logits [B, ..., V] into probabilities [B, ..., V] (float32, rows sum to 1).

    Order: temperature, then top-k, then top-p on the renormalised top-k distribution. Tokens tied
    with the k-th largest logit are all kept (as Hugging Face does), so the result never depends on
    how a sort breaks ties. Greedy rows (temperature == 0) get a one-hot on the first argmax,
    selected by an explicit mask, never through a sentinel temperature. A row's top_k must not
    exceed ``filters.top_k`` (the engine guarantees it); top_k <= 0 or >= V switches it off.
    """
    V = logits.shape[-1]
    if filters.greedy:
        return jax.nn.one_hot(argmax(logits), V, dtype=jnp.float32)
    greedy, _, _, probs, keep = _filtered(logits, params, filters)
    if filters.top_p:
        probs = jnp.where(keep, probs, 0.0)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    one_hot = jax.nn.one_hot(argmax(logits), V, dtype=jnp.float32)
    return jnp.where(greedy, one_hot, probs)


def process_log_probs(logits: Array, params: SamplingArrays,
                      filters: Filters = Filters()) -> Array:
    """The log of ``process_logits``' probabilities [B, ..., V] (float32), computed from the
    scaled logits, so a probability too small for float32 (a low temperature's alternatives,
    e^-250) keeps its value instead of becoming log 0; exactly -inf where top-k or top-p
    filtered the token out. Greedy rows (temperature == 0), whose token is no draw: the model's
    own log-softmax, with the temperature, top-k and top-p they do not use left out."""
    raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    if filters.greedy:
        return raw
    greedy, x, peak, probs, keep = _filtered(logits, params, filters)
    weights = jnp.where(keep, jnp.exp(x - peak), 0.0)  # the peak itself is kept: the sum >= 1
    lp = jnp.where(keep, x - peak - jnp.log(jnp.sum(weights, axis=-1, keepdims=True)), -jnp.inf)
    return jnp.where(greedy, raw, lp)


def _filtered(logits: Array, params: SamplingArrays, filters: Filters):
    """The sampled rows' processing, shared by process_logits and process_log_probs: (greedy
    rows [..., 1], scaled logits x [..., V] with top-k's dropped tokens at -inf, their max,
    softmax(x) before top-p, the tokens kept [..., V])."""
    x = logits.astype(jnp.float32)
    V = x.shape[-1]
    temperature = _per_row(params.temperature, x)[..., None]
    greedy = temperature == 0
    # Shifted by the row's largest logit before dividing: x / T overflows to inf at a tiny T, and
    # XLA may compute x / T in the softmax's element-wise pass with other rounding than in its
    # max (at T = 1e-10 one ulp of x / T is about 8,000, so exp(x / T - max) was inf and the row
    # NaN). Shifted, the largest is exactly 0 on every path and every other value is below it.
    x = (x - jnp.max(x, axis=-1, keepdims=True)) / jnp.where(greedy, 1.0, temperature)
    if filters.top_k:
        kmax = min(filters.top_k, V)
        k = _per_row(params.top_k, x)[..., None]
        off = (k <= 0) | (k >= V)
        top = jax.lax.top_k(x, kmax)[0]  # [B, ..., kmax], descending
        kth = jnp.take_along_axis(top, jnp.clip(k, 1, kmax) - 1, axis=-1)
        kth = jnp.where(off, -jnp.inf, kth)
        x = jnp.where(x < kth, -jnp.inf, x)
        descending = jnp.where(top < kth, -jnp.inf, top)  # the kept logits, largest first
        k_on = ~off[..., 0]  # a row whose top-k is off may keep more than kmax tokens
    elif filters.top_p:  # the likeliest TOP_P_CANDIDATES first (a full sort only if needed)
        descending = jax.lax.top_k(x, min(TOP_P_CANDIDATES, V))[0]
    # One softmax shared by the full and the sorted view, so their values compare exactly.
    peak = jnp.max(x, axis=-1, keepdims=True)
    weights = jnp.exp(x - peak)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / total
    keep = x > -jnp.inf
    if filters.top_p:
        top_p = _per_row(params.top_p, x)[..., None]
        threshold, covered = _top_p_threshold(descending, peak, total, top_p)
        if filters.top_k:  # a row with top-k on keeps at most kmax tokens (and their ties)
            covered = covered | k_on
        if descending.shape[-1] < V and not (filters.top_k and filters.top_k_every_row):
            # Where some row keeps all of its candidates, the threshold may lie beyond them:
            # then every row's is searched for over the whole vocabulary (over top-k's kept
            # tokens, for a row with top-k on: probs has the others at 0).
            threshold = jax.lax.cond(jnp.all(covered), lambda: threshold,
                                     lambda: _top_p_bisected(probs, top_p))
        keep = keep & (probs >= threshold)
    return greedy, x, peak, probs, keep


CDF_BLOCK = 128
"""Tokens per block of ``inverse_cdf``'s two-level search."""


def inverse_cdf(probs: Array, u: Array) -> Array:
    """The first token whose cumulative probability exceeds u times the total: probs [..., V]
    (unnormalised is fine), u [...] in [0, 1) -> [...] int32.

    In two levels: the cumulative mass of blocks of ``CDF_BLOCK`` tokens finds the block, then
    the cumulative sum inside that block (starting from the mass before it) the token. A
    cumulative sum over all V tokens is what XLA's CPU backend does slowly (a reduce-window: 41
    µs for one row of 8,192, 425 µs for 16 rows, against 4 and 64 µs this way). A
    zero-probability token is never drawn: its running sum equals its predecessor's, and a
    block without mass is never chosen (its cumulative mass equals the block before's). Where
    the two levels' sums round apart and the search runs off the chosen block's end, and where
    u times the total rounds up to the total (both of probability ~1e-8), the last token with
    probability in the block (the last block with mass) is drawn."""
    *lead, V = probs.shape
    C = CDF_BLOCK
    if V <= C:
        cdf = jnp.cumsum(probs, axis=-1)
        index = jnp.sum(cdf <= (u * cdf[..., -1])[..., None], axis=-1)
        return jnp.where(index < V, index, argmax(probs)).astype(jnp.int32)
    if V % C:
        probs = jnp.pad(probs, [(0, 0)] * len(lead) + [(0, -V % C)])
    blocks = probs.reshape(*lead, -1, C)
    mass = jnp.sum(blocks, axis=-1)  # [..., NB]
    block_cdf = jnp.cumsum(mass, axis=-1)
    target = u * block_cdf[..., -1]
    below = jnp.sum(block_cdf <= target[..., None], axis=-1)  # blocks wholly below the target
    ids = jax.lax.broadcasted_iota(jnp.int32, mass.shape, mass.ndim - 1)
    b = jnp.where(below < mass.shape[-1], below, jnp.max(jnp.where(mass > 0, ids, 0), axis=-1))
    before = jnp.take_along_axis(block_cdf, jnp.maximum(b - 1, 0)[..., None], axis=-1)[..., 0]
    before = jnp.where(b > 0, before, 0.0)
    inner = jnp.take_along_axis(blocks, b[..., None, None], axis=-2)[..., 0, :]  # [..., C]
    index = jnp.sum(before[..., None] + jnp.cumsum(inner, axis=-1) <= target[..., None], axis=-1)
    slot = jax.lax.broadcasted_iota(jnp.int32, inner.shape, inner.ndim - 1)
    last = jnp.max(jnp.where(inner > 0, slot, 0), axis=-1)
    return (b * C + jnp.where(index < C, index, last)).astype(jnp.int32)


def sample(keys: Array, probs: Array) -> Array:
    """Draw one token per row: keys [B], probs [B, V] -> tokens [B] int32.

    Inverse-CDF sampling (``inverse_cdf``): one uniform per row, then the first token whose
    cumulative probability exceeds it. That costs one random number per draw instead of V Gumbel
    variates (50x faster on a CPU at V = 4096). Each row uses its own key, so a row's draw never
    depends on its neighbours. A zero-probability token is never drawn, which also keeps one-hot
    (greedy) rows exact.
    """
    return inverse_cdf(probs, jax.vmap(jax.random.uniform)(keys))  # u [B] in [0, 1)


def sample_without_replacement(keys: Array, probs: Array, count: int) -> Array:
    """``count`` draws without replacement from each distribution, in the order drawn: keys [B]
    (one per row), probs [B, n, V] -> tokens [B, n, count] int32. Draw c is distributed as probs
    with draws 0..c-1 removed and renormalised: inverse-CDF draws as ``sample``, each drawn
    token's probability zeroed before the next. (Gumbel top-k would take one product, but
    float32 uniforms cap the noise near 16, so tokens below ~1e-7 of the maximum were almost
    never drawn.) Once a distribution's mass is used up, further draws are meaningless (token 0
    or another spent one); callers treat a draw whose probability is zero as not drawn."""
    B, n, V = probs.shape
    u = jax.vmap(lambda k: jax.random.uniform(k, (count, n)))(keys)  # [B, count, n]
    left, draws = probs, []
    for c in range(count):
        index = inverse_cdf(left, u[:, c])  # [B, n]
        draws.append(index)
        left = jnp.where(jax.nn.one_hot(index, V, dtype=bool), 0.0, left)
    return jnp.stack(draws, axis=-1)
