"""The bundled draft model with its LM head cut to a draft vocabulary, against the whole head.

One process, variants interleaved over repeats (the first pass compiles and is not timed): the
autoregressive target, the draft over all 8,192 tokens, and the draft restricted to the M most
frequent tokens of the training stream for each M given. Prints tokens/s (median over repeats),
the speed-up over the autoregressive loop of the same repeats, the acceptance rate and α, and a
draft step's time with each head (the draft's forward alone, timed side by side). Greedy outputs
are checked against the autoregressive ones. Usage:

    .venv/bin/python experiments/draft_vocab.py [--sizes 1024,2048,4096] [--gamma 4]
        [--temperatures 0,0.8] [--prompts 10] [--repeats 3]

The draft vocabulary is read from the training stream (``--train``, default
~/specjax-work/train.npy, written by `specjax train pair data`); without it the script uses the
vocabulary the bundled draft ships (checkpoints/code-draft/draft_vocab.npy), truncated to M by
token id order, which is not a frequency order: pass --train for the real comparison.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

import numpy as np

import specjax as sj
from specjax import bench, timing
from specjax.draft import restrict_vocab
from specjax.draft.draft_model import VOCAB_FILE
from specjax.draft.vocab import frequent_tokens
from specjax.engine import cache_capacity, slots_needed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="1024,2048,4096")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--train", type=pathlib.Path,
                    default=pathlib.Path.home() / "specjax-work" / "train.npy")
    args = ap.parse_args()
    ckpt = sj.bundled().parent
    target = sj.load_model(ckpt / "code-target", dtype="float32")
    draft = sj.load_model(ckpt / "code-draft", dtype="float32")
    tok = sj.load_tokenizer(ckpt / "code-target")
    prompts = [tok.encode(p["text"]) for p in bench.load_prompts()][:args.prompts]
    V = target.config.vocab_size
    if args.train.exists():
        stream = np.load(args.train, mmap_mode="r")
        vocab_for = lambda m: frequent_tokens(stream, V, m)  # noqa: E731
    else:
        shipped = np.load(ckpt / "code-draft" / VOCAB_FILE)
        print(f"{args.train} not found: using {VOCAB_FILE}'s first ids (not frequency-ranked)")
        vocab_for = lambda m: shipped[:m]  # noqa: E731
    drafts = {"full": draft}
    drafts.update({f"M={m}": restrict_vocab(draft, vocab_for(m))
                   for m in (int(x) for x in args.sizes.split(","))})
    spec = sj.SpecConfig(num_speculative_tokens=args.gamma)

    # A draft step with each head, timed alone (the same timer as the bench's verify cost).
    capacity = cache_capacity(target.config, args.gamma,
                              slots_needed(max(map(len, prompts)), args.max_new_tokens, args.gamma))
    context = int(np.mean([len(p) for p in prompts])) + args.max_new_tokens // 2
    timers = {"target": timing.forward_timer(target, 1, capacity, context)}
    timers.update({name: timing.forward_timer(d, 1, capacity, context)
                   for name, d in drafts.items()})
    step = timing.median_seconds(timers, 20)
    print("one forward, median of 20 (ms): " + ", ".join(
        f"{k} {1e3 * v:.3f}" for k, v in step.items()))

    for temperature in (float(t) for t in args.temperatures.split(",")):
        sampling = sj.SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens)
        variants = {"ar": (None, None)} | {name: (spec, d) for name, d in drafts.items()}
        speed = {k: [] for k in variants}
        last = {}
        for rep in range(args.repeats + 1):
            for name, (s, d) in variants.items():
                outs = [sj.generate(target, [p], sampling=sampling, spec=s, draft=d, key=i)
                        for i, p in enumerate(prompts)]
                if rep:
                    tokens = sum(int(o.lengths[0]) - 1 for o in outs)
                    speed[name].append(tokens / sum(o.stats.decode_seconds for o in outs))
                last[name] = outs
        ar = statistics.median(speed["ar"])
        print(f"\nT = {temperature}, gamma {args.gamma}, {len(prompts)} prompts x "
              f"{args.max_new_tokens} tokens, median of {args.repeats} interleaved repeats; "
              f"autoregressive {ar:.1f} tok/s")
        for name in drafts:
            outs = last[name]
            pooled = bench._pooled(outs)  # acceptance over all prompts, as the bench reports it
            tps = statistics.median(speed[name])
            same = ""
            if temperature == 0:
                same = "  identical: " + str(all(np.array_equal(a.tokens, b.tokens)
                                                 for a, b in zip(last["ar"], outs)))
            print(f"  {name:7s} {tps:7.1f} tok/s  {tps / ar:5.2f}x  acceptance "
                  f"{pooled['acceptance_rate']:.3f}  alpha {pooled['alpha']:.3f}  per repeat "
                  + " ".join(f"{s / a:.2f}" for s, a in zip(speed[name], speed["ar"])) + same)


if __name__ == "__main__":
    main()
