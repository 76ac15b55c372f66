"""N-gram prompt lookup vs autoregressive decoding, greedy, on input-grounded prompts and on
prompts without repetition (greedy, and sampled at T = 1 with the same key for both), in one run.

    .venv/bin/python experiments/bench_ngram.py [--target checkpoints/code-target]
        [--settings 4,2,4 8,2,8,1.5 12,2,8,1.5] [--prompts grounded grounded-check free "free T=1"]
        [--max-new-tokens 128] [--repeats 3] [--json out.json]

Each setting is gamma,min,max[,length factor] (SpecConfig's num_speculative_tokens,
prompt_lookup_min, prompt_lookup_max, prompt_lookup_length_factor), or a JSON speculative config
of another model-free method ('{"method": "suffix"}', '{"method": "lookahead"}'); all settings
and the autoregressive baseline run interleaved on each prompt in one process.

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
# More prompts of the same two kinds, written before any were run, to check that lookup settings
# chosen on GROUNDED carry over to prompts they were not chosen on.
CLASS = '''class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def __repr__(self):
        return f"Point({self.x}, {self.y})"

    def distance(self, other):
        dx = self.x - other.x
        dy = self.y - other.y
        return (dx * dx + dy * dy) ** 0.5


'''
GROUNDED_CHECK = [
    CLASS + "class Vector:\n    def __init__(self, x, y):\n",
    "    def test_parse(self):\n" + "".join(
        f"        self.assertEqual(parse_int(\"{i}\"), {i})\n" for i in range(10))
    + "        self.assertEqual(parse_int(\"10\")",
    CLASS.replace("distance", "length") + CLASS[:80],
]
PROMPT_SETS = {"grounded": (GROUNDED, 0.0), "grounded-check": (GROUNDED_CHECK, 0.0),
               "free": (FREE, 0.0), "free T=1": (FREE, 1.0)}


def setting(text: str) -> sj.SpecConfig:
    """"γ,min,max" or "γ,min,max,factor" -> an n-gram SpecConfig; a JSON object (vLLM's
    speculative config, e.g. '{"method": "suffix", "num_speculative_tokens": 4}') -> that."""
    if text.lstrip().startswith("{"):
        return sj.SpecConfig.parse(text)
    parts = text.split(",")
    if len(parts) not in (3, 4):
        raise SystemExit(f"--settings {text!r}: want gamma,min,max[,length_factor]")
    gamma, lo, hi = (int(x) for x in parts[:3])
    return sj.SpecConfig(method="ngram", num_speculative_tokens=gamma, prompt_lookup_min=lo,
                         prompt_lookup_max=hi,
                         prompt_lookup_length_factor=float(parts[3]) if len(parts) == 4 else None)


def run(target, tok, prompt, specs, n, repeats, temperature=0.0):
    """Autoregressive and every setting on one prompt, interleaved; the best of `repeats` each
    (the first round compiles and is dropped)."""
    sampling = sj.SamplingParams(temperature=temperature, max_new_tokens=n)
    ids = [tok.encode(prompt)]
    best = {}
    for _ in range(repeats + 1):
        for name, s in [("autoregressive", None), *specs.items()]:
            out = sj.generate(target, ids, sampling=sampling, spec=s)
            if out.stats.compile_seconds == 0 and (
                    name not in best or out.stats.decode_seconds < best[name].stats.decode_seconds):
                best[name] = out
    ar = best["autoregressive"]
    figures = {}
    for name in specs:
        ng = best[name]
        if temperature == 0:
            assert np.array_equal(ar.tokens, ng.tokens), (
                f"{name} output differs from autoregressive")
        s = ng.stats
        figures[name] = dict(
            ar_tokens_per_second=ar.stats.decode_tokens_per_second,
            ngram_tokens_per_second=s.decode_tokens_per_second,
            speedup=s.decode_tokens_per_second / ar.stats.decode_tokens_per_second,
            acceptance_rate=s.acceptance_rate, mean_accepted_length=s.mean_accepted_length,
            proposal_rate=s.proposal_rate,
            per_position_acceptance=[float(x) for x in s.per_position_acceptance])
    return figures


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="checkpoints/code-target")
    ap.add_argument("--settings", nargs="+", default=["4,2,4", "8,2,8,1.5", "12,2,8,1.5"],
                    help="n-gram settings to compare in one run, each gamma,min,max[,factor] "
                         "(default: the SpecConfig defaults at gamma 4, and gamma 8 and 12 with "
                         "lookup 2..8 and length factor 1.5)")
    ap.add_argument("--prompts", nargs="+", default=list(PROMPT_SETS), choices=list(PROMPT_SETS))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    specs = {text: setting(text) for text in args.settings}
    target = sj.load_model(args.target, dtype="float32")
    tok = sj.load_tokenizer(args.target)
    rows = {}
    print(f"target {args.target} ({target.config.num_params / 1e6:.1f}M), "
          f"{args.max_new_tokens} new tokens, batch 1 per prompt, best of {args.repeats}; "
          f"settings gamma,min,max[,length factor]")
    print(f"{'prompts':15}{'setting':12}{'AR tok/s':>10}{'ngram tok/s':>13}{'speed-up':>10}"
          f"{'per prompt':>20}{'accept':>8}{'tokens/round':>14}{'matched':>9}")
    # The small bundled target's greedy continuations of the free prompts loop (and so repeat
    # themselves); sampled at T = 1 they do not, which shows what lookup costs when it rarely
    # matches.
    for name in args.prompts:
        prompts, temperature = PROMPT_SETS[name]
        per_prompt = [run(target, tok, p, specs, args.max_new_tokens, args.repeats, temperature)
                      for p in prompts]
        for text in specs:
            figures = [f[text] for f in per_prompt]
            row = {k: statistics.mean(f[k] for f in figures)
                   for k in figures[0] if k != "per_position_acceptance"}
            rows.setdefault(name, {})[text] = dict(row, per_prompt=figures)
            each = " ".join(f"{f['speedup']:.2f}" for f in figures)
            print(f"{name:15}{text:12}{row['ar_tokens_per_second']:10.0f}"
                  f"{row['ngram_tokens_per_second']:13.0f}{row['speedup']:9.2f}x{each:>20}"
                  f"{row['acceptance_rate']:8.2f}{row['mean_accepted_length']:14.2f}"
                  f"{row['proposal_rate']:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
