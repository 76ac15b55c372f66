"""Drafts from an independent small model with its own KV cache.

Each round the draft runs γ forwards: one two-token forward, then γ - 1 single-token forwards. The
first forward re-feeds the token before the last one, at slot length - 1:

* if the previous round rejected a draft, that slot already holds exactly this token (recomputed,
  identical), and rewriting it also rolls back everything after it;
* if the previous round accepted all γ drafts, the draft model never saw its own last draft d_γ
  (it only proposed it), and this write is how it catches up, without a data-dependent shape.

So the draft cache never needs to be told what was accepted: rollback is setting its length to
length - 1 before the write.

A draft model may propose from a subset of the vocabulary (``restrict_vocab``; see
specjax/draft/vocab.py): a ``DraftModel`` is the model and its optional ``DraftVocab``, and a
restricted draft computes only those M logits.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from .. import sampling
from ..adaptive import Budget, Calibration, ChainControl, checked_calibration, load_calibration
from ..cache import KVCache, compact, write_chunk
from ..config import ModelConfig, SpecConfig, _is_int, check_int
from ..model import PREFILL_CHUNK, Model, forward, prefill_chunked
from ..tree import Tree
from .base import Draft, draw, draw_scored, expand_tree, stack_chain, tree_candidates
from .vocab import DraftVocab, lm_head


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftModel:
    """A draft model, the draft vocabulary it proposes from (None: its whole vocabulary) and the
    calibration of its confidence for adaptive draft lengths (None: the identity;
    specjax/adaptive.py). ``from_target``: for a draft whose vocabulary is a prefix of the
    target's (``shared_prefix``), its input id for each target id [V_target] (None: the same
    ids). ``spelling``: for a draft with a tokenizer of its own (``map_vocab(..., spelling=)``,
    ``for_tokenizers``), the draft ids that write each target token [V_target, K], -1 after
    the last; a chain then reads every accepted token as its draft spelling (re-encoding)."""

    model: Model
    vocab: DraftVocab | None = None
    calibration: Calibration | None = None
    from_target: Array | None = None
    spelling: Array | None = None
    strings: Any = None  # strings.StringBridge: string-level drafts (for_tokenizers(level=))

    def inputs(self, tokens: Array) -> Array:
        """Target token ids -> the ids this draft reads (the same unless ``from_target``)."""
        if self.from_target is None:
            return tokens
        return jnp.take(self.from_target, tokens, mode="clip")

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def vocab_size(self) -> int:
        """M: how many tokens the draft can propose."""
        return self.config.vocab_size if self.vocab is None else self.vocab.size

    def logits(self, tokens: Array, positions: Array, cache: KVCache,
               chunk_mask: Array | None = None, *, write: bool = True,
               at: tuple[int, ...] | None = None) -> tuple[Array, KVCache]:
        """A draft forward: logits over its draft vocabulary [B, T, M] and the extended cache
        (``write=False``: the chunk's keys and values instead, as ``model.forward``). With a
        restricted vocabulary the full-vocabulary logits are never used, and the compiler
        drops them. ``at`` (chunk indices, static): the logits at those positions only, [B,
        len(at), M] (the LM head is the draft's widest product; XLA does not narrow it to the
        positions a caller reads)."""
        logits, hidden, cache = forward(self.model, self.inputs(tokens), positions, cache,
                                        chunk_mask, write=write,
                                        logits_at=at if self.vocab is None else ())
        if self.vocab is not None:
            logits = self.vocab.logits(hidden if at is None
                                       else hidden[:, np.asarray(at, np.int32)])
        return logits, cache

    def token_ids(self, index: Array) -> Array:
        """Indices into the draft vocabulary -> token ids (the identity when unrestricted)."""
        return index.astype(jnp.int32) if self.vocab is None else self.vocab.token_ids(index)


def as_draft_model(draft) -> DraftModel:
    """A DraftModel from an sj.Model (whole vocabulary) or a DraftModel; ValueError otherwise."""
    if isinstance(draft, DraftModel):
        return draft
    if isinstance(draft, Model):
        return DraftModel(draft)
    raise ValueError(f"the draft must be an sj.Model or sj.DraftModel (sj.load_draft_model), "
                     f"got {type(draft).__name__}")


def program_params(draft) -> DraftModel:
    """What a compiled program takes for ``draft``: the DraftModel, with the identity
    calibration when it has none, so drafts with and without one share the program."""
    draft = as_draft_model(draft)
    return dataclasses.replace(draft, calibration=checked_calibration(draft.calibration,
                                                                      "DraftModel.calibration"))


def restrict_vocab(draft, vocab) -> DraftModel:
    """``draft`` (an sj.Model or sj.DraftModel) proposing only from the token ids ``vocab`` (for
    example the M most frequent tokens of its training data: ``sj.draft.frequent_tokens``).

    Returns a DraftModel whose draft vocabulary holds the model's LM head columns for ``vocab``;
    as a draft (``sj.generate(..., draft=)``) it computes only those M logits. ``.model`` is the
    unchanged model (save that one; a DraftModel is not a model checkpoint)."""
    if not isinstance(draft, (Model, DraftModel)):
        raise ValueError(f"restrict_vocab expects an sj.Model or sj.DraftModel, got "
                         f"{type(draft).__name__}")
    draft = as_draft_model(draft)
    if draft.from_target is not None or draft.strings is not None:
        raise ValueError("restrict_vocab: the draft already maps the target's vocabulary "
                         "(shared_prefix, map_vocab, for_tokenizers); restrict it first, then "
                         "map it")
    return DraftModel(draft.model, DraftVocab.of(draft.model, vocab), draft.calibration)


def shared_prefix(draft, target_vocab_size: int, *, fallback: int = 0) -> DraftModel:
    """``draft`` (an sj.Model or sj.DraftModel) for a target whose vocabulary extends the
    draft's: the draft's ids 0 .. V_d - 1 are the same tokens as the target's (Gemma 3 270M's
    262,144 ids and the 4B's 262,208, whose extra ids are image tokens; Qwen2.5 0.5B and 7B).
    Whether the ids mean the same tokens cannot be seen from the weights: check the tokenizers
    (docs/your-own-pair.md). ``map_vocab`` with the pairs (i, i)."""
    draft = _checked_draft(draft, "shared_prefix")
    V = draft.config.vocab_size
    if _is_int(target_vocab_size) and target_vocab_size < V:
        raise ValueError(f"target_vocab_size={target_vocab_size!r} must be an int >= the draft's "
                         f"vocab_size {V}")
    ids = np.arange(V, dtype=np.int64)
    return map_vocab(draft, target_vocab_size, np.stack([ids, ids], axis=1), fallback=fallback)


def map_vocab(draft, target_vocab_size: int, pairs, *, fallback: int = 0,
              spelling=None) -> DraftModel:
    """``draft`` (an sj.Model or sj.DraftModel) for a target with another vocabulary:
    ``pairs`` [n, 2] lists (draft id, target id) for the tokens the two share (each id at most
    once on either side; ``sj.draft.token_pairs`` finds them from the two tokenizers: token-level
    intersection, as Timor et al. 2025).

    The draft proposes only shared tokens (those of its draft vocabulary, if it has one), from its
    distribution restricted and renormalised to them, as target ids; its q is zero elsewhere, so
    verification is unchanged and the output keeps the target's distribution. It reads the
    target's tokens in its own ids; a target token it does not share is read as ``fallback`` (a
    draft id), which can only cost acceptance, never change the output.

    ``spelling`` [V_target, K] (``sj.draft.token_spellings`` builds it from the tokenizers):
    row t holds the draft ids that write target token t, padded with -1. With it a chain draft
    (not a tree, not adaptive lengths) reads each accepted target token as those draft tokens,
    so its cache holds the text in its own tokenization (docs/draft-model.md); what the draft
    reads never changes the output, only how often its drafts are accepted."""
    draft = _checked_draft(draft, "map_vocab")
    V = draft.config.vocab_size
    if not _is_int(target_vocab_size) or target_vocab_size < 1:
        raise ValueError(f"target_vocab_size={target_vocab_size!r} must be an int >= 1")
    if not _is_int(fallback) or not 0 <= fallback < V:
        raise ValueError(f"fallback={fallback!r} must be a draft token id in [0, {V})")
    try:
        pairs = np.asarray(pairs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"pairs must be an [n, 2] array of token ids: {e}") from None
    if pairs.ndim != 2 or pairs.shape[1:] != (2,) or not len(pairs) \
            or not np.issubdtype(pairs.dtype, np.integer):
        raise ValueError(f"pairs must be a non-empty [n, 2] array of (draft id, target id) ints, "
                         f"got shape {pairs.shape} of {pairs.dtype}")
    for side, (column, size) in enumerate(((pairs[:, 0], V), (pairs[:, 1], target_vocab_size))):
        name = ("draft", "target")[side]
        if column.min() < 0 or column.max() >= size:
            raise ValueError(f"pairs hold a {name} id outside [0, {size})")
        if len(np.unique(column)) != len(column):
            raise ValueError(f"pairs repeat a {name} id: each token maps to one")
    if draft.vocab is not None:  # only what the draft vocabulary lets the draft propose
        pairs = pairs[np.isin(pairs[:, 0], np.asarray(draft.vocab.ids))]
        if not len(pairs):
            raise ValueError("no pair's draft id is in the draft's draft vocabulary")
    head = jnp.take(lm_head(draft.model), jnp.asarray(pairs[:, 0], jnp.int32), axis=1)
    vocab = DraftVocab(jnp.asarray(pairs[:, 1], jnp.int32), head,
                       draft.model.config.final_logit_softcapping)
    from_target = np.full(int(target_vocab_size), int(fallback), np.int32)
    from_target[pairs[:, 1]] = pairs[:, 0]
    if spelling is not None:
        spelling = jnp.asarray(_checked_spelling(spelling, int(target_vocab_size), V))
    return DraftModel(draft.model, vocab, draft.calibration, jnp.asarray(from_target), spelling)


def _checked_spelling(spelling, target_vocab_size: int, draft_vocab_size: int) -> np.ndarray:
    """``map_vocab``'s spelling as int32 [V_target, K], or ValueError naming what is wrong."""
    try:
        spelling = np.asarray(spelling)
    except (TypeError, ValueError) as e:
        raise ValueError(f"spelling must be a [V_target, K] array of draft ids: {e}") from None
    if spelling.ndim != 2 or spelling.shape[0] != target_vocab_size or spelling.shape[1] < 1 \
            or not np.issubdtype(spelling.dtype, np.integer):
        raise ValueError(f"spelling must be a [{target_vocab_size}, K] int array (draft ids, -1 "
                         f"after the last), got shape {spelling.shape} of {spelling.dtype}")
    if spelling.min() < -1 or spelling.max() >= draft_vocab_size:
        raise ValueError(f"spelling holds an id outside [0, {draft_vocab_size}) other than the "
                         f"padding -1")
    used = spelling >= 0
    bad = np.flatnonzero(~used[:, 0] | (used[:, 1:] & ~used[:, :-1]).any(1))
    if bad.size:
        raise ValueError(f"spelling row {int(bad[0])} must start with a draft id and pad with -1 "
                         f"only after its last one, got {spelling[bad[0]].tolist()}")
    return spelling.astype(np.int32)


