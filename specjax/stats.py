"""Acceptance counters accumulated on device inside the loop, summarised on the host once."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

BINS = 10  # bins of predicted acceptance for Stats.calibration_error (equal width)
POSITION_EDGES = (256, 512, 1024)
"""Where the context-position bins of ``Stats.accepted_length_by_position`` part: 0-256,
256-512, 512-1024 and beyond (a round counts in the bin of its first verified position)."""


def _count(n: int, noun: str) -> str:
    """'1 token', '2 tokens', '0 tokens'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Counters:
    """Device-side counts; only rows still generating (active) are counted in a round."""

    rounds: Array  # [] int32: loop iterations (target verify calls)
    row_rounds: Array  # [] int32: active rows summed over rounds
    proposed: Array  # [] int32: drafts proposed (a row may propose fewer than γ)
    proposing: Array  # [] int32: active row-rounds that proposed at least one draft
    accepted: Array  # [] int32: accepted drafts
    emitted: Array  # [] int32: sum of num_accepted + 1 (before EOS / max_new_tokens truncation)
    accepted_at: Array  # [G] int32: active row-rounds whose draft at position k was accepted
    accepted_count: Array  # [G+1] int32: active row-rounds that accepted exactly k drafts
    near_ties: Array  # [] int32: emitted greedy tokens chosen at a near tie (sampling.near_ties)
    proposed_count: Array  # [G+1] int32: active row-rounds that proposed exactly k drafts
    rejecting: Array  # [] int32: active row-rounds that rejected one of their drafts
    # [G, BINS, 3] float32, adaptive chains (Draft.predicted): per draft position and bin of
    # predicted acceptance, the verified drafts (reached: every draft before it accepted) and
    # the sums of their predictions and of their outcomes (1 accepted, 0 rejected)
    reliability: Array
    proposed_by_row: Array  # [B] int32: drafts each row proposed while active
    rounds_by_row: Array  # [B] int32: rounds each row was active in
    forwards: Array  # [] int32: draft forwards run, where the proposer reports them (adaptive)
    counted_forwards: Array  # [] bool: whether it did
    # [len(POSITION_EDGES) + 1, 2] int32: per bin of the round's first verified position, the
    # active row-rounds and the tokens they emitted (num_accepted + 1)
    by_position: Array
    rested: Array  # [] int32: rounds run as rests, the draft skipped (engine.Idle)

    @classmethod
    def zeros(cls, gamma: int, batch: int = 1) -> Counters:
        """gamma: the most drafts a round can accept (a tree's depth); batch: rows."""
        z = jnp.zeros((), jnp.int32)
        return cls(z, z, z, z, z, z, jnp.zeros((gamma,), jnp.int32),
                   jnp.zeros((gamma + 1,), jnp.int32), z, jnp.zeros((gamma + 1,), jnp.int32),
                   z, jnp.zeros((gamma, BINS, 3), jnp.float32), jnp.zeros((batch,), jnp.int32),
                   jnp.zeros((batch,), jnp.int32), z, jnp.zeros((), bool),
                   jnp.zeros((len(POSITION_EDGES) + 1, 2), jnp.int32), z)

    def update(self, active: Array, num_accepted: Array, num_proposed: Array,
               near_ties: Array | int = 0, predicted: Array | None = None,
               forwards: Array | None = None, position: Array | None = None) -> Counters:
        """active [B] bool, num_accepted [B] int32, num_proposed [B] int32; near_ties: the
        round's emitted near-tie tokens, all rows; predicted [B, G]: Draft.predicted;
        forwards []: Draft.forwards; position [B]: the round's first verified position (the
        row's length), for ``by_position``."""
        G = self.accepted_at.shape[0]
        n = jnp.where(active, num_accepted, 0)
        proposed = jnp.where(active, num_proposed, 0)
        at = (jnp.arange(G)[None, :] < n[:, None]) & active[:, None]
        lengths = jnp.arange(G + 1)[None, :]
        reliability = self.reliability
        if predicted is not None:
            assert predicted.shape[1] == G, (predicted.shape, G)  # one column per position
            k = jnp.arange(predicted.shape[1])[None, :]
            reached = active[:, None] & (k < proposed[:, None]) & (k <= n[:, None])
            outcome = (k < n[:, None]).astype(jnp.float32)
            bins = jnp.clip((predicted * BINS).astype(jnp.int32), 0, BINS - 1)
            one_hot = (bins[..., None] == jnp.arange(BINS)) & reached[..., None]  # [B, G, BINS]
            add = jnp.stack([jnp.ones_like(predicted), predicted, outcome], -1)  # [B, G, 3]
            reliability = reliability + jnp.einsum("bgn,bgc->gnc", one_hot.astype(jnp.float32),
                                                   add)
        return Counters(
            rounds=self.rounds + 1,
            row_rounds=self.row_rounds + jnp.sum(active, dtype=jnp.int32),
            proposed=self.proposed + jnp.sum(proposed, dtype=jnp.int32),
            proposing=self.proposing + jnp.sum(proposed > 0, dtype=jnp.int32),
            accepted=self.accepted + jnp.sum(n, dtype=jnp.int32),
            emitted=self.emitted + jnp.sum(jnp.where(active, n + 1, 0), dtype=jnp.int32),
            accepted_at=self.accepted_at + jnp.sum(at, axis=0, dtype=jnp.int32),
            accepted_count=self.accepted_count + jnp.sum(
                (n[:, None] == lengths) & active[:, None], axis=0, dtype=jnp.int32),
            near_ties=self.near_ties + near_ties,
            proposed_count=self.proposed_count + jnp.sum(
                (jnp.minimum(proposed, G)[:, None] == lengths) & active[:, None], axis=0,
                dtype=jnp.int32),
            rejecting=self.rejecting + jnp.sum(active & (n < jnp.minimum(proposed, G)),
                                               dtype=jnp.int32),
            reliability=reliability,
            proposed_by_row=self.proposed_by_row + proposed,
            rounds_by_row=self.rounds_by_row + active.astype(jnp.int32),
            forwards=self.forwards + (0 if forwards is None else forwards),
            counted_forwards=self.counted_forwards | (forwards is not None),
            by_position=self.by_position if position is None else self.by_position + jnp.einsum(
                "bn,bc->nc", (position_bin(position)[:, None] == jnp.arange(
                    len(POSITION_EDGES) + 1)[None, :]).astype(jnp.int32),
                jnp.stack([active.astype(jnp.int32), jnp.where(active, n + 1, 0)], axis=1)),
            rested=self.rested,
        )


