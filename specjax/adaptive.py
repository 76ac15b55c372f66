"""Adaptive draft lengths: each row drafts, and has verified, only the drafts likely to survive.

* **Confidence.** For each draft position, the largest probability of the drafter's distribution
  there, read before the draft is drawn: of its processed q for a sampled row, of its softmax
  for a greedy row (whose draft is that argmax). Never q(token) of the drawn token: see below.
* **Calibration.** Confidence is not acceptance. A ``Calibration`` maps a confidence c to the
  predicted probability that the draft is accepted given that the drafts before it were:
  sigmoid(a · logit(c) + b), with a > 0 so the order of confidences is kept, one (a, b) per draft
  position for greedy rows and one for sampled rows. ``calibrate`` fits a draft model's on the
  target's own text from held-out prompts (one map for every position: teacher forcing has no
  positions), ``calibrate_rounds`` any drafter's on real rounds, a map per position or one for
  all as cross-validation on the fitting prompts chooses (a block drafter's later positions,
  drawn without seeing the drafts before them, are accepted less at the same confidence); the
  identity (a = 1, b = 0) is the default.
* **Survival.** The product of the predictions along a row's chain: the predicted chance that
  every draft so far is accepted. A row wants draft k while its survival is at least the
  threshold (``SpecConfig.survival_threshold``). The batch verifies draft k while some row wants
  it, in every row still generating: the verify forward is [B, width] for the widest row, so a
  row's drafts up to that width cost nothing more and can only add tokens (``Draft.valid`` marks
  them). Drafting stops once no row wants more. The engine verifies over the narrowest of
  ``loop_widths(γ)`` that holds that width (one while loop per width in one program,
  ``engine._rounds``, chosen on the device), so nothing recompiles when the lengths change, nor
  for another threshold or budget: their numbers are data of the call (``Tuning``).

Why the output stays the target's: whether a row has draft k verified is decided from what the
drafter knew before drawing it, in that row and in the others (the drafts before it, its
distribution q_k, the calibration), never from the target and never from draft k itself. The
verifier's rule needs, at each verified position, a draft distributed as the q it reports given
everything before it; a decision taken before the draw leaves that intact (draft k, when
verified, is still a plain draw from q_k), and a row verifying nothing more takes its next
token from p itself, as after a fully accepted chain. Two ways to get it wrong, both in
tests/test_adaptive.py and both caught by the exact-distribution test: a length that looked at
the target (stopping just before a draft the target would reject makes that token come from p
instead of the residual max(p − q, 0)), and a length that looked at the draft it keeps (scoring
a sampled draft by q(token) of the token drawn keeps likely tokens more often than unlikely
ones, so the drafts verified are no longer distributed as q).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

FILE = "calibration.json"
"""A drafter folder's calibration, beside its weights."""

_EPS = 1e-6


def _logit(c):
    c = jnp.clip(c, _EPS, 1 - _EPS)
    return jnp.log(c) - jnp.log1p(-c)


SEQUENTIAL_DRAFTERS = ("draft_model", "eagle")
"""Methods whose chain drafts one step per draft and stops drafting with the verify budget
(``Budget.sequential``); Medusa, MTP and the block drafter draft the same whatever it decides."""

POSITIONS = 16
"""Draft positions a Calibration holds a map for (the deepest block a block drafter makes);
drafts deeper in a chain use the last position's."""


