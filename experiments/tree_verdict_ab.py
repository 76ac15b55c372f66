"""A greedy tree's round verified from argmaxes against from one-hot distributions, one process.

Greedy calls verify a tree with ``verify.greedy_tree_verdict`` (the target's argmax after each
node; [B, N] integers). Before, they processed the logits into one-hot p [B, N, V] and ran
``verify.tree_sample`` (residuals, a draw). This traces generate's round both ways for the bundled
draft model and EAGLE with a tree and times the rounds (``timing.round_timers``) interleaved,
bench prompt 1 after 64 generated tokens. The "one-hot p" side builds p from the argmaxes; the
engine before also ran the logits through ``sampling.process_logits`` (a softmax over [N, V]),
which this leaves out, so the ratio understates what the change saved.

    .venv/bin/python experiments/tree_verdict_ab.py [--tree JSON] [--repeats 25]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

import jax

import specjax as sj
from specjax import bench, timing, verify

CKPT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default="[[0],[1],[0,0],[0,0,0],[0,0,0,0]]")
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args()
    tok = sj.load_tokenizer(CKPT / "code-target")
    target = sj.load_model(CKPT / "code-target")

    def through_probs(tree, draft_tokens, target_tokens, valid=None):
        """The verdict as before: one-hot p and ``tree_sample`` (a greedy draw ignores its
        keys)."""
        p = jax.nn.one_hot(target_tokens, target.config.vocab_size)
        keys = jax.random.split(jax.random.key(0), target_tokens.shape[0])
        return verify.tree_sample(keys, tree, draft_tokens, p, valid)

    drafts = {"draft_model": sj.load_draft_model(CKPT / "code-draft"),
              "eagle": sj.load_heads(CKPT / "code-eagle", target)}
    prompt = tok.encode(bench.load_prompts()[0]["text"])
    greedy = sj.SamplingParams(temperature=0.0, max_new_tokens=256)
    argmaxes = verify.greedy_tree_verdict
    timers = {}
    try:
        for way, fn in (("one-hot p", through_probs), ("argmax", argmaxes)):
            verify.greedy_tree_verdict = fn  # read when the round is traced
            jax.clear_caches()
            for method, draft in drafts.items():
                spec = sj.SpecConfig(method=method, tree=json.loads(args.tree))
                timers[(method, way)] = timing.round_timers(
                    target, prompt, spec=spec, draft=draft, decoded=64, sampling=greedy)["round"]
    finally:
        verify.greedy_tree_verdict = argmaxes
    samples = timing.interleaved(timers, args.repeats)
    us = {k: 1e6 * statistics.median(v) for k, v in samples.items()}
    print(f"tree {args.tree}, greedy, median of {args.repeats} interleaved repeats, µs a round:")
    for method in drafts:
        old, new = us[(method, "one-hot p")], us[(method, "argmax")]
        print(f"  {method:12s} one-hot p {old:7.0f}  argmax {new:7.0f}  argmax / one-hot "
              f"{new / old:.3f}")


if __name__ == "__main__":
    main()
