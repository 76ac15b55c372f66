"""Suffix decoding: drafts from what followed the row's latest tokens, in its own text and in the
outputs of earlier requests, as a tree weighted by how often each continuation followed.

The corpus is two sources, both searched inside the compiled loop:

* the row's own prompt and generated text (``history``), and
* a ``SuffixCache``: a fixed-size ring of token ids that the user keeps across calls
  (``draft=cache``); ``generate`` adds each call's outputs to it (and the prompts, with
  ``include_prompts=True``), the oldest evicted first. Its size is fixed, so filling it never
  recompiles anything.

Each round, for every row: every position e of either source where the row's last tokens occur
ending at e is scored by how many of them match (up to ``max_depth``); the ``candidates``
best occurrences (longest match first, then most recent; the row's own text counts as newer
than the corpus) whose match is the longest found are kept, with the tokens that followed each.
Those continuations fill the static shape (``specjax.tree.Tree``: a chain by default, or
``SpecConfig.tree``) breadth first: a node of child
rank r under a parent is the r-th most frequent token at that depth among the occurrences that
agree with the parent's path (ties: the more recent occurrence first). A node is proposed only
where its parent is, at least one occurrence supports it, its share of its parent's occurrences
is at least ``min_token_prob``, and its depth is at most ``max_spec_factor`` × the match length
(a longer match earns a deeper draft), or ``own_spec_factor`` × it where the longest match lies
in the row's own text. Drafts are point masses, verified by the tree verifier as
any tree is, so the output follows the target's distribution exactly, at any temperature.

SuffixDecoding (Oliaro et al., 2024) builds a suffix tree per request and a global one on the
host; this keeps both as flat token arrays scanned on the device, which costs a comparison per
corpus token and match length a round, and needs no host round trip.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import jax.numpy as jnp
import numpy as np
from jax import Array

from ..tree import Tree
from .base import MAX_CANDIDATES, Draft, check_fanout, fill_by_count
from .gate import GateState, gated
from .ngram import last_tokens, match_runs

SEPARATOR = -1  # ends a document in the corpus (and fills its empty slots)


class SuffixCache:
    """Earlier requests' tokens for suffix decoding: a ring of ``capacity_tokens`` ids on the
    device (int32, 4 bytes each), documents separated, the oldest overwritten first.

        cache = sj.draft.SuffixCache(capacity_tokens=65536)
        out = sj.generate(target, prompts, spec={"method": "suffix"}, draft=cache)  # adds outputs

    ``vocab_size``: checked against the target (taken from the first target it is used with when
    None). ``include_prompts``: add each row's prompt with its output, as one document."""

    def __init__(self, capacity_tokens: int = 32768, *, vocab_size: int | None = None,
                 include_prompts: bool = False):
        if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, (int, np.integer)) \
                or not 16 <= capacity_tokens <= 2**22:
            raise ValueError(f"SuffixCache capacity_tokens must be an int in [16, 2**22], got "
                             f"{capacity_tokens!r}")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(
                vocab_size, (int, np.integer)) or vocab_size < 1):
            raise ValueError(f"SuffixCache vocab_size must be an int >= 1 or None, got "
                             f"{vocab_size!r}")
        self.capacity_tokens = int(capacity_tokens)
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        if not isinstance(include_prompts, (bool, np.bool_)):
            raise ValueError(f"SuffixCache include_prompts must be a bool, got "
                             f"{include_prompts!r}")
        self.include_prompts = bool(include_prompts)
        self._tokens = np.full(self.capacity_tokens, SEPARATOR, np.int32)
        self._write = 0  # the next slot to write
        self._ordered = None
        self._pending_vocab = None  # the vocabulary of the call being built (check_vocab)

    @property
    def tokens(self) -> Array:
        """The ring as a device array [capacity_tokens] int32 (SEPARATOR where empty), in slot
        order (``params`` holds it in time order, as the program reads it)."""
        return jnp.asarray(self._tokens)

    @property
    def params(self) -> dict:
        """What the compiled program reads: the ring's tokens in time order (oldest first: the
        ring rotated to start at its write point, a separator where it wrapped), padded at the
        front to a whole number of BLOCKs. Data of a fixed shape, so adding to the cache never
        recompiles; reordered once per change, on the host, not once per round."""
        if self._ordered is None:
            w = self._write
            ordered = np.concatenate([self._tokens[w:], [SEPARATOR], self._tokens[:w]])
            pad = np.full(-ordered.size % BLOCK, SEPARATOR, np.int32)
            self._ordered = jnp.asarray(np.concatenate([pad, ordered]).astype(np.int32))
        return {"tokens": self._ordered}

    @property
    def nbytes(self) -> int:
        """Memory the corpus holds on the device."""
        return self._tokens.nbytes

    def __len__(self) -> int:
        """Token ids held (separators not counted)."""
        return int(np.sum(self._tokens >= 0))

    def __repr__(self) -> str:
        return (f"SuffixCache({len(self):,} of {self.capacity_tokens:,} tokens, "
                f"{self.nbytes / 2**20:.2f} MiB, vocab_size={self.vocab_size})")

    def fresh(self) -> SuffixCache:
        """An empty cache of the same size and settings (a benchmark's pass starts from one)."""
        return SuffixCache(self.capacity_tokens, vocab_size=self.vocab_size,
                           include_prompts=self.include_prompts)

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a target of another vocabulary. A cache without one takes this one when the
        call has run (``after_call``): a call refused later, for another reason, leaves the
        cache as it was."""
        if self.vocab_size is None:
            held = int(self._tokens.max())  # SEPARATOR (-1) where empty
            if held >= vocab_size:
                raise ValueError(f"this SuffixCache holds token id {held}, outside the target's "
                                 f"vocabulary [0, {vocab_size})")
            self._pending_vocab = int(vocab_size)
        elif self.vocab_size != vocab_size:
            raise ValueError(f"this SuffixCache holds tokens of a {self.vocab_size}-token "
                             f"vocabulary; the target has {vocab_size}: use a cache per "
                             f"tokenizer")

    def add(self, sequences) -> None:
        """Append token sequences (each a document: its tokens, then a separator), evicting the
        oldest tokens when the ring is full. A sequence longer than the ring keeps its end."""
        for seq in sequences:
            ids = np.asarray(seq)
            if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
                raise ValueError(f"SuffixCache.add takes lists of token ids, got {seq!r:.80}")
            if ids.size and (ids.min() < -1 or ids.max() >= 2 ** 31):
                bad = int(ids.min()) if ids.min() < -1 else int(ids.max())
                raise ValueError(f"token id {bad} in SuffixCache.add: ids are >= 0 (-1 is "
                                 f"generate's padding, dropped) and fit in int32")
            ids = ids[ids >= 0]  # generate pads rows with -1
            limit = self.vocab_size
            if limit is not None and ids.size and ids.max() >= limit:
                raise ValueError(f"token id {int(ids.max())} is outside this SuffixCache's "
                                 f"vocabulary [0, {limit})")
            if ids.size == 0:
                continue
            ids = ids[-(self.capacity_tokens - 1):].astype(np.int32)
            if self._write + ids.size + 1 > self.capacity_tokens:  # wrap: never split a document
                self._tokens[self._write:] = SEPARATOR
                self._write = 0
            end = self._write + ids.size
            self._tokens[self._write:end] = ids
            self._tokens[end] = SEPARATOR
            self._write = (end + 1) % self.capacity_tokens
        self._ordered = None

    def save(self, path: str | os.PathLike) -> None:
        """Write the cache to a folder (atomically: ``specjax/files.py``)."""
        from ..files import replace_folder
        meta = {"format": "specjax-suffix-cache", "version": 1,
                "capacity_tokens": self.capacity_tokens, "vocab_size": self.vocab_size,
                "include_prompts": self.include_prompts, "write": self._write}
        with replace_folder(path, lambda name: name in ("suffix_cache.json", "tokens.npy")) \
                as tmp:
            np.save(tmp / "tokens.npy", self._tokens)
            (tmp / "suffix_cache.json").write_text(json.dumps(meta, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> SuffixCache:
        """A cache written by ``save``."""
        from ..files import read_json_object
        folder = pathlib.Path(path)
        try:
            meta = read_json_object(folder / "suffix_cache.json")
            tokens = np.load(folder / "tokens.npy")
        except (OSError, ValueError) as e:
            raise ValueError(f"{folder} is not a saved SuffixCache ({e})") from None
        keys = ("capacity_tokens", "vocab_size", "include_prompts", "write")
        if meta.get("format") != "specjax-suffix-cache" or any(k not in meta for k in keys) \
                or tokens.shape != (meta["capacity_tokens"],) or tokens.dtype != np.int32:
            raise ValueError(f"{folder} is not a saved SuffixCache (or is damaged): its "
                             f"suffix_cache.json needs the format and {', '.join(keys)}, and "
                             f"tokens.npy int32 ids, one per slot")
        cache = cls(meta["capacity_tokens"], vocab_size=meta["vocab_size"],
                    include_prompts=meta["include_prompts"])
        if tokens.min() < SEPARATOR or (cache.vocab_size is not None
                                        and tokens.max() >= cache.vocab_size):
            raise ValueError(f"{folder / 'tokens.npy'} holds ids outside the vocabulary")
        write = meta["write"]
        # the write point starts a document: the ring's start, or just after a separator
        if (isinstance(write, bool) or not isinstance(write, int)
                or not 0 <= write < cache.capacity_tokens
                or (write and tokens[write - 1] != SEPARATOR)):
            raise ValueError(f"{folder / 'suffix_cache.json'}: write={write!r} is not where a "
                             f"document of its {cache.capacity_tokens}-slot ring may start")
        cache._tokens, cache._write = tokens, write
        return cache


def chain(depth: int) -> Tree:
    """A chain of ``depth`` most-frequent continuations (the default shape)."""
    return Tree([(0,) * d for d in range(1, depth + 1)])


def branching_tree(depth: int) -> Tree:
    """A chain of ``depth`` most-frequent continuations, with the runner-up token at the first
    two depths (each continued one more token): depth + 4 nodes (fewer when depth < 2). Worth
    its wider verify where a verify of more positions costs little (GPUs, TPUs)."""
    paths = [(0,) * d for d in range(1, depth + 1)]
    for d in range(1, min(depth, 2) + 1):
        sibling = (0,) * (d - 1) + (1,)
        paths += [sibling] + ([sibling + (0,)] if d < depth else [])
    return Tree(paths)


def _following(source: Array, ends: Array, depth: int, stop: Array | None = None) -> Array:
    """The ``depth`` tokens after each position ends [B, M] of source [B, L] (or [L]): [B, M,
    depth], SEPARATOR from the first separator (or past ``stop`` [B], a row's last index) on."""
    L = source.shape[-1]
    at = ends[:, :, None] + 1 + jnp.arange(depth)[None, None, :]  # [B, M, depth]
    inside = at < L if stop is None else at <= stop[:, None, None]
    where = jnp.clip(at, 0, L - 1)
    tokens = source[where] if source.ndim == 1 else jnp.take_along_axis(
        source[:, None, :], where, axis=2)
    tokens = jnp.where(inside, tokens, SEPARATOR)
    ended = jnp.cumsum(tokens == SEPARATOR, axis=2) > 0
    return jnp.where(ended, SEPARATOR, tokens)


BLOCK = 128  # newest_hits' block size; the corpus is padded to a multiple of it


def newest_hits(hit: Array, M: int) -> tuple[Array, Array, Array]:
    """The M newest True positions of hit [B, L] (newest = last): (rank [B, n] of each position
    looked at, 0 = the newest, >= M when not among the M newest; its slot [B, n] int32; how many
    hits [B]). Past M × BLOCK positions, counts per block of BLOCK positions say which blocks
    hold the M newest (at most M), and only those are looked at: n = M × BLOCK, whatever L is;
    below, every position is (n = L)."""
    B, L = hit.shape
    if L <= M * BLOCK:  # no fewer positions to look at: a running count over all of them
        newer = jnp.cumsum(hit[:, ::-1], axis=1, dtype=jnp.int32)[:, ::-1] - hit
        slot = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[None, :], (B, L))
        return jnp.where(hit, newer, M), slot, jnp.sum(hit, axis=1, dtype=jnp.int32)
    K = BLOCK
    hit = jnp.pad(hit, ((0, 0), (-L % K, 0)))  # whole blocks (the padding is older, no hits)
    nb = hit.shape[1] // K
    blocks = hit.reshape(B, nb, K)
    count = jnp.sum(blocks, axis=2, dtype=jnp.int32)  # [B, nb]
    newer = jnp.cumsum(count[:, ::-1], axis=1)[:, ::-1] - count  # hits in newer blocks
    holds = count > 0  # the M newest blocks that hold hits hold the M newest hits
    order = jnp.cumsum(holds[:, ::-1], axis=1)[:, ::-1] - holds  # newer blocks holding hits
    pick = jnp.full((B, M), -1, jnp.int32).at[jnp.arange(B)[:, None], jnp.where(
        holds, order, M)].set(jnp.arange(nb, dtype=jnp.int32)[None, :], mode="drop")  # ids
    got = pick >= 0
    block = jnp.clip(pick, 0, nb - 1)
    part = jnp.take_along_axis(blocks, block[:, :, None], axis=1) & got[:, :, None]  # [B, M, K]
    within = jnp.cumsum(part[:, :, ::-1], axis=2)[:, :, ::-1] - part  # newer hits in the block
    rank = jnp.where(part, jnp.take_along_axis(newer, block, axis=1)[:, :, None] + within, M)
    slot = block[:, :, None] * K + jnp.arange(K)[None, None, :] - (-L % K)
    return rank.reshape(B, M * K), slot.reshape(B, M * K).astype(jnp.int32), jnp.sum(count, 1)


