"""A block drafter (``method="dflash"``): all of a round's drafts from one parallel forward.

After DFlash (block diffusion drafting, 2026), written for this engine. A few decoder layers in
the target's layer shape read a block of γ + 1 positions: the row's last token (embedded with the
target's own embedding) followed by γ copies of a learned mask vector, at positions length ..
length + γ. Attention inside the block is bidirectional; every block position also sees the
context, and the context is the target's own view of it: the outputs of a few target layers
(``taps``) at each past position, concatenated, fused by a projection and an RMSNorm, and passed
through each drafter layer's own input norm and K/V projections into that layer's cache ("KV
injection"). The block's output at position length + j, through the target's LM head (cut to
the draft vocabulary), is the distribution of draft j. One forward gives all γ of them, so a
longer block costs little more than a shorter one.

The drafts of a round are drawn independently, each from its own position's distribution (argmax
point masses when greedy); draft j's q does not depend on the drafts before it, which the
verifier allows (a draft may come from any distribution fixed before it is drawn), so the output
is the target's distribution exactly.

Trees (``SpecConfig.tree``): the block runs over the tree's depth, and every node at depth d takes
as children the same candidates of position d + 1: as many top-ranked tokens as that depth's nodes
have children (``Tree.ranks_under``) when greedy, as many draws without replacement from its q when
sampled (one draw per depth, shared by the nodes at that depth). Position d + 1's q does not depend
on the tokens above it and each depth's draw has its own key, so whichever node the verifier
reaches, its children are a fresh draw from the q it reports (``Draft.probs``), as recursive
rejection sampling needs.

Cache: slot t holds the injected keys and values of the target's features at position t. Each
round first injects the features the last verification produced (along the accepted path, from
``Features.start``), then rolls back to ``length``: everything at or past it is stale. The block's
own keys and values are written at slots length .. length + γ during the forward and dropped.
The drafter's cache has ``block_size + 1`` more slots than the target's, so a block never runs out
of room. After prefill every prompt position's features are injected at once.

Training (``specjax train heads dflash``, specjax/train/heads.py) scores the block at random
anchor positions of the target's own text against the target's distributions, with the block cut
at a random length per anchor, so a drafter trained for blocks of 16 drafts any γ ≤ 16.

Parameters (``Heads.params["weights"]``)::

    fuse/kernel      [len(taps) * E, E]   the tapped features, fused
    fuse_norm/weight [E]
    mask             [E]                  the embedding of a position still to be drafted
    layers/<i>/...   a DecoderLayer each (the target's layer shape, its own MLP width)
    norm/weight      [E]                  before the LM head
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array

from .. import sampling
from ..attention import BLOCK, current_block
from ..cache import KVCache, write_chunk
from ..model import Layers, RMSNorm, apply_rope, rope_tables
from ..model import view as model_view
from .base import Draft, draw_scored, expand_tree, tree_candidates
from .heads import HeadsConfig, embed
from .rider import Features, RiderProposer, check_heads, spec_tree


class DFlashNet(nn.Module):
    """The block drafter's network: ``context`` fuses tapped features; ``__call__`` runs a block."""

    config: HeadsConfig
    init_std: float = 0.02
    block: int = BLOCK  # slots per attention block

    def setup(self):
        cfg = self.config.layer
        dtype = jnp.dtype(cfg.dtype)
        self.fuse = nn.Dense(cfg.hidden_size, use_bias=False, dtype=dtype, param_dtype=dtype,
                             kernel_init=nn.initializers.normal(self.init_std))
        self.fuse_norm = RMSNorm(cfg.rms_norm_eps, dtype)
        self.mask = self.param("mask", nn.initializers.normal(self.init_std), (cfg.hidden_size,),
                               dtype)
        self.layers = Layers(cfg, self.init_std, self.block)
        self.norm = RMSNorm(cfg.rms_norm_eps, dtype)

    def context(self, feats: Array) -> Array:
        """Tapped target features [..., len(taps) * E] -> the fused context vector [..., E]."""
        return self.fuse_norm(self.fuse(feats.astype(self.mask.dtype)))

    def __call__(self, embeds: Array, view, k: Array, v: Array):
        """A block [B, T, E] (embeddings: the last token's, then the mask's) -> its outputs
        [B, T, E] after the final norm, and the cache with the block written at view.length."""
        cos, sin = rope_tables(view.positions, self.config.layer)
        (x, k, v, _, _), _, _ = self.layers(
            (embeds.astype(self.mask.dtype), k, v, None, None), ((cos, sin), (cos, sin)), view)
        return self.norm(x), k, v

    def init_all(self, feats, embeds, view, k, v):
        self.context(feats)
        return self(embeds, view, k, v)


