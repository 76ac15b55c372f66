"""String-level drafts: a draft with another tokenizer drafts freely in its own tokens, its text
becomes target tokens, and those are verified as point masses (Timor et al. 2025's string-level
exact match, here inside the compiled loop).

Token-level intersection (``map_vocab``) lets a draft propose only the tokens the two tokenizers
share; a target token the draft cannot write in one token of its own can never be drafted. Here
the draft writes text: each round it takes γ + 1 greedy steps in its own vocabulary, the bytes of
those tokens are cut into target tokens by longest match (the longest target token that the text
starts with, again from where it ends), and the first γ of them are the round's drafts, as point
masses. A target token that ends exactly where the draft's text ends is not proposed (the next
draft token might have made it part of a longer one), unless the draft ended its text there (a
special token). A draft token that ends inside a UTF-8 character and a target token that spans
two draft tokens need nothing special: the text is bytes.

Lossless: the drafts are target ids proposed as point masses, and the verifier is exact for
point masses at any temperature (a draft x passes with probability p(x), else the residual is
drawn); how they were found never enters.

After verification the draft reads the accepted target tokens as their spellings in its own
tokens (``DraftModel.spelling``, as ``SpelledChainProposer``): its cache is rolled back to the
end of the text it had read and the new target tokens (the accepted drafts and the target's own
token, at most γ + 1) are written after it in one forward.

Matching runs on the device: the target's tokens are kept as a sorted table of 32-bit hashes of
their bytes (``StringBridge``); every substring of the draft's text up to the longest target
token is hashed from prefix hashes, looked up with a binary search, and its bytes compared with
the token's, so a hash collision can only lose a match, never make a wrong one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from .. import sampling
from ..config import ModelConfig
from ..model import PREFILL_CHUNK
from . import draft_model
from .base import Draft
from .draft_model import SpelledState, _packed, _spell, spelled_prefill

_P = 1_000_003  # the hash's base (odd, so invertible modulo 2^32)
_LENGTH_MIX = 0x9E3779B1


def _hash(data: bytes) -> int:
    """The hash ``StringBridge`` keeps for a target token (the device computes the same)."""
    h = 0
    for b in data:
        h = (h * _P + b + 1) % 2 ** 32
    return (h + len(data) * _LENGTH_MIX) % 2 ** 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StringBridge:
    """What turns a draft's tokens into text and text into target tokens, on the device."""

    draft_bytes: Array  # [V_d, Lb] int32: each draft token's bytes (0 after its length)
    draft_len: Array  # [V_d] int32: its length; -1 for a token that writes no text (special)
    keys: Array  # [n] uint32, sorted: the hashes of the target tokens' bytes
    key_ids: Array  # [n] int32: the target token of each key
    target_bytes: Array  # [V_t, Lt] int32: each target token's bytes
    target_len: Array  # [V_t] int32: their lengths (0: never matched)
    # [] bool: the target splits text as GPT-2's byte-level pre-tokenizer does, where the last
    # whitespace of a run before other text starts the next piece (" return" after an indent)
    whitespace_runs: Array

    @property
    def longest(self) -> int:
        """Lt: the longest target token matched, in bytes."""
        return int(self.target_bytes.shape[1])


def string_bridge(draft_tokenizer, target_tokenizer, target_vocab_size: int,
                  draft_vocab_size: int, *, longest: int = 48) -> StringBridge:
    """The tables for two tokenizers (sj.Tokenizer): the draft's tokens' bytes (a special token
    ends the text) and the target's tokens by their bytes (special tokens, and tokens longer
    than ``longest`` bytes, are never matched)."""
    from .vocab import token_keys
    draft_keys = token_keys(draft_tokenizer)[:draft_vocab_size]
    draft_keys += [None] * (draft_vocab_size - len(draft_keys))
    texts = [k[1] if k is not None and k[0] == "bytes" else None for k in draft_keys]
    width = max([len(t) for t in texts if t] + [1])
    draft_bytes = np.zeros((draft_vocab_size, width), np.int32)
    draft_len = np.full(draft_vocab_size, -1, np.int32)
    for i, t in enumerate(texts):
        if t is not None:
            draft_bytes[i, :len(t)] = list(t)
            draft_len[i] = len(t)
    target_keys = token_keys(target_tokenizer)[:target_vocab_size]
    matched = {}
    for i, k in enumerate(target_keys):
        if k is not None and k[0] == "bytes" and 0 < len(k[1]) <= longest:
            matched.setdefault(k[1], i)
    if not matched:
        raise ValueError("the target tokenizer has no token the draft's text could be cut into")
    Lt = max(map(len, matched))
    target_bytes = np.zeros((target_vocab_size, Lt), np.int32)
    target_len = np.zeros(target_vocab_size, np.int32)
    pairs = []
    for data, i in matched.items():
        target_bytes[i, :len(data)] = list(data)
        target_len[i] = len(data)
        pairs.append((_hash(data), i))
    pairs.sort()
    keys = np.array([h for h, _ in pairs], np.uint32)
    ids = np.array([i for _, i in pairs], np.int32)
    import json

    from .vocab import _uses
    spec = json.loads(target_tokenizer.backend.to_str())
    runs = _uses(spec.get("pre_tokenizer"), "ByteLevel")
    return StringBridge(jnp.asarray(draft_bytes), jnp.asarray(draft_len), jnp.asarray(keys),
                        jnp.asarray(ids), jnp.asarray(target_bytes), jnp.asarray(target_len),
                        jnp.asarray(runs))


