"""Where the whole decode loop's time goes, by scope, from XLA's own profile.

``experiments/round_profile.py`` profiles one round repeated from one state; this profiles a
whole ``sj.generate`` call of the bundled pair (its decode program, every round as the loop
runs them, rests and wake-ups included) and sums the time of each XLA operation by the scope
in its HLO metadata (``propose``, ``verify``; the target's and draft's forwards apart), per
round. Operations without a scope are listed by name, with their shape: that is where copies
XLA inserted (a layout change, a loop-carried buffer) show up. The program is compiled in
this process with the XLA dump on (so each operation's metadata is known) and the compile
cache off. The profiler adds a little per operation, and the machine's speed swings between
runs: compare the parts beside the forwards, not the totals of two runs.

    python experiments/decode_profile.py --variant ar --batch 16 --temperature 0.8
    python experiments/decode_profile.py --variant declined --batch 16 --temperature 0.8
    python experiments/decode_profile.py --variant static --gamma 4 --batch 4

``declined``: a verify budget that never pays (every width but 1 priced at 50 steps), so
every round declines and the loop rests (``idle_rounds`` 1024): plain decode steps run inside
the speculative program, with its wake-ups. ``static``: a static chain of ``--gamma``.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import pathlib
import re
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
CKPT = ROOT / "checkpoints"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=("ar", "static", "declined"), default="declined")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-new-tokens", type=int, default=88,
                    help="88: the bench prompts' longest (158 tokens) + 88 + γ 8 fit the "
                         "256-slot tier, as plain decoding's does")
    ap.add_argument("--top", type=int, default=25, help="scopes and operations listed")
    args = ap.parse_args()
    dump = tempfile.mkdtemp(prefix="decode_profile_")
    if "jax" in sys.modules:
        raise RuntimeError("run as a script: XLA_FLAGS must be set before jax is imported")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} "
                               "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*")
    os.environ["SPECJAX_COMPILATION_CACHE"] = "off"
    import jax

    import specjax as sj
    from specjax import bench

    target = sj.load_model(CKPT / "code-target")
    draft = sj.load_draft_model(CKPT / "code-draft")
    tok = sj.load_tokenizer(CKPT / "code-target")
    texts = [p["text"] for p in bench.load_prompts()]
    prompts = [texts[i % len(texts)] for i in range(args.batch)]
    G = args.gamma
    spec = {"ar": None,
            "static": dict(num_speculative_tokens=G),
            "declined": dict(num_speculative_tokens=G, idle_rounds=1024, survival_threshold=0.2,
                             verify_costs=[1.0] + [50.0] * G, draft_cost=0.4, round_cost=0.0,
                             decline_cost=1.1)}[args.variant]
    sampling = sj.SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)

    def run():
        return sj.generate(target, prompts, sampling=sampling, tokenizer=tok, spec=spec,
                           draft=None if spec is None else draft, key=0)
    run()
    seconds = sorted(run().stats.decode_seconds for _ in range(3))
    (hlo,) = glob.glob(f"{dump}/*jit_decode.cpu_after_optimizations.txt")
    lines = {}
    for line in open(hlo):
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if m:
            lines[m.group(1)] = line
    with tempfile.TemporaryDirectory() as out:
        jax.profiler.start_trace(out)
        stats = run().stats
        jax.profiler.stop_trace()
        trace = json.load(gzip.open(glob.glob(f"{out}/**/*.trace.json.gz", recursive=True)[0]))
    rounds = stats.num_rounds
    scopes, unscoped, shapes = collections.Counter(), collections.Counter(), {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("args", {}).get("hlo_module") != "jit_decode":
            continue
        name, line = e["name"], lines.get(e["name"], "")
        # a while loop's time is its body's operations, counted apart (attention's block loop
        # is kept: its body's operations are not all reported on their own)
        if re.match(r"(while|cond|conditional)[.\d]*$", name) and "self_attn" not in line:
            continue
        op = re.search(r'op_name="([^"]*)"', line)
        if op is None:
            unscoped[name] += e["dur"]
            shape = re.search(r"= (\S+)", line)
            shapes[name] = shape.group(1)[:40] if shape else ""
            continue
        parts = [p for p in op.group(1).split("/") if p not in ("while", "body", "cond")][1:]
        path = "/".join(parts)
        key = path.split("/jit(_forward)")[0] + ("/forward" if "jit(_forward)" in path else "")
        scopes[("copy " if " copy(" in line else "") + key[:70]] += e["dur"]
    total = sum(scopes.values()) + sum(unscoped.values())
    print(f"{args.variant}, batch {args.batch}, T {args.temperature}, γ {G}, "
          f"{args.max_new_tokens} new tokens: decode {', '.join(f'{s:.3f}' for s in seconds)} s "
          f"(3 runs without the profiler), {rounds} rounds, {stats.rested_rounds} rested; "
          f"XLA operations {total / rounds:.0f} µs a round")
    for key, us in scopes.most_common(args.top):
        print(f"  {us / rounds:8.1f} µs a round  {key}")
    print(f"  {sum(unscoped.values()) / rounds:8.1f} µs a round  (no scope), of which:")
    for name, us in unscoped.most_common(min(args.top, 10)):
        print(f"      {us / rounds:8.1f}  {name:32s} {shapes[name]}")


if __name__ == "__main__":
    main()
