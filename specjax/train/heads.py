"""Training drafters that ride on a frozen target: Medusa heads, EAGLE, MTP modules and the
block drafter (optax, orbax resume via ``fit``).

All learn what the target will say, not what the corpus says (self-distillation): every batch
runs the frozen target once for its hidden states and its next-token distributions p_t, and the
heads are scored against those distributions restricted to the draft vocabulary.

* Medusa: head k on h_t against p_{t+k} (the target's distribution for token t + k + 1), summed
  over heads with weights 0.8^(k-1) (later heads are harder; Medusa-1 weights them down too).
* EAGLE: the head reads (f_t, x_{t+1}) for every t with the true features (teacher forcing) and
  is scored on the feature it predicts for t + 1: a smooth-L1 regression to f_{t+1} plus the
  cross-entropy of its logits against p_{t+1}.
* MTP: module k reads (h^{k-1}_t, x_{t+k}) at every t with the true tokens, h^0 the target's
  features and h^{k-1} module k - 1's own outputs (the chain is trained end to end), and is
  scored by the cross-entropy against p_{t+k}, weighted HEAD_DECAY^(k-1).
* dflash: see ``_dflash_terms``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import pathlib
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..bundle import bundled
from ..cache import KVCache
from ..config import ModelConfig
from ..draft import heads as heads_lib
from ..draft.heads import Heads, HeadsConfig
from ..draft.vocab import DraftVocab, frequent_tokens, lm_head
from ..files import write_atomic
from ..model import Model, forward
from .data import sample_batch, sample_rows
from .loop import (
    POSITION_BINS,
    TrainConfig,
    check_stream,
    configure_logging,
    digest,
    eval_log,
    fit,
    read_evals,
)

log = logging.getLogger(__name__)

HEAD_DECAY = 0.8  # Medusa: weight of head k is HEAD_DECAY ** (k - 1)


def _target_outputs(target: ModelConfig, target_params, inputs, taps=()):
    """The frozen target on inputs [B, T]: logits [B, T, V] and hidden [B, T, E] (float32; with
    ``taps``, those layers' outputs [B, T, len(taps) * E])."""
    B, T = inputs.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits, hidden, _ = forward(Model(target, target_params), inputs, positions,
                                KVCache.init(target, B, T), taps=taps)
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(hidden.astype(jnp.float32))


def anchors_per_sequence(seq_len: int) -> int:
    """dflash: blocks scored per training sequence, one per 16 tokens (at least 8)."""
    return max(8, seq_len // 16)


def _dflash_terms(drafter: HeadsConfig, weights, target_params, draft_vocab: DraftVocab,
                  inputs, t_logits, feats) -> tuple[Term, ...]:
    """The block drafter at ``anchors_per_sequence`` random anchors a per sequence: the
    context (features of positions < a) injected, the block [x_a, mask, ...] at positions a ..
    a + G, cut at a random length g per anchor (block positions past g are invisible and
    unscored), each draft position j scored by the cross-entropy against the target's
    distribution for token a + j, weighted HEAD_DECAY^(j - 1) (one term, at position a).
    Anchors and lengths are a function of the batch, so a resumed run sees the same ones."""
    from ..draft import dflash
    B, T = inputs.shape
    G = drafter.block_size
    if T < G + 2:
        raise ValueError(f"dflash training needs seq_len >= block_size + 2 = {G + 2}, got {T}")
    spread = jnp.arange(inputs.size, dtype=jnp.uint32).reshape(inputs.shape)
    mix = jnp.sum(inputs.astype(jnp.uint32) * (spread * jnp.uint32(2654435761) + 1))
    key = jax.random.fold_in(jax.random.key(0), mix.astype(jnp.int32))
    k_anchor, k_length = jax.random.split(key)
    ANCHORS = anchors_per_sequence(T)  # noqa: N806
    anchors = jax.random.randint(k_anchor, (B, ANCHORS), 1, T - G + 1).reshape(-1)  # [R]
    lengths = jax.random.randint(k_length, (B * ANCHORS,), 1, G + 1)  # g per block
    cache = dflash.inject(drafter, weights, feats, KVCache.init(drafter.layer, B, T + G + 1))
    rows = jnp.repeat(jnp.arange(B), ANCHORS)
    cache = KVCache(jnp.repeat(cache.k, ANCHORS, axis=1), jnp.repeat(cache.v, ANCHORS, axis=1),
                    anchors)  # each block sees the context before its anchor
    index = jnp.arange(G + 1)
    visible = index[None, None, :] <= lengths[:, None, None]  # [R, 1, G+1]: keys past g hidden
    chunk_mask = jnp.broadcast_to(visible, (B * ANCHORS, G + 1, G + 1))
    positions = anchors[:, None] + index[None, :]
    out = dflash.run_block(drafter, weights, target_params, inputs[rows, anchors], positions,
                           cache, chunk_mask, block=cache.capacity)  # dense: differentiable
    logits = draft_vocab.logits(out[:, 1:].astype(jnp.float32))  # [R, G, M]
    target = t_logits[rows[:, None], anchors[:, None] + index[None, :G]]  # for tokens a + j
    ce = _soft_ce(target, draft_vocab.ids, logits)  # [R, G]
    j = jnp.arange(1, G + 1)
    w = HEAD_DECAY ** (j - 1)[None, :] * (j[None, :] <= lengths[:, None])
    return (Term(1.0, ce, w, jnp.broadcast_to(anchors[:, None], ce.shape)),)


def _mtp_terms(drafter: HeadsConfig, weights, target_params, draft_vocab: DraftVocab, batch,
               t_logits, hidden) -> tuple[Term, ...]:
    """The MTP modules over a batch [B, T + 1] with teacher-forced tokens: module k at position
    t reads x_{t+k} and the previous depth's state at t, and is scored where t + k < T (the
    target's distribution for token t + k + 1 is t_logits[:, t + k]); a term per module, at
    position t + k."""
    B, T = t_logits.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h, terms = hidden, []
    for k in range(1, drafter.num_heads + 1):
        tokens = jnp.pad(batch[:, k:], ((0, 0), (0, k - 1)))  # x_{t+k}; past the batch: padding
        h, _ = heads_lib.eagle_forward(drafter, weights[str(k - 1)], h,
                                       heads_lib.embed(target_params, tokens), positions,
                                       KVCache.init(drafter.layer, B, T))
        logits = draft_vocab.logits(h[:, :T - k].astype(jnp.float32))
        ce = _soft_ce(t_logits[:, k:], draft_vocab.ids, logits)
        terms.append((HEAD_DECAY ** (k - 1), ce, positions[:, :T - k] + k))  # reads x_{t+k}
    return _decayed(terms)


def _soft_ce(target_logits, vocab, draft_logits):
    """Cross-entropy [...] of draft logits [..., M] against the target's distribution restricted
    to the draft vocabulary (mass outside it cannot be matched and is left out)."""
    p = jax.nn.softmax(target_logits, axis=-1)[..., vocab]
    return -jnp.sum(p * jax.nn.log_softmax(draft_logits, axis=-1), axis=-1)


class Term(NamedTuple):
    """One part of a drafter's objective: ``coef`` × the ``weights``-weighted mean of
    ``values``; ``positions`` (same shape) is the context position each value is scored at: the
    position of the last token its draft reads (``HeadsObjective.by_position`` bins by it)."""

    coef: float
    values: jax.Array
    weights: jax.Array
    positions: jax.Array


def _decayed(parts) -> tuple[Term, ...]:
    """Terms for depths k = 1, 2, ... given as (HEAD_DECAY^(k-1), values, positions): each
    depth's plain mean, weighted by its decay over the decays' sum."""
    norm = sum(w for w, _, _ in parts)
    return tuple(Term(w / norm, v, jnp.ones_like(v), p) for w, v, p in parts)


@dataclasses.dataclass(frozen=True)
class HeadsObjective:
    """The loss of a drafter's weights on a batch [B, T + 1]; aux = {"target", "vocab"}."""

    drafter: HeadsConfig
    target: ModelConfig
    reg_weight: float = 1.0  # EAGLE: feature regression
    ce_weight: float = 0.5  # EAGLE: token cross-entropy

    def __call__(self, weights, batch, aux) -> jax.Array:
        return sum(t.coef * jnp.sum(t.weights * t.values) / jnp.sum(t.weights)
                   for t in self.terms(weights, batch, aux))

    def by_position(self, weights, batch, aux, edges) -> tuple[jax.Array, jax.Array]:
        """The terms' coefficients [terms] and [terms, 2, bins]: each term's weighted sum of
        values and sum of weights over the values scored at context positions in [edges[i],
        edges[i + 1]); pooled over batches, sum / weight per term, combined by the
        coefficients, is the objective by bin."""
        rows, terms = [], self.terms(weights, batch, aux)
        for t in terms:
            bin_of = jnp.searchsorted(jnp.asarray(edges), t.positions, side="right") - 1
            inside = (bin_of[..., None] == jnp.arange(len(edges) - 1)) * t.weights[..., None]
            rows.append(jnp.stack([jnp.sum(inside * t.values[..., None], axis=(0, 1)),
                                   jnp.sum(inside, axis=(0, 1))]))
        return jnp.asarray([t.coef for t in terms]), jnp.stack(rows)

    def terms(self, weights, batch, aux) -> tuple[Term, ...]:
        """The objective's parts on a batch [B, T + 1]."""
        target_params, vocab = aux["target"], aux["vocab"]
        inputs = batch[:, :-1]
        t_logits, hidden = _target_outputs(self.target, target_params, inputs,
                                           self.drafter.taps)
        head = jnp.take(lm_head(Model(self.target, target_params)), vocab,
                        axis=1).astype(jnp.float32)
        draft_vocab = DraftVocab(vocab, head, self.target.final_logit_softcapping)
        T = inputs.shape[1]
        if self.drafter.method == "dflash":  # hidden: the tapped layers' outputs
            return _dflash_terms(self.drafter, weights, target_params, draft_vocab, inputs,
                                 t_logits, hidden)
        if self.drafter.method == "mtp":
            return _mtp_terms(self.drafter, weights, target_params, draft_vocab, batch, t_logits,
                              hidden)
        if self.drafter.method == "medusa":
            feats = heads_lib.medusa_heads(weights, hidden)  # [B, T, K, E]
            logits = draft_vocab.logits(feats)  # [B, T, K, M]
            at = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), inputs.shape)
            return _decayed([(HEAD_DECAY ** (k - 1),
                              _soft_ce(t_logits[:, k:], vocab, logits[:, :T - k, k - 1]),
                              at[:, :T - k]) for k in range(1, self.drafter.num_heads + 1)])
        B = inputs.shape[0]
        positions = jnp.broadcast_to(jnp.arange(T - 1, dtype=jnp.int32), (B, T - 1))
        out, _ = heads_lib.eagle_forward(
            self.drafter, weights, hidden[:, :-1], heads_lib.embed(target_params, inputs[:, 1:]),
            positions, KVCache.init(self.drafter.layer, B, T - 1))
        out = out.astype(jnp.float32)
        error = jnp.abs(out - hidden[:, 1:])
        reg = jnp.where(error < 1.0, 0.5 * error ** 2, error - 0.5).mean(-1)  # smooth L1
        ce = _soft_ce(t_logits[:, 1:], vocab, draft_vocab.logits(out))
        ones = jnp.ones_like(ce)
        return (Term(self.reg_weight, reg, ones, positions + 1),  # reads x_{t+1}
                Term(self.ce_weight, ce, ones, positions + 1))


