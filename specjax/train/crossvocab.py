"""Distilling a draft that has another tokenizer than its target, token by token.

A draft with its own tokenizer cannot learn the target's next-token distribution position by
position in general: the two cut the text at different places. But wherever both cut it at the
same byte (most token ends in practice), the draft's next token and the target's next token
start at the same byte, and a draft token that is also a target token is accepted exactly as
often as the target would write that token there. So at those aligned boundaries the draft's
distribution over its drafting vocabulary is trained towards the target's, restricted to the
tokens it can propose and renormalised (soft labels, as in ordinary distillation), which is what
its proposals are verified against at any temperature (``docs/draft-model.md``).

A batch is windows of the target's token stream: the target reads its own tokens, the draft
reads the same bytes in its tokens (``aligned_windows``), and ``align`` says, for each draft
position, which target position ends at the same byte (or -1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..config import ModelConfig
from ..model import Model
from .loop import _logits


class Aligner:
    """Encodes target-token windows for the draft and finds where the two cut alike.

    ``draft_ids`` [n]: the draft's drafting vocabulary (the columns it proposes from);
    ``target_of`` [n]: the target id with the same bytes as each of them.

    With ``spelling`` ([V_target, K] draft ids, -1 after the last: ``DraftModel.spelling``) the
    draft reads each target token as its spelling, as the chain reads the text it drafts for
    (``SpelledChainProposer``), so every target token's end is a draft token's end; without it,
    the draft reads the window's text as its own tokenizer cuts it."""

    def __init__(self, target_tokenizer, draft_tokenizer, draft_ids: np.ndarray,
                 spelling: np.ndarray | None = None):
        from ..draft.vocab import token_keys, token_pairs
        self.draft_tokenizer = draft_tokenizer
        self.target_bytes = [k[1] if k is not None and k[0] == "bytes" else b""
                             for k in token_keys(target_tokenizer)]
        self.draft_bytes = [len(k[1]) if k is not None and k[0] == "bytes" else 0
                            for k in token_keys(draft_tokenizer)]
        to_target = dict(token_pairs(draft_tokenizer, target_tokenizer).tolist())
        missing = [int(i) for i in draft_ids if int(i) not in to_target]
        if missing:
            raise ValueError(f"draft tokens {missing[:5]} have no target token with their bytes")
        self.draft_ids = np.asarray(draft_ids, np.int32)
        self.target_of = np.asarray([to_target[int(i)] for i in draft_ids], np.int32)
        self.spelling = None if spelling is None else np.asarray(spelling)

    def window(self, target_ids: np.ndarray, draft_len: int):
        """(draft ids [draft_len + 1], align [draft_len]) for the bytes of ``target_ids``, or
        None when they are not whole UTF-8 text (a window cut inside a character) or hold a
        token that writes no bytes (the end-of-text token between files, whose next-token
        distribution belongs to another file)."""
        if any(not self.target_bytes[int(t)] for t in target_ids):
            return None
        target_ends = np.cumsum([len(self.target_bytes[int(t)]) for t in target_ids])
        if self.spelling is not None:
            rows = self.spelling[target_ids]
            ids = rows[rows >= 0]
        else:
            data = b"".join(self.target_bytes[int(t)] for t in target_ids)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                return None
            ids = self.draft_tokenizer.encode(text, add_special_tokens=False)
        ends = np.cumsum([self.draft_bytes[i] for i in ids])
        if not len(ids) or ends[-1] != target_ends[-1]:
            return None
        where = {int(e): j for j, e in enumerate(target_ends)}
        out = np.zeros(draft_len + 1, np.int32)
        n = min(len(ids), draft_len + 1)
        out[:n] = ids[:n]
        align = np.full(draft_len, -1, np.int32)
        # draft position i predicts draft token i + 1 (so it ends before the window does, and
        # its aligned target position is never the last, whose next token lies outside)
        for i in range(min(n - 1, draft_len)):
            align[i] = where.get(int(ends[i]), -1)
        return out, align

    def batch(self, stream: np.ndarray, size: int, target_len: int, draft_len: int,
              seed: int, step: int) -> dict:
        """``size`` windows of ``target_len`` target tokens from ``stream`` (a token stream, or
        rows [n, >= target_len] of which each window is one row's start), a pure function of
        (seed, step): {"target": [size, target_len], "draft": [size, draft_len + 1],
        "align": [size, draft_len]}."""
        length = stream.shape[1] if stream.ndim == 2 else len(stream) - 1
        if len(stream) < 1 or length < target_len:
            raise ValueError(f"a stream of shape {tuple(stream.shape)} holds no window of "
                             f"{target_len} target tokens")
        rng = np.random.default_rng([seed, step])
        rows = {"target": [], "draft": [], "align": []}
        tries = 0
        while len(rows["target"]) < size:
            tries += 1
            if tries > 100 * size:  # a stream whose every window spans an end of text
                raise ValueError(f"{tries - 1} windows of {target_len} tokens drawn, "
                                 f"{len(rows['target'])} usable (a window must not span an end "
                                 f"of text and must cover {draft_len + 1} draft tokens)")
            if stream.ndim == 2:
                ids = np.asarray(stream[int(rng.integers(0, len(stream))), :target_len],
                                 np.int32)
            else:
                s = int(rng.integers(0, len(stream) - target_len))
                ids = np.asarray(stream[s:s + target_len], np.int32)
            got = self.window(ids, draft_len)
            if got is None:
                continue
            rows["target"].append(ids)
            rows["draft"].append(got[0])
            rows["align"].append(got[1])
        return {k: np.stack(v) for k, v in rows.items()}


