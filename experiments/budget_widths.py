"""The verify budget charged the forward its loop runs, against the forward over k + 1 tokens.

An adaptive chain's decode loop has a forward of each of ``adaptive.loop_widths(γ)`` only (1, 2,
3, 5, 9 at γ = 8), so a round verifying k drafts pays the narrowest of them holding k + 1
tokens. Until 2026-12-06 ``Budget.cost(k)`` charged the forward over k + 1 tokens, so at γ = 8
a round of five drafts looked like a six-token forward and paid a nine-token one. This runs the
bundled pair at γ = 8 with a survival threshold and the verify budget (costs measured by
``measure_costs`` at each batch size) both ways in one process: the cost table is data of the
call, so the two share one compiled program and differ only in the table. Beside them the
static chains of 2 and 8 and autoregressive decoding; every variant interleaved per repeat,
speed-ups against autoregressive decoding in the same repeat (median), tokens a round and
drafts verified a round.

    .venv/bin/python experiments/budget_widths.py [--batch-size 1,4,16] [--temperatures 0,0.8]
        [--gamma 8] [--repeats 3] [--max-new-tokens 96] [--before k-plus-1-forward]

``--before k-draft-steps`` compares instead the draft steps charged (2026-12-07): a round
verifying k < γ drafts has run k + 1 draft steps (the one that scored draft k + 1 decided not to
verify it), charged since then, against the k charged before.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import statistics

import specjax as sj
from specjax import adaptive, bench

CKPT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"


@contextlib.contextmanager
def charged(rule, on: bool):
    """Budget.cost of a round verifying k >= 1 drafts replaced by an earlier ``rule`` while on."""
    cost = adaptive.Budget.cost

    def old(self, k):
        if self.table is not None or k == 0:
            return cost(self, k)
        return rule(self, k)
    if on:
        adaptive.Budget.cost = old
    try:
        yield
    finally:
        adaptive.Budget.cost = cost


def k_plus_1_forward(budget, k: int) -> float:
    """Until 2026-12-06: the forward over k + 1 tokens (and k draft steps)."""
    return budget.round_cost + budget.draft_cost * k + budget.verify_costs[k]


def k_draft_steps(budget, k: int) -> float:
    """Until 2026-12-07: the loop's forward, and k draft steps."""
    width = next(w for w in adaptive.loop_widths(budget.gamma) if w > k)
    return budget.round_cost + budget.draft_cost * k + budget.verify_costs[width - 1]


BEFORE = {"k-plus-1-forward": ("budget, loop's forward", "budget, k + 1 forward",
                               k_plus_1_forward),
          "k-draft-steps": ("budget, k + 1 draft steps", "budget, k draft steps",
                            k_draft_steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", default="1,4,16")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--threshold", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--before", choices=tuple(BEFORE), default="k-plus-1-forward",
                    help="the earlier charge compared with today's")
    args = ap.parse_args()
    now_name, before_name, charged_before = BEFORE[args.before]
    target = sj.load_model(CKPT / "code-target")
    draft = sj.load_draft_model(CKPT / "code-draft")  # with its draft vocabulary and calibration
    tok = sj.load_tokenizer(CKPT / "code-target")
    texts = [p["text"] for p in bench.load_prompts()]
    G = args.gamma
    print(f"γ {G}, threshold {args.threshold}, loop widths {adaptive.loop_widths(G)}")
    for B in (int(b) for b in args.batch_size.split(",")):
        # every prompt at least once, cycled to whole batches (until 2026-12-07 the first B
        # prompts only: batch 1 ran the first prompt alone)
        cycled = [texts[i % len(texts)] for i in range(-(-len(texts) // B) * B)]
        groups = [cycled[i:i + B] for i in range(0, len(cycled), B)]
        costs = adaptive.measure_costs(target, draft, batch_size=B, gamma=G)
        print(f"\nbatch {B}: forward costs {[round(c, 3) for c in costs.verify_costs]}, "
              f"a draft in a round {costs.draft_cost:.3f}, round's fixed part "
              f"{costs.round_cost:.3f}, a round verifying none {costs.cost(0):.3f}")
        budget = dict(survival_threshold=args.threshold, verify_costs=costs.verify_costs,
                      draft_cost=costs.draft_cost, round_cost=costs.round_cost,
                      decline_cost=costs.decline_cost)
        variants = {"autoregressive": (None, False),
                    "static 2": (dict(num_speculative_tokens=2), False),
                    f"static {G}": (dict(num_speculative_tokens=G), False),
                    now_name: (dict(num_speculative_tokens=G, **budget), False),
                    before_name: (dict(num_speculative_tokens=G, **budget), True)}
        for T in (float(t) for t in args.temperatures.split(",")):
            sampling = sj.SamplingParams(temperature=T, max_new_tokens=args.max_new_tokens)
            # per variant and repeat: decode seconds, tokens, rounds, drafts over every group
            runs = {name: [] for name in variants}
            for r in range(args.repeats + 1):  # the first: compiling
                for name, (spec, old) in variants.items():
                    total = [0.0, 0, 0, 0]
                    for prompts in groups:
                        with charged(charged_before, old):
                            out = sj.generate(target, prompts, sampling=sampling, tokenizer=tok,
                                              spec=spec, draft=None if spec is None else draft,
                                              key=r)
                        s = out.stats
                        for i, x in enumerate((s.decode_seconds, s.generated_tokens,
                                               s.num_rounds, s.proposed_tokens)):
                            total[i] += x
                    if r:
                        runs[name].append(total)
            ar = [t[0] / t[1] for t in runs["autoregressive"]]
            print(f"  T {T}:")
            for name, totals in runs.items():
                ratios = [a / (t[0] / t[1]) for a, t in zip(ar, totals)]
                last = totals[-1]
                rounds = max(last[2], 1)
                print(f"    {name:24} {statistics.median(ratios):5.2f}x  "
                      f"(per repeat {', '.join(f'{x:.2f}' for x in ratios)})  "
                      f"tokens a round {last[1] / rounds / B:5.2f}  "
                      f"drafts a round {last[3] / rounds / B:5.2f}")


if __name__ == "__main__":
    main()
