"""sj.roofline: the bytes and FLOPs of a forward, and the knee where verifying stops being free."""

import jax
import pytest
from conftest import tiny_config

import specjax as sj
from specjax import roofline, timing


def test_forward_cost_by_hand():
    cfg = tiny_config(vocab_size=32, hidden_size=16, layers=2, heads=2, kv_heads=1,
                      tie_word_embeddings=True)
    model = sj.init_model(cfg, jax.random.key(0))
    cost = roofline.forward_cost(model, batch=4, width=3, context=10)
    # weights: every parameter in float32 (the tied table is the LM head)
    assert cost["weight_bytes"] == 4 * cfg.num_params
    # keys and values: 4 rows x 2 layers x (k, v) x 1 head x 8 dims x 10 slots x 4 bytes
    assert cost["kv_bytes"] == 4 * 2 * 2 * 1 * 8 * 10 * 4
    # products: 2 per weight per token; attention: 4 x heads x head_dim per slot attended
    # (10 cached, then on average (3 + 1) / 2 of the chunk) per token per layer
    assert cost["flops"] == 2 * cfg.num_params * 12 + 4 * 2 * 2 * 8 * 12 * 12
    # untied: a step reads one row of the input table, and no product runs over it
    untied = sj.init_model(tiny_config(vocab_size=32, hidden_size=16, layers=2, heads=2,
                                       kv_heads=1, tie_word_embeddings=False),
                           jax.random.key(0))
    table = 32 * 16
    cost = roofline.forward_cost(untied, batch=4, width=3, context=10)
    assert cost["weight_bytes"] == 4 * (untied.config.num_params - table)
    assert cost["flops"] == 2 * (untied.config.num_params - table) * 12 + 4 * 2 * 2 * 8 * 12 * 12


def test_the_knee_is_the_first_width_over_its_batchs_step(monkeypatch):
    """With forward times made up (batch 1 flat until width 5; batch 4 rising at once), the
    report finds each batch's knee, costs in that batch's steps, and the fractions."""
    made_up = {1: {1: 1.0, 2: 1.0, 4: 1.1, 5: 1.3, 8: 2.0}, 4: {1: 2.0, 2: 3.0, 4: 5.0,
                                                                5: 6.0, 8: 9.0}}
    monkeypatch.setattr(timing, "forward_timer",
                        lambda model, w, capacity, context, batch: lambda: made_up[batch][w])
    model = sj.init_model(tiny_config(), jax.random.key(0))
    r = roofline.report(model, batches=(1, 4), widths=(1, 2, 4, 5, 8), context=8, repeats=1,
                        bandwidth=1e9, flops=1e12)
    assert r["knee_width"] == {"1": 5, "4": 2} and r["knee_tokens"] == {"1": 5, "4": 8}
    cell = {(c["batch"], c["width"]): c for c in r["cells"]}
    assert cell[4, 8]["steps"] == 4.5
    cost = roofline.forward_cost(model, 4, 8, 8)
    assert cell[4, 8]["bandwidth_fraction"] == pytest.approx(
        (cost["weight_bytes"] + cost["kv_bytes"]) / 9.0 / 1e9)
    assert cell[4, 8]["flops_fraction"] == pytest.approx(cost["flops"] / 9.0 / 1e12)
    text = roofline.format_report(r)
    assert "width 5, 5 tokens per forward" in text and "width 2, 8 tokens per forward" in text
    with pytest.raises(ValueError, match="capacity 9 cannot hold context 8 \\+ width 8"):
        roofline.report(model, widths=(1, 8), context=8, capacity=9)


def test_timers_refuse_sizes_that_time_another_computation():
    """A forward whose writes run past the cache (they are dropped: another computation), a
    negative context (negative KV bytes) and no repeats (a StatisticsError after every
    forward compiled) are named before anything compiles."""
    model = sj.init_model(tiny_config(), jax.random.key(0))
    with pytest.raises(ValueError, match="context 12 \\+ T 8 tokens do not fit a cache of "
                                         "capacity 16"):
        timing.forward_timer(model, 8, 16, 12)
    with pytest.raises(ValueError, match="forward_timer's context must be an int >= 0"):
        timing.forward_timer(model, 1, 16, -1)
    for kw, message in [(dict(context=-1), "context must be an int >= 0, got -1"),
                        (dict(repeats=0), "repeats must be an int >= 1, got 0")]:
        with pytest.raises(ValueError, match="roofline report's " + message):
            roofline.report(model, batches=(1,), widths=(1,), **kw)
