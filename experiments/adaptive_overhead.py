"""What an adaptive chain's round costs beyond the static chain's.

Issue 21's batch-16 cell: the adaptive draft-model chain yields the same tokens a round as the
static one, and each round cost more. This times one round of ``sj.generate``'s own program
(``sj.timing.round_timers``, the bundled pair, the first bench prompt copied to ``--batch``
rows), interleaved, for programs that verify every draft (threshold 1e-9, so the work is the
same and only the program differs):

- ``static``: the static chain of γ.
- ``adaptive``: adaptive lengths as shipped: a ``lax.cond`` per later draft step, the drafts
  proposed a round ahead and verified at the width generate's loop picks for them
  (``engine._rounds``; here all γ + 1).
- ``adaptive, width by switch``: the same round with its width chosen inside it by a
  ``lax.switch`` whose branches leave the cache unwritten, the chunk written after it (how
  generate's loop ran adaptive rounds until 2026-12-04; ``engine.round_step`` with no width).

Prints each program's round time and its ratio to the static chain's, per repeat block.

    python experiments/adaptive_overhead.py --batch 16 --temperature 0.8
    python experiments/adaptive_overhead.py --max-new-tokens 256   # a cache past one block

The cache's capacity follows ``--max-new-tokens``: up to 256 slots attention is one dense
block, past it blocked (experiments/results/2026-12-03-adaptive-round-cost.md,
experiments/results/2026-12-04-verify-width-loops.md).
"""

from __future__ import annotations

import argparse
import pathlib

import specjax as sj
from specjax import bench, timing

CKPT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--gamma", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds per block")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96,
                    help="sets the cache's capacity, hence dense or blocked attention")
    args = ap.parse_args()
    tok = sj.load_tokenizer(CKPT / "code-target")
    target = sj.load_model(CKPT / "code-target")
    draft = sj.load_draft_model(CKPT / "code-draft")
    prompt = tok.encode(bench.load_prompts()[0]["text"])
    sampling = sj.SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    timers = {}
    for name, threshold, switch in (("static", None, False), ("adaptive", 1e-9, False),
                                    ("adaptive, width by switch", 1e-9, True)):
        spec = sj.SpecConfig(method="draft_model", num_speculative_tokens=args.gamma,
                             survival_threshold=threshold)
        timers[name] = timing.round_timers(target, prompt, spec=spec, draft=draft, decoded=32,
                                           batch=args.batch, sampling=sampling,
                                           switch=switch)["round"]
    print(f"batch {args.batch}, γ {args.gamma}, T {args.temperature}: one round, ms "
          f"(÷ static), median of {args.repeats} interleaved")
    for _ in range(args.blocks):
        seconds = timing.median_seconds(timers, args.repeats)
        print("  " + " | ".join(f"{k} {1e3 * v:.2f} ({v / seconds['static']:.3f})"
                                for k, v in seconds.items()))


if __name__ == "__main__":
    main()