def position_bin(position: Array) -> Array:
    """The ``POSITION_EDGES`` bin of each position [B]: how many edges it has reached."""
    return jnp.sum(position[:, None] >= jnp.asarray(POSITION_EDGES)[None, :], axis=1)


def alpha_of(accepted: int, rejected: int) -> float:
    """``Stats.alpha`` from its counts (pooled over calls by the bench)."""
    return accepted / (accepted + rejected) if accepted + rejected else float("nan")


@dataclasses.dataclass(frozen=True, repr=False)
class Stats:
    """What one ``generate`` call did. Rates are over (row, round) pairs of rows still running.
    Prints as a short summary; every field stays an attribute (``dataclasses.asdict`` for all)."""

    acceptance_rate: float  # accepted drafts / proposed drafts (nan when none was proposed);
    #   a tree proposes all its nodes but can accept at most one path, so its rate is lower
    mean_accepted_length: float  # tokens per row-round, bonus/recovered included (1.0 without)
    per_position_acceptance: np.ndarray  # [G]: fraction of row-rounds whose k-th draft was accepted
    #   (trees: per depth, the fraction of row-rounds whose accepted path reached depth k)
    accepted_length_distribution: np.ndarray  # [G+1]: fraction of row-rounds accepting k drafts
    #   (these rates are nan, as mean_accepted_length, when no round ran: max_new_tokens 1)
    num_rounds: int  # decode loop iterations
    target_calls: int  # target forwards: prefill + one verify per round
    # draft forwards: prefill + the proposer's forwards per round (a draft model's chain: γ; a
    # tree: its depth; Medusa, the block drafter: 1; 0 for methods without a model); adaptive
    # chains: those really run (steps skipped once no row drafts are not counted)
    draft_calls: int
    proposed_tokens: int  # drafts proposed (rows may propose fewer than γ, e.g. no n-gram match)
    accepted_tokens: int
    proposal_rate: float  # fraction of row-rounds with at least one draft (ngram: found a match)
    generated_tokens: int  # tokens in the output, all rows
    prefill_seconds: float  # host-timed prefill and first token (TTFT), compile excluded
    decode_seconds: float  # host-timed decode loop, compile excluded
    decode_tokens_per_second: float  # tokens after the first, all rows, per decode second
    compile_seconds: float  # tracing and compiling (or loading from the disk cache) in this call;
    # 0 when the process already held the programs
    capacity: int = 0  # cache slots per row the program was compiled for (its tier)
    cache_bytes_per_row: int = 0  # target and draft caches (and proposer state), bytes per row
    # Set only when SpecConfig.synthetic_acceptance was used: the α per draft position. Such a
    # run is NOT lossless (benchmark only).
    synthetic_acceptance: tuple[float, ...] | None = None
    # Greedy calls: decode-loop tokens the target chose where another logit was within its
    # dtype's rounding of the top one (sampling.near_ties). The verify forward and a one-token
    # step round differently, so at such a token a speculative run may choose apart from an
    # autoregressive one, neither being wrong (exact ties always go to the smaller id). 0 when
    # sampling, or when any row samples.
    greedy_near_ties: int = 0
    # [G+1]: fraction of row-rounds that proposed exactly k drafts (a tree counts its depth's
    # worth; n-gram and adaptive lengths, SpecConfig.survival_threshold, propose fewer than γ)
    proposed_length_distribution: np.ndarray | None = None
    rejecting_rounds: int = 0  # row-rounds in which a proposed draft was rejected
    # rounds summed over the rows running in each (one row: num_rounds): the count the per-round
    # rates above (mean accepted length, per-position acceptance, the distributions) divide by
    row_rounds: int = 0
    # [B]: drafts each row proposed per round it was active (adaptive lengths vary it by row)
    mean_proposed_by_row: np.ndarray | None = None
    # Adaptive chains (SpecConfig.survival_threshold / verify_costs): the expected calibration
    # error of the calibrated predictions on this call's own verified drafts (each draft whose
    # predecessors were all accepted: predicted chance of acceptance against the outcome),
    # binned in 10 equal bins and weighted by count; nan without predictions. ``reliability``:
    # per non-empty bin, (mean predicted, fraction accepted, drafts);
    # ``reliability_by_draft_position``: the same for each draft position of a round (the first
    # draft, the second, ...), a tuple per position.
    calibration_error: float = float("nan")
    # Rounds that rested (a verify budget's declines, engine.Idle): plain decode steps run
    # without the draft, counted in num_rounds
    rested_rounds: int = 0
    reliability: tuple[tuple[float, float, int], ...] = ()
    reliability_by_draft_position: tuple[tuple[tuple[float, float, int], ...], ...] = ()
    # Per bin of context position (POSITION_EDGES) that some round started in: (first position,
    # end position or None for the last bin, mean accepted length, row-rounds): how acceptance
    # holds up deeper into the context
    accepted_length_by_position: tuple[tuple[int, int | None, float, int], ...] = ()

    @property
    def alpha(self) -> float:
        """α as the speed-up formula (``sj.theory``) means it: the chance that a draft passes
        given that every draft before it in its round passed, accepted drafts over accepted
        ones plus the rejections (at most one a row-round); nan when nothing was verified.
        ``acceptance_rate`` (accepted over proposed) is lower: a round's later drafts count
        as proposed after an earlier one failed."""
        return alpha_of(self.accepted_tokens, self.rejecting_rounds)

    def __repr__(self) -> str:
        lines = [f"Stats: {_count(self.generated_tokens, 'token')} in "
                 f"{_count(self.num_rounds, 'round')}, {self.target_calls} target and "
                 f"{_count(self.draft_calls, 'draft forward')}"]
        if self.synthetic_acceptance is not None:
            lines.append("  SYNTHETIC acceptance (benchmark only, NOT LOSSLESS): "
                         + " ".join(f"{a:g}" for a in self.synthetic_acceptance))
        if self.proposed_tokens:
            lines.append(f"  acceptance rate {self.acceptance_rate:.3f} ({self.accepted_tokens} "
                         f"of {_count(self.proposed_tokens, 'draft')}), mean accepted length "
                         f"{self.mean_accepted_length:.2f} tokens a round")
            lines.append("  per position " + " ".join(
                f"{a:.2f}" for a in np.asarray(self.per_position_acceptance)))
            if len(self.accepted_length_by_position) > 1:
                lines.append("  mean accepted length by context position " + ", ".join(
                    f"{lo}-{'' if hi is None else hi}: {m:.2f}"
                    for lo, hi, m, _ in self.accepted_length_by_position))
        else:
            lines.append("  no drafts proposed (autoregressive, or no draft found)")
        if np.isfinite(self.calibration_error):
            lines.append(f"  calibration error {self.calibration_error:.3f}")
        if self.rested_rounds:
            lines.append(f"  {_count(self.rested_rounds, 'round')} rested (the budget declined "
                         "drafting)")
        decode = (f"decode {1e3 * self.decode_seconds:.1f} ms "
                  f"({self.decode_tokens_per_second:.1f} tokens/s)" if self.num_rounds
                  else "no decode rounds (each row's one token came from the prefill)")
        lines.append(f"  prefill (TTFT) {1e3 * self.prefill_seconds:.1f} ms, {decode}, "
                     f"compile {self.compile_seconds:.1f} s")
        if self.greedy_near_ties:
            lines.append(f"  greedy near ties: {self.greedy_near_ties}")
        return "\n".join(lines)

    __str__ = __repr__

    @classmethod
    def summarise(cls, counters: Counters, *, gamma: int, draft_calls_per_round: int,
                  has_draft_model: bool, generated_tokens: int, batch: int,
                  prefill_seconds: float, decode_seconds: float,
                  compile_seconds: float, capacity: int = 0,
                  cache_bytes_per_row: int = 0, decode_tokens: int | None = None) -> Stats:
        """``decode_tokens``: tokens after each row's first (None: generated_tokens - batch,
        which counts a row that made no token as one fewer)."""
        c = jax.device_get(counters)
        row_rounds = int(c.row_rounds)
        proposed = int(c.proposed)
        rounds = int(c.rounds)
        if decode_tokens is None:
            decode_tokens = max(generated_tokens - batch, 0)
        return cls(
            acceptance_rate=float(c.accepted) / proposed if proposed else float("nan"),
            mean_accepted_length=float(c.emitted) / row_rounds if row_rounds else float("nan"),
            per_position_acceptance=(np.asarray(c.accepted_at, np.float64) / row_rounds
                                     if row_rounds else np.full(gamma, np.nan)),
            accepted_length_distribution=(np.asarray(c.accepted_count, np.float64) / row_rounds
                                          if row_rounds else np.full(gamma + 1, np.nan)),
            num_rounds=rounds,
            target_calls=1 + rounds,
            draft_calls=(0 if not has_draft_model else 1 + int(c.forwards)
                         if bool(c.counted_forwards) else 1 + draft_calls_per_round * rounds),
            proposed_tokens=proposed,
            accepted_tokens=int(c.accepted),
            proposal_rate=float(c.proposing) / row_rounds if row_rounds and gamma else float("nan"),
            generated_tokens=generated_tokens,
            prefill_seconds=prefill_seconds,
            decode_seconds=decode_seconds,
            decode_tokens_per_second=decode_tokens / decode_seconds if decode_seconds > 0 else 0.0,
            compile_seconds=compile_seconds,
            capacity=capacity,
            cache_bytes_per_row=cache_bytes_per_row,
            greedy_near_ties=int(c.near_ties),
            proposed_length_distribution=(np.asarray(c.proposed_count, np.float64) / row_rounds
                                          if row_rounds else np.full(gamma + 1, np.nan)),
            rejecting_rounds=int(c.rejecting),
            row_rounds=row_rounds,
            mean_proposed_by_row=(np.asarray(c.proposed_by_row, np.float64)[:batch]
                                  / np.maximum(np.asarray(c.rounds_by_row)[:batch], 1)),
            **calibration_summary(np.asarray(c.reliability, np.float64)),
            accepted_length_by_position=position_summary(np.asarray(c.by_position)),
            rested_rounds=int(c.rested),
        )


