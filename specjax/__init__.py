"""specjax: lossless speculative decoding in JAX.

    import jax, specjax as sj
    target = sj.init_model(sj.ModelConfig(...), jax.random.key(0))
    out = sj.generate(target, [[1, 5, 9]], sampling=sj.SamplingParams(temperature=0.7),
                      spec=sj.SpecConfig(method="draft_model", num_speculative_tokens=4),
                      draft=draft, key=jax.random.key(42))
"""

# Configuration
from .config import ModelConfig, RopeScaling, SamplingParams, SpecConfig

# Models and caches
from .model import Model, init_model, logits, forward
from .cache import KVCache

# Checkpoints
from .checkpoint import load_model, save_model, CheckpointError
from .tokenizer import load_tokenizer, Tokenizer

# Drafters that ride on the target (Medusa heads, EAGLE)
from .drafter import Drafter, DrafterConfig, init_drafter, load_drafter, save_drafter

# Generation
from .engine import generate, Generation
from .sharding import make_mesh, shard
from .stats import Stats

# Building blocks (pure functions, usable on their own)
from . import sampling, verify, theory, draft

__version__ = "0.1.0"

__all__ = [
    "ModelConfig", "RopeScaling", "SamplingParams", "SpecConfig",
    "load_model", "save_model", "CheckpointError", "load_tokenizer", "Tokenizer",
    "Model", "init_model", "logits", "forward", "KVCache",
    "Drafter", "DrafterConfig", "init_drafter", "load_drafter", "save_drafter",
    "generate", "Generation", "Stats", "make_mesh", "shard",
    "sampling", "verify", "theory", "draft",
]
