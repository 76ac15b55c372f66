"""``specjax bench``: speculative against autoregressive decoding on a fixed held-out prompt set.

Every figure comes from one run, variants interleaved (each repeat runs the autoregressive
baseline and every variant in turn), so drift on a noisy machine hits them
alike; throughputs are medians over repeats. Prompts run one at a time by default (batch 1, the
latency case speculation is for; ``batch_size`` runs them B to a call, cycled to whole batches),
each call with its own seed; compilation happens in a warm-up pass and is never timed.

Figures per (temperature, γ):

* tokens/s: decode tokens (after the first) over decode seconds, all prompts; AR beside spec
* speed-up: spec tokens/s / AR tokens/s
* TTFT: prefill plus the first token, mean over prompts; TPOT: decode seconds per decode token
  of a row (at batch B, of each call's mean row: the wait a user sees, not 1 / throughput)
* acceptance rate (accepted / proposed drafts, vLLM's figure), α (a draft's chance to pass given
  that the drafts before it passed: accepted / (accepted + rejected), the α of the speed-up
  formula in specjax/theory.py), mean accepted length (tokens per round, bonus included),
  per-position acceptance (fraction of rounds whose k-th draft was accepted); at batch B each
  per row-round (``Stats.row_rounds``)
* c: the proposer's time per draft in target steps: its ``propose`` alone (a draft model's
  forwards and draws, a head's, an n-gram lookup), timed apart from the round
  (``timing.round_timers``) over γ target decode steps (adaptive chains: over the drafts a row
  proposed a round on average); at batch B every part runs at the rows generate runs (B padded
  to its batch bucket)
* verify: the target's forward over the γ + 1 tokens a round verifies (a tree: its nodes), in
  target decode steps
* round/parts: one whole round of generate's own program (propose, verify forward, sampling,
  verification, bookkeeping) over the sum of its two parts, propose and verify forward: what
  the round costs beyond its parts (1 = nothing)
* ``draft_cost_per_draft`` (JSON): the c that, with the measured verify cost, makes the formula's
  denominator (γc + v) what the generate loop measured: a round's time over the autoregressive
  loop's round (both at the run's batch size), less v, per draft a row proposes in a round (the
  drafter plus what the speculative loop spends beyond the autoregressive one)
* ``--synthetic-acceptance A``: benchmark only, not lossless: each chain accepts draft position i
  with probability A (or the i-th of several A's) whatever the drafts, so random weights, or a
  device without trained models, run rounds of a known length; such rows are labelled
  "synthetic" and "NOT LOSSLESS" and never compared with autoregressive output
* several methods can run in one bench (``--method draft_model,medusa,eagle``): one AR baseline,
  every variant interleaved with it
* predicted: the formula ``(1 - α^(γ+1)) / ((1 - α)(γc + 1))`` (specjax/theory.py) from the
  measured α and c; it assumes verifying γ + 1 tokens costs one target step (the target's
  one-token forward, timed in the same temperature's repeats as the row). ``pred·v`` puts the
  measured verify cost in the denominator (γc + v); for a tree, whose acceptance the formula
  does not model, its numerator is the measured mean accepted length. For a chain whose rounds
  propose fewer than γ drafts (n-gram, suffix), both parts follow the lengths it proposed: the
  formula's tokens for each length k, and the verify cost of the width its loop verifies k
  drafts over (``engine.loop_widths``, each timed), weighed by how often each came (at batch B
  a round verifies at its widest row's width: taken as the widest of B independent rows).
* meas/pred: the measured speed-up over ``pred·v`` (static γ only). Below 1 by what a round
  costs beyond its parts (round/parts) and by what the speculative loop spends beside its
  forwards beyond what the autoregressive loop does; for a chain also off by how far the
  formula's independent-acceptance model (one α for every position) is from the acceptance
  measured, which can put it on either side of 1.
* ``--roofline``: the weight bytes a target step reads (every parameter but an untied input
  embedding, of which a step reads one row) over the AR step, against what one jitted sum over
  512 MiB reads per second on this machine: the fraction of that bandwidth a step reaches; and
  ``sj.roofline``'s report: the target's forward over 1 to 16 tokens at each of
  ``--roofline-batches`` (default 1), in one-token steps, with its bytes and FLOPs against the
  measured bandwidth and peak, and the knee where verifying stops being nearly free.
* ``--target-shape NAME``: no checkpoint: a random-weight target in the shape of a common model
  (``sj.shapes``: llama-3.2-1b, llama-3.1-8b, qwen3-0.6b, qwen3-4b, tiny), a one-layer draft
  and fresh EAGLE / Medusa heads for it, in the backend's dtype (float32 on CPU, bfloat16 on
  GPU and TPU; ``--dtype`` overrides), random prompts of ``--max-prompt-tokens`` (64) tokens.
  Random weights accept nothing, so its chains use synthetic acceptance (``--synthetic-
  acceptance``, 0.8 unless given): benchmark only, not lossless.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import jax
import numpy as np

from . import adaptive, engine, theory
from . import roofline as roofline_lib
from . import stats as stats_lib
from .bundle import bundled
from .config import SamplingParams, SpecConfig
from .draft import registry
from .draft.base import lookahead_width
from .draft.draft_model import as_draft_model
from .draft.suffix import SuffixCache
from .engine import cache_capacity, generate, slots_needed
from .model import Model
from .timing import forward_timer, memory_bandwidth, round_timers, step_weight_bytes
from .tree import Tree

PROMPTS = pathlib.Path(__file__).parent / "data" / "bench_prompts.json"
PROMPT_SETS = {"short": PROMPTS, "long": PROMPTS.parent / "long_prompts.json"}
"""The shipped held-out prompt sets: "short" (15 lines ending with a function definition,
71-158 tokens) and "long" (300-900 tokens, experiments/make_long_prompts.py)."""


def load_prompts(path: str | os.PathLike | None = None) -> list[dict]:
    """The bench prompts: a JSON file {"prompts": [{"source", "text"}, ...]}, or the name of a
    shipped set (``PROMPT_SETS``; default "short")."""
    path = PROMPT_SETS.get(path, path) if isinstance(path, str) else path
    path = pathlib.Path(path) if path is not None else PROMPTS
    try:
        prompts = json.loads(path.read_text())["prompts"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read bench prompts from {path}: {e}") from e
    if not prompts or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                              and p["text"] for p in prompts):
        raise ValueError(f"{path} must hold a non-empty list of prompts with non-empty 'text'")
    return prompts


# -- the bench ----------------------------------------------------------------------------------

@dataclasses.dataclass
class _Runs:
    """One variant's generations over the prompt set, per repeat."""
    outputs: list = dataclasses.field(default_factory=list)  # last repeat's Generation per prompt
    tokens_per_second: list = dataclasses.field(default_factory=list)  # per repeat
    ttft: list = dataclasses.field(default_factory=list)
    tpot: list = dataclasses.field(default_factory=list)  # per repeat, a row's (below)
    round_seconds: list = dataclasses.field(default_factory=list)  # decode seconds per round
    # per generate call, every prompt group of every repeat: TTFT and TPOT (decode seconds per
    # token after the first, for the call's mean row), for percentiles
    call_ttft: list = dataclasses.field(default_factory=list)
    call_tpot: list = dataclasses.field(default_factory=list)

    def add(self, outs) -> None:
        for o in outs:
            self.call_ttft.append(o.stats.prefill_seconds)
            self.call_tpot.append(o.stats.decode_seconds / max(float(np.mean(o.lengths - 1)), 1))
        decode_tokens = sum(int(o.lengths.sum()) - len(o.lengths) for o in outs)
        decode_seconds = sum(o.stats.decode_seconds for o in outs)
        self.outputs = outs
        self.tokens_per_second.append(decode_tokens / decode_seconds)
        # TPOT as a user waits for it: decode seconds per token of a row (the calls' mean rows;
        # at batch B not decode seconds per token of all B rows, which is 1 / throughput)
        row_tokens = sum(max(float(np.mean(o.lengths - 1)), 1) for o in outs)
        self.tpot.append(decode_seconds / row_tokens)
        self.round_seconds.append(decode_seconds / max(1, sum(o.stats.num_rounds for o in outs)))
        self.ttft.append(statistics.mean(o.stats.prefill_seconds for o in outs))

    def median(self, name: str) -> float:
        return statistics.median(getattr(self, name))

    def latency(self) -> dict:
        """TTFT and TPOT in ms at the 50th, 95th and 99th percentiles over every call."""
        return {name: {f"p{q}": float(1e3 * np.percentile(values, q)) for q in PERCENTILES}
                for name, values in (("ttft_ms", self.call_ttft), ("tpot_ms", self.call_tpot))}


