"""``generate``: prefill, then speculative rounds under one ``lax.while_loop``.

Loop invariant, per row b::

    history[b, :length[b] + 1]   the sequence so far (prompt, then generated tokens)
    cache.length[b] == length[b] every token but the last is in the target cache
    history[b, length[b]]        the last token, which the next round feeds first

A round feeds the target the chunk [last, d_1 .. d_γ] at positions length .. length + γ, verifies,
writes the num_accepted + 1 new tokens into history after the last one and advances length by
what was emitted. Each row moves by its own count; done rows stay frozen. With ``spec=None`` the
same round runs with γ = 0 (no proposer): plain autoregressive decoding, our baseline.

Shapes that are fixed per program (static, part of the compile key): batch B, prompt bucket P,
capacity S (cache and history), γ, the model configs, and whether top-k / top-p filters are
compiled in. Everything else (prompt lengths, max_new_tokens, temperature, top-k, top-p, EOS ids,
keys) is an array, so nearby request sizes share a compiled program.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import numbers
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec

from . import cache as kv
from . import sharding
from . import model as model_lib
from . import sampling as sampling_lib
from . import verify
from .cache import KVCache
from .config import MAX_EOS_IDS, SamplingParams, SpecConfig
from .draft import (DraftModelProposer, DraftTreeProposer, EagleProposer, MedusaProposer,
                    NgramProposer)
from .draft.model import draft_vocab_size
from .drafter import Drafter
from .model import Model
from .sampling import Filters, SamplingArrays
from .stats import Counters, Stats
from .tree import Tree

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one compiled program."""

    target: Any  # ModelConfig of the target
    proposer: Any  # a proposer (see specjax.draft), or None for autoregressive decoding
    capacity: int  # S: cache and history slots per row
    filters: Filters  # which sampling filters are compiled in
    mesh: Any = None  # a ("data", "model") jax.sharding.Mesh for sharded runs, or None

    @property
    def gamma(self) -> int:
        return 0 if self.proposer is None else self.proposer.gamma

    @property
    def tree(self):
        """The proposer's static tree (specjax.tree.Tree), or None for a chain."""
        return getattr(self.proposer, "tree", None)

    @property
    def depth(self) -> int:
        """The most drafts a round can accept: γ for a chain, the tree's depth for a tree."""
        return self.gamma if self.tree is None else self.tree.depth


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Request:
    """Per-call arrays (never part of the compile key)."""

    keys: Array  # [B] typed PRNG keys, one per row
    sampling: SamplingArrays  # [B] each
    max_new_tokens: Array  # [B] int32
    eos: Array  # [MAX_EOS_IDS] int32, padded with -1


@dataclasses.dataclass(frozen=True)
class Generation:
    tokens: np.ndarray  # [B, max_new_tokens] int32, -1 after each row's end
    lengths: np.ndarray  # [B] int32: generated tokens per row (EOS included)
    stats: Stats
    text: list[str] | None = None  # decoded rows, when generate was asked for text


def _emit(state: LoopState, tokens: Array, num_accepted: Array, request: Request
          ) -> tuple[Array, Array, Array]:
    """How many of a round's tokens each row keeps: EOS and max_new_tokens cut the round short.

    tokens [B, T] (−1 padded), num_accepted [B]. Returns (n_emit [B], hit_eos [B], history).
    """
    T = tokens.shape[1]
    index = jnp.arange(T)[None, :]
    offered = index < (num_accepted + 1)[:, None]
    is_eos = jnp.any(tokens[:, :, None] == request.eos[None, None, :], axis=-1) & offered
    eos_cut = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, T)
    n_emit = jnp.minimum(jnp.minimum(num_accepted + 1, eos_cut),
                         request.max_new_tokens - state.num_generated)
    n_emit = jnp.where(state.done, 0, n_emit)
    hit_eos = jnp.any(is_eos & (index < n_emit[:, None]), axis=1)
    history = kv.write(state.history, tokens, state.length + 1)
    return n_emit, hit_eos, history