_PAIRED: collections.OrderedDict = collections.OrderedDict()
"""The last few drafts mapped by ``for_tokenizers``: a call with the same draft and tokenizers
reuses the map (pairing two 262k-token vocabularies takes seconds; the mapped LM head is a
copy of the shared columns)."""


def for_tokenizers(draft, draft_tokenizer, target_tokenizer, target_vocab_size: int, *,
                   level: str = "token") -> DraftModel:
    """``draft`` (an sj.Model or sj.DraftModel) made to draft for a target with another
    tokenizer: ``map_vocab`` with ``token_pairs(draft_tokenizer, target_tokenizer)`` (what
    ``sj.generate(..., draft_tokenizer=)`` does). Returns the draft unchanged when the two
    tokenizers give every id the same token. A chain draft reads each target token as its
    spelling in the draft's tokens (``token_spellings``); trees and adaptive lengths read the
    target tokens the draft lacks as its first special token (its id 0 when it has none).

    ``level="string"``: string-level drafts instead (specjax/draft/strings.py): the draft drafts
    freely in its own vocabulary and its text is cut into target tokens, verified as point
    masses; chains only."""
    if level not in ("token", "string"):
        raise ValueError(f"level={level!r} must be 'token' (token-level intersection) or "
                         f"'string' (string-level drafts)")
    check_int("for_tokenizers' target_vocab_size", target_vocab_size, 1)
    from ..tokenizer import Tokenizer
    for name, tok in (("draft_tokenizer", draft_tokenizer), ("tokenizer", target_tokenizer)):
        if not isinstance(tok, Tokenizer):
            raise ValueError(f"{name}= must be an sj.Tokenizer (sj.load_tokenizer) to pair the "
                             f"draft's tokens with the target's, got {type(tok).__name__}")
    given = draft
    key = (id(given), id(draft_tokenizer), id(target_tokenizer), int(target_vocab_size), level)
    hit = _PAIRED.get(key)
    if hit is not None and hit[0] is given and hit[1] is draft_tokenizer \
            and hit[2] is target_tokenizer:
        _PAIRED.move_to_end(key)
        return hit[3]
    draft = _checked_draft(draft, "draft_tokenizer=")
    from .vocab import token_keys, token_pairs, token_spellings
    V = draft.config.vocab_size
    special = [i for i, k in enumerate(token_keys(draft_tokenizer))
               if k is not None and k[0] == "special"]
    fallback = special[0] if special and special[0] < V else 0

    def spelling():
        return token_spellings(draft_tokenizer, target_tokenizer, target_vocab_size,
                               fallback=fallback, draft_vocab_size=V)
    if level == "string":
        from .strings import string_bridge
        mapped = DraftModel(draft.model, draft.vocab, draft.calibration, None,
                            jnp.asarray(spelling()),
                            string_bridge(draft_tokenizer, target_tokenizer, target_vocab_size, V))
    else:
        pairs = token_pairs(draft_tokenizer, target_tokenizer)
        # a tokenizer may name more ids than its model has rows (ids added past the vocabulary)
        pairs = pairs[(pairs[:, 0] < V) & (pairs[:, 1] < target_vocab_size)]
        # the same tokens at the same ids: every id of both tokenizers (a model may have rows
        # past its tokenizer's ids, Qwen's 151,936 for 151,665: those stay as they are)
        ids = min(draft_tokenizer.vocab_size, V)
        if (V == target_vocab_size and draft_tokenizer.vocab_size == target_tokenizer.vocab_size
                and len(pairs) == ids and np.array_equal(pairs[:, 0], pairs[:, 1])
                and np.array_equal(np.sort(pairs[:, 0]), np.arange(ids))):
            mapped = draft
        else:
            mapped = map_vocab(draft, target_vocab_size, pairs, fallback=fallback,
                               spelling=spelling())
    _PAIRED[key] = (given, draft_tokenizer, target_tokenizer, mapped)
    while len(_PAIRED) > 4:
        _PAIRED.popitem(last=False)
    return mapped