def _per_position(value, mode: str, name: str) -> np.ndarray:
    """A calibration parameter as [POSITIONS] float64: a number (every position alike), or a
    list of one per position from the first (the last repeated to POSITIONS)."""
    items = value if isinstance(value, (list, tuple)) else [value]
    numbers_only = not any(isinstance(v, (str, bytes, bool, np.bool_))
                           for v in items)  # "2.5" or true in a file is not a number
    try:
        # float32, as the program holds it: 1e40 is inf there and 1e-50 is 0, both refused
        with np.errstate(over="ignore"):
            x = np.atleast_1d(np.asarray(value, np.float64)).astype(np.float32).astype(np.float64)
    except (TypeError, ValueError):
        x = np.zeros((0,))
    if not numbers_only or x.ndim != 1 or not 1 <= x.size <= POSITIONS:
        raise ValueError(f"a calibration's {mode} {name} must be a number or a list of 1 to "
                         f"{POSITIONS} numbers (one per draft position), got {value!r}")
    return np.concatenate([x, np.full(POSITIONS - x.size, x[-1])])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Calibration:
    """Confidence -> predicted acceptance at draft position k, sigmoid(a · logit(c) + b) with
    that position's (a, b); row 0 of each for greedy rows, row 1 for sampled rows. Arrays, so a
    new calibration is new data for the same compiled program."""

    a: Array  # [2, POSITIONS] float32, > 0
    b: Array  # [2, POSITIONS] float32

    @classmethod
    def identity(cls) -> Calibration:
        return cls(jnp.ones((2, POSITIONS), jnp.float32), jnp.zeros((2, POSITIONS), jnp.float32))

    @classmethod
    def of(cls, greedy: tuple, sampled: tuple) -> Calibration:
        """From (a, b) pairs, each a number (every draft position alike) or a list with one
        per position from the first (the last one repeated for deeper positions); ValueError
        unless every a is a finite number > 0 and every b finite."""
        rows = {}
        for mode, (given_a, given_b) in (("greedy", greedy), ("sampled", sampled)):
            a, b = _per_position(given_a, mode, "a"), _per_position(given_b, mode, "b")
            if not (np.all(np.isfinite(a)) and np.all(a > 0) and np.all(np.isfinite(b))):
                shown = (lambda v: np.asarray(v, np.float64).tolist())
                raise ValueError(f"a calibration's {mode} (a, b) must be finite with a > 0 (it "
                                 f"must keep the order of confidences), got "
                                 f"({shown(given_a)}, {shown(given_b)})")
            rows[mode] = a, b
        return cls(jnp.asarray([rows["greedy"][0], rows["sampled"][0]], jnp.float32),
                   jnp.asarray([rows["greedy"][1], rows["sampled"][1]], jnp.float32))

    def predict(self, confidence: Array, greedy: Array, position: int = 1) -> Array:
        """Predicted acceptance [B, ...] of drafts at draft ``position`` (1 = the first draft
        of a round) with confidence [B, ...] in rows whose greedy flag is greedy [B]."""
        i = jnp.where(greedy, 0, 1)
        k = min(max(int(position), 1), POSITIONS) - 1
        shape = (-1,) + (1,) * (confidence.ndim - 1)
        a, b = self.a[i, k].reshape(shape), self.b[i, k].reshape(shape)
        return jax.nn.sigmoid(a * _logit(confidence) + b)

    def to_json(self) -> dict:
        """{"greedy": {"a", "b"}, "sampled": {...}}: a number where every position has the
        same value, else a list with one per position (trailing repeats dropped)."""
        def compact(row):
            last = len(row)
            while last > 1 and row[last - 2] == row[-1]:
                last -= 1
            return float(row[0]) if last == 1 else [float(v) for v in row[:last]]
        a, b = np.asarray(self.a, np.float64), np.asarray(self.b, np.float64)
        return {mode: {"a": compact(a[i]), "b": compact(b[i])}
                for i, mode in enumerate(("greedy", "sampled"))}

    @classmethod
    def from_json(cls, record: dict, source: str = "calibration") -> Calibration:
        try:
            return cls.of((record["greedy"]["a"], record["greedy"]["b"]),
                          (record["sampled"]["a"], record["sampled"]["b"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{source}: not a calibration record ({e!r})") from None


def checked_calibration(c, name: str = "calibration") -> Calibration:
    """``c`` checked (a Calibration with a [2, POSITIONS] > 0 and b [2, POSITIONS], finite), or
    the identity for None: what a compiled program takes, so drafters with and without one
    share the program."""
    if c is None:
        return Calibration.identity()
    if not isinstance(c, Calibration):
        raise ValueError(f"{name} must be a specjax.adaptive.Calibration, got "
                         f"{type(c).__name__}")
    a, b = np.asarray(c.a), np.asarray(c.b)
    shape = (2, POSITIONS)
    if a.shape != shape or b.shape != shape or not (
            np.all(np.isfinite(a)) and np.all(a > 0) and np.all(np.isfinite(b))):
        raise ValueError(f"{name} must hold a {list(shape)} > 0 and b {list(shape)}, finite "
                         f"(Calibration.of checks this), got a of shape {list(a.shape)} "
                         f"{a.ravel()[:4].tolist()}..., b of shape {list(b.shape)}")
    return c


def save_calibration(calibration: Calibration, folder, report: dict | None = None,
                     model=None) -> None:
    """Write ``calibration.json`` into a drafter folder (with the fit's report, if given). With
    ``model`` (the drafter it was fitted for: an sj.Model, a DraftModel or Heads), the file
    records its weights' fingerprint, and ``load_calibration`` ignores it beside other weights."""
    from .files import write_atomic
    record = {**calibration.to_json(), "report": report or {}}
    if model is not None:
        from .draft.heads import fingerprint
        record["fitted_for"] = fingerprint(getattr(model, "model", model))
    write_atomic(pathlib.Path(folder) / FILE, json.dumps(record, indent=1) + "\n")


def load_calibration(folder, model=None) -> Calibration | None:
    """A drafter folder's calibration, or None when it has none. With ``model`` (the drafter
    loaded from the folder: a draft model or Heads): None, with a warning, when the file records
    that it was fitted for other weights (a drafter trained again after its calibration was
    fitted)."""
    path = pathlib.Path(folder) / FILE
    if not path.is_file():
        return None
    from .files import read_json_object
    record = read_json_object(path, ": fit it again with `specjax train calibrate`, or remove it")
    try:
        calibration = Calibration.from_json(record, str(path))
    except ValueError as e:
        message = str(e)
        raise ValueError(message if str(path) in message else f"{path}: {message}") from None
    fitted_for = record.get("fitted_for")
    if fitted_for is not None and (not isinstance(fitted_for, dict) or not fitted_for):
        raise ValueError(f"{path}: fitted_for must be the fingerprint of the drafter's weights "
                         f"(a non-empty object), got {fitted_for!r}")
    if model is not None and fitted_for is not None:
        from .draft.heads import Heads, differing_weight
        if differing_weight(fitted_for, getattr(model, "model", model)) is not None:
            import warnings
            flag = "--heads" if isinstance(model, Heads) else "--draft"
            warnings.warn(f"{path} was fitted for other weights than the drafter in {folder}: "
                          f"ignored, so adaptive lengths use the raw confidence (fit it again: "
                          f"`specjax train calibrate {flag} {folder}`)", stacklevel=2)
            return None
    return calibration


def confidence(logits: Array, q: Array | None, temperature: Array) -> Array:
    """Each row's confidence at a draft position, known before its draft is drawn: the largest
    probability of the processed q [B, M] for sampled rows, of the softmax of the logits [B, M]
    for greedy rows (temperature [B] == 0)."""
    # the softmax's largest value, 1 / sum(exp(logits - max)): one pass fewer over the vocabulary
    # than taking the max of the softmax
    x = logits.astype(jnp.float32)
    top = 1.0 / jnp.sum(jnp.exp(x - jnp.max(x, axis=-1, keepdims=True)), axis=-1)
    if q is None:
        return top
    return jnp.where(temperature == 0, top, jnp.max(q, axis=-1))


def keep(survival: Array, threshold: float | None) -> Array:
    """Which rows keep drafting: survival [B] at least the threshold (None: every row)."""
    if threshold is None:
        return jnp.ones(survival.shape, bool)
    return survival >= threshold


# ---------------------------------------------------------------------------------------------
# The batch's verify budget


def loop_widths(gamma: int) -> tuple[int, ...]:
    """The verify widths the decode loop of a chain with per-row lengths has a loop for: 1 (no
    drafts: a decode step), 2, 3, 5, 9, ... up to γ + 1 (``engine._rounds``). A round verifies
    over the narrowest that holds its widest row's drafts."""
    widths, w = [1], 2
    while w < gamma + 1:
        widths.append(w)
        w = 2 * w - 1
    return tuple(widths) + (gamma + 1,)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Budget:
    """What a round costs on this backend at this batch size, in one-token target steps:
    ``verify_costs[k]``, a target forward over k + 1 tokens (verifying k drafts; [0] is 1, the
    plain decode step), ``draft_cost`` (c), one draft as it costs inside a round (its step,
    draw and writes), ``round_cost`` (o), what a round that drafts costs besides its forwards
    and drafts, beyond what a plain decode step costs besides its forward, and
    ``decline_cost``, a round that verifies none. Numbers of a call, not of its program:
    ``generate`` passes them as data (``Tuning``), so other costs run the same compiled
    program.

    A round verifying k >= 1 drafts costs o + c·min(k + 1, γ) + v_n, where n + 1 is the
    narrowest of ``loop_widths(γ)`` (1, 2, 3, 5, 9, ..., γ + 1) holding k + 1 tokens: the decode
    loop has a forward of each of those widths only, so three drafts at γ = 8 are verified by
    the forward over five tokens; below γ it has run the draft step that scored draft k + 1 to
    decide not to verify it. One verifying none costs ``decline_cost`` (None: 1 + c; its
    draft still reads the newest token to score draft 1, and nothing else of the round's fixed
    part runs in it: with ``idle_rounds`` the rounds after such rounds skip the draft too). A
    drafter that is not ``sequential`` (its drafting costs the same whatever the lengths:
    Medusa, MTP, the block drafter) pays c once a round, verifying none included: o + c + v_n
    and 1 + c (or ``decline_cost``).

    The batch verifies as many draft positions as pay for themselves. Every row shares the
    forward's width (the verify forward is [B, width]), so the budget is a width. Before draft k
    is drawn, each row still generating has a predicted survival s_k through draft k and a
    predicted chance p_k for draft k itself; projecting p_k onto the drafts after it gives the
    expected tokens of every width w >= k, E_w = E_{k-1} + sum over rows of s_k (1 + p_k + ...
    + p_k^(w-k)), where E_{k-1} counts each row's own token and the drafts already kept. The
    batch verifies draft k if some width w >= k has a higher expected rate than stopping:

        max over w >= k of  E_w / cost(w)  >  E_{k-1} / cost(k - 1),

    and the first k that fails ends the batch's drafting. At small batch, where v stays near 1,
    every confident draft is verified; at large batch, where each extra position costs a step's
    worth, the width falls to 0 and the round is a plain decode step, without recompiling (and
    after two such rounds in a row, ``idle_rounds`` rest the draft: see ``engine.Idle``). The
    projection lets a first draft through where one draft alone does not pay for a wider forward
    but several would (a cost table with a step, then flat).

    Everything the rule reads for position k is known before draft k is drawn (s_k and p_k use
    q_k's confidence, not the draft), so the decision never depends on draft k or the target.
    """

    verify_costs: tuple[float, ...]
    draft_cost: float = 0.0
    # what a round that drafts costs besides its forwards, beyond a plain decode step's own
    # and drafts (verification, bookkeeping), in one-token target steps
    round_cost: float = 0.0
    # what a round that verifies no draft costs, in one-token target steps: its decode step and
    # the draft step that scored draft 1 (None: 1 + draft_cost). ``measure_costs`` gives it
    # apart because its draft_cost is a draft inside a drafting round, dearer than that step.
    decline_cost: float | None = None
    # cost(0) .. cost(γ), computed on the host in float64 and rounded once to float32: the
    # budget a program traces with when the call passes it (``Tuning.costs``; the fields above
    # are then empty), so its decisions are those of the same numbers compiled in (None:
    # computed from the fields)
    table: Array | None = None
    # True: one draft step per draft scored, skipped once the batch stops (a draft model,
    # EAGLE); False: the drafting costs the same every round, however many drafts are verified
    # (Medusa, MTP, the block drafter: ``draft_cost`` is then the whole round's drafting)
    sequential: bool = dataclasses.field(default=True, metadata=dict(static=True))

    @classmethod
    def of(cls, verify_costs, draft_cost: float = 0.0, gamma: int | None = None,
           round_cost: float = 0.0, sequential: bool = True,
           decline_cost: float | None = None) -> Budget:
        """Checked: γ + 1 finite costs > 0 (divided by the first), a draft cost and a round
        cost >= 0, a decline cost > 0 or None (in the first's units already)."""
        def real(x):
            return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))

        costs = tuple(verify_costs) if isinstance(verify_costs, (tuple, list)) else None
        if costs is not None and all(real(x) and x > 0 for x in costs):
            with np.errstate(over="ignore"):  # as the program holds them: float32, over the first
                scaled = np.float32(np.asarray(costs, np.float64) / float(costs[0]))
        if (costs is None or len(costs) < 2 or (gamma is not None and len(costs) != gamma + 1)
                or not all(real(x) and np.isfinite(x) and x > 0 for x in costs)
                or not np.all(np.isfinite(scaled) & (scaled > 0))):
            want = "γ + 1" if gamma is None else f"{gamma + 1} (γ + 1)"
            raise ValueError(f"verify_costs must be {want} finite costs > 0 (a target forward "
                             f"over 1, 2, ... tokens, in one-token steps), got {verify_costs!r}")
        for name, value, what in (("draft_cost", draft_cost, "one draft step"),
                                  ("round_cost", round_cost, "a round's fixed part")):
            if not real(value) or not np.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0 ({what} in target "
                                 f"steps), got {value!r}")
        if decline_cost is not None and (not real(decline_cost) or not np.isfinite(decline_cost)
                                         or decline_cost <= 0):
            raise ValueError(f"decline_cost must be a finite number > 0 (a round that verifies "
                             f"no draft, in target steps) or None, got {decline_cost!r}")
        return cls(tuple(float(x) / float(costs[0]) for x in costs), float(draft_cost),
                   float(round_cost), None if decline_cost is None else float(decline_cost),
                   sequential=bool(sequential))

    def cost(self, k: int) -> float:
        """A round verifying k >= 1 drafts: its fixed part, its draft steps and the forward of
        the loop that verifies them, over the narrowest of ``loop_widths(γ)`` holding k + 1
        tokens (at γ = 8, three to seven drafts cost the forward over five or nine tokens);
        verifying none (k = 0): a decode step and the draft step that scored draft 1. Draft
        steps: min(k + 1, γ) when ``sequential`` (the rule stops after scoring draft k + 1,
        which it then does not verify), else one round's drafting (``draft_cost``) whatever k."""
        if self.table is not None:
            return self.table[k]
        if k == 0:
            return (self.verify_costs[0] + self.draft_cost if self.decline_cost is None
                    else self.decline_cost)
        width = next(w for w in loop_widths(self.gamma) if w > k)
        steps = min(k + 1, self.gamma) if self.sequential else 1
        return self.round_cost + self.draft_cost * steps + self.verify_costs[width - 1]

    @property
    def gamma(self) -> int:
        return len(self.verify_costs if self.table is None else self.table) - 1

    def widen(self, expected: Array, survival: Array, predicted: Array, alive: Array,
              k: int, group: int | None = None) -> tuple[Array, Array]:
        """Whether each group of rows verifies draft k (static k >= 1) [G], and the expected
        tokens with it [G]. expected: E_{k-1} [G]; survival, predicted, alive [B]: each row's
        s_k, p_k and whether it still drafts (see the class docstring); ``group``: rows per
        group (``WIDTH_GROUP``; None: the whole batch, G = 1)."""
        s = jnp.where(alive, survival, 0.0)
        later = jnp.arange(self.gamma - k + 1, dtype=jnp.float32)  # drafts k .. γ
        projected = _group_sums(s[:, None] * predicted[:, None] ** later[None, :], group)
        tokens = expected[:, None] + jnp.cumsum(projected, axis=1)  # E_w, w = k .. γ
        costs = jnp.asarray([self.cost(w) for w in range(k, self.gamma + 1)], jnp.float32)
        go = jnp.max(tokens * self.cost(k - 1) - expected[:, None] * costs, axis=1) > 0
        return go, expected + projected[:, 0]


class _PerCall:
    """The value of a proposer's adaptive setting in a compiled program's plan: the call passes
    the number itself (``Tuning``). Anything that reads it as a number fails loudly."""

    def __repr__(self) -> str:
        return "PER_CALL"

    def __reduce__(self) -> str:  # copied or unpickled, it is still the one PER_CALL
        return "PER_CALL"


PER_CALL = _PerCall()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tuning:
    """The numbers of a chain's adaptive lengths as data of one call (``engine.Request``): the
    survival threshold ([] float32) and the verify budget as its cost table (``costs``
    [γ + 1] float32: ``Budget.cost(0 .. γ)``, all the rule reads), each None when off. The
    program's plan holds ``PER_CALL`` in their place, so a call with another threshold or other
    costs runs the program compiled for the first: choosing them, by hand or by
    ``measure_costs``, compiles no program per value (turning either on or off does, as does
    another γ or batch bucket)."""

    threshold: Array | None = None
    costs: Array | None = None


def split_tuning(proposer):
    """(``proposer`` with its adaptive numbers replaced by ``PER_CALL``, their ``Tuning``), or
    (``proposer``, None) when it has none: only specjax's adaptive chains
    (``tunable = True``, inherited by their subclasses, which must read the two as traced
    numbers) are split; any other proposer is its own static plan."""
    if not getattr(proposer, "tunable", False):
        return proposer, None
    threshold, budget = proposer.survival_threshold, proposer.budget
    if threshold is None and budget is None:
        return proposer, None
    if threshold is PER_CALL or budget is PER_CALL:
        raise ValueError(f"{type(proposer).__name__} is a program's plan, whose adaptive "
                         f"numbers each call passes (PER_CALL): pass the proposer as built, "
                         f"with its survival_threshold and budget")
    tuning = Tuning(None if threshold is None else np.float32(threshold),
                    None if budget is None else np.asarray(
                        [budget.cost(k) for k in range(budget.gamma + 1)], np.float32))
    return dataclasses.replace(proposer, survival_threshold=None if threshold is None else PER_CALL,
                               budget=None if budget is None else PER_CALL), tuning


def tuned(proposer, tuning: Tuning | None):
    """The proposer a program traces with: its ``PER_CALL`` settings given the call's numbers
    (``split_tuning``'s inverse, with arrays); unchanged without a tuning."""
    if tuning is None:
        return proposer
    return dataclasses.replace(
        proposer, survival_threshold=(proposer.survival_threshold if tuning.threshold is None
                                      else tuning.threshold),
        budget=proposer.budget if tuning.costs is None else Budget((), table=tuning.costs))


WIDTH_GROUP: int | None = None
"""How many neighbouring rows share one verified width: None, the whole batch (the verify forward
is [B, width] whatever each row wants, so a row verifies every draft up to the batch's width).
Tests set 1 (each row its own length) or 2 to see, inside one big batch, the lengths a batch of
one or two rows gets, the verify budget's decisions included (it weighs each group's rows); the
rule is the same code at every scope."""


def _group_sums(x: Array, group: int | None) -> Array:
    """x [B, ...] summed over each group of ``group`` neighbouring rows: [G, ...] (None: the
    whole batch, G = 1)."""
    if group is None:
        return jnp.sum(x, axis=0, keepdims=True)
    B = x.shape[0]
    x = jnp.pad(x, [(0, -B % group)] + [(0, 0)] * (x.ndim - 1))
    return jnp.sum(x.reshape(-1, group, *x.shape[1:]), axis=1)


def _per_row(x: Array, group: int | None, B: int) -> Array:
    """A value per group [G] given to each of its rows [B] (``_group_sums``' groups)."""
    return jnp.broadcast_to(x, (B,)) if group is None else jnp.repeat(x, group)[:B]


def _shared(wants: Array, group: int | None) -> Array:
    """Per row [B]: whether any row of its group (``group`` neighbouring rows; None: the whole
    batch) wants the position."""
    return _per_row(_group_sums(wants.astype(jnp.int32), group) > 0, group, wants.shape[0])


class ChainControl:
    """Adaptive lengths along a chain, one draft position at a time (draft-model, EAGLE, MTP
    chains): ``start`` with the rows still generating, then ``step`` with each position's
    confidence (read before the draw) returns which rows have it verified. Holds the calibrated
    per-position predictions for ``Draft.predicted``.

    A row *wants* draft k while its survival through k is at least the threshold. The batch
    verifies draft k in every row still generating when some row wants it (and the budget, if
    any, pays for it): the verify forward is [B, width] for the widest row anyway, and every draft
    is drawn while some row drafts, so verifying a row's drafts up to that width costs nothing
    and can only add accepted tokens (``WIDTH_GROUP`` narrows the scope, the budget's with it,
    for tests)."""

    def __init__(self, calibration: Calibration | None, threshold: float | None,
                 budget: Budget | None, greedy_rows: Array, active: Array | None):
        self.calibration = calibration or Calibration.identity()
        self.threshold, self.budget, self.greedy_rows = threshold, budget, greedy_rows
        self.group = WIDTH_GROUP
        self.active = jnp.ones(greedy_rows.shape, bool) if active is None else active
        self.survival = jnp.ones(greedy_rows.shape, jnp.float32)
        self.wants = self.active  # rows whose own survival keeps them drafting
        self.alive = self.active  # rows whose drafts are verified so far
        # E_{k-1} per group of rows sharing a width [G]: each row still generating counts its
        # own token
        self.expected = jnp.maximum(_group_sums(self.active.astype(jnp.float32), self.group),
                                    1.0)
        self.valid, self.predicted = [], []
        self.forwards = jnp.ones((), jnp.int32)  # the first draft step always runs

    def step(self, score: Array) -> Array:
        """Rows [B] whose next draft is verified, given its confidence [B]."""
        k = len(self.valid) + 1
        predicted = self.calibration.predict(score, self.greedy_rows, k)
        self.survival = self.survival * predicted
        self.wants = self.wants & keep(self.survival, self.threshold)
        alive = self.alive & _shared(self.wants, self.group)
        if self.budget is not None:
            go, self.expected = self.budget.widen(self.expected, self.survival, predicted, alive,
                                                  k, self.group)
            alive = alive & _per_row(go, self.group, alive.shape[0])
        self.alive = alive
        self.valid.append(alive)
        self.predicted.append(predicted)
        return alive

    def drafting(self) -> Array:
        """Whether any row goes on ([] bool): the next draft step is skipped otherwise (and
        counted in ``forwards`` when it is not)."""
        go = jnp.any(self.alive)
        self.forwards = self.forwards + go.astype(jnp.int32)
        return go

    def arrays(self) -> tuple[Array, Array]:
        """(valid [B, G] bool, predicted [B, G] float32)."""
        return jnp.stack(self.valid, axis=1), jnp.stack(self.predicted, axis=1)


def measure_costs(target, draft=None, *, batch_size: int = 1, gamma: int = 4,
                  context: int = 64, repeats: int = 9, temperature: float = 1.0) -> Budget:
    """This backend's ``Budget`` for ``target`` (and a draft model, if given) at ``batch_size``
    rows: the target's forward over 1 .. γ + 1 tokens, each with the cache filled to
    ``context`` slots, in the target's one-token steps. With a draft model, also whole rounds of
    generate's own program for static chains of 1 and of γ drafts (rows sampled at
    ``temperature``; 0: greedy), its plain decode step, and the draft's one-token forward: a
    round that drafts g costs o + c·g + v_g beyond what a plain step costs besides its
    forward, so the two rounds give the draft cost c (``draft_cost``: a draft as it costs
    inside a round, its forward, its draw and its writes; never less than the bare forward) and
    the round's fixed part o (``round_cost``, ``fit_round_costs``); a round that verifies no
    draft costs a decode step and the bare forward that scored draft 1 (``decline_cost``).
    Timed interleaved (median of ``repeats``). A draft that is not a model (heads) has no step
    or round timed here: pass its costs to ``Budget.of`` yourself.

    Why rounds, not the draft's forward timed apart: inside a round a draft costs 1.5-3 times
    its bare forward on the project's CPU (it draws and writes as well, and runs after the
    target's forward has passed through the caches). Charged at its bare cost with the rest of
    a round of γ drafts put into o, as until 2026-12-07, the model priced rounds of 2 and 4
    drafts 3-29% above what they cost and long rounds about right, so once it drafted it
    favoured long rounds (experiments/results/2026-12-07-budget-round-fit.md)."""
    from . import timing
    from .config import SamplingParams, SpecConfig
    from .draft.draft_model import DraftModel
    from .engine import bucket
    from .model import Model
    capacity = context + gamma + 2
    rows = bucket(batch_size, minimum=1)  # what generate runs (and the rounds below are timed at)
    timers = {w: timing.forward_timer(target, w, capacity, context, batch=rows)
              for w in range(1, gamma + 2)}
    chains = sorted({1, gamma}) if isinstance(draft, (Model, DraftModel)) else []
    if chains:
        timers["draft"] = timing.forward_timer(draft, 1, capacity, context, batch=rows)
        decoded = context // 2
        prompt = np.random.default_rng(0).integers(1, target.config.vocab_size,
                                                   max(context - decoded, 1)).tolist()
        sampling = SamplingParams(temperature=temperature,
                                  max_new_tokens=decoded + 2 * gamma + 2)
        for g in chains:
            timers[("round", g)] = timing.round_timers(
                target, prompt, sampling=sampling, spec=SpecConfig(num_speculative_tokens=g),
                draft=draft, decoded=decoded, batch=batch_size)["round"]
        timers["plain"] = timing.round_timers(target, prompt, sampling=sampling,
                                              decoded=decoded, batch=batch_size)["round"]
    seconds = timing.median_seconds(timers, repeats)
    step = seconds[1]
    verify = [seconds[w] / step for w in range(1, gamma + 2)]
    if not chains:
        return Budget.of(verify)
    # each round beyond what a plain decode step costs besides its forward (both pay that)
    rounds = {g: seconds[("round", g)] / step - (seconds["plain"] / step - 1.0) for g in chains}
    bare = seconds["draft"] / step
    draft_cost, round_cost = fit_round_costs(rounds, verify, bare)
    return Budget.of(verify, draft_cost, round_cost=round_cost, decline_cost=1.0 + bare)


def fit_round_costs(rounds: dict[int, float], verify: list[float],
                    bare_draft: float) -> tuple[float, float]:
    """(c, o) of rounds that cost ``rounds[g]`` = o + c·g + verify[g] (a static chain of g
    drafts; one-token steps) for g = 1 and γ: c the slope between the two, never below
    ``bare_draft`` (the draft's forward alone), o what the round of one draft leaves, never
    below 0. With one chain only (γ = 1), c = ``bare_draft``."""
    low, high = min(rounds), max(rounds)
    c = bare_draft
    if high > low:
        slope = (rounds[high] - rounds[low] - verify[high] + verify[low]) / (high - low)
        c = max(slope, bare_draft)
    return c, max(rounds[low] - c * low - verify[low], 0.0)


# ---------------------------------------------------------------------------------------------
# Fitting


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)), without overflow for large |x|."""
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _np_logit(c: np.ndarray) -> np.ndarray:
    """log(c / (1 - c)) on the host, c clipped to [_EPS, 1 - _EPS] (as _logit on the device)."""
    c = np.clip(c, _EPS, 1 - _EPS)
    return np.log(c) - np.log1p(-c)


_MIN_SLOPE = 1e-3  # a fitted a is kept at least this: a calibration keeps the confidences' order


def _fit_logistic(c: np.ndarray, y: np.ndarray, steps: int = 200,
                  weights: np.ndarray | None = None) -> tuple[float, float]:
    """(a, b) minimising the cross-entropy of sigmoid(a · logit(c) + b) against soft labels y
    in [0, 1] (each sample weighted by ``weights``, default 1), by Newton's method on the two
    parameters, each step halved until the loss does not rise (a full Newton step from (1, 0)
    can run away where many confidences sit at the same clipped logit); where the best a is
    below ``_MIN_SLOPE``, a is that and b the best for it."""
    x = _np_logit(c)
    X = np.stack([x, np.ones_like(x)], axis=1)
    n = np.ones_like(x) if weights is None else np.asarray(weights, np.float64)
    n = n / n.sum()

    def loss(w):  # the weighted cross-entropy, from the logits (stable at any size)
        z = X @ w
        return float(np.sum(n * (np.logaddexp(0.0, z) - y * z)))

    w = np.array([1.0, 0.0])
    current = loss(w)
    for _ in range(steps):
        p = _sigmoid(X @ w)
        grad = X.T @ (n * (p - y))
        hess = (X * (n * p * (1 - p))[:, None]).T @ X + 1e-6 * np.eye(2)
        step = np.linalg.solve(hess, grad)
        for _ in range(60):
            tried = loss(w - step)
            if tried <= current:
                break
            step = step / 2
        else:
            break  # no step lowers the loss: at the optimum to rounding
        w, current = w - step, tried
        if np.abs(step).max() < 1e-9:
            break
    if not np.all(np.isfinite(w)):
        raise ValueError(f"the calibration fit did not converge (a, b = {w.tolist()})")
    if w[0] >= _MIN_SLOPE:
        return float(w[0]), float(w[1])
    # The best slope is not positive (confidence says nothing, or the wrong thing, here): the
    # best order-keeping map is then the flattest, with its intercept fitted for that slope.
    # (the mean prediction rises with b: bisect for the b where it meets the mean outcome)
    lo, hi = -50.0, 50.0
    for _ in range(100):
        b = 0.5 * (lo + hi)
        if np.sum(n * (_sigmoid(_MIN_SLOPE * x + b) - y)) > 0:
            hi = b
        else:
            lo = b
    return _MIN_SLOPE, 0.5 * (lo + hi)


def _logistic_map(a: float, b: float):
    return lambda c: _sigmoid(a * _np_logit(c) + b)


def _ece_of_cells(points: np.ndarray, predict=lambda c: c, bins: int = 10) -> float:
    """The expected calibration error (as Stats.calibration_error: equal-width bins of the
    prediction, weighted by drafts) of cells ``points`` [n, 3] (mean raw confidence, fraction
    accepted, drafts), each cell's drafts predicted ``predict`` of its mean confidence."""
    c, y, n = points.T
    p = predict(c)
    which = np.minimum((p * bins).astype(int), bins - 1)
    gap = sum(abs(np.sum(n[which == i] * (p - y)[which == i])) for i in range(bins))
    return float(gap / max(n.sum(), 1.0))