def init_weights(config: HeadsConfig, key: Array, init_std: float = 0.02):
    """Fresh weights for ``config`` (a dflash HeadsConfig)."""
    return _init_weights(config, float(init_std), key)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_weights(config: HeadsConfig, init_std: float, key: Array):
    """init_weights: one program per (config, init_std), traced and compiled once per process."""
    layer = config.layer
    dtype = jnp.dtype(layer.dtype)
    cache = KVCache.init(layer, 1, 1)
    positions = jnp.zeros((1, 1), jnp.int32)
    E = layer.hidden_size
    return DFlashNet(config, init_std).init(
        key, jnp.zeros((1, 1, len(config.taps) * E), dtype), jnp.zeros((1, 1, E), dtype),
        model_view(cache, positions, None, None), cache.k, cache.v, method="init_all")["params"]


def inject(config: HeadsConfig, weights, feats: Array, cache: KVCache) -> KVCache:
    """Write the tapped target features feats [B, W, len(taps) * E] of positions cache.length ..
    + W - 1 into every layer's cache as keys and values: each layer's input norm and K/V
    projections (and K norm, RoPE) applied to the fused context vector. Returns the cache with
    length + W."""
    cfg = config.layer
    B, W, _ = feats.shape
    K, D = cfg.num_key_value_heads, cfg.head_dim
    ctx = DFlashNet(config).apply({"params": weights}, feats, method="context")
    positions = cache.length[:, None] + jnp.arange(W, dtype=jnp.int32)[None, :]
    cos, sin = rope_tables(positions, cfg)
    ks, vs = [], []
    for i in range(cfg.num_hidden_layers):
        p = weights["layers"][str(i)]
        h = _norm(cfg, p["input_layernorm"], ctx)
        attn = p["self_attn"]
        k = _dense(attn["k_proj"], h).reshape(B, W, K, D)
        v = _dense(attn["v_proj"], h).reshape(B, W, K, D)
        if cfg.qk_norm:
            k = _norm(cfg, attn["k_norm"], k)
        ks.append(apply_rope(k, cos, sin).astype(cache.k.dtype))
        vs.append(v.astype(cache.v.dtype))
    return write_chunk(cache, jnp.stack(ks), jnp.stack(vs))


def _norm(cfg, params, x):
    return RMSNorm(cfg.rms_norm_eps, jnp.dtype(cfg.dtype), cfg.norm_unit_offset).apply(
        {"params": params}, x)


def _dense(params, x):
    y = x @ params["kernel"]
    return y + params["bias"] if "bias" in params else y


def run_block(config: HeadsConfig, weights, target_params, last: Array, positions: Array,
              cache: KVCache, chunk_mask: Array | None = None, block: int | None = None
              ) -> Array:
    """The block forward: the last tokens [B] at positions[:, 0], mask vectors after them, at
    positions [B, T]; the cache holds the context (slots < cache.length). chunk_mask [B, T, T]
    (default: all of the block sees all of it). block: cache slots per attention block (default
    ``attention.current_block()``; training passes the capacity: one dense softmax, which can
    be differentiated). Returns the block's outputs [B, T, E]."""
    B, T = positions.shape
    mask = weights["mask"]
    embeds = jnp.concatenate([embed(target_params, last)[:, None].astype(mask.dtype),
                              jnp.broadcast_to(mask, (B, T - 1, mask.shape[0]))], axis=1)
    if chunk_mask is None:
        chunk_mask = jnp.ones((T, T), bool)
    block = current_block() if block is None else block
    out, _, _ = DFlashNet(config, block=block).apply(
        {"params": weights}, embeds, model_view(cache, positions, chunk_mask, None, block),
        cache.k, cache.v)
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DFlashState:
    cache: KVCache  # the drafter's layers' cache: injected context keys and values
    features: Features  # the tapped target features from the last verification


