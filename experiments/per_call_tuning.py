"""What a call with another survival threshold or verify budget costs: the bundled pair, API
defaults (greedy, γ 4, 64 new tokens), the compile cache off, one process.

With the numbers in the program's plan (as before 2026-12-06) each value compiled a program of
its own; as data of the call (``adaptive.Tuning``) the first call compiles and the others run
its program. This runs every value both ways (the old way by keeping ``adaptive.split_tuning``
from splitting), then times the decode loop of both programs for two of the values,
interleaved, to show that reading the numbers as data costs the loop nothing.

    SPECJAX_COMPILATION_CACHE=off .venv/bin/python experiments/per_call_tuning.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import statistics
import time

import specjax as sj
from specjax import adaptive

CKPT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"
PROMPT = "import os\n\n\ndef walk(root):\n    \"\"\"Yield every file under root.\"\"\"\n"
SPECS = [dict(survival_threshold=t) for t in (0.1, 0.3, 0.6)] + [
    dict(verify_costs=c, draft_cost=0.08) for c in ((1.0, 1.1, 1.2, 1.3, 1.4),
                                                     (1.0, 1.3, 1.6, 1.9, 2.2))]


@contextlib.contextmanager
def numbers_in_the_plan(on: bool):
    split = adaptive.split_tuning
    if on:
        adaptive.split_tuning = lambda proposer: (proposer, None)
    try:
        yield
    finally:
        adaptive.split_tuning = split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    target = sj.load_model(CKPT / "code-target")
    draft = sj.load_model(CKPT / "code-draft")
    tok = sj.load_tokenizer(CKPT / "code-target")
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=64)

    def call(extra, in_plan):
        with numbers_in_the_plan(in_plan):
            t0 = time.perf_counter()
            out = sj.generate(target, [PROMPT], sampling=sampling, draft=draft, tokenizer=tok,
                              spec=sj.SpecConfig(num_speculative_tokens=4, **extra))
            return out, time.perf_counter() - t0

    for in_plan in (False, True):
        print("numbers in the plan (before)" if in_plan else "numbers per call")
        for extra in SPECS:
            out, wall = call(extra, in_plan)
            print(f"  {extra}: {wall:5.2f} s, of it compiling {out.stats.compile_seconds:5.2f} "
                  f"s, {out.stats.proposed_tokens} drafts proposed")
    timed = {(i, p): [] for i in (1, 4) for p in (False, True)}
    for _ in range(args.repeats):
        for (i, in_plan), samples in timed.items():
            samples.append(call(SPECS[i], in_plan)[0].stats.decode_seconds)
    print(f"decode loop, median of {args.repeats} interleaved calls:")
    for i in (1, 4):
        per_call, in_plan = (1e3 * statistics.median(timed[(i, p)]) for p in (False, True))
        print(f"  {SPECS[i]}: per call {per_call:.1f} ms, in the plan {in_plan:.1f} ms "
              f"(ratio {per_call / in_plan:.3f})")


if __name__ == "__main__":
    main()
