"""Draft vocabularies: a proposer that drafts only from M of the target's V token ids.

A small draft spends most of each step in its vocabulary projection (the bundled draft's LM head
is 73% of the weights a step multiplies by; EAGLE and Medusa project through the target's whole
LM head). Cutting the head to the M most frequent tokens of the training data (the idea of FR-Spec
and EAGLE-3) makes each draft step much cheaper. It stays lossless: q is zero outside the subset
(renormalised over it), and the verifier corrects any q.

``DraftVocab`` is a pytree of two arrays, ids [M] and the head's columns for them [E, M]: the
draft model and the heads drafters each carry one beside their weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from ..attention import soft_cap
from ..config import check_int
from ..model import Model


def lm_head(model: Model) -> Array:
    """A model's LM head as [E, V] (the embedding's transpose when tied)."""
    p = model.params
    if model.config.tie_word_embeddings:
        return p["embed_tokens"]["embedding"].T
    return p["lm_head"]["kernel"]


def check_vocab(vocab, vocab_size: int) -> np.ndarray:
    """A draft vocabulary as int32 [M], or ValueError: it must be distinct ids in [0, V)."""
    ids = np.asarray(vocab)
    if (ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer)
            or ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"a draft vocabulary must be a non-empty 1-D list of token ids in "
                         f"[0, {vocab_size}), got {_describe(ids)}")
    if np.unique(ids).size != ids.size:
        raise ValueError("the draft vocabulary has repeated token ids")
    return ids.astype(np.int32)


def _describe(ids: np.ndarray) -> str:
    if ids.size == 0 or ids.ndim != 1 or not np.issubdtype(ids.dtype, np.number):
        return f"an array of shape {ids.shape} and dtype {ids.dtype}"
    return f"{ids.size} ids from {ids.min()} to {ids.max()} ({ids.dtype})"


def frequent_tokens(tokens: np.ndarray, vocab_size: int, size: int) -> np.ndarray:
    """The ``size`` most frequent ids of a token stream (ties: the smaller id), sorted by id."""
    check_int("frequent_tokens' vocab_size", vocab_size, 1)
    check_int("frequent_tokens' size", size, 1)
    if size > vocab_size:  # fewer ids than asked for came back
        raise ValueError(f"frequent_tokens: size {size} is more than the vocabulary's "
                         f"{vocab_size} ids")
    tokens = np.asarray(tokens).ravel()
    if tokens.size and (not np.issubdtype(tokens.dtype, np.integer) or tokens.min() < 0
                        or tokens.max() >= vocab_size):  # ids past it were dropped
        raise ValueError(f"frequent_tokens counts token ids in [0, {vocab_size}), got "
                         f"{_describe(tokens)}")
    counts = np.bincount(tokens, minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
    return np.sort(order[:size]).astype(np.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftVocab:
    """The M token ids a proposer may draft and the LM head columns that score them."""

    ids: Array  # [M] int32, ids into the target's vocabulary
    head: Array  # [E, M], the LM head's columns for ids
    # the model's final logit soft-cap (Gemma 2: logits -> c · tanh(logits / c)), or None
    softcap: float | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def of(cls, model: Model, vocab) -> DraftVocab:
        """The draft vocabulary ``vocab`` (checked ids) over ``model``'s LM head."""
        ids = check_vocab(vocab, model.config.vocab_size)
        ids = jnp.asarray(ids, jnp.int32)
        return cls(ids, jnp.take(lm_head(model), ids, axis=1),
                   model.config.final_logit_softcapping)

    @property
    def size(self) -> int:
        """M."""
        return int(self.ids.shape[0])

    def logits(self, h: Array) -> Array:
        """Features [..., E] -> logits over the draft vocabulary [..., M] (float32), soft-capped
        as the model's own logits are."""
        logits = jnp.einsum("...e,em->...m", h.astype(self.head.dtype), self.head,
                            preferred_element_type=jnp.float32)
        return soft_cap(logits, self.softcap)

    def token_ids(self, index: Array) -> Array:
        """Indices into the draft vocabulary -> token ids (int32)."""
        return self.ids[index].astype(jnp.int32)

    def widen(self, sub: Array, vocab_size: int) -> Array:
        """Probabilities over the draft vocabulary [..., M] -> [..., V], zero elsewhere.

        A gather, not a scatter: each of the V ids reads its slot of ``sub`` (M, a zero, for an
        id outside the vocabulary). XLA's CPU scatter of ``sub`` along its last axis
        (``.at[..., ids].set``) walked the M ids across every row: 4.7 ms for a chain's q's at
        batch 16, γ 8 (M 2,048, V 8,192) against 0.8 ms gathered, 0.68 against 0.13 ms at
        batch 4, level at batch 1 (experiments/results/2026-12-07-widen-gather.md). Row by row
        (vmapped): ``jnp.take`` over the last axis gave the result a transposed layout, which
        the decode loop then copied back every round (1.25 ms a round at batch 16)."""
        M = self.ids.shape[0]
        if sub.ndim == 0 or sub.shape[-1] != M:
            raise ValueError(f"DraftVocab.widen: q over the draft vocabulary must end in its {M} "
                             f"ids, got shape {tuple(sub.shape)}")
        slot = jnp.full((vocab_size,), M, jnp.int32).at[self.ids].set(
            jnp.arange(M, dtype=jnp.int32))
        rows = jnp.pad(sub.astype(jnp.float32).reshape(-1, M), ((0, 0), (0, 1)))
        return jax.vmap(lambda row: row[slot])(rows).reshape(sub.shape[:-1] + (vocab_size,))


# -- the tokens two tokenizers share (token-level intersection) -------------------------------