def position_summary(by_position: np.ndarray) -> tuple[tuple[int, int | None, float, int], ...]:
    """``Stats.accepted_length_by_position`` from the [bins, 2] counters (row-rounds, emitted)."""
    edges = (0,) + POSITION_EDGES + (None,)
    return tuple((edges[i], edges[i + 1], float(emitted / rounds), int(rounds))
                 for i, (rounds, emitted) in enumerate(by_position) if rounds > 0)


def _reliability(bins: np.ndarray) -> tuple[tuple[float, float, int], ...]:
    return tuple((float(p / n), float(a / n), int(n)) for n, p, a in bins if n > 0)


def calibration_summary(bins: np.ndarray) -> dict:
    """calibration_error, reliability and reliability_by_draft_position from the [G, BINS, 3]
    counters (count, sum predicted, sum accepted per draft position and bin; [BINS, 3]: one
    position)."""
    by_position = bins.reshape(-1, BINS, 3)
    pooled = by_position.sum(axis=0)
    total = pooled[:, 0].sum()
    if total == 0:
        return {}
    ece = float(np.abs(pooled[:, 1] - pooled[:, 2]).sum() / total)
    return dict(calibration_error=ece, reliability=_reliability(pooled),
                reliability_by_draft_position=tuple(_reliability(b) for b in by_position))
