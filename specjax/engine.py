"""``generate``: prefill, then speculative rounds under one ``lax.while_loop``.

Loop invariant, per row b::

    history[b, :length[b] + 1]   the sequence so far (prompt, then generated tokens)
    cache.length[b] == length[b] every token but the last is in the target cache
    history[b, length[b]]        the last token, which the next round feeds first

A round feeds the target the chunk [last, d_1 .. d_γ] at positions length .. length + γ, verifies,
writes the num_accepted + 1 new tokens into history after the last one and advances length by
what was emitted. Each row moves by its own count; done rows stay frozen. With no proposer the
same round runs with γ = 0: plain autoregressive decoding, our baseline.

Shapes that are fixed per program (static, part of the compile key): the batch bucket B, the
capacity tier S (cache and history; prompts are passed S wide and prefilled in chunks), the
proposer (γ, tree), the model configs, whether top-k / top-p filters are compiled in and whether
every row is greedy. Everything else (prompt lengths, max_new_tokens, temperature, top-k, top-p,
EOS ids, keys) is an array, so every request of a tier shares a compiled program.

``generate`` is a short script of named steps: ``check_request`` → ``build_proposer`` →
``plan_program`` → ``place`` → ``build_inputs`` → ``Program.run`` (compiled once per plan and
argument shapes, cached in ``PROGRAMS``) → ``collect``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import logging
import numbers
import os
import reprlib
import secrets
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec

from . import adaptive, attention, compile_cache, sharding, verify
from . import cache as kv
from . import sampling as sampling_lib
from .cache import KVCache
from .config import (
    MAX_EOS_IDS,
    MAX_STOP_LENGTH,
    MAX_STOP_SEQUENCES,
    ModelConfig,
    SamplingParams,
    SpecConfig,
)
from .draft import base as draft_base
from .draft import registry
from .model import PREFILL_CHUNK, Model, forward, prefill_chunked
from .sampling import Filters, SamplingArrays
from .stats import Counters, Stats

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# What a compiled program is made of


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one compiled program."""

    target: ModelConfig  # the target's config
    proposer: Any  # a proposer (specjax.draft.base.Proposer), or None for autoregressive decoding
    capacity: int  # S: cache and history slots per row (a tier, or max_cache_len)
    filters: Filters  # which sampling filters are compiled in
    mesh: Any = None  # a ("data", "model") jax.sharding.Mesh for sharded runs, or None
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens per prefill forward
    attention_block: int = attention.BLOCK  # cache slots per attention block
    # SpecConfig.synthetic_acceptance is on (benchmark only, not lossless); its α's are in the
    # Request, so other values reuse the program
    synthetic: bool = False
    # SamplingParams.logprobs (alternatives per token; None: no logprobs computed) and whether
    # they come from the processed distribution (logprobs_mode="processed")
    logprobs: int | None = None
    logprobs_processed: bool = False

    @property
    def gamma(self) -> int:
        return 0 if self.proposer is None else self.proposer.gamma

    @property
    def taps(self) -> tuple[int, ...]:
        """The target layers whose outputs a riding proposer reads in place of the final-norm
        hidden state (a block drafter's ``taps``); () for the final-norm hidden state."""
        return tuple(getattr(self.proposer, "taps", ())) if self.rides else ()

    @property
    def tree(self):
        """The proposer's static tree (specjax.tree.Tree), or None for a chain."""
        return getattr(self.proposer, "tree", None)

    @property
    def depth(self) -> int:
        """The most drafts a round can accept: γ for a chain, the tree's depth for a tree."""
        return self.gamma if self.tree is None else self.tree.depth

    @property
    def span(self) -> int:
        """The most target-cache slots written past a committed length before the next rollback
        (a prefill chunk, or a round's γ + 1 and lookahead positions): sliding layers keep rings
        of window + span - 1 slots (``cache.KVCache.init``)."""
        return max(self.prefill_chunk,
                   self.gamma + draft_base.lookahead_width(self.proposer) + 1)

    @property
    def rides(self) -> bool:
        """Whether the proposer drafts from the target's hidden states (Medusa, EAGLE)."""
        return draft_base.rides_on_target(self.proposer)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Idle:
    """Rests of a chain whose verify budget declines (``idle_rounds`` of its proposer).

    A proposal in which no generating row drafts is a decline. After d >= 2 declines in a row
    the next min(2^(d - 2), idle_rounds) rounds are plain decode steps that skip the draft
    altogether; then the draft reads the tokens it missed (``rejoin``, a few tokens a forward)
    and proposes again. Under a load where drafting does not pay the rests grow to
    ``idle_rounds`` and the loop runs as plain decoding, paying a proposal and a rejoin per rest;
    a proposal in which some row drafts ends the run of declines. Whether a round rests depends
    only on the proposals of rounds before it, never on the target's output at positions
    verified, so the output distribution is the target's (docs/adaptive.md)."""

    declines: Array  # [] int32: proposals in a row in which no generating row drafted
    rest: Array  # [] int32: n + 1 while n plain rounds remain; 1: the draft to rejoin; 0: none
    read: Array  # [B] int32: the last position the draft has read (where it last proposed)


def idle_rounds(plan: Plan) -> int:
    """The longest rest of ``plan``'s proposer (0: its rounds never rest)."""
    return int(getattr(plan.proposer, "idle_rounds", 0) or 0)


REST_AFTER = 2
"""Declines in a row after which rounds rest (``Idle``)."""
FIRST_REST = 1
"""Rounds in the first rest after ``REST_AFTER`` declines; each decline after it doubles the
rest, up to the proposer's ``idle_rounds``."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
    history: Array  # [B, S] int32: prompt then generated tokens
    length: Array  # [B] int32: position of the last token == target cache length
    num_generated: Array  # [B] int32
    done: Array  # [B] bool
    cache: KVCache  # target cache
    draft_state: Any  # the proposer's state (a draft cache), or None
    counters: Counters
    step: Array  # [] int32: rounds run so far
    # Plan.logprobs: per history slot, the target's log-probability of the token there [B, S]
    # and its top-k ids and log-probabilities [B, S, K] (written with the tokens)
    logprobs: tuple[Array, Array, Array] | None = None
    # [B] int32: the generated-token index at which the row's target logits were first not
    # finite (the row stopped there), or -1
    nonfinite: Array | None = None
    # A chain with per-row lengths (Draft.valid: n-gram, suffix, adaptive lengths): the next
    # round's drafts, proposed at the end of the round before (by prefill for the first), so the
    # decode loop knows a round's verify width before running it (``_rounds``); else None.
    pending: draft_base.Draft | None = None
    idle: Idle | None = None  # a chain whose proposer rests (``Idle``), else None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Request:
    """Per-call arrays (never part of the compile key)."""

    keys: Array  # [B] typed PRNG keys, one per row
    sampling: SamplingArrays  # [B] each
    max_new_tokens: Array  # [B] int32
    eos: Array  # [MAX_EOS_IDS] int32, padded with -1
    synthetic: Array | None = None  # [γ] float32: SpecConfig.synthetic_acceptance, or None
    # [MAX_STOP_SEQUENCES, MAX_STOP_LENGTH] int32: stop token sequences, right-aligned, -1 before
    # each (an unused row is all -1); None: none
    stop: Array | None = None
    # an adaptive chain's threshold and budget (adaptive.Tuning), read in place of the plan's
    # PER_CALL settings: other numbers reuse the program; None: the plan's own
    tuning: adaptive.Tuning | None = None


@dataclasses.dataclass(frozen=True)
class Generation:
    tokens: np.ndarray  # [B, max_new_tokens] int32, -1 after each row's end
    lengths: np.ndarray  # [B] int32: generated tokens per row (EOS included)
    stats: Stats
    text: list[str] | None = None  # decoded rows, when generate was asked for text
    logprobs: Logprobs | None = None  # SamplingParams.logprobs


@dataclasses.dataclass(frozen=True)
class Logprobs:
    """SamplingParams.logprobs: for each generated token (the layout of Generation.tokens), the
    target's log-probability of it and its k most likely alternatives, from the raw model
    distribution or the processed one (SamplingParams.logprobs_mode)."""

    token: np.ndarray  # [B, max_new_tokens] float32; nan after each row's end
    top_ids: np.ndarray  # [B, max_new_tokens, k] int32, most likely first; -1 after the end
    top: np.ndarray  # [B, max_new_tokens, k] float32; nan after the end


# ---------------------------------------------------------------------------------------------
# Traced code: prefill and one round


def _proposer_params(plan: Plan, draft_params, target_params):
    return {"heads": draft_params, "target": target_params} if plan.rides else draft_params


def _logprobs(plan: Plan, request: Request, logits: Array, tokens: Array
              ) -> tuple[Array, Array, Array]:
    """logits [B, T, V] of the target at T positions and the tokens [B, T] chosen there (-1:
    none) -> (log-probability of each token [B, T], top-k ids [B, T, K], their log-probabilities
    [B, T, K]), from the raw distribution or the processed one (Plan.logprobs_processed)."""
    if plan.logprobs_processed:
        lp = sampling_lib.process_log_probs(logits, request.sampling, plan.filters)
    else:
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token = jnp.take_along_axis(lp, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    top, ids = jax.lax.top_k(lp, plan.logprobs) if plan.logprobs else (
        jnp.zeros(lp.shape[:-1] + (0,), jnp.float32), jnp.zeros(lp.shape[:-1] + (0,), jnp.int32))
    return token, ids.astype(jnp.int32), top


def _write_logprobs(stored, new, start: Array):
    """Write a round's logprobs ([B, T], [B, T, K], [B, T, K]) at slots start.. of each row, as
    the tokens are written (``cache.write``: slots past the capacity dropped)."""
    return tuple(kv.write(buffer, x, start) for buffer, x in zip(stored, new))


def prefill_state(plan: Plan, target_params, draft_params, prompts: Array, prompt_lengths: Array,
                  request: Request, ahead: bool = True) -> LoopState:
    """Run the prompts [B, N] (right-padded; the engine passes N = S rounded up to whole
    prefill chunks) through target and proposer, a chunk at a time up to the longest prompt;
    draw the first token. A chain with per-row lengths then proposes the first round's drafts
    (``LoopState.pending``), unless ``ahead`` is False (tests: every round then proposes its
    own drafts and chooses its width by a switch, as before drafts were proposed ahead)."""
    B, N = prompts.shape
    S = plan.capacity
    cache = KVCache.init(plan.target, B, S, span=plan.span)
    if plan.mesh is not None:  # the target cache: rows over "data", kv heads over "model"
        spec = sharding.cache_spec(plan.target, plan.mesh)
        cache = dataclasses.replace(cache, **{
            name: sharding.constrain(getattr(cache, name), plan.mesh, spec)
            for name in ("k", "v", "ring_k", "ring_v") if getattr(cache, name) is not None})
    last_logits, hidden, cache = prefill_chunked(
        Model(plan.target, target_params), prompts, prompt_lengths, cache, plan.prefill_chunk,
        keep_hidden=plan.rides, taps=plan.taps)
    rows = jnp.arange(B)
    probs = sampling_lib.process_logits(last_logits, request.sampling, plan.filters)
    keys = jax.vmap(lambda k: jax.random.fold_in(k, 0))(request.keys)
    first = sampling_lib.sample(keys, probs)
    history = jnp.zeros((B, S), jnp.int32).at[:, :min(N, S)].set(prompts[:, :S])
    history = history.at[rows, prompt_lengths].set(first)
    draft_state = None
    if plan.proposer is not None:
        params = _proposer_params(plan, draft_params, target_params)
        extra = (hidden,) if plan.rides else ()
        draft_state = plan.proposer.init(params, prompts, prompt_lengths, S, *extra)
    done = jnp.any(first[:, None] == request.eos[None, :], axis=1) | (request.max_new_tokens <= 1)
    finite = jnp.all(jnp.isfinite(last_logits), axis=-1)  # else no first token: the row stops
    done |= ~finite
    if request.stop is not None:  # a one-token stop sequence
        window = jnp.concatenate([jnp.full((B, request.stop.shape[1] - 1), -1, jnp.int32),
                                  first[:, None]], axis=1)
        done |= stop_ends(window, jnp.zeros((B,), jnp.int32), jnp.ones((B,), jnp.int32),
                          request.stop)[:, 0]
    logprobs = None
    if plan.logprobs is not None:
        K = plan.logprobs
        logprobs = _write_logprobs(
            (jnp.zeros((B, S), jnp.float32), jnp.zeros((B, S, K), jnp.int32),
             jnp.zeros((B, S, K), jnp.float32)),
            _logprobs(plan, request, last_logits[:, None], first[:, None]), prompt_lengths)
    counters = Counters.zeros(plan.depth, B)
    if plan.mesh is not None:  # per-row counters split by rows, as every round leaves them (a
        #                        stream's segments then run one executable from the first on)
        counters = dataclasses.replace(counters, **{
            name: sharding.constrain(getattr(counters, name), plan.mesh,
                                     PartitionSpec(sharding.DATA))
            for name in ("proposed_by_row", "rounds_by_row")})
    state = LoopState(
        history=history, length=prompt_lengths, num_generated=finite.astype(jnp.int32),
        done=done, cache=cache, draft_state=draft_state,
        counters=counters, step=jnp.zeros((), jnp.int32),
        logprobs=logprobs, nonfinite=jnp.where(finite, -1, 0).astype(jnp.int32))
    if ahead and _per_row_lengths(plan, target_params, draft_params, request, state):
        if idle_rounds(plan):
            zero = jnp.zeros((), jnp.int32)
            state = dataclasses.replace(state, idle=Idle(zero, zero, prompt_lengths))
        state = _propose_next(plan, target_params, draft_params, request, state)
    return state


def round_keys(keys: Array, step: Array) -> tuple[Array, Array]:
    """Fresh draft and verify keys [B] for round ``step``: each row's key folded with the round
    number (prefill used 0), so no random number is reused across rows or rounds."""
    keys = jax.vmap(jax.random.fold_in, (0, None))(keys, step + 1)
    draft_keys, verify_keys = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
    return draft_keys, verify_keys


def _per_row_lengths(plan: Plan, target_params, draft_params, request: Request,
                     state: LoopState) -> bool:
    """Whether the plan is a chain whose drafts come with per-row lengths (``Draft.valid``), so
    its rounds are proposed one round ahead (``LoopState.pending``). Decided at trace time."""
    if plan.proposer is None or plan.tree is not None:
        return False
    shape = jax.eval_shape(lambda: _propose(plan, target_params, draft_params, request, state,
                                            request.keys)[0])
    return shape.valid is not None


def _propose_next(plan: Plan, target_params, draft_params, request: Request,
                  state: LoopState) -> LoopState:
    """The state with the drafts of round ``state.step`` proposed (``LoopState.pending``): what
    that round's own start would propose, with the same keys."""
    with jax.named_scope("propose"):
        draft, draft_state = _propose(plan, target_params, draft_params, request, state,
                                      round_keys(request.keys, state.step)[0])
    idle = state.idle
    if idle is not None:
        generating = ~state.done
        drafted = jnp.any(generating[:, None] & draft.valid)
        declines = jnp.where(drafted, 0, idle.declines + 1)
        rests = jnp.minimum(jnp.left_shift(FIRST_REST, jnp.clip(declines - REST_AFTER, 0, 20)),
                            idle_rounds(plan))
        rest = jnp.where((declines >= REST_AFTER) & jnp.any(generating), rests + 1, 0)
        idle = Idle(declines, rest.astype(jnp.int32), state.length)
    return dataclasses.replace(state, pending=draft, draft_state=draft_state, idle=idle)


