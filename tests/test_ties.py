"""Greedy ties: the same choice on every path, and near ties counted.

A greedy token is the first index of the largest logit (``sampling.argmax``) on every path: the
one-token step of autoregressive decoding, a chain's γ + 1 verify, an n-gram branch, a tree's
verify. A target whose LM head has two equal columns for each of its likely tokens ties exactly
at every step; speculative decoding must still give the autoregressive text, in float32 and in
bfloat16, and a tie rule that depends on the forward's width must fail that test. Ties that are
not exact (the top two within the dtype's rounding) are counted in ``Stats.greedy_near_ties``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

import specjax as sj
from specjax import sampling

V = 16
PROMPT = [5, 6, 7, 8, 5, 6]


def planted(dtype="float32", margin=0.0, seed=3, layers=2):
    """A model whose LM head scores only tokens 0 and 1 (column w, and w(1 - margin)) and 2
    and 3 (-w and -w(1 - margin)): every greedy step chooses between 0 and 1, or 2 and 3, and
    with margin 0 the two tie exactly. (Seed 3: its greedy text has both 0s and 2s.)"""
    model = tiny_model(seed, vocab_size=V, hidden_size=32, layers=layers, heads=4, kv_heads=2,
                       max_pos=128, tie_word_embeddings=False)
    params = jax.tree.map(lambda x: x, model.params)  # a copy of the nested dicts
    head = np.zeros(np.shape(params["lm_head"]["kernel"]), np.float32)
    w = np.asarray(model.params["lm_head"]["kernel"], np.float32)[:, 0] * 4.0
    head[:, 0], head[:, 1], head[:, 2], head[:, 3] = w, w * (1 - margin), -w, -w * (1 - margin)
    params["lm_head"]["kernel"] = jnp.asarray(head)
    return sj.checkpoint.cast(sj.Model(model.config, params), dtype)


def greedy(target, spec=None, draft=None, n=24):
    return sj.generate(target, [PROMPT], sampling=sj.SamplingParams(temperature=0,
                                                                    max_new_tokens=n),
                       spec=spec, draft=draft)


SPECS = {"chain": (dict(num_speculative_tokens=3), True),
         "ngram": (dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1), False),
         "tree": (dict(tree=[[0], [1], [0, 0], [0, 0, 0]]), True),
         "suffix": (dict(method="suffix", num_speculative_tokens=3), False),
         "lookahead": (dict(method="lookahead", num_speculative_tokens=2), False)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("how", list(SPECS))
def test_exact_ties_go_the_same_way_on_every_path(dtype, how):
    target = planted(dtype)
    ar = greedy(target)
    assert set(np.unique(ar.tokens)) <= {0, 2}  # every tie went to the smaller id
    assert {0, 2} <= set(np.unique(ar.tokens))  # both pairs occur
    # every decode-loop token was a tie, and was counted (the first comes from the prefill)
    assert ar.stats.greedy_near_ties == ar.stats.generated_tokens - 1
    fields, needs_draft = SPECS[how]
    draft = planted(dtype, seed=7, layers=1) if needs_draft else None  # drafts 0s and 2s
    sp = greedy(target, sj.SpecConfig(**fields), draft)
    assert sp.stats.proposed_tokens > 0 and sp.stats.accepted_tokens > 0
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
    assert sp.stats.greedy_near_ties == sp.stats.generated_tokens - 1


def test_a_tie_rule_that_depends_on_the_width_fails(monkeypatch, fresh_programs):
    """Broken on purpose: forwards over several positions (the verify) break ties towards the
    larger id, one-token steps towards the smaller. The speculative text leaves the
    autoregressive one."""
    first = sampling.argmax

    def by_width(x):
        if x.ndim >= 3 and x.shape[-2] > 1:
            return x.shape[-1] - 1 - first(x[..., ::-1])
        return first(x)
    monkeypatch.setattr(sampling, "argmax", by_width)
    target = planted()
    draft = planted(seed=7, layers=1)
    ar = greedy(target)
    sp = greedy(target, sj.SpecConfig(num_speculative_tokens=3), draft)
    assert not np.array_equal(sp.tokens, ar.tokens)


@pytest.mark.parametrize("margin,counted", [(2.0 ** -20, True), (2.0 ** -8, False)])
def test_near_ties_are_counted_and_clear_choices_are_not(margin, counted):
    target = planted(margin=margin)
    draft = planted(seed=7, layers=1)
    for out in (greedy(target), greedy(target, sj.SpecConfig(num_speculative_tokens=3), draft)):
        if not counted:  # a near tie may go either way: the column's rounding decides
            assert set(np.unique(out.tokens)) <= {0, 2}
        assert out.stats.greedy_near_ties == (out.stats.generated_tokens - 1 if counted else 0)


def test_near_ties_by_dtype():
    top = 8.0
    for dtype, tol in sampling.TIE_TOLERANCE.items():
        logits = jnp.array([[top, top - 0.5 * tol * top, 0.0],  # within the tolerance
                            [top, top - 2.0 * tol * top, 0.0],  # beyond it
                            [top, top, 0.0],  # exact
                            [0.5, 0.5 - 0.5 * tol, 0.0]])  # below 1: the tolerance is absolute
        np.testing.assert_array_equal(sampling.near_ties(logits, dtype),
                                      [True, False, True, True], err_msg=dtype)
    # sampled calls count nothing
    out = sj.generate(planted(), [PROMPT], sampling=sj.SamplingParams(temperature=1.0,
                                                                      max_new_tokens=8))
    assert out.stats.greedy_near_ties == 0


def test_a_parting_is_blamed_on_rounding_only_at_a_near_tie():
    """bench.parted_at_near_tie: the texts' first difference is checked against the target's
    logits there; a clear choice is not rounding."""
    from specjax.bench import parted_at_near_tie
    tie, clear = planted(), planted(margin=2.0 ** -8)
    a, b = np.array([0, 2, 0, -1]), np.array([0, 2, 1, -1])
    for model, want in ((tie, True), (clear, False)):
        head = greedy(model, n=2).tokens[0]  # the target's own first two tokens
        a[:2], b[:2] = head, head
        assert parted_at_near_tie(model, PROMPT, a, b) is want
    assert parted_at_near_tie(tie, PROMPT, a, a) is False  # they do not part


@pytest.mark.parametrize("seed,how", [(0, "chain"), (1, "chain"), (0, "tree"), (0, "ngram")])
def test_a_bfloat16_model_keeps_the_guarantee_it_states(seed, how):
    """A bfloat16 model without planted ties, greedy: speculation's text equals autoregressive
    decoding's, or the two part where the target's logits are a near tie that the speculative
    call counted (Stats.greedy_near_ties): what docs/design.md promises in low precision, for a
    chain's verify, a tree's (its own attention mask and positions) and n-gram's point masses."""
    from specjax.bench import parted_at_near_tie
    target = sj.checkpoint.cast(tiny_model(seed=10 + seed, vocab_size=64, hidden_size=32),
                                "bfloat16")
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12]]
    params = sj.SamplingParams(temperature=0, max_new_tokens=40)
    # the target drafting for itself (chain, tree): every round verifies 4 positions (a tree 6)
    # in one forward where autoregressive decoding ran one-token forwards
    spec = {"chain": sj.SpecConfig(num_speculative_tokens=3),
            "tree": sj.SpecConfig(tree=((0,), (1,), (0, 0), (1, 0), (0, 0, 0))),
            "ngram": sj.SpecConfig(method="ngram", num_speculative_tokens=3,
                                   prompt_lookup_min=1)}[how]
    sp = sj.generate(target, prompts, sampling=params, spec=spec,
                     draft=None if how == "ngram" else target)
    ar = sj.generate(target, prompts, sampling=params)
    if how == "ngram":  # the random target's text repeats itself: drafts found, each round
        # that finds some verifies in a forward of up to 4 tokens, accepted or not
        assert sp.stats.proposed_tokens > 40 and sp.stats.accepted_tokens > 0, sp.stats
    else:
        assert sp.stats.acceptance_rate > (0.9 if how == "chain" else 0.4), sp.stats
    for prompt, a, b in zip(prompts, sp.tokens, ar.tokens):
        if not np.array_equal(a, b):
            assert sp.stats.greedy_near_ties > 0
            assert parted_at_near_tie(target, prompt, a, b), (prompt, a, b)