def vocab_coverage(target: Model, draft: DraftModel, sequences) -> dict:
    """How much probability the shared tokens of a mapped draft (``map_vocab``,
    ``for_tokenizers``) carry, on the texts ``sequences`` (lists of target token ids) read by
    both models: ``target_mass``, the mean mass the target's next-token distribution puts on
    tokens the draft can propose, and ``draft_mass``, the mean mass the draft's (whole-vocabulary)
    distribution puts on them: the draft proposes from its distribution renormalised by that
    mass, so a low one means its proposals are distorted, a low target mass that the target's
    choices often lie outside what the draft can say. Also ``shared_tokens`` and ``positions``
    (how many next-token distributions were averaged)."""
    from ..model import logits as full_logits
    draft = as_draft_model(draft)
    if draft.from_target is None or draft.vocab is None:
        raise ValueError("vocab_coverage needs a draft mapped to the target's vocabulary "
                         "(sj.draft.map_vocab, shared_prefix, or generate's draft_tokenizer=)")
    shared_target = np.asarray(draft.vocab.ids)
    shared_draft = np.asarray(draft.from_target)[shared_target]
    masses, count = np.zeros(2), 0
    for seq in sequences:
        ids = np.asarray(seq, np.int64).reshape(1, -1)
        if ids.size == 0:
            continue
        if ids.min() < 0 or ids.max() >= target.config.vocab_size:
            raise ValueError(f"a sequence holds ids outside the target's vocabulary "
                             f"[0, {target.config.vocab_size})")
        for model, tokens, shared, i in ((target, ids, shared_target, 0),
                                         (draft.model, np.asarray(draft.from_target)[ids],
                                          shared_draft, 1)):
            p = jax.nn.softmax(full_logits(model, tokens)[0], axis=-1)
            masses[i] += float(jnp.take(p, jnp.asarray(shared), axis=-1).sum())
        count += ids.size
    if not count:
        raise ValueError("vocab_coverage needs at least one non-empty sequence")
    return {"target_mass": masses[0] / count, "draft_mass": masses[1] / count,
            "shared_tokens": len(shared_target), "positions": count}