def alternating_batches(tokens: np.ndarray, generated: np.ndarray, rows: int, cfg: TrainConfig,
                        step: int) -> np.ndarray:
    """Step ``step``'s batch when a drafter trains on the target's own text too: even steps
    ``cfg.batch_size`` windows of the stream (as without it), odd steps ``rows`` rows of
    ``generated`` [n, L], drawn by a pure function of the step (so a resumed run sees the same)."""
    if step % 2 == 0:
        return sample_batch(tokens, cfg.batch_size, cfg.seq_len, cfg.seed, step)
    return sample_rows(generated, rows, cfg.seed, step)


def train_heads(target: Model, method: str, tokens: np.ndarray, cfg: TrainConfig, workdir, *,
                num_heads: int = 4, draft_vocab_size: int | None = None,
                intermediate_size: int | None = None, num_layers: int = 2,
                block_size: int = 16, taps: tuple[int, ...] | None = None,
                layer_width: int | None = None, heldout: np.ndarray | None = None,
                ce_weight: float = 0.5, reg_weight: float = 1.0, progress: bool = True,
                on_eval: Callable[[int, float], None] | None = None,
                max_seconds: float | None = None,
                init: Heads | None = None, generated: np.ndarray | None = None,
                generated_rows: int = 8) -> tuple[Heads, list[dict]]:
    """Train a Medusa (``num_heads`` heads), EAGLE, MTP (``num_heads`` modules) or block
    (dflash: ``num_layers`` layers, blocks of up to ``block_size``, reading target layers
    ``taps``; EAGLE and MTP: a layer ``layer_width`` wide, default the target's) drafter for the
    frozen ``target`` on a token stream, resuming from workdir. The
    draft vocabulary is the ``draft_vocab_size`` most frequent tokens of ``tokens`` (default:
    the whole vocabulary). ``init``: start from this drafter's weights, shape and draft vocabulary
    instead (the shape arguments are then unused), e.g. one trained for an earlier version of the
    target. Weights train in float32. ``generated``: rows [n, L] of the target's own text
    (``specjax train pair draft-gen`` writes them); every other step then trains on
    ``generated_rows`` of them instead of a batch of the stream. Returns the drafter (with the
    target's LM head columns) and the held-out evaluations."""
    V = target.config.vocab_size
    for name, stream in (("token stream", tokens), ("held-out stream", heldout)):
        if stream is not None:
            check_stream(name, stream, V, cfg.seq_len)
    M = V if draft_vocab_size is None else draft_vocab_size
    if not 1 <= M <= V:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in [1, {V}]")
    if init is not None:
        if init.config.method != method:
            raise ValueError(f"init is a {init.config.method} drafter, not {method}")
        vocab = np.asarray(init.vocab.ids)
        fresh = Heads(init.config, {**init.params, "weights": jax.tree.map(
            lambda x: jnp.asarray(x, jnp.float32), init.params["weights"])})
    else:
        vocab = np.arange(V, dtype=np.int32) if M == V else frequent_tokens(tokens, V, M)
        fresh = heads_lib.init_heads(target, method, jax.random.key(cfg.seed),
                                     num_heads=num_heads, vocab=vocab,
                                     intermediate_size=intermediate_size, num_layers=num_layers,
                                     block_size=block_size, taps=taps, layer_width=layer_width)
    if not (0 <= ce_weight < float("inf") and 0 <= reg_weight < float("inf")
            and ce_weight + reg_weight > 0):
        raise ValueError(f"ce_weight={ce_weight!r} and reg_weight={reg_weight!r} must be finite, "
                         f">= 0 and not both 0")
    objective = HeadsObjective(fresh.config, target.config, reg_weight, ce_weight)
    aux = {"target": target.params, "vocab": jnp.asarray(vocab)}
    run = {"drafter": dataclasses.asdict(fresh.config), "train": dataclasses.asdict(cfg),
           "target": heads_lib.target_record(target),
           # the token stream, the target's own rows and the draft vocabulary's ids (picked from
           # the stream): a resume on other data, or other columns of the LM head, is refused
           "data": digest(tokens, None if generated is None else np.asarray(generated), vocab),
           **({"objective": {"ce_weight": ce_weight, "reg_weight": reg_weight}}
              if method == "eagle" and (ce_weight, reg_weight) != (0.5, 1.0) else {})}
    batches = None
    if generated is not None:
        generated = np.asarray(generated)
        if generated.ndim != 2 or generated.shape[1] < 3 or not 1 <= generated_rows:
            raise ValueError(f"generated rows of shape {generated.shape} and generated_rows="
                             f"{generated_rows}: need [n, L >= 3] rows and at least one a step")
        if not 0 <= generated.min() <= generated.max() < V:
            raise ValueError(f"generated rows hold ids outside the target's vocabulary of {V}")
        if method == "dflash" and generated.shape[1] < fresh.config.block_size + 3:
            raise ValueError(f"generated rows of {generated.shape[1]} tokens are too short for "
                             f"blocks of {fresh.config.block_size}")
        run["generated"] = {"rows": int(generated.shape[0]), "length": int(generated.shape[1]),
                            "per_step": generated_rows}
        batches = functools.partial(alternating_batches, tokens, generated, generated_rows, cfg)
    evaluate_fn = None
    if heldout is not None:
        loss = jax.jit(objective)

        def evaluate_fn(weights):
            return float(np.mean([
                float(loss(weights, jnp.asarray(sample_batch(heldout, cfg.batch_size,
                                                             cfg.seq_len, 12345, i)), aux))
                for i in range(cfg.eval_batches)]))
    weights, history = fit(objective, fresh.params["weights"], aux, tokens, cfg, workdir, run,
                           evaluate_fn=evaluate_fn, progress=progress, on_eval=on_eval,
                           max_seconds=max_seconds, batches=batches)
    return Heads(fresh.config, {**fresh.params, "weights": weights}), history


