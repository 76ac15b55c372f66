"""Stop sequences: token sequences matched on the device inside the loop (SamplingParams.
stop_token_ids), stop strings matched on the host with the tokenizer (SamplingParams.stop). A
row's rounds before its stop are those it runs without one, so with the same key its output is
the unstopped output cut where the reference says: checked for every method, greedy and sampled,
with stops that straddle rounds."""

import numpy as np
import pytest
from conftest import tiny_model, verification_paths

import specjax as sj
from specjax import engine
from specjax.config import MAX_STOP_LENGTH, MAX_STOP_SEQUENCES

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [3, 3]]
NEW = 40


def reference_cut(row, sequences):
    """Tokens a row keeps: up to the first generated position where any sequence ends."""
    for j in range(len(row)):
        for s in sequences:
            if j + 1 >= len(s) and list(row[j + 1 - len(s):j + 1]) == list(s):
                return j + 1
    return len(row)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["autoregressive", "chain", "ngram", "tree",
                                    "lookahead", "suffix"])
def test_stop_sequences_cut_where_the_reference_says(target, draft, method, temperature):
    spec, d = verification_paths(draft)[method]
    sampling = sj.SamplingParams(temperature=temperature, max_new_tokens=NEW)
    free = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=d, key=3)
    rows = [free.tokens[b, :free.lengths[b]] for b in range(len(PROMPTS))]
    # sequences taken from the unstopped output at several offsets and lengths (so they end in
    # every position of a round), one that never occurs, and a one-token one
    sequences = [tuple(rows[0][9:12]), tuple(rows[1][20:22]), tuple(rows[3][13:18]),
                 (int(rows[2][30]),), (31, 31, 31, 31, 31, 31, 31, 30)]
    out = sj.generate(target, PROMPTS, spec=spec, draft=d, key=3,
                      sampling=sj.SamplingParams(temperature=temperature, max_new_tokens=NEW,
                                                 stop_token_ids=sequences))
    cuts = [reference_cut(r, sequences) for r in rows]
    assert out.lengths.tolist() == cuts and min(cuts) < NEW
    for b, r in enumerate(rows):
        np.testing.assert_array_equal(out.tokens[b, :cuts[b]], r[:cuts[b]])
        assert (out.tokens[b, cuts[b]:] == -1).all()


def prompt_spanning(target):
    """A sequence that spans the prompt's last token and the first two generated ones."""
    free = sj.generate(target, [[7, 8, 9]], sampling=sj.SamplingParams(temperature=0,
                                                                       max_new_tokens=12))
    return free.tokens[0], (9, int(free.tokens[0, 0]), int(free.tokens[0, 1]))


def test_a_sequence_that_starts_in_the_prompt_does_not_stop(target):
    row, spanning = prompt_spanning(target)
    out = sj.generate(target, [[7, 8, 9]], sampling=sj.SamplingParams(
        temperature=0, max_new_tokens=12, stop_token_ids=[spanning]))
    assert out.lengths[0] == reference_cut(row, [spanning]) == 12
    # the first token alone stops the row at once (the prefill's token)
    out = sj.generate(target, [[7, 8, 9]], sampling=sj.SamplingParams(
        temperature=0, max_new_tokens=12, stop_token_ids=[spanning[1]]))
    assert out.lengths[0] == 1 and out.tokens[0, 0] == spanning[1]


def test_a_matcher_that_ignores_the_prompt_boundary_fails(target, monkeypatch, fresh_programs):
    """Broken on purpose: every token before the round counted as generated; the
    prompt-spanning sequence then stops the row at its second token, which the test above
    rules out."""
    real = engine.stop_ends
    monkeypatch.setattr(engine, "stop_ends", lambda window, generated, offered, stop: real(
        window, generated + 100, offered, stop))
    _, spanning = prompt_spanning(target)
    out = sj.generate(target, [[7, 8, 9]], sampling=sj.SamplingParams(
        temperature=0, max_new_tokens=12, stop_token_ids=[spanning]))
    assert out.lengths[0] == 2


def test_stop_sequences_do_not_recompile(target, draft):
    """Calls with stop sequences share one program, whatever the sequences; calls without keep
    the program that matches nothing."""
    spec = sj.SpecConfig(num_speculative_tokens=3)
    for stops in (None, [5]):
        sj.generate(target, PROMPTS, spec=spec, draft=draft,
                    sampling=sj.SamplingParams(max_new_tokens=8, stop_token_ids=stops))
    compiled = engine.PROGRAMS.compiled
    for stops in ([[1, 2], [3, 4, 5]], [[7] * MAX_STOP_LENGTH] * MAX_STOP_SEQUENCES, None):
        sj.generate(target, PROMPTS, spec=spec, draft=draft,
                    sampling=sj.SamplingParams(max_new_tokens=8, stop_token_ids=stops))
    assert engine.PROGRAMS.compiled == compiled


