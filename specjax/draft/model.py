"""Drafts from an independent small model with its own KV cache.

Each round the draft runs γ forwards: one two-token forward, then γ - 1 single-token forwards
under ``lax.scan``. The first forward re-feeds the token before the last one, at slot length - 1:

* if the previous round rejected a draft, that slot already holds exactly this token (recomputed,
  identical), and rewriting it also rolls back everything after it;
* if the previous round accepted all γ drafts, the draft model never saw its own last draft d_γ
  (it only proposed it), and this write is how it catches up, without a data-dependent shape.

So the draft cache never needs to be told what was accepted: rollback is setting its length to
length - 1 before the write.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array

from .. import model as model_lib
from .. import sampling
from ..cache import KVCache
from ..config import ModelConfig
from . import Draft


@dataclasses.dataclass(frozen=True)
class DraftModelProposer:
    config: ModelConfig  # the draft model's config (same vocabulary as the target)
    gamma: int  # drafts per round

    def init(self, params, prompts: Array, prompt_lengths: Array, capacity: int) -> KVCache:
        """Prefill the draft cache with the prompts [B, P] (right-padded)."""
        B, P = prompts.shape
        positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
        cache = KVCache.init(self.config, B, capacity)
        _, _, cache = model_lib.forward(model_lib.Model(self.config, params), prompts, positions,
                                        cache)
        return cache.rollback(prompt_lengths)

    def propose(self, params, cache: KVCache, history: Array, length: Array, keys: Array,
                sampling_params: sampling.SamplingArrays, filters: sampling.Filters
                ) -> tuple[Draft, KVCache]:
        draft = model_lib.Model(self.config, params)
        rows = jnp.arange(history.shape[0])
        prev, last = history[rows, length - 1], history[rows, length]
        step_keys = jax.vmap(lambda k: jax.random.split(k, self.gamma))(keys)  # [B, G]

        # Two-token catch-up forward at slots length-1, length (see module docstring).
        cache = cache.rollback(length - 1)
        logits, _, cache = model_lib.forward(
            draft, jnp.stack([prev, last], 1), jnp.stack([length - 1, length], 1), cache)
        q = sampling.process_logits(logits[:, -1], sampling_params, filters)  # [B, V]
        token = sampling.sample(step_keys[:, 0], q)

        def step(carry, i):
            cache, token = carry
            logits, _, cache = model_lib.forward(draft, token[:, None], (length + i)[:, None],
                                                 cache)
            q = sampling.process_logits(logits[:, 0], sampling_params, filters)
            nxt = sampling.sample(step_keys[:, i], q)
            return (cache, nxt), (nxt, q)

        tokens, probs = token[:, None], q[:, None]
        if self.gamma > 1:
            (cache, _), (more, more_q) = jax.lax.scan(step, (cache, token),
                                                      jnp.arange(1, self.gamma))
            tokens = jnp.concatenate([tokens, more.T], axis=1)  # [B, G]
            probs = jnp.concatenate([probs, jnp.moveaxis(more_q, 0, 1)], axis=1)  # [B, G, V]
        return Draft(tokens, probs), cache