def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2, Llama 3, Qwen) writes each byte as one printable character: the
    printable Latin-1 bytes as themselves, the other 68 as 256, 257, ... in byte order. Its
    inverse: character -> byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _uses(spec, kind: str) -> bool:
    """Whether a tokenizer.json component tree has a part of type ``kind``."""
    if isinstance(spec, dict):
        return spec.get("type") == kind or any(_uses(v, kind) for v in spec.values())
    if isinstance(spec, list):
        return any(_uses(v, kind) for v in spec)
    return False


def token_keys(tokenizer) -> list[tuple[str, bytes] | None]:
    """What each id of ``tokenizer`` (an sj.Tokenizer) stands for, comparable across
    tokenizers: ("special", its text) for added special tokens, ("bytes", the bytes it writes)
    for the others: byte-level vocabularies decoded through their byte alphabet, SentencePiece
    ones with "▁" as a space and byte-fallback pieces (<0xAB>) as their byte. None for an id with
    no token."""
    import json
    import re
    backend = tokenizer.backend
    spec = json.loads(backend.to_str())
    byte_level = _uses(spec.get("pre_tokenizer"), "ByteLevel") or _uses(spec.get("decoder"),
                                                                         "ByteLevel")
    alphabet = _byte_level_alphabet() if byte_level else None
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    fallback = re.compile(r"<0x([0-9A-Fa-f]{2})>")
    out = []
    for i in range(tokenizer.vocab_size):
        text = backend.id_to_token(i)
        if text is None:
            out.append(None)
        elif i in special:
            out.append(("special", text))
        elif alphabet is not None:
            try:
                out.append(("bytes", bytes(alphabet[c] for c in text)))
            except KeyError:  # an added, not byte-encoded token
                out.append(("bytes", text.encode()))
        elif fallback.fullmatch(text):
            out.append(("bytes", bytes([int(fallback.fullmatch(text).group(1), 16)])))
        else:
            out.append(("bytes", text.replace("\u2581", " ").encode()))
    return out


def token_pairs(draft_tokenizer, target_tokenizer) -> np.ndarray:
    """(draft id, target id) [n, 2] for every token the two tokenizers share: the same bytes
    (or the same special token), each side's first id when a tokenizer has two for them. For
    ``sj.draft.map_vocab``."""
    target = {}
    for i, key in enumerate(token_keys(target_tokenizer)):
        if key is not None:
            target.setdefault(key, i)
    pairs, seen = [], set()
    for i, key in enumerate(token_keys(draft_tokenizer)):
        if key is not None and key in target and key not in seen:
            seen.add(key)
            pairs.append((i, target[key]))
    if not pairs:
        raise ValueError("the two tokenizers share no token")
    return np.asarray(pairs, np.int64)


def _shortest_segmentation(text: bytes, pieces: dict[bytes, int], longest: int
                           ) -> list[int] | None:
    """The fewest draft tokens whose bytes concatenate to ``text`` (ties: the earliest split
    found), or None when the draft's tokens cannot write it."""
    best: list[list[int] | None] = [[]] + [None] * len(text)
    for end in range(1, len(text) + 1):
        for start in range(max(0, end - longest), end):
            head, piece = best[start], pieces.get(text[start:end])
            if head is not None and piece is not None \
                    and (best[end] is None or len(head) + 1 < len(best[end])):
                best[end] = head + [piece]
    return best[-1]


def token_spellings(draft_tokenizer, target_tokenizer, target_vocab_size: int, *,
                    fallback: int = 0, max_tokens: int = 8,
                    draft_vocab_size: int | None = None) -> np.ndarray:
    """For each target id, the draft ids that write the same bytes: [V_target, K] int32, -1
    after the last (K: the longest spelling, at most ``max_tokens``; a longer one keeps its
    first ``max_tokens``). A shared token is its one draft id; another is the draft tokenizer's
    encoding of its text when that writes exactly its bytes, else the shortest split of its
    bytes into draft tokens (a token that ends inside a UTF-8 character); a special token the
    draft lacks, and bytes no draft tokens write, are ``fallback``. For ``map_vocab``'s
    ``spelling``: what a chain draft reads an accepted target token as. ``draft_vocab_size``:
    the draft model's rows, when its tokenizer names more ids (those are not used)."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r} must be an int >= 1")
    draft_keys = token_keys(draft_tokenizer)
    own = {}
    for i, key in enumerate(draft_keys[:draft_vocab_size]):
        if key is not None:
            own.setdefault(key, i)
    pieces = {key[1]: i for key, i in own.items() if key[0] == "bytes" and key[1]}
    longest = max(map(len, pieces), default=1)
    rows = []
    for key in token_keys(target_tokenizer)[:target_vocab_size]:
        if key is None:
            row = [fallback]
        elif key in own:
            row = [own[key]]
        elif key[0] == "special" or not key[1]:
            row = [fallback]
        else:
            row = None
            try:
                ids = draft_tokenizer.encode(key[1].decode("utf-8"), add_special_tokens=False)
                written = [draft_keys[i] for i in ids]
                if ids and max(ids) < len(draft_keys[:draft_vocab_size]) \
                        and all(k is not None and k[0] == "bytes" for k in written) \
                        and b"".join(k[1] for k in written) == key[1]:
                    row = list(ids)
            except UnicodeDecodeError:
                pass
            if row is None:
                row = _shortest_segmentation(key[1], pieces, longest) or [fallback]
        rows.append(row[:max_tokens])
    rows += [[fallback]] * (target_vocab_size - len(rows))  # ids past the target tokenizer's
    width = max(map(len, rows))
    out = np.full((target_vocab_size, width), -1, np.int32)
    for t, row in enumerate(rows):
        out[t, :len(row)] = row
    return out