def test_bad_stop_settings_are_refused_by_name(target):
    for bad in ([[]], [[1] * (MAX_STOP_LENGTH + 1)], [[1]] * (MAX_STOP_SEQUENCES + 1), [-1],
                [[1, -2]], 5, "ab", [1.5]):
        with pytest.raises(ValueError, match="stop_token_ids must be a list of token ids"):
            sj.SamplingParams(stop_token_ids=bad)
    with pytest.raises(ValueError, match=r"stop_token_ids \[3, 99\] has id 99 outside \[0, 32\)"):
        sj.generate(target, [[1]], sampling=sj.SamplingParams(stop_token_ids=[[3, 99]]))
    for bad in ("", [""], [3], 7):
        with pytest.raises(ValueError, match="SamplingParams.stop must be a non-empty string"):
            sj.SamplingParams(stop=bad)
    with pytest.raises(ValueError, match="SamplingParams.stop=.* needs tokenizer="):
        sj.generate(target, [[1]], sampling=sj.SamplingParams(stop=["\n"]))
    with pytest.raises(ValueError, match="include_stop_str_in_output must be a bool"):
        sj.SamplingParams(include_stop_str_in_output="yes")


# -- stop strings ---------------------------------------------------------------------------------

class CharTokenizer:
    """Token i is the printable character chr(32 + i % 95): a string of several characters spans
    several tokens, and so several rounds."""

    vocab_size = 256
    eos_token_ids = ()

    def encode(self, text):
        return [ord(c) - 32 for c in text]

    def decode(self, ids):
        return "".join(chr(32 + int(i) % 95) for i in ids)


