"""What a round costs when the verify budget declines every round: with rests (the default,
``SpecConfig.idle_rounds``), with longer rests, and without them, against plain decoding.

The budget's forward costs are set so that no draft ever pays (a two-token forward costing 9
steps), so every round is a decline: without rests each still runs the draft's catch-up
forward and the proposal; with them the rounds skip the draft. Decode seconds per loop round,
median of interleaved repeats, in one process:

    python experiments/rest_cost.py --batch 32 --temperature 0.8 [--gamma 2]
"""

from __future__ import annotations

import argparse
import functools
import pathlib

import numpy as np

import specjax as sj
from specjax import bench, timing

CKPT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gamma", type=int, default=2)
    args = ap.parse_args()
    tok = sj.load_tokenizer(CKPT / "code-target")
    target = sj.load_model(CKPT / "code-target", dtype="float32")
    draft = sj.load_draft_model(CKPT / "code-draft", "float32")
    prompts = [tok.encode(p["text"]) for p in bench.load_prompts()]
    rows = [prompts[i % len(prompts)] for i in range(args.batch)]
    sampling = sj.SamplingParams(temperature=args.temperature,
                                 max_new_tokens=args.max_new_tokens)
    never = dict(num_speculative_tokens=args.gamma, verify_costs=(1.0,) + (9.0,) * args.gamma,
                 draft_cost=0.09)
    variants = {
        "autoregressive": {},
        "rests (idle_rounds 16, default)": dict(spec=sj.SpecConfig(**never), draft=draft),
        "rests (idle_rounds 64)": dict(spec=sj.SpecConfig(**never, idle_rounds=64),
                                       draft=draft),
        "no rests (idle_rounds 0)": dict(spec=sj.SpecConfig(**never, idle_rounds=0),
                                         draft=draft),
    }
    stats = {name: sj.generate(target, rows, sampling=sampling, **v).stats  # compiles
             for name, v in variants.items()}

    def per_round(v: dict) -> float:
        s = sj.generate(target, rows, sampling=sampling, **v).stats
        return s.decode_seconds / max(s.num_rounds, 1)
    seconds = timing.interleaved({name: functools.partial(per_round, v)
                                  for name, v in variants.items()}, args.repeats)
    ar = np.median(seconds["autoregressive"])
    print(f"batch {args.batch}, T = {args.temperature}, γ {args.gamma}, {args.max_new_tokens} "
          f"new tokens, median of {args.repeats} interleaved repeats")
    print(f"{'variant':<34}{'rounds':>7}{'rested':>7}{'draft fwd':>10}{'ms/round':>10}"
          f"{'AR/variant':>11}   per repeat (ms/round)")
    for name, s in stats.items():
        mine = np.median(seconds[name])
        print(f"{name:<34}{s.num_rounds:7d}{s.rested_rounds:7d}{s.draft_calls:10d}"
              f"{1e3 * mine:10.2f}{ar / mine:11.3f}   "
              + " ".join(f"{1e3 * x:.2f}" for x in seconds[name]))


if __name__ == "__main__":
    main()
