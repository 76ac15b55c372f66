"""How fast is speculative decoding here? One script for a GPU or TPU host (or, tiny, a CPU).

Random weights in the shape of a 1B-class Llama target (Llama-3.2-1B: 16 layers, width 2048,
GQA 32/8, tied 128,256-token embeddings; other shapes in specjax/shapes.py) and a small draft
(one layer, width 512, the same vocabulary), in the backend's default dtype (bfloat16 on GPU
and TPU, float32 on CPU). Random weights accept nothing, so the speculative runs use synthetic
acceptance (benchmark only, not lossless: each draft position passes with probability α). It
measures and writes to one JSON file, and prints:

* the device (kind, count), jax version, dtype;
* the roofline (``sj.roofline``): the target's forward over 1 to 16 positions at batch 1, 8
  and 32, in that batch's one-token steps, beside the weight and KV bytes it moves against the
  measured memory bandwidth (one jitted sum over 512 MiB) and its FLOPs against the measured
  peak (a chain of jitted matrix products); per batch the knee, the first width costing over
  1.25 steps, where verifying stops being nearly free;
* the draft's step in target steps (c), at batch 1 and 8;
* speculative decoding against autoregressive decoding at α ∈ {0.6, 0.8, 0.9} × γ ∈ {2, 4, 8},
  batch 1 (and α = 0.8 at batch 8), each beside the formula's prediction from α, the measured c
  and verify cost at that batch: (1 − α^(γ+1)) / ((1 − α)(γc + v));
* the adaptive program (``SpecConfig.survival_threshold``: a decode loop per verify width, the
  draft lengths chosen on the device) against the static chain at α = 0.8, γ = 4, batch 1 (one
  more program to compile, where a round is shortest), with every draft verified (threshold
  ``adaptive.EVERY_DRAFT``), so both verify the same widths and the time per round compares
  what the adaptive machinery itself costs here (on a GPU each of its one-shot loops may read
  its condition back to the host);
* with more than one device, α = 0.8, γ = 4 again on a tensor-parallel mesh over all of them.

    python experiments/accelerator_check.py                    # 1B-class on GPU/TPU, tiny on CPU
    python experiments/accelerator_check.py --size tiny --out /tmp/check.json
    python experiments/accelerator_check.py --size qwen3-0.6b

On a GPU or TPU it should finish in under 8 minutes (most of it compiling); ``--size tiny`` runs
in about a minute on a 2-core CPU (a test runs it that way).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import sys
import time

import jax
import numpy as np

import specjax as sj
from specjax import adaptive, roofline, shapes, theory, timing

ROOT = pathlib.Path(__file__).resolve().parents[1]

def models(size: str, dtype: str):
    target = sj.init_model(shapes.target_config(size, dtype=dtype), jax.random.key(0))
    draft = sj.init_model(shapes.draft_config(size, dtype=dtype), jax.random.key(1))
    return target, draft


def decode_seconds(target, draft, prompts, new_tokens, spec, mesh=None, repeats=3,
                   per_round=False) -> float:
    """Median decode seconds of one greedy generate call (compiled first); ``per_round``: its
    decode seconds per round instead."""
    def run():
        out = sj.generate(target, prompts, draft=draft if spec else None, spec=spec, mesh=mesh,
                          sampling=sj.SamplingParams(temperature=0, max_new_tokens=new_tokens),
                          allow_synthetic=True, key=0)
        return out.stats.decode_seconds / (out.stats.num_rounds if per_round else 1)
    run()
    return statistics.median(run() for _ in range(repeats))


def main() -> None:
    backend = jax.default_backend()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=shapes.names(),
                    default="tiny" if backend == "cpu" else "llama-3.2-1b",
                    help="the target's shape (specjax/shapes.py); its draft is one layer a "
                         "quarter as wide")
    ap.add_argument("--out", default=None, help="the JSON file (default: experiments/results/"
                                                "<date>-accelerator-<device>.json)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--alphas", default="0.6,0.8,0.9")
    ap.add_argument("--gammas", default="2,4,8")
    ap.add_argument("--widths", default=",".join(map(str, roofline.WIDTHS)),
                    help="verify widths of the roofline report (1 always included)")
    args = ap.parse_args()
    alphas = [float(a) for a in args.alphas.split(",")]
    gammas = [int(g) for g in args.gammas.split(",")]
    widths = sorted({1, *(int(w) for w in args.widths.split(","))})
    t_start = time.perf_counter()
    devices = jax.devices()
    kind = devices[0].device_kind
    dtype = "float32" if backend == "cpu" else "bfloat16"
    target, draft = models(args.size, dtype)
    rng = np.random.default_rng(0)
    V = target.config.vocab_size

    def prompts(batch):
        return rng.integers(1, V, size=(batch, args.prompt_tokens)).tolist()

    capacity = sj.engine.cache_capacity(target.config, max(gammas), args.prompt_tokens
                                        + args.new_tokens + max(gammas) + 1)
    context = args.prompt_tokens + args.new_tokens // 2
    batches = (1, 8)  # the speculative runs; the roofline also at 32
    roof = roofline.report(target, batches=(1, 8, 32), widths=widths, context=context,
                           capacity=capacity, log=lambda m: print(m, file=sys.stderr))
    cell = {(c["batch"], c["width"]): c for c in roof["cells"]}
    # c per batch: the draft's step over the target's, timed interleaved at that batch
    timers = {(kind_, b): timing.forward_timer(model, 1, capacity, context, batch=b)
              for b in batches for kind_, model in (("target", target), ("draft", draft))}
    seconds = timing.median_seconds(timers, 7)
    c_by_batch = {b: seconds[("draft", b)] / seconds[("target", b)] for b in batches}
    step = cell[1, 1]["ms"] / 1e3
    weight_bytes = cell[1, 1]["weight_bytes"]
    bandwidth = roof["bandwidth_bytes_per_second"]
    verify = {w: cell[1, w]["steps"] for w in widths}
    c = c_by_batch[1]

    rows = []
    for batch, alist in ((1, alphas), (8, [0.8])):  # α's share a program; each γ compiles one
        batch_prompts = prompts(batch)
        ar = decode_seconds(target, draft, batch_prompts, args.new_tokens, None)
        for alpha in alist:
            for gamma in gammas:
                spec = sj.SpecConfig(num_speculative_tokens=gamma, synthetic_acceptance=alpha)
                sp = decode_seconds(target, draft, batch_prompts, args.new_tokens, spec)
                v = cell[batch, gamma + 1]["steps"] if (batch, gamma + 1) in cell else float("nan")
                predicted = theory.expected_tokens_per_round(alpha, gamma) / (
                    gamma * c_by_batch[batch] + v)
                rows.append(dict(batch=batch, alpha=alpha, gamma=gamma, ar_seconds=ar,
                                 spec_seconds=sp, speedup=ar / sp, predicted=predicted,
                                 measured_over_predicted=ar / sp / predicted))
    # the adaptive program against the static chain, batch 1, the same widths verified
    spec = {name: sj.SpecConfig(num_speculative_tokens=4, synthetic_acceptance=0.8, **extra)
            for name, extra in (("static", {}),
                                ("adaptive", dict(survival_threshold=adaptive.EVERY_DRAFT)))}
    got = {name: decode_seconds(target, draft, prompts(1), args.new_tokens, s, per_round=True)
           for name, s in spec.items()}
    adaptive_rows = [dict(batch=1, alpha=0.8, gamma=4, static_round_ms=1e3 * got["static"],
                          adaptive_round_ms=1e3 * got["adaptive"],
                          adaptive_over_static=got["adaptive"] / got["static"])]
    mesh_row = None
    if len(devices) > 1:
        mesh = sj.make_mesh(data=1)
        batch_prompts = prompts(1)
        spec = sj.SpecConfig(num_speculative_tokens=4, synthetic_acceptance=0.8)
        ar = decode_seconds(target, draft, batch_prompts, args.new_tokens, None, mesh=mesh)
        sp = decode_seconds(target, draft, batch_prompts, args.new_tokens, spec, mesh=mesh)
        mesh_row = dict(devices=len(devices), alpha=0.8, gamma=4, ar_seconds=ar,
                        spec_seconds=sp, speedup=ar / sp)

    result = dict(
        note="synthetic acceptance: benchmark only, not lossless; random weights",
        device=dict(backend=backend, kind=kind, count=len(devices)), jax=jax.__version__,
        platform=platform.platform(), size=args.size, dtype=dtype,
        target_parameters=sum(x.size for x in jax.tree.leaves(target.params)),
        draft_parameters=sum(x.size for x in jax.tree.leaves(draft.params)),
        prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, capacity=capacity,
        roofline=dict(step_ms=1e3 * step, weight_bytes=weight_bytes,
                      bandwidth_bytes_per_second=bandwidth,
                      fraction=weight_bytes / step / bandwidth,
                      verify_cost_by_width={str(w): v for w, v in verify.items()}, report=roof),
        draft_step_c=c, draft_step_c_by_batch={str(b): x for b, x in c_by_batch.items()},
        speculative=rows, adaptive=adaptive_rows, mesh=mesh_row,
        seconds=time.perf_counter() - t_start)
    out = pathlib.Path(args.out) if args.out else (
        ROOT / "experiments" / "results" /
        f"{datetime.date.today()}-accelerator-{kind.replace(' ', '-').lower()}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")

    print(f"{kind} x {len(devices)} ({backend}), jax {jax.__version__}, {args.size} target "
          f"({result['target_parameters'] / 1e6:.1f}M parameters, {dtype}), draft "
          f"{result['draft_parameters'] / 1e6:.1f}M; synthetic acceptance: NOT LOSSLESS, "
          f"benchmark only")
    print(f"roofline: {weight_bytes / 2**20:.0f} MiB of weights per {1e3 * step:.2f} ms step = "
          f"{weight_bytes / step / 1e9:.1f} GB/s against {bandwidth / 1e9:.1f} GB/s measured "
          f"({result['roofline']['fraction']:.0%})")
    print(roofline.format_report(roof))
    print("draft step c (target steps): " + ", ".join(
        f"batch {b}: {x:.3f}" for b, x in c_by_batch.items()))
    print(f"{'batch':>5} {'alpha':>5} {'gamma':>5} {'speed-up':>9} {'predicted':>9} "
          f"{'meas/pred':>9}")
    for r in rows:
        print(f"{r['batch']:5d} {r['alpha']:5.2f} {r['gamma']:5d} {r['speedup']:8.2f}x "
              f"{r['predicted']:8.2f}x {r['measured_over_predicted']:9.2f}")
    for r in adaptive_rows:
        print(f"adaptive program, every draft verified, batch {r['batch']}, alpha 0.8, gamma 4: "
              f"a round {r['adaptive_round_ms']:.2f} ms against the static chain's "
              f"{r['static_round_ms']:.2f} ms ({r['adaptive_over_static']:.2f})")
    if mesh_row:
        print(f"mesh over {mesh_row['devices']} devices, alpha 0.8, gamma 4: "
              f"{mesh_row['speedup']:.2f}x")
    print(f"wrote {out} in {result['seconds']:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
