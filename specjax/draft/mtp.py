"""Multi-token prediction modules (``method="mtp"``): one small module per draft depth, chained
across depths at the row's last position.

After DeepSeek-V3's MTP modules, here trained post hoc on a frozen target
(``specjax train heads mtp``). Module k (k = 1 .. K) reads, at position j, the previous depth's
state h^{k-1}_j (the target's final-norm hidden state for k = 1, module k - 1's output after
that) and the target's embedding of token x_{j+k}; each passes an RMSNorm of its own, the two are
concatenated and projected (2E -> E), and one decoder layer (causal over the module's own cache)
and an RMSNorm give h^k_j, which the target's LM head (cut to the draft vocabulary) turns into
the distribution of x_{j+k+1}. The network is EAGLE's layer with input norms
(``heads.EagleNet``), one per module.

A round whose last token x_L sits at position L drafts at position L - 1: module 1 reads
(h^0_{L-1}, x_L) and proposes d_1 (for x_{L+1}); module 2 reads (h^1_{L-1}, d_1) and proposes
d_2; and so on, γ <= K modules, one forward each. Unlike EAGLE no module feeds on its own
predicted state at a later position: module k's state at j depends only on the tokens up to
j + k. Drafts are sampled from each module's processed distribution q (argmax point masses when
greedy), so the verifier's sampled-draft rule keeps the output exactly the target's.

Caches. Slot j of module k's cache holds its entry at position j, built from h^{k-1}_j and
x_{j+k}. The entry is final once x_{j+k} is known (j <= L - k); the entries L - k + 1 .. L - 1,
which the draft at L - 1 attends to, read this round's drafts d_1 .. d_{k-1} where training read
the true tokens (the same, when the drafts are right). So in each round module k rewrites its
slots from s_k = start - k + 1 to L - 1 in one forward of γ + k positions (start: the previous
round's length, where the last verification began, ``Features.start``): the entries made final
by the tokens just accepted, and those reading this round's drafts. Its inputs h^{k-1}_j come
from module k - 1's forward this round (positions s_k + 1 ..) and, at s_k itself, from the
output module k - 1 saved the round before (its last final entry then). Module 1 reads the
target's hidden states of the last verification. A prompt shorter than a module's depth clamps
s_k at 0.

After prefill every module writes its final prompt entries (j <= P - 1 - k), chunk by chunk,
with the modules chained inside each chunk (module k at j needs module k - 1 at the same j).

Parameters (``Heads.params["weights"]``): {"0": module 1, ..., "K-1": module K}, each
{"hnorm", "enorm", "fc" [2E, E], "layer" (a DecoderLayer), "norm"}. How a checkpoint that ships
MTP weights maps onto them: docs/mtp.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array

from .. import sampling
from ..cache import KVCache
from ..model import PREFILL_CHUNK, over_chunks
from .base import Draft, draw_scored, stack_chain
from .heads import eagle_forward, embed
from .rider import Features, RiderProposer, check_heads, spec_tree


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPState:
    caches: tuple[KVCache, ...]  # one one-layer cache per module in use (γ of them)
    saved: Array  # [B, γ - 1, E]: module m's output at position start - m (m = 1 .. γ - 1)
    features: Features  # the target's hidden states from the last verification


@dataclasses.dataclass(frozen=True)
class MTPProposer(RiderProposer):
    def _module(self, params, k: int, feats: Array, tokens: Array, positions: Array,
                cache: KVCache) -> tuple[Array, KVCache]:
        """Module k (1-based) on states feats [B, T, E] and tokens [B, T] at positions."""
        return eagle_forward(self.config, params["heads"]["weights"][str(k - 1)], feats,
                             embed(params["target"], tokens), positions, cache)

    def init(self, params, prompts: Array, prompt_lengths: Array, capacity: int,
             hidden: Array) -> MTPState:
        """Every module's final prompt entries; module m's output at P - 1 - m saved."""
        B, P = prompts.shape
        G = self.chain
        chunk = min(PREFILL_CHUNK, P)
        N = P + -P % chunk
        tokens = jnp.pad(prompts, ((0, 0), (0, N - P + G)))  # x_{j+k} for every j < N
        feats = jnp.pad(hidden[:, :P], ((0, 0), (0, N - min(P, hidden.shape[1])), (0, 0)))
        rows = jnp.arange(B)
        caches = tuple(KVCache.init(self.config.layer, B, capacity + 2 * G + 1)
                       for _ in range(G))
        saved = jnp.zeros((B, G - 1, hidden.shape[-1]), hidden.dtype)

        def step(carry, start):
            caches, saved = carry
            positions = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
            h = jax.lax.dynamic_slice_in_dim(feats, start, chunk, axis=1)
            out = []
            for k in range(1, G + 1):
                x = jax.lax.dynamic_slice_in_dim(tokens, start + k, chunk, axis=1)
                h, cache = self._module(params, k, h, x, positions,
                                        caches[k - 1].rollback(jnp.full((B,), start, jnp.int32)))
                out.append(cache)
                if k < G:  # module k's output at P - 1 - k, if this chunk holds it
                    index = prompt_lengths - 1 - k - start
                    inside = (index >= 0) & (index < chunk)
                    pick = h[rows, jnp.clip(index, 0, chunk - 1)].astype(saved.dtype)
                    saved = saved.at[:, k - 1].set(
                        jnp.where(inside[:, None], pick, saved[:, k - 1]))
            return tuple(out), saved

        caches, saved = over_chunks(step, (caches, saved), prompt_lengths, chunk)
        caches = tuple(c.rollback(jnp.maximum(prompt_lengths - k, 0))
                       for k, c in enumerate(caches, 1))
        return MTPState(caches, saved, Features.from_prompt(hidden, prompt_lengths, self.width))

    def observe(self, state: MTPState, start: Array, hidden: Array) -> MTPState:
        return MTPState(state.caches, state.saved, Features(hidden, start))

    def propose(self, params, state: MTPState, history: Array, length: Array, keys: Array,
                sampling_params: sampling.SamplingArrays, filters: sampling.Filters,
                active: Array | None = None) -> tuple[Draft, MTPState]:
        p, G = params["heads"], self.chain
        # adaptive lengths (specjax/adaptive.py): module k's confidence is read from its
        # distribution before its draw. Every module still runs every round: each must rewrite
        # the entries the accepted tokens made final, which a skipped module would leave stale.
        control = self.control(params, sampling_params, active) if self.adaptive else None
        vocab = p["vocab"]
        f = state.features
        B, S = history.shape
        rows = jnp.arange(B)[:, None]
        step_keys = jax.vmap(lambda k: jax.random.split(k, G))(keys)  # [B, G]
        tokens, probs, caches, saved = [], [], [], []
        prev = None  # module k - 1's outputs this round [B, G + k - 1, E]
        for k in range(1, G + 1):
            W = G + k
            first = f.start - k + 1  # s_k before clamping
            s = jnp.maximum(first, 0)
            positions = s[:, None] + jnp.arange(W, dtype=jnp.int32)[None, :]
            if k == 1:
                h = f.feats  # positions start .. start + G: s_1 = start, W = G + 1
            else:  # position s_k: saved last round; s_k + 1 ..: module k - 1 this round
                shifted = jnp.concatenate(
                    [state.saved[:, k - 2][:, None].astype(prev.dtype), prev[:, :W - 1]], axis=1)
                aligned = jnp.pad(prev, ((0, 0), (0, 1), (0, 0)))  # clamped: s_k = s_{k-1} = 0
                h = jnp.where((first < 0)[:, None, None], aligned, shifted)
            index = positions + k  # the token each entry reads: x_{j+k}
            x = history[rows, jnp.minimum(index, S - 1)]
            if k > 1:  # past the last token: this round's drafts
                drafted = jnp.stack(tokens, axis=1)[rows, jnp.clip(index - length[:, None] - 1,
                                                                   0, k - 2)]
                x = jnp.where(index <= length[:, None], x, drafted)
            out, cache = self._module(params, k, h, x, positions,
                                      state.caches[k - 1].rollback(s))
            caches.append(cache)
            token, q, score = draw_scored(vocab.logits(_at(out, length - 1 - s)),
                                          step_keys[:, k - 1], sampling_params, filters, vocab,
                                          scored=control is not None)
            if control is not None:
                control.step(score)
            tokens.append(token)
            probs.append(q)
            if k < G:  # final: module k + 1 reads it at s_{k+1} next round
                saved.append(_at(out, length - k - s))
            prev = out
        saved = (jnp.stack(saved, axis=1).astype(state.saved.dtype) if saved
                 else state.saved)
        chain = stack_chain(tokens, probs, vocab, self.config.vocab_size)
        if control is not None:
            valid, predicted = control.arrays()
            chain = dataclasses.replace(chain, valid=valid, predicted=predicted)
        return chain, MTPState(tuple(caches), saved, f)


def _at(x: Array, index: Array) -> Array:
    """x[b, index[b]] for x [B, W, E] (index clipped into [0, W - 1]: a finished row's is
    out of range and its drafts are never read)."""
    return x[jnp.arange(x.shape[0]), jnp.clip(index, 0, x.shape[1] - 1)]


def build(spec, heads, target):
    """The registry's builder for "mtp": the proposer for ``heads`` (MTP modules trained for
    this target), after checking they fit the target and the spec."""
    c = check_heads("mtp", heads, target)
    spec_tree(spec, c)  # a chain (the registry refuses trees): γ <= K
    return MTPProposer(c, spec.num_speculative_tokens, None, spec.survival_threshold,
                       spec.budget)