def heldout_window(target: Model, available: int) -> int:
    """The positions a held-out window gives ``heldout_loss_by_position`` (it reads one token
    more): the target's context, at most POSITION_BINS' last edge, at most the stream."""
    return min(target.config.max_position_embeddings, POSITION_BINS[-1][1], available - 1)


def heldout_loss_by_position(drafter: Heads, target: Model, tokens: np.ndarray,
                             batch_size: int = 4, windows: int | None = None,
                             ce_weight: float = 0.5, reg_weight: float = 1.0) -> dict:
    """The drafter's training objective (EAGLE's with these weights) on windows as long as the
    target's context (at most 1,024 tokens) cut one after another from a held-out stream (the
    first ``windows``; None: all), by ``POSITION_BINS`` bin of the context position each value
    is scored at (the last token its draft reads), each bin's values pooled over the windows.
    Keys as ``loop.loss_by_position``: "windows" and "0-256", ...; "all": every position."""
    if windows is not None and (not isinstance(windows, int) or windows < 1):
        raise ValueError(f"windows={windows!r} must be a positive int or None (all)")
    length = heldout_window(target, len(tokens))
    cut = np.asarray(tokens[:len(tokens) // (length + 1) * (length + 1)])
    cut = cut.reshape(-1, length + 1)[:windows].astype(np.int32)
    if length < 2 or not len(cut):
        raise ValueError(f"the held-out stream ({len(tokens)} tokens) is shorter than a window "
                         f"of {length + 1}")
    objective = HeadsObjective(drafter.config, target.config, reg_weight, ce_weight)
    weights = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), drafter.params["weights"])
    aux = {"target": target.params, "vocab": drafter.vocab.ids}
    bins = [(lo, min(hi, length)) for lo, hi in POSITION_BINS if lo < length]
    edges = (*(lo for lo, _ in bins), length)
    sums = jax.jit(objective.by_position, static_argnums=3)
    pooled = 0.0
    for i in range(0, len(cut), batch_size):
        coefs, part = sums(weights, jnp.asarray(cut[i:i + batch_size]), aux, edges)
        pooled = pooled + np.asarray(part, np.float64)

    def combine(total, weight):
        return float(np.sum(np.asarray(coefs, np.float64) * total / weight))
    return {"windows": len(cut), "all": combine(*pooled.sum(-1).T),
            **{f"{lo}-{hi}": combine(pooled[:, 0, i], pooled[:, 1, i])
               for i, (lo, hi) in enumerate(bins)}}


