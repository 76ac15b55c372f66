"""Crash trials at scale (issue 25): SIGKILL during saves of every kind (orbax model, Hugging
Face model, drafter heads) and during training, counting models lost and resumed runs that
differ from an uninterrupted one. The same trials as tests/test_crash_safety.py, many more.

    .venv/bin/python experiments/crash_trials.py [--saves 120] [--trainings 10] [--json PATH]
"""

import argparse
import json
import pathlib
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import crash_harness as h  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=120, help="SIGKILL trials during saves")
    ap.add_argument("--trainings", type=int, default=10, help="SIGKILL trials during training")
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args()
    out = {"saves": {}, "training": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        trials = h.SaveTrials(tmp)
        lost = []

        def one(t):
            kind = h.KINDS[t % len(h.KINDS)]
            try:
                return kind, trials.kill_trial(kind, t, random.Random(t))
            except Exception as e:  # a lost or broken model: counted, not raised
                lost.append((kind, t, repr(e)[:300]))
                return kind, "lost"
        t0 = time.perf_counter()
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(one, range(args.saves)))
        for kind in h.KINDS:
            out["saves"][kind] = {o: sum(1 for k, x in results if k == kind and x == o)
                                  for o in ("old", "new", "lost")}
        out["saves"]["lost_detail"] = lost
        out["saves"]["seconds"] = round(time.perf_counter() - t0, 1)
        print("saves:", json.dumps(out["saves"]))

        t0 = time.perf_counter()
        straight = h.train_run(tmp / "straight")
        seconds = time.perf_counter() - t0
        rng = random.Random(0)
        steps, differ = [], 0
        for t in range(args.trainings):
            workdir = tmp / f"train-{t}"
            steps.append(h.train_kill_trial(workdir, seconds, rng))
            resumed = h.train_run(workdir)
            differ += any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                          zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)))
        out["training"] = {"trials": args.trainings, "resumed_differ": differ,
                           "last_checkpoint_at_kill": steps, "steps": h.TRAIN_STEPS}
        print("training:", json.dumps(out["training"]))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 1 if lost or differ else 0


if __name__ == "__main__":
    sys.exit(main())
