"""What the on-disk compilation cache (specjax/compile_cache.py) saves a user: fresh Python
processes, each loading the bundled pair and making one ``sj.generate`` call with the API's
defaults (greedy, γ 4, 64 new tokens), timed from the start of the call to its result. Three
variants, interleaved, each in its own processes: the cache off (``SPECJAX_COMPILATION_CACHE=
off``), an empty cache (the first process of a machine), and a warm one (a process after it).

    .venv/bin/python experiments/compile_cache.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, time
import specjax as sj
target = sj.load_model(sj.bundled("code-target"))
draft = sj.load_draft_model(sj.bundled("code-draft"))
t0 = time.perf_counter()
out = sj.generate(target, [[1, 400, 17, 33, 90]], draft=draft,
                  sampling=sj.SamplingParams(temperature=0, max_new_tokens=64),
                  spec=sj.SpecConfig(num_speculative_tokens=4))
call = time.perf_counter() - t0
print(json.dumps({"call": call, "compile": out.stats.compile_seconds,
                  "tokens": [int(t) for t in out.tokens[0]]}))
"""


def child(env: dict) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = {k: v for k, v in os.environ.items()
            if k not in ("JAX_COMPILATION_CACHE_DIR", "SPECJAX_COMPILATION_CACHE")}
    warm = tempfile.mkdtemp(prefix="specjax-warm-")
    child(dict(base, SPECJAX_COMPILATION_CACHE=warm))  # fills the warm cache
    runs: dict[str, list[dict]] = {"off": [], "empty": [], "warm": []}
    for _ in range(args.repeats):
        runs["off"].append(child(dict(base, SPECJAX_COMPILATION_CACHE="off")))
        empty = tempfile.mkdtemp(prefix="specjax-empty-")
        runs["empty"].append(child(dict(base, SPECJAX_COMPILATION_CACHE=empty)))
        shutil.rmtree(empty)
        runs["warm"].append(child(dict(base, SPECJAX_COMPILATION_CACHE=warm)))
    shutil.rmtree(warm)
    same = len({json.dumps(r["tokens"]) for rs in runs.values() for r in rs}) == 1
    off = statistics.median(r["call"] for r in runs["off"])
    print(f"the first sj.generate call of a fresh process (bundled pair, API defaults, greedy, "
          f"γ 4, 64 new tokens), median of {args.repeats} processes each, interleaved:")
    for name, rs in runs.items():
        call = statistics.median(r["call"] for r in rs)
        comp = statistics.median(r["compile"] for r in rs)
        print(f"  cache {name:6} {call:6.2f} s a call (compile {comp:5.2f} s)   "
              f"x{call / off:.2f} of off   per process: "
              + " ".join(f"{r['call']:.2f}" for r in rs))
    print(f"same tokens in every process: {same}")


if __name__ == "__main__":
    main()
