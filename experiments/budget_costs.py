"""The verify budget costed by whole rounds of its own program, or by forwards and a fitted o.

``adaptive.measure_costs`` times the target's bare forwards over 1 .. γ + 1 tokens, each at a
small capacity, and fits the draft cost c and a round's fixed part o from whole static rounds
of 1 and γ drafts less a plain step's overhead ("fitted" below; until 2026-12-07 c was the
draft's bare forward and o a round of γ drafts less its forwards). The alternative here
times a round of the adaptive program itself at each of its loop widths, each proposing the
drafts its width holds, and one draft step inside its proposal ("rounds"). This runs the
bundled pair at γ = 8 with the budget both ways, beside static chains and autoregressive
decoding, every variant interleaved per repeat; speed-ups against autoregressive decoding in
the same repeat (median), tokens and drafts a row-round. Prompts: the bench's, cycled to whole
batches.

    .venv/bin/python experiments/budget_costs.py [--batch-size 1,4,16] [--temperatures 0,0.8]
        [--gamma 8] [--static 2,4] [--repeats 3] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

import numpy as np

import specjax as sj
from specjax import adaptive, bench, timing
from specjax.config import SamplingParams, SpecConfig

CKPT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"


def round_costs(target, draft, *, batch_size: int, gamma: int, context: int = 64,
                repeats: int = 9, temperature: float = 1.0) -> adaptive.Budget:
    """A budget from whole rounds of generate's own adaptive program: a round at each loop width
    w (``adaptive.loop_widths``), each proposing the w - 1 drafts its width holds (a cost table
    that makes those free and more dear), and the proposal of all γ drafts, whose γ-th part is
    one draft step c. cost(k) = R_w - c (w - 1 - k) for the narrowest loop width w holding
    k + 1 tokens, cost(0) = R_1, in units of R_1 - c: verify_costs[w - 1] = R_w - c (w - 1)
    (the widths no loop runs interpolated), round_cost 0."""
    widths = adaptive.loop_widths(gamma)
    decoded = context // 2
    prompt = np.random.default_rng(0).integers(1, target.config.vocab_size,
                                               max(context - decoded, 1)).tolist()
    sampling = SamplingParams(temperature=temperature, max_new_tokens=decoded + 2 * gamma + 2)
    timers = {}
    for w in widths:
        table = [1.0] * w + [1e6] * (gamma + 1 - w)
        spec = SpecConfig(num_speculative_tokens=gamma, verify_costs=table, idle_rounds=0)
        run = timing.round_timers(target, prompt, sampling=sampling, spec=spec, draft=draft,
                                  decoded=decoded, batch=batch_size, width=w)
        timers[w] = run["round"]
        if w == gamma + 1:
            timers["propose"] = run["propose"]
    s = timing.median_seconds(timers, repeats)
    c = s["propose"] / gamma
    unit = s[1] - c
    known = [1.0] + [(s[w] - c * (w - 1)) / unit for w in widths[1:]]
    verify = np.interp(np.arange(1, gamma + 2), widths, known)
    return adaptive.Budget.of([float(x) for x in verify], c / unit, gamma)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", default="1,4,16")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--static", default="2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    target = sj.load_model(CKPT / "code-target")
    draft = sj.load_draft_model(CKPT / "code-draft")  # its draft vocabulary and calibration
    tok = sj.load_tokenizer(CKPT / "code-target")
    texts = [p["text"] for p in bench.load_prompts()]
    G = args.gamma
    for B in (int(b) for b in args.batch_size.split(",")):
        prompts = [texts[i % len(texts)] for i in range(-(-len(texts) // B) * B)]
        groups = [prompts[i:i + B] for i in range(0, len(prompts), B)]
        # as the bench does: the caches filled to the median prompt and half the new tokens
        context = (sorted(len(tok.encode(t)) for t in texts)[len(texts) // 2]
                   + args.max_new_tokens // 2)
        budgets = {"fitted": adaptive.measure_costs(target, draft, batch_size=B, gamma=G,
                                                    context=context),
                   "rounds": round_costs(target, draft, batch_size=B, gamma=G, context=context)}
        print(f"\nbatch {B}, γ {G}, costs timed with {context} slots filled")
        for name, b in budgets.items():
            print(f"  costs, {name}: {[round(c, 3) for c in b.verify_costs]}, draft step "
                  f"{b.draft_cost:.3f}, fixed part {b.round_cost:.3f}; cost(k) "
                  f"{[round(b.cost(k), 2) for k in range(G + 1)]}")
        variants = {"autoregressive": None}
        variants.update({f"static {g}": dict(num_speculative_tokens=int(g))
                         for g in args.static.split(",")})
        variants.update({f"budget, {name}": dict(
            num_speculative_tokens=G, verify_costs=b.verify_costs, draft_cost=b.draft_cost,
            round_cost=b.round_cost, decline_cost=b.decline_cost)
            for name, b in budgets.items()})
        for T in (float(t) for t in args.temperatures.split(",")):
            sampling = sj.SamplingParams(temperature=T, max_new_tokens=args.max_new_tokens)
            seconds = {n: [] for n in variants}
            count = {n: np.zeros(3) for n in variants}  # tokens, row-rounds, drafts
            for r in range(args.repeats + 1):  # the first: compiling
                for name, spec in variants.items():
                    spent, tokens = 0.0, 0
                    for group in groups:
                        out = sj.generate(target, group, sampling=sampling, tokenizer=tok,
                                          spec=spec, draft=None if spec is None else draft,
                                          key=r)
                        spent += out.stats.decode_seconds
                        tokens += out.stats.generated_tokens
                        if r:
                            count[name] += (out.stats.generated_tokens,
                                            max(out.stats.num_rounds, 1) * len(group),
                                            out.stats.proposed_tokens)
                    if r:
                        seconds[name].append(spent / tokens)
            print(f"  T {T}:")
            for name in variants:
                ratios = [a / s for a, s in zip(seconds["autoregressive"], seconds[name])]
                tokens, rounds, drafts = count[name]
                print(f"    {name:18} {statistics.median(ratios):5.3f}x  (per repeat "
                      f"{', '.join(f'{x:.2f}' for x in ratios)})  tokens a row-round "
                      f"{tokens / rounds:5.2f}  drafts a row-round {drafts / rounds:5.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
