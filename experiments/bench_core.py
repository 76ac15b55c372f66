"""Where the time of a speculative round goes (random weights).

For a ~25M and a ~150M target and a ~3M draft, all measured in this one run:

* target step ms      one-token decode forward (cache filled to CONTEXT slots)
* verify(γ+1) ms      the same forward over γ + 1 tokens
* draft step ms       one-token draft forward; the round's first draft forward takes 2 tokens
* c                   draft step / target step
* verify/step         verify(γ+1) / target step (1.0 would be "verification is free")
* loop round ms       sj.generate's decode time / rounds, against the sum of its parts

Parts are timed as INNER back-to-back forwards inside one compiled program (as in the decode loop),
so Python dispatch is not counted in them.
* AR loop token ms    sj.generate(spec=None) decode time / tokens, against one target step

Each part is timed as the median of REPEATS interleaved repetitions. Usage:

    .venv/bin/python experiments/bench_core.py [--gamma 4] [--repeats 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax

import specjax as sj
from specjax import timing

CONFIGS = {
    "target-25M": sj.ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536,
                                 num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                                 max_position_embeddings=1024),
    "target-150M": sj.ModelConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816,
                                  num_hidden_layers=11, num_attention_heads=16,
                                  num_key_value_heads=8, max_position_embeddings=1024),
    "draft-3M": sj.ModelConfig(vocab_size=8192, hidden_size=160, intermediate_size=448,
                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                               max_position_embeddings=1024, tie_word_embeddings=False),
}
PROMPT_LEN, NEW_TOKENS = 64, 128
CONTEXT = PROMPT_LEN + NEW_TOKENS // 2  # cache fill for the single-forward timings


def forward_timer(model, T, capacity):
    return timing.forward_timer(model, T, capacity, CONTEXT)


def median_ms(timers: dict, repeats: int) -> dict:
    return {k: 1e3 * s for k, s in timing.median_seconds(timers, repeats).items()}


def loop_ms(target, draft, gamma, repeats):
    prompt = [list(range(1, PROMPT_LEN + 1))]
    greedy = sj.SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS)
    spec = sj.SpecConfig(num_speculative_tokens=gamma)
    runs = {"spec": [], "ar": []}
    for _ in range(max(3, repeats // 10)):
        s = sj.generate(target, prompt, sampling=greedy, spec=spec, draft=draft).stats
        a = sj.generate(target, prompt, sampling=greedy).stats
        runs["spec"].append((s.decode_seconds / s.num_rounds, s))
        runs["ar"].append((a.decode_seconds / a.num_rounds, a))
    spec_round = statistics.median(r for r, _ in runs["spec"][1:]) * 1e3
    ar_token = statistics.median(r for r, _ in runs["ar"][1:]) * 1e3
    return spec_round, ar_token, runs["spec"][-1][1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--targets", nargs="+", default=["target-25M", "target-150M"])
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    G = args.gamma
    capacity = sj.engine.cache_capacity(CONFIGS["target-25M"], G,
                                        sj.engine.slots_needed(PROMPT_LEN, NEW_TOKENS, G))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; gamma={G}; cache capacity "
          f"{capacity}, context {CONTEXT}; medians of {args.repeats} interleaved repeats")
    draft = sj.init_model(CONFIGS["draft-3M"], jax.random.key(1))
    rows = []
    for name in args.targets:
        target = sj.init_model(CONFIGS[name], jax.random.key(0))
        timers = {"target step": forward_timer(target, 1, capacity),
                  f"verify({G + 1})": forward_timer(target, G + 1, capacity),
                  "draft step": forward_timer(draft, 1, capacity),
                  "draft 2-token": forward_timer(draft, 2, capacity)}
        ms = median_ms(timers, args.repeats)
        spec_round, ar_token, stats = loop_ms(target, draft, G, args.repeats)
        parts = ms["draft 2-token"] + (G - 1) * ms["draft step"] + ms[f"verify({G + 1})"]
        row = dict(
            target=name, target_params=CONFIGS[name].num_params,
            draft_params=CONFIGS["draft-3M"].num_params, gamma=G,
            target_step_ms=ms["target step"], verify_ms=ms[f"verify({G + 1})"],
            draft_step_ms=ms["draft step"], draft_2token_ms=ms["draft 2-token"],
            c=ms["draft step"] / ms["target step"],
            verify_over_step=ms[f"verify({G + 1})"] / ms["target step"],
            loop_round_ms=spec_round, round_parts_ms=parts, loop_overhead_ms=spec_round - parts,
            ar_loop_token_ms=ar_token, ar_overhead_ms=ar_token - ms["target step"],
            acceptance_rate=stats.acceptance_rate)
        rows.append(row)
        print(f"\n{name} ({row['target_params'] / 1e6:.1f}M params), draft "
              f"{row['draft_params'] / 1e6:.1f}M")
        print(f"  target step         {row['target_step_ms']:8.2f} ms")
        print(f"  verify({G + 1})           {row['verify_ms']:8.2f} ms   verify/step = "
              f"{row['verify_over_step']:.2f}")
        print(f"  draft step          {row['draft_step_ms']:8.2f} ms   c = {row['c']:.3f}"
              f"   (2-token draft forward {row['draft_2token_ms']:.2f} ms)")
        print(f"  loop round          {spec_round:8.2f} ms   sum of parts {parts:.2f} ms -> "
              f"loop overhead {spec_round - parts:+.2f} ms per round")
        print(f"  AR loop per token   {ar_token:8.2f} ms   target step {ms['target step']:.2f} ms "
              f"-> overhead {ar_token - ms['target step']:+.2f} ms per token")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
