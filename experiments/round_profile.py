"""Where one speculative round's time goes, operation by operation, from XLA's own profile.

Times ``sj.timing.round_timers``'s round (generate's own round, repeated from one state) under
``jax.profiler`` and sums the time of every XLA operation the trace records, grouped by what it
belongs to (the scopes ``engine.round_step`` names in the compiled program): the proposer,
the target's verify forward, the rest of verification (argmax or sampling, the verdict),
bookkeeping, each with its matrix products apart, and the copies of whole cache buffers XLA
inserted. The
profiler adds a few percent per operation; compare groups and methods, not the total against a
timer run without it.

    python experiments/round_profile.py                       # ar, ngram, draft_model, eagle
    python experiments/round_profile.py --methods ngram --top 10
    python experiments/round_profile.py --methods draft_model --tree '[[0],[1],[0,0],[0,0,0]]'
    python experiments/round_profile.py --methods draft_model --batch 4 --gamma 2 \
        --survival-threshold 1e-9        # adaptive lengths' program, every draft verified
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import pathlib
import re
import tempfile

import jax
import numpy as np

import specjax as sj
from specjax import bench, timing

ROOT = pathlib.Path(__file__).resolve().parents[1]
CKPT = ROOT / "checkpoints"
_SKIP = ("ThunkExecutor", "SlinkyThreadPool", "end:", "$", "Pjit", "Common", "Py", "Parse",
         "Handle", "Allocate")


def group(name: str, op_name: str, line: str) -> str:
    """The part of the round an operation belongs to: the scope engine.round_step names
    (propose, verify, observe; the rest is bookkeeping), matrix products apart, and the copies
    of a whole [L, B, S, K, D] cache buffer XLA inserted wherever they are."""
    shape = re.search(r"= (\w+\[[\d,]*\])\S* copy\(", line)
    if shape and shape.group(1).count(",") >= 4:
        return "cache copies"
    part = next((p for p in ("propose", "verify", "observe") if f"/{p}/" in op_name),
                "bookkeeping")
    if part == "verify" and "_forward" in op_name:
        part = "verify forward"
    if name.startswith("dot") and not op_name:  # XLA's rewrite of M = 1 products drops the scope
        return "matmuls, unlabelled"
    return f"{part}, {'matmuls' if 'dot_general' in op_name else 'rest'}"


def profile(method: str, temperature: float, top: int, batch: int = 1, gamma: int = 4,
            threshold: float | None = None, no_match: bool = False, tree=None) -> None:
    tok = sj.load_tokenizer(CKPT / "code-target")
    target = sj.load_model(CKPT / "code-target")
    draft = {"draft_model": lambda: sj.load_draft_model(CKPT / "code-draft"),
             "eagle": lambda: sj.load_heads(CKPT / "code-eagle", target),
             "medusa": lambda: sj.load_heads(CKPT / "code-medusa", target),
             "mtp": lambda: sj.load_heads(CKPT / "code-mtp", target),
             "dflash": lambda: sj.load_heads(CKPT / "code-dflash", target)}.get(
        method, lambda: None)()
    prompt = tok.encode(bench.load_prompts()[0]["text"])
    if no_match:  # distinct ids: n-gram and suffix find nothing to copy, rounds propose nothing
        prompt = [int(t) for t in np.random.default_rng(0).permutation(
            np.arange(1, target.config.vocab_size))[:200]]
    spec = None if method == "ar" else sj.SpecConfig(
        method=method, survival_threshold=threshold,
        **({"tree": tree} if tree is not None else {"num_speculative_tokens": gamma}))
    timers = timing.round_timers(target, prompt, spec=spec, draft=draft,
                                 decoded=2 if no_match else 64,
                                 sampling=sj.SamplingParams(temperature=temperature,
                                                            max_new_tokens=256), batch=batch)
    run = timers["round"]
    lines = {}
    for line in run.executable.as_text().splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if m:
            lines[m.group(1)] = line
    for _ in range(3):
        run()
    plain = sorted(run() for _ in range(5))[2]
    calls = 5 * timing.INNER
    with tempfile.TemporaryDirectory() as out:
        jax.profiler.start_trace(out, create_perfetto_trace=True)
        for _ in range(5):
            run()
        jax.profiler.stop_trace()
        trace = json.load(gzip.open(glob.glob(f"{out}/**/*.trace.json.gz", recursive=True)[0]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spent, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(_SKIP) \
                and not re.match(r"(cond|while|conditional)[.\d]*$", e["name"]):
            spent[e["name"]] += e.get("dur", 0) / calls
            count[e["name"]] += 1 / calls
    groups, members = collections.Counter(), collections.defaultdict(list)
    for name, us in spent.items():
        line = lines.get(name, "")
        op = re.search(r'op_name="([^"]*)"', line)
        g = group(name, op.group(1) if op else "", line)
        groups[g] += us
        members[g].append((us, name))
    total = sum(groups.values())
    shape = f"γ={gamma}" if tree is None else f"tree {tree}"
    print(f"\n{method}, {shape}, threshold {threshold}, batch {batch}, T={temperature}: "
          f"round {1e6 * plain:.0f} µs timed without the profiler; "
          f"{total:.0f} µs in {sum(count.values()):.0f} operations under it")
    for g, us in groups.most_common():
        print(f"  {g:28s} {us:8.1f} µs  {us / total:6.1%}")
        for us, name in sorted(members[g], reverse=True)[:top]:
            line = lines.get(name, "")
            op = re.search(r'op_name="([^"]*)"', line)
            shape = re.search(r"= (\S+)", line)
            print(f"      {us:8.1f} µs {count[name]:4.1f}x {name:28s} "
                  f"{shape.group(1)[:32] if shape else '':32s} {(op.group(1) if op else '')[-60:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="ar,ngram,draft_model,eagle")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top", type=int, default=3, help="operations listed per group")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--survival-threshold", type=float, default=None,
                    help="adaptive lengths (chains of draft_model, eagle, medusa, mtp, dflash)")
    ap.add_argument("--no-match", action="store_true",
                    help="a prompt of 200 distinct random ids, so n-gram and suffix rounds "
                         "propose nothing (a round's fixed cost)")
    ap.add_argument("--tree", type=json.loads, default=None,
                    help="a tree (JSON list of node paths) instead of a chain of --gamma")
    args = ap.parse_args()
    for method in args.methods.split(","):
        profile(method, args.temperature, args.top, args.batch, args.gamma,
                None if method == "ar" else args.survival_threshold, args.no_match,
                None if method == "ar" else args.tree)


if __name__ == "__main__":
    main()