def _checked_draft(draft, name: str) -> DraftModel:
    if not isinstance(draft, (Model, DraftModel)):
        raise ValueError(f"{name} expects an sj.Model or sj.DraftModel, got "
                         f"{type(draft).__name__}")
    draft = as_draft_model(draft)
    if draft.from_target is not None or draft.strings is not None:
        raise ValueError(f"{name}: the draft already maps another vocabulary")
    return draft


VOCAB_FILE = "draft_vocab.npy"
"""A draft model folder may ship its draft vocabulary here (token ids, as ``np.save`` writes)."""


def load_draft_model(path, dtype: str | None = None, *, full_vocab: bool = False) -> DraftModel:
    """A draft model folder: ``sj.load_model(path, dtype)`` restricted to the draft vocabulary
    the folder ships in ``draft_vocab.npy``, unless there is none or ``full_vocab`` is set, with
    the calibration it ships in ``calibration.json`` (adaptive draft lengths), if any."""
    from ..checkpoint import load_model
    model = load_model(path, dtype)
    calibration = load_calibration(path, model)
    file = pathlib.Path(path) / VOCAB_FILE
    if full_vocab and file.exists() and calibration is not None:
        import warnings  # its confidences were those of the draft vocabulary, not of all tokens
        warnings.warn(f"{path}: full_vocab=True drafts over the whole vocabulary, and the "
                      f"folder's calibration.json was fitted over its draft vocabulary "
                      f"({VOCAB_FILE}): not used, so adaptive lengths read the raw confidence",
                      stacklevel=2)
        calibration = None
    if full_vocab or not file.exists():
        return DraftModel(model, None, calibration)
    try:
        vocab = np.load(file)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the draft vocabulary {file}: {e}") from e
    try:
        return restrict_vocab(DraftModel(model, None, calibration), vocab)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from e


def load_paired_draft(path, target_tokenizer, target_vocab_size: int, dtype: str | None = None,
                      *, full_vocab: bool = False, level: str = "token") -> DraftModel:
    """``load_draft_model``, then, when the folder ships a ``tokenizer.json`` of its own,
    ``for_tokenizers`` with it and the target's tokenizer (at ``level``): what ``specjax
    generate`` and ``specjax bench`` do with ``--draft FOLDER``."""
    draft = load_draft_model(path, dtype, full_vocab=full_vocab)
    if (pathlib.Path(path) / "tokenizer.json").is_file():
        from ..tokenizer import load_tokenizer
        draft = for_tokenizers(draft, load_tokenizer(path), target_tokenizer, target_vocab_size,
                               level=level)
    return draft


REJOIN_WIDTH = 8
"""Tokens a draft reads per forward when it rejoins after a rest (``DraftModelProposer.rejoin``):
after a rest of r rounds it reads r - 2 of them (its catch-up reads the last two), in
ceil((r - 2) / 8) such forwards."""