PERCENTILES = (50, 95, 99)


def _memory(target: Model, draft, out) -> dict:
    """Device memory of one generate call: the target's and the drafter's weights, the caches
    of the call's rows (target and draft KV and the proposer's state), the decode program's
    own buffers (XLA's memory analysis), and the device's peak where the backend reports it
    (GPU, TPU; None on CPU)."""
    def nbytes(tree):
        return int(sum(x.nbytes for x in jax.tree.leaves(tree))) if tree is not None else 0
    draft_params = getattr(draft, "params", draft)
    decode = engine.PROGRAMS.programs()[-1].executables("decode")
    analysis = decode[-1].memory_analysis() if decode else None
    stats = jax.local_devices()[0].memory_stats() or {}
    return {"target_bytes": nbytes(target.params), "draft_bytes": nbytes(draft_params),
            "cache_bytes": out.stats.cache_bytes_per_row * len(out.lengths),
            "program_temp_bytes": getattr(analysis, "temp_size_in_bytes", None),
            "device_peak_bytes": stats.get("peak_bytes_in_use")}


def _pooled(outs) -> dict:
    """Acceptance figures over all prompts' calls: each call's per-row-round rates weighted by
    its row-rounds (rounds summed over the rows running in them), so the pooled rates are
    counts over counts, not an average of averages, at any batch size."""
    rounds = sum(o.stats.num_rounds for o in outs)  # loop rounds
    row_rounds = sum(o.stats.row_rounds for o in outs)
    proposed = sum(o.stats.proposed_tokens for o in outs)
    accepted = sum(o.stats.accepted_tokens for o in outs)

    def total(name):  # a per-row-round rate back to its count (calls without rounds: none)
        return sum(np.asarray(getattr(o.stats, name), np.float64) * o.stats.row_rounds
                   for o in outs if o.stats.row_rounds)
    emitted = total("mean_accepted_length")
    per_position = total("per_position_acceptance")
    lengths = total("accepted_length_distribution")
    proposed_lengths = total("proposed_length_distribution")
    # α as the formula means it: the chance that a draft passes given that every draft before it
    # in the round passed: accepted drafts against accepted ones plus the rejections (at most one
    # a round; a round that proposed fewer than γ and accepted them all rejected none).
    alpha = stats_lib.alpha_of(accepted, sum(o.stats.rejecting_rounds for o in outs))
    # the adaptive rows' predictions against their verdicts (Stats.reliability), bins pooled
    # back into Stats' [BINS, 3] counters (a bin's mean prediction lies inside it)
    bins = np.zeros((stats_lib.BINS, 3))
    for o in outs:
        for p, a, n in o.stats.reliability:
            bins[min(int(p * stats_lib.BINS), stats_lib.BINS - 1)] += (n, p * n, a * n)
    pooled = stats_lib.calibration_summary(bins)
    by_position = np.zeros((len(stats_lib.POSITION_EDGES) + 1, 2))  # row-rounds, emitted
    edges = (0,) + stats_lib.POSITION_EDGES
    for o in outs:
        for lo, _, mean, n in o.stats.accepted_length_by_position:
            by_position[edges.index(lo)] += (n, mean * n)
    calibration = dict(calibration_error=pooled.get("calibration_error", float("nan")),
                       reliability=[list(b) for b in pooled.get("reliability", ())])
    return dict(acceptance_rate=accepted / proposed if proposed else float("nan"), alpha=alpha,
                **calibration,
                accepted_length_distribution=[float(x) for x in lengths / row_rounds],
                proposed_length_distribution=[float(x) for x in proposed_lengths / row_rounds],
                mean_accepted_length=float(emitted / row_rounds),
                per_position_acceptance=[float(x) for x in per_position / row_rounds],
                # [first position, end (None: open), mean accepted length, row-rounds] per bin
                # of the context position the rounds started at
                accepted_length_by_position=[
                    list(b) for b in stats_lib.position_summary(by_position)],
                proposal_rate=float(total("proposal_rate") / row_rounds),
                rounds=rounds, row_rounds=row_rounds, proposed_tokens=proposed,
                accepted_tokens=accepted,
                mean_proposed=proposed / row_rounds,  # drafts a row proposes in a round
                rested_rounds=sum(o.stats.rested_rounds for o in outs))  # of the rounds