def _layer_list(text: str) -> tuple[int, ...]:
    """--taps: comma-separated layer indices, ascending and distinct."""
    import argparse
    try:
        taps = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated layer indices, got {text!r}") from None
    if list(taps) != sorted(set(taps)):
        raise argparse.ArgumentTypeError(f"ascending distinct layer indices, got {text!r}")
    return taps


def heads_main(argv=None) -> int:
    """``specjax train heads``: train, then save the drafter next to its target."""
    import argparse

    from ..checkpoint import load_model
    ap = argparse.ArgumentParser(
        prog="specjax train heads",
        description="Train Medusa heads, an EAGLE head, MTP modules or a block drafter (dflash) "
                    "on a frozen "
                    "target (self-distillation on the target's own distributions); resumes "
                    "from --workdir.")
    ap.add_argument("method", choices=list(heads_lib.HEADS_METHODS))
    ap.add_argument("--target", help="the frozen target (default: the bundled code-target)")
    ap.add_argument("--data", default="~/specjax-work",
                    help="folder with train.npy and heldout.npy (`specjax train pair data`)")
    ap.add_argument("--workdir", required=True, help="run folder (checkpoints, run.json)")
    ap.add_argument("--out", help="save the trained drafter here (e.g. checkpoints/code-eagle)")
    ap.add_argument("--steps", type=int, default=600, help="the schedule's length")
    ap.add_argument("--minutes", type=float, help="stop (after a checkpoint) after this long")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--learning-rate", type=float, default=1e-3)
    ap.add_argument("--init", help="start from this drafter folder's weights, shape and draft "
                                   "vocabulary (trained for this target or an earlier version "
                                   "of it, e.g. before the target trained on longer sequences)")
    ap.add_argument("--num-heads", type=int,
                    help="medusa: heads; mtp: modules (either: the deepest draft; default 4)")
    ap.add_argument("--draft-vocab-size", type=int,
                    help="draft from the N most frequent training tokens (default: all)")
    ap.add_argument("--intermediate-size", type=int,
                    help="eagle, mtp, dflash: the MLP width (default: the target's)")
    ap.add_argument("--layer-width", type=int,
                    help="eagle, mtp: the layer's width (default: the target's hidden size); "
                         "a narrower layer reads and writes the target's features through "
                         "projections")
    ap.add_argument("--ce-weight", type=float, default=0.5,
                    help="eagle: the weight of the cross-entropy against the target's "
                         "distribution in the objective (default 0.5)")
    ap.add_argument("--reg-weight", type=float, default=1.0,
                    help="eagle: the weight of the smooth-L1 feature regression (default 1.0)")
    ap.add_argument("--num-layers", type=int, help="dflash: its layers (default 2)")
    ap.add_argument("--block-size", type=int,
                    help="dflash: the most drafts a block makes (seq-len must exceed it by 2; "
                         "default 16)")
    ap.add_argument("--taps", type=_layer_list,
                    help="dflash: target layers it reads, e.g. 1,3,5 (default: three spread to "
                         "the last)")
    ap.add_argument("--generated", help="a folder of the target's own text (chunk-*.npy rows, "
                                        "as `specjax train pair draft-gen` writes into "
                                        "W/draft-gen-text): every other step trains on "
                                        "--generated-rows of them")
    ap.add_argument("--generated-rows", type=int, default=8,
                    help="rows of --generated a step (default 8)")
    ap.add_argument("--save-dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--verbose", action="store_true",
                    help="also show the INFO logs of orbax and absl")
    from ..cli import show_defaults
    args = show_defaults(ap).parse_args(argv)
    configure_logging(args.verbose)
    for name in ("steps", "batch_size", "seq_len", "generated_rows", "num_heads", "num_layers",
                 "block_size", "draft_vocab_size", "intermediate_size", "layer_width"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.minutes is not None and not args.minutes >= 0:
        ap.error(f"--minutes must be >= 0 (0: one step), got {args.minutes}")
    if not (np.isfinite(args.learning_rate) and args.learning_rate > 0):
        ap.error(f"--learning-rate must be a finite number > 0, got {args.learning_rate}")
    workdir = pathlib.Path(args.workdir).expanduser()
    data = pathlib.Path(args.data).expanduser()
    missing = [n for n in ("train.npy", "heldout.npy") if not (data / n).is_file()]
    if missing:
        ap.error(f"--data {data}: no {' or '.join(missing)} there; build the token streams "
                 f"with `specjax train pair data --workdir DIR` and pass --data DIR")
    tokens, heldout = np.load(data / "train.npy"), np.load(data / "heldout.npy")
    try:
        args.target = args.target or str(bundled("code-target"))
    except FileNotFoundError as e:
        ap.error(f"--target: {e}")
    try:
        target = load_model(args.target)
    except (ValueError, FileNotFoundError) as e:
        ap.error(f"--target {args.target}: {e}")
    init = None
    shape = ("num_heads", "draft_vocab_size", "intermediate_size", "layer_width", "num_layers",
             "block_size", "taps")
    if args.init:
        given = [n for n in shape if getattr(args, n) is not None]
        if given:
            ap.error(f"--init {args.init} gives the drafter's shape; drop "
                     + ", ".join("--" + n.replace("_", "-") for n in given))
        try:
            init = heads_lib.load_heads(args.init, target, same_target=False)
        except (ValueError, FileNotFoundError) as e:
            ap.error(f"--init {args.init}: {e}")
        if init.config.method != args.method:
            ap.error(f"--init {args.init} holds a {init.config.method} drafter, not "
                     f"{args.method}")
        # What --init held when this run began, kept in the run's folder: a later session (a
        # --minutes stop, then the same command) finds --init rewritten by the earlier one's
        # --out when the two are one folder, and would record that as the earlier training.
        began = workdir / "continued_from.json"
        if not began.is_file():
            earlier = json.loads((pathlib.Path(args.init) / "drafter.json").read_text())
            workdir.mkdir(parents=True, exist_ok=True)
            write_atomic(began, json.dumps({
                "folder": args.init, "training": earlier.get("training"),
                "target": {k: v for k, v in earlier["target"].items() if k != "fingerprint"}},
                indent=1) + "\n")
    args.num_heads = 4 if args.num_heads is None else args.num_heads
    args.num_layers = 2 if args.num_layers is None else args.num_layers
    args.block_size = 16 if args.block_size is None else args.block_size
    # the deepest draft must have a position to learn from in every sequence (a shorter one
    # trained to a loss of NaN)
    shaped = init.config if init is not None else args
    deepest = {"medusa": shaped.num_heads, "mtp": shaped.num_heads,
               "dflash": shaped.block_size}.get(args.method, 1)
    if args.seq_len < deepest + 2:
        ap.error(f"--seq-len must be >= {deepest + 2} for {args.method} (its deepest draft, "
                 f"{deepest}, plus 2), got {args.seq_len}")
    if args.taps is not None and not all(0 <= t < target.config.num_hidden_layers
                                         for t in args.taps):
        ap.error(f"--taps must be layers of the target, in [0, "
                 f"{target.config.num_hidden_layers}), got {','.join(map(str, args.taps))}")
    generated = None
    if args.generated:
        chunks = sorted(pathlib.Path(args.generated).expanduser().glob("chunk-*.npy"))
        if not chunks:
            ap.error(f"--generated {args.generated}: no chunk-*.npy files there")
        generated = np.concatenate([np.load(c) for c in chunks])
        args.generated_length = generated.shape[1] if generated.ndim == 2 else 0
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                      learning_rate=args.learning_rate, warmup_steps=min(50, args.steps // 10),
                      checkpoint_every=25, eval_every=max(args.steps // 4, 1), eval_batches=4,
                      weight_decay=0.0, seed=0)
    drafter, history = train_heads(
        target, args.method, tokens, cfg, workdir, num_heads=args.num_heads,
        draft_vocab_size=args.draft_vocab_size, intermediate_size=args.intermediate_size,
        num_layers=args.num_layers, block_size=args.block_size, layer_width=args.layer_width,
        ce_weight=args.ce_weight, reg_weight=args.reg_weight,
        taps=args.taps,
        heldout=heldout, init=init, generated=generated, generated_rows=args.generated_rows,
        max_seconds=None if args.minutes is None else args.minutes * 60,
        on_eval=eval_log(workdir / "evals.jsonl"))
    # every session's evaluations of this run, not only this process's
    history = read_evals(workdir / "evals.jsonl") or history
    for h in history:
        print(f"step {h['step']}: held-out loss {h['heldout_loss']:.4f}")
    if args.out:
        card = model_card(pathlib.Path(args.out), drafter, args, cfg, history,
                          int(history[-1]["step"]) if history else 0)
        training = {"train": dataclasses.asdict(cfg), "evals": history, "data": str(data)}
        if args.generated:
            training["generated"] = {"folder": args.generated, "rows": len(generated),
                                     "length": args.generated_length,
                                     "rows_per_step": args.generated_rows}
        if args.init:  # the earlier training stays on record, as --init held it at the start
            training["continued_from"] = json.loads(
                (workdir / "continued_from.json").read_text())
        heads_lib.save_heads(drafter, args.out, target, dtype=args.save_dtype,
                             extra={"training": training}, files={"README.md": card})
        print(f"saved {args.method} drafter for {args.target} to {args.out}")
        loss = record_heldout_by_position(args.out, target, heldout, ce_weight=args.ce_weight,
                                          reg_weight=args.reg_weight)
        print(f"held-out loss by context position: {loss}")
        if (pathlib.Path(args.target) / "tokenizer.json").is_file():
            from ..tokenizer import load_tokenizer
            long = record_long_acceptance(args.out, target, load_tokenizer(args.target))
            print(f"acceptance on the long bench prompts: {long}")
    return 0


LONG_LINE = "* Acceptance by context position"
HELDOUT_LINE = "* Held-out loss by context position"


def _record(folder: pathlib.Path, key: str, value: dict, prefix: str, figures: str,
            after: str | None = None) -> None:
    """Store ``value`` under ``key`` in the folder's drafter.json and the line ``prefix +
    figures`` in its README.md: in place of an earlier line starting with ``prefix``, or else
    after the first line starting with ``after``, or else before "* Load with"."""
    meta = json.loads((folder / "drafter.json").read_text())
    meta[key] = value
    line = prefix + figures
    card = (folder / "README.md").read_text().splitlines()
    at = next((i for i, x in enumerate(card) if x.startswith(prefix)), None)
    if at is not None:
        card[at] = line
    else:
        at = next((i + 1 for i, x in enumerate(card) if after and x.startswith(after)),
                  next((i for i, x in enumerate(card) if x.startswith("* Load with")),
                       len(card)))
        card.insert(at, line)
    # write_atomic: a crash leaves the old file or the new one, whole
    write_atomic(folder / "drafter.json", json.dumps(meta, indent=1) + "\n")
    write_atomic(folder / "README.md", "\n".join(card) + "\n")


def record_long_acceptance(folder, target: Model, tokenizer, gamma: int = 4) -> dict:
    """The greedy acceptance of the drafter in ``folder`` on the long bench prompts, overall and
    by the context position a round starts at (``pair.measure_long``, γ = ``gamma`` or its
    deepest draft if that is less), recorded in its drafter.json (``acceptance.long``) and as a
    line of its README.md (replacing an earlier one). ``experiments/drafter_long_acceptance.py``
    runs it for a shipped folder."""
    from .pair import long_figures, measure_long
    folder = pathlib.Path(folder)
    drafter = heads_lib.load_heads(folder, target)
    depth = drafter.config.max_depth
    long = measure_long(target, drafter, tokenizer, min(gamma, depth or gamma),
                        method=drafter.config.method)
    acceptance = json.loads((folder / "drafter.json").read_text()).get("acceptance", {})
    _record(folder, "acceptance", {**acceptance, "long": long},
            LONG_LINE, f" (greedy, γ = {long['gamma']}, {long['max_new_tokens']} new tokens "
            f"after each long bench prompt of 300-900 tokens, float32 on a 2-core CPU): "
            f"{long_figures(long)}.")
    return long


def record_heldout_by_position(folder, target: Model, heldout: np.ndarray,
                               ce_weight: float = 0.5, reg_weight: float = 1.0,
                               windows: int | None = 512) -> dict:
    """``heldout_loss_by_position`` of the drafter in ``folder`` on the first ``windows`` windows
    of the held-out stream (None: all; 512 windows of 1,024 tokens take a few minutes on a
    2-core CPU), recorded in its drafter.json (``heldout_loss_by_position``) and as a line of
    its README.md after its held-out loss (replacing an earlier one).
    ``experiments/drafter_heldout_positions.py`` runs it for a shipped folder."""
    folder = pathlib.Path(folder)
    drafter = heads_lib.load_heads(folder, target)
    loss = heldout_loss_by_position(drafter, target, heldout, windows=windows,
                                    ce_weight=ce_weight, reg_weight=reg_weight)
    length = heldout_window(target, len(heldout))
    available = len(heldout) // (length + 1)
    which = (f"all {available}" if loss["windows"] == available
             else f"the first {loss['windows']} of the {available}")
    _record(folder, "heldout_loss_by_position", loss,
            HELDOUT_LINE, f" (the training objective pooled over {which} held-out windows of "
            f"{length} tokens, by the position of the last token a draft reads): "
            f"{heldout_figures(loss)}.", after="* Held-out loss (")
    return loss


def heldout_figures(loss: dict) -> str:
    """The figures of a card's held-out-loss-by-position line."""
    return f"all {loss['all']:.3f}; " + ", ".join(
        f"{k} {v:.3f}" for k, v in loss.items() if k not in ("windows", "all"))


CARD = """# {folder}

{what} for `{target}` ({params:,} trainable parameters, stored in {dtype}), trained by
self-distillation on the frozen target (`specjax train heads {method}`; see docs/training.md).

* Draft vocabulary: the {vocab:,} most frequent tokens of the training stream (`vocab.npy`).
* Data: `train.npy` of `specjax train pair data` (the bundled target's training corpus), batches
  of {batch} x {seq} tokens{generated}; held-out loss on `heldout.npy`.
* Training: {steps} optimizer steps of a {schedule}-step schedule (AdamW, peak learning rate
  {lr}), {tokens:,} tokens{init}.
* Held-out loss (the training objective on held-out batches, float32 weights as trained): {evals}.
* Load with `sj.load_heads("{folder_path}", target)`; it refuses any other target.

Command: `{command}`
"""


def model_card(out: pathlib.Path, drafter: Heads, args, cfg: TrainConfig, history, steps: int
               ) -> str:
    """The drafter folder's README.md."""
    c = drafter.config
    width = (f" {c.layer.hidden_size} wide, projected from and to the target's "
             f"{c.hidden_size}" if c.layer is not None and c.layer.hidden_size != c.hidden_size
             else "")
    if c.method == "medusa":  # (the others have a layer: Medusa's c.layer is None)
        what = f"{c.num_heads} Medusa heads"
    else:
        what = {"eagle": f"An EAGLE head (one decoder layer{width}, MLP width "
                         f"{c.layer.intermediate_size})",
                "mtp": f"{c.num_heads} MTP modules (one decoder layer each{width}, MLP width "
                       f"{c.layer.intermediate_size})",
                "dflash": f"A block drafter ({c.layer.num_hidden_layers} decoder layers, MLP "
                          f"width {c.layer.intermediate_size}, blocks of up to {c.block_size} "
                          f"drafts, reading target layers {', '.join(map(str, c.taps))})"
                }[c.method]
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(drafter.params["weights"]))
    evals = ", ".join(f"{h['heldout_loss']:.3f} at step {h['step']}" for h in history) or "none"
    command = (f"specjax train heads {c.method} --target {args.target} --data {args.data} "
               f"--workdir {args.workdir} "
               f"--steps {args.steps} --batch-size {cfg.batch_size} --seq-len {cfg.seq_len}"
               + (f" --learning-rate {args.learning_rate:g}"
                  if getattr(args, "learning_rate", 1e-3) != 1e-3 else "")
               + (f" --minutes {args.minutes:g}" if args.minutes else "")
               + (f" --init {args.init}" if args.init else "")
               + (f" --num-heads {c.num_heads}" if c.method in ("medusa", "mtp")
                  and not args.init else "")
               + (f" --draft-vocab-size {args.draft_vocab_size}" if args.draft_vocab_size else "")
               + (f" --intermediate-size {args.intermediate_size}"
                  if args.intermediate_size else "")
               + (f" --layer-width {args.layer_width}" if args.layer_width else "")
               + (f" --generated {args.generated} --generated-rows {args.generated_rows}"
                  if getattr(args, "generated", None) else "")
               + (f" --ce-weight {args.ce_weight:g}" if args.ce_weight != 0.5 else "")
               + (f" --reg-weight {args.reg_weight:g}" if args.reg_weight != 1.0 else "")
               + (f" --num-layers {args.num_layers} --block-size {args.block_size}"
                  + (f" --taps {','.join(map(str, args.taps))}" if args.taps else "")
                  if c.method == "dflash" and not args.init else "")
               + f" --out {args.out}")
    return CARD.format(
        folder=out.name, what=what, target=args.target, params=params, dtype=args.save_dtype,
        method=c.method, vocab=c.draft_vocab_size, batch=cfg.batch_size, seq=cfg.seq_len,
        steps=steps, schedule=cfg.steps, lr=cfg.learning_rate,
        tokens=((steps + 1) // 2 * cfg.batch_size * cfg.seq_len
                + steps // 2 * args.generated_rows * (args.generated_length - 1)
                if getattr(args, "generated", None) else steps * cfg.batch_size * cfg.seq_len),
        evals=evals, folder_path=args.out,
        generated=(f", every other step instead {args.generated_rows} rows of the target's own "
                   f"text (`{args.generated}`: its continuations of training windows, half "
                   f"greedy, half at T = 1)" if getattr(args, "generated", None) else ""),
        init=(f", continuing from the weights of `{args.init}` as they were (that drafter's "
              f"training is recorded in drafter.json under training.continued_from)"
              if args.init else ""),
        command=command)