def _catch_up(draft: DraftModel, cache: KVCache, history: Array, length: Array
              ) -> tuple[Array, KVCache]:
    """The two-token forward at slots length - 1, length (see the module docstring): the
    logits at the last [B, 1, M] (the first position's are never read) and the cache."""
    rows = jnp.arange(history.shape[0])
    prev, last = history[rows, length - 1], history[rows, length]
    return draft.logits(jnp.stack([prev, last], 1), jnp.stack([length - 1, length], 1),
                        cache.rollback(length - 1), at=(1,))


def _prefilled(draft: DraftModel, prompts: Array, prompt_lengths: Array, capacity: int,
               slots: int) -> KVCache:
    """The draft cache with the prompts [B, N] (right-padded) prefilled, chunk by chunk up to
    the longest. A round writes ``slots`` slots from the catch-up's first (length - 1): that
    or a prefill chunk is the span of the sliding layers' rings (``KVCache.init``)."""
    cache = KVCache.init(draft.config, prompts.shape[0], capacity,
                         span=max(PREFILL_CHUNK, slots))
    return prefill_chunked(draft.model, draft.inputs(prompts), prompt_lengths, cache)[2]


@dataclasses.dataclass(frozen=True)
class DraftModelProposer:
    """A chain of γ drafts, sampled from the draft model with the request's processing.

    With ``survival_threshold`` (adaptive lengths, specjax/adaptive.py) the batch verifies
    draft k while some row's calibrated survival through k is at least the threshold, and the
    draft forwards stop once no row wants more (each later step is a ``lax.cond`` whose skipped
    branch writes nothing of use: those slots lie past every row's proposals)."""

    config: ModelConfig  # the draft model's config
    gamma: int  # drafts per round
    survival_threshold: float | None = None
    budget: Budget | None = None  # the batch's verify budget (adaptive.Budget)
    vocab_size: int = 0  # the target's V, that q's are widened to; 0: the draft's own
    idle_rounds: int = 0  # the longest rest after declined rounds (engine.Idle); 0: none
    # the threshold's and budget's numbers are passed per call (adaptive.split_tuning)
    tunable: ClassVar[bool] = True

    @property
    def target_vocab(self) -> int:
        return self.vocab_size or self.config.vocab_size

    @property
    def adaptive(self) -> bool:
        """Lengths chosen per row and round: the engine passes ``active`` (rows generating)."""
        return self.survival_threshold is not None or self.budget is not None

    @property
    def draft_forwards_per_round(self) -> int:
        return self.gamma

    def init(self, params: DraftModel, prompts: Array, prompt_lengths: Array,
             capacity: int) -> KVCache:
        """Prefill the draft cache with the prompts [B, N] (right-padded), chunk by chunk up to
        the longest."""
        return _prefilled(params, prompts, prompt_lengths, capacity, self.gamma + 1)

    @staticmethod
    def behind(read: Array, length: Array) -> Array:
        """Rows [B] whose draft has not read enough for a proposal: one reads up to ``read`` [B]
        itself, its catch-up forward the last two positions (length - 1, length)."""
        return read < length - 2

    def rejoin(self, params: DraftModel, cache: KVCache, history: Array, read: Array,
               length: Array) -> tuple[KVCache, Array]:
        """After a rest (``engine.Idle``): the draft reads the next ``REJOIN_WIDTH`` of the
        tokens it missed (positions read + 1 ...; never past a row's ``length``), keys and
        values only. Returns the cache and the positions read through. A row that is not behind
        reads its last ones again, which writes what its slots hold."""
        draft = params
        C = min(REJOIN_WIDTH, cache.capacity)
        start = jnp.maximum(jnp.minimum(read + 1, length + 1 - C), 0)
        positions = start[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]
        tokens = jnp.take_along_axis(history, jnp.minimum(positions, history.shape[1] - 1), 1)
        _, _, cache = forward(draft.model, draft.inputs(tokens), positions,
                              cache.rollback(start), logits_at=())
        read = jnp.maximum(read, jnp.minimum(start + C - 1, length))
        return cache.rollback(read + 1), read

    def propose(self, params: DraftModel, cache: KVCache, history: Array, length: Array,
                keys: Array, sampling_params: sampling.SamplingArrays, filters: sampling.Filters,
                active: Array | None = None) -> tuple[Draft, KVCache]:
        """One round's chain; ``active`` [B] (adaptive lengths only): the rows still generating,
        the only ones that draft and count toward the verify budget."""
        draft = params
        step_keys = jax.vmap(lambda k: jax.random.split(k, self.gamma))(keys)  # [B, G]
        if self.adaptive:
            return self._adaptive(draft, cache, history, length, step_keys, sampling_params,
                                  filters, active)
        logits, cache = _catch_up(draft, cache, history, length)
        token, q = draw(logits[:, -1], step_keys[:, 0], sampling_params, filters, draft.vocab)
        # γ - 1 single-token forwards, unrolled (γ is static and small): a lax.scan here carries
        # the draft cache through a loop, which measured slower per round on a CPU.
        tokens, probs = [token], [q]
        for i in range(1, self.gamma):
            logits, cache = draft.logits(token[:, None], (length + i)[:, None], cache)
            token, q = draw(logits[:, 0], step_keys[:, i], sampling_params, filters, draft.vocab)
            tokens.append(token)
            probs.append(q)
        return stack_chain(tokens, probs, draft.vocab, self.target_vocab), cache

    def _adaptive(self, draft: DraftModel, cache: KVCache, history: Array, length: Array,
                  step_keys: Array, sampling_params: sampling.SamplingArrays,
                  filters: sampling.Filters, active: Array | None) -> tuple[Draft, KVCache]:
        control = ChainControl(draft.calibration, self.survival_threshold, self.budget,
                               sampling_params.temperature == 0, active)
        logits, cache = _catch_up(draft, cache, history, length)
        token, q, score = draw_scored(logits[:, -1], step_keys[:, 0], sampling_params, filters,
                                      draft.vocab)
        control.step(score)
        tokens, probs = [token], [q]

        def step(i, token, q, score, cache):
            logits, kv = draft.logits(token[:, None], (length + i)[:, None], cache, write=False)
            return draw_scored(logits[:, 0], step_keys[:, i], sampling_params, filters,
                               draft.vocab), kv

        for i in range(1, self.gamma):
            def skip(i, token, q, score, cache):
                shape = jax.eval_shape(step, i, token, q, score, cache)[1]
                nothing = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape)
                return (token, q, jnp.zeros_like(score)), nothing

            (token, q, score), kv = jax.lax.cond(control.drafting(), step, skip, i, token, q,
                                                 score, cache)
            cache = write_chunk(cache, *kv)
            control.step(score)
            tokens.append(token)
            probs.append(q)
        valid, predicted = control.arrays()
        chain = stack_chain(tokens, probs, draft.vocab, self.target_vocab, valid)
        return dataclasses.replace(chain, predicted=predicted, forwards=control.forwards), cache


