"""How large each decode program is and how long it takes to compile, at two commits.

For the bundled pair through ``sj.generate`` with its defaults (float32 on CPU), a few methods
whose decode loop verifies over several widths (n-gram, adaptive lengths, a verify budget
with rests) and a static chain as a control: the decode program's HLO instructions (after
XLA's optimisations), the seconds XLA spent compiling the call's programs, and the whole first
call, each program compiled afresh (JAX's and specjax's disk caches off), old and new
interleaved, with the output tokens compared.

    .venv/bin/python experiments/program_size.py HEAD~1
    .venv/bin/python experiments/program_size.py HEAD~1 --methods "draft_model~0.2" --gammas 8

``old`` is extracted with ``git archive`` and imported as ``specjax_old``, as
``experiments/ab_commits.py`` does; "new" is the work tree.
"""

from __future__ import annotations

import argparse
import os

os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # every program compiled afresh

import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from ab_commits import old_package, setup  # noqa: E402
from jax._src import dispatch  # noqa: E402

COSTS = {4: (1.0, 1.2, 1.4, 1.6, 1.8), 8: (1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8)}


def spec_of(sj, method: str, gamma: int):
    """(SpecConfig, draft key) for a method name: ``draft_model~X`` adaptive lengths at
    threshold X, ``budget`` the draft model with a verify budget (which rests), ``ngram``,
    ``draft_model`` the static chain."""
    name, _, threshold = method.partition("~")
    if name == "budget":
        return sj.SpecConfig(num_speculative_tokens=gamma, verify_costs=COSTS[gamma],
                             draft_cost=0.05), "draft_model"
    if name == "ngram":
        return sj.SpecConfig(method="ngram", num_speculative_tokens=gamma), None
    extra = {"survival_threshold": float(threshold)} if threshold else {}
    return sj.SpecConfig(method=name, num_speculative_tokens=gamma, **extra), name


def measure(sj, target, drafts, prompts, method, gamma, temperature):
    compiled = []

    def listen(event, duration, **_):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            compiled.append(duration)
    sj.engine.PROGRAMS.clear()
    jax.clear_caches()
    spec, draft = spec_of(sj, method, gamma)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        start = time.perf_counter()
        out = sj.generate(target, prompts[:1], spec=spec, draft=drafts.get(draft),
                          sampling=sj.SamplingParams(temperature=temperature,
                                                     max_new_tokens=64),
                          key=jax.random.key(0))
        wall = time.perf_counter() - start
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    size = sum(sum(1 for line in exe.as_text().splitlines() if " = " in line)
               for program in sj.engine.PROGRAMS.programs()
               for exe in program.executables("decode"))
    return size, sum(compiled), wall, np.asarray(out.tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="the older commit")
    ap.add_argument("--methods", default="draft_model~0.2,budget,ngram,draft_model")
    ap.add_argument("--gammas", default="4,8")
    ap.add_argument("--temperatures", default="0,0.8")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = old_package(args.old, tmp)

        import specjax as new
        setups = {"old": (old, *setup(old, 1)), "new": (new, *setup(new, 1))}
        print(f"old = {args.old}, new = the work tree; decode HLO instructions, XLA compile "
              f"seconds of the call, first call seconds; the first bench prompt, 64 tokens")
        print("| method | γ | T | HLO old | HLO new | compile old (s) | compile new (s) | "
              "call old (s) | call new (s) | same tokens |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for method in args.methods.split(","):
            for gamma in map(int, args.gammas.split(",")):
                for t in map(float, args.temperatures.split(",")):
                    got = {name: measure(sj, target, drafts, prompts, method, gamma, t)
                           for name, (sj, target, drafts, prompts) in setups.items()}
                    (s0, c0, w0, t0), (s1, c1, w1, t1) = got["old"], got["new"]
                    print(f"| {method} | {gamma} | {t:g} | {s0:,} | {s1:,} | {c0:.1f} | "
                          f"{c1:.1f} | {w0:.1f} | {w1:.1f} | {np.array_equal(t0, t1)} |",
                          flush=True)


if __name__ == "__main__":
    main()
