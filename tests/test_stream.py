"""sj.stream: generate's rounds in segments, yielding each row's new tokens (and text) between
them; the streamed result equals generate's, token for token, and nothing recompiles between
segments or for another segment length."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import tiny_model

import specjax as sj
from specjax import engine

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]


def joined(chunks, rows):
    return [np.concatenate([c.tokens[b] for c in chunks]) for b in range(rows)]


@pytest.mark.parametrize("name", ["autoregressive-greedy", "chain-sampled-eos",
                                  "tree-sampled-eos", "eagle-sampled-eos"])
def test_streamed_tokens_equal_generate(target, draft, name):
    """Also a tree, and EAGLE (a rider: its features of the last round are carried from one
    segment to the next)."""
    if name == "autoregressive-greedy":
        sampling, spec, d = sj.SamplingParams(temperature=0, max_new_tokens=17), None, None
    else:  # EOS ends rows at different rounds; drafts accepted and rejected
        sampling = sj.SamplingParams(temperature=0.8, max_new_tokens=24, eos_token_id=5)
        spec, d = sj.SpecConfig(num_speculative_tokens=3), draft
        if name.startswith("tree"):
            spec = sj.SpecConfig(tree=((0,), (1,), (0, 0), (0, 0, 0)))
        elif name.startswith("eagle"):
            spec = sj.SpecConfig(method="eagle", num_speculative_tokens=3)
            d = sj.init_heads(target, "eagle", jax.random.key(2))
    ref = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=d, key=4)
    chunks = list(sj.stream(target, PROMPTS, sampling=sampling, spec=spec, draft=d, key=4,
                            rounds_per_chunk=1))
    assert [len(t) for t in chunks[0].tokens] == [1, 1, 1]  # the prefill's first token
    for b, tokens in enumerate(joined(chunks, len(PROMPTS))):
        np.testing.assert_array_equal(tokens, ref.tokens[b, :ref.lengths[b]])
    out = chunks[-1].generation
    assert all(c.generation is None for c in chunks[:-1]) and out is not None
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    assert (out.stats.num_rounds, out.stats.accepted_tokens, out.stats.proposed_tokens) == (
        ref.stats.num_rounds, ref.stats.accepted_tokens, ref.stats.proposed_tokens)
    # one chunk a round after the prefill; rows finish once and stay finished
    assert len(chunks) == 1 + ref.stats.num_rounds
    finished = np.array([c.finished for c in chunks])
    assert finished[-1].all() and (np.diff(finished.astype(int), axis=0) >= 0).all()
    if name != "autoregressive-greedy":
        assert ref.stats.accepted_tokens > 0 and (ref.lengths < 24).any()  # EOS cut some row
        # a finished row gets no more tokens
        for b in range(len(PROMPTS)):
            first = int(np.argmax(finished[:, b]))
            assert all(len(c.tokens[b]) == 0 for c in chunks[first + 1:])


def test_a_rider_that_forgets_its_features_between_segments_fails(target, monkeypatch,
                                                                  fresh_programs):
    """The EAGLE case above fails when each segment starts from zeroed features (what a rider
    whose state the segments did not carry would draft from)."""
    import dataclasses

    from specjax.draft.eagle import EagleState
    forget = engine.decode_until

    def forgetting(plan, target_params, draft_params, request, state, until):
        if isinstance(state.draft_state, EagleState):
            f = state.draft_state.features
            state = dataclasses.replace(state, draft_state=dataclasses.replace(
                state.draft_state, features=dataclasses.replace(f, feats=f.feats * 0)))
        return forget(plan, target_params, draft_params, request, state, until)
    monkeypatch.setitem(engine._STAGES, "segment", jax.jit(
        engine._with_blocks(forgetting), static_argnums=0, donate_argnums=4))
    with pytest.raises(AssertionError, match="Arrays are not equal"):  # the streamed tokens
        test_streamed_tokens_equal_generate(target, None, "eagle-sampled-eos")


def test_segments_of_any_length_share_one_executable(target, draft):
    sampling = sj.SamplingParams(temperature=0.7, max_new_tokens=20)
    spec = sj.SpecConfig(num_speculative_tokens=2)
    ref = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=draft, key=1)
    list(sj.stream(target, PROMPTS, sampling=sampling, spec=spec, draft=draft, key=1))
    compiled = engine.PROGRAMS.compiled
    for rounds in (2, 5, 100, None):  # None: as many rounds a chunk as take about 20 ms
        chunks = list(sj.stream(target, PROMPTS, sampling=sampling, spec=spec, draft=draft,
                                key=1, rounds_per_chunk=rounds))
        if rounds is not None:
            assert len(chunks) == 1 + -(-ref.stats.num_rounds // rounds)
        np.testing.assert_array_equal(chunks[-1].generation.tokens, ref.tokens)
        assert engine.PROGRAMS.compiled == compiled and (
            chunks[-1].generation.stats.compile_seconds == 0)


class BytesTokenizer:
    """Token i < 256 is byte i: a UTF-8 character of several bytes spans several tokens."""

    vocab_size = 256
    eos_token_ids = ()

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(int(i) for i in ids).decode(errors="replace")


def test_text_never_splits_a_character():
    tok, delta = BytesTokenizer(), engine._TextDelta(1)
    euro = list("€".encode())  # three bytes
    pieces = [delta(0, tok.decode([104] + euro[:1]), False),
              delta(0, tok.decode([104] + euro[:2]), False),
              delta(0, tok.decode([104] + euro + [105]), False)]
    assert pieces == ["h", "", "€i"]
    # a row that ends on an incomplete character gives what it has
    assert delta(0, tok.decode([104] + euro + [105] + euro[:1]), True) == "\ufffd"
    # holding back a tail (where a stop string may start) until the row is done
    held = engine._TextDelta(1, hold=2)
    assert [held(0, "abcd", False), held(0, "abcdef", False), held(0, "abcdefg", True)] == [
        "ab", "cd", "efg"]


def test_a_slow_caller_is_not_counted_as_decoding(target, monkeypatch):
    """The caller's own time between chunks (here 40 ms a chunk, far more than a tiny model's
    round) is neither decode time in the stats nor a reason to hand out one round a chunk
    (the chunk sizing reads the decode time). Counted as decoding, it made the streamed
    tokens/s 50-170 times too low and every chunk one round."""
    import time
    sampling = sj.SamplingParams(temperature=0, max_new_tokens=60)
    fast = list(sj.stream(target, PROMPTS[:1], sampling=sampling))
    slept, chunks = 0.0, []
    for chunk in sj.stream(target, PROMPTS[:1], sampling=sampling):
        chunks.append(chunk)
        time.sleep(0.04)
        slept += 0.04
    np.testing.assert_array_equal(chunks[-1].generation.tokens, fast[-1].generation.tokens)
    stats = chunks[-1].generation.stats
    assert stats.decode_seconds < slept / 4, (stats.decode_seconds, slept)
    assert len(chunks) < 1 + stats.num_rounds / 2, (len(chunks), stats.num_rounds)


def test_streamed_text_adds_up_to_generate_text():
    tok = BytesTokenizer()
    target = tiny_model(seed=3, vocab_size=256, hidden_size=16, max_pos=128)
    sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=24)
    prompts = ["año ", "x"]
    ref = sj.generate(target, prompts, sampling=sampling, tokenizer=tok, return_text=True, key=2)
    chunks = list(sj.stream(target, prompts, sampling=sampling, tokenizer=tok, key=2))
    assert chunks[-1].generation.text == ref.text
    for b in range(len(prompts)):
        assert "".join(c.text[b] for c in chunks) == ref.text[b]
    # random bytes: the text does hold characters cut between rounds (U+FFFD in the result)
    assert any("\ufffd" in t for t in ref.text)
    # return_text=False, as generate takes it: tokens only, with or without stop strings
    for stop in (None, [ref.text[0][6:8]]):
        quiet = dataclasses.replace(sampling, stop=stop)
        plain = list(sj.stream(target, prompts, sampling=quiet, tokenizer=tok, key=2,
                               return_text=False))
        assert all(c.text is None for c in plain) and plain[-1].generation.text is None
        assert sj.generate(target, prompts, sampling=quiet, tokenizer=tok, key=2,
                           return_text=False).text is None
        np.testing.assert_array_equal(plain[-1].generation.tokens, sj.generate(
            target, prompts, sampling=quiet, tokenizer=tok, key=2).tokens)


def test_bad_stream_arguments_are_refused_by_name(target):
    for bad in (0, -1, 1.5, True, 2 ** 31):  # the loop counts rounds in int32
        with pytest.raises(ValueError, match=r"rounds_per_chunk must be an int in "
                                             r"\[1, 2\*\*31 - 1\] or None, got "):
            sj.stream(target, PROMPTS, rounds_per_chunk=bad)
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['stream_interval'\\]"):
        sj.stream(target, PROMPTS, stream_interval=2)
    with pytest.raises(ValueError, match="prompt 0 has token id 99"):
        sj.stream(target, [[99]])  # checked before anything runs, not at the first next()
