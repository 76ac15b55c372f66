"""Expected speed-up of speculative decoding (Leviathan et al. 2023, Theorem 3.8).

Assumes every draft is accepted independently with the same probability α, a draft step costs c
target steps, and verifying γ + 1 positions costs one target step (true while the batch is small
enough that the verify step stays memory-bound).

A table of the formula, c = 0.05::

    α    γ   tokens/round  speed-up
    0.6  4   2.31          1.92×
    0.8  4   3.36          2.80×
    0.8  8   4.33          3.09×
    0.9  4   4.10          3.41×
"""

from __future__ import annotations

import numbers


def _check(alpha: float, gamma: int | None = None, c: float | None = None,
           name: str = "gamma") -> None:
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, numbers.Integral)
                              or gamma < 0):
        raise ValueError(f"{name} must be an int >= 0, got {gamma!r}")
    if c is not None and not c >= 0:
        raise ValueError(f"c must be >= 0, got {c!r}")


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E[tokens per round] = (1 - α^(γ+1)) / (1 - α): a geometric series capped at γ + 1."""
    _check(alpha, gamma)
    if alpha == 1:
        return float(gamma + 1)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speedup(alpha: float, gamma: int, c: float) -> float:
    """Expected wall-clock speed-up over autoregressive decoding: E[tokens] / (γc + 1)."""
    _check(alpha, gamma, c)
    return expected_tokens_per_round(alpha, gamma) / (gamma * c + 1)


def optimal_gamma(alpha: float, c: float, max_gamma: int = 16) -> int:
    """The γ in [1, max_gamma] with the largest expected speed-up, or 0 when no γ beats plain
    decoding (speed-up <= 1: then speculation only costs time). Ties go to the smaller γ."""
    _check(alpha, max_gamma, c, "max_gamma")
    best, best_speedup = 0, 1.0
    for gamma in range(1, max_gamma + 1):
        s = speedup(alpha, gamma, c)
        if s > best_speedup + 1e-12:
            best, best_speedup = gamma, s
    return best
