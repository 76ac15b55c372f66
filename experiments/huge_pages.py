"""Does the decode step stream its weights faster from 2 MiB pages than from 4 KiB pages?

A decode step at batch 1 reads every weight once, so its time is bounded by memory bandwidth.
On Linux, with transparent huge pages in ``madvise`` mode (this machine's setting), nothing jax
allocates gets a huge page, so every 4 KiB of weights costs a TLB entry and the hardware
prefetcher stops at every page boundary. This script starts fresh processes, alternating three
variants, and in each times the bundled target's decode step (float32, 64 of 256 cache slots)
and one jitted sum over 512 MiB:

* ``4k``: as jax allocates;
* ``collapse``: the same process after ``collapse`` (below) asked the kernel to back the
  weights (and the sum's buffer) with huge pages (``madvise(MADV_COLLAPSE)``, Linux 6.1+);
* ``malloc-thp``: a process started with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, so glibc's
  allocator asks for huge pages for everything from the start.

Each process reports the step before and after (for ``collapse``), the huge pages the process
holds (``AnonHugePages`` in /proc/self/smaps_rollup) and the step's weight bytes per second.

    .venv/bin/python experiments/huge_pages.py [--processes 6] [--repeats 21]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]




MADV_COLLAPSE = 25  # linux/mman.h
HUGE_PAGE = 2 ** 21


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _host_spans(tree) -> list[tuple[int, int]]:
    """(address, bytes) of every CPU buffer under ``tree`` (jax arrays; anything else skipped)."""
    import jax
    spans = []
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            if shard.device.platform != "cpu" or shard.data.nbytes == 0:
                continue
            try:
                spans.append((shard.data.unsafe_buffer_pointer(), shard.data.nbytes))
            except Exception:  # a buffer without a host address (deleted, donated)
                continue
    return spans


def collapse(tree) -> int:
    """Ask Linux to back the CPU buffers of every jax array in ``tree`` (a model's params, or any
    pytree) with 2 MiB pages. Returns the bytes of huge pages now under them (0 where the
    platform cannot: not Linux, a kernel before 6.1, no CPU buffers). Each 2 MiB-aligned region
    a buffer touches is collapsed whole, so neighbouring host memory may move to the same page;
    nothing's contents change."""
    madvise = _madvise()
    if madvise is None:
        return 0
    regions = set()
    for address, nbytes in _host_spans(tree):
        first = address // HUGE_PAGE
        last = math.ceil((address + nbytes) / HUGE_PAGE)
        regions.update(range(first, last))
    done = 0
    for region in sorted(regions):
        if madvise(region * HUGE_PAGE, HUGE_PAGE, MADV_COLLAPSE) == 0:
            done += HUGE_PAGE
    return done


def huge_mib() -> float:
    """MiB of this process's anonymous memory in transparent huge pages (Linux; NaN elsewhere)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def child(repeats: int, do_collapse: bool) -> dict:
    import jax
    import jax.numpy as jnp

    import specjax as sj
    from specjax import timing

    target = sj.load_model(sj.bundled("code-target"), "float32")
    step = timing.forward_timer(target, 1, 256, 64)
    weights = timing.step_weight_bytes(target)
    x = jnp.ones((512 * 2 ** 18,), jnp.float32)
    total = jax.jit(jnp.sum)
    timing.timed(total, x)

    def measure() -> dict:
        s = statistics.median(step() for _ in range(repeats))
        bw = x.nbytes / statistics.median(timing.timed(total, x)[1] for _ in range(repeats))
        return {"step_ms": s * 1e3, "step_gbs": weights / s / 1e9, "bw_gbs": bw / 1e9,
                "huge_mib": huge_mib()}

    out = {"before": measure()}
    if do_collapse:
        out["collapsed_mib"] = collapse([target.params, x]) / 2 ** 20
        out["after"] = measure()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--child", choices=["plain", "collapse"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.repeats, args.child == "collapse")))
        return
    rows = []
    for i in range(args.processes):
        for variant in ("collapse", "malloc-thp"):
            env = dict(os.environ)
            if variant == "malloc-thp":
                env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
            mode = "collapse" if variant == "collapse" else "plain"
            run = subprocess.run([sys.executable, __file__, "--child", mode, "--repeats",
                                  str(args.repeats)], cwd=ROOT, env=env, capture_output=True,
                                 text=True, check=True)
            r = json.loads(run.stdout.strip().splitlines()[-1])
            measured = ([("4k", r["before"]), ("collapse", r["after"])] if mode == "collapse"
                        else [("malloc-thp", r["before"])])
            for name, m in measured:
                rows.append({"process": i, "variant": name, **m})
                print(f"process {i:2d} {name:10s} step {m['step_ms']:5.2f} ms "
                      f"({m['step_gbs']:5.1f} GB/s of weights)  sum {m['bw_gbs']:5.1f} GB/s  "
                      f"huge pages {m['huge_mib']:6.0f} MiB", flush=True)
    print()
    base = {r["process"]: r for r in rows if r["variant"] == "4k"}
    for name in ("4k", "collapse", "malloc-thp"):
        sel = [r for r in rows if r["variant"] == name]
        ratio = [base[r["process"]]["step_ms"] / r["step_ms"] for r in sel]
        print(f"{name:10s} step median {statistics.median(r['step_ms'] for r in sel):5.2f} ms "
              f"(range {min(r['step_ms'] for r in sel):.2f}-{max(r['step_ms'] for r in sel):.2f})"
              f"; speed vs 4k in the same or the neighbouring process: median "
              f"{statistics.median(ratio):.2f} (range {min(ratio):.2f}-{max(ratio):.2f}); "
              f"sum median {statistics.median(r['bw_gbs'] for r in sel):.1f} GB/s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