def _varied_round(alpha: float, proposed: list[float], batch: int,
                  width_costs: dict[int, float]) -> tuple[float, float]:
    """A round of a chain with per-row lengths, as the formula sees it: the tokens a row-round
    yields, E over the proposed lengths k (``proposed``, [γ + 1] fractions of row-rounds) of
    (1 - α^(k+1)) / (1 - α), and the verify forward's expected cost in target steps
    (``width_costs``: the cost of each of ``engine.loop_widths(γ)``), at the narrowest width
    that holds the round's widest row: at batch B, the widest of B independent draws."""
    p = np.asarray(proposed, np.float64)
    p = p / p.sum()
    tokens = sum(pk * theory.expected_tokens_per_round(alpha, k) for k, pk in enumerate(p))
    widest = np.diff(np.concatenate([[0.0], np.cumsum(p) ** batch]))  # P(max of B = k)
    widths = np.asarray(sorted(width_costs))
    verify = sum(wk * width_costs[int(widths[np.searchsorted(widths, k + 1)])]
                 for k, wk in enumerate(widest))
    return float(tokens), float(verify)


def parted_at_near_tie(target: Model, prompt: list[int], a, b) -> bool:
    """Whether two greedy continuations a, b of ``prompt`` (token arrays, -1 padded) first part
    at a near tie (``sampling.near_ties``) of the target's logits after their common prefix,
    computed by one full forward: where rounding, not a lost guarantee, can explain it. False
    when they do not part."""
    from .model import logits as full_logits
    from .sampling import near_ties
    a, b = [int(x) for x in a if x >= 0], [int(x) for x in b if x >= 0]
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None:
        return False
    last = full_logits(target, [list(prompt) + a[:k]])[0, -1]
    return bool(near_ties(last, target.config.dtype))


def chain_specs(method: str, gammas, **options) -> list[SpecConfig]:
    """Chains of each γ; options are further SpecConfig fields (the lookup settings of ngram)."""
    if not gammas or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in gammas):
        raise ValueError(f"gammas must be ints >= 1, got {list(gammas)!r}")
    return [SpecConfig(method=method, num_speculative_tokens=g, **options) for g in gammas]


def _lookahead(spec: SpecConfig):
    """The proposer of a lookahead spec (its tree and window), else None."""
    return registry.get("lookahead").build(spec, None, None) if spec.method == "lookahead" \
        else None


def forward_width(spec: SpecConfig) -> int:
    """Positions a round's verify forward runs: γ + 1, and a lookahead window's guesses."""
    proposer = _lookahead(spec)
    if proposer is None:
        return spec.num_speculative_tokens + 1
    return proposer.gamma + 1 + lookahead_width(proposer)


def lookup_options(args, method: str | None = None) -> dict:
    """SpecConfig's n-gram lookup fields from the command line's --prompt-lookup-* flags, and
    lookahead decoding's from --lookahead-window and --lookahead-candidates; with ``method``,
    that method's alone (SpecConfig refuses another method's options)."""
    options = dict(prompt_lookup_min=args.prompt_lookup_min,
                   prompt_lookup_max=args.prompt_lookup_max,
                   prompt_lookup_length_factor=args.prompt_lookup_length_factor)
    if method not in (None, "ngram"):
        options = {}
    for name in ("lookahead_window", "lookahead_candidates"):
        if method not in (None, "lookahead"):
            break
        if getattr(args, name, None) is not None:
            options[name] = getattr(args, name)
    return options


def _lookup(spec: SpecConfig) -> dict | None:
    if spec.method != "ngram":
        return None
    return dict(min=spec.prompt_lookup_min, max=spec.prompt_lookup_max,
                length_factor=spec.prompt_lookup_length_factor)


def _label(spec: SpecConfig) -> str:
    if spec.synthetic_acceptance is not None:
        alphas = sorted(set(spec.synthetic_acceptance))
        profile = f"{alphas[0]:g}" if len(alphas) == 1 else "/".join(
            f"{a:g}" for a in spec.synthetic_acceptance)
        return f"chain {spec.num_speculative_tokens} synthetic α={profile}"
    if spec.method == "lookahead":  # W columns, n-grams of N, G candidate chains (or a tree)
        window = f"W{spec.lookahead_window} "
        if spec.tree is None:
            return (f"{window}N{spec.num_speculative_tokens + 1} "
                    f"G{spec.lookahead_candidates}")
        tree = Tree(spec.tree)
        return f"{window}tree {tree.num_nodes - 1}/{tree.depth}"
    if spec.tree is None:
        lookup = _lookup(spec)
        if spec.survival_threshold is not None or spec.verify_costs is not None:
            return (f"chain {spec.num_speculative_tokens}"
                    + ("" if spec.survival_threshold is None
                       else f" adaptive {spec.survival_threshold:g}")
                    + ("" if spec.verify_costs is None else " budget")
                    + (" no rests" if spec.verify_costs is not None and not spec.rests else ""))
        if spec.method == "suffix" and spec.suffix_decoding_own_spec_factor is not None:
            own = spec.suffix_decoding_own_spec_factor
            return f"chain {spec.num_speculative_tokens} own x{own:g}"
        if lookup is None:
            return f"chain {spec.num_speculative_tokens}"
        factor = "" if lookup["length_factor"] is None else f" x{lookup['length_factor']:g}"
        return f"chain {spec.num_speculative_tokens} ({lookup['min']}..{lookup['max']}{factor})"
    tree = Tree(spec.tree)
    return f"tree {tree.num_nodes - 1}/{tree.depth}"  # nodes / depth


@dataclasses.dataclass(frozen=True)
class _Forward:
    """A forward timer's key: the tokens it verifies and the cache capacity it runs in."""
    width: int
    capacity: int


