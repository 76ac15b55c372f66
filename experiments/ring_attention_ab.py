"""The bundled draft's ring attended densely against walked in blocks, in one process.

The bundled draft slides over its latest 256 positions, so its cache keeps a ring of 319 slots
per layer (``cache.ring_size``). ``attention.ring_is_dense`` makes a ring of at most two blocks
one dense softmax; this traces generate's round twice, once with that rule and once with every
ring walked block by block (the rule before 59c41bd), and times the draft model's propose and
the whole round (``timing.round_timers``) interleaved: after 64 generated tokens of bench prompt
1 (the ring not yet wrapped) and after 400 of bench prompt 4 (wrapped).

    .venv/bin/python experiments/ring_attention_ab.py [--temperature 0] [--repeats 25]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

import jax

import specjax as sj
from specjax import attention, bench, timing

CKPT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args()
    tok = sj.load_tokenizer(CKPT / "code-target")
    target = sj.load_model(CKPT / "code-target")
    draft = sj.load_draft_model(CKPT / "code-draft")
    sampling = sj.SamplingParams(temperature=args.temperature, max_new_tokens=700)
    spec = sj.SpecConfig(method="draft_model", num_speculative_tokens=4)
    dense = attention.ring_is_dense
    timers = {}
    try:
        for prompt_index, decoded in ((0, 64), (3, 400)):
            prompt = tok.encode(bench.load_prompts()[prompt_index]["text"])
            for rule, fn in (("blocks", lambda slots, block: False), ("dense", dense)):
                attention.ring_is_dense = fn  # read when the round is traced
                jax.clear_caches()
                parts = timing.round_timers(target, prompt, spec=spec, draft=draft,
                                            decoded=decoded, sampling=sampling)
                for part in ("propose", "round"):
                    timers[(decoded, rule, part)] = parts[part]
    finally:
        attention.ring_is_dense = dense
    samples = timing.interleaved(timers, args.repeats)
    us = {k: 1e6 * statistics.median(v) for k, v in samples.items()}
    print(f"draft model chain of 4, T = {args.temperature}, median of {args.repeats} interleaved "
          f"repeats, µs:")
    for decoded in (64, 400):
        for part in ("propose", "round"):
            old, new = us[(decoded, "blocks", part)], us[(decoded, "dense", part)]
            print(f"  after {decoded:3d} tokens  {part:8s} blocks {old:7.0f}  dense {new:7.0f}  "
                  f"dense / blocks {new / old:.3f}")


if __name__ == "__main__":
    main()
