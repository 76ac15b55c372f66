"""A tree's round with each level expanded up to its last node with children, against every
node expanded, traced in one process.

A drafter fills a tree level by level: one draft forward over a level's nodes gives each node's
candidates for the next. A leaf has no children, so its forward is wasted work; since
``Tree.expanded`` a level is expanded up to its last node with children, and the leaves after
it are left out (the bundled draft model's and EAGLE's forwards over two nodes cost well over
one's on this CPU, where a matrix product over 2 to 8 rows runs about as slow as over 8). This
traces generate's round both ways for the bundled draft model and EAGLE and times the rounds
and their propose parts (``timing.round_timers``) interleaved, bench prompt 1 after 64 generated
tokens.

    .venv/bin/python experiments/tree_leaves_ab.py [--tree JSON] [--temperature T] [--repeats 25]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

import jax

import specjax as sj
from specjax import bench, engine, timing
from specjax.tree import Tree

CKPT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"


def every_node(tree, d):
    """``Tree.expanded`` before: every node of a level but the deepest."""
    start, stop = tree.levels[d]
    return stop - start if d + 1 < tree.depth else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default="[[0],[1],[0,0],[0,0,0],[0,0,0,0]]")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args()
    tok = sj.load_tokenizer(CKPT / "code-target")
    target = sj.load_model(CKPT / "code-target")
    drafts = {"draft_model": sj.load_draft_model(CKPT / "code-draft"),
              "eagle": sj.load_heads(CKPT / "code-eagle", target)}
    prompt = tok.encode(bench.load_prompts()[0]["text"])
    sampling = sj.SamplingParams(temperature=args.temperature, max_new_tokens=256)
    tree = Tree(json.loads(args.tree))
    levels = range(tree.depth)
    print(f"tree {args.tree}: nodes expanded per level {[tree.expanded(d) for d in levels]}, "
          f"before {[every_node(tree, d) for d in levels]}")
    trimmed = Tree.expanded
    timers = {}
    try:
        for way, rule in (("every node", every_node), ("trimmed", trimmed)):
            Tree.expanded = rule  # read when the round is traced
            engine.PROGRAMS.clear()
            jax.clear_caches()
            for method, draft in drafts.items():
                spec = sj.SpecConfig(method=method, tree=json.loads(args.tree))
                parts = timing.round_timers(target, prompt, spec=spec, draft=draft, decoded=64,
                                            sampling=sampling)
                for part in ("propose", "round"):
                    timers[(method, way, part)] = parts[part]
    finally:
        Tree.expanded = trimmed
    samples = timing.interleaved(timers, args.repeats)
    us = {k: 1e6 * statistics.median(v) for k, v in samples.items()}
    print(f"T = {args.temperature}, median of {args.repeats} interleaved repeats, µs:")
    for method in drafts:
        for part in ("propose", "round"):
            old, new = us[(method, "every node", part)], us[(method, "trimmed", part)]
            print(f"  {method:12s} {part:8s} every node {old:7.0f}  trimmed {new:7.0f}  "
                  f"trimmed / every node {new / old:.3f}")


if __name__ == "__main__":
    main()
