"""How well the verify budget's cost model predicts what a round costs, fitted two ways.

A round of a static chain of g drafts costs, beyond what a plain decode step costs besides its
forward, o + c·g + v_g in one-token steps (v_g: the target's forward over g + 1 tokens). Two
fits of c and o:

* "bare": c is the draft's one-token forward timed apart, o what a round of γ drafts leaves
  (``adaptive.measure_costs`` until 2026-12-07);
* "rounds": c is the slope between whole rounds of 1 and γ drafts less what their verify
  forwards differ by (never below the bare forward), o what the round of one draft leaves
  (``adaptive.fit_round_costs``, what ``measure_costs`` does since 2026-12-07).

Both are fitted on rounds of 1 and γ drafts and then asked for the rounds in between (chains of
2 and 4 drafts at γ = 8), timed in the same interleaved repeats: generate's own programs for the
bundled pair (``timing.round_timers``), a random 32-token prompt after 32 decoded tokens,
median of ``--repeats`` interleaved calls, at each batch size and temperature.

    .venv/bin/python experiments/budget_round_fit.py [--batch-size 1,4,16] [--temperatures 0,0.8]
        [--gamma 8] [--between 2,4] [--repeats 15]
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

import specjax as sj
from specjax import adaptive, engine, timing

CKPT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", default="1,4,16")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--between", default="2,4")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    target = sj.load_model(CKPT / "code-target")
    draft = sj.load_draft_model(CKPT / "code-draft")
    G, context, decoded = args.gamma, 64, 32
    between = [int(g) for g in args.between.split(",")]
    prompt = np.random.default_rng(0).integers(1, target.config.vocab_size,
                                               context - decoded).tolist()
    print("batch  T    | c bare  o bare | c rounds  o rounds | g  measured  bare (error)  "
          "rounds (error)")
    for B in (int(b) for b in args.batch_size.split(",")):
        rows = engine.bucket(B, minimum=1)
        for T in (float(t) for t in args.temperatures.split(",")):
            sampling = sj.SamplingParams(temperature=T, max_new_tokens=decoded + 2 * G + 2)
            capacity = context + G + 2
            timers = {w: timing.forward_timer(target, w, capacity, context, batch=rows)
                      for w in range(1, G + 2)}
            timers["draft"] = timing.forward_timer(draft, 1, capacity, context, batch=rows)
            for g in sorted({1, G, *between}):
                timers[("round", g)] = timing.round_timers(
                    target, prompt, sampling=sampling,
                    spec=sj.SpecConfig(num_speculative_tokens=g), draft=draft,
                    decoded=decoded, batch=B)["round"]
            timers["plain"] = timing.round_timers(target, prompt, sampling=sampling,
                                                  decoded=decoded, batch=B)["round"]
            s = timing.median_seconds(timers, args.repeats)
            step = s[1]
            v = [s[w] / step for w in range(1, G + 2)]
            plain = s["plain"] / step - 1.0
            rounds = {g: s[k] / step - plain for k in s if isinstance(k, tuple)
                      for g in [k[1]]}
            bare_c = s["draft"] / step
            bare_o = max(rounds[G] - v[G] - G * bare_c, 0.0)
            c, o = adaptive.fit_round_costs({1: rounds[1], G: rounds[G]}, v, bare_c)
            for i, g in enumerate(between):
                lead = (f"{B:5}  {T:3} | {bare_c:6.3f}  {bare_o:6.3f} | {c:8.3f}  {o:8.3f} |"
                        if i == 0 else " " * 43 + "|")
                want = rounds[g]
                got_bare, got_rounds = bare_o + bare_c * g + v[g], o + c * g + v[g]
                print(f"{lead} {g}  {want:8.3f}  {got_bare:5.3f} ({got_bare / want - 1:+6.1%})  "
                      f"{got_rounds:6.3f} ({got_rounds / want - 1:+6.1%})", flush=True)


if __name__ == "__main__":
    main()