SPELLED_SLOTS = 2
"""Draft cache slots per target token for a spelled draft. Code spelled by code-draft-bpe4k
takes 1.08 draft tokens per target token on average and at most 1.39 in any 64-token window of
the held-out files; a cache sized for the longest spelling (K = 7 there) is walked in blocks
(experiments/results/2026-12-04-spelled-round.md). A text that spells longer than the cache
holds keeps exact output: the draft then reads its start and its newest tokens, which can cost
acceptance only."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpelledState:
    """A draft cache in the draft's own tokens and where the target's tokens sit in it: the
    draft has read the target's tokens up to index ``last`` [B], spelled, in slots
    0 .. ``after`` - 1 [B] (a chain's drafts: their draft ids; a text spelled longer than the
    cache: its start and its newest tokens, see SPELLED_SLOTS)."""

    cache: KVCache
    last: Array
    after: Array


@dataclasses.dataclass(frozen=True)
class SpelledChainProposer:
    """The chain of ``DraftModelProposer`` for a draft with a tokenizer of its own that reads
    the target's tokens as their spellings in its tokens (``DraftModel.spelling``, K draft
    tokens at most per target token). Its cache is in its own tokenization, so a draft slot is
    not a target position; the state records where the last target token read begins.

    Its drafts are shared tokens, one draft token each, read as that draft id. A round's draft
    forwards read drafts 1 .. γ - 1 (the γ-th is only proposed) in the slots from ``after``, so
    when the round before accepted a < γ drafts, the ones it accepted are already read and the
    catch-up forward reads only the newest target token, spelled, from slot ``after`` + a; when
    it accepted all γ, the catch-up reads the last draft's id first, from slot ``after`` + γ - 1.
    That is K + 1 slots (the ones past what it reads are ignored and rolled back)."""

    config: ModelConfig  # the draft model's config
    gamma: int
    width: int  # K: the longest spelling
    vocab_size: int  # the target's V

    @property
    def target_vocab(self) -> int:
        return self.vocab_size

    @property
    def draft_forwards_per_round(self) -> int:
        return self.gamma

    def capacity(self, capacity: int) -> int:
        """Draft slots for ``capacity`` target slots: SPELLED_SLOTS per target token (K if
        smaller), plus a round's writes past the end (``limit``)."""
        return min(self.width, SPELLED_SLOTS) * capacity + self.width + self.gamma

    def limit(self, slots: int) -> int:
        """The last slot a round's catch-up may start at in a cache of ``slots``: it writes K + 1
        slots from there and its draft forwards γ - 1 more after what it read."""
        return slots - self.width - self.gamma

    def init(self, params: DraftModel, prompts: Array, prompt_lengths: Array,
             capacity: int) -> SpelledState:
        """Prefill the prompts [B, N] (right-padded), spelled, into the draft cache."""
        slots = self.capacity(capacity)
        return spelled_prefill(params, prompts, prompt_lengths, slots,
                               max(PREFILL_CHUNK, self.width + self.gamma), self.limit(slots))

    def propose(self, params: DraftModel, state: SpelledState, history: Array, length: Array,
                keys: Array, sampling_params: sampling.SamplingArrays, filters: sampling.Filters
                ) -> tuple[Draft, SpelledState]:
        draft, K = params, self.width
        B = history.shape[0]
        rows = jnp.arange(B)
        step_keys = jax.vmap(lambda k: jax.random.split(k, self.gamma))(keys)  # [B, G]
        # drafts accepted last round (a finished row's length stops: 0); all γ: the last one
        # was proposed but never read
        accepted = jnp.clip(length - state.last - 1, 0, self.gamma)
        unread = accepted == self.gamma
        # A text spelled longer than the cache holds: the catch-up starts at the limit every
        # round, over the newest tokens read (the draft then reads the text's start and its end).
        start = jnp.minimum(state.after + accepted - unread, self.limit(state.cache.capacity))
        spelled, size = _spell(draft.spelling, history[rows, length])  # [B, K], [B]
        last_draft = draft.inputs(history[rows, length - 1])[:, None]
        tokens = jnp.where(unread[:, None],
                           jnp.concatenate([last_draft, spelled], 1),
                           jnp.concatenate([spelled, jnp.zeros_like(last_draft)], 1))
        read = size + unread  # [B, K + 1] tokens of which the first read count
        _, hidden, cache = forward(draft.model, tokens,
                                   start[:, None] + jnp.arange(K + 1)[None, :],
                                   state.cache.rollback(start))
        after = start + read
        cache = cache.rollback(after)
        # a mapped draft always has its shared tokens as draft vocabulary (map_vocab)
        logits = draft.vocab.logits(hidden[rows, read - 1])
        token, q = draw(logits, step_keys[:, 0], sampling_params, filters, draft.vocab)
        tokens, probs = [token], [q]
        for i in range(1, self.gamma):
            logits, cache = draft.logits(token[:, None], (after + i - 1)[:, None], cache)
            token, q = draw(logits[:, 0], step_keys[:, i], sampling_params, filters, draft.vocab)
            tokens.append(token)
            probs.append(q)
        chain = stack_chain(tokens, probs, draft.vocab, self.target_vocab)
        return chain, SpelledState(cache, length, after)


