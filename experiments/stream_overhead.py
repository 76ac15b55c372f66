"""What streaming costs: ``sj.stream`` (a host sync and a history read after every segment of
rounds) against ``sj.generate`` (one compiled loop), on the bundled pair with the Python API's
defaults, greedy, batch 1, interleaved repeats; medians and the ratio printed.

    .venv/bin/python experiments/stream_overhead.py [--new-tokens 128] [--repeats 7]
"""

from __future__ import annotations

import argparse

import specjax as sj
from specjax import timing


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prompt", default="import os\n\n\ndef read_config(path):\n")
    args = ap.parse_args()
    target = sj.load_model(sj.bundled("code-target"))
    draft = sj.load_draft_model(sj.bundled("code-draft"))
    tok = sj.load_tokenizer(sj.bundled("code-target"))
    kw = dict(sampling=sj.SamplingParams(temperature=0, max_new_tokens=args.new_tokens),
              spec=sj.SpecConfig(num_speculative_tokens=4), draft=draft, tokenizer=tok)
    runs = {"generate": lambda: sj.generate(target, [args.prompt], return_text=True, **kw)}
    for rounds in (None, 1, 4):
        runs[f"stream, {rounds or '~20 ms of'} round(s) a chunk"] = (
            lambda r=rounds: list(sj.stream(target, [args.prompt], rounds_per_chunk=r, **kw)))
    for run in runs.values():
        run()  # compile
    medians = timing.median_seconds(
        {name: lambda run=run: timing.timed(run)[1] for name, run in runs.items()}, args.repeats)
    base = medians["generate"]
    print(f"{args.new_tokens} new tokens, greedy, batch 1, median of {args.repeats} interleaved "
          f"calls (prefill and text included)")
    for name, m in medians.items():
        print(f"{name:34} {1e3 * m:8.1f} ms   x{m / base:.3f} of generate")


if __name__ == "__main__":
    main()