def _propose(plan: Plan, target_params, draft_params, request: Request, state: LoopState,
             keys: Array) -> tuple[draft_base.Draft, Any]:
    """This round's drafts (γ = 0: none) and the proposer's new state."""
    B = state.length.shape[0]
    if plan.proposer is None:
        return draft_base.Draft(jnp.zeros((B, 0), jnp.int32), None), state.draft_state
    # adaptive lengths (specjax/adaptive.py) draft, and count toward the budget, only for rows
    # still generating
    extra = {"active": ~state.done} if getattr(plan.proposer, "adaptive", False) else {}
    draft, draft_state = plan.proposer.propose(
        _proposer_params(plan, draft_params, target_params), state.draft_state, state.history,
        state.length, keys, request.sampling, plan.filters, **extra)
    _check_draft(plan, draft, B)
    return draft, draft_state


def _check_draft(plan: Plan, draft: draft_base.Draft, B: int) -> None:
    """A proposer's Draft, checked when the program is traced (before anything compiles): its
    tokens [B, G] (a tree: [B, N - 1]) of integers, and its q, when it has one, in float32. A q
    in lower precision, checked against the target's float32 p, is not what the token was drawn
    from to the last bits, and the output would not be exactly the target's."""
    name = type(plan.proposer).__name__
    G = plan.gamma if plan.tree is None else plan.tree.num_nodes - 1
    tokens = draft.tokens
    if tokens.shape != (B, G) or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{name}.propose returned Draft.tokens {tokens.dtype}"
                         f"{list(tokens.shape)}; expected integer token ids [B, "
                         f"{'gamma' if plan.tree is None else 'tree nodes - 1'}] = [{B}, {G}]")
    if plan.tree is not None and draft.probs is not None and draft.probs.shape[:2] != (
            B, plan.tree.num_nodes):
        raise ValueError(f"a tree proposer's Draft.probs must be [B, N, V] = [{B}, "
                         f"{plan.tree.num_nodes}, V] (row i: what node i's children were drawn "
                         f"from), got {tuple(draft.probs.shape)}")
    if draft.probs is not None and draft.probs.dtype != jnp.float32:
        raise ValueError(f"{name}.propose returned Draft.probs in {draft.probs.dtype}; they must "
                         f"be float32, what each draft was drawn from exactly "
                         f"(sampling.process_logits returns float32 for any model dtype)")


def _verify_chain(plan: Plan, target: Model, request: Request, state: LoopState,
                  chunk: Array, draft: draft_base.Draft, keys: Array, T: int,
                  write: bool = True):
    """Feed [last, d_1 .. d_{T-1}] (T static) and verify those drafts.

    Returns the verdict (tokens padded to γ + 1), the cache, and the target's hidden states
    padded to [B, γ + 1, E] (None unless the proposer rides on the target). ``write=False``:
    in place of the cache, the chunk's keys and values padded to [L, B, γ + 1, K, D], unwritten
    (``model.forward``)."""
    G = plan.gamma
    positions = state.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    logits, hidden, cache = forward(target, chunk[:, :T], positions,
                                    state.cache.rollback(state.length), write=write,
                                    taps=plan.taps)
    if not write:  # padded: every branch of a switch returns the same shapes
        cache = tuple(jnp.pad(x, ((0, 0), (0, 0), (0, G + 1 - T), (0, 0), (0, 0)))
                      for x in cache)
    drafts = draft.tokens[:, :T - 1]
    valid = None if draft.valid is None else draft.valid[:, :T - 1]
    if plan.synthetic:  # benchmark only: acceptance by a coin, not by p and q
        verdict = _synthetic_verdict(plan, request, logits, drafts, valid, keys)
    elif plan.filters.greedy:  # one-hot p: the same verdict from argmaxes alone
        verdict = verify.greedy_verdict(drafts, sampling_lib.argmax(logits), valid)
        near = jnp.pad(sampling_lib.near_ties(logits, plan.target.dtype), ((0, 0), (0, G + 1 - T)))
        verdict = dataclasses.replace(verdict, near_ties=near)
    else:
        target_probs = sampling_lib.process_logits(logits, request.sampling, plan.filters)
        verdict = verify.rejection_sample(
            keys, drafts, None if draft.probs is None else draft.probs[:, :T - 1], target_probs,
            valid)
    if plan.logprobs is not None:
        pad = lambda x: jnp.pad(x, ((0, 0), (0, G + 1 - T)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
        verdict = dataclasses.replace(verdict, logprobs=tuple(
            pad(x) for x in _logprobs(plan, request, logits, verdict.tokens)))
    tokens = jnp.pad(verdict.tokens, ((0, 0), (0, G + 1 - T)), constant_values=-1)
    hidden = jnp.pad(hidden, ((0, 0), (0, G + 1 - T), (0, 0))) if plan.rides else None
    finite = jnp.pad(jnp.all(jnp.isfinite(logits), axis=-1), ((0, 0), (0, G + 1 - T)),
                     constant_values=True)
    return dataclasses.replace(verdict, tokens=tokens, finite=finite), cache, hidden


def _synthetic_verdict(plan: Plan, request: Request, logits: Array, drafts: Array,
                       valid: Array | None, keys: Array) -> verify.Verdict:
    """NOT LOSSLESS, benchmark only: draft i is accepted with probability request.synthetic[i]
    (in a row, until the first rejection), whatever it is; the token after the accepted ones is
    the target's own (its argmax, or a draw from its processed distribution), as a real round
    would emit. Costs what a real verification costs, or a little less."""
    B, G = drafts.shape
    coin, draw = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
    u = jax.vmap(lambda k: jax.random.uniform(k, (G,)))(coin)  # [B, G]
    hit = u < request.synthetic[None, :G]
    hit &= verify._in_vocabulary(drafts, logits.shape[-1], valid)  # -1: not proposed
    num_accepted = jnp.sum(jnp.cumprod(hit, axis=1), axis=1).astype(jnp.int32)
    rows = jnp.arange(B)
    at = logits[rows, num_accepted]  # [B, V]: the target after the last accepted draft
    if plan.filters.greedy:
        last = sampling_lib.argmax(at)
    else:
        last = sampling_lib.sample(draw, sampling_lib.process_logits(at, request.sampling,
                                                                     plan.filters))
    index = jnp.arange(G + 1)[None, :]
    padded = jnp.pad(drafts, ((0, 0), (0, 1)))
    tokens = jnp.where(index < num_accepted[:, None], padded,
                       jnp.where(index == num_accepted[:, None], last[:, None], -1))
    return verify.Verdict(tokens.astype(jnp.int32), num_accepted)


def _verify_chain_any_length(plan: Plan, target: Model, request: Request, state: LoopState,
                             chunk: Array, draft: draft_base.Draft, keys: Array):
    """Per-row draft lengths (``Draft.valid``, e.g. n-gram lookup): feed only as many drafts as
    the longest row proposed, so rounds without a match cost one decode step, not a γ + 1 verify.
    One branch per length, all with static shapes; the choice is made on the device. Used by a
    round run alone (``round_step`` with no width: ``Program.step``, tests); the decode loop
    picks the width outside its rounds instead (``_rounds``).

    The branches only read the cache; the chunk's keys and values are written after the switch
    (γ + 1 slots, those past the chunk garbage past the length). Written inside, XLA copied the
    whole cache two to four times a round (experiments/round_profile.py)."""
    proposed = jnp.where(state.done, 0, jnp.sum(draft.valid, axis=1, dtype=jnp.int32))
    branches = [lambda T=T: _verify_chain(plan, target, request, state, chunk, draft, keys, T,
                                          write=False)
                for T in range(1, plan.gamma + 2)]
    verdict, (k, v), hidden = jax.lax.switch(jnp.max(proposed), branches)
    return verdict, kv.write_chunk(state.cache.rollback(state.length), k, v), hidden


def _verify_tree(plan: Plan, target: Model, request: Request, state: LoopState, chunk: Array,
                 draft: draft_base.Draft, keys: Array, draft_state):
    """Every node at once: position = length + depth, each node sees its ancestors. The accepted
    path is compacted in the target's cache and (``commit``) the proposer's. A ``Lookahead``
    proposer's positions (``Draft.lookahead``) run in the same forward after the nodes, unseen by
    them; it observes the target's argmax there. Returns the verdict, cache, hidden states along
    the accepted path [B, D+1, E] (root first), and draft state."""
    tree, B = plan.tree, chunk.shape[0]
    depths, mask, logits_at, N = tree.depths, tree.ancestors, None, tree.num_nodes
    if draft.lookahead is not None:  # the proposer's own positions ride along (Lookahead)
        chunk = jnp.concatenate([chunk, draft.lookahead], axis=1)
        depths, mask = lookahead_layout(tree, plan.proposer)
        read = draft_base.lookahead_read(plan.proposer)
        logits_at = tuple(range(N)) + tuple(N + k for k in read)  # no logits for the rest
    positions = state.length[:, None] + jnp.asarray(depths)[None, :]
    logits, hidden, cache = forward(target, chunk, positions, state.cache.rollback(state.length),
                                    chunk_mask=jnp.asarray(mask), taps=plan.taps,
                                    logits_at=logits_at)
    if draft.lookahead is not None:
        draft_state = plan.proposer.observe_lookahead(
            draft_state, sampling_lib.argmax(logits[:, N:]).astype(jnp.int32))
        logits, hidden = logits[:, :N], hidden[:, :N]
    if plan.filters.greedy:  # every row greedy: the argmax after each node decides
        verdict = verify.greedy_tree_verdict(tree, draft.tokens, sampling_lib.argmax(logits),
                                             draft.valid)
    else:
        target_probs = sampling_lib.process_logits(logits, request.sampling, plan.filters)
        verdict = verify.tree_sample(keys, tree, draft.tokens, target_probs, draft.valid,
                                     draft.probs)
    nodes = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), verdict.path], axis=1)  # root, path
    if plan.filters.greedy:
        near = sampling_lib.near_ties(logits, plan.target.dtype)  # [B, N]
        verdict = dataclasses.replace(verdict, near_ties=jnp.take_along_axis(near, nodes, axis=1))
    if plan.logprobs is not None:  # at the root and the accepted path's nodes
        verdict = dataclasses.replace(verdict, logprobs=_logprobs(
            plan, request, jnp.take_along_axis(logits, nodes[:, :, None], axis=1),
            verdict.tokens))
    # the token at each depth was decided by the target at that node (the root, then the path)
    verdict = dataclasses.replace(verdict, finite=jnp.take_along_axis(
        jnp.all(jnp.isfinite(logits), axis=-1), nodes, axis=1))
    cache = kv.compact(cache, state.length, verdict.path, verdict.num_accepted)
    if hasattr(plan.proposer, "commit"):  # a proposer with a cache of its own compacts it too
        draft_state = plan.proposer.commit(draft_state, state.length, verdict.path,
                                           verdict.num_accepted)
    hidden = jnp.take_along_axis(hidden, nodes[:, :, None], axis=1)  # entries past it are stale
    return verdict, cache, hidden, draft_state


