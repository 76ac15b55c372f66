"""Per-device memory of the sharded generate program as the "model" axis grows.

On fake CPU devices timings mean little, so this reports what the compiler says: for a ~160M
parameter target (float32, 640 MB of weights) and its chain draft, the compiled decode loop's
per-device argument, output and temporary bytes (``compiled.memory_analysis()``) and the compile
time, for meshes data=1 x model=m over the first m of 8 devices. Weights per device fall as 1/m
(embedding and LM head included, split over the vocabulary); the draft is replicated. The last
row repeats model=8 with the embedding and LM head replicated instead (the other choice the
partition table could make).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        .venv/bin/python experiments/sharded_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402

import specjax as sj  # noqa: E402
from specjax import engine, sharding  # noqa: E402

TARGET = sj.ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                        max_position_embeddings=2048)
DRAFT = sj.ModelConfig(vocab_size=32000, hidden_size=256, intermediate_size=704,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=2048)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    target = sj.init_model(TARGET, jax.random.key(0))
    draft = sj.init_model(DRAFT, jax.random.key(1))
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(target.params))
    print(f"target {TARGET.num_params / 1e6:.0f}M params ({weights / 2**20:.0f} MiB float32), "
          f"draft {DRAFT.num_params / 1e6:.1f}M (replicated); batch {args.batch}, prompt 64, "
          f"64 new tokens, gamma 4; jax {jax.__version__}, {jax.device_count()} CPU devices")
    print(f"{'mesh':>17} {'args MiB/dev':>13} {'temp MiB/dev':>13} {'out MiB/dev':>12} "
          f"{'target weights MiB/dev':>23} {'compile s':>10}")
    rows = []
    prompts = [[1 + i] * 64 for i in range(args.batch)]
    split_rules = sharding.RULES
    replicated_rules = {k: v for k, v in split_rules.items() if k != "vocab"}  # V replicated
    for m, rules in [(m, split_rules) for m in args.models] + [(8, replicated_rules)]:
        label = f"1 x {m}" + ("" if rules is split_rules else " (V repl.)")
        mesh = sj.make_mesh(data=1, model=m, devices=jax.devices()[:m])
        placed = sj.shard(target, mesh, rules=rules)  # generate keeps a placement it is given
        engine.PROGRAMS.clear()
        out = sj.generate(placed, prompts, draft=draft, mesh=mesh,
                          spec=sj.SpecConfig(num_speculative_tokens=4),
                          sampling=sj.SamplingParams(temperature=0, max_new_tokens=64))
        (decode,) = engine.PROGRAMS.programs()[-1].executables("decode")
        mem = decode.memory_analysis()
        per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(
            placed.params))
        row = dict(model=m, argument_bytes=mem.argument_size_in_bytes,
                   temp_bytes=mem.temp_size_in_bytes, output_bytes=mem.output_size_in_bytes,
                   target_weight_bytes_per_device=per_device,
                   compile_seconds=out.stats.compile_seconds)
        rows.append(row)
        mib = 2 ** 20
        row["embedding_and_head"] = "split" if rules is split_rules else "replicated"
        print(f"{label:>17} {row['argument_bytes'] / mib:13.1f} "
              f"{row['temp_bytes'] / mib:13.1f} {row['output_bytes'] / mib:12.1f} "
              f"{per_device / mib:23.1f} {row['compile_seconds']:10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
