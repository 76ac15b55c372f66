"""Why decode speed swings between processes, and what bounds it against the bandwidth roofline.

Starts ``--processes`` fresh Python processes one after another, alternating two placements:
both cores, and core 0 only (``taskset -c 0``). Each process measures, in this order and again
at its end:

* ``bw``: what one jitted sum over 512 MiB of float32 reads per second
  (``timing.memory_bandwidth``);
* ``matvec``: bytes per second of one-token products through 48 different [384, 1024] float32
  matrices (72 MiB, more than the last-level cache, so every product streams from memory);
* ``step``: the bundled target's decode step in float32 (64 of 256 cache slots), and its weight
  bytes per second (every weight but the input embedding).

Then, across processes of the same placement, the correlation between the decode step's time and
1 / bandwidth: if the step swings with what the memory delivers, the swings are the machine's.
The single-core rows show whether XLA spreads a one-token product over both cores: if
``matvec`` is the same on one core as on two, it does not, and a decode step can reach at best
the one-core bandwidth, not the two-core figure the roofline divides by.

    .venv/bin/python experiments/speed_swings.py [--processes 8] [--repeats 15]

``--watch SECONDS`` instead keeps one process measuring, window after window (about one second
each): the decode step, a γ = 4 verify forward (5 tokens; its ratio to the step is what a
speculative speed-up rests on), ``compute`` (a chain of products of one 128 x 128 matrix held in the
first-level caches: arithmetic, no memory traffic) and ``bw`` over 64 MiB, with the CPU time the
hypervisor took from this machine in that window (the ``steal`` column of ``/proc/stat``,
in percent of both cores). If the step swings together with ``compute`` and ``steal``, the
swings are the machine's (time taken from the cores), not the program's.

    .venv/bin/python experiments/speed_swings.py --watch 300 --json FILE
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def child(repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    import specjax as sj
    from specjax import timing

    target = sj.load_model(sj.bundled("code-target"), "float32")
    step = timing.forward_timer(target, 1, 256, 64)
    weights = timing.step_weight_bytes(target)

    E, F, N = 384, 1024, 48
    mats = [jax.random.normal(jax.random.key(i), (E, F), jnp.float32) for i in range(N)]

    @jax.jit
    def products(x, mats):
        for w in mats:  # each product depends on the last: no two run at once
            x = x + (x @ w)[:, :E] * 1e-9
        return x

    x = jnp.ones((1, E), jnp.float32)
    products(x, mats).block_until_ready()

    def matvec() -> float:
        return N * E * F * 4 / timing.timed(products, x, mats)[1]

    def measure() -> dict:
        bw = timing.memory_bandwidth()
        mv = statistics.median(matvec() for _ in range(repeats))
        s = statistics.median(step() for _ in range(repeats))
        return {"bw": bw, "matvec": mv, "step_ms": s * 1e3, "step_bytes_per_s": weights / s}

    first = measure()
    time.sleep(1.0)
    return {"first": first, "last": measure()}


def _cpu_times() -> list[int]:
    """The first line of /proc/stat: user nice system idle iowait irq softirq steal (jiffies)."""
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:9]]


def watch(seconds: float, json_path: str | None) -> None:
    import jax
    import jax.numpy as jnp

    import specjax as sj
    from specjax import timing

    target = sj.load_model(sj.bundled("code-target"), "float32")
    step = timing.forward_timer(target, 1, 256, 64)
    verify = timing.forward_timer(target, 5, 256, 64)  # a γ = 4 verify forward
    a = jax.random.normal(jax.random.key(0), (128, 128), jnp.float32) / 16

    @jax.jit
    def compute(x):  # 64 products with the same small matrix: in cache, arithmetic only
        return jax.lax.fori_loop(0, 64, lambda _, y: jnp.tanh(y @ a), x)

    x = jnp.ones((128, 128), jnp.float32)
    timing.timed(compute, x)
    rows, start = [], time.time()
    while time.time() - start < seconds:
        before, t0 = _cpu_times(), time.time()
        s = statistics.median(step() for _ in range(9))
        v = statistics.median(verify() for _ in range(9))
        c = statistics.median(timing.timed(compute, x)[1] for _ in range(9))
        bw = timing.memory_bandwidth(64, 9)
        after = _cpu_times()
        delta = [b - a for a, b in zip(before, after)]
        row = {"t": round(t0 - start, 1), "step_ms": s * 1e3, "verify_ms": v * 1e3,
               "compute_ms": c * 1e3,
               "bw": bw, "steal": delta[7] / max(sum(delta), 1)}
        rows.append(row)
        print(f"{row['t']:6.1f} s  step {row['step_ms']:5.2f} ms  verify/step {v / s:4.2f}  "
              f"compute {row['compute_ms']:5.2f} "
              f"ms  bw {bw / 1e9:5.1f} GB/s  steal {row['steal']:5.1%}", flush=True)
    steps = [r["step_ms"] for r in rows]
    print(f"\n{len(rows)} windows: step {min(steps):.2f}-{max(steps):.2f} ms "
          f"(median {statistics.median(steps):.2f}); corr(step, compute) = "
          f"{pearson(steps, [r['compute_ms'] for r in rows]):.2f}; corr(step, 1/bw) = "
          f"{pearson(steps, [1 / r['bw'] for r in rows]):.2f}; corr(step, steal) = "
          f"{pearson(steps, [r['steal'] for r in rows]):.2f}")
    ratio = [r["verify_ms"] / r["step_ms"] for r in rows]
    print(f"verify (5 tokens) / step: {min(ratio):.2f}-{max(ratio):.2f} (median "
          f"{statistics.median(ratio):.2f}); corr(verify/step, step) = {pearson(ratio, steps):.2f};"
          f" corr(verify/step, 1/bw) = {pearson(ratio, [1 / r['bw'] for r in rows]):.2f}")
    if json_path:
        pathlib.Path(json_path).write_text(json.dumps(rows, indent=1))


def pearson(xs, ys) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sx = sum((x - mx) ** 2 for x in xs) ** 0.5
    sy = sum((y - my) ** 2 for y in ys) ** 0.5
    return sxy / (sx * sy) if sx and sy else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                        help="one process, measuring window after window for SECONDS")
    parser.add_argument("--json", default=None, help="with --watch: write the windows here")
    args = parser.parse_args()
    if args.watch:
        watch(args.watch, args.json)
        return
    if args.child:
        print(json.dumps(child(args.repeats)))
        return
    rows = []
    for i in range(args.processes):
        placement = "both cores" if i % 2 == 0 else "core 0"
        cmd = [sys.executable, __file__, "--child", "--repeats", str(args.repeats)]
        if placement == "core 0":
            cmd = ["taskset", "-c", "0"] + cmd
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        for when in ("first", "last"):
            rows.append({"process": i, "placement": placement, "when": when, **r[when]})
            m = r[when]
            print(f"process {i} {placement:10s} {when:5s}  bw {m['bw'] / 1e9:5.1f} GB/s  "
                  f"matvec {m['matvec'] / 1e9:5.1f} GB/s  step {m['step_ms']:5.2f} ms "
                  f"({m['step_bytes_per_s'] / 1e9:4.1f} GB/s, "
                  f"{m['step_bytes_per_s'] / m['bw']:.0%} of bw)", flush=True)
    for placement in ("both cores", "core 0"):
        sel = [r for r in rows if r["placement"] == placement]
        steps = [r["step_ms"] for r in sel]
        print(f"\n{placement}: step {min(steps):.2f}-{max(steps):.2f} ms over {len(sel)} "
              f"measurements; bw {min(r['bw'] for r in sel) / 1e9:.1f}-"
              f"{max(r['bw'] for r in sel) / 1e9:.1f} GB/s; matvec median "
              f"{statistics.median(r['matvec'] for r in sel) / 1e9:.1f} GB/s; "
              f"corr(step, 1/bw) = {pearson(steps, [1 / r['bw'] for r in sel]):.2f}")
    both = [r for r in rows if r["placement"] == "both cores"]
    one = [r for r in rows if r["placement"] == "core 0"]
    if both and one:
        med = {k: (statistics.median(r[k] for r in both), statistics.median(r[k] for r in one))
               for k in ("bw", "matvec", "step_ms")}
        print(f"\none core / two cores (medians): bw {med['bw'][1] / med['bw'][0]:.2f}, matvec "
              f"{med['matvec'][1] / med['matvec'][0]:.2f}, step time "
              f"{med['step_ms'][1] / med['step_ms'][0]:.2f}")


if __name__ == "__main__":
    main()