@dataclasses.dataclass(frozen=True)
class SuffixProposer:
    """Suffix-decoding drafts over a static tree (see the module docstring). A chain (every
    node its parent's first child) is proposed as a chain: verified over only as many positions
    as the longest row proposes, as n-gram drafts are."""

    shape: Tree
    max_depth: int = 24  # longest match looked for (vLLM's suffix_decoding_max_tree_depth)
    max_spec_factor: float = 1.0  # a match of n tokens drafts at most ceil(factor × n) deep
    min_token_prob: float = 0.1  # a node's least share of its parent's occurrences
    candidates: int = MAX_CANDIDATES  # occurrences kept a round, the longest matches first
    min_match: int = 1  # the shortest match that drafts anything
    acceptance_floor: float = 0.0  # rows propose while their acceptance is this high (gate.py)
    own_spec_factor: float | None = 4.0  # the factor where the longest match is in the row's
    # own text (None: max_spec_factor; SpecConfig.suffix_decoding_own_spec_factor)

    def __post_init__(self):  # built directly, as a custom proposer may be: checked as well
        from ..config import _require_int, _require_real
        for name in ("max_depth", "candidates", "min_match"):
            _require_int(self, name, getattr(self, name), 1)
        _require_real(self, "max_spec_factor", self.max_spec_factor,
                      lambda x: np.isfinite(x) and x > 0, "a finite number > 0")
        if self.own_spec_factor is not None:
            _require_real(self, "own_spec_factor", self.own_spec_factor,
                          lambda x: np.isfinite(x) and x > 0, "a finite number > 0 or None")
        for name in ("min_token_prob", "acceptance_floor"):
            _require_real(self, name, getattr(self, name), lambda x: 0 <= x <= 1, "in [0, 1]")
        check_fanout(self.shape, self.candidates, "SuffixProposer")

    @property
    def gamma(self) -> int:
        return self.shape.num_nodes - 1

    @property
    def tree(self) -> Tree | None:
        """The tree the engine verifies; None for a chain."""
        return None if all(r == 0 for path in self.shape.paths for r in path) else self.shape

    def init(self, params, prompts: Array, prompt_lengths: Array, capacity: int):
        # the history and the corpus are all it reads; the gate (if any) keeps each row's
        # acceptance
        return GateState.init(prompts.shape[0]) if self.acceptance_floor > 0 else None

    def propose(self, params, state, history: Array, length: Array, keys: Array,
                sampling_params, filters) -> tuple[Draft, GateState | None]:
        B, S = history.shape
        P, D, tree = self.max_depth, self.shape.depth, self.shape
        rows = jnp.arange(B)
        want = last_tokens(history, length, P)
        own = match_runs(history, want, P)
        own = jnp.where(jnp.arange(S)[None, :] < length[:, None], own, 0)  # end before the last
        own_longest = jnp.max(own, axis=1)
        longest = own_longest
        if params is not None:  # the corpus [C'], in time order, shared by every row
            corpus = params["tokens"]
            C = corpus.shape[0]
            other = match_runs(corpus, want, P)  # [B, C']
            longest = jnp.maximum(longest, jnp.max(other, axis=1))
        # The occurrences whose match is the longest support the draft: the M most recent of
        # them, the row's own text first (newest first), then the corpus, newest first. Ranked
        # by counting within the few blocks that hold them (no sort: a top-k over a large
        # corpus is slow on a CPU, and so is a running count over all of it).
        M = self.candidates
        enough = longest[:, None] >= self.min_match
        rank, slots, seen = newest_hits((own == longest[:, None]) & enough, M)
        index = jnp.full((B, M), -1, jnp.int32).at[rows[:, None], rank].set(slots, mode="drop")
        if params is not None:
            rank_c, slots_c, _ = newest_hits((other == longest[:, None]) & enough, M)
            index = index.at[rows[:, None], seen[:, None] + rank_c].set(S + slots_c, mode="drop")
        support = index >= 0
        # the continuation of each kept occurrence [B, M, D], from whichever source it lies in
        cont = _following(history, jnp.clip(index, 0, S - 1), D, length)
        if params is not None:
            in_corpus = index >= S
            cont = jnp.where(in_corpus[:, :, None],
                             _following(corpus, jnp.clip(index - S, 0, C - 1), D), cont)
        cont = jnp.where(support[:, :, None], cont, SEPARATOR)
        factor = self.max_spec_factor
        if self.own_spec_factor is not None:
            factor = jnp.where(own_longest >= longest, self.own_spec_factor, factor)
        depth_cap = jnp.ceil(factor * longest).astype(jnp.int32)
        tokens, valid = fill_by_count(tree, cont, support, min_share=self.min_token_prob,
                                      depth_cap=depth_cap)
        draft = Draft(tokens, None, valid)
        return (draft, None) if state is None else gated(draft, state, length,
                                                         self.acceptance_floor)


