"""Suffix decoding against n-gram lookup and plain decoding on the bundled pair, as a user calls
it (``sj.generate`` with its defaults, greedy): first on fresh prompts (the corpus holds nothing
the rows will write), then on the same prompts again, where the corpus holds the earlier outputs
(a request re-derived, as agents and refinement loops do). Variants interleaved, median of the
repeats; speed-ups against autoregressive decoding in the same repeats.

    .venv/bin/python experiments/suffix_repeat.py [--prompts 4] [--max-new-tokens 128] [--repeats 5]
"""

import argparse
import statistics
import time

import numpy as np

import specjax as sj
from specjax import bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--tree", action="store_true",
                    help="also the branching tree (sj.draft.suffix.branching_tree) with the corpus")
    args = ap.parse_args()
    target = sj.load_model(sj.bundled("code-target"))
    tok = sj.load_tokenizer(sj.bundled("code-target"))
    prompts = [tok.encode(p["text"])[-96:] for p in bench.load_prompts()[:args.prompts]]
    greedy = sj.SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens)
    ngram = sj.SpecConfig(method="ngram", num_speculative_tokens=args.gamma)
    suffix = sj.SpecConfig(method="suffix", num_speculative_tokens=args.gamma)
    warm = sj.draft.SuffixCache(65536)
    sj.generate(target, prompts, sampling=greedy, spec=suffix, draft=warm)  # the earlier call
    variants = {"autoregressive": dict(), "ngram": dict(spec=ngram),
                "suffix, own text only": dict(spec=suffix),
                "suffix, earlier outputs in the corpus": dict(spec=suffix, draft=warm)}
    if args.tree:
        tree = sj.SpecConfig(method="suffix", tree=sj.draft.suffix.branching_tree(args.gamma).paths)
        variants["suffix tree, earlier outputs in the corpus"] = dict(spec=tree, draft=warm)
    reference = None
    times = {name: [] for name in variants}
    lengths = {}
    for name, kw in variants.items():  # compile and check
        outs = [sj.generate(target, [p], sampling=greedy, **kw) for p in prompts]
        tokens = [o.tokens for o in outs]
        reference = reference or tokens
        assert all(np.array_equal(a, b) for a, b in zip(tokens, reference)), name
        lengths[name] = statistics.mean(o.stats.mean_accepted_length for o in outs)
    for _ in range(args.repeats):
        for name, kw in variants.items():
            t0 = time.perf_counter()
            for p in prompts:
                sj.generate(target, [p], sampling=greedy, **kw)
            times[name].append(time.perf_counter() - t0)
    ar = statistics.median(times["autoregressive"])
    print(f"{len(prompts)} bench prompts (last 96 tokens), {args.max_new_tokens} new tokens, "
          f"greedy, γ = {args.gamma} (suffix: a chain of {args.gamma}"
          + (f"; branching tree: {len(sj.draft.suffix.branching_tree(args.gamma).paths)} nodes"
             if args.tree else "") + f"), median of {args.repeats} interleaved repeats of whole "
          f"generate calls; outputs identical")
    for name in variants:
        t = statistics.median(times[name])
        print(f"  {name:40} {t * 1e3:8.1f} ms  speed-up {ar / t:5.2f}x  "
              f"tokens a round {lengths[name]:.2f}")
    print(f"corpus: {warm}")


if __name__ == "__main__":
    main()
