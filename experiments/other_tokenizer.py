"""A draft with another tokenizer beside the same-tokenizer draft, in one process (issue 27).

The bundled target with: code-draft (its own tokenizer), code-draft-bpe4k with token-level
intersection (the re-encoding chain), and code-draft-bpe4k with string-level drafts. Every variant
runs through the Python API with its defaults (`sj.generate`, batch 1, one prompt per call, the
bench's ten held-out prompts, 128 new tokens), interleaved with autoregressive decoding in each
repeat, so the ratios share the machine's state. Prints, per temperature and variant, the median
speed-up over the repeats (each repeat: the autoregressive calls' time per generated token over
the speculative calls', whole calls over all prompts; per token because sampled texts end at
different lengths), acceptance and mean accepted length, and whether greedy output was
identical.

    python experiments/other_tokenizer.py [--gammas 4] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import specjax as sj
from specjax import bench
from specjax.draft.draft_model import load_paired_draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gammas", default="4")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    target = sj.load_model(sj.bundled("code-target"))
    tok = sj.load_tokenizer(sj.bundled("code-target"))
    V = target.config.vocab_size
    other = sj.bundled("code-draft-bpe4k")
    drafts = {"code-draft": sj.load_draft_model(sj.bundled("code-draft")),
              "bpe4k token-level": load_paired_draft(other, tok, V),
              "bpe4k string-level": load_paired_draft(other, tok, V, level="string")}
    prompts = [tok.encode(p["text"]) for p in bench.load_prompts("short")]
    rows = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        sampling = sj.SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens)
        variants = {"autoregressive": dict()}
        for gamma in [int(g) for g in args.gammas.split(",")]:
            for name, draft in drafts.items():
                variants[f"{name}, γ={gamma}"] = dict(
                    draft=draft, spec=sj.SpecConfig(method="draft_model",
                                                    num_speculative_tokens=gamma))

        def run(kwargs, key, sampling=sampling):
            outs, began = [], time.perf_counter()
            for i, p in enumerate(prompts):
                outs.append(sj.generate(target, [p], sampling=sampling, key=key + i, **kwargs))
            return time.perf_counter() - began, outs

        for kwargs in variants.values():  # compile every program first
            run(kwargs, 0)
        seconds = {name: [] for name in variants}
        tokens = {name: [] for name in variants}
        results = {}
        for r in range(args.repeats):
            for name, kwargs in variants.items():
                took, outs = run(kwargs, 1000 * r)
                seconds[name].append(took)
                tokens[name].append(sum(int(o.lengths.sum()) for o in outs))
                results[name] = outs
        reference = results["autoregressive"]
        for name in variants:
            if name == "autoregressive":
                continue
            outs = results[name]
            # per generated token: sampled texts end at different lengths (EOS), so whole
            # calls' times compare only per token
            ratios = [(a / na) / (s / ns) for a, s, na, ns in zip(
                seconds["autoregressive"], seconds[name], tokens["autoregressive"], tokens[name])]
            proposed = sum(o.stats.proposed_tokens for o in outs)
            accepted = sum(o.stats.accepted_tokens for o in outs)
            rounds = sum(o.stats.num_rounds for o in outs)
            generated = sum(int(o.lengths[0]) for o in outs)
            same = all(np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
                       for a, b in zip(outs, reference)) if temperature == 0 else None
            row = {"variant": name, "temperature": temperature,
                   "speedup": statistics.median(ratios), "speedup_per_repeat": ratios,
                   "ar_seconds": seconds["autoregressive"], "spec_seconds": seconds[name],
                   "ar_tokens": tokens["autoregressive"], "spec_tokens": tokens[name],
                   "acceptance_rate": accepted / max(proposed, 1),
                   "tokens_per_round": generated / max(rounds, 1),
                   "identical_to_autoregressive": same}
            rows.append(row)
            print(f"T={temperature:<4} {name:<26} speed-up {row['speedup']:.2f}x "
                  f"({', '.join(f'{x:.2f}' for x in ratios)}), acceptance "
                  f"{row['acceptance_rate']:.3f}, tokens a round {row['tokens_per_round']:.2f}"
                  + ("" if same is None else f", greedy identical: {same}"), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python experiments/other_tokenizer.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                if v is not None and k != "json"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
