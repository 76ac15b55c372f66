"""String-level drafts (sj.draft.for_tokenizers(..., level="string")): the draft drafts in its
own tokens, its text is cut into target tokens by longest match on the device, and those are
verified as point masses. The tokenizers are the byte-level ones of test_spelled_draft, where
"é" is two bytes that the draft may write with two tokens and the target with one."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from test_draft_vocab import (
    GREEDY,
    PROMPTS,
    noisy,  # noqa: F401  (the fixture: the 32-token target, perturbed)
)
from test_lossless import (
    N,
    exact_joint,
    g_test,
    generate_samples,
    later_samples,
    models,  # noqa: F401  (the fixture: an 8-token target and drafts)
    tail_joints,  # noqa: F401  (the fixture: tokens 5-6's exact joints)
    tail_pvalues,
)
from test_spelled_draft import (
    TARGET_8,
    TARGET_32,
    reference_logits,
    spelled_pair,
    started,
    written,
)

import specjax as sj
from specjax.draft import draft_model, strings


@pytest.fixture(scope="module")
def by_string(noisy):
    draft_tok, target_tok, own, draft_tokens = spelled_pair(noisy, TARGET_32, 12)
    draft = sj.draft.for_tokenizers(own, draft_tok, target_tok, 32, level="string")
    return draft, draft_tokens


def longest_match_reference(data: bytes, tokens: list[str], gamma: int, stopped: bool):
    """Python: cut ``data`` by longest match into target ids, never across the start of a
    byte-level piece (whitespace after whitespace and before other text), dropping a token
    that ends at the end unless ``stopped``; at most gamma."""
    table = {written(tokens, [i]): i for i in range(len(tokens)) if tokens[i] != "<eos>"}
    space = b" \t\n\r\x0b\x0c"

    def starts_piece(j):
        return (0 < j < len(data) - 1 and data[j] in space and data[j - 1] in space
                and data[j + 1] not in space)
    out, at = [], 0
    while len(out) < gamma:
        best = max((n for n in range(1, len(data) - at + 1) if data[at:at + n] in table
                    and not any(starts_piece(j) for j in range(at + 1, at + n))), default=0)
        if best == 0 or (at + best == len(data) and not stopped):
            break
        out.append(table[data[at:at + best]])
        at += best
    return out


def test_the_text_is_cut_into_the_longest_target_tokens(by_string):
    """Random draft token sequences (special tokens included, which end the text) against a
    Python reference: the text's bytes and its cut, including target tokens that span two draft
    tokens and draft tokens that end inside "é"."""
    draft, draft_tokens = by_string
    bridge = draft.strings
    rng = np.random.default_rng(0)
    B, G, gamma = 64, 5, 4
    tokens = rng.integers(0, len(draft_tokens), (B, G))
    # half the rows write "é" as its two bytes' tokens, "Ã" then "©"
    tokens[::2, 1:3] = [draft_tokens.index("\u00c3"), draft_tokens.index("\u00a9")]
    # and a quarter write two spaces, then a letter
    tokens[1::4, 0:3] = [draft_tokens.index(t) for t in ("\u0120", "\u0120", "a")]
    text, size, stopped = strings.draft_text(bridge, jnp.asarray(tokens, jnp.int32))
    cut, valid = strings.cut(bridge, text, size, stopped, gamma)
    cut, valid = np.asarray(cut), np.asarray(valid)
    spans = runs = 0
    for b in range(B):
        seq = list(tokens[b])
        ends = [i for i, t in enumerate(seq) if draft_tokens[t] == "<eos>"]
        head = seq[:ends[0]] if ends else seq
        data = written(draft_tokens, head)
        assert int(size[b]) == len(data) and bool(stopped[b]) == bool(ends)
        assert bytes(np.asarray(text[b, :len(data)]).tolist()) == data
        want = longest_match_reference(data, TARGET_32, gamma, bool(ends))
        assert valid[b].tolist() == [True] * len(want) + [False] * (gamma - len(want)), b
        assert cut[b, :len(want)].tolist() == want, (b, data)
        spans += any(TARGET_32[t] in ("\u00c3\u00a9", "\u0120\u00c3\u00a9", "\u00c3\u00a9a")
                     for t in want)
        runs += b"  a" in data or b"  b" in data or b"  c" in data
    assert spans > 3  # "é" written by two draft tokens became one target token
    assert runs > 3  # "ĠĠ" then a letter: "Ġ" and "Ġa", not "ĠĠ" and "a"


def test_the_draft_reads_the_accepted_text_in_its_own_tokens(target, by_string):
    """Round after round, the catch-up leaves the draft where reading the whole text spelled in
    its tokens from scratch would: its logits match the one-forward reference."""
    draft, _ = by_string
    spelling = np.asarray(draft.spelling)
    gamma = 3
    proposer, state, history, length = started(target, draft, gamma, [5, 1, 3], [13, 21, 0], 1)
    assert isinstance(proposer, strings.StringChainProposer)
    B = len(length)
    rng = np.random.default_rng(1)
    for round_ in range(8):
        logits, state = proposer.catch_up(draft, state, jnp.asarray(history),
                                          jnp.asarray(length))
        for b in range(B):
            text = [d for t in history[b, :length[b] + 1] for d in spelling[t] if d >= 0]
            np.testing.assert_allclose(np.asarray(logits[b]), reference_logits(draft, text),
                                       atol=2e-4, err_msg=f"round {round_} row {b}")
        grown = rng.integers(1, gamma + 2, B)  # the accepted drafts and the target's token
        for b in range(B):
            history[b, length[b] + 1:length[b] + 1 + grown[b]] = rng.integers(0, 32, grown[b])
            length[b] += grown[b]


def test_string_drafts_are_greedy_exact(target, noisy, by_string):
    draft, _ = by_string
    reference = sj.generate(target, PROMPTS, sampling=GREEDY)
    out = sj.generate(target, PROMPTS, sampling=GREEDY, draft=draft,
                      spec=sj.SpecConfig(method="draft_model", num_speculative_tokens=4))
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    assert out.stats.proposed_tokens > 0 and out.stats.accepted_tokens > 0


def test_a_string_draft_for_another_vocabulary_is_named(target, noisy, by_string):
    """A string-level draft made for a target of another vocabulary size reads target ids by
    a table of that size (accepted: acceptance fell to nothing, or tokens were misread);
    for_tokenizers' size is checked (a float or 0 failed inside numpy)."""
    draft, _ = by_string
    wider = tiny_model(seed=0, vocab_size=40, hidden_size=32, layers=2, heads=4, kv_heads=2,
                       max_pos=128)
    with pytest.raises(ValueError, match="made for a target of vocab_size 32 .* this target "
                                         "has 40"):
        sj.generate(wider, PROMPTS, sampling=GREEDY, draft=draft,
                    spec=sj.SpecConfig(method="draft_model", num_speculative_tokens=4))
    draft_tok, target_tok, own, _ = spelled_pair(noisy, TARGET_32, 12)
    for bad in (300.5, 0, True):
        with pytest.raises(ValueError, match="target_vocab_size must be an int >= 1"):
            sj.draft.for_tokenizers(own, draft_tok, target_tok, bad)