def lookahead_layout(tree, proposer) -> tuple[np.ndarray, np.ndarray]:
    """Depths [N + K] and the attention mask [N + K, N + K] of a verify forward that carries a
    ``Lookahead`` proposer's K positions after the tree's N nodes: the tree's nodes see their
    ancestors only; the lookahead positions see the root and what ``lookahead_mask`` says."""
    N, K = tree.num_nodes, draft_base.lookahead_width(proposer)
    mask = np.zeros((N + K, N + K), bool)
    mask[:N, :N] = tree.ancestors
    mask[N:, 0] = True
    mask[N:, N:] = proposer.lookahead_mask
    return np.concatenate([tree.depths, proposer.lookahead_depths]).astype(np.int32), mask


def stop_ends(window: Array, generated: Array, offered: Array, stop: Array) -> Array:
    """Where a stop sequence ends among a round's tokens, counting generated tokens only.

    window [B, M - 1 + T]: the M - 1 tokens before the round (M = stop.shape[1]), then the
    round's T tokens; generated [B]: tokens the row generated before the round (the last of
    them end the window's first part; earlier entries there are prompt or padding); offered [B]:
    how many of the round's tokens are real; stop [S, M]: sequences right-aligned, -1 before.
    Returns [B, T] bool: a sequence ends at the round's token j."""
    B, W = window.shape
    M = stop.shape[1]
    T = W - (M - 1)
    at = jnp.arange(W)[None, :]
    real = jnp.where(at >= M - 1, at - (M - 1) < offered[:, None],
                     (M - 1) - at <= generated[:, None])  # [B, W]: a generated token
    span = jnp.arange(T)[:, None] + jnp.arange(M)[None, :]  # [T, M]: the M tokens ending at j
    tokens, known = window[:, span], real[:, span]  # [B, T, M]
    needed = stop >= 0  # [S, M]
    same = (tokens[:, :, None, :] == stop[None, None]) & known[:, :, None, :]  # [B, T, S, M]
    match = jnp.all(same | ~needed[None, None], axis=-1) & needed[None, None, :, -1]
    return jnp.any(match, axis=-1)


def _emit(state: LoopState, tokens: Array, num_accepted: Array, request: Request
          ) -> tuple[Array, Array, Array]:
    """How many of a round's tokens each row keeps: EOS, a stop sequence and max_new_tokens cut
    the round short (EOS and the stop sequence kept).

    tokens [B, T] (−1 padded), num_accepted [B]. Returns (n_emit [B], hit_eos [B]: the row
    emitted EOS or ended a stop sequence, history).
    """
    B, T = tokens.shape
    index = jnp.arange(T)[None, :]
    offered = index < (num_accepted + 1)[:, None]
    history = kv.write(state.history, tokens, state.length + 1)
    is_eos = jnp.any(tokens[:, :, None] == request.eos[None, None, :], axis=-1)
    if request.stop is not None:
        # the M - 1 tokens before the round and the round's, read back from the written history
        # (read before the write, XLA copied the whole history every round)
        M = request.stop.shape[1]
        at = state.length[:, None] - (M - 2) + jnp.arange(M - 1 + T)[None, :]
        window = jnp.take_along_axis(history, jnp.clip(at, 0, history.shape[1] - 1), axis=1)
        is_eos |= stop_ends(window, state.num_generated, num_accepted + 1, request.stop)
    is_eos &= offered
    eos_cut = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, T)
    n_emit = jnp.minimum(jnp.minimum(num_accepted + 1, eos_cut),
                         request.max_new_tokens - state.num_generated)
    n_emit = jnp.where(state.done, 0, n_emit)
    hit_eos = jnp.any(is_eos & (index < n_emit[:, None]), axis=1)
    return n_emit, hit_eos, history


def _emitted_near_ties(verdict: verify.Verdict, n_emit: Array) -> Array | int:
    """How many of the tokens the rows emit this round were greedy near ties."""
    if verdict.near_ties is None:
        return 0
    index = jnp.arange(verdict.near_ties.shape[1])[None, :]
    return jnp.sum(verdict.near_ties & (index < n_emit[:, None]), dtype=jnp.int32)


def round_step(plan: Plan, target_params, draft_params, request: Request,
               state: LoopState, width: int | None = None, propose: bool = True) -> LoopState:
    """One speculative round (γ = 0: one autoregressive step) for every row.

    A chain with per-row lengths verifies the pending drafts (``LoopState.pending``) over
    ``width`` positions (static; at least one more than the widest row's drafts), or with None
    over as many as the widest row needs, chosen by a ``lax.switch``; it then proposes the next
    round's drafts (unless ``propose`` is False: a rest, ``Idle``). The decode loop picks the
    width per round outside the round (``_rounds``)."""
    B = state.length.shape[0]
    draft_keys, verify_keys = round_keys(request.keys, state.step)
    if state.pending is None:
        # The named scopes label each part's operations in profiles (experiments/round_profile.py).
        with jax.named_scope("propose"):
            draft, draft_state = _propose(plan, target_params, draft_params, request, state,
                                          draft_keys)
    else:
        draft, draft_state = state.pending, state.draft_state
    last = state.history[jnp.arange(B), state.length]
    chunk = jnp.concatenate([last[:, None], draft.tokens], axis=1)  # [B, G+1] (tree: [B, N])
    target = Model(plan.target, target_params)
    args = (plan, target, request, state, chunk, draft, verify_keys)
    with jax.named_scope("verify"):
        if plan.tree is not None:
            verdict, cache, hidden, draft_state = _verify_tree(*args, draft_state)
        elif draft.valid is None:
            verdict, cache, hidden = _verify_chain(*args, plan.gamma + 1)
        elif width is None:
            verdict, cache, hidden = _verify_chain_any_length(*args)
        else:
            verdict, cache, hidden = _verify_chain(*args, width)
    if plan.rides:
        with jax.named_scope("observe"):
            draft_state = plan.proposer.observe(draft_state, state.length, hidden)
    num_proposed = (jnp.full((B,), plan.gamma, jnp.int32) if draft.valid is None
                    else jnp.sum(draft.valid, axis=1, dtype=jnp.int32))
    n_emit, hit_eos, history = _emit(state, verdict.tokens, verdict.num_accepted, request)
    # a row whose logits were not finite at a token it would emit stops before that token
    bad = jnp.argmin(verdict.finite, axis=1).astype(jnp.int32)  # the first non-finite position
    broken = ~jnp.all(verdict.finite, axis=1) & (bad < n_emit)
    n_emit = jnp.where(broken, bad, n_emit)
    hit_eos &= ~broken
    nonfinite = jnp.where(broken & (state.nonfinite < 0), state.num_generated + bad,
                          state.nonfinite)
    length = state.length + n_emit
    num_generated = state.num_generated + n_emit
    state = LoopState(
        history=history, length=length, num_generated=num_generated,
        done=state.done | hit_eos | broken | (num_generated >= request.max_new_tokens),
        cache=cache.rollback(length), draft_state=draft_state,
        counters=state.counters.update(~state.done, verdict.num_accepted, num_proposed,
                                       _emitted_near_ties(verdict, n_emit), draft.predicted,
                                       draft.forwards, state.length),
        step=state.step + 1,
        logprobs=None if state.logprobs is None else _write_logprobs(
            state.logprobs, verdict.logprobs, state.length + 1),
        nonfinite=nonfinite, pending=state.pending, idle=state.idle)
    if state.pending is not None and propose:
        state = _propose_next(plan, target_params, draft_params, request, state)
    return state


def verify_width(plan: Plan, state: LoopState) -> Array:
    """Which of ``loop_widths(plan.gamma)`` the pending drafts are verified over ([] int32, an
    index): the narrowest that holds the drafts of the generating row with the most."""
    proposed = jnp.where(state.done, 0, jnp.sum(state.pending.valid, axis=1, dtype=jnp.int32))
    return jnp.searchsorted(jnp.asarray(loop_widths(plan.gamma)), jnp.max(proposed) + 1)