@dataclasses.dataclass(frozen=True)
class DFlashProposer(RiderProposer):
    @property
    def taps(self) -> tuple[int, ...]:
        """The target layers whose outputs the engine hands this proposer."""
        return self.config.taps

    @property
    def draft_forwards_per_round(self) -> int:
        return 1

    def init(self, params, prompts: Array, prompt_lengths: Array, capacity: int,
             hidden: Array) -> DFlashState:
        """Inject every prompt position's features (slots past the capacity are dropped)."""
        B = prompts.shape[0]
        cache = KVCache.init(self.config.layer, B, capacity + self.config.block_size + 1)
        cache = inject(self.config, params["heads"]["weights"], hidden, cache)
        return DFlashState(cache.rollback(prompt_lengths),
                           Features.from_prompt(hidden, prompt_lengths, self.width))

    def observe(self, state: DFlashState, start: Array, hidden: Array) -> DFlashState:
        return DFlashState(state.cache, Features(hidden, start))

    def propose(self, params, state: DFlashState, history: Array, length: Array, keys: Array,
                sampling_params: sampling.SamplingArrays, filters: sampling.Filters,
                active: Array | None = None) -> tuple[Draft, DFlashState]:
        p, G = params["heads"], self.depth
        f = state.features
        cache = inject(self.config, p["weights"], f.feats,
                       state.cache.rollback(f.start)).rollback(length)
        B = length.shape[0]
        last = history[jnp.arange(B), length]
        positions = length[:, None] + jnp.arange(G + 1, dtype=jnp.int32)[None, :]
        out = run_block(self.config, p["weights"], params["target"], last, positions, cache)
        logits = p["vocab"].logits(out[:, 1:])  # [B, G, M]
        if self.tree is not None:
            return self._tree(logits, keys, sampling_params, filters, p["vocab"]), DFlashState(
                cache, f)
        step_keys = jax.vmap(lambda k: jax.random.split(k, G))(keys)  # [B, G]
        # All G drafts in one draw over B * G rows, each with its row's sampling settings.
        per_draft = jax.tree.map(lambda x: jnp.repeat(x, G, axis=0), sampling_params)
        tokens, q, score = draw_scored(logits.reshape(B * G, -1), step_keys.reshape(-1),
                                       per_draft, filters, p["vocab"], scored=self.adaptive)
        q = None if q is None else p["vocab"].widen(q.reshape(B, G, -1), self.config.vocab_size)
        draft = Draft(tokens.reshape(B, G), q)
        if self.adaptive:
            # Adaptive lengths (specjax/adaptive.py): draft j's confidence is the largest
            # probability of position j's own distribution, which no draft of the block depends
            # on; all of them come from the one forward, so there are no draft steps to skip.
            control = self.control(params, sampling_params, active)
            score = score.reshape(B, G)
            for j in range(G):
                control.step(score[:, j])
            valid, predicted = control.arrays()
            draft = dataclasses.replace(draft, valid=valid, predicted=predicted)
        return draft, DFlashState(cache, f)

    def _tree(self, logits: Array, keys: Array, sampling_params: sampling.SamplingArrays,
              filters: sampling.Filters, vocab) -> Draft:
        """The tree's nodes from the block's per-position logits [B, depth, M]."""
        B, tree = logits.shape[0], self.tree

        def candidates(d):  # the children of any node at depth d: position d + 1's
            level_keys = jax.vmap(lambda k: jax.random.fold_in(k, d))(keys)
            return tree_candidates(logits[:, d:d + 1], tree.ranks_under(d), level_keys,
                                   sampling_params, filters, vocab)

        def expand(d, level, parent):  # the same candidates under every node of the level
            ids, q = candidates(d + 1)
            n = level.shape[1]
            return (jnp.broadcast_to(ids, (B, n, ids.shape[-1])),
                    None if q is None else jnp.broadcast_to(q, (B, n, q.shape[-1])))

        tokens, q = expand_tree(self.tree, candidates(0), expand, vocab, self.config.vocab_size)
        return Draft(tokens, q)


def build(spec, heads, target):
    """The registry's builder for "dflash": the proposer for ``heads`` (a dflash sj.Heads
    trained for this target), after checking it fits the target and the spec."""
    c = check_heads("dflash", heads, target)
    if max(c.taps) >= target.num_hidden_layers:
        raise ValueError(f"the block drafter reads target layers {c.taps}; the target has "
                         f"{target.num_hidden_layers}")
    return DFlashProposer(c, spec.num_speculative_tokens, spec_tree(spec, c),
                          spec.survival_threshold, spec.budget)
