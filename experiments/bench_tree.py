"""Chains against trees on the bundled pair, all in one run.

For each temperature (greedy and 0.8): plain autoregressive decoding, the draft model alone (for
c), a chain of 4 drafts and trees of the same or nearby depth, each over the held-out bench
prompts, interleaved repeats (see specjax/bench.py). Per variant: mean accepted length,
per-depth acceptance, the target's cost of verifying N nodes against one decode step
(``verify``), tokens/s and the speed-up over autoregressive decoding.

    .venv/bin/python experiments/bench_tree.py [--repeats 3] [--json tree.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import specjax as sj
from specjax import bench

TREES = {
    # depth 4; "chain" is the chain proposer itself (sampled drafts, the chain rule), "top-1 path"
    # the same shape through the tree code (the draft's argmax children, the tree rule)
    "chain": None,
    "top-1 path": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]],
    "narrow-deep": [[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 1]],
    # depth 3
    "six-node": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]],
    "balanced": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]],
    # depth 2
    "wide-shallow": [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [2, 0]],
}
ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(ROOT / "checkpoints" / "code-target"))
    ap.add_argument("--draft", default=str(ROOT / "checkpoints" / "code-draft"))
    ap.add_argument("--trees", nargs="+", default=list(TREES), choices=list(TREES))
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--json")
    args = ap.parse_args()
    target, draft = sj.load_model(args.target, "float32"), sj.load_model(args.draft, "float32")
    tok = sj.load_tokenizer(args.target)
    prompts = [tok.encode(p["text"]) for p in bench.load_prompts()][:args.num_prompts]
    specs = [sj.SpecConfig(num_speculative_tokens=4) if TREES[name] is None
             else sj.SpecConfig(tree=TREES[name]) for name in args.trees]
    result = bench.run_bench(target, prompts, specs, draft=draft,
                             temperatures=args.temperatures, max_new_tokens=args.max_new_tokens,
                             repeats=args.repeats, log=lambda m: print(m, file=sys.stderr))
    names = {bench._label(s): n for s, n in zip(specs, args.trees)}
    print("trees: " + "; ".join(f"{names[bench._label(s)]} = {bench._label(s)} "
                                f"(nodes/depth)" for s in specs))
    print(bench.format_table(result))
    if args.json:
        result["settings"]["tree_names"] = names
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