def _prefill(plan: Plan, target_params, draft_params, prompts: Array, prompt_lengths: Array,
             request: Request) -> LoopState:
    """Run the prompts [B, P] (right-padded) through target and proposer; draw the first token."""
    B, P = prompts.shape
    S = plan.capacity
    target = Model(plan.target, target_params)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    cache = KVCache.init(plan.target, B, S)
    if plan.mesh is not None:  # the target cache: rows over "data", kv heads over "model"
        spec = sharding.cache_spec(plan.target, plan.mesh)
        cache = dataclasses.replace(cache, k=sharding.constrain(cache.k, plan.mesh, spec),
                                    v=sharding.constrain(cache.v, plan.mesh, spec))
    logits, hidden, cache = model_lib.forward(target, prompts, positions, cache)
    rows = jnp.arange(B)
    last_logits = logits[rows, prompt_lengths - 1]  # [B, V]
    probs = sampling_lib.process_logits(last_logits, request.sampling, plan.filters)
    keys = jax.vmap(lambda k: jax.random.fold_in(k, 0))(request.keys)
    first = sampling_lib.sample(keys, probs)
    history = jnp.zeros((B, S), jnp.int32).at[:, :P].set(prompts)
    history = history.at[rows, prompt_lengths].set(first)
    draft_state = None
    if _rides(plan):
        draft_state = plan.proposer.init(_proposer_params(plan, draft_params, target_params),
                                         prompts, prompt_lengths, S, hidden)
    elif plan.proposer is not None:
        draft_state = plan.proposer.init(draft_params, prompts, prompt_lengths, S)
    done = jnp.any(first[:, None] == request.eos[None, :], axis=1) | (request.max_new_tokens <= 1)
    return LoopState(
        history=history, length=prompt_lengths, num_generated=jnp.ones((B,), jnp.int32),
        done=done, cache=cache.rollback(prompt_lengths), draft_state=draft_state,
        counters=Counters.zeros(plan.depth), step=jnp.zeros((), jnp.int32))


def _rides(plan: Plan) -> bool:
    """Whether the proposer drafts from the target's hidden states (Medusa, EAGLE)."""
    return getattr(plan.proposer, "rides_on_target", False)


def _proposer_params(plan: Plan, draft_params, target_params):
    return ({"drafter": draft_params, "target": target_params} if _rides(plan)
            else draft_params)


def _round_keys(keys: Array, step: Array) -> tuple[Array, Array]:
    """Fresh draft and verify keys [B] for round ``step``: each row's key folded with the round
    number (prefill used 0), so no random number is reused across rows or rounds."""
    round_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, step + 1)
    draft_keys, verify_keys = jnp.moveaxis(jax.vmap(jax.random.split)(round_keys), 1, 0)
    return draft_keys, verify_keys