def _labelled(teacher: Model, target_of: jax.Array, batch: dict, temperature: float):
    """The target's distribution at each draft position's aligned target position, restricted
    to the drafting vocabulary's target ids: (labels [B, M, n] renormalised, mass [B, M] the
    target put on them, zero where no position aligns)."""
    t_logits = jax.lax.stop_gradient(_logits(teacher.config, teacher.params, batch["target"]))
    t_prob = jax.nn.softmax(t_logits / temperature, axis=-1)  # [B, Tt, V]
    align = batch["align"]
    rows = jnp.take_along_axis(t_prob, jnp.maximum(align, 0)[..., None], axis=1)  # [B, M, V]
    restricted = rows[..., target_of]  # [B, M, n]
    mass = jnp.where(align >= 0, restricted.sum(-1), 0.0)
    return restricted / jnp.maximum(mass, 1e-9)[..., None], mass


def _draft_logp(config: ModelConfig, params, draft_ids: jax.Array, batch: dict,
                temperature: float):
    """The draft's log-probabilities over its drafting vocabulary, [B, M, n], and its logits."""
    logits = _logits(config, params, batch["draft"][:, :-1])
    return jax.nn.log_softmax(logits[..., draft_ids] / temperature, axis=-1), logits


@dataclasses.dataclass(frozen=True)
class SoftLabelObjective:
    """Cross-entropy of the draft's drafting-vocabulary distribution against the target's
    (restricted, renormalised) at aligned positions, each weighted by the mass the target puts
    on the drafting vocabulary there, plus ``ce_weight`` x the draft's own next-token loss.
    aux: (teacher params, draft_ids [n], target_of [n])."""

    config: ModelConfig
    teacher: ModelConfig
    ce_weight: float = 0.1

    def __call__(self, params, batch: dict, aux) -> jax.Array:
        teacher_params, draft_ids, target_of = aux
        labels, mass = _labelled(Model(self.teacher, teacher_params), target_of, batch, 1.0)
        logp, logits = _draft_logp(self.config, params, draft_ids, batch, 1.0)
        kd = -(labels * logp).sum(-1)
        loss = (kd * mass).sum() / jnp.maximum(mass.sum(), 1e-9)
        if self.ce_weight:
            labels_next = batch["draft"][:, 1:]
            valid = (labels_next != 0) | (jnp.arange(labels_next.shape[1]) == 0)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels_next)
            loss = loss + self.ce_weight * (ce * valid).sum() / jnp.maximum(valid.sum(), 1)
        return loss


def expected_acceptance(teacher: Model, draft: Model, aligner: Aligner, batch: dict,
                        temperatures=(1.0, 0.8)) -> dict:
    """At the batch's aligned positions: the probability that a token the draft proposes there
    (sampled from its drafting vocabulary at temperature T) is accepted by the target sampling
    at T, sum_x min(p(x), q(x)) with p over the target's whole vocabulary, averaged over the
    positions; and the greedy agreement (the draft's argmax is the target's). A teacher-forced
    estimate of a first draft's acceptance."""
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    draft_ids, target_of = jnp.asarray(aligner.draft_ids), jnp.asarray(aligner.target_of)
    t_logits = _logits(teacher.config, teacher.params, batch["target"])
    rows = jnp.take_along_axis(t_logits, jnp.maximum(batch["align"], 0)[..., None], axis=1)
    d_logits = _logits(draft.config, draft.params, batch["draft"][:, :-1])[..., draft_ids]
    valid = batch["align"] >= 0
    out = {"positions": int(valid.sum())}
    for T in temperatures:
        p = jax.nn.softmax(rows / T, axis=-1)[..., target_of]
        q = jax.nn.softmax(d_logits / T, axis=-1)
        out[f"t{T:g}"] = float((jnp.minimum(p, q).sum(-1) * valid).sum() / valid.sum())
    greedy = target_of[jnp.argmax(d_logits, -1)] == jnp.argmax(rows, -1)
    out["greedy"] = float((greedy * valid).sum() / valid.sum())
    return out
