import pytest

from specjax import theory

# (alpha, gamma) -> (tokens per round, speed-up) at c = 0.05, the table in specjax/theory.py
SEED_TABLE = [
    (0.6, 4, 2.31, 1.92),
    (0.8, 4, 3.36, 2.80),
    (0.8, 8, 4.33, 3.09),
    (0.9, 4, 4.10, 3.41),
]


@pytest.mark.parametrize("alpha,gamma,tokens,speed", SEED_TABLE)
def test_the_speedup_table(alpha, gamma, tokens, speed):
    assert round(theory.expected_tokens_per_round(alpha, gamma), 2) == tokens
    assert round(theory.speedup(alpha, gamma, 0.05), 2) == speed


def test_the_speedup_claims():
    # "c from 0.05 to 0.2 takes α = 0.8, γ = 4 from 2.80× to 1.87×"
    assert round(theory.speedup(0.8, 4, 0.2), 2) == 1.87
    # "α = 0.8 peaks near γ = 8; α = 0.6 peaks at γ = 4"
    assert theory.optimal_gamma(0.8, 0.05) == 8
    assert theory.optimal_gamma(0.6, 0.05) == 4


def test_edges():
    assert theory.expected_tokens_per_round(1.0, 4) == 5.0
    assert theory.expected_tokens_per_round(0.0, 4) == 1.0
    assert theory.optimal_gamma(0.0, 0.1) == 0  # drafts never accepted: do not speculate
    assert theory.optimal_gamma(1.0, 0.0, max_gamma=7) == 7
    for bad in (lambda: theory.speedup(1.5, 4, 0.1), lambda: theory.speedup(0.5, -1, 0.1),
                lambda: theory.speedup(0.5, 4, -0.1)):
        with pytest.raises(ValueError):
            bad()


def test_numpy_integers_and_the_argument_named():
    """γ read from an array (np.int64) is a γ (it was refused as not an int); optimal_gamma's
    bad bound is named as max_gamma, not gamma."""
    import numpy as np
    assert theory.speedup(0.5, np.int64(4), 0.1) == theory.speedup(0.5, 4, 0.1)
    assert theory.optimal_gamma(0.8, 0.05, max_gamma=np.int32(4)) == 4
    with pytest.raises(ValueError, match="max_gamma must be an int >= 0, got -1"):
        theory.optimal_gamma(0.8, 0.05, max_gamma=-1)
    with pytest.raises(ValueError, match="gamma must be an int >= 0, got True"):
        theory.speedup(0.5, True, 0.1)
