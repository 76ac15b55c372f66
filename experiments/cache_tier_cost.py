"""The same request in the 256-slot cache tier and in a larger cache (max_cache_len).

A speculative program reserves γ slots past prompt + max_new_tokens, so near a tier's top it
runs in the next tier (1,024 slots after 256) while plain decoding stays below; a cache over
one attention block (256 slots) is read block by block (``attention.blocked``). This times
plain decoding and a static chain of 2 with the bundled pair in 256, 264 and 1,024 slots, the
10 bench prompts cycled to the batch, T 0.8, 88 new tokens (so everything fits 256), time per
token over plain decoding in 256 slots in the same repeat.

    .venv/bin/python experiments/cache_tier_cost.py [batch sizes, default 16,4] [repeats, 4]
"""
import pathlib
import statistics
import sys

import specjax as sj
from specjax import bench

CKPT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"
target = sj.load_model(CKPT / "code-target")
draft = sj.load_draft_model(CKPT / "code-draft")
tok = sj.load_tokenizer(CKPT / "code-target")
texts = [p["text"] for p in bench.load_prompts()]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
for B in (int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "16,4").split(",")):
    prompts = [texts[i % len(texts)] for i in range(B)]
    sampling = sj.SamplingParams(temperature=0.8, max_new_tokens=88)
    variants = {"ar 256": (None, None), "ar 1024": (None, 1024), "ar 264": (None, 264),
                "static2 256": (dict(num_speculative_tokens=2), None),
                "static2 1024": (dict(num_speculative_tokens=2), 1024)}
    runs = {k: [] for k in variants}
    for r in range(reps + 1):
        for name, (spec, cap) in variants.items():
            out = sj.generate(target, prompts, sampling=sampling, tokenizer=tok, spec=spec,
                              draft=None if spec is None else draft, key=r, max_cache_len=cap)
            if r:
                runs[name].append(out.stats.decode_seconds / out.stats.generated_tokens)
            elif name.endswith("256"):
                assert out.stats.capacity <= 256, out.stats.capacity
    base = runs["ar 256"]
    print(f"batch {B}, T 0.8, 88 new tokens; time per token over 'ar 256' in the same repeat")
    for name, xs in runs.items():
        ratios = [x / b for x, b in zip(xs, base)]
        print(f"  {name:14} {statistics.median(ratios):.3f}  "
              f"({', '.join(f'{x:.2f}' for x in ratios)})", flush=True)
