"""The one processing function against an independent numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ref_process

import specjax as sj
from specjax import sampling

CASES = [  # temperature, top_k, top_p
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (0.7, 5, 0.8), (1.0, 0, 0.5), (0.5, 2, 0.95),
    (0.0, 0, 1.0), (0.0, 3, 0.5), (1.0, 100, 1.0), (2.0, 1, 1.0),
]


def _arrays(B, t, k, p):
    return sampling.SamplingArrays(jnp.full((B,), t, jnp.float32), jnp.full((B,), k, jnp.int32),
                                   jnp.full((B,), p, jnp.float32))


def _filters(k, p, bound="exact"):
    """The static filter set: top-k bound equal to k, or looser (the engine compiles one bound)."""
    kmax = 0 if k <= 0 else (k if bound == "exact" else 64)
    return sampling.Filters(top_k=kmax, top_p=p < 1)


@pytest.mark.parametrize("bound", ["exact", "loose"])
@pytest.mark.parametrize("t,k,p", CASES)
def test_process_matches_reference(t, k, p, bound):
    logits = jax.random.normal(jax.random.key(3), (4, 3, 11)) * 2
    got = sampling.process_logits(logits, _arrays(4, t, k, p), _filters(k, p, bound))
    np.testing.assert_allclose(np.asarray(got), ref_process(logits, t, k, p), atol=1e-6)
    np.testing.assert_allclose(np.asarray(got).sum(-1), 1.0, atol=1e-6)


@pytest.mark.parametrize("p", [1.0, 0.97, 0.5])
def test_ties_at_the_kth_logit_are_kept(p):
    logits = jnp.array([[3.0, 1.0, 1.0, 1.0, 0.0, 1.0]])
    got = sampling.process_logits(logits, _arrays(1, 1.0, 2, p), _filters(2, p))
    want = ref_process(logits, 1.0, 2, p)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)
    if p == 1.0:  # the four tied logits all survive top-2, though only 2 are in lax.top_k's view
        assert np.count_nonzero(np.asarray(got)) == 5


def test_many_ties_against_reference():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.integers(0, 4, size=(64, 10)).astype(np.float32))
    for k, p in [(3, 1.0), (3, 0.8), (5, 0.6), (0, 0.7), (1, 0.9)]:
        got = sampling.process_logits(logits, _arrays(64, 1.0, k, p), _filters(k, p))
        np.testing.assert_allclose(np.asarray(got), ref_process(logits, 1.0, k, p), atol=1e-6,
                                   err_msg=f"k={k} p={p}")


def test_order_is_temperature_then_top_k_then_top_p():
    # top-p before top-k would keep a different set here; the reference fixes the HF/vLLM order.
    logits = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1]]))
    got = np.asarray(sampling.process_logits(logits, _arrays(1, 1.0, 3, 0.6), _filters(3, 0.6)))
    # top-3 renormalised: [.444, .333, .222]; top-p 0.6 keeps the first two
    np.testing.assert_allclose(got, [[4 / 7, 3 / 7, 0, 0]], atol=1e-6)


def test_per_row_parameters_and_greedy_mask():
    logits = jax.random.normal(jax.random.key(0), (3, 9))
    params = sampling.SamplingArrays(jnp.array([0.0, 1.0, 0.5]), jnp.array([0, 2, 0]),
                                     jnp.array([1.0, 1.0, 0.7]))
    got = np.asarray(sampling.process_logits(logits, params, _filters(2, 0.7, "loose")))
    for b, (t, k, p) in enumerate([(0.0, 0, 1.0), (1.0, 2, 1.0), (0.5, 0, 0.7)]):
        np.testing.assert_allclose(got[b], ref_process(logits[b], t, k, p), atol=1e-6)


def test_filters_off_means_no_filtering():
    logits = jax.random.normal(jax.random.key(1), (2, 7))
    got = sampling.process_logits(logits, _arrays(2, 1.0, 0, 1.0))
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.nn.softmax(logits)), atol=1e-6)


@pytest.mark.parametrize("k,p", [(0, 1.0), (5, 0.9)])
def test_tiny_temperatures_give_the_argmax_one_hot(k, p):
    """As T -> 0 the processed distribution tends to a one-hot on the argmax (no ties here), and
    stays a distribution at every T > 0: at T = 1e-10, one ulp of x / T is thousands, and a
    jitted softmax over 1,000 or 2,048 logits computed x / T with other rounding in its
    element-wise pass than in its max, so exp(x / T - max) overflowed and the row became NaN
    (a draft's q at such a temperature: every draft rejected). Down to a subnormal T, where
    x / T itself overflows."""
    process = jax.jit(sampling.process_logits, static_argnums=2)
    rng = np.random.default_rng(5)
    for shape in [(1, 1000), (1, 2048), (2, 3, 8192)]:
        logits = jnp.asarray(rng.standard_normal(shape) * 3, jnp.float32)
        want = np.asarray(jax.nn.one_hot(jnp.argmax(logits, -1), shape[-1]))
        for t in (1e-6, 1e-10, 1e-30, 1e-45):
            B = int(np.prod(shape[:-1]))
            got = np.asarray(process(logits.reshape(B, -1), _arrays(B, t, k, p), _filters(k, p)))
            np.testing.assert_array_equal(got.reshape(shape), want, err_msg=f"{shape} T={t}")


def test_sample_draws_from_the_distribution_with_per_row_keys():
    probs = jnp.array([0.1, 0.6, 0.0, 0.3])
    N = 20000
    keys = jax.random.split(jax.random.key(7), N)
    draws = np.asarray(sampling.sample(keys, jnp.broadcast_to(probs, (N, 4))))
    freq = np.bincount(draws, minlength=4) / N
    assert freq[2] == 0  # a zero-probability token is never drawn
    np.testing.assert_allclose(freq, probs, atol=0.015)
    again = np.asarray(sampling.sample(keys[:5], jnp.broadcast_to(probs, (5, 4))))
    np.testing.assert_array_equal(again, draws[:5])  # a row's draw depends only on its key


def _argmax_mismatches(argmax) -> list[str]:
    """Where ``argmax`` disagrees with numpy's first-maximum argmax: random logits, many ties
    (small integers), rows that are all -inf, NaN anywhere, bfloat16, leading batch axes."""
    rng = np.random.default_rng(0)
    cases = {
        "normal": rng.normal(size=(3, 5, 8192)).astype(np.float32),
        "ties": rng.integers(0, 3, size=(64, 17)).astype(np.float32),
        "all -inf": np.full((2, 9), -np.inf, np.float32),
        "-inf and one finite": np.where(np.arange(9) == 6, 0.5, -np.inf)[None].astype(np.float32),
    }
    nan = rng.normal(size=(6, 11)).astype(np.float32)
    nan[1, 4] = nan[1, 7] = nan[3, 0] = np.nan
    cases["nan"] = nan
    bad = []
    for name, x in cases.items():
        if not np.array_equal(np.asarray(argmax(jnp.asarray(x))), np.argmax(x, axis=-1)):
            bad.append(name)
    x = rng.integers(0, 4, size=(8, 33)).astype(np.float32)
    got = argmax(jnp.asarray(x, jnp.bfloat16))
    if got.dtype != jnp.int32 or not np.array_equal(np.asarray(got), np.argmax(x, axis=-1)):
        bad.append("bfloat16")
    return bad


def test_argmax_is_the_first_maximum_as_numpy_gives_it():
    assert _argmax_mismatches(sampling.argmax) == []


@pytest.mark.parametrize("broken", [
    lambda x: x.shape[-1] - 1 - jnp.argmax(x[..., ::-1], axis=-1),  # the last maximum
    lambda x: jnp.argmax(jnp.nan_to_num(x, nan=-jnp.inf), axis=-1),  # NaN never wins
])
def test_the_argmax_check_catches_broken_variants(broken):
    assert _argmax_mismatches(broken)


def test_sample_without_replacement_draws_in_order():
    """Draw 0 follows q; draw 1, given draw 0, follows q without it, renormalised; no token
    twice; zero-probability tokens only once the mass is used up."""
    q = np.array([0.1, 0.6, 0.0, 0.3])
    N = 20000
    keys = jax.random.split(jax.random.key(9), N)
    draws = np.asarray(sampling.sample_without_replacement(
        keys, jnp.broadcast_to(jnp.asarray(q, jnp.float32), (N, 1, 4)), 3))[:, 0]
    assert draws.shape == (N, 3) and draws.dtype == np.int32
    assert (draws[:, 0] != draws[:, 1]).all() and (draws[:, 1] != draws[:, 2]).all()
    assert (draws[:, 0] != draws[:, 2]).all() and (draws[:, :3] != 2).all()
    np.testing.assert_allclose(np.bincount(draws[:, 0], minlength=4) / N, q, atol=0.012)
    first = draws[:, 0] == 1
    rest = q.copy()
    rest[1] = 0
    np.testing.assert_allclose(np.bincount(draws[first, 1], minlength=4) / first.sum(),
                               rest / rest.sum(), atol=0.02)
    short = np.asarray(sampling.sample_without_replacement(
        keys[:50], jnp.broadcast_to(jnp.array([0.0, 1.0, 0.0, 0.0]), (50, 1, 4)), 2))[:, 0]
    assert (short[:, 0] == 1).all() and (short[:, 1] != 1).all()  # then a zero-probability one


def test_sample_without_replacement_keeps_the_far_tail():
    """Tokens far below the likeliest (5e-8 each, 2e-4 together) are drawn as often as their
    mass says. (Gumbel top-k with float32 uniforms never drew them: its noise stops near 16,
    and they sit 16.8 below in log-probability.)"""
    V, tiny = 4097, 5e-8
    q = np.full(V, tiny)
    q[0] = 1 - tiny * (V - 1)
    q = jnp.asarray(q, jnp.float32)
    # the [20000, 1, V] distributions are built inside the program, not embedded as a constant
    keys = [jax.random.split(jax.random.key(c), 20000) for c in range(5)]
    # compiled with LLVM's optimizations (the suite's -O0, tests/fast_compile.py, runs these
    # 82M-element draws 1.9 s a call; -O1 0.3 s, for 0.2 s more compiling)
    draw = jax.jit(lambda k: sampling.sample_without_replacement(
        k, jnp.broadcast_to(q, (k.shape[0], 1, V)), 1)).lower(keys[0]).compile(
        compiler_options={"xla_backend_optimization_level": 1})
    tail = sum(int(np.sum(np.asarray(draw(k)) != 0)) for k in keys)
    # 100,000 draws x 2.05e-4 = 20.5 expected (Gumbel top-k: 0); a correct sampler lands
    # outside [6, 40] with probability 1e-4 (Poisson)
    assert 6 <= tail <= 40, tail


def _inverse_cdf_cases():
    """Distributions over V = 1000 (not a whole number of blocks) and 8192 tokens with zeros
    where the two-level search could slip: whole blocks without mass, zeros at a block's start
    and end, a block whose only mass is its last token, one-hot rows, mass in the last
    (padded) block only; with uniforms spread over [0, 1), the extremes included."""
    rng = np.random.default_rng(3)
    C = sampling.CDF_BLOCK
    rows = []
    for V in (1000, 8192):
        p = rng.exponential(size=(6, V)) ** 3
        p[0, : 3 * C] = 0  # the first blocks empty
        p[1, C - 2: C + 2] = 0  # zeros around a block boundary
        p[2, :] = 0
        p[2, 2 * C - 1] = 1.0  # a block's last token alone
        p[3, :] = 0
        p[3, V - 1] = 1.0  # one-hot on the very last token
        p[4, np.arange(V) % 3 == 0] = 0
        p[5, : V - 40] = 0  # mass only at the end
        rows.append(p / p.sum(-1, keepdims=True))
    u = np.concatenate([np.linspace(0, 1, 4001, endpoint=False),
                        [1 - 2.0 ** -24, 2.0 ** -24, 0.5 - 2.0 ** -25]]).astype(np.float32)
    return rows, u


def _inverse_cdf_failures(fn):
    """(draws of a zero-probability token, draws unlike a float64 inverse CDF of the same
    uniforms) for ``fn(probs [..., V], u [...])``."""
    rows, u = _inverse_cdf_cases()
    zero, unlike = 0, 0
    for p in rows:
        probs = np.broadcast_to(p[:, None, :], (p.shape[0], u.size, p.shape[1]))
        got = np.asarray(fn(jnp.asarray(probs, jnp.float32), jnp.broadcast_to(u, probs.shape[:2])))
        p32 = p.astype(np.float32).astype(np.float64)
        cdf = np.cumsum(p32, axis=-1)
        want = (cdf[:, None, :] <= (u[None, :, None] * cdf[:, None, -1:])).sum(-1)
        want = np.minimum(want, p.shape[1] - 1)
        zero += int((np.take_along_axis(p32, got, axis=1) == 0).sum())
        unlike += int((got != want).sum())
    return zero, unlike


def test_inverse_cdf_draws_what_a_float64_inverse_cdf_draws():
    """The two-level search (blocks, then tokens in the block) draws, for each uniform, the
    token a float64 cumulative sum over all V gives (two uniforms in 24,000 may fall between
    the two's roundings), and never a token of probability zero. A search that reads the mass
    before a block one block too far fails it."""
    zero, unlike = _inverse_cdf_failures(sampling.inverse_cdf)
    assert zero == 0 and unlike <= 2, (zero, unlike)

    def shifted(probs, u):  # the mass before block b taken as that through block b
        C = sampling.CDF_BLOCK
        V = probs.shape[-1]
        blocks = jnp.pad(probs, [(0, 0)] * (probs.ndim - 1) + [(0, -V % C)]).reshape(
            *probs.shape[:-1], -1, C)
        block_cdf = jnp.cumsum(blocks.sum(-1), -1)
        target = u * block_cdf[..., -1]
        b = jnp.minimum(jnp.sum(block_cdf <= target[..., None], -1), block_cdf.shape[-1] - 1)
        before = jnp.take_along_axis(block_cdf, b[..., None], -1)[..., 0]
        inner = jnp.take_along_axis(blocks, b[..., None, None], -2)[..., 0, :]
        index = jnp.sum(before[..., None] + jnp.cumsum(inner, -1) <= target[..., None], -1)
        return b * C + jnp.minimum(index, C - 1)
    assert _inverse_cdf_failures(shifted)[1] > 1000


def _wide_rows():
    """Logits over 1,000 tokens, per row: peaked (top-p's threshold among the likeliest
    ``TOP_P_CANDIDATES``), flat (beyond them: the whole vocabulary searched), flat with a
    planted tie at the threshold's level and a run of equal logits, and one row of equal
    logits only."""
    rng = np.random.default_rng(5)
    rows = [rng.normal(size=1000) * 6, rng.normal(size=1000) * 0.5,
            np.round(rng.normal(size=1000) * 2) / 2, np.zeros(1000)]
    return jnp.asarray(np.stack(rows)[:, None, :], jnp.float32)  # [4, 1, 1000]


@pytest.mark.parametrize("p", [0.9, 0.5, 0.999, 0.02])
def test_top_p_over_a_wide_vocabulary_matches_the_reference(p):
    """Top-p alone over 1,000 tokens: rows whose threshold lies among the likeliest 64 (found
    from ``lax.top_k``) and rows where it does not (found by bisection over the whole
    vocabulary), with ties at the threshold, against the numpy reference (sorted, float64);
    mixed rows in one call and each row alone agree."""
    logits = _wide_rows()
    assert sampling.TOP_P_CANDIDATES < logits.shape[-1]
    want = ref_process(logits, 0.8, 0, p)
    got = sampling.process_logits(logits, _arrays(4, 0.8, 0, p), _filters(0, p))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)
    assert ((np.asarray(got) > 0) == (want > 0)).all()  # the same tokens kept
    for b in range(4):
        alone = sampling.process_logits(logits[b:b + 1], _arrays(1, 0.8, 0, p), _filters(0, p))
        np.testing.assert_array_equal(np.asarray(alone)[0] > 0, want[b] > 0)


def test_a_bisection_that_counts_the_candidate_as_above_fails_the_reference(monkeypatch):
    """The control: the whole-vocabulary search counting the tokens equal to the candidate
    threshold among the more likely ones (>= for >) keeps too few: the threshold's own tokens
    go, which the reference keeps."""
    def counted_as_above(probs, top_p):
        def halve(_, bounds):
            lo, hi = bounds
            mid = lo + (hi - lo) // 2
            t = jax.lax.bitcast_convert_type(mid, jnp.float32)[..., None]
            below = jnp.sum(jnp.where(probs >= t, probs, 0.0), axis=-1) < top_p[..., 0]
            return jnp.where(below, lo, mid + 1), jnp.where(below, mid, hi)
        hi = jax.lax.bitcast_convert_type(jnp.max(probs, axis=-1), jnp.int32) + 1
        _, hi = jax.lax.fori_loop(0, 31, halve, (jnp.zeros_like(hi), hi))
        return jax.lax.bitcast_convert_type(hi, jnp.float32)[..., None]

    logits, p = _wide_rows(), 0.5
    want = ref_process(logits, 0.8, 0, p) > 0
    monkeypatch.setattr(sampling, "_top_p_bisected", counted_as_above)
    got = sampling.process_logits(logits, _arrays(4, 0.8, 0, p), _filters(0, p))
    assert ((np.asarray(got) > 0) != want).any()


@pytest.mark.parametrize("case", ["top-p-off-row", "top-k-off-row", "both-off-row"])
def test_rows_with_a_filter_off_beside_rows_with_it_on(case):
    """Rows of one call with different settings (SamplingArrays is per row; the static Filters
    say which filters any row uses), over 1,000 tokens, against the numpy reference. Before, a
    row with top_p = 1 beside a top-p row kept only the 64 top-p candidates, and a row with
    top-k off beside a top-k row only kmax tokens (total variation 0.57 on a flat row)."""
    logits = _wide_rows()
    rows = {"top-p-off-row": [(0.8, 0, 0.02), (0.8, 0, 1.0), (0.8, 0, 0.05), (0.8, 0, 1.0)],
            "top-k-off-row": [(0.8, 5, 1.0), (0.8, 0, 0.99), (0.8, 20, 0.9), (0.8, 0, 0.5)],
            "both-off-row": [(0.8, 5, 1.0), (0.8, 0, 1.0), (1.0, 64, 0.9), (0.8, 0, 1.0)]}[case]
    t, k, p = (jnp.asarray(x) for x in zip(*rows))
    params = sampling.SamplingArrays(t.astype(jnp.float32), k.astype(jnp.int32),
                                     p.astype(jnp.float32))
    filters = sampling.Filters(top_k=64 if case != "top-p-off-row" else 0, top_p=True)
    got = np.asarray(sampling.process_logits(logits, params, filters))
    for b, (t_, k_, p_) in enumerate(rows):
        want = ref_process(logits[b], t_, k_, p_)
        np.testing.assert_array_equal(got[b] > 0, want > 0, err_msg=f"row {b}: {rows[b]}")
        np.testing.assert_allclose(got[b], want, atol=1e-6)


def test_a_call_whose_rows_all_use_top_k_has_no_branch():
    """generate's rows share one request's settings, so with top-k on in every row top-p's
    threshold lies among top-k's candidates: its program holds no branch to search past them
    (whose condition, over rows split across devices, was an all-reduce every call); a call
    whose rows may turn top-k off keeps it, and both give the same distributions."""
    logits = _wide_rows()
    params = _arrays(4, 0.8, 20, 0.9)
    every = sampling.Filters(top_k=64, top_p=True, top_k_every_row=True)
    maybe = sampling.Filters(top_k=64, top_p=True)
    jaxprs = {f: str(jax.make_jaxpr(lambda x, f=f: sampling.process_logits(x, params, f))(logits))
              for f in (every, maybe)}
    assert "cond[" not in jaxprs[every] and "cond[" in jaxprs[maybe]
    np.testing.assert_array_equal(np.asarray(sampling.process_logits(logits, params, every)),
                                  np.asarray(sampling.process_logits(logits, params, maybe)))
    from specjax import engine
    plan, _ = engine.plan_program(sj.ModelConfig(vocab_size=300, hidden_size=8,
                                                 intermediate_size=16, num_hidden_layers=1,
                                                 num_attention_heads=1),
                                  None, [np.array([1, 2])],
                                  sj.SamplingParams(temperature=0.8, top_k=20, top_p=0.9), None)
    assert plan.filters.top_k_every_row