def draft_text(bridge: StringBridge, tokens: Array) -> tuple[Array, Array, Array]:
    """Draft tokens [B, G] -> their bytes, concatenated [B, G * Lb] (0 past the end), the
    text's length [B] (up to the first special token) and whether one ended it [B]."""
    sizes = bridge.draft_len[tokens]  # [B, G]
    stops = sizes < 0
    stopped_before = jnp.cumsum(stops, axis=1) - stops > 0
    sizes = jnp.where(~stops & ~stopped_before, sizes, 0)
    text, length = _packed(bridge.draft_bytes[tokens], sizes)
    return text, length, stops.any(axis=1)


def longest_matches(bridge: StringBridge, text: Array, length: Array) -> tuple[Array, Array]:
    """For each byte offset s of text [B, N] (length [B]): the longest target token the text
    starts with at s and ends by ``length``, as (its id [B, N], its length in bytes [B, N], 0
    where none)."""
    B, N = text.shape
    Lt = bridge.longest
    padded = jnp.pad(text, ((0, 0), (0, Lt)))
    windows = jnp.stack([padded[:, i:i + N] for i in range(Lt)], axis=-1)  # [B, N, Lt]
    # h(s, l) = sum_{i<l} (b_{s+i} + 1) P^(l-1-i), mod 2^32 (uint32 arithmetic wraps)
    P = jnp.uint32(_P)
    h = jnp.zeros((B, N), jnp.uint32)
    hashes = []
    for i in range(Lt):
        h = h * P + (windows[..., i].astype(jnp.uint32) + jnp.uint32(1))
        hashes.append(h + jnp.uint32((i + 1) * _LENGTH_MIX % 2 ** 32))
    hashes = jnp.stack(hashes, axis=-1)  # [B, N, Lt]: the substring of l = index + 1 bytes
    where = jnp.clip(jnp.searchsorted(bridge.keys, hashes), 0, bridge.keys.shape[0] - 1)
    cand = bridge.key_ids[where]  # [B, N, Lt]
    sizes = jnp.arange(1, Lt + 1)
    same = (bridge.keys[where] == hashes) & (bridge.target_len[cand] == sizes)
    inside = jnp.arange(Lt)[None, :] < sizes[:, None]  # [l, i]: byte i belongs to length l
    # each candidate's bytes [B, N, Lt(l), Lt(i)] against the text's at s
    equal = jnp.all((bridge.target_bytes[cand] == windows[..., None, :]) | ~inside, axis=-1)
    fits = (jnp.arange(N)[None, :, None] + sizes[None, None, :]) <= length[:, None, None]
    # no token across a piece boundary of the target's pre-tokenizer: a whitespace byte after
    # whitespace and before other text starts a piece (GPT-2's `\s+(?!\S)`); without this rule
    # a long run of spaces is matched where the target would write the run minus one and then
    # " return" (on held-out code, 91% of the token ends match the target's own tokenization
    # without it, 97% with it)
    space = (text == 32) | ((text >= 9) & (text <= 13))
    before = jnp.pad(space[:, :-1], ((0, 0), (1, 0)))
    after = jnp.pad(~space[:, 1:], ((0, 0), (0, 1))) \
        & (jnp.arange(N)[None, :] + 1 < length[:, None])
    starts = (space & before & after & bridge.whitespace_runs).astype(jnp.int32)
    count = jnp.pad(jnp.cumsum(starts, axis=1), ((0, 0), (0, Lt)), mode="edge")  # at <= j
    ends = jnp.arange(N)[:, None] + sizes[None, :] - 1  # [N, Lt]: the match's last byte
    inside = jnp.take_along_axis(count, jnp.broadcast_to(ends.reshape(1, -1), (B, N * Lt)),
                                 axis=1).reshape(B, N, Lt) - count[:, :N, None]
    hit = same & fits & equal & (inside == 0)
    best = jnp.max(jnp.where(hit, sizes, 0), axis=-1)  # [B, N]
    index = jnp.clip(best - 1, 0, Lt - 1)
    return jnp.take_along_axis(cand, index[..., None], axis=-1)[..., 0], best