def _rounds(plan: Plan, target_params, draft_params, request: Request, state: LoopState,
            more) -> LoopState:
    """Rounds while ``more(state)``.

    A chain with per-row lengths knows each round's drafts before the round
    (``LoopState.pending``). Each round verifies them in one of a set of while loops, one per
    verify width (``loop_widths``), that runs at most once: the narrowest that holds the widest
    generating row's drafts (a round with no drafts is a plain decode step, one whose widest row
    drafted all γ a static chain's round); then the round proposes the next round's drafts. So
    the program holds one verify forward per width but a single proposal (a proposal per width
    made the bundled pair's adaptive and budget decode programs 1.8-3 times as large and their
    compile 1.3-2.2 times as long: experiments/results/2026-12-07-one-proposal.md), and every
    loop writes the caches in place, as a decode step does. Choosing the width with a
    ``lax.switch`` over the widths, whose branches cannot write the cache in place without XLA
    copying it, made an adaptive chain's round cost 5-10% more than a static chain's at batch
    16 on a 2-core CPU (experiments/results/2026-12-04-verify-width-loops.md). The width
    depends only on the drafts' lengths, never on the target's output at the positions
    verified.

    A chain that rests (``Idle``) runs a rest's rounds through the loop of width 1 (its
    declined proposal has no drafts), and after the last of them the draft reads the tokens it
    missed (``rejoin``) and proposes again, through the same single proposal."""
    if state.pending is None:
        body = lambda s: round_step(plan, target_params, draft_params, request, s)  # noqa: E731
        return jax.lax.while_loop(more, body, state)
    widths = loop_widths(plan.gamma)
    resting = state.idle is not None

    def each(state: LoopState) -> LoopState:
        start = state.step
        drafting = (state.idle.rest == 0) if resting else jnp.bool_(True)
        # a rest's round: the declined proposal verified over one position (its first round
        # counts the proposal's forwards), no proposal after it
        plain = (state.idle.rest > 1) if resting else jnp.bool_(False)
        # (the loop runs ``each`` only while more(state))
        width = jnp.where(drafting, verify_width(plan, state), jnp.where(plain, 0, -1))
        for i in range(len(widths)):
            def verify(s: LoopState, i: int = i) -> LoopState:
                s = round_step(plan, target_params, draft_params, request, s, widths[i],
                               propose=False)
                return _rested(s, plain) if resting and i == 0 else s
            state = jax.lax.while_loop(lambda s, i=i: (width == i) & (s.step == start), verify,
                                       state)
        if not resting:  # a round ran
            return _propose_next(plan, target_params, draft_params, request, state)
        state = _rejoin(plan, target_params, draft_params, state)
        # propose after a drafting round, and once a rest is over (unless every row is done)
        again = ((state.step != start) & ~plain) | ((state.idle.rest == 1) & ~jnp.all(state.done))

        def propose(carry: tuple[LoopState, Array]) -> tuple[LoopState, Array]:
            s, _ = carry
            return _propose_next(plan, target_params, draft_params, request, s), jnp.bool_(False)
        state, _ = jax.lax.while_loop(lambda c: c[1], propose, (state, again))
        return state
    return jax.lax.while_loop(more, each, state)


def _rested(state: LoopState, plain: Array) -> LoopState:
    """``state`` after a round, counted as a rest's round where ``plain`` ([] bool): one round
    less to rest, one more rested, and the declined proposal's forwards (counted by the rest's
    first round) not counted again. Only these small arrays are selected, never the caches."""
    forwards, one = state.pending.forwards, plain.astype(jnp.int32)
    return dataclasses.replace(
        state,
        pending=dataclasses.replace(state.pending,
                                    forwards=jnp.where(plain, jnp.zeros_like(forwards), forwards)),
        idle=dataclasses.replace(state.idle, rest=state.idle.rest - one),
        counters=dataclasses.replace(state.counters, rested=state.counters.rested + one))


def _rejoin(plan: Plan, target_params, draft_params, state: LoopState) -> LoopState:
    """Once a rest is over (``Idle.rest`` 1), the draft reads the tokens it missed, a few a
    forward, while a generating row's draft is behind."""
    def behind(s: LoopState) -> Array:
        return (s.idle.rest == 1) & jnp.any(~s.done & plan.proposer.behind(s.idle.read, s.length))

    def rejoin(s: LoopState) -> LoopState:
        params = _proposer_params(plan, draft_params, target_params)
        draft_state, read = plan.proposer.rejoin(params, s.draft_state, s.history, s.idle.read,
                                                 s.length)
        return dataclasses.replace(
            s, draft_state=draft_state, idle=dataclasses.replace(s.idle, read=read),
            counters=dataclasses.replace(s.counters, forwards=s.counters.forwards + 1))
    return jax.lax.while_loop(behind, rejoin, state)


loop_widths = adaptive.loop_widths


def decode(plan: Plan, target_params, draft_params, request: Request,
           state: LoopState) -> LoopState:
    """Rounds until every row is done; no host sync inside."""
    return _rounds(plan, target_params, draft_params, request, state,
                   lambda s: ~jnp.all(s.done))


# ---------------------------------------------------------------------------------------------
# Compiled programs


def _with_blocks(stage):
    """``stage`` traced with its plan's attention block, for the target and proposers alike, and
    with the call's adaptive numbers (``Request.tuning``) in its proposer."""
    @functools.wraps(stage)
    def traced(plan: Plan, *args):
        request = next((a for a in args if isinstance(a, Request)), None)
        if request is not None and request.tuning is not None:
            plan = dataclasses.replace(plan, proposer=adaptive.tuned(plan.proposer,
                                                                     request.tuning))
        with attention.blocks_of(plan.attention_block):
            return stage(plan, *args)
    return traced


def decode_until(plan: Plan, target_params, draft_params, request: Request, state: LoopState,
                 until: Array) -> LoopState:
    """Rounds until every row is done or ``until`` ([] int32) rounds have run in all
    (``state.step``): a segment of the decode loop, for streaming. ``until`` is data, so every
    segment length runs the same executable."""
    state = _rounds(plan, target_params, draft_params, request, state,
                    lambda s: ~jnp.all(s.done) & (s.step < until))
    # what the host reads, apart from the state (which the next segment takes over)
    return state, (state.done, state.num_generated, state.history)


_STAGES = {
    "prefill": jax.jit(_with_blocks(prefill_state), static_argnums=0),
    "round": jax.jit(_with_blocks(round_step), static_argnums=0),
    "decode": jax.jit(_with_blocks(decode), static_argnums=0, donate_argnums=4),
    "segment": jax.jit(_with_blocks(decode_until), static_argnums=0, donate_argnums=4),
}


@dataclasses.dataclass(frozen=True)
class Timing:
    prefill_seconds: float  # prefill and first token, compile excluded
    decode_seconds: float  # the decode loop, compile excluded
    compile_seconds: float  # tracing and compiling, or loading from the disk cache, in this call
    # (0 when the process held the executables)


STREAM_SECONDS = 0.02
"""``stream``'s default chunk: as many rounds as take about this long (each segment of the loop
costs a dispatch and a read of the host, about 1 ms on a 2-core CPU)."""


class Program:
    """One plan's compiled stages ("prefill", "round", "decode", "segment"), compiled ahead of
    time once per argument signature (shapes, dtypes, shardings), so timings never include
    compilation."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.compiled = 0  # executables compiled for this plan
        self._executables: collections.OrderedDict = collections.OrderedDict()

    def executable(self, stage: str, *args):
        """(the compiled executable of ``stage`` for these arguments, seconds spent compiling
        it now: 0 when cached)."""
        leaves, treedef = jax.tree_util.tree_flatten(args)
        signature = (stage, treedef,
                     tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
        exe = self._executables.get(signature)
        if exe is not None:
            self._executables.move_to_end(signature)
            return exe, 0.0
        t0 = time.perf_counter()
        lowered = _STAGES[stage].lower(self.plan, *args)
        mesh = self.plan.mesh
        with compile_cache.compiling(() if mesh is None else mesh.devices.flat):  # the disk cache
            exe = lowered.compile()
        spent = time.perf_counter() - t0
        self._executables[signature] = exe
        self.compiled += 1
        log.info("compiled %s for %s in %.1fs", stage, self.plan, spent)
        return exe, spent

    @property
    def held(self) -> int:
        """Executables this program holds."""
        return len(self._executables)

    def trim(self, size: int) -> int:
        """Drop the least recently used executables beyond ``size``; returns how many."""
        dropped = 0
        while len(self._executables) > size:
            self._executables.popitem(last=False)
            dropped += 1
        return dropped

    def executables(self, stage: str) -> list:
        """The compiled executables of ``stage`` held (one per argument signature), for
        inspection (``memory_analysis()``, ``as_text()``)."""
        return [exe for sig, exe in self._executables.items() if sig[0] == stage]

    def call(self, stage: str, *args) -> tuple[Any, float]:
        """Run ``stage`` on args; (result, compile seconds)."""
        exe, spent = self.executable(stage, *args)
        return exe(*args), spent

    def prefill(self, target_params, draft_params, prompts, prompt_lengths, request) -> LoopState:
        return self.call("prefill", target_params, draft_params, prompts, prompt_lengths,
                         request)[0]

    def step(self, target_params, draft_params, request, state) -> LoopState:
        """One round (for tests and experiments that look between rounds)."""
        return self.call("round", target_params, draft_params, request, state)[0]

    def run(self, target_params, draft_params, inputs: Inputs) -> tuple[LoopState, Timing]:
        """Prefill and decode to the end, each stage timed apart from its compilation."""
        t0 = time.perf_counter()
        state, prefill_compile = self.call("prefill", target_params, draft_params,
                                           inputs.prompts, inputs.lengths, inputs.request)
        state = jax.block_until_ready(state)
        prefill_seconds = time.perf_counter() - t0 - prefill_compile
        t0 = time.perf_counter()
        state, decode_compile = self.call("decode", target_params, draft_params, inputs.request,
                                          state)
        state = jax.block_until_ready(state)
        decode_seconds = time.perf_counter() - t0 - decode_compile
        return state, Timing(prefill_seconds, decode_seconds, prefill_compile + decode_compile)

    def segments(self, target_params, draft_params, inputs: Inputs, rounds: int | None,
                 stopper=None):
        """Prefill, then the decode loop ``rounds`` rounds at a time: yields (Timing so far, and
        on the host: done [B_pad], num_generated [B_pad], history [B_pad, S], then the final
        state last) after the prefill and after each segment, until every row is done. The
        next segment is started before a segment's results are read, so the device never
        waits for the host. The rounds are those of ``run`` (same keys, same order), so the
        final state is ``run``'s. ``stopper(done, num_generated, history)``, if given, returns
        rows [B_pad] to end now (stop strings): they are marked done before the next segment."""
        def stop(state, view):
            end = None if stopper is None else stopper(*view)
            if end is None or not end.any():
                return state, view
            state = dataclasses.replace(state, done=state.done | _put_like(end, state.done))
            return state, (view[0] | end, *view[1:])

        t0 = time.perf_counter()
        state, compile_seconds = self.call("prefill", target_params, draft_params,
                                           inputs.prompts, inputs.lengths, inputs.request)
        state, view = stop(state, _fetch((state.done, state.num_generated, state.history)))
        prefill_seconds = time.perf_counter() - t0 - compile_seconds
        decode_seconds, exe, until, step = 0.0, None, 0, 1
        # seconds a round, from the first two segments (each waited for before it is handed
        # on, so timed without the caller's loop; the second is long enough that a segment's
        # fixed cost hardly counts)
        per_round, timed = None, 0
        while True:
            timing = Timing(prefill_seconds, decode_seconds, compile_seconds)
            if view[0].all():
                yield timing, view, state
                return
            # rounds the next segment runs: given, or as many as take about STREAM_SECONDS,
            # from the rounds so far (state.step: a segment that leaves rows running ran all)
            if rounds is not None:
                step = rounds
            elif until:
                step = int(np.clip(STREAM_SECONDS * until / max(decode_seconds, 1e-6), 1, 64))
            until += step
            if exe is None:  # the same signature every segment: looked up once
                exe, spent = self.executable("segment", target_params, draft_params,
                                             inputs.request, state, jnp.asarray(until, jnp.int32))
                compile_seconds += spent
            elif self.plan.mesh is not None:
                # on a mesh a segment may leave some of the state laid out otherwise than the
                # prefill did (a counter replicated, then split; an axis of size 1 named or
                # not): put back where the executable takes it (a no-op where it already is)
                state = jax.device_put(state, exe.input_shardings[0][3])
            args = (target_params, draft_params, inputs.request, state,
                    jnp.asarray(until, jnp.int32))
            launched = time.perf_counter()
            state, ahead = exe(*args)  # runs while the host reads and hands out the last view
            if timed < 2:
                jax.block_until_ready(ahead)
            handed = time.perf_counter()
            yield timing, view, None
            in_caller = time.perf_counter() - handed
            state, view = stop(state, _fetch(ahead))
            # a segment's time, less the caller's: exact while the caller is quicker than the
            # device (the read then waits for the segment); a segment that ended while the
            # caller still held the last chunk is counted at the measured rate
            spent = time.perf_counter() - launched - in_caller
            if timed < 2:
                per_round, timed = spent / step, timed + 1
                decode_seconds += spent
            else:
                decode_seconds += max(spent, per_round * step)


def memory_mappings() -> int | None:
    """The memory mappings this process holds now (Linux), or None where it cannot be read.

    Every executable XLA compiles for the CPU maps its kernels' code and data apart: a static
    chain's program holds about 1,400 mappings, an adaptive chain of 8 (a loop per verify
    width) about 5,400, and Linux stops a process at ``vm.max_map_count`` (65,530 by default),
    where LLVM aborts the process in the middle of a compile ("Cannot allocate memory")."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return None