def _round(plan: Plan, target_params, draft_params, request: Request,
           state: LoopState) -> LoopState:
    """One speculative round (γ = 0: one autoregressive step) for every row."""
    B = state.length.shape[0]
    G = plan.gamma
    draft_keys, verify_keys = _round_keys(request.keys, state.step)
    last = state.history[jnp.arange(B), state.length]
    if plan.proposer is None:
        draft_tokens, draft_probs, valid = jnp.zeros((B, 0), jnp.int32), None, None
        draft_state = state.draft_state
    else:
        draft, draft_state = plan.proposer.propose(
            _proposer_params(plan, draft_params, target_params), state.draft_state, state.history, state.length, draft_keys,
            request.sampling, plan.filters)
        draft_tokens, draft_probs, valid = draft.tokens, draft.probs, draft.valid
    chunk = jnp.concatenate([last[:, None], draft_tokens], axis=1)  # [B, G+1] (tree: [B, N])
    target = Model(plan.target, target_params)
    cache = state.cache.rollback(state.length)
    tree = plan.tree
    if tree is None:
        def verify_chain(T: int):
            """Feed [last, d_1 .. d_{T-1}] (T static) and verify those drafts."""
            def run(cache):
                positions = state.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
                logits, hidden, cache = model_lib.forward(target, chunk[:, :T], positions,
                                                          cache)
                row_valid = None if valid is None else valid[:, :T - 1]
                if plan.filters.greedy:  # one-hot p: the same verdict from argmaxes alone
                    verdict = verify.greedy_verdict(
                        draft_tokens[:, :T - 1], jnp.argmax(logits, axis=-1), row_valid)
                else:
                    target_probs = sampling_lib.process_logits(logits, request.sampling,
                                                               plan.filters)
                    verdict = verify.rejection_sample(
                        verify_keys, draft_tokens[:, :T - 1],
                        None if draft_probs is None else draft_probs[:, :T - 1], target_probs,
                        row_valid)
                tokens = jnp.pad(verdict.tokens, ((0, 0), (0, G + 1 - T)), constant_values=-1)
                return verify.Verdict(tokens, verdict.num_accepted), cache, hidden
            return run

        if valid is None:
            verdict, cache, hidden = verify_chain(G + 1)(cache)
        else:
            # Per-row draft lengths (n-gram lookup): feed only as many drafts as the longest row
            # proposed, so rounds without a match cost one decode step, not a γ + 1 verify. One
            # branch per length, all with static shapes; the choice is made on the device.
            proposed = jnp.where(state.done, 0, jnp.sum(valid, axis=1, dtype=jnp.int32))
            verdict, cache = jax.lax.switch(
                jnp.max(proposed), [lambda c, T=T: verify_chain(T)(c)[:2]
                                    for T in range(1, G + 2)], cache)
    else:  # every node at once: position = length + depth, each node sees its ancestors
        positions = state.length[:, None] + jnp.asarray(tree.depths)[None, :]
        logits, hidden, cache = model_lib.forward(target, chunk, positions, cache,
                                                  chunk_mask=jnp.asarray(tree.ancestors))
        target_probs = sampling_lib.process_logits(logits, request.sampling, plan.filters)
        verdict = verify.tree_sample(verify_keys, tree, draft_tokens, target_probs, valid)
        cache = kv.compact(cache, state.length, verdict.path, verdict.num_accepted)
        if hasattr(plan.proposer, "commit"):
            draft_state = plan.proposer.commit(draft_state, state.length, verdict.path,
                                               verdict.num_accepted)
        # The hidden states along the accepted path, root first (entries past it are stale).
        nodes = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), verdict.path], axis=1)
        hidden = jnp.take_along_axis(hidden, nodes[:, :, None], axis=1)  # [B, D+1, E]
    if _rides(plan):
        draft_state = plan.proposer.observe(draft_state, state.length, hidden)
    num_proposed = (jnp.full((B,), G, jnp.int32) if valid is None
                    else jnp.sum(valid, axis=1, dtype=jnp.int32))

    n_emit, hit_eos, history = _emit(state, verdict.tokens, verdict.num_accepted, request)
    length = state.length + n_emit
    num_generated = state.num_generated + n_emit
    return LoopState(
        history=history, length=length, num_generated=num_generated,
        done=state.done | hit_eos | (num_generated >= request.max_new_tokens),
        cache=cache.rollback(length), draft_state=draft_state,
        counters=state.counters.update(~state.done, verdict.num_accepted, num_proposed),
        step=state.step + 1)


def _decode(plan: Plan, target_params, draft_params, request: Request,
            state: LoopState) -> LoopState:
    """Rounds until every row is done; no host sync inside."""
    body = lambda s: _round(plan, target_params, draft_params, request, s)  # noqa: E731
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)


_prefill_jit = jax.jit(_prefill, static_argnums=0)
_decode_jit = jax.jit(_decode, static_argnums=0, donate_argnums=4)
_EXECUTABLES: collections.OrderedDict = collections.OrderedDict()
_MAX_EXECUTABLES = 64  # least recently used programs beyond this are dropped
_compile_count = 0


def compiled_programs() -> int:
    """How many programs ``generate`` has compiled in this process (for tests and tuning)."""
    return _compile_count


