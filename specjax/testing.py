"""Checking that a draft method keeps the target's distribution: the test every specjax method
passes, for yours (docs/custom-proposers.md, "Checking a new proposer").

On a target with a tiny vocabulary (8 tokens: a model you build with ``sj.init_model``), the
exact probability of every sequence of the first ``length`` tokens under autoregressive sampling
is enumerated (``exact_joint``); many rows sampled speculatively are then compared with it by a
G-test (``g_test``). A lossless method gives p-values spread uniformly over (0, 1); a method
that changes the distribution gives p-values that fall towards 0 as rows grow: with 20,000 rows
of a method that reports another q than it samples from, p is far below 1e-6.

    target = sj.init_model(sj.ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=2, num_attention_heads=2), 0,
                           init_std=0.3)
    p = sj.testing.lossless_pvalue(target, [1, 2, 3], proposer=MyProposer(gamma=2),
                                   sampling=sj.SamplingParams(temperature=0.8, top_k=5))
    assert p > 1e-6

The reference distribution is computed here in numpy and float64 from the target's logits
(temperature, then top-k, then top-p: the order ``SamplingParams`` documents), independently of
specjax's own sampling code, so the check does not share a mistake with what it checks.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

MAX_CELLS = 2 ** 21
"""The most token sequences ``exact_joint`` enumerates (vocabulary ** length)."""


def reference_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The next-token distribution [..., V] (float64) that sampling with these settings draws
    from: logits / temperature, the top_k largest kept (0 or less: all; ties with the k-th
    stay), then the smallest set of the most probable tokens whose probability reaches top_p
    (ties with its least probable token stay). temperature 0: the argmax, one-hot."""
    x = np.asarray(logits, np.float64)
    if temperature == 0:
        out = np.zeros_like(x)
        np.put_along_axis(out, np.argmax(x, axis=-1)[..., None], 1.0, axis=-1)
        return out
    x = x / temperature
    if 0 < top_k < x.shape[-1]:
        kth = -np.sort(-x, axis=-1)[..., top_k - 1:top_k]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        kept = np.cumsum(sorted_p, axis=-1) - sorted_p < top_p  # the mass before it is short
        threshold = np.min(np.where(kept, sorted_p, np.inf), axis=-1, keepdims=True)
        p = np.where(p >= threshold, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def exact_joint(target, prompt: list[int], sampling, length: int = 3) -> np.ndarray:
    """P(t_1 .. t_length | prompt) [V] * length under autoregressive sampling from ``target``
    with ``sampling`` (an ``sj.SamplingParams``), by enumerating every prefix."""
    from .model import logits as model_logits
    V = target.config.vocab_size
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be an int >= 1, got {length!r}")
    if V ** length > MAX_CELLS:
        raise ValueError(f"exact_joint enumerates vocab_size ** length = {V} ** {length} = "
                         f"{V ** length:,} sequences, more than {MAX_CELLS:,}: use a target with "
                         f"a tiny vocabulary (8 tokens) or a shorter length")
    if not prompt:
        raise ValueError("prompt must hold at least one token id")
    n = len(prompt)
    prefixes = np.array([list(prompt) + list(s)
                         for s in itertools.product(range(V), repeat=length - 1)], np.int32)
    probs = reference_probs(np.asarray(model_logits(target, prefixes))[:, n - 1:],
                            sampling.temperature, sampling.top_k, sampling.top_p)
    # probs[r, i]: the distribution of t_(i+1) after prefix r's first i tokens; the prefixes
    # whose later tokens are all 0 (a stride of V ** (length - 1 - i)) hold each first-i once
    joint = np.ones(1)
    for i in range(length):
        joint = (joint[:, None] * probs[:: V ** (length - 1 - i), i]).ravel()
    return joint.reshape((V,) * length)


def g_test(sequences, joint) -> float:
    """The p-value of a G-test of sampled sequences [N, length] against ``joint`` [V] * length.
    A sequence of probability 0 (cut by top-k or top-p) drawn even once gives 0.0; cells
    expected fewer than 5 times are pooled into one."""
    joint = np.asarray(joint, np.float64)
    seqs = np.asarray(sequences)
    V, length = joint.shape[0], joint.ndim
    if seqs.ndim != 2 or seqs.shape[1] < length:
        raise ValueError(f"sequences must be [N, >= {length}] token ids, got shape {seqs.shape}")
    seqs = seqs[:, :length]
    if seqs.min() < 0 or seqs.max() >= V:
        raise ValueError(f"sequences hold token ids outside [0, {V}) (unfinished rows?)")
    counts = np.bincount(np.ravel_multi_index(seqs.T, joint.shape), minlength=joint.size)
    probs = joint.ravel()
    if counts[probs == 0].sum():
        return 0.0
    counts, expected = counts[probs > 0], probs[probs > 0] * len(seqs)
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    g = 2.0 * float(np.sum(np.where(obs > 0, obs * np.log(np.where(obs > 0, obs, 1) / exp), 0)))
    return _chi2_sf(g, len(obs) - 1)


def _chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X chi-squared with ``df`` degrees of freedom (the regularised upper
    incomplete gamma function Q(df / 2, x / 2), by its series or continued fraction)."""
    if df < 1:
        return 1.0
    a, z = df / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    log_front = a * math.log(z) - z - math.lgamma(a)
    if z < a + 1:  # the series of the lower function P(a, z)
        term = total = 1.0 / a
        for n in range(1, 10_000):
            term *= z / (a + n)
            total += term
            if term < total * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    # Lentz's continued fraction for Q(a, z)
    tiny = 1e-300
    b = z + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for n in range(1, 10_000):
        an = -n * (n - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return h * math.exp(log_front)


def lossless_pvalue(target, prompt: list[int], *, sampling, spec=None, draft=None,
                    proposer=None, rows: int = 20_000, key: int = 0, length: int = 3) -> float:
    """``rows`` copies of ``prompt`` decoded by ``sj.generate`` with ``spec`` (or your
    ``proposer``) and ``draft``, ``length`` new tokens each; the G-test p-value of their tokens
    against ``exact_joint``. ``sampling``'s max_new_tokens is set to ``length``; its
    temperature must be > 0 (greedy output is checked by equality with plain decoding)."""
    import dataclasses

    from .config import SpecConfig
    from .draft.base import lookahead_width
    from .engine import build_proposer, generate, slots_needed
    if not sampling.temperature > 0:
        raise ValueError("lossless_pvalue compares sampled distributions: give a temperature "
                         "> 0 (check greedy decoding by equality with spec=None)")
    sampling = dataclasses.replace(sampling, max_new_tokens=length, eos_token_id=[],
                                   stop_token_ids=None, stop=None)
    joint = exact_joint(target, prompt, sampling, length)
    # The cache holds what the request needs, not the smallest tier (256 slots): attention over
    # a tier's empty slots made 20,000 rows of a tiny model about 30 times slower.
    built, _ = build_proposer(SpecConfig.parse(spec), proposer, draft, target.config)
    gamma = 0 if built is None else built.gamma + lookahead_width(built)
    out = generate(target, [list(prompt)] * rows, sampling=sampling, spec=spec, draft=draft,
                   proposer=proposer, key=key,
                   max_cache_len=slots_needed(len(prompt), length, gamma))
    return g_test(out.tokens, joint)
