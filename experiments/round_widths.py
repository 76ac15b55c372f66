"""What a round of a chain with per-row lengths (n-gram, suffix) costs at each verify width, and
whether generate's rounds cost what the widths they ran predict.

Times generate's own round (``timing.round_timers``) at every width in ``engine.loop_widths(γ)``,
an autoregressive step, and whole ``sj.generate`` calls on the 10 held-out bench prompts (decode
seconds per round), interleaved; then weighs the width costs by the proposed-length distribution
the calls ran, against what those calls' rounds measured.

    python experiments/round_widths.py --method suffix --temperature 1
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

import specjax as sj
from specjax import bench, engine, timing

CKPT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="suffix")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    tok = sj.load_tokenizer(CKPT / "code-target")
    target = sj.load_model(CKPT / "code-target")
    prompts = [p["text"] for p in bench.load_prompts()][:10]
    spec = sj.SpecConfig(method=args.method, num_speculative_tokens=args.gamma)
    sampling = sj.SamplingParams(temperature=args.temperature, max_new_tokens=256)

    def timer(spec, width=None):
        return timing.round_timers(target, tok.encode(prompts[0]), sampling=sampling, spec=spec,
                                   decoded=64, width=width)["round"]

    widths = engine.loop_widths(args.gamma)
    timers = {w: timer(spec, w) for w in widths}
    timers["ar"] = timer(None)
    ran = {}

    def calls(spec, name):
        def run():
            seconds = rounds = 0
            dist = 0.0
            for i, prompt in enumerate(prompts):
                kw = {"spec": spec} if spec is not None else {}
                s = sj.generate(target, prompt, tokenizer=tok, key=i, sampling=sj.SamplingParams(
                    temperature=args.temperature, max_new_tokens=128), **kw).stats
                seconds += s.decode_seconds
                rounds += s.num_rounds
                if spec is not None:
                    dist = dist + np.asarray(s.proposed_length_distribution) * s.num_rounds
            ran[name] = (dist, rounds)
            return seconds / rounds
        return run
    timers["generate ar"] = calls(None, "generate ar")
    timers["generate"] = calls(spec, "generate")
    for f in timers.values():
        f()
    seconds = timing.median_seconds(timers, args.repeats)
    step = seconds["ar"]
    print(f"{args.method}, γ {args.gamma}, T = {args.temperature}, batch 1, median of "
          f"{args.repeats} interleaved repeats")
    for k, v in seconds.items():
        label = f"round at width {k}" if isinstance(k, int) else k
        print(f"  {label:22s} {v * 1e6:8.0f} µs  {v / step:.3f} × the autoregressive step")
    dist, rounds = ran["generate"]
    dist = dist / rounds
    at = [int(np.searchsorted(np.asarray(widths), k + 1)) for k in range(len(dist))]
    predicted = sum(d * seconds[widths[i]] for d, i in zip(dist, at))
    print(f"  proposed lengths 0..γ: {np.round(dist, 3).tolist()}")
    print(f"  predicted round from the widths {predicted / step:.3f} steps; generate's rounds "
          f"{seconds['generate'] / seconds['generate ar']:.3f} × its autoregressive rounds")


if __name__ == "__main__":
    main()