def mapping_budget() -> int | None:
    """Three quarters of this system's ``vm.max_map_count`` (None where it cannot be read): the
    mappings ``PROGRAMS`` lets the process reach before it drops programs; the last quarter
    (16,000 of the default 65,530) is left for the next compile, larger than any program here."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) * 3 // 4
    except (OSError, ValueError):
        return None


class ProgramCache:
    """The most recently used Programs, by plan. Each lookup drops the least recently used
    programs, then the looked-up program's least recently used executables, until at most
    ``size`` executables are held in all, and, when anything compiled since the last lookup,
    until the process holds at most ``mappings`` memory mappings (default ``mapping_budget()``;
    None: no such bound), so a long-lived process compiling large programs never reaches the
    system's limit."""

    def __init__(self, size: int = 64, mappings: int | None | str = "auto"):
        self.size = size
        self.mappings = mapping_budget() if mappings == "auto" else mappings
        self._programs: collections.OrderedDict[Plan, Program] = collections.OrderedDict()
        self._dropped = 0  # executables compiled by programs no longer held
        self._counted = 0  # self.compiled when the mappings were last counted

    def get(self, plan: Plan) -> Program:
        program = self._programs.get(plan)
        if program is None:
            program = self._programs[plan] = Program(plan)
        self._programs.move_to_end(plan)
        dropped = 0
        while (len(self._programs) > 1
               and sum(p.held for p in self._programs.values()) > self.size):
            dropped += self._drop_oldest()
        dropped += program.trim(self.size)
        if dropped:
            _release()
        if self.compiled != self._counted:
            self._counted = self.compiled
            self.bound(keep=program)
        return program

    def _drop_oldest(self) -> int:
        old = self._programs.popitem(last=False)[1]
        self._dropped += old.compiled
        return old.held

    def bound(self, keep: Program | None = None) -> None:
        """Drop the least recently used programs (all but ``keep``), then ``keep``'s own
        executables, while the process holds more than ``self.mappings`` memory mappings. A
        lookup calls it after a compile; call it yourself after compiling other large programs
        in the same process (the bench's timers)."""
        if self.mappings is None:
            return
        count = memory_mappings()
        while count is not None and count > self.mappings:
            if len(self._programs) > (keep is not None):
                self._drop_oldest()
            elif keep is not None and keep.held:
                log.warning("this process holds %d memory mappings, over the program cache's "
                            "%d: dropping the running program's executables too (they compile "
                            "again when used); free other compiled code, or raise "
                            "vm.max_map_count", count, self.mappings)
                keep.trim(keep.held - 1)
            else:
                return  # nothing of ours is left to free
            _release()
            count = memory_mappings()

    @property
    def compiled(self) -> int:
        """Executables compiled through this cache (dropped programs included)."""
        return self._dropped + sum(p.compiled for p in self._programs.values())

    def programs(self) -> list[Program]:
        """The programs held, least recently used first."""
        return list(self._programs.values())

    def clear(self) -> None:
        """Forget every compiled program (the count of compiled ones stays)."""
        self._dropped = self.compiled
        self._programs.clear()


def _release() -> None:
    """Free the executables no program holds any more. jax's own caches keep every executable
    it compiled alive, each with its memory mappings: without clearing them, a process that
    cycles through many request shapes crashes in the end. The programs still held keep their
    executables; other jitted code compiles again."""
    jax.clear_caches()


PROGRAMS = ProgramCache()
"""The programs ``generate`` compiles and reuses."""


def compiled_programs() -> int:
    """How many executables ``generate`` has compiled in this process (for tests and tuning)."""
    return PROGRAMS.compiled


# ---------------------------------------------------------------------------------------------
# Host steps


def bucket(n: int, minimum: int = 16) -> int:
    """Round a size up to the next of minimum, then 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, ...
    (each step x1.5 or x4/3, so at most 50% padding)."""
    size = 1
    while size < max(n, minimum):
        size = size * 2 if size < 2 else (size * 3 // 2 if size & (size - 1) == 0
                                           else size * 4 // 3)
    return size


def tokenizer_eos(tokenizer) -> tuple[int, ...]:
    """The EOS ids of a tokenizer: an sj.Tokenizer's ``eos_token_ids``, else (a Hugging Face
    tokenizer) its ``eos_token_id``, an int or a list; () when it has none."""
    eos = getattr(tokenizer, "eos_token_ids", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return ()
    if isinstance(eos, numbers.Integral):
        return (int(eos),)
    return tuple(int(e) for e in eos)


def _one_prompt(prompts) -> bool:
    """Whether ``prompts`` is a single flat list (or 1-D array) of integer ids."""
    try:
        arr = np.asarray(prompts)
    except ValueError:  # ragged: a list of prompts
        return False
    return arr.ndim == 1 and arr.size > 0 and np.issubdtype(arr.dtype, np.integer)


def _prompt_rows(prompts, vocab_size: int) -> list[np.ndarray]:
    if (isinstance(prompts, (str, bytes, collections.abc.Mapping, collections.abc.Set))
            or not hasattr(prompts, "__len__") or getattr(prompts, "ndim", 1) == 0):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    try:
        flat = np.asarray(prompts)
    except ValueError:  # ragged: a list of prompts
        flat = None
    if (flat is not None and flat.ndim == 1 and flat.size
            and not np.issubdtype(flat.dtype, np.integer) and flat.dtype.kind in "fcb"):
        raise ValueError(f"prompts must hold integer token ids, got {reprlib.repr(prompts)} "
                         f"(dtype {flat.dtype})")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    if _one_prompt(prompts):
        prompts = [prompts]
    rows = []
    for b, row in enumerate(prompts):
        if isinstance(row, (str, bytes)):
            raise ValueError(f"prompt {b} is a string; pass token ids, or a tokenizer= to "
                             f"encode text")
        try:
            arr = np.asarray(row)
        except ValueError:  # numpy refuses ragged nesting, [1, [2, 3]]
            arr = None
        if arr is None or arr.ndim != 1:
            raise ValueError(f"prompt {b} must be a flat list of token ids, got "
                             f"{reprlib.repr(row)}")
        if arr.size == 0:
            raise ValueError(f"prompt {b} is empty: every prompt needs at least one token")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompt {b} must hold integer token ids, got dtype {arr.dtype}")
        bad = arr[(arr < 0) | (arr >= vocab_size)]
        if bad.size:
            raise ValueError(f"prompt {b} has token id {int(bad[0])} outside [0, {vocab_size})")
        rows.append(arr.astype(np.int32))
    return rows


def check_params(name: str, model: Model) -> None:
    """Refuse parameters that are not those of the model's config (a Model built by hand with
    another config's params, a missing or extra weight): named by path, before tracing (they
    failed deep in flax, or in the program's signature)."""
    from .model import abstract_params
    want = {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf
            in jax.tree_util.tree_flatten_with_path(abstract_params(model.config))[0]}
    got = {jax.tree_util.keystr(path): leaf
           for path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]}
    for path in sorted(want.keys() | got.keys()):
        shape = tuple(getattr(got.get(path), "shape", ())) if path in got else None
        if shape != want.get(path):
            raise ValueError(
                f"the {name}'s params do not match its config at {path}: "
                + ("missing" if path not in got else "not in the config" if path not in want
                   else f"shape {shape}, the config makes {want[path]}"))


def _check_context(name: str, config: ModelConfig, rows: list[np.ndarray], max_new: int) -> None:
    longest = max(len(r) for r in rows)
    if longest + max_new > config.max_position_embeddings:
        b = int(np.argmax([len(r) for r in rows]))
        raise ValueError(
            f"prompt {b} has {longest} tokens; with max_new_tokens={max_new} that is "
            f"{longest + max_new} positions, beyond the {name}'s "
            f"max_position_embeddings={config.max_position_embeddings}")


def check_request(target: Model, prompts, sampling: SamplingParams | None, tokenizer,
                  return_text: bool) -> tuple[list[np.ndarray], SamplingParams]:
    """The prompts as checked int32 rows and the sampling settings (a tokenizer's EOS ids filled
    in), or ValueError naming the bad value."""
    sampling = SamplingParams() if sampling is None else sampling
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if not isinstance(target, Model):
        raise ValueError(f"target must be an sj.Model (from sj.init_model or sj.load_model), "
                         f"got {type(target).__name__}")
    check_params("target", target)
    cfg = target.config
    if sampling.logprobs is not None and sampling.logprobs > cfg.vocab_size:
        raise ValueError(f"SamplingParams.logprobs={sampling.logprobs} exceeds the target's "
                         f"vocab_size {cfg.vocab_size}")
    if tokenizer is not None:
        missing = [a for a in ("vocab_size", "encode", "decode") if not hasattr(tokenizer, a)]
        if missing:  # any object with a Tokenizer's interface serves
            raise ValueError(f"tokenizer must be an sj.Tokenizer (sj.load_tokenizer) or have its "
                             f"{', '.join(missing)}, got {type(tokenizer).__name__}")
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the "
                             f"target's vocab_size {cfg.vocab_size}")
        if isinstance(prompts, str):
            prompts = [prompts]
        if (isinstance(prompts, bytes) or not hasattr(prompts, "__len__")
                or getattr(prompts, "ndim", 1) == 0):
            raise ValueError(f"prompts must be a string, a list of strings or a list of "
                             f"token-id lists, got {type(prompts).__name__}")
        prompts = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        eos = tokenizer_eos(tokenizer)
        if sampling.eos_token_id is None and eos:
            sampling = dataclasses.replace(sampling, eos_token_id=eos)
    elif return_text:
        raise ValueError("return_text=True needs tokenizer=")
    if sampling.stop and tokenizer is None:
        raise ValueError(f"SamplingParams.stop={list(sampling.stop)!r} needs tokenizer= (stop "
                         f"strings are matched in the decoded text); stop_token_ids takes ids")
    rows = _prompt_rows(prompts, cfg.vocab_size)
    _check_context("target", cfg, rows, sampling.max_new_tokens)
    for eos in sampling.eos_ids:
        if eos >= cfg.vocab_size:
            raise ValueError(f"eos_token_id {eos} is outside [0, {cfg.vocab_size})")
    for sequence in sampling.stop_token_ids or ():
        if max(sequence) >= cfg.vocab_size:
            raise ValueError(f"stop_token_ids {list(sequence)} has id {max(sequence)} outside "
                             f"[0, {cfg.vocab_size})")
    return rows, sampling