def build(spec, draft, target):
    """The registry's builder for method "suffix": draft is a SuffixCache or None."""
    if draft is not None and not isinstance(draft, SuffixCache):
        raise ValueError(f"method 'suffix' takes a sj.draft.SuffixCache (or nothing) as draft=, "
                         f"got {type(draft).__name__}")
    if draft is not None:
        draft.check_vocab(target.vocab_size)
    tree = Tree(spec.tree) if spec.tree is not None else chain(spec.num_speculative_tokens)
    return SuffixProposer(tree, spec.suffix_decoding_max_tree_depth,
                          spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob,
                          min_match=spec.suffix_decoding_min_match_length,
                          acceptance_floor=spec.floor,
                          own_spec_factor=spec.suffix_decoding_own_spec_factor)


def corpus(cache: SuffixCache) -> dict:
    """The registry's params: the ring and its write point, passed into the compiled program."""
    return cache.params


def after_call(cache: SuffixCache, prompts, generation) -> None:
    """Add a call's outputs (and prompts, if the cache says so) to the corpus."""
    if cache.vocab_size is None:  # the vocabulary of the call that has now run
        cache.vocab_size = cache._pending_vocab
    outputs = [list(generation.tokens[b, :generation.lengths[b]])
               for b in range(len(generation.lengths))]
    # with the prompts, each row's prompt and output are one document: a request asked again
    # then finds its earlier answer right after its own prompt's end, from the first round
    cache.add([list(p) + o for p, o in zip(prompts, outputs)] if cache.include_prompts
              else outputs)


__all__ = ["SuffixCache", "SuffixProposer", "chain", "branching_tree", "SEPARATOR"]