def test_string_drafts_copy_no_draft_cache(target, by_string, fresh_programs):
    """The draft steps write the draft's cache in place: propose returned the state holding
    the cache before them, so XLA copied the whole draft cache every round (two copies of its
    shape in the decode loop; a round about twice as long on a toy model)."""
    import re

    from specjax import engine
    draft, _ = by_string
    sj.generate(target, PROMPTS, sampling=GREEDY, draft=draft, max_cache_len=96,
                spec=sj.SpecConfig(method="draft_model", num_speculative_tokens=4))
    program = engine.PROGRAMS.programs()[-1]
    proposer = program.plan.proposer
    slots = proposer.per_token * program.plan.capacity + proposer.span
    (decode,) = program.executables("decode")
    # a copy laid out as the draft's cache [L, B, K, slots, D] (attention's scores end in slots)
    copies = [dims for dims in re.findall(r"= \w+\[([\d,]+)\]\S* copy\(", decode.as_text())
              if len(dims.split(",")) == 5 and dims.split(",")[3] == str(slots)]
    assert copies == [], copies


def string_8(models):
    target, drafts = models
    draft_tok, target_tok, own, _ = spelled_pair(drafts["close"], TARGET_8, 5, seed=3)
    return target, sj.draft.for_tokenizers(own, draft_tok, target_tok, 8, level="string")


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 5, 0.9)], ids=["T1", "T0.7-topk5-topp0.9"])
def test_string_drafts_follow_the_target(models, t, k, p):
    target, draft = string_8(models)
    sampling_params = sj.SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=3)
    samples = generate_samples(target, draft, sampling_params,
                               sj.SpecConfig(num_speculative_tokens=3))
    assert g_test(samples, exact_joint(target, t, k, p)) > 1e-3