def build_proposer(spec: SpecConfig | None, proposer, draft, target: ModelConfig):
    """(the proposer, or None for autoregressive decoding; its params) from a SpecConfig through
    the method registry, or a user's own ``proposer`` with ``draft`` as its params."""
    if proposer is not None:
        if spec is not None:
            raise ValueError("give either spec= or proposer=, not both: a proposer object "
                             "replaces the SpecConfig")
        draft_base.check_proposer(proposer)
        return proposer, draft
    if spec is None:
        if draft is not None:
            raise ValueError("a draft model was given but spec is None; pass spec=SpecConfig(...) "
                             "to speculate, or drop draft=")
        return None, None
    method = registry.get(spec.method)
    proposer = method.build(spec, draft, target)
    return proposer, (None if draft is None else method.params(draft))


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The padded sizes of one call."""

    batch: int  # B: the caller's rows
    padded_batch: int  # rows in the program (padding rows start done and are dropped)
    prompt: int  # N: the prompt array's width (the capacity rounded up to whole prefill chunks)


CACHE_TIERS = (256, 1024, 4096, 16384, 65536, 262144)
"""The capacities a request picks from (the smallest that holds it), so a model compiles once per
tier, not once per request size; past the last, 4 times the one before (1,048,576, ...). A
model's last tier is what its context can use at most."""

TOP_K_BOUNDS = (64, 256)
"""The static top-k sizes a program compiles for when top-k is on: a request's top_k picks the
smallest that holds it (``lax.top_k`` over 8,192 logits costs about 15 µs a position at 64
and 52 µs at 256 on a 2-core CPU, so the common top_k of 20-50 should not pay for 256); a
larger top_k compiles the whole vocabulary (a full sort)."""


def slots_needed(longest: int, max_new_tokens: int, gamma: int) -> int:
    """Cache slots a request can use: a row's last round starts at slot prompt + max_new - 2 and
    writes γ + 1 cache slots from there, and history one further (up to prompt + max_new + γ - 1).
    A finished row's later writes may pass the capacity; they are dropped."""
    return longest + max_new_tokens + gamma


def cache_capacity(target: ModelConfig, gamma: int, needed: int,
                   max_cache_len: int | None = None) -> int:
    """S for a request needing ``needed`` slots: ``max_cache_len`` when given (checked), else the
    smallest of CACHE_TIERS that holds it, never more than the target can use."""
    limit = target.max_position_embeddings + gamma
    if max_cache_len is None:
        tier = next((t for t in CACHE_TIERS if t >= needed), None)
        if tier is None:  # a longer context: the tiers go on growing 4 times a step
            tier = CACHE_TIERS[-1]
            while tier < needed:
                tier *= 4
        return min(tier, limit)
    if (not isinstance(max_cache_len, numbers.Integral) or isinstance(max_cache_len, bool)
            or max_cache_len < 1):
        raise ValueError(f"max_cache_len must be a positive int, got {max_cache_len!r}")
    if max_cache_len > limit:
        raise ValueError(
            f"max_cache_len={max_cache_len} is more than the target can use: "
            f"max_position_embeddings={target.max_position_embeddings} plus {gamma} slots a "
            f"round writes past its tokens (drafts, and a lookahead window's) = {limit}")
    if needed > max_cache_len:
        raise ValueError(
            f"max_cache_len={max_cache_len} is too small for this request: it needs {needed} "
            f"slots (longest prompt + max_new_tokens + {gamma} slots a round writes past its "
            f"tokens: drafts, and a lookahead window's)")
    return int(max_cache_len)


