"""EAGLE heads side by side in one process: ``sj.generate`` with its defaults on the bundled
target and the bench's held-out prompts, each head and the bundled draft model timed interleaved
with autoregressive decoding, so a slow phase of the machine hits them alike.

    python experiments/eagle_heads.py checkpoints/code-eagle /tmp/eagle-narrow \
        --temperatures 0,0.8 --gamma 4 --repeats 5

Prints per head and temperature: decode seconds summed over the prompts (median of the
repeats), the speed-up over autoregressive decoding in the same repeats, tokens per round
(accepted drafts plus the bonus), and whether greedy output equals autoregressive decoding.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

import specjax as sj
from specjax import bench

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("heads", nargs="+", help="EAGLE head folders")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    tok = sj.load_tokenizer(ROOT / "checkpoints" / "code-target")
    target = sj.load_model(ROOT / "checkpoints" / "code-target")
    prompts = [tok.encode(p["text"]) for p in bench.load_prompts()[:args.prompts]]
    variants = {"autoregressive": (None, None),
                "draft model": (sj.load_draft_model(ROOT / "checkpoints" / "code-draft"),
                                sj.SpecConfig(num_speculative_tokens=args.gamma))}
    for path in args.heads:
        variants[path] = (sj.load_heads(path, target),
                          sj.SpecConfig(method="eagle", num_speculative_tokens=args.gamma))
    for t in (float(x) for x in args.temperatures.split(",")):
        sampling = sj.SamplingParams(temperature=t, max_new_tokens=args.max_new_tokens)
        seconds = {name: [] for name in variants}
        per_round, texts = {}, {}
        for repeat in range(args.repeats + 1):  # the first pass compiles and is not counted
            for name, (draft, spec) in variants.items():
                total, accepted, rounds, tokens = 0.0, 0, 0, []
                for i, p in enumerate(prompts):
                    out = sj.generate(target, [p], sampling=sampling, spec=spec, draft=draft,
                                      key=i)
                    total += out.stats.decode_seconds
                    accepted += out.stats.accepted_tokens
                    rounds += out.stats.num_rounds
                    tokens.append(out.tokens.tolist())
                if repeat:
                    seconds[name].append(total)
                per_round[name] = (accepted + rounds) / max(rounds, 1)
                texts[name] = tokens
        ar = statistics.median(seconds["autoregressive"])
        print(f"T={t:g}, gamma {args.gamma}, {len(prompts)} prompts x {args.max_new_tokens} "
              f"tokens, median of {args.repeats} interleaved repeats")
        for name, runs in seconds.items():
            s = statistics.median(runs)
            same = texts[name] == texts["autoregressive"] if t == 0 else "-"
            print(f"  {name:40s} {s * 1e3:8.1f} ms  speed-up {ar / s:5.2f}x  "
                  f"tokens/round {per_round[name]:4.2f}  greedy equal: {same}")


if __name__ == "__main__":
    main()
