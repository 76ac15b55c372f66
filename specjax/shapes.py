"""Model shapes from the field, for measuring with random weights (nothing is downloaded).

The shapes of common targets' published ``config.json`` files, and a small draft for each, so a
benchmark can run at a realistic size where no trained pair is at hand (random weights accept
nothing: pair them with ``SpecConfig(synthetic_acceptance=...)``). Only shapes: weights come from
``sj.init_model``.

    target = sj.init_model(sj.shapes.target_config("llama-3.2-1b", dtype="bfloat16"), key)
"""

from __future__ import annotations

from .config import ModelConfig

TARGETS = {
    # name: ModelConfig fields as in the model's config.json (published parameter count)
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, tie_word_embeddings=True, rope_theta=500000.0),  # 1.24B
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, rope_theta=500000.0),  # 8.03B
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, qk_norm=True, tie_word_embeddings=True,
                       rope_theta=1000000.0),  # 0.60B
    "qwen3-4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, qk_norm=True, tie_word_embeddings=True,
                     rope_theta=1000000.0),  # 4.02B
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 tie_word_embeddings=True),  # a CPU-sized stand-in
}


def names() -> list[str]:
    return sorted(TARGETS)


def _fields(name: str) -> dict:
    if name not in TARGETS:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(names())}")
    return TARGETS[name]


def target_config(name: str, *, dtype: str = "float32",
                  max_position_embeddings: int = 4096) -> ModelConfig:
    """The shape ``name`` (``names()``) as a ModelConfig (plain RoPE, whatever scaling the real
    model uses: it changes no cost)."""
    return ModelConfig(**_fields(name), dtype=dtype,
                       max_position_embeddings=max_position_embeddings)


def draft_config(name: str, *, dtype: str = "float32",
                 max_position_embeddings: int = 4096) -> ModelConfig:
    """A small draft for target shape ``name``: one layer a quarter of the target's width (at
    least 32), 64-wide heads (at least 2 heads, so narrower for the tiny shape), the target's
    vocabulary with tied embeddings."""
    t = _fields(name)
    width = max(32, t["hidden_size"] // 4)
    heads = max(2, width // 64)
    return ModelConfig(vocab_size=t["vocab_size"], hidden_size=width,
                       intermediate_size=3 * width, num_hidden_layers=1,
                       num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                       head_dim=width // heads, tie_word_embeddings=True, dtype=dtype,
                       max_position_embeddings=max_position_embeddings)