def _run(fn, plan: Plan, *args) -> tuple[Any, float]:
    """Call fn(plan, *args) through an ahead-of-time compiled executable cached by plan and the
    arguments' shapes, dtypes and shardings, so timings never include compilation.
    Returns (result, compile seconds)."""
    global _compile_count
    leaves, treedef = jax.tree_util.tree_flatten(args)
    sig = (fn, plan, treedef,
           tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
    exe, spent = _EXECUTABLES.get(sig), 0.0
    if exe is None:
        t0 = time.perf_counter()
        exe = fn.lower(plan, *args).compile()
        spent = time.perf_counter() - t0
        _compile_count += 1
        _EXECUTABLES[sig] = exe
        if len(_EXECUTABLES) > _MAX_EXECUTABLES:
            _EXECUTABLES.popitem(last=False)
        log.info("compiled %s for %s in %.1fs", fn.__name__, plan, spent)
    else:
        _EXECUTABLES.move_to_end(sig)
    return exe(*args), spent


def bucket(n: int, minimum: int = 16) -> int:
    """Round a size up to the next of minimum, then 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, ...
    (each step x1.5 or x4/3, so at most 50% padding)."""
    size = 1
    while size < max(n, minimum):
        size = size * 2 if size < 2 else (size * 3 // 2 if size & (size - 1) == 0
                                           else size * 4 // 3)
    return size


def _prompt_rows(prompts, vocab_size: int) -> list[np.ndarray]:
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    rows = []
    for b, row in enumerate(prompts):
        if isinstance(row, (str, bytes)):
            raise ValueError(f"prompt {b} is a string; pass token ids, or a tokenizer= to "
                             f"encode text")
        arr = np.asarray(row)
        if arr.ndim != 1:
            raise ValueError(f"prompt {b} must be a flat list of token ids, got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError(f"prompt {b} is empty: every prompt needs at least one token")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompt {b} must hold integer token ids, got dtype {arr.dtype}")
        bad = arr[(arr < 0) | (arr >= vocab_size)]
        if bad.size:
            raise ValueError(f"prompt {b} has token id {int(bad[0])} outside [0, {vocab_size})")
        rows.append(arr.astype(np.int32))
    return rows


def _as_key(key) -> Array:
    """One PRNG key from None (seed 0), an int seed, a typed key or a legacy uint32 [2] key."""
    if key is None:
        return jax.random.key(0)
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        return jax.random.key(int(key))
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
        return jax.random.key(int(key))
    raise ValueError(f"key must be a jax.random.key, an int seed or None, got {key!r}")


def _drafter_proposer(spec: SpecConfig, drafter, cfg):
    """The Medusa / EAGLE proposer for a drafter, after checking it fits the target and spec."""
    if not isinstance(drafter, Drafter):
        raise ValueError(f"method {spec.method!r} needs draft= an sj.Drafter (sj.load_drafter("
                         f"path, target)), got {type(drafter).__name__}")
    c = drafter.config
    if c.method != spec.method:
        raise ValueError(f"method {spec.method!r} but the drafter is a {c.method!r} drafter")
    if (c.hidden_size, c.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
        raise ValueError(f"the drafter was built for hidden_size={c.hidden_size}, vocab_size="
                         f"{c.vocab_size}; the target has {cfg.hidden_size}, {cfg.vocab_size}")
    tree = None if spec.tree is None else Tree(spec.tree)
    depth = spec.num_speculative_tokens if tree is None else tree.depth
    if c.max_depth is not None and depth > c.max_depth:
        raise ValueError(f"the Medusa drafter has {c.num_heads} heads, so it drafts at most "
                         f"{c.num_heads} tokens deep; got "
                         + (f"num_speculative_tokens={depth}" if tree is None
                            else f"a tree of depth {depth}"))
    if tree is not None and int(tree.children.shape[1]) > c.draft_vocab_size:
        raise ValueError(f"the tree has {int(tree.children.shape[1])} children per node, more "
                         f"than the drafter's {c.draft_vocab_size}-token draft vocabulary")
    cls = MedusaProposer if c.method == "medusa" else EagleProposer
    return cls(c, spec.num_speculative_tokens, tree)


def _check_model(name: str, model) -> None:
    if not isinstance(model, Model):
        raise ValueError(f"{name} must be an sj.Model (from sj.init_model or sj.load_model), "
                         f"got {type(model).__name__}")


def _on_mesh(x, mesh):
    """Host data -> a global array split over "data" (every process passes the whole batch)."""
    x = np.asarray(x)
    s = sharding.rows(mesh, x.ndim)
    return jax.make_array_from_callback(x.shape, s, lambda index: x[index])


def _fetch(x) -> np.ndarray:
    """A (possibly multi-process) array -> numpy on this host, whole."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def generate(target: Model, prompts: Sequence[Sequence[int]], *,
             sampling: SamplingParams | None = None,
             spec: SpecConfig | dict | str | None = None,
             draft: Model | None = None,
             key: Array | int | None = None,
             tokenizer=None, return_text: bool = False, mesh=None) -> Generation:
    """Generate from ``target`` for a batch of prompts, speculatively when ``spec`` is given.

    prompts: B lists of token ids, any lengths (>= 1). sampling: SamplingParams (default:
    temperature 1, 64 new tokens). spec: SpecConfig, a dict or JSON string in vLLM's style, or None
    for plain autoregressive decoding. draft: the draft model for method "draft_model" (same
    vocabulary as the target). key: a PRNG key (or an int seed); each row draws from its own key
    folded from it, so the same key gives the same output and rows do not depend on each other.

    The output distribution equals autoregressive sampling from the target with the same
    SamplingParams; with temperature 0 the tokens equal autoregressive greedy decoding.

    mesh: a ("data", "model") mesh from ``sj.make_mesh`` runs the whole loop sharded: the target
    tensor-parallel over "model" (placed by the table in specjax/sharding.py unless it already
    is), the draft replicated, rows split over "data" (the batch is padded to a multiple of the
    "data" size; padding rows are dropped from the result). In a multi-process run
    (``jax.distributed``) every process makes the same call with the same prompts and gets the
    whole result.
    """
    sampling = SamplingParams() if sampling is None else sampling
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    spec = SpecConfig.parse(spec)
    _check_model("target", target)
    cfg = target.config
    if tokenizer is not None:
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the "
                             f"target's vocab_size {cfg.vocab_size}")
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        if sampling.eos_token_id is None and tokenizer.eos_token_ids:
            sampling = dataclasses.replace(sampling, eos_token_id=tokenizer.eos_token_ids)
    elif return_text:
        raise ValueError("return_text=True needs tokenizer=")
    rows = _prompt_rows(prompts, cfg.vocab_size)
    lengths = np.array([len(r) for r in rows], np.int32)
    B, longest, max_new = len(rows), int(lengths.max()), sampling.max_new_tokens

    def check_context(name, config):
        if longest + max_new > config.max_position_embeddings:
            raise ValueError(
                f"prompt {int(lengths.argmax())} has {longest} tokens; with max_new_tokens="
                f"{max_new} that is {longest + max_new} positions, beyond the {name}'s "
                f"max_position_embeddings={config.max_position_embeddings}")
    check_context("target", cfg)
    for eos in sampling.eos_ids:
        if eos >= cfg.vocab_size:
            raise ValueError(f"eos_token_id {eos} is outside [0, {cfg.vocab_size})")

    proposer = None
    if spec is None:
        if draft is not None:
            raise ValueError("a draft model was given but spec is None; pass spec=SpecConfig(...) "
                             "to speculate, or drop draft=")
    elif spec.needs_draft_model:
        if draft is None:
            raise ValueError(f"method {spec.method!r} needs a draft model: pass draft=")
        _check_model("draft", draft)
        check_context("draft", draft.config)
        if draft.config.vocab_size != cfg.vocab_size:
            raise ValueError(
                f"draft vocab_size {draft.config.vocab_size} != target vocab_size "
                f"{cfg.vocab_size}: draft and target must share one vocabulary")
        if spec.tree is None:
            proposer = DraftModelProposer(draft.config, spec.num_speculative_tokens)
        else:
            tree, M = Tree(spec.tree), draft_vocab_size(draft)
            if int(tree.children.shape[1]) > M:
                raise ValueError(f"the tree gives a node {int(tree.children.shape[1])} children, "
                                 f"more than the draft's {M}-token draft vocabulary")
            proposer = DraftTreeProposer(draft.config, tree)
    elif spec.needs_drafter:
        proposer = _drafter_proposer(spec, draft, cfg)
    else:
        if draft is not None:
            raise ValueError(f"method {spec.method!r} uses no draft model; drop draft=")
        proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                 spec.prompt_lookup_max, spec.prompt_lookup_length_factor)
    gamma = 0 if proposer is None else proposer.gamma
    if spec is not None and spec.tree is not None:
        for name, c in [("target", cfg),
                        ("draft", draft.config if isinstance(draft, Model) else None)]:
            if c is not None and c.sliding_window is not None:
                raise ValueError(f"tree drafts are not supported with sliding-window attention "
                                 f"(the {name} has sliding_window={c.sliding_window}); use a "
                                 f"chain (tree=None)")

    P = bucket(longest)
    # Never a write past S (dynamic_update_slice would clamp and overwrite silently): a row's last
    # round writes γ + 1 cache slots from prompt + max_new - 1 and history slots one further on.
    capacity = bucket(max(P, longest + max_new + gamma + 1))
    # Batch sizes are bucketed too; padding rows start done (max_new_tokens 1) and are dropped.
    B_pad = bucket(B, minimum=1)
    if mesh is not None:
        sharding._check_mesh(mesh)
        data = mesh.shape[sharding.DATA]
        B_pad = -(-B_pad // data) * data  # every "data" shard gets the same number of rows
        target = sharding.shard(target, mesh)
        if isinstance(draft, Model):
            draft = sharding.shard(draft, mesh, replicate=True)
        elif draft is not None:  # a drafter's heads: small, a full copy per device
            draft = Drafter(draft.config, jax.device_put(
                draft.params, NamedSharding(mesh, PartitionSpec())))
    top_k_on = 0 < sampling.top_k < cfg.vocab_size
    plan = Plan(cfg, proposer, capacity,
                Filters(top_k=min(bucket(sampling.top_k), cfg.vocab_size) if top_k_on else 0,
                        top_p=sampling.top_p < 1.0, greedy=sampling.temperature == 0), mesh)

    padded = np.zeros((B_pad, P), np.int32)
    for b, r in enumerate(rows):
        padded[b, :len(r)] = r
    lengths_pad = np.ones((B_pad,), np.int32)
    lengths_pad[:B] = lengths
    max_new_pad = np.ones((B_pad,), np.int32)
    max_new_pad[:B] = max_new
    eos = np.full((MAX_EOS_IDS,), -1, np.int32)
    eos[:len(sampling.eos_ids)] = sampling.eos_ids
    root = _as_key(key)
    request = Request(
        keys=jax.vmap(jax.random.fold_in, (None, 0))(root, jnp.arange(B_pad)),
        sampling=SamplingArrays(
            temperature=jnp.full((B_pad,), sampling.temperature, jnp.float32),
            top_k=jnp.full((B_pad,), sampling.top_k, jnp.int32),
            top_p=jnp.full((B_pad,), sampling.top_p, jnp.float32)),
        max_new_tokens=jnp.asarray(max_new_pad), eos=jnp.asarray(eos))
    draft_params = None if draft is None else draft.params
    prompts_dev, lengths_dev = jnp.asarray(padded), jnp.asarray(lengths_pad)
    if mesh is not None:  # global arrays, rows over "data" (built the same in every process)
        put = functools.partial(_on_mesh, mesh=mesh)
        keys = jax.jit(jax.random.wrap_key_data, out_shardings=sharding.rows(mesh, 1))(
            put(np.asarray(jax.random.key_data(request.keys))))
        eos_all = NamedSharding(mesh, PartitionSpec())
        request = Request(
            keys=keys,
            sampling=jax.tree.map(lambda x: put(np.asarray(x)), request.sampling),
            max_new_tokens=put(max_new_pad),
            eos=jax.make_array_from_callback(eos.shape, eos_all, lambda index: eos[index]))
        prompts_dev, lengths_dev = put(padded), put(lengths_pad)

    compile_seconds = 0.0
    t0 = time.perf_counter()
    state, spent = _run(_prefill_jit, plan, target.params, draft_params, prompts_dev, lengths_dev,
                        request)
    state = jax.block_until_ready(state)
    compile_seconds += spent
    prefill_seconds = time.perf_counter() - t0 - spent
    t0 = time.perf_counter()
    state, spent = _run(_decode_jit, plan, target.params, draft_params, request, state)
    state = jax.block_until_ready(state)
    compile_seconds += spent
    decode_seconds = time.perf_counter() - t0 - spent

    history, generated = _fetch(state.history), _fetch(state.num_generated)
    generated = generated[:B]
    tokens = np.full((B, max_new), -1, np.int32)
    for b in range(B):
        n = int(generated[b])
        tokens[b, :n] = history[b, lengths[b]:lengths[b] + n]
    stats = Stats.summarise(
        jax.tree.map(_fetch, state.counters), gamma=plan.depth,
        draft_calls_per_round=1 if isinstance(proposer, MedusaProposer) else plan.depth,
        has_draft_model=isinstance(proposer, (DraftModelProposer, DraftTreeProposer,
                                              EagleProposer, MedusaProposer)),
        generated_tokens=int(generated.sum()), batch=B,
        prefill_seconds=prefill_seconds, decode_seconds=decode_seconds,
        compile_seconds=compile_seconds)
    text = None
    if return_text:
        text = [tokenizer.decode(tokens[b, :generated[b]]) for b in range(B)]
    return Generation(tokens=tokens, lengths=np.asarray(generated, np.int32), stats=stats,
                      text=text)