def spelled_prefill(params: DraftModel, prompts: Array, prompt_lengths: Array, slots: int,
                    span: int, limit: int | None = None) -> SpelledState:
    """A draft cache of ``slots`` slots (``span``: as ``KVCache.init``) with the prompts
    [B, N] (right-padded, target ids) prefilled as their spellings in the draft's tokens. A
    spelled prompt longer than ``limit`` (default ``slots``) draft tokens keeps its last
    ``limit``."""
    B, N = prompts.shape
    spelled, sizes = _spell(params.spelling, prompts)  # [B, N, K], [B, N]
    sizes = jnp.where(jnp.arange(N)[None, :] < prompt_lengths[:, None], sizes, 0)
    tokens, total = _packed(spelled, sizes)
    limit = slots if limit is None else limit
    if tokens.shape[1] > limit:  # (static: only a cache smaller than K per token can overflow)
        cut = jnp.maximum(total - limit, 0)
        tokens = jnp.take_along_axis(tokens, cut[:, None] + jnp.arange(limit)[None, :], axis=1,
                                     mode="clip")
        total = total - cut
    cache = KVCache.init(params.config, B, slots, span=span)
    cache = prefill_chunked(params.model, tokens, total, cache)[2]
    return SpelledState(cache, prompt_lengths - 1, total)


def _packed(pieces: Array, sizes: Array) -> tuple[Array, Array]:
    """Pieces [B, N, K] of which the first sizes [B, N] count, back to back: [B, N * K] (0
    after the last) and the total length [B]. Spellings into a token chunk; draft tokens'
    bytes into text (specjax/draft/strings.py)."""
    B, N, K = pieces.shape
    ends = jnp.cumsum(sizes, axis=1)
    within = jnp.arange(K)[None, None, :]
    slot = jnp.where(within < sizes[:, :, None], (ends - sizes)[:, :, None] + within, N * K)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None, None], slot.shape)
    return (jnp.zeros((B, N * K), pieces.dtype).at[rows, slot].set(pieces, mode="drop"),
            ends[:, -1])


