"""How the test suite compiles its programs faster (set in tests/conftest.py).

The suite compiles hundreds of small programs, and on a fresh clone (CI) compiling, not running,
takes most of its time. Three settings of XLA's CPU code generator make compiling these tiny
programs much cheaper:
- LLVM at -O0 (the default is -O3): alone, about a quarter less compile time on two test files;
- XLA's older elemental emitters instead of its newer fusion emitters;
- each module compiled as one piece, not split for parallel code generation.
Measured on this 2-core CPU with an empty cache, compiling a chain, an n-gram, a tree and an
autoregressive program of a V = 8 model: the backend compile took 17.5 s at -O0 alone and 6.0 s
with all three. Running such programs is about as fast (a 40,000-row three-token chain: 3.0 s
against 3.2 s a call), with the same tokens.
Only how the CPU backend emits machine code changes, not XLA's graph passes or floating-point
semantics, and every program a test compares is compiled the same way. Benchmarks and users
keep the defaults. A setting the caller's XLA_FLAGS already names is kept. XLA aborts on
unknown flags, so a jaxlib that no longer knows one of these (probed once, in a subprocess)
gets none of them.

Under pytest-xdist each worker is also pinned to its own share of the CPUs
(``pin_xdist_worker``; the programs and processes it starts inherit that), so its XLA thread
pool does not run kernels on the core the other worker compiles on. test_lossless.py and
test_engine.py run side by side (fresh caches, two rounds) took 4% and 15% less user CPU pinned.
"""

import os
import subprocess
import sys

FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                "--xla_cpu_parallel_codegen_split_count=1")


def xla_flags(flags: str) -> str:
    """``flags`` with every FAST_COMPILE setting it does not name added, if this jaxlib knows
    them all (probed once, in a subprocess); otherwise ``flags`` unchanged."""
    named = {f.split("=")[0] for f in flags.split()}
    extra = [f for f in FAST_COMPILE if f.split("=")[0] not in named]
    if not extra:
        return flags
    wanted = " ".join([flags, *extra]).strip()
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                           env=dict(os.environ, XLA_FLAGS=wanted, JAX_PLATFORMS="cpu"),
                           capture_output=True)
    return wanted if probe.returncode == 0 else flags


def pin_xdist_worker() -> None:
    """Pin this pytest-xdist worker (``gw<i>`` of ``PYTEST_XDIST_WORKER_COUNT``) to every n-th
    CPU it may run on, starting at the i-th, when there are at least as many CPUs as workers;
    anything else (no xdist, one worker, fewer CPUs, no sched_setaffinity) is left as it is."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= count:
        os.sched_setaffinity(0, cpus[int(worker[2:]) % count::count])
