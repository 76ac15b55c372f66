"""The public API, fuzzed (issue 25): random small model configurations (grouped-query ratios,
head sizes, tied or untied embeddings, biases, q/k norms, sliding windows, Gemma 2's soft-caps
and local/global layers), random batches and prompt lengths, random sampling settings, every
method and trees, and inputs that are wrong on purpose. Each case either raises a clear
ValueError before anything compiles, or returns rows of the right lengths with tokens in the
vocabulary, whose greedy output equals autoregressive decoding's.

CI runs FUZZ_EXAMPLES cases (default 100); experiments/fuzz_api.py runs many more."""

import os

import jax
import numpy as np
import pytest
from conftest import release_programs
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import specjax as sj
from specjax import engine

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "100"))
V = 48

CONFIGS = [  # small, and different where it matters to the engine
    dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2),  # GQA 2:1
    dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
         tie_word_embeddings=True),  # MQA, wide heads, tied
    dict(hidden_size=24, num_attention_heads=2, num_key_value_heads=2, attention_bias=True,
         qk_norm=True),  # MHA, q/k/v biases, q/k norms
    dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
         o_proj_bias=True),  # a sliding window
    dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=24,
         sliding_window=3, layer_types=("sliding_attention", "full_attention"),
         attn_logit_softcapping=4.0, final_logit_softcapping=6.0, query_pre_attn_scalar=20.0,
         sandwich_norms=True, norm_unit_offset=True, scale_embeddings=True,
         hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True),  # Gemma 2's features
]
HEADS = ("medusa", "eagle", "dflash", "mtp")
METHODS = ("autoregressive", "draft_model", "ngram", "suffix", "lookahead", *HEADS, "tree")


@pytest.fixture(scope="module")
def pool():
    out = []
    for i, extra in enumerate(CONFIGS):
        cfg = sj.ModelConfig(vocab_size=V, intermediate_size=48, num_hidden_layers=2,
                             max_position_embeddings=96, **extra)
        target = sj.init_model(cfg, jax.random.key(i), init_std=0.4)
        small = sj.ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32,
                               num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, max_position_embeddings=96)
        drafts = {"draft_model": sj.init_model(small, jax.random.key(10 + i), init_std=0.4),
                  **{m: sj.init_heads(target, m, jax.random.key(20 + i), num_heads=4,
                                      block_size=4) for m in HEADS}}
        out.append((target, drafts))
    return out


_released = [0]  # engine.PROGRAMS.compiled when the programs were last released


@st.composite
def cases(draw):
    case = dict(
        config=draw(st.integers(0, len(CONFIGS) - 1)),
        method=draw(st.sampled_from(METHODS)),
        gamma=draw(st.integers(1, 4)),
        prompts=draw(st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=12),
                              min_size=1, max_size=3)),
        temperature=draw(st.sampled_from([0.0, 0.0, 0.7, 1.0])),
        top_k=draw(st.sampled_from([0, 5])),
        top_p=draw(st.sampled_from([1.0, 0.9])),
        max_new_tokens=draw(st.integers(1, 12)),
        seed=draw(st.integers(0, 2**31 - 1)),
        # one thing wrong on purpose, or nothing
        wrong=draw(st.sampled_from([None] * 6 + [
            "token_past_vocab", "negative_token", "empty_prompt", "no_prompts",
            "negative_temperature", "nan_temperature", "top_p_zero", "top_k_negative",
            "zero_new_tokens", "too_long", "gamma_zero", "unknown_method", "bad_tree",
            "string_prompt_without_tokenizer"])),
    )
    return case


