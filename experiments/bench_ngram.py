"""N-gram prompt lookup vs autoregressive decoding, greedy, on input-grounded prompts and on
prompts without repetition (greedy, and sampled at T = 1 with the same key for both), in one run.

    .venv/bin/python experiments/bench_ngram.py [--target checkpoints/code-target]
        [--gamma 4] [--max-new-tokens 128] [--repeats 3] [--json out.json]

The target folder must hold a tokenizer (tokenizer.json). Input-grounded prompts: a function
followed by the start of the same function with one name changed; a long list of similar lines.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

import specjax as sj

FUNCTION = '''def read_config(path, defaults=None):
    """Read a JSON config file and merge it over the defaults."""
    import json
    settings = dict(defaults or {})
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(settings.get(key), dict):
            settings[key].update(value)
        else:
            settings[key] = value
    return settings

'''
GROUNDED = [
    FUNCTION + "def read_settings(path, defaults=None):\n",
    "".join(f"    parser.add_argument('--option-{i}', type=int, default={i}, "
            f"help='option {i}')\n" for i in range(12)) + "    parser.add_argument('--option-12'",
    FUNCTION.replace("read_config", "load_config") + FUNCTION[:60],
]
FREE = ["import os\n\n\ndef main():\n", "class Cache:\n    def __init__(self", "# Utilities\n"]


def run(target, tok, prompts, spec, n, repeats, temperature=0.0):
    greedy = sj.SamplingParams(temperature=temperature, max_new_tokens=n)
    ids = [tok.encode(p) for p in prompts]
    best = {}
    for _ in range(repeats + 1):  # the first round compiles
        for name, s in (("autoregressive", None), ("ngram", spec)):
            out = sj.generate(target, ids, sampling=greedy, spec=s)
            if out.stats.compile_seconds == 0 and (
                    name not in best or out.stats.decode_seconds < best[name].stats.decode_seconds):
                best[name] = out
    ar, ng = best["autoregressive"], best["ngram"]
    if temperature == 0:
        assert np.array_equal(ar.tokens, ng.tokens), "n-gram output differs from autoregressive"
    s = ng.stats
    return dict(ar_tokens_per_second=ar.stats.decode_tokens_per_second,
                ngram_tokens_per_second=s.decode_tokens_per_second,
                speedup=s.decode_tokens_per_second / ar.stats.decode_tokens_per_second,
                acceptance_rate=s.acceptance_rate, mean_accepted_length=s.mean_accepted_length,
                proposal_rate=s.proposal_rate,
                per_position_acceptance=[float(x) for x in s.per_position_acceptance])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="checkpoints/code-target")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    target = sj.load_model(args.target, dtype="float32")
    tok = sj.load_tokenizer(args.target)
    spec = sj.SpecConfig(method="ngram", num_speculative_tokens=args.gamma)
    rows = {}
    print(f"target {args.target} ({target.config.num_params / 1e6:.1f}M), greedy, gamma "
          f"{args.gamma}, {args.max_new_tokens} new tokens, batch 1 per prompt, best of "
          f"{args.repeats}")
    print(f"{'prompts':12}{'AR tok/s':>10}{'ngram tok/s':>13}{'speed-up':>10}{'accept':>8}"
          f"{'tokens/round':>14}{'matched':>9}")
    # The small bundled target's greedy continuations of the free prompts loop (and so repeat
    # themselves); sampled at T = 1 they do not, which shows what lookup costs when it rarely
    # matches.
    for name, prompts, temperature in (("grounded", GROUNDED, 0.0), ("free", FREE, 0.0),
                                       ("free T=1", FREE, 1.0)):
        figures = [run(target, tok, [p], spec, args.max_new_tokens, args.repeats, temperature)
                   for p in prompts]
        row = {k: statistics.mean(f[k] for f in figures)
               for k in figures[0] if k != "per_position_acceptance"}
        rows[name] = dict(row, per_prompt=figures)
        print(f"{name:12}{row['ar_tokens_per_second']:10.0f}{row['ngram_tokens_per_second']:13.0f}"
              f"{row['speedup']:9.2f}x{row['acceptance_rate']:8.2f}"
              f"{row['mean_accepted_length']:14.2f}{row['proposal_rate']:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