def expected_calibration_error(predicted: np.ndarray, observed: np.ndarray,
                               bins: int = 10) -> float:
    """ECE: over equal-width bins of the prediction, the mean |mean prediction − mean outcome|
    weighted by the bin's share of the samples."""
    predicted, observed = np.asarray(predicted, np.float64), np.asarray(observed, np.float64)
    return _ece_of_cells(np.stack([predicted, observed, np.ones_like(predicted)], axis=1),
                         bins=bins)


def reliability(predicted: np.ndarray, observed: np.ndarray, bins: int = 10) -> list[dict]:
    """Per bin of the prediction: its count, mean prediction and mean outcome (the reliability
    diagram's points)."""
    predicted, observed = np.asarray(predicted, np.float64), np.asarray(observed, np.float64)
    which = np.minimum((predicted * bins).astype(int), bins - 1)
    return [{"bin": i, "count": int(np.sum(which == i)),
             "predicted": float(predicted[which == i].mean()),
             "observed": float(observed[which == i].mean())}
            for i in range(bins) if np.any(which == i)]


def _teacher_forced(target, draft, sequences: list[list[int]]):
    """Target logits [B, T, V] and draft logits over its draft vocabulary [B, T, M] (float32
    numpy) for right-padded sequences, each model run once over the whole sequence."""
    from .cache import KVCache
    from .model import forward
    B, T = len(sequences), max(map(len, sequences))
    tokens = np.zeros((B, T), np.int32)
    for i, s in enumerate(sequences):
        tokens[i, :len(s)] = s
    tokens = jnp.asarray(tokens)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    p, _, _ = forward(target, tokens, positions, KVCache.init(target.config, B, T))
    q, _ = draft.logits(tokens, positions, KVCache.init(draft.config, B, T))
    return np.asarray(p, np.float32), np.asarray(q, np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def acceptance_samples(target, draft, prompts: list[list[int]], *, temperature: float,
                       max_new_tokens: int, seed: int = 0
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(confidence, acceptance, row) triples of a draft model's drafts on text the target
    writes from ``prompts``, teacher-forced.

    A chain's k-th draft is verified only after the k - 1 before it were accepted, and then the
    draft model's cache holds the true text: so the k-th draft's conditional acceptance at a
    position is what a one-token draft from the true prefix gets there, and the target's own
    text (greedy, or sampled at ``temperature``) is the prefix distribution rounds see. Greedy:
    confidence = the draft's largest softmax probability, acceptance = [its argmax is the
    target's]. Sampled: confidence = the largest probability of q, acceptance = the chance the
    verifier keeps a draw from q, sum over x of min(p(x), q(x))."""
    from .config import SamplingParams
    from .draft.draft_model import as_draft_model
    from .engine import generate
    draft = as_draft_model(draft)
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
    out = generate(target, prompts, sampling=sampling, key=seed)
    sequences = [list(p) + [int(t) for t in row if t >= 0] for p, row in zip(prompts, out.tokens)]
    p_logits, q_logits = _teacher_forced(target, draft, sequences)
    ids = (np.arange(q_logits.shape[-1]) if draft.vocab is None
           else np.asarray(draft.vocab.ids))
    conf, acc, rows = [], [], []
    for b, (prompt, seq) in enumerate(zip(prompts, sequences)):
        span = slice(len(prompt) - 1, len(seq) - 1)  # positions whose next token is generated
        if temperature == 0:
            q = _softmax(q_logits[b, span])
            conf.append(q.max(axis=-1))
            acc.append((ids[q.argmax(axis=-1)] == np.asarray(seq[span.start + 1:])).astype(
                np.float64))
            rows.append(np.full(len(q), b))
            continue
        q = _softmax(q_logits[b, span] / temperature)
        p = _softmax(p_logits[b, span] / temperature)[:, ids]  # at the draft's ids
        conf.append(q.max(axis=-1))
        acc.append(np.minimum(p, q).sum(axis=-1))
        rows.append(np.full(len(q), b))
    return np.concatenate(conf), np.concatenate(acc), np.concatenate(rows)


def _check_fit_args(name: str, prompts, temperature: float, split: str,
                    least: int = 2) -> None:
    if len(prompts) < least:
        raise ValueError(f"{name} needs at least {least} prompts ({split}), got {len(prompts)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the sampled rows' fit), got {temperature}")


def calibrate(target, draft, prompts: list[list[int]], *, temperature: float = 0.8,
              max_new_tokens: int = 128, seed: int = 0) -> tuple[Calibration, dict]:
    """Fit a draft model's Calibration on the target's own text from ``prompts`` (held-out
    prompts: never the ones you will benchmark on), greedy and sampled at ``temperature``.
    Rows alternate between fitting and scoring: the report gives, per mode, the held-out
    expected calibration error of the raw confidence and of the fitted map, and the reliability
    diagram's points."""
    _check_fit_args("calibrate", prompts, temperature,
                    "rows alternate between fitting and scoring")
    fitted, report = {}, {}
    for mode, t in (("greedy", 0.0), ("sampled", float(temperature))):
        c, y, rows = acceptance_samples(target, draft, prompts, temperature=t,
                                        max_new_tokens=max_new_tokens, seed=seed)
        fit, held = rows % 2 == 0, rows % 2 == 1
        a, b = _fit_logistic(c[fit], y[fit])
        fitted[mode] = (a, b)
        predicted = _logistic_map(a, b)(c[held])
        report[mode] = {"temperature": t, "samples": int(c.size), "a": a, "b": b,
                        "ece_raw": expected_calibration_error(c[held], y[held]),
                        "ece": expected_calibration_error(predicted, y[held]),
                        "mean_acceptance": float(y[held].mean()),
                        "reliability": reliability(predicted, y[held])}
    return Calibration.of(fitted["greedy"], fitted["sampled"]), report


# A survival threshold far below what a chain's product of raw confidences reaches in practice
# (four drafts at 1 / 2,048 each: 6e-14), so every row wants every draft and every draft is
# verified and scored. Were a product ever to fall below it, the drafts after would only go
# uncounted: each draft counted is still one whose predecessors were all accepted.
EVERY_DRAFT = 1e-30


def _uncalibrated(drafter):
    """``drafter`` (a DraftModel, an sj.Model or Heads) with the identity calibration, so the
    engine's predictions are its raw confidences."""
    from .draft.draft_model import DraftModel
    from .draft.heads import Heads
    if isinstance(drafter, DraftModel):
        return dataclasses.replace(drafter, calibration=None)
    if isinstance(drafter, Heads):
        return Heads(drafter.config, {k: v for k, v in drafter.params.items()
                                      if k != "calibration"})
    return drafter  # an sj.Model: no calibration of its own


def _method_of(drafter, method: str | None) -> str:
    from .draft import registry
    from .draft.heads import Heads
    if method is None:
        method = drafter.config.method if isinstance(drafter, Heads) else "draft_model"
    if not registry.get(method).adaptive:
        adaptive = [n for n in registry.names() if registry.get(n).adaptive]
        raise ValueError(f"method {method!r} has no adaptive lengths to calibrate (those that "
                         f"do: {', '.join(adaptive)})")
    return method


def round_points(target, drafter, prompts: list[list[int]], *, method: str | None = None,
                 gamma: int = 4, temperature: float, max_new_tokens: int = 128,
                 seed: int = 0) -> list[np.ndarray]:
    """Real rounds of a chain of ``gamma`` drafts from ``drafter`` (a draft model, or heads
    with adaptive lengths; ``method`` from the heads' own by default) on ``prompts``, every
    draft verified (survival threshold EVERY_DRAFT) and scored by its raw confidence (identity
    calibration): per draft position, the engine's reliability counters as [bins, 3] (mean
    confidence, fraction accepted, drafts; non-empty bins). A draft is counted when the drafts
    before it in its round were all accepted, so the fraction is the conditional acceptance a
    calibration predicts."""
    from .config import SamplingParams, SpecConfig
    from .engine import generate
    spec = SpecConfig(method=_method_of(drafter, method), num_speculative_tokens=gamma,
                      survival_threshold=EVERY_DRAFT)
    out = generate(target, prompts, spec=spec, draft=_uncalibrated(drafter), key=seed,
                   sampling=SamplingParams(temperature=temperature,
                                           max_new_tokens=max_new_tokens))
    points = [np.asarray(bins, np.float64).reshape(-1, 3)
              for bins in out.stats.reliability_by_draft_position]
    if len(points) > POSITIONS:  # a Calibration's last map serves every deeper position too
        points = points[:POSITIONS - 1] + [np.concatenate(points[POSITIONS - 1:])]
    return points


MIN_POSITION_DRAFTS = 1000
"""calibrate_rounds fits a draft position a map of its own when its fitting rounds verified at
least this many drafts there; a position with fewer takes the map of the one before it."""


def fit_positions(fit: list[np.ndarray]) -> tuple[list[tuple[float, float]], tuple[float, float]]:
    """(a map (a, b) per draft position, the map of every position pooled) fitted to binned
    points per position, each [n, 3] (mean raw confidence, fraction accepted, drafts): a
    position's own weighted logistic fit when it has ``MIN_POSITION_DRAFTS`` drafts, else the
    map of the position before it (the pooled map for the first)."""
    pooled = np.concatenate(fit)
    pooled_map = _fit_logistic(pooled[:, 0], pooled[:, 1], weights=pooled[:, 2])
    maps = []
    for points in fit:
        if points[:, 2].sum() >= MIN_POSITION_DRAFTS:
            maps.append(_fit_logistic(points[:, 0], points[:, 1], weights=points[:, 2]))
        else:
            maps.append(maps[-1] if maps else pooled_map)
    return maps, pooled_map


def _log_loss(points: np.ndarray, predict) -> float:
    """Cross-entropy of cells [n, 3] (mean raw confidence, fraction accepted, drafts) under
    ``predict`` of each cell's mean confidence, summed over drafts."""
    c, y, n = points.T
    p = np.clip(predict(c), _EPS, 1 - _EPS)
    return float(-np.sum(n * (y * np.log(p) + (1 - y) * np.log1p(-p))))


def _positions_loss(maps, points: list[np.ndarray]) -> float:
    return sum(_log_loss(h, _logistic_map(*m)) for m, h in zip(maps, points))


def choose_form(first: list[np.ndarray], second: list[np.ndarray]) -> tuple[str, dict]:
    """("per position" or "one map", the cross-entropy of each and the margin): two-fold
    cross-validation between two sets of binned points per position, each [n, 3] (mean raw
    confidence, fraction accepted, drafts), each fitted (``fit_positions``) and scored on the
    other. A map per position must win by a margin, one nat per parameter it adds (two per
    position with a map of its own): where positions are alike, the two forms score within
    noise of each other and the simpler one ships."""
    losses = {"per position": 0.0, "one map": 0.0, "margin": 0.0}
    for fit, score in ((first, second), (second, first)):
        if np.concatenate(fit)[:, 2].sum() == 0:
            return "one map", {**losses, "per position": np.inf}  # nothing to fit a fold on
        maps, one = fit_positions(fit)
        losses["per position"] += _positions_loss(maps, score)
        losses["one map"] += _positions_loss([one] * len(maps), score)
        losses["margin"] += 2.0 * (len(set(maps)) - 1)
    better = (losses["margin"] > 0  # a map per position only where some position has its own
              and losses["per position"] + losses["margin"] < losses["one map"])
    return ("per position" if better else "one map"), losses


def calibrate_rounds(target, drafter, prompts: list[list[int]], *, method: str | None = None,
                     gamma: int = 4, temperature: float = 0.8, max_new_tokens: int = 128,
                     seed: int = 0) -> tuple[Calibration, dict]:
    """Fit a Calibration from real rounds, for any drafter with adaptive lengths (a draft
    model; Medusa, EAGLE, MTP or block-drafter heads): ``round_points`` on the even prompts is
    fitted, and the odd prompts score it.

    Two forms are fitted: a map per draft position (``fit_positions``: a position's own
    weighted logistic fit where it has ``MIN_POSITION_DRAFTS`` drafts) and one map for every
    position. Which one ships is chosen on the fitting prompts alone, by two-fold cross-
    validation between their two halves (prompts 0, 4, 8, ... and 2, 6, 10, ...; lower
    cross-entropy wins): a map per position pays where positions differ at the same
    confidence (a block drafter's later drafts, drawn without seeing the ones before them), and
    overfits where they do not. The report gives per mode (greedy; sampled at ``temperature``)
    the fit, the choice, and the held-out expected calibration error (binned by prediction, as
    Stats.calibration_error) of the raw confidence, of the shipped maps and of the other form."""
    _check_fit_args("calibrate_rounds", prompts, temperature,
                    "even ones fit, odd ones score; the even ones split in two to choose the form",
                    least=4)
    fitted, report = {}, {}
    for mode, t in (("greedy", 0.0), ("sampled", float(temperature))):
        quarters = [round_points(target, drafter, prompts[i::4], method=method, gamma=gamma,
                                 temperature=t, max_new_tokens=max_new_tokens, seed=seed)
                    for i in range(4)]
        fit = [np.concatenate(x) for x in zip(quarters[0], quarters[2])]
        held = [np.concatenate(x) for x in zip(quarters[1], quarters[3])]
        pooled = np.concatenate(fit)
        if pooled[:, 2].sum() == 0:
            raise ValueError(f"no drafts were verified in the {mode} rounds (prompts too long "
                             f"for the context, or max_new_tokens too small)")
        form, losses = choose_form(quarters[0], quarters[2])
        maps, one = fit_positions(fit)
        shipped = maps if form == "per position" else [one] * len(maps)
        fitted[mode] = ([m[0] for m in shipped], [m[1] for m in shipped])

        def mapped_cells(ms, held=held):
            return np.concatenate([np.stack([_logistic_map(*m)(h[:, 0]), h[:, 1], h[:, 2]], 1)
                                   for m, h in zip(ms, held)])
        other = [one] * len(maps) if form == "per position" else maps
        cells = np.concatenate(held)
        report[mode] = {
            "temperature": t, "samples": int(pooled[:, 2].sum() + cells[:, 2].sum()),
            "a": fitted[mode][0], "b": fitted[mode][1], "form": form,
            "cross_validated_loss": losses,
            "ece_raw": _ece_of_cells(cells), "ece": _ece_of_cells(mapped_cells(shipped)),
            "ece_other_form": _ece_of_cells(mapped_cells(other)),
            "drafts_by_position": {"fit": [int(p[:, 2].sum()) for p in fit],
                                   "held": [int(h[:, 2].sum()) for h in held]},
            "mean_acceptance": float(np.sum(cells[:, 1] * cells[:, 2])
                                     / max(cells[:, 2].sum(), 1.0)),
            "reliability": [{"position": k + 1, "predicted": float(p), "observed": float(y),
                             "count": int(n)}
                            for k, h in enumerate(held)
                            for p, y, n in zip(_logistic_map(*shipped[k])(h[:, 0]), h[:, 1],
                                               h[:, 2])]}
    return Calibration.of(fitted["greedy"], fitted["sampled"]), report


def stream_prompts(stream: np.ndarray, num_prompts: int, tokens: int) -> list[list[int]]:
    """``num_prompts`` prompts of ``tokens`` tokens cut at even spacing from a token stream
    (a held-out ``heldout.npy``): ``specjax train calibrate --prompts windows``."""
    if stream.size < num_prompts * tokens:
        raise ValueError(f"the stream has {stream.size} tokens, fewer than {num_prompts} "
                         f"prompts x {tokens} tokens = {num_prompts * tokens}")
    starts = np.linspace(0, stream.size - tokens, num_prompts).astype(int)
    return [[int(t) for t in stream[s:s + tokens]] for s in starts]


def definition_prompts(texts: list[str], num_prompts: int, lines: int = 15) -> list[str]:
    """``num_prompts`` prompts of up to ``lines`` lines that end with a function definition
    (``def`` or ``async def``, its line and a newline included), picked at even spacing among
    every such line of ``texts`` after the first line of its file: the shape of a request to
    complete a function (the bench's prompts have it). ValueError when there are too few."""
    ends = []
    for text in texts:
        rows = text.split("\n")
        for i, row in enumerate(rows):
            head = row.lstrip()
            if i >= 1 and (head.startswith("def ") or head.startswith("async def ")):
                ends.append("\n".join(rows[max(0, i - lines + 1):i + 1]) + "\n")
    if len(ends) < num_prompts:
        raise ValueError(f"the texts have {len(ends)} function definitions after a first line, "
                         f"fewer than the {num_prompts} prompts asked for")
    return [ends[i] for i in np.linspace(0, len(ends) - 1, num_prompts).astype(int)]


def calibrate_main(argv=None) -> int:
    """``specjax train calibrate``: fit a draft model folder's calibration and save it there."""
    import argparse
    ap = argparse.ArgumentParser(
        prog="specjax train calibrate",
        description="Fit the calibration of a draft model's confidence (adaptive draft lengths, "
                    "SpecConfig.survival_threshold) on held-out prompts, and save it as "
                    "calibration.json in the draft folder.")
    ap.add_argument("--target", help="the target folder (default: the bundled code-target)")
    ap.add_argument("--draft", help="the draft folder (default: the bundled code-draft)")
    ap.add_argument("--heads", help="a Medusa, EAGLE, MTP or block-drafter folder to calibrate "
                                    "instead of a draft model (fitted on real rounds: --fit "
                                    "rounds)")
    ap.add_argument("--fit", choices=("teacher", "rounds"), default=None,
                    help="teacher: the target's text, both models run over it once (draft "
                         "models; the default for them); rounds: real rounds of a γ-draft "
                         "chain with every draft verified (any drafter; the only way for heads)")
    ap.add_argument("--gamma", type=int, default=None,
                    help="--fit rounds: the chain's γ (default 4; positions past 16 share the "
                         "16th's map)")
    ap.add_argument("--data", default="~/specjax-work",
                    help="the folder `specjax train pair data` wrote (corpus.json, heldout.npy)")
    ap.add_argument("--prompts", choices=("definitions", "windows"), default="definitions",
                    help="definitions: 15 lines ending with a function definition, from the "
                         "held-out files no bench prompt set uses (default); windows: "
                         "--prompt-tokens tokens cut from the held-out token stream")
    ap.add_argument("--num-prompts", type=int, default=256,
                    help="half fit, half score (with fewer, the fit follows those prompts' own "
                         "acceptance more than the drafter's; docs/adaptive.md)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="--prompts windows only")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.8, help="the sampled rows' fit")
    ap.add_argument("--out", help="folder to write calibration.json to (default: --draft or "
                                  "--heads)")
    from .cli import show_defaults
    args = show_defaults(ap).parse_args(argv)
    if args.heads and args.draft:
        ap.error("give --draft or --heads, not both")
    if args.heads and args.fit == "teacher":
        ap.error("--heads fits on real rounds only (--fit rounds): heads draft from their own "
                 "features, which teacher forcing does not give")
    fit = args.fit or ("rounds" if args.heads else "teacher")
    if args.gamma is not None and fit != "rounds":
        ap.error("--gamma is the chain of --fit rounds; --fit teacher scores every position of "
                 "the target's text")
    args.gamma = 4 if args.gamma is None else args.gamma
    for name in ("num_prompts", "prompt_tokens", "max_new_tokens", "gamma"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    least = 4 if fit == "rounds" else 2  # what calibrate_rounds and calibrate split
    if args.num_prompts < least:
        ap.error(f"--num-prompts must be >= {least} for --fit {fit} (half fit, half score), got "
                 f"{args.num_prompts}")
    if not args.temperature > 0:
        ap.error(f"--temperature must be > 0 (the sampled rows' fit), got {args.temperature}")
    from .bundle import bundled
    from .checkpoint import load_model
    try:
        args.target = args.target or str(bundled("code-target"))
        if not args.heads:
            args.draft = args.draft or str(bundled("code-draft"))
    except FileNotFoundError as e:
        ap.error(str(e))
    from .draft.draft_model import load_draft_model
    data = pathlib.Path(args.data).expanduser()
    need = data / ("corpus.json" if args.prompts == "definitions" else "heldout.npy")
    if not need.is_file():
        ap.error(f"--data {args.data}: no {need.name} there; build it with `specjax train pair "
                 f"data --workdir DIR` and pass --data DIR")
    try:
        if args.prompts == "definitions":
            from .tokenizer import load_tokenizer
            from .train.pair import calibration_prompts
            prompts = calibration_prompts(data, load_tokenizer(args.target), args.num_prompts)
        else:
            prompts = stream_prompts(np.load(need), args.num_prompts, args.prompt_tokens)
    except (ValueError, OSError) as e:
        raise SystemExit(f"{need}: {e}") from None
    folder = pathlib.Path(args.out or args.heads or args.draft)
    if args.out:  # made now, not after minutes of fitting
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            ap.error(f"--out {args.out}: {e}")
    try:
        target = load_model(args.target, dtype="float32")
        if args.heads:
            from .draft.heads import load_heads
            draft = load_heads(args.heads, target)
        else:
            draft = load_draft_model(args.draft, dtype="float32")
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    if fit == "rounds":
        calibration, report = calibrate_rounds(target, draft, prompts, gamma=args.gamma,
                                               temperature=args.temperature,
                                               max_new_tokens=args.max_new_tokens)
    else:
        calibration, report = calibrate(target, draft, prompts, temperature=args.temperature,
                                        max_new_tokens=args.max_new_tokens)
    for mode, r in report.items():
        shown = (lambda v: " ".join(f"{x:.3f}" for x in np.atleast_1d(v)))
        one = (f"; {r['form']} chosen, the other form {r['ece_other_form']:.3f}"
               if "form" in r else "")
        print(f"{mode}: a={shown(r['a'])} b={shown(r['b'])}; held-out ECE {r['ece']:.3f} (raw "
              f"confidence {r['ece_raw']:.3f}{one}); mean acceptance "
              f"{r['mean_acceptance']:.3f}, {r['samples']} samples")
    report["command"] = ("specjax train calibrate " + " ".join(argv if argv is not None
                                                                else []))
    report["fit"] = fit
    save_calibration(calibration, folder, report, draft)  # with the weights it was fitted for
    print(f"wrote {folder / FILE}")
    return 0