def _request(case, pool):
    """(generate's keyword arguments, target) for a case, wrong on purpose when it says so."""
    target, drafts = pool[case["config"]]
    prompts = [list(p) for p in case["prompts"]]
    sampling = dict(temperature=case["temperature"], top_k=case["top_k"], top_p=case["top_p"],
                    max_new_tokens=case["max_new_tokens"])
    method, gamma = case["method"], case["gamma"]
    spec, draft = None, None
    if method == "tree":
        spec, draft = sj.SpecConfig(tree=((0,), (1,), (0, 0), (0, 0, 0))[:gamma]), \
            drafts["draft_model"]
    elif method != "autoregressive":
        spec = sj.SpecConfig(method=method, num_speculative_tokens=gamma,
                             **({"prompt_lookup_min": 1} if method == "ngram" else {}))
        draft = sj.draft.SuffixCache(64) if method == "suffix" else drafts.get(method)
    wrong = case["wrong"]
    if wrong == "token_past_vocab":
        prompts[0][-1] = V + 3
    elif wrong == "negative_token":
        prompts[0][0] = -2
    elif wrong == "empty_prompt":
        prompts[-1] = []
    elif wrong == "no_prompts":
        prompts = []
    elif wrong == "string_prompt_without_tokenizer":
        prompts[0] = "def f(x):"
    elif wrong == "too_long":
        prompts[0] = [1] * 90
        sampling["max_new_tokens"] = 12
    elif wrong == "gamma_zero":
        spec = {"method": "draft_model", "num_speculative_tokens": 0}
        draft = drafts["draft_model"]
    elif wrong == "unknown_method":
        spec = {"method": "medusa2", "num_speculative_tokens": 2}
    elif wrong == "bad_tree":
        spec = {"method": "draft_model", "tree": [[0], [0, 1]]}  # a node without its parent
        draft = drafts["draft_model"]
    return dict(prompts=prompts, sampling_kwargs=sampling, wrong=wrong, spec=spec,
                draft=draft), target


def _sampling(case, kwargs):
    bad = {"negative_temperature": ("temperature", -0.5),
           "nan_temperature": ("temperature", float("nan")), "top_p_zero": ("top_p", 0.0),
           "top_k_negative": ("top_k", -2), "zero_new_tokens": ("max_new_tokens", 0)}
    name, value = bad.get(case["wrong"], (None, None))
    return {**kwargs, **({name: value} if name else {})}


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(case=cases())
def test_the_api_either_refuses_clearly_or_decodes_right(pool, case):
    # Each compiled program holds hundreds of memory mappings and Linux allows a process 65,530
    # (see conftest._release_compiled_programs): a thousand cases in one test must let go of
    # them now and then (the on-disk compilation cache reads them back).
    if engine.PROGRAMS.compiled - _released[0] >= 40:
        release_programs()
        _released[0] = engine.PROGRAMS.compiled
    req, target = _request(case, pool)
    V_ = target.config.vocab_size
    before = engine.compiled_programs()
    try:
        sampling = sj.SamplingParams(**_sampling(case, req["sampling_kwargs"]))
        out = sj.generate(target, req["prompts"], sampling=sampling, spec=req["spec"],
                          draft=req["draft"], key=jax.random.key(case["seed"]))
    except ValueError as e:
        assert engine.compiled_programs() == before, f"compiled before refusing: {e}"
        assert str(e), "an error without a message"
        assert case["wrong"] is not None, f"a valid case was refused: {e}"
        event(f"refused: {case['wrong']}")
        return
    assert case["wrong"] is None, f"{case['wrong']} was accepted"
    event(f"decoded: {case['method']}, {'greedy' if sampling.temperature == 0 else 'sampled'}")
    B, max_new = len(req["prompts"]), sampling.max_new_tokens
    assert out.tokens.shape == (B, max_new) and out.lengths.shape == (B,)
    for b in range(B):
        n = int(out.lengths[b])
        assert 1 <= n <= max_new
        assert ((out.tokens[b, :n] >= 0) & (out.tokens[b, :n] < V_)).all()
        assert (out.tokens[b, n:] == -1).all()
    if sampling.temperature == 0 and req["spec"] is not None:
        ar = sj.generate(target, req["prompts"], sampling=sampling)
        np.testing.assert_array_equal(out.tokens, ar.tokens)