def _spell(spelling: Array, tokens: Array) -> tuple[Array, Array]:
    """Target ids [...] -> their draft spellings [..., K] (-1 entries as 0) and lengths [...]."""
    spelled = jnp.take(spelling, tokens, axis=0, mode="clip")
    return jnp.maximum(spelled, 0), (spelled >= 0).sum(-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class DraftTreeProposer:
    """The draft model expanding a static tree level by level (one draft forward per depth).

    The round starts with the chain proposer's two-token catch-up forward, whose last position
    ranks the root's children. Then for each depth d < D, the nodes at depth d are fed in one
    forward at positions length + d, written at their tree slots (node i at slot length + i)
    under the tree's ancestor mask (``cache.attention_mask`` with a window covering the tree
    so far), and their logits give their own children. Greedy: a node's children are the
    draft's top-ranked tokens after it (rank r = the r-th largest logit), point masses. Sampled:
    draws without replacement from the draft's processed q after it, verified by recursive
    rejection sampling (``base.tree_candidates``, ``verify.tree_sample``).

    After verification the engine calls ``commit``, which moves the accepted path's entries to
    consecutive slots, so the next round's catch-up sees the cache a chain would have left.
    """

    config: ModelConfig
    tree: Tree
    vocab_size: int = 0  # the target's V, that q's are widened to; 0: the draft's own

    @property
    def target_vocab(self) -> int:
        return self.vocab_size or self.config.vocab_size

    @property
    def gamma(self) -> int:
        return self.tree.num_nodes - 1  # drafts per round: every non-root node

    @property
    def draft_forwards_per_round(self) -> int:
        return self.tree.depth

    def init(self, params: DraftModel, prompts: Array, prompt_lengths: Array,
             capacity: int) -> KVCache:
        return _prefilled(params, prompts, prompt_lengths, capacity, self.tree.num_nodes + 1)

    def propose(self, params: DraftModel, cache: KVCache, history: Array, length: Array,
                keys: Array, sampling_params: sampling.SamplingArrays, filters: sampling.Filters
                ) -> tuple[Draft, KVCache]:
        draft, tree = params, self.tree
        B = history.shape[0]

        def children(logits, d):  # the candidates depth d's nodes need: top-ranked or sampled
            level_keys = jax.vmap(lambda k: jax.random.fold_in(k, d))(keys)
            return tree_candidates(logits, tree.ranks_under(d), level_keys, sampling_params,
                                   filters, draft.vocab)

        logits, cache = _catch_up(draft, cache, history, length)

        def expand(d, level, parent):  # level: the nodes at depth d + 1 that have children
            nonlocal cache
            start = tree.levels[d][0]
            stop = start + level.shape[1]
            positions = jnp.broadcast_to((length + d + 1)[:, None], (B, stop - start))
            logits, cache = draft.logits(level, positions, cache.rollback(length + start),
                                         chunk_mask=jnp.asarray(tree.ancestors[start:stop, :stop]))
            return children(logits, d + 1)

        tokens, q = expand_tree(tree, children(logits[:, -1:], 0), expand, draft.vocab,
                                self.target_vocab)
        return Draft(tokens, q), cache

    def commit(self, cache: KVCache, start: Array, path: Array, num_accepted: Array) -> KVCache:
        """Move the accepted path's draft entries next to each other (the length is reset by the
        next ``propose``)."""
        return compact(cache, start, path, num_accepted)


def build(spec: SpecConfig, draft, target: ModelConfig):
    """The registry's builder for method "draft_model": a chain or tree proposer for ``draft``
    (an sj.Model or sj.DraftModel sharing the target's vocabulary)."""
    if draft is None:
        raise ValueError(f"method {spec.method!r} needs a draft model: pass draft=")
    if not isinstance(draft, (Model, DraftModel)):
        raise ValueError(f"draft must be an sj.Model or sj.DraftModel (sj.init_model, "
                         f"sj.load_draft_model), got {type(draft).__name__}")
    draft = as_draft_model(draft)
    if draft.strings is not None:
        if spec.tree is not None or spec.survival_threshold is not None or spec.budget is not None:
            raise ValueError("string-level drafts (sj.draft.for_tokenizers(..., level='string')) "
                             "run as a chain: tree=, survival_threshold= and budget= are not "
                             "supported with them")
        if draft.spelling.shape[0] != target.vocab_size:  # it reads target ids by this table
            raise ValueError(f"the string-level draft was made for a target of vocab_size "
                             f"{draft.spelling.shape[0]} (sj.draft.for_tokenizers), this target "
                             f"has {target.vocab_size}")
        from .strings import StringChainProposer
        return StringChainProposer(draft.config, spec.num_speculative_tokens,
                                   int(draft.spelling.shape[1]))
    if draft.from_target is not None:
        if draft.from_target.shape != (target.vocab_size,):
            raise ValueError(f"the draft was made for a target of vocab_size "
                             f"{draft.from_target.shape[0]} (sj.draft.shared_prefix), this "
                             f"target has {target.vocab_size}")
    elif draft.config.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft vocab_size {draft.config.vocab_size} != target vocab_size "
            f"{target.vocab_size}: a draft with a tokenizer of its own is passed with it, "
            f"generate(..., tokenizer=target_tokenizer, draft_tokenizer=its_tokenizer); a draft "
            f"whose ids are the first ones of the target's: sj.draft.shared_prefix(draft, "
            f"{target.vocab_size})")
    if spec.tree is None and draft.spelling is not None and spec.survival_threshold is None \
            and spec.budget is None:
        return SpelledChainProposer(draft.config, spec.num_speculative_tokens,
                                    int(draft.spelling.shape[1]), target.vocab_size)
    if spec.tree is None:
        return DraftModelProposer(draft.config, spec.num_speculative_tokens,
                                  spec.survival_threshold, spec.budget, target.vocab_size,
                                  spec.rests)
    tree = Tree(spec.tree)
    if int(tree.children.shape[1]) > draft.vocab_size:
        raise ValueError(f"the tree gives a node {int(tree.children.shape[1])} children, "
                         f"more than the draft's {draft.vocab_size}-token draft vocabulary")
    return DraftTreeProposer(draft.config, tree, target.vocab_size)