def plan_program(target: ModelConfig, proposer, rows: list[np.ndarray], sampling: SamplingParams,
                 mesh, max_cache_len: int | None = None) -> tuple[Plan, Shapes]:
    """The program's static plan (capacity tier, batch bucket, filters, mesh) and the call's
    padded sizes. Neither the prompt lengths nor max_new_tokens pick the program beyond the
    tier; top_k only by which of TOP_K_BOUNDS holds it, if any (or by being off)."""
    longest = max(len(r) for r in rows)
    # the slots a round writes past the length: the drafts, and a lookahead window's guesses
    gamma = 0 if proposer is None else proposer.gamma + draft_base.lookahead_width(proposer)
    capacity = cache_capacity(target, gamma, slots_needed(longest, sampling.max_new_tokens, gamma),
                              max_cache_len)
    B_pad = bucket(len(rows), minimum=1)
    if mesh is not None:
        sharding.check_mesh(mesh)
        data = mesh.shape[sharding.DATA]
        B_pad = -(-B_pad // data) * data  # every "data" shard gets the same number of rows
    V = target.vocab_size
    top_k_on = 0 < sampling.top_k < V
    filters = Filters(top_k=next((min(b, V) for b in TOP_K_BOUNDS if sampling.top_k <= b), V)
                      if top_k_on else 0,
                      top_p=sampling.top_p < 1.0, greedy=sampling.temperature == 0,
                      top_k_every_row=top_k_on)
    chunk = min(PREFILL_CHUNK, capacity)
    width = -(-capacity // chunk) * chunk
    plan = Plan(target, proposer, capacity, filters, mesh, prefill_chunk=chunk,
                attention_block=attention.BLOCK, logprobs=sampling.logprobs,
                logprobs_processed=(sampling.logprobs is not None
                                    and sampling.logprobs_mode == "processed"))
    return plan, Shapes(len(rows), B_pad, width)


def place(target: Model, draft_params, mesh) -> tuple[Model, Any]:
    """Put the weights on the mesh: the target tensor-parallel over "model" (by the sharding
    table, unless ``sj.shard`` already placed it there), the proposer's params replicated
    (drafts are small: drafting needs no communication). Without a mesh, unchanged."""
    if mesh is None:
        return target, draft_params
    if not sharding.placed_on(target, mesh):  # a layout of the caller's own is kept
        target = sharding.shard(target, mesh)
    if draft_params is not None:
        draft_params = jax.device_put(draft_params, NamedSharding(mesh, PartitionSpec()))
    return target, draft_params


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Inputs:
    """One call's arrays, on the devices."""

    prompts: Array  # [B, N] int32, right-padded
    lengths: Array  # [B] int32
    request: Request


def _as_key(key, shared: bool = False) -> Array:
    """One PRNG key from None (a fresh seed from the operating system's randomness), an int
    seed, a typed key or a legacy uint32 [2] key. ``shared``: the call runs on a mesh over
    several processes, which must all draw alike (a seed broadcast from the first; a call in
    one process alone, off such a mesh, must not wait for the others)."""
    if key is None:
        seed = secrets.randbits(63)
        if shared:
            from jax.experimental import multihost_utils
            seed = int(multihost_utils.broadcast_one_to_all(np.int64(seed)))
        return _seed_key(seed)
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        return _seed_key(int(key))
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(f"key must be a single PRNG key, got a key array of shape "
                             f"{key.shape}; rows get their own keys folded from it")
        return key
    if dtype is not None and getattr(key, "shape", None) == (2,) and dtype == np.uint32:
        return jax.random.wrap_key_data(jnp.asarray(key))  # a legacy jax.random.PRNGKey
    if dtype is not None and getattr(key, "shape", None) == () and np.issubdtype(dtype,
                                                                                 np.integer):
        return _seed_key(int(key))
    raise ValueError(f"key must be a jax.random.key, an int seed or None, got {key!r}")


def _seed_key(seed: int) -> Array:
    if not -2 ** 63 <= seed < 2 ** 63:
        raise ValueError(f"key seed {seed} is outside [-2**63, 2**63)")
    return jax.random.key(seed)


@functools.lru_cache(maxsize=32)
def _wrap_keys(impl, out_sharding):
    """A jitted wrap of raw key data into keys of ``impl``, laid out as ``out_sharding``: one
    per (impl, sharding), so a call on a mesh does not trace and compile it again."""
    return jax.jit(functools.partial(jax.random.wrap_key_data, impl=impl),
                   out_shardings=out_sharding)


@functools.partial(jax.jit, static_argnums=1)
def _row_keys(root, rows: int):
    """Row i's key: fold_in(root, i), for ``rows`` rows (compiled once per padded batch size:
    traced eagerly, these few operations cost about 3 ms of every generate call)."""
    return jax.vmap(jax.random.fold_in, (None, 0))(root, jnp.arange(rows))


def build_inputs(rows: list[np.ndarray], sampling: SamplingParams, key, shapes: Shapes,
                 mesh, synthetic: tuple[float, ...] | None = None,
                 tuning: adaptive.Tuning | None = None) -> Inputs:
    """The call's arrays, built in numpy and placed on the devices once (split over "data" on a
    mesh, the same in every process); ``tuning``: an adaptive chain's numbers
    (``adaptive.split_tuning``)."""
    B, B_pad, P = shapes.batch, shapes.padded_batch, shapes.prompt
    prompts = np.zeros((B_pad, P), np.int32)
    for b, r in enumerate(rows):
        prompts[b, :len(r)] = r
    lengths = np.ones((B_pad,), np.int32)
    lengths[:B] = [len(r) for r in rows]
    max_new = np.ones((B_pad,), np.int32)  # padding rows: done after their first token
    max_new[:B] = sampling.max_new_tokens
    eos = np.full((MAX_EOS_IDS,), -1, np.int32)
    eos[:len(sampling.eos_ids)] = sampling.eos_ids
    # stop sequences: matched in the loop only when given (a program of their own, shared by
    # every set of them), so other calls pay nothing for them
    stop = None
    if sampling.stop_token_ids:
        stop = np.full((MAX_STOP_SEQUENCES, MAX_STOP_LENGTH), -1, np.int32)
        for i, sequence in enumerate(sampling.stop_token_ids):
            stop[i, MAX_STOP_LENGTH - len(sequence):] = sequence
    root = _as_key(key, shared=mesh is not None and len(
        {d.process_index for d in mesh.devices.flat}) > 1)
    keys = _row_keys(root, B_pad)
    per_row = dict(temperature=np.full((B_pad,), sampling.temperature, np.float32),
                   top_k=np.full((B_pad,), sampling.top_k, np.int32),
                   top_p=np.full((B_pad,), sampling.top_p, np.float32))
    if mesh is None:
        put, everywhere = jnp.asarray, jnp.asarray
    else:
        put = lambda x: jax.make_array_from_callback(  # noqa: E731
            x.shape, sharding.rows(mesh, x.ndim), lambda index: x[index])
        everywhere = lambda x: jax.make_array_from_callback(  # noqa: E731
            x.shape, NamedSharding(mesh, PartitionSpec()), lambda index: x[index])
        keys = _wrap_keys(jax.random.key_impl(root), sharding.rows(mesh, 1))(
            put(np.asarray(jax.random.key_data(keys))))
    request = Request(keys=keys, sampling=SamplingArrays(**{k: put(v) for k, v in per_row.items()}),
                      max_new_tokens=put(max_new), eos=everywhere(eos),
                      stop=None if stop is None else everywhere(stop),
                      synthetic=None if synthetic is None else everywhere(
                          np.asarray(synthetic, np.float32)),
                      tuning=None if tuning is None else jax.tree.map(
                          lambda x: everywhere(np.asarray(x)), tuning))
    return Inputs(put(prompts), put(lengths), request)


def _put_like(x: np.ndarray, like):
    """A host array onto the devices as ``like`` is placed (whole, the same in every process)."""
    if getattr(like, "is_fully_addressable", True):
        return jax.device_put(x, like.sharding)
    return jax.make_array_from_callback(x.shape, like.sharding, lambda index: x[index])


def _fetch(x):
    """A (possibly multi-process) array, or a tuple of them -> numpy on this host, whole (a
    tuple in one transfer)."""
    if isinstance(x, tuple):
        if all(getattr(a, "is_fully_addressable", True) for a in x):
            return tuple(np.asarray(a) for a in jax.device_get(x))
        return tuple(_fetch(a) for a in x)
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def collect(plan: Plan, state: LoopState, rows: list[np.ndarray], max_new: int,
            timing: Timing) -> Generation:
    """The caller's rows of the final state as a Generation (one read of the device)."""
    B = len(rows)
    history, generated = _fetch(state.history), _fetch(state.num_generated)[:B]

    def generated_part(buffer: np.ndarray, fill) -> np.ndarray:
        """Each row's generated slots of a per-slot buffer [B_pad, S, ...] -> [B, max_new, ...],
        ``fill`` past each row's end."""
        out = np.full((B, max_new) + buffer.shape[2:], fill, buffer.dtype)
        for b, r in enumerate(rows):
            out[b, :generated[b]] = buffer[b, len(r):len(r) + generated[b]]
        return out

    tokens = generated_part(history, -1)
    per_round = (0 if plan.proposer is None
                 else getattr(plan.proposer, "draft_forwards_per_round", 0))
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves((state.cache, state.draft_state)))
    stats = Stats.summarise(
        jax.tree.map(_fetch, state.counters), gamma=plan.depth,
        draft_calls_per_round=per_round, has_draft_model=per_round > 0,
        generated_tokens=int(generated.sum()), batch=B,
        # after each row's first token (a row stopped at its first non-finite logits: none)
        decode_tokens=int(np.maximum(np.asarray(generated) - 1, 0).sum()),
        prefill_seconds=timing.prefill_seconds, decode_seconds=timing.decode_seconds,
        compile_seconds=timing.compile_seconds,
        cache_bytes_per_row=cache_bytes // state.length.shape[0], capacity=plan.capacity)
    logprobs = None
    if state.logprobs is not None:
        token, top_ids, top = _fetch(tuple(state.logprobs))
        logprobs = Logprobs(generated_part(token, np.nan), generated_part(top_ids, -1),
                            generated_part(top, np.nan))
    return Generation(tokens=tokens, lengths=np.asarray(generated, np.int32), stats=stats,
                      logprobs=logprobs)


# ---------------------------------------------------------------------------------------------
# The entry point


def _prepare(target: Model, prompts, sampling, spec, draft, proposer, key, tokenizer,
             return_text, mesh, max_cache_len, allow_synthetic=False, draft_tokenizer=None):
    """Every host step before running: checks, proposer, plan, placement, inputs."""
    spec = SpecConfig.parse(spec)
    if draft_tokenizer is not None:
        if spec is None or proposer is not None or registry.get(spec.method).draft != "model":
            got = ("a proposer" if proposer is not None else "no spec" if spec is None
                   else f"method {spec.method!r}")
            raise ValueError(f"draft_tokenizer= is for a draft model (spec method "
                             f"'draft_model'), got {got}")
        if tokenizer is None:
            raise ValueError("draft_tokenizer= pairs the draft's tokens with the target's by "
                             "their bytes: pass the target's tokenizer= too")
        from .draft.draft_model import for_tokenizers
        draft = for_tokenizers(draft, draft_tokenizer, tokenizer, target.config.vocab_size)
    # (return_text None: the caller's default, text only with a tokenizer)
    for name, flag in (("allow_synthetic", allow_synthetic), ("return_text", return_text)):
        if not isinstance(flag, (bool, np.bool_)) and not (name == "return_text" and flag is None):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    synthetic = None if spec is None else spec.synthetic_acceptance
    if synthetic is not None and not allow_synthetic:
        raise ValueError(f"SpecConfig.synthetic_acceptance={synthetic!r} accepts drafts by a "
                         f"coin, so the output does NOT follow the target's distribution: it "
                         f"is for benchmarks only. Pass allow_synthetic=True to run it.")
    rows, sampling = check_request(target, prompts, sampling, tokenizer, return_text)
    draft_config = getattr(draft, "config", None)
    if isinstance(draft_config, ModelConfig):  # a draft model's own context limit
        _check_context("draft", draft_config, rows, sampling.max_new_tokens)
    proposer, draft_params = build_proposer(spec, proposer, draft, target.config)
    # the threshold's and budget's numbers travel with the call, not in the plan
    proposer, tuning = adaptive.split_tuning(proposer)
    if synthetic is not None and draft_base.is_tree(proposer):
        raise ValueError(f"SpecConfig.synthetic_acceptance is for chains; method "
                         f"{spec.method!r} here verifies a tree (lookahead always does)")
    plan, shapes = plan_program(target.config, proposer, rows, sampling, mesh, max_cache_len)
    if synthetic is not None:
        plan = dataclasses.replace(plan, synthetic=True)
    target, draft_params = place(target, draft_params, mesh)
    inputs = build_inputs(rows, sampling, key, shapes, mesh, synthetic, tuning)
    return rows, sampling, plan, target, draft_params, inputs


def generate(target: Model, prompts: Sequence[Sequence[int]], *,
             sampling: SamplingParams | None = None,
             spec: SpecConfig | dict | str | None = None,
             draft: Any = None,
             proposer: Any = None,
             key: Array | int | None = None,
             tokenizer=None, return_text: bool | None = None, mesh=None,
             max_cache_len: int | None = None, allow_synthetic: bool = False,
             draft_tokenizer=None) -> Generation:
    """Generate from ``target`` for a batch of prompts, speculatively when ``spec`` or
    ``proposer`` is given.

    prompts: B lists of token ids, any lengths (>= 1), or strings with ``tokenizer=``; one flat
    list of ids (or one string) is one prompt. return_text: decode ``out.text`` (default: when a
    tokenizer is given; False leaves it None). sampling:
    SamplingParams (default: temperature 1, 64 new tokens). spec: SpecConfig, a dict or JSON
    string in vLLM's style, or None for plain autoregressive decoding. draft: what the method
    drafts with: a draft model (sj.Model or sj.DraftModel, same vocabulary as the target) for
    "draft_model", sj.Heads for "medusa" / "eagle". proposer: instead of spec, any object
    satisfying ``sj.draft.Proposer`` (frozen and hashable); draft= is then its params (any pytree,
    or None). key: a PRNG key (or an int seed); each row draws from its own key folded from it,
    so the same key gives the same output and rows do not depend on each other. None (the
    default) draws a fresh seed each call, as vLLM and Hugging Face do: sampled calls differ;
    pass a key to reproduce one.

    The output distribution equals autoregressive sampling from the target with the same
    SamplingParams; with temperature 0 the tokens equal autoregressive greedy decoding.

    Compiling: a program is compiled once per batch bucket, cache capacity, proposer, set of
    sampling filters and greedy-or-not (docs/performance.md has the table); prompt lengths,
    max_new_tokens, temperature and top_k values share it. The capacity is the smallest of
    ``CACHE_TIERS`` holding longest prompt + max_new_tokens + γ, or ``max_cache_len`` when
    given (fixed for a server or notebook; ``warmup`` compiles it ahead). Attention reads only
    live slots, so a larger capacity costs memory, not speed.

    mesh: a ("data", "model") mesh from ``sj.make_mesh`` runs the whole loop sharded: the target
    tensor-parallel over "model" (placed by the table in specjax/sharding.py unless it already
    is), the draft replicated, rows split over "data" (the batch is padded to a multiple of the
    "data" size; padding rows are dropped from the result). In a multi-process run
    (``jax.distributed``) every process makes the same call with the same prompts and gets the
    whole result.

    allow_synthetic: run a spec with ``synthetic_acceptance`` (benchmarks only: the output is
    not the target's distribution; ``out.stats.synthetic_acceptance`` says so).

    draft_tokenizer: the draft model's own tokenizer (an sj.Tokenizer), when it is not the
    target's (``tokenizer=``, needed with it): the draft proposes only the tokens the two share,
    its distribution renormalised over them (``sj.draft.for_tokenizers``; lossless like every
    draft; ``sj.draft.vocab_coverage`` says how much probability the shared tokens carry).
    """
    return_text = tokenizer is not None if return_text is None else return_text
    rows, sampling, plan, target, draft_params, inputs = _prepare(
        target, prompts, sampling, spec, draft, proposer, key, tokenizer, return_text, mesh,
        max_cache_len, allow_synthetic, draft_tokenizer)
    if sampling.stop:  # stop strings: matched on the host between segments of rounds
        last = collections.deque(_stream(plan, target, draft_params, inputs, rows, sampling,
                                         spec, tokenizer, None, with_text=return_text),
                                 maxlen=1)[0]
        out = last.generation
    else:
        state, timing = PROGRAMS.get(plan).run(target.params, draft_params, inputs)
        out = _result(plan, state, rows, sampling, timing, spec,
                      tokenizer if return_text else None)
    _after_call(spec, draft, rows, out)
    return out


def _after_call(spec, draft, rows, out: Generation) -> None:
    """Let a draft= that learns from calls (suffix decoding's corpus) see this one."""
    spec = SpecConfig.parse(spec)
    if spec is None or draft is None:
        return
    after = registry.get(spec.method).after_call
    if after is not None:
        after(draft, [list(map(int, r)) for r in rows], out)


_GENERATE_OPTIONS = {name: p.default for name, p in inspect.signature(generate).parameters.items()
                     if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _decode(tokenizer, ids) -> str:
    """Generated ids -> text: ids a padded embedding has past the tokenizer's are dropped (an
    sj.Tokenizer; other tokenizers decode as they do)."""
    from .tokenizer import Tokenizer
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.decode(ids, unknown="skip")
    return tokenizer.decode(ids)


class NonFiniteError(FloatingPointError):
    """The target's logits became NaN or infinite for some rows (a float16 overflow, a broken
    checkpoint): those rows stopped before the token that could not be drawn. ``rows`` and
    ``positions`` (the index of that token among the row's generated tokens) name them;
    ``generation`` holds the call's result, every row's tokens up to where it stopped."""

    def __init__(self, rows: list[int], positions: list[int], generation: Generation):
        self.rows, self.positions, self.generation = rows, positions, generation
        where = ", ".join(f"row {b} at generated token {t}" for b, t in zip(rows, positions))
        super().__init__(
            f"the target's logits were not finite (NaN or inf) for {where}: each of those rows "
            f"stopped there, and its tokens before are valid (this error's .generation holds "
            f"them). A float16 overflow (try dtype='bfloat16' or 'float32') or a broken "
            f"checkpoint?")


def _result(plan: Plan, state: LoopState, rows, sampling: SamplingParams, timing: Timing, spec,
            tokenizer, stops: _StopStrings | None = None) -> Generation:
    """The finished state as the caller's Generation (text when a tokenizer is given; rows a
    stop string ended cut, ``stops``); raises NonFiniteError, with that Generation, when a row
    met non-finite logits."""
    out = collect(plan, state, rows, sampling.max_new_tokens, timing)
    if plan.synthetic:  # said wherever the result goes
        out = dataclasses.replace(out, stats=dataclasses.replace(
            out.stats, synthetic_acceptance=SpecConfig.parse(spec).synthetic_acceptance))
    if tokenizer is not None:
        text = [_decode(tokenizer, out.tokens[b, :out.lengths[b]]) for b in range(len(rows))]
        out = dataclasses.replace(out, text=text)
    if stops is not None:
        out = stops.cut(out)
    nonfinite = _fetch(state.nonfinite)[:len(rows)]
    if (nonfinite >= 0).any():
        bad = [int(b) for b in np.flatnonzero(nonfinite >= 0)]
        raise NonFiniteError(bad, [int(nonfinite[b]) for b in bad], out)
    return out


@dataclasses.dataclass(frozen=True)
class StreamChunk:
    """What ``stream`` yields after the prefill and after each segment of rounds."""

    tokens: list[np.ndarray]  # per row: the tokens it generated since the last chunk (int32)
    finished: np.ndarray  # [B] bool: rows that have generated their last token
    text: list[str] | None = None  # per row: the new text, when a tokenizer is given
    # the whole call's Generation (tokens, lengths, stats, text), on the last chunk only
    generation: Generation | None = None


class _TextDelta:
    """Per row, the text so far minus what was already given out. A text that ends in U+FFFD (a
    character whose bytes are not all there yet) is held back until the rest arrive, and so are
    its last ``hold`` characters (where a stop string may be starting); a finished row's last
    chunk gives everything. (A byte-level BPE decode of more tokens only extends the text; for
    a tokenizer where it could change earlier characters, the new text is taken from where the
    two first differ, and ``Generation.text`` is the reference.)"""

    def __init__(self, rows: int, hold: int = 0):
        self.sent, self.hold = [""] * rows, hold

    def __call__(self, b: int, text: str, final: bool) -> str:
        ready = text
        if not final:
            ready = ready.rstrip("\ufffd")
            ready = ready[:max(len(ready) - self.hold, 0)]
        common = len(os.path.commonprefix([ready, self.sent[b]]))
        if len(ready) <= common:
            return ""
        self.sent[b] = ready
        return ready[common:]


class _StopStrings:
    """Stop strings, matched on the host in each row's decoded text after each segment: the
    first string to be completed ends the row. Its tokens are kept up to the one completing it
    (the fewest whose text holds a stop string), its text up to the string's start (or its end,
    ``include_stop_str_in_output``), as vLLM cuts them."""

    def __init__(self, tokenizer, sampling: SamplingParams, rows: list[np.ndarray]):
        self.tokenizer, self.stops = tokenizer, sampling.stop
        self.include = sampling.include_stop_str_in_output
        self.rows = rows
        self.kept: dict[int, tuple[int, str]] = {}  # row -> (tokens kept, text kept)

    def _holds(self, tokens) -> bool:
        text = _decode(self.tokenizer, tokens)
        return any(s in text for s in self.stops)

    def __call__(self, done, generated, history) -> np.ndarray:
        """Rows [len(done)] that a stop string ends now (recorded in ``kept``)."""
        end = np.zeros(done.shape, bool)
        for b, r in enumerate(self.rows):
            if b in self.kept:
                continue
            tokens = history[b, len(r):len(r) + int(generated[b])]
            if not self._holds(tokens):
                continue
            lo, hi = 1, len(tokens)  # the fewest tokens whose text holds a stop string
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if self._holds(tokens[:mid]) else (mid + 1, hi)
            text = _decode(self.tokenizer, tokens[:lo])
            # the string completed first: the earliest to end (one token can complete several,
            # "bc" and "abcd" in "…abcd"); of those ending together, the first listed
            ends, _, stop = min((text.find(s) + len(s), i, s) for i, s in enumerate(self.stops)
                                if s in text)
            self.kept[b] = (lo, text[:ends] if self.include else text[:ends - len(stop)])
            end[b] = True
        return end

    def cut(self, out: Generation) -> Generation:
        """The call's result with each stopped row's tokens and text cut."""
        tokens, lengths = out.tokens.copy(), out.lengths.copy()
        text = list(out.text) if out.text is not None else None
        logprobs = out.logprobs and Logprobs(*(x.copy() for x in dataclasses.astuple(
            out.logprobs)))
        for b, (n, kept) in self.kept.items():
            tokens[b, n:] = -1
            lengths[b] = n
            if text is not None:
                text[b] = kept
            if logprobs is not None:
                logprobs.token[b, n:], logprobs.top_ids[b, n:], logprobs.top[b, n:] = (
                    np.nan, -1, np.nan)
        # the output's own token count (the rounds run past a stop stay counted as rounds)
        generated = int(lengths.sum())
        seconds = out.stats.decode_seconds
        stats = dataclasses.replace(
            out.stats, generated_tokens=generated,
            decode_tokens_per_second=(int(np.maximum(lengths - 1, 0).sum()) / seconds
                                      if seconds > 0 else 0.0))
        return dataclasses.replace(out, tokens=tokens, lengths=lengths, text=text,
                                   logprobs=logprobs, stats=stats)


def stream(target: Model, prompts, *, rounds_per_chunk: int | None = None, **kwargs):
    """``generate``, yielding each row's new tokens as rounds finish: a ``StreamChunk`` after the
    prefill (each row's first token) and after every ``rounds_per_chunk`` rounds (None: as many
    as take about ``STREAM_SECONDS``, 20 ms), the last one carrying the whole ``Generation``.
    Same arguments as ``generate`` (text, as there, whenever ``tokenizer=`` is given, unless
    ``return_text=False``). The compiled
    loop runs in segments, one executable for every segment length, so nothing recompiles
    between chunks, and the next segment runs while a chunk is handed out; the rounds are
    generate's own, so the final tokens and stats equal ``generate``'s with the same key.
    Each segment costs a dispatch and a read of the host (about 1 ms on a 2-core CPU): one round
    a chunk suits large models, where a round takes far longer.

        for chunk in sj.stream(target, ["def f("], tokenizer=tok, spec=spec, draft=draft):
            print(chunk.text[0], end="", flush=True)
    """
    if rounds_per_chunk is not None and (
            isinstance(rounds_per_chunk, bool)
            or not isinstance(rounds_per_chunk, numbers.Integral) or rounds_per_chunk < 1
            or rounds_per_chunk > 2 ** 31 - 1):  # the loop counts rounds in int32
        raise ValueError(f"rounds_per_chunk must be an int in [1, 2**31 - 1] or None, got "
                         f"{rounds_per_chunk!r}")
    unknown = set(kwargs) - set(_GENERATE_OPTIONS)
    if unknown:
        raise TypeError(f"stream() got unexpected keyword arguments {sorted(unknown)}; it takes "
                        f"generate's: {', '.join(_GENERATE_OPTIONS)}")
    options = {**_GENERATE_OPTIONS, **kwargs}
    tokenizer = options["tokenizer"]
    rows, sampling, plan, target, draft_params, inputs = _prepare(
        target, prompts, options["sampling"], options["spec"], options["draft"],
        options["proposer"], options["key"], tokenizer, options["return_text"],
        options["mesh"], options["max_cache_len"], options["allow_synthetic"],
        options["draft_tokenizer"])
    chunks = _stream(plan, target, draft_params, inputs, rows, sampling, options["spec"],
                     tokenizer, rounds_per_chunk, with_text=options["return_text"] is not False)

    def chunks_then_learn():  # (a generator inside: the checks above ran at the call)
        for chunk in chunks:
            if chunk.generation is not None:
                _after_call(options["spec"], options["draft"], rows, chunk.generation)
            yield chunk
    return chunks_then_learn()


def _stream(plan, target, draft_params, inputs, rows, sampling, spec, tokenizer, rounds,
            with_text=True):
    """stream's chunks; text in them when a tokenizer is given and ``with_text`` (stop strings
    read the text either way)."""
    B = len(rows)
    given = np.zeros(B, np.int64)  # tokens given out per row
    stops = None if not sampling.stop else _StopStrings(tokenizer, sampling, rows)
    hold = 0 if stops is None else max(map(len, sampling.stop)) - 1
    with_text = with_text and tokenizer is not None
    delta = _TextDelta(B, hold) if with_text else None
    segments = PROGRAMS.get(plan).segments(target.params, draft_params, inputs, rounds, stops)
    for timing, (done, generated, history), state in segments:
        done, generated = done[:B], generated[:B].astype(np.int64)
        kept = {} if stops is None else stops.kept
        new, text = [], [] if delta is not None else None
        for b, r in enumerate(rows):
            n = kept[b][0] if b in kept else int(generated[b])
            new.append(np.asarray(history[b, len(r) + min(given[b], n):len(r) + n], np.int32))
            generated[b] = n
            if delta is not None:
                row_text = kept[b][1] if b in kept else _decode(
                    tokenizer, history[b, len(r):len(r) + n])
                text.append(delta(b, row_text, bool(done[b])))
        given = np.maximum(given, generated)
        generation = None
        if state is not None:
            generation = _result(plan, state, rows, sampling, timing, spec, tokenizer, stops)
            if not with_text:
                generation = dataclasses.replace(generation, text=None)
        yield StreamChunk(tokens=new, finished=done.copy(), text=text, generation=generation)


@dataclasses.dataclass(frozen=True)
class Warmup:
    """What ``warmup`` compiled."""

    capacity: int  # cache slots per row of the compiled program
    batch: int  # rows in the program (the batch bucket)
    compiled: int  # executables compiled now (0: they were already cached)
    compile_seconds: float


def warmup(target: Model, *, batch_size: int = 1, prompt_tokens: int = 1,
           sampling: SamplingParams | None = None,
           spec: SpecConfig | dict | str | None = None, draft: Any = None, proposer: Any = None,
           mesh=None, max_cache_len: int | None = None, allow_synthetic: bool = False,
           stream: bool = False) -> Warmup:
    """Compile ahead (a notebook's first cell, a server's start-up) the program that
    ``generate`` with the same target, spec, draft, proposer, mesh and max_cache_len will use
    for ``batch_size`` prompts of up to ``prompt_tokens`` tokens and ``sampling`` (its
    max_new_tokens, whether it is greedy and which filters it turns on). Every request that
    lands in the same batch bucket and capacity then compiles nothing. Runs one prefill on a
    dummy prompt; decodes nothing. ``stream=True`` (or stop strings in ``sampling``) also
    compiles the segment of the loop that ``stream`` and stop strings run."""
    for name, value in [("batch_size", batch_size), ("prompt_tokens", prompt_tokens)]:
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    prompts = [[0] * int(prompt_tokens)] * int(batch_size)
    if isinstance(sampling, SamplingParams) and sampling.stop:  # host-side: no tokenizer needed
        sampling = dataclasses.replace(sampling, stop=None)
        stream = True  # stop strings are matched between segments
    _, _, plan, target, draft_params, inputs = _prepare(
        target, prompts, sampling, spec, draft, proposer, None, None, False, mesh, max_cache_len,
        allow_synthetic)
    program = PROGRAMS.get(plan)
    before = program.compiled
    state, prefill_compile = program.call("prefill", target.params, draft_params, inputs.prompts,
                                          inputs.lengths, inputs.request)
    _, decode_compile = program.executable("decode", target.params, draft_params,
                                           inputs.request, state)
    if stream:
        _, spent = program.executable("segment", target.params, draft_params, inputs.request,
                                      state, jnp.asarray(0, jnp.int32))
        decode_compile += spent
    return Warmup(plan.capacity, int(inputs.lengths.shape[0]), program.compiled - before,
                  prefill_compile + decode_compile)