class PairTokenizer(CharTokenizer):
    """Token i is two letters (a-p twice: 256 tokens), as a BPE token is several characters: a
    stop string can begin or end inside a token's text."""

    def encode(self, text):
        return [(ord(a) - 97) * 16 + ord(b) - 97 for a, b in zip(text[::2], text[1::2])]

    def decode(self, ids):
        return "".join(chr(97 + int(i) // 16) + chr(97 + int(i) % 16) for i in ids)


@pytest.fixture(scope="module")
def byte_models():
    target = tiny_model(seed=4, vocab_size=256, hidden_size=32, heads=4, kv_heads=2, max_pos=128)
    draft = tiny_model(seed=5, vocab_size=256, hidden_size=16, layers=1, max_pos=128)
    return target, draft


def string_cut(text, stops, include):
    """(text kept, or None when no stop string occurs)."""
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return None
    end = min(at + len(s) for at, s in hits)  # the first string to be completed
    at, s = min((text.find(s), s) for s in stops if s in text[:end])
    return text[:at + len(s)] if include else text[:at]


@pytest.mark.parametrize("include", [False, True], ids=["cut-before", "included"])
@pytest.mark.parametrize("method,tokens", [("autoregressive", "chars"), ("chain", "chars"),
                                           ("chain", "letter-pairs")])
def test_stop_strings_cut_text_and_tokens(byte_models, method, tokens, include):
    target, draft = byte_models
    tok = CharTokenizer() if tokens == "chars" else PairTokenizer()
    spec, d = (None, None) if method == "autoregressive" else (
        sj.SpecConfig(num_speculative_tokens=3), draft)
    prompts = ["ab", "xyz", "q"] if tokens == "chars" else ["ab", "cdef", "gh"]
    sampling = sj.SamplingParams(temperature=0.9, max_new_tokens=48)
    free = sj.generate(target, prompts, sampling=sampling, spec=spec, draft=d, key=6,
                       tokenizer=tok, return_text=True)
    # strings of 2 and 3 tokens' text from the unstopped text (they straddle tokens, and
    # rounds); with two letters a token, the first begins and ends inside a token's text
    raw = [free.tokens[b, :free.lengths[b]] for b in range(len(prompts))]
    first = tok.decode(raw[0][20:23])
    stops = [first if tokens == "chars" else first[1:-1], tok.decode(raw[1][31:33]),
             "\n never \n"]
    stopped = dict(stop=stops, include_stop_str_in_output=include)
    out = sj.generate(target, prompts, spec=spec, draft=d, key=6, tokenizer=tok,
                      return_text=True, sampling=sj.SamplingParams(
                          temperature=0.9, max_new_tokens=48, **stopped))
    chunks = list(sj.stream(target, prompts, spec=spec, draft=d, key=6, tokenizer=tok,
                            rounds_per_chunk=1,  # stop strings straddle chunks
                            sampling=sj.SamplingParams(temperature=0.9, max_new_tokens=48,
                                                       **stopped)))
    cut_any = False
    for b in range(len(prompts)):
        want = string_cut(free.text[b], stops, include)
        if want is None:
            assert out.text[b] == free.text[b] and out.lengths[b] == free.lengths[b]
            continue
        cut_any = True
        assert out.text[b] == want
        # tokens: up to the one that completes the string, and no further
        n = int(out.lengths[b])
        np.testing.assert_array_equal(out.tokens[b, :n], raw[b][:n])
        assert any(s in tok.decode(raw[b][:n]) for s in stops)
        assert not any(s in tok.decode(raw[b][:n - 1]) for s in stops)
        # streamed: the same text, no character past the stop ever handed out
        assert "".join(c.text[b] for c in chunks) == want
    assert cut_any
    # the last chunk ends every row and carries the whole call's text
    assert chunks[-1].finished.all() and chunks[-1].generation.text == out.text
    # the stats count the tokens kept, however many rounds ran past a stop in a segment
    for g in (out, chunks[-1].generation):
        assert g.stats.generated_tokens == int(g.lengths.sum())
        decode = g.stats.generated_tokens - len(prompts)
        assert g.stats.decode_tokens_per_second == pytest.approx(decode / g.stats.decode_seconds)


@pytest.mark.parametrize("include", [False, True], ids=["cut-before", "included"])
def test_of_stop_strings_one_token_completes_the_first_to_end_wins(byte_models, include):
    """Two letters a token: "wxyz" (two tokens) and "xy" are both completed by the token "yz";
    "xy" ends first, so the text ends before "xy" (or with it), wherever "wxyz" starts, and
    whichever is listed first."""
    target, draft = byte_models
    tok = PairTokenizer()
    sampling = sj.SamplingParams(temperature=0.9, max_new_tokens=48)
    spec = sj.SpecConfig(num_speculative_tokens=3)
    free = sj.generate(target, ["ab"], sampling=sampling, spec=spec, draft=draft, key=6,
                       tokenizer=tok)
    raw = free.tokens[0, :free.lengths[0]]
    pair = tok.decode(raw[20:22])
    for stops in ([pair, pair[1:3]], [pair[1:3], pair]):
        want = string_cut(free.text[0], stops, include)
        out = sj.generate(target, ["ab"], spec=spec, draft=draft, key=6, tokenizer=tok,
                          sampling=sj.SamplingParams(temperature=0.9, max_new_tokens=48,
                                                     stop=stops,
                                                     include_stop_str_in_output=include))
        assert out.text[0] == want and want.endswith(pair[1:3] if include else "")
        assert pair[1:3] not in want[:len(want) - 2 * include]


def test_a_row_stopped_by_a_string_is_cut_in_a_non_finite_error_too(byte_models):
    """One row meets a NaN logit late (its token's embedding planted with NaN), another stops at
    a string early: the NonFiniteError's generation has the second row cut as generate would
    have returned it (the stop applied before the error is raised), not run on past it."""
    from test_nonfinite import planted
    target, draft = byte_models
    tok = CharTokenizer()
    prompts = ["ab", "xyz"]
    sampling = sj.SamplingParams(temperature=0.9, max_new_tokens=40)
    free = sj.generate(target, prompts, sampling=sampling, key=6, tokenizer=tok)
    rows = [free.tokens[b, :free.lengths[b]] for b in range(2)]
    stop = tok.decode(rows[1][6:8])
    want = string_cut(free.text[1], [stop], False)
    n_stop = len(want) + 2  # one character a token: the kept text, then the stop's two
    # a token of row 0's, late, that neither row nor prompt holds before
    j = next(j for j in range(30, 38) if rows[0][j] not in rows[0][:j]
             and rows[0][j] not in rows[1][:n_stop] and rows[0][j] not in tok.encode("abxyz"))
    broken = planted(target, int(rows[0][j]), np.nan)
    with pytest.raises(sj.NonFiniteError) as err:
        sj.generate(broken, prompts, key=6, tokenizer=tok, sampling=sj.SamplingParams(
            temperature=0.9, max_new_tokens=40, stop=[stop]))
    g = err.value.generation
    assert err.value.rows == [0] and g.lengths[0] == j + 1
    assert g.lengths[1] == n_stop and g.text[1] == want
    np.testing.assert_array_equal(g.tokens[1, :n_stop], rows[1][:n_stop])
    assert (g.tokens[1, n_stop:] == -1).all()