def cut(bridge: StringBridge, text: Array, length: Array, stopped: Array, gamma: int
        ) -> tuple[Array, Array]:
    """The draft's text [B, N] (length [B]) cut into at most ``gamma`` target tokens by longest
    match: tokens [B, γ] and valid [B, γ] (a prefix: matching stops at bytes no target token
    starts, and a token ending at the text's end counts only when ``stopped``)."""
    ids, sizes = longest_matches(bridge, text, length)
    B, N = text.shape
    rows = jnp.arange(B)
    at = jnp.zeros((B,), jnp.int32)
    going = jnp.ones((B,), bool)
    tokens, valid = [], []
    for _ in range(gamma):
        here = jnp.clip(at, 0, N - 1)
        size = jnp.where(at < N, sizes[rows, here], 0)
        end = at + size
        going &= (size > 0) & ((end < length) | stopped)
        tokens.append(ids[rows, here])
        valid.append(going)
        at = end
    return jnp.stack(tokens, 1), jnp.stack(valid, 1)


@dataclasses.dataclass(frozen=True)
class StringChainProposer:
    """String-level drafts from a draft model with a tokenizer of its own (module docstring):
    γ + 1 greedy draft steps, their text cut into up to γ target tokens."""

    config: ModelConfig  # the draft model's config
    gamma: int  # target tokens verified per round, at most
    width: int  # K: the longest spelling of a target token in draft tokens

    @property
    def draft_forwards_per_round(self) -> int:
        return self.gamma + 1  # the catch-up, then γ single-token steps: γ + 1 draft tokens

    @property
    def reads(self) -> int:
        """Target tokens the catch-up may read: the accepted drafts and the target's token."""
        return self.gamma + 1

    @property
    def per_token(self) -> int:
        """Draft slots per target token in the cache and in a catch-up: SPELLED_SLOTS (K if
        smaller), as ``SpelledChainProposer``'s cache."""
        return min(self.width, draft_model.SPELLED_SLOTS)

    @property
    def span(self) -> int:
        """Slots a round writes from the catch-up's first: the catch-up, then γ draft steps."""
        return self.reads * self.per_token + self.gamma + 1

    def init(self, params, prompts: Array, prompt_lengths: Array, capacity: int
             ) -> SpelledState:
        """Prefill the prompts, spelled, as ``SpelledChainProposer`` does."""
        slots = self.per_token * capacity + self.span
        return spelled_prefill(params, prompts, prompt_lengths, slots,
                               max(PREFILL_CHUNK, self.span), slots - self.span)

    def catch_up(self, params, state: SpelledState, history: Array, length: Array
                 ) -> tuple[Array, SpelledState]:
        """Read the target tokens after ``state.last`` up to ``length`` (spelled) from slot
        ``state.after``: the draft's logits after them [B, M] and the new state.

        It reads at most ``per_token`` draft tokens a target token on average (the first that
        many of their spellings; text spelled longer is skipped), and from the cache's last
        usable slot at most (a text spelled longer than the cache holds): the draft then reads
        less of the text, which can only cost acceptance."""
        B, S = history.shape
        R, W = self.reads, self.reads * self.per_token
        rows = jnp.arange(B)
        index = state.last[:, None] + 1 + jnp.arange(R)[None, :]  # [B, R]
        spelled, sizes = _spell(params.spelling, history[rows[:, None], jnp.clip(index, 0, S - 1)])
        tokens, read = _packed(spelled, jnp.where(index <= length[:, None], sizes, 0))
        tokens, read = tokens[:, :W], jnp.minimum(read, W)
        start = jnp.minimum(state.after, state.cache.capacity - self.span)
        positions = start[:, None] + jnp.arange(W)[None, :]
        logits, cache = params.logits(tokens, positions, state.cache.rollback(start))
        after = start + read
        logits = logits[rows, jnp.maximum(read - 1, 0)]
        return logits, SpelledState(cache.rollback(after), jnp.maximum(length, state.last), after)

    def propose(self, params, state: SpelledState, history: Array, length: Array, keys: Array,
                sampling_params: sampling.SamplingArrays, filters: sampling.Filters
                ) -> tuple[Draft, SpelledState]:
        logits, state = self.catch_up(params, state, history, length)
        cache = state.cache
        token = params.token_ids(sampling.argmax(logits))
        drafted = [token]
        for i in range(1, self.gamma + 1):
            logits, cache = params.logits(token[:, None], (state.after + i - 1)[:, None], cache)
            token = params.token_ids(sampling.argmax(logits[:, 0]))
            drafted.append(token)
        bridge = params.strings
        text, size, stopped = draft_text(bridge, jnp.stack(drafted, axis=1))
        tokens, valid = cut(bridge, text, size, stopped, self.gamma)
        # the cache the draft steps wrote, rolled back (the next catch-up rolls back anyway):
        # returning the one before them made XLA copy the whole cache every round
        return Draft(tokens, None, valid), dataclasses.replace(state,
                                                               cache=cache.rollback(state.after))
