"""Where a speculative round's time goes inside the real decode loop, by ablation.

Each variant runs the same ``sj.generate`` loop on the bundled pair with one part replaced, in one
process, interleaved over repeats (the first repeat compiles and is dropped):

* ar                 autoregressive decoding: one target step per round (the unit below)
* draft_model        the bundled draft model, chain of γ
* draft_model-const  the same loop, the draft model replaced by constant drafts (no draft forward):
                     the verify forward plus the round's bookkeeping
* eagle              the bundled EAGLE head, chain of γ
* eagle-no-catchup   EAGLE without its catch-up forward (it reuses the last feature it has; drafts
                     are worse, the round's shape is the same)
* eagle-const        EAGLE's loop with constant drafts (observe still runs)

A round's milliseconds are decode seconds over rounds, summed over the prompts; "steps" divide by
the AR round. Outputs of the ablated variants are not speculative decoding of anything useful: only
their time is read. Usage:

    .venv/bin/python experiments/round_parts.py [--gamma 3] [--temperature 0] [--prompts 5]
        [--repeats 4]
"""

from __future__ import annotations

import argparse
import statistics

import jax.numpy as jnp

import specjax as sj
from specjax import bench
from specjax.draft import Draft
from specjax.draft.draft_model import DraftModelProposer
from specjax.draft.eagle import EagleProposer


class ConstDraft(DraftModelProposer):
    def propose(self, params, cache, history, length, keys, sampling_params, filters):
        B = history.shape[0]
        return Draft(jnp.zeros((B, self.gamma), jnp.int32), None), cache


class EagleNoCatchUp(EagleProposer):
    def _catch_up(self, params, state, history, length):
        return state.features.feats[:, 0], state.cache.rollback(length)


class EagleConst(EagleProposer):
    def propose(self, params, state, history, length, keys, sampling_params, filters):
        B = history.shape[0]
        return Draft(jnp.zeros((B, self.chain), jnp.int32), None), state


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    ckpt = sj.bundled().parent
    target = sj.load_model(ckpt / "code-target", dtype="float32")
    draft = sj.load_draft_model(ckpt / "code-draft", dtype="float32")  # as shipped: cut vocabulary
    eagle = sj.load_heads(ckpt / "code-eagle", target)
    tok = sj.load_tokenizer(ckpt / "code-target")
    prompts = [tok.encode(p["text"]) for p in bench.load_prompts()][:args.prompts]
    sampling = sj.SamplingParams(temperature=args.temperature, max_new_tokens=128)
    G = args.gamma
    dm, eg = sj.draft.DraftModelProposer(draft.config, G), EagleProposer(eagle.config, G)
    # (proposer, its params): each variant swapped in through generate(proposer=...)
    variants = {"ar": (None, None),
                "draft_model": (dm, draft),
                "draft_model-const": (ConstDraft(draft.config, G), draft),
                "eagle": (eg, eagle.params),
                "eagle-no-catchup": (EagleNoCatchUp(eagle.config, G), eagle.params),
                "eagle-const": (EagleConst(eagle.config, G), eagle.params)}
    rounds = {k: [] for k in variants}
    for rep in range(args.repeats + 1):
        for name, (proposer, params) in variants.items():
            seconds = num_rounds = 0
            for i, p in enumerate(prompts):
                s = sj.generate(target, [p], sampling=sampling, proposer=proposer, draft=params,
                                key=i).stats
                seconds += s.decode_seconds
                num_rounds += s.num_rounds
            if rep:
                rounds[name].append(1e3 * seconds / num_rounds)
    ar = statistics.median(rounds["ar"])
    print(f"gamma {args.gamma}, T = {args.temperature}, {len(prompts)} prompts, median of "
          f"{args.repeats} interleaved repeats")
    for name, ms in rounds.items():
        m = statistics.median(ms)
        print(f"{name:18s} round {m:7.3f} ms = {m / ar:5.3f} AR steps")


if __name__ == "__main__":
    main()