def test_string_drafts_later_tokens_follow_the_target(models, tail_joints):
    """Tokens 5 and 6 of a mixed batch over several rounds: each round the draft re-reads the
    text the verifier kept, cut into its own tokens. Half the usual rows (the cut costs more
    than a draft step; reused round keys still fail it at p = 0)."""
    target, draft = string_8(models)
    out = later_samples(target, draft, 3, rows=N // 2)
    assert out.stats.per_position_acceptance[1] > 0.01  # 0.015: hundreds of such rounds
    assert min(tail_pvalues(out.tokens, tail_joints)) > 1e-3


def _uniform_q(propose):
    def wrong(self, *args, **kwargs):  # the 8-token target's vocabulary
        out, state = propose(self, *args, **kwargs)
        return dataclasses.replace(out, probs=jnp.full(out.tokens.shape + (8,), 1 / 8)), state
    return wrong


def test_string_drafts_said_to_come_from_another_q_fail(models, monkeypatch, fresh_programs):
    """The same drafts declared as drawn from the uniform distribution instead of point masses:
    the G-test catches the wrong q."""
    target, draft = string_8(models)
    monkeypatch.setattr(strings.StringChainProposer, "propose",
                        _uniform_q(strings.StringChainProposer.propose))
    samples = generate_samples(target, draft, sj.SamplingParams(temperature=1.0,
                                                                max_new_tokens=3),
                               sj.SpecConfig(num_speculative_tokens=3))
    assert g_test(samples, exact_joint(target, 1.0, 0, 1.0)) < 1e-6


def test_string_drafts_refuse_what_they_do_not_support(target, by_string):
    draft, _ = by_string
    for spec in [dict(tree=((0,), (0, 0))),
                 dict(num_speculative_tokens=3, survival_threshold=0.5)]:
        with pytest.raises(ValueError, match="run as a chain"):
            sj.generate(target, PROMPTS, sampling=GREEDY, draft=draft,
                        spec=sj.SpecConfig(method="draft_model", **spec))
    with pytest.raises(ValueError, match="restrict it first"):
        sj.draft.restrict_vocab(draft, [0, 1])
    with pytest.raises(ValueError, match="already maps"):
        sj.draft.map_vocab(draft, 32, [[0, 3]])
    with pytest.raises(ValueError, match="level='words' must be"):
        sj.draft.for_tokenizers(draft.model, None, None, 32, level="words")


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "uniform-q"])
def test_string_drafts_that_read_part_of_the_text_follow_the_target(models, monkeypatch,
                                                                    fresh_programs, broken):
    """With one draft slot per target token, in the cache and in each catch-up, the draft reads
    only part of a round's text where it spells longer (here: a prompt spelled in 14 draft
    tokens for 13 target slots, tokens spelled with two): the first three tokens keep their
    exact joint distribution, and drafts declared as drawn from another q are still caught."""
    target, draft = string_8(models)
    monkeypatch.setattr(draft_model, "SPELLED_SLOTS", 1)
    if broken:
        monkeypatch.setattr(strings.StringChainProposer, "propose",
                            _uniform_q(strings.StringChainProposer.propose))
    prompt = [5, 6, 7, 5, 6, 7, 5]
    samples = generate_samples(target, draft, sj.SamplingParams(temperature=1.0,
                                                                max_new_tokens=3),
                               sj.SpecConfig(num_speculative_tokens=3), prompt=prompt)
    p = g_test(samples, exact_joint(target, 1.0, 0, 1.0, prompt=prompt))
    assert (p < 1e-6) if broken else (p > 1e-3), p


def test_string_drafts_that_read_part_of_the_text_are_greedy_exact(target, by_string, monkeypatch,
                                                                  fresh_programs):
    draft, _ = by_string
    monkeypatch.setattr(draft_model, "SPELLED_SLOTS", 1)
    prompts = [list(range(12, 31)) * 3, [2], [12, 13, 14]]
    reference = sj.generate(target, prompts, sampling=GREEDY)
    out = sj.generate(target, prompts, sampling=GREEDY, draft=draft,
                      spec=sj.SpecConfig(method="draft_model", num_speculative_tokens=4),
                      max_cache_len=len(prompts[0]) + GREEDY.max_new_tokens + 4)
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    assert out.stats.proposed_tokens > 0 and out.stats.accepted_tokens > 0