def run_bench(target: Model, prompts: list[list[int]], specs, *, draft: Model | None = None,
              drafters: dict | None = None,
              temperatures=(0.0, 0.8), top_k: int = 0, top_p: float = 1.0,
              max_new_tokens: int = 128, repeats: int = 3, seed: int = 0,
              verify_repeats: int = 20, roofline: bool = False, roofline_batches=(1,),
              batch_size: int = 1, budget: bool = False, without_rests: bool = False,
              log=None) -> dict:
    """Run the bench and return its figures (see the module docstring); ``rows`` has one entry
    per (temperature, spec). specs: SpecConfigs (chains or trees) of any methods; draft: the
    draft model for the methods that draft with one ("draft_model"); drafters: {"medusa": Heads,
    "eagle": Heads} for the methods that draft with heads. batch_size: rows per generate call
    (the prompts cycled to fill whole batches). budget: each adaptive chain (one with
    survival_threshold) also runs with the verify budget, its costs measured here at this batch
    size (``adaptive.measure_costs``); ``without_rests``: each such draft-model variant also
    with ``idle_rounds=0``."""
    specs = [SpecConfig.parse(s) for s in specs]
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not specs:
        raise ValueError("specs is empty: give at least one SpecConfig")
    drafts = dict(drafters or {})
    drafts.update({s.method: draft for s in specs if s.needs_draft_model and draft is not None})
    for s in specs:
        if (s.needs_draft_model or s.needs_heads) and s.method not in drafts:
            raise ValueError(f"method {s.method!r} needs a "
                             + ("draft model (draft=)" if s.needs_draft_model
                                else "drafter (drafters={...})"))
    methods = sorted({s.method for s in specs})
    if not temperatures or any(not t >= 0 for t in temperatures):
        raise ValueError(f"temperatures must be >= 0, got {list(temperatures)!r}")
    for name, value in (("repeats", repeats), ("verify_repeats", verify_repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not prompts:
        raise ValueError("prompts is empty")
    log = log or (lambda msg: None)
    use_draft = as_draft_model(draft) if any(s.needs_draft_model for s in specs) else None
    B = batch_size
    # whole batches of prompts, cycled: every prompt at least once
    cycled = [prompts[i % len(prompts)] for i in range(-(-len(prompts) // B) * B)]
    groups = [cycled[i:i + B] for i in range(0, len(cycled), B)]
    costs = None
    if budget:
        adaptive_specs = [s for s in specs if s.survival_threshold is not None]
        if not adaptive_specs:
            raise ValueError("budget=True needs adaptive chains (specs with survival_threshold)")
        costs = adaptive.measure_costs(
            target, use_draft, batch_size=B,
            gamma=max(s.num_speculative_tokens for s in adaptive_specs),
            context=len(sorted(prompts, key=len)[len(prompts) // 2]) + max_new_tokens // 2)
        log(f"verify budget at batch {B}: forward costs {[round(c, 3) for c in costs.verify_costs]}"
            f" steps, a draft in a round {costs.draft_cost:.3f}, a round's fixed part "
            f"{costs.round_cost:.3f}, a round verifying none {costs.cost(0):.3f}")
        specs += [dataclasses.replace(
            s, verify_costs=costs.verify_costs[:s.num_speculative_tokens + 1],
            draft_cost=costs.draft_cost if s.needs_draft_model else 0.0,
            round_cost=costs.round_cost if s.needs_draft_model else 0.0,
            decline_cost=costs.decline_cost if s.needs_draft_model else None,
            idle_rounds=rests) for s in adaptive_specs
            for rests in ((None, 0) if without_rests and s.method == "draft_model" else (None,))]

    # The parts of a round, each timed apart inside one compiled program (timing.py), for the
    # prompt of median length after half the new tokens, in the capacity generate picks for it;
    # their samples are taken inside the same repeats as the generate runs, so a slow phase of
    # the machine hits the parts and the whole alike.
    prompt = sorted(prompts, key=len)[len(prompts) // 2]
    decoded = max_new_tokens // 2
    context = len(prompt) + decoded
    # Each forward in the cache capacity (tier) its own program runs in: autoregressive
    # decoding's step in autoregressive decoding's, a variant's verify in the variant's (a
    # variant that reaches a larger tier walks a longer cache, and the figures say so).
    def capacity_of(gamma: int) -> int:
        return cache_capacity(target.config, gamma,
                              slots_needed(len(prompt), max_new_tokens, gamma))

    # the forwards at the rows generate runs (B padded to its batch bucket), as its rounds are
    rows_run = engine.bucket(B, minimum=1)
    timers = {}

    def time_forward(width: int, capacity: int) -> _Forward:
        key = _Forward(width, capacity)
        if key not in timers:
            timers[key] = forward_timer(target, width, capacity, context, batch=rows_run)
        return key

    step_key = time_forward(1, capacity_of(0))
    verify_keys = [time_forward(forward_width(s), capacity_of(forward_width(s) - 1))
                   for s in specs]
    samples: dict = {}
    round_widths: dict = {}  # (temperature, spec) -> the width its timed round verified at
    inner = -(-verify_repeats // repeats)  # samples of each part per repeat

    def sample_parts(keys, temperature):
        for _ in range(inner):
            for k in keys:
                t = timers[k]()
                samples.setdefault(k, []).append(t)
                if isinstance(k, _Forward):  # a forward: pooled, and this temperature's own
                    samples.setdefault((temperature, "forward", k), []).append(t)

    rows = []
    for temperature in temperatures:
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                  max_new_tokens=max_new_tokens)
        variants = {"ar": (None, None)}
        variants.update({i: (s, drafts.get(s.method)) for i, s in enumerate(specs)})

        filled = {}  # a suffix cache as one pass left it: what the timed round reads

        def run_all(spec, d, sampling=sampling, filled=filled):
            if isinstance(d, SuffixCache):  # each pass starts empty and fills as it goes
                d = filled[id(spec)] = d.fresh()
            return [generate(target, g, sampling=sampling, spec=spec, draft=d, key=seed + i,
                             allow_synthetic=True)  # labelled so in every row it touches
                    for i, g in enumerate(groups)]

        t0 = time.perf_counter()
        memory = {}
        for name, v in variants.items():  # warm-up: compiles every program the timed passes use
            outs = run_all(*v)
            memory[name] = _memory(target, v[1], outs[-1])
        for i, spec in enumerate(specs):
            parts = round_timers(target, prompt, sampling=sampling, spec=spec,
                                 draft=filled.get(id(spec), drafts.get(spec.method)),
                                 decoded=decoded, key=seed,
                                 max_cache_len=verify_keys[i].capacity, allow_synthetic=True,
                                 batch=B)
            timers.update({(temperature, i, k): f for k, f in parts.items()})
            # a chain with per-row lengths (n-gram, suffix; the engine's own decision) verifies
            # each round at one of its loop's widths: its timed round at the one it picked
            # there, and every width's forward for the prediction
            round_widths[(temperature, i)] = parts["round"].width
            if parts["round"].width is not None:
                for n in engine.loop_widths(spec.num_speculative_tokens):
                    time_forward(n, verify_keys[i].capacity)
            # the timers hold executables of their own (an adaptive chain of 8: ~5,400 memory
            # mappings each); past the cache's budget, generate's programs make room, and
            # compile again (untimed) when run
            engine.PROGRAMS.bound()
        log(f"T={temperature}: compiled and warmed up in {time.perf_counter() - t0:.0f} s")
        runs = {name: _Runs() for name in variants}
        for r in range(repeats):
            for name, v in variants.items():
                runs[name].add(run_all(*v))
            sample_parts([k for k in timers if not isinstance(k, tuple) or k[0] == temperature],
                         temperature)
            log(f"T={temperature}: repeat {r + 1}/{repeats} done")
        ar = runs["ar"]
        for i, spec in enumerate(specs):
            sp = runs[i]
            tree = None if spec.tree is None else Tree(spec.tree)
            if spec.method == "lookahead":  # always a tree (G chains by default)
                tree = _lookahead(spec).tree
            row = dict(
                label=_label(spec), method=spec.method, temperature=temperature,
                gamma=spec.num_speculative_tokens,
                depth=spec.num_speculative_tokens if tree is None else tree.depth,
                verify_tokens=forward_width(spec),
                tree=None if tree is None else tree.to_json(), lookup=_lookup(spec),
                synthetic_acceptance=spec.synthetic_acceptance,
                survival_threshold=spec.survival_threshold, verify_costs=spec.verify_costs,
                draft_cost=spec.draft_cost, round_cost=spec.round_cost,
                decline_cost=spec.decline_cost,
                idle_rounds=spec.rests if spec.verify_costs is not None else None, batch_size=B,
                ar_tokens_per_second=ar.median("tokens_per_second"),
                spec_tokens_per_second=sp.median("tokens_per_second"),
                speedup=sp.median("tokens_per_second") / ar.median("tokens_per_second"),
                speedup_per_repeat=[s / a for s, a in zip(sp.tokens_per_second,
                                                          ar.tokens_per_second)],
                ar_ttft_ms=1e3 * ar.median("ttft"), spec_ttft_ms=1e3 * sp.median("ttft"),
                ar_tpot_ms=1e3 * ar.median("tpot"), spec_tpot_ms=1e3 * sp.median("tpot"),
                latency={"ar": ar.latency(), "spec": sp.latency()},
                tpot_samples_ms={"ar": [1e3 * x for x in ar.call_tpot],
                                 "spec": [1e3 * x for x in sp.call_tpot]},
                memory={"ar": memory["ar"], "spec": memory[i]},
                **_pooled(sp.outputs))
            row["spec_round_ms"] = 1e3 * sp.median("round_seconds")  # in the generate loop
            row["ar_round_ms"] = 1e3 * ar.median("round_seconds")
            if temperature == 0 and spec.synthetic_acceptance is None:
                row["identical_to_autoregressive"] = all(
                    np.array_equal(a.tokens, s.tokens) for a, s in zip(ar.outputs, sp.outputs))
                # tokens where rounding could decide (Stats.greedy_near_ties), AR and spec,
                # and whether every text that left the autoregressive one did so at one
                row["greedy_near_ties"] = [sum(o.stats.greedy_near_ties for o in runs.outputs)
                                           for runs in (ar, sp)]
                if not row["identical_to_autoregressive"]:
                    row["parted_at_near_ties"] = all(
                        parted_at_near_tie(target, p, x, y)
                        for g, a, s in zip(groups, ar.outputs, sp.outputs)
                        for p, x, y in zip(g, a.tokens, s.tokens)
                        if not np.array_equal(x, y))
            rows.append(row)
        # This temperature's programs and part timers are done with. Each compiled program
        # holds hundreds of memory mappings (Linux allows 65,530 a process): a bench that kept
        # every temperature's died in LLVM with "Cannot allocate memory".
        for k in [k for k in timers if isinstance(k, tuple) and k[0] == temperature]:
            del timers[k]
        engine.PROGRAMS.clear()
        jax.clear_caches()  # the forward timers still held keep their own executables

    seconds = {k: statistics.median(v) for k, v in samples.items()}
    for k, row in enumerate(rows):  # temperature-major, then specs in order
        i = k % len(specs)
        # The forwards' times sampled in this temperature's own repeats, beside its generate
        # runs and parts: a phase of the machine that hit one temperature's runs hits them too.
        forward = {k[2]: v for k, v in seconds.items()
                   if isinstance(k, tuple) and k[:2] == (row["temperature"], "forward")}
        step = forward[step_key]
        capacity = verify_keys[i].capacity
        row["target_step_ms"] = 1e3 * step
        row["verify_capacity"] = capacity
        row["verify_cost"] = forward[verify_keys[i]] / step
        row["propose_ms"] = 1e3 * seconds[(row["temperature"], i, "propose")]
        row["round_ms"] = 1e3 * seconds[(row["temperature"], i, "round")]
        # c: the proposer's time per draft in target steps, its propose timed alone (a draft
        # model's catch-up forward and draws included; an n-gram lookup's too). Adaptive
        # lengths: per draft proposed on average (the static-γ formula does not apply).
        is_adaptive = (row.get("survival_threshold") is not None
                       or row.get("verify_costs") is not None)
        drafts = row["mean_proposed"] if is_adaptive else row["gamma"]
        row["c"] = row["propose_ms"] / 1e3 / step / drafts if drafts else float("nan")
        # what the round costs over its parts: sampling, verification, bookkeeping, copies
        # (a chain with per-row lengths: its timed round verified at the width its loop picked
        # for that state's drafts, so its parts are that width's forward)
        width = round_widths[(row["temperature"], i)]
        row["round_verify_tokens"] = row["verify_tokens"] if width is None else width
        row["round_over_parts"] = row["round_ms"] / (row["propose_ms"] + 1e3 * forward[
            _Forward(row["round_verify_tokens"], capacity)])
        # What a round spends besides the verify forward, per draft, from the generate loops'
        # own times: in autoregressive rounds (one token a row), so that γ·this + v over the
        # measured tokens a round gives the measured speed-up
        row["draft_cost_per_draft"] = (
            (row["spec_round_ms"] / row["ar_round_ms"] - row["verify_cost"]) / drafts
            if drafts else float("nan"))
        g, alpha, c = row["gamma"], row["alpha"], row["c"]
        chain = row["tree"] is None and not is_adaptive
        ok = np.isfinite(alpha) and chain
        row["predicted_speedup"] = theory.speedup(alpha, g, c) if ok else float("nan")
        # Tokens a round yields: the formula's from α for a chain (i.i.d. acceptance of γ drafts
        # in a row), the measured mean accepted length for a tree (the formula is for chains).
        tokens = (theory.expected_tokens_per_round(alpha, g) if ok
                  else row["mean_accepted_length"] if not chain else float("nan"))
        verify = row["verify_cost"]
        if ok and width is not None:  # per-row lengths: the widths' forwards were timed
            width_costs = {n: forward[_Forward(n, capacity)] / step
                           for n in engine.loop_widths(g)}
            tokens, verify = _varied_round(alpha, row["proposed_length_distribution"],
                                           row["batch_size"], width_costs)
            # [width, cost in target steps] of each width its loop verifies over, and their
            # expected cost per round
            row["verify_cost_by_width"] = [[n, x] for n, x in width_costs.items()]
            row["predicted_verify_cost"] = verify
        row["predicted_speedup_with_verify_cost"] = (
            float("nan") if is_adaptive else tokens / (g * c + verify))
        row["measured_over_predicted"] = row["speedup"] / row["predicted_speedup_with_verify_cost"]
    roof = None
    if roofline:
        weight_bytes = step_weight_bytes(target)
        bytes_per_second = memory_bandwidth()
        roof = dict(weight_bytes=weight_bytes, bandwidth_bytes_per_second=bytes_per_second,
                    step_ms=1e3 * seconds[step_key],
                    fraction=weight_bytes / seconds[step_key] / bytes_per_second,
                    report=roofline_lib.report(target, batches=roofline_batches,
                                               context=context, bandwidth=bytes_per_second,
                                               log=log))
    return dict(
        roofline=roof,
        machine=dict(platform=platform.platform(), processor=platform.processor(),
                     cpu_count=os.cpu_count(), jax=jax.__version__,
                     backend=jax.default_backend(), device=str(jax.devices()[0].device_kind)),
        settings=dict(method=",".join(methods), specs=[f"{s.method} {_label(s)}" for s in specs],
                      temperatures=list(temperatures), top_k=top_k, top_p=top_p,
                      max_new_tokens=max_new_tokens, repeats=repeats, seed=seed,
                      prompts=len(prompts), prompt_tokens=[len(p) for p in prompts],
                      batch_size=B, target_params=target.config.num_params,
                      verify_budget=None if costs is None else dataclasses.asdict(costs),
                      draft_params=use_draft.config.num_params if use_draft is not None else 0,
                      draft_vocab_size=(use_draft.vocab_size if use_draft is not None
                                        else None),
                      target_step_ms=1e3 * seconds[step_key], verify_context=context,
                      parts_prompt_tokens=len(prompt), parts_capacity=step_key.capacity,
                      dtype=target.config.dtype),
        rows=rows)


def format_table(result: dict) -> str:
    s = result["settings"]
    kind = s.get("prompt_kind", "held-out prompts")
    lines = [f"{s['prompts']} {kind}, batch {s.get('batch_size', 1)}, "
             f"{s['max_new_tokens']} new tokens, "
             f"median of {s['repeats']} interleaved repeats; {result['machine']['cpu_count']} "
             f"CPU cores, jax {result['machine']['jax']} on {result['machine']['backend']}",
             ""]
    cover = s.get("draft_vocab_coverage")
    if s.get("draft_tokenizer_level") == "string":
        lines[-1:-1] = ["draft with its own tokenizer, string-level: its text cut into target "
                        "tokens, verified as point masses"]
    if cover:
        lines[-1:-1] = [f"draft with its own tokenizer: {cover['shared_tokens']} tokens shared "
                        f"with the target's, carrying {cover['target_mass']:.3f} of the "
                        f"target's and {cover['draft_mass']:.3f} of the draft's probability on "
                        f"the prompts"]
    width = max([12] + [len(r["label"]) + 1 for r in result["rows"]])
    head = (f"{'method':<12}{'variant':<{width}}{'T':>4} {'AR tok/s':>9}{'spec tok/s':>11}"
            f"{'speed-up':>9}{'TTFT ms':>8}{'TPOT ms AR/spec':>17}{'accept':>7}{'α':>6}{'len':>6}"
            f"{'c':>7}{'verify':>7}{'round/parts':>12}"
            f"{'predicted':>10}{'pred·v':>7}{'meas/pred':>10}  per-position acceptance")
    lines += [head, "-" * len(head)]
    for r in result["rows"]:
        line = (f"{r['method']:<12}{r['label']:<{width}}{r['temperature']:>4g} "
                f"{r['ar_tokens_per_second']:9.1f}{r['spec_tokens_per_second']:11.1f}"
                f"{r['speedup']:8.2f}x{r['spec_ttft_ms']:8.1f}"
                f"{r['ar_tpot_ms']:9.2f}/{r['spec_tpot_ms']:<7.2f}"
                f"{r['acceptance_rate']:7.3f}{r['alpha']:6.3f}{r['mean_accepted_length']:6.2f}{r['c']:7.3f}"
                f"{r['verify_cost']:7.2f}{r['round_over_parts']:12.2f}"
                f"{r['predicted_speedup']:9.2f}x"
                f"{r['predicted_speedup_with_verify_cost']:6.2f}x"
                + (f"{r['measured_over_predicted']:10.2f}"
                   if np.isfinite(r["measured_over_predicted"]) else f"{'':10}") + "  "
                + " ".join(f"{a:.2f}" for a in r["per_position_acceptance"]))
        if r.get("mean_proposed", r["gamma"]) < r["gamma"] and r.get("tree") is None:
            line += f"  ({r['mean_proposed']:.2f} drafts/round"
            if "predicted_verify_cost" in r:
                line += f"; verify {r['predicted_verify_cost']:.2f} a round at its widths"
            line += ")"
        if r.get("rested_rounds"):
            line += f"  ({r['rested_rounds'] / r['rounds']:.0%} of rounds rested)"
        if r.get("reliability"):
            line += f"  (calibration error {r['calibration_error']:.3f})"
        if len(r.get("accepted_length_by_position", ())) > 1:
            line += "  (mean accepted length by context position: " + ", ".join(
                f"{lo}-{'' if hi is None else hi} {m:.2f}"
                for lo, hi, m, _ in r["accepted_length_by_position"]) + ")"
        if r.get("identical_to_autoregressive") is False:
            line += "  OUTPUT DIFFERS FROM AUTOREGRESSIVE"
            if r.get("parted_at_near_ties"):
                line += " (each at a near tie: rounding)"
        if r.get("synthetic_acceptance") is not None:
            line += "  NOT LOSSLESS, benchmark only"
        lines.append(line)
    if all("latency" in r for r in result["rows"]) and result["rows"]:
        lines.append("\nlatency over every call (prompt groups x repeats), ms, "
                     "p50/p95/p99:")
        fmt = lambda d: "/".join(f"{d[f'p{q}']:.2f}" for q in PERCENTILES)  # noqa: E731
        shown = None
        for r in result["rows"]:
            named = [(r["method"] + " " + r["label"], r["latency"]["spec"])]
            if r["temperature"] != shown:  # each temperature's autoregressive baseline first
                named.insert(0, ("autoregressive", r["latency"]["ar"]))
                shown = r["temperature"]
            for name, lat in named:
                lines.append(f"  {name:<{width + 12}} T={r['temperature']:<4g} TTFT "
                             f"{fmt(lat['ttft_ms']):<22} TPOT {fmt(lat['tpot_ms'])}")
    if all("memory" in r for r in result["rows"]) and result["rows"]:
        mib = lambda x: "-" if x is None else f"{x / 2**20:.1f}"  # noqa: E731
        lines.append("\nmemory, MiB: target weights, draft weights, caches (all rows), decode "
                     "program buffers, device peak")
        for r in result["rows"]:
            m, name = r["memory"]["spec"], r["method"] + " " + r["label"]
            keys = ("target_bytes", "draft_bytes", "cache_bytes", "program_temp_bytes",
                    "device_peak_bytes")
            lines.append(f"  {name:<{width + 12}} T={r['temperature']:<4g} "
                         + " ".join(f"{mib(m[k]):>8}" for k in keys))
    roof = result.get("roofline")
    if roof:
        lines.append(f"\nroofline: {roof['weight_bytes'] / 2**20:.1f} MiB of target weights read "
                     f"({s.get('dtype', '?')}) per {roof['step_ms']:.2f} ms step = "
                     f"{roof['weight_bytes'] / roof['step_ms'] / 1e6:.1f} GB/s against "
                     f"{roof['bandwidth_bytes_per_second'] / 1e9:.1f} GB/s measured: "
                     f"{roof['fraction']:.0%} of the roofline")
        if roof.get("report"):
            lines.append("\n" + roofline_lib.format_report(roof["report"]))
    if any("identical_to_autoregressive" in r for r in result["rows"]):
        same = all(r.get("identical_to_autoregressive", True) for r in result["rows"])
        lines.append(f"\ngreedy output identical to autoregressive on every prompt: {same}")
    if any(r.get("synthetic_acceptance") is not None for r in result["rows"]):
        lines.append("\nrows marked synthetic accept each draft position with a fixed probability "
                     "α whatever the drafts are: their output is NOT the target's distribution "
                     "(benchmark only)")
    return "\n".join(lines)


def _tree_json(text: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"--tree is not valid JSON: {text!r} ({e})") from None


def shaped_target(name: str, args) -> tuple[Model, list[list[int]]]:
    """``--target-shape``: a random-weight target in shape ``name`` (sj.shapes) in the backend's
    dtype (or ``--dtype``), and ``--num-prompts`` (4) random prompts of ``--max-prompt-tokens``
    (64) tokens."""
    from . import shapes
    from .checkpoint import compute_dtype
    from .model import init_model
    dtype = compute_dtype(args.dtype, jax.default_backend()) or "bfloat16"
    n = 4 if args.num_prompts is None else args.num_prompts
    length = 64 if args.max_prompt_tokens is None else args.max_prompt_tokens
    if n < 1 or length < 1:
        raise ValueError(f"--num-prompts and --max-prompt-tokens must be >= 1, got {n} and "
                         f"{length}")
    target = init_model(shapes.target_config(name, dtype=dtype), jax.random.key(args.seed))
    rng = np.random.default_rng(args.seed)
    return target, rng.integers(1, target.config.vocab_size, size=(n, length)).tolist()


def shaped_drafters(name: str, target: Model, needs_draft: bool, heads: list[str],
                    depth: int) -> tuple[Model | None, dict]:
    """Random-weight drafters for ``--target-shape``: the shape's one-layer draft model and fresh
    heads (EAGLE, Medusa) over the target, ``depth`` deep."""
    from . import shapes
    from .draft import init_heads
    from .model import init_model
    dtype = target.config.dtype
    draft = (init_model(shapes.draft_config(name, dtype=dtype), jax.random.key(1))
             if needs_draft else None)
    drafters = {m: init_heads(target, m, jax.random.key(2), num_heads=depth, dtype=dtype)
                for m in heads}
    return draft, drafters


def finite_json(value):
    """``value`` with every NaN or infinite float replaced by None, so ``json.dumps`` writes
    standard JSON (``null``: a figure that does not apply to the row) that every parser reads."""
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if np.isfinite(value) else None
    return value


def _check_args(args) -> None:
    """Refuse bad settings by their flag before anything loads, compiles or runs: each
    temperature's sampling settings, every batch size, trees where no method takes them (and
    say which methods get none), and a --json whose folder is missing."""
    if getattr(args, "target_shape", None) is not None:  # random weights of that shape: the
        # model folders and prompt set are not read
        given = [f"--{name.replace('_', '-')}" for name in
                 ("target", "draft", "medusa", "eagle", "dflash", "mtp", "prompts")
                 if getattr(args, name, None) is not None]
        if given:
            raise ValueError(f"--target-shape benches random weights in that shape; "
                             f"{', '.join(given)} would be ignored: drop "
                             f"{'it' if len(given) == 1 else 'them'}")
    for t in args.temperatures:
        try:
            SamplingParams(temperature=t, top_k=args.top_k, top_p=args.top_p,
                           max_new_tokens=args.max_new_tokens)
        except ValueError as e:
            raise ValueError(f"--temperatures/--top-k/--top-p/--max-new-tokens: {e}") from None
    for b in getattr(args, "batch_size", None) or ():
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"--batch-size values must be ints >= 1, got {b!r}")
    if args.tree:
        flat = [m for m in args.method if not registry.get(m).tree]
        if len(flat) == len(args.method):
            raise ValueError(f"--tree is not supported by method {', '.join(map(repr, flat))}")
        if flat:
            print(f"--tree: no tree variants for {', '.join(flat)} (chains only)",
                  file=sys.stderr)
    if args.json and not pathlib.Path(args.json).resolve().parent.is_dir():
        raise ValueError(f"--json {args.json}: the folder {pathlib.Path(args.json).parent} "
                         f"does not exist")
    if args.json and pathlib.Path(args.json).is_dir():
        raise ValueError(f"--json {args.json} is a folder: give the file to write")
    plots_dir = getattr(args, "plots", None)
    if plots_dir and pathlib.Path(plots_dir).exists() and not pathlib.Path(plots_dir).is_dir():
        raise ValueError(f"--plot {plots_dir} is a file: give the folder to write the PNGs to")
    for b in getattr(args, "roofline_batches", None) or ():
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"--roofline-batches values must be ints >= 1, got {b!r}")
    if getattr(args, "suffix_cache", None) is not None and args.suffix_cache < 1:
        raise ValueError(f"--suffix-cache must be a number of tokens >= 16 (leave it out for "
                         f"no cache), got {args.suffix_cache}")


def main(args) -> int:
    """``specjax bench`` (arguments parsed in specjax.cli)."""
    from .checkpoint import load_model
    from .draft import load_heads
    from .draft.draft_model import load_paired_draft
    from .tokenizer import load_tokenizer
    _check_args(args)
    shape = getattr(args, "target_shape", None)
    if shape is not None:
        target, prompts = shaped_target(shape, args)
    else:
        texts = load_prompts(args.prompts)
        if args.num_prompts is not None:
            if args.num_prompts < 1:
                raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
            texts = texts[:args.num_prompts]
        args.target = args.target or str(bundled("code-target"))
        target = load_model(args.target, dtype=args.dtype)
        tok = load_tokenizer(args.target)
        prompts = [tok.encode(p["text"]) for p in texts]
        if args.max_prompt_tokens is not None:
            if args.max_prompt_tokens < 1:
                raise ValueError(f"--max-prompt-tokens must be >= 1, got "
                                 f"{args.max_prompt_tokens}")
            prompts = [p[-args.max_prompt_tokens:] for p in prompts]  # keep the end
    methods = args.method
    kinds = {m: registry.get(m) for m in methods}
    needs_draft = any(k.draft == "model" for k in kinds.values())
    heads = [m for m, k in kinds.items() if k.draft == "heads"]
    synthetic = getattr(args, "synthetic_acceptance", None)
    if shape is not None:
        draft, drafters = shaped_drafters(shape, target, needs_draft, heads,
                                          max(args.gammas or [1]))
        if synthetic is None:
            synthetic = [0.8]
            print("--target-shape: random weights accept nothing; using synthetic acceptance "
                  "0.8 (NOT LOSSLESS, benchmark only)", file=sys.stderr)
    else:
        if needs_draft:
            args.draft = args.draft or str(bundled("code-draft"))
        draft = (load_paired_draft(args.draft, tok, target.config.vocab_size, args.dtype,
                                   full_vocab=args.full_draft_vocab,
                                   level=getattr(args, "draft_tokenizer_level", "token"))
                 if needs_draft else None)
        drafters = {m: load_heads(getattr(args, m, None) or bundled(f"code-{m}"), target)
                    for m in heads}
    if "suffix" in methods and getattr(args, "suffix_cache", None) is not None:
        drafters["suffix"] = SuffixCache(args.suffix_cache)  # the prompts' outputs, in order
    specs = []
    for m in methods:
        lookup = lookup_options(args, m)
        if m in ("ngram", "suffix") and getattr(args, "acceptance_floor", None) is not None:
            lookup["acceptance_floor"] = args.acceptance_floor
        if synthetic is not None and m == "lookahead":
            print("skipping lookahead: synthetic acceptance is for chains, and lookahead "
                  "verifies a tree", file=sys.stderr)
            continue
        if synthetic is not None:
            lookup["synthetic_acceptance"] = synthetic if len(synthetic) > 1 else synthetic[0]
        for spec in chain_specs(m, args.gammas, **lookup) if args.gammas else ():
            limit = getattr(getattr(drafters.get(m), "config", None), "max_depth", None)
            if limit is not None and spec.num_speculative_tokens > limit:
                print(f"skipping {m} chain {spec.num_speculative_tokens}: the drafter drafts at "
                      f"most {limit} deep", file=sys.stderr)
                continue
            own = getattr(args, "suffix_own_spec_factor", None) if m == "suffix" else None
            specs += ([dataclasses.replace(spec, suffix_decoding_own_spec_factor=f) for f in own]
                      if own else [spec])
            thresholds = getattr(args, "survival_threshold", None) or ()
            if thresholds and (not kinds[m].adaptive or synthetic is not None):
                print(f"no adaptive variants for {m}" + (" with synthetic acceptance"
                                                         if kinds[m].adaptive else
                                                         ": the method has no adaptive lengths"),
                      file=sys.stderr)
            elif thresholds:
                specs += [dataclasses.replace(spec, survival_threshold=t) for t in thresholds]
        if kinds[m].tree:
            specs += [SpecConfig(method=m, tree=_tree_json(tree)) for tree in args.tree or ()]
    if not specs:
        raise ValueError("nothing to compare: --gammas gives no γ (or none the drafters can "
                         "draft) and no --tree was given")
    batches = getattr(args, "batch_size", None) or [1]
    budget = getattr(args, "verify_budget", False)
    if budget and not any(s.survival_threshold is not None for s in specs):
        raise ValueError("--verify-budget needs --survival-threshold (adaptive chains)")
    if getattr(args, "without_rests", False) and not budget:
        raise ValueError("--without-rests compares budget variants: give --verify-budget")
    if getattr(args, "plots", None):
        from . import plots
        plots.require()  # before hours of benching
    results = []
    for batch in batches:
        result = run_bench(target, prompts, specs, draft=draft, drafters=drafters,
                           temperatures=args.temperatures, top_k=args.top_k, top_p=args.top_p,
                           max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                           seed=args.seed, verify_repeats=args.verify_repeats,
                           roofline=args.roofline,
                           roofline_batches=getattr(args, "roofline_batches", None) or (1,),
                           batch_size=batch, budget=budget,
                           without_rests=getattr(args, "without_rests", False),
                           log=lambda m: print(m, file=sys.stderr, flush=True))
        if shape is not None:
            result["settings"].update(prompt_kind=f"random prompts of {len(prompts[0])} tokens",
                                      target=f"random weights, {shape} shape",
                                      draft=f"random weights, {shape} one-layer draft"
                                      if draft is not None else None,
                                      drafters={m: f"random weights, {shape}" for m in drafters})
        else:
            chosen = getattr(args, "prompts", None)
            result["settings"].update(
                prompt_kind="held-out prompts" if chosen in (None, "short") else
                "long held-out prompts" if chosen == "long" else f"prompts from {chosen}",
                target=str(args.target), draft=str(args.draft) if draft is not None else None,
                drafters={m: repr(d) if isinstance(d, SuffixCache) else
                          str(getattr(args, m, None) or bundled(f"code-{m}"))
                          for m, d in drafters.items()})
        if getattr(draft, "from_target", None) is not None:  # a draft with its own tokenizer
            from .draft import vocab_coverage
            result["settings"]["draft_vocab_coverage"] = vocab_coverage(target, draft, prompts)
        if getattr(draft, "strings", None) is not None:
            result["settings"]["draft_tokenizer_level"] = "string"
        print(format_table(result), flush=True)
        results.append(result)
    if args.json:  # before the plots: a figure that fails to draw loses no numbers
        out = results[0] if len(results) == 1 else {"runs": results}
        pathlib.Path(args.json).write_text(json.dumps(finite_json(out), indent=1,
                                                      allow_nan=False) + "\n")
        print(f"\nwrote {args.json}")
    if getattr(args, "plots", None):
        from . import plots
        for path in plots.write(results, args.plots):
            print(f"wrote {path}")
    return 0 if all(r.get("identical_to_autoregressive", True)
                    for result in results for r in result["rows"]) else 1
