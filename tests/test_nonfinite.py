"""Non-finite numbers (issue 25): when the target's logits for a row become NaN or infinite, the
row stops before the token they would have decided, and the call raises sj.NonFiniteError
naming the rows and positions, with every row's valid tokens, instead of emitting garbage."""

import jax
import numpy as np
import pytest
from conftest import verification_paths

import specjax as sj

MAX_NEW = 24
PROMPTS = [[1, 2, 3, 4], [9, 8, 7], [5, 5, 6, 1, 2]]


def planted(target: sj.Model, token: int, value: float) -> sj.Model:
    """The target with token's embedding row set to value (NaN or inf): the logits at every
    position where that token is the input (and after it) are no longer finite."""
    params = dict(target.params)
    params["embed_tokens"] = {"embedding": target.params["embed_tokens"]["embedding"]
                              .at[token].set(value)}
    return sj.Model(target.config, params)


def expected_stop(rows: np.ndarray, lengths: np.ndarray, prompts, token: int) -> list[int]:
    """Per row, the generated-token index the row must stop at (its output up to there is the
    clean model's), or -1: one past the first generated ``token`` (0 if the prompt holds it)."""
    out = []
    for b, prompt in enumerate(prompts):
        if token in prompt:
            out.append(0)
            continue
        hits = np.flatnonzero(rows[b, :lengths[b]] == token)
        out.append(int(hits[0]) + 1 if hits.size and hits[0] + 1 < lengths[b] else -1)
    return out


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("path", ["autoregressive", "chain", "ngram", "tree"])
def test_greedy_rows_stop_where_the_logits_break(target, draft, path, value):
    greedy = sj.SamplingParams(temperature=0, max_new_tokens=MAX_NEW)
    clean = sj.generate(target, PROMPTS, sampling=greedy)
    token = int(clean.tokens[0, 3])  # row 0 generates it at index 3 (or earlier)
    stops = expected_stop(clean.tokens, clean.lengths, PROMPTS, token)
    assert stops[0] > 0
    spec, d = verification_paths(draft)[path]
    with pytest.raises(sj.NonFiniteError) as err:
        sj.generate(planted(target, token, value), PROMPTS, sampling=greedy, spec=spec, draft=d)
    e = err.value
    bad = [b for b, s in enumerate(stops) if s >= 0]
    assert e.rows == bad and e.positions == [stops[b] for b in bad], (e.rows, e.positions)
    out = e.generation
    for b, s in enumerate(stops):
        n = clean.lengths[b] if s < 0 else s
        assert out.lengths[b] == n
        np.testing.assert_array_equal(out.tokens[b, :n], clean.tokens[b, :n])
        assert (out.tokens[b, n:] == -1).all()
    assert f"row {bad[0]} at generated token {stops[bad[0]]}" in str(e)


@pytest.mark.parametrize("path", ["autoregressive", "chain", "tree"])
def test_sampled_rows_never_emit_a_token_from_broken_logits(target, draft, path):
    """At T = 0.8 a row stops just after it first generates the planted token (its next
    logits are NaN), never later; its tokens before are ordinary vocabulary ids."""
    sampling = sj.SamplingParams(temperature=0.8, max_new_tokens=MAX_NEW)
    spec, d = verification_paths(draft)[path]
    prompts = PROMPTS * 4
    clean = sj.generate(target, prompts, sampling=sampling, spec=spec, draft=d,
                        key=jax.random.key(3))
    token = int(np.bincount(clean.tokens[clean.tokens >= 0]).argmax())  # a common one
    with pytest.raises(sj.NonFiniteError) as err:
        sj.generate(planted(target, token, np.nan), prompts, sampling=sampling, spec=spec,
                    draft=d, key=jax.random.key(3))
    out, e = err.value.generation, err.value
    assert e.rows, "no row met the planted token"
    for b in range(len(prompts)):
        row = out.tokens[b, :out.lengths[b]]
        assert ((row >= 0) & (row < target.config.vocab_size)).all()
        first = np.flatnonzero(row == token)
        if token in prompts[b]:  # broken from the prefill on: nothing generated
            assert b in e.rows and e.positions[e.rows.index(b)] == 0 == out.lengths[b]
        elif b in e.rows:  # stopped one past the planted token's first appearance
            assert first.size and e.positions[e.rows.index(b)] == first[0] + 1 == out.lengths[b]
        else:  # never generated it (or as its very last token)
            assert not first.size or first[0] == out.lengths[b] - 1


def test_a_prompt_holding_the_broken_token_yields_nothing(target):
    one = sj.SamplingParams(temperature=0, max_new_tokens=1)  # the other rows: prefill only
    with pytest.raises(sj.NonFiniteError) as err:
        sj.generate(planted(target, 7, np.nan), PROMPTS, sampling=one)
    assert err.value.rows == [1] and err.value.positions == [0]
    assert list(err.value.generation.lengths) == [1, 0, 1]
    # every row's first token came from the prefill (one of them none at all): no decode
    # tokens, not minus one
    assert err.value.generation.stats.decode_tokens_per_second == 0.0


def test_decode_speed_counts_the_tokens_after_each_rows_first(target):
    """A row that made no token (its prompt broken) counts no decode token, not minus one: the
    decode speed is the tokens after each row's first over the decode time."""
    four = sj.SamplingParams(temperature=0, max_new_tokens=4)
    with pytest.raises(sj.NonFiniteError) as err:
        sj.generate(planted(target, 7, np.nan), PROMPTS, sampling=four)
    out = err.value.generation
    assert 0 in out.lengths and out.lengths.max() > 1
    s = out.stats
    want = int(np.maximum(out.lengths - 1, 0).sum())
    np.testing.assert_allclose(s.decode_tokens_per_second * s.decode_seconds, want, rtol=1e-9)
