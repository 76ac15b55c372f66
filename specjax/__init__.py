"""specjax: lossless speculative decoding in JAX.

    import jax, specjax as sj
    target = sj.init_model(sj.ModelConfig(...), jax.random.key(0))
    out = sj.generate(target, [[1, 5, 9]], sampling=sj.SamplingParams(temperature=0.7),
                      spec=sj.SpecConfig(method="draft_model", num_speculative_tokens=4),
                      draft=draft, key=jax.random.key(42))
"""

import warnings as _warnings

# Building blocks (pure functions, usable on their own)
from . import draft, roofline, sampling, shapes, testing, theory, verify
from .bundle import bundled
from .cache import KVCache

# Checkpoints
from .checkpoint import CheckpointError, load_model, save_model

# Compiled programs kept on disk between processes
from .compile_cache import set_compilation_cache

# Configuration
from .config import ModelConfig, RopeScaling, SamplingParams, SpecConfig

# Drafts: a separate draft model, and heads that ride on the target (Medusa, EAGLE)
from .draft import (
    DraftModel,
    DraftVocab,
    Heads,
    HeadsConfig,
    init_heads,
    load_draft_model,
    load_heads,
    save_heads,
)

# Generation
from .engine import (
    Generation,
    Logprobs,
    NonFiniteError,
    StreamChunk,
    Warmup,
    generate,
    stream,
    warmup,
)

# Models and caches
from .model import Model, forward, init_model, logits, prefill
from .sharding import make_mesh, shard
from .stats import Stats
from .tokenizer import Tokenizer, load_tokenizer, save_tokenizer

__version__ = "0.1.0"

__all__ = [
    "ModelConfig", "RopeScaling", "SamplingParams", "SpecConfig",
    "load_model", "save_model", "CheckpointError", "load_tokenizer", "save_tokenizer", "Tokenizer",
    "bundled",
    "Model", "init_model", "logits", "forward", "prefill", "KVCache",
    "DraftModel", "DraftVocab", "load_draft_model",
    "Heads", "HeadsConfig", "init_heads", "load_heads", "save_heads",
    "generate", "Generation", "Logprobs", "NonFiniteError", "stream", "StreamChunk", "warmup",
    "Warmup", "Stats",
    "make_mesh", "shard", "set_compilation_cache",
    "sampling", "verify", "theory", "draft", "shapes", "roofline", "testing",
]

# Old names, kept for one version: each use warns with the new name.
_RENAMED = {"Drafter": "Heads", "DrafterConfig": "HeadsConfig", "init_drafter": "init_heads",
            "load_drafter": "load_heads", "save_drafter": "save_heads"}


def __getattr__(name):
    if name in _RENAMED:
        _warnings.warn(f"sj.{name} is renamed sj.{_RENAMED[name]}", DeprecationWarning,
                       stacklevel=2)
        return globals()[_RENAMED[name]]
    if name == "drafter":
        _warnings.warn("specjax.drafter moved to specjax.draft.heads (networks, loading) and "
                       "specjax.draft.vocab (draft vocabularies)", DeprecationWarning,
                       stacklevel=2)
        import types

        from .draft import heads, vocab
        names = {k: v for m in (vocab, heads) for k, v in vars(m).items()
                 if not k.startswith("__")}
        names.update({old: names[new] for old, new in _RENAMED.items()},
                     DRAFTER_METHODS=heads.HEADS_METHODS)
        return types.SimpleNamespace(**names)
    raise AttributeError(f"module 'specjax' has no attribute {name!r}")
