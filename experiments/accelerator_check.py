"""How fast is speculative decoding here? One script for a GPU or TPU host (or, tiny, a CPU).

Random weights in the shape of a 1B-class Llama target (Llama-3.2-1B: 16 layers, width 2048,
GQA 32/8, tied 128,256-token embeddings; other shapes in specjax/shapes.py) and a small draft
(one layer, width 512, the same vocabulary), in the backend's default dtype (bfloat16 on GPU
and TPU, float32 on CPU; ``--dtype`` overrides). Random weights accept nothing, so the
speculative runs use synthetic acceptance (benchmark only, not lossless: each draft position
passes with probability α). In sections, each saved to the JSON file as soon as it is done:

1. the device (kind, count), jax version, dtype, parameter counts;
2. ``roofline``: the target's forward over 1 to 16 positions at batch 1, 8 and 32, in that
   batch's one-token steps, beside the weight and KV bytes it moves against the measured memory
   bandwidth (one jitted sum over 512 MiB; 2 GiB off CPU, so that one dispatch does not count)
   and its FLOPs against the measured peak; per batch the knee, the first width costing over
   1.25 steps, where verifying stops being nearly free;
3. ``draft_step``: the draft's step in target steps (c), at batch 1 and 8;
4. ``batch 1`` and ``batch 8``: speculative decoding against autoregressive decoding at
   α ∈ {0.6, 0.8, 0.9} × γ ∈ {2, 4, 8}, each beside the formula's prediction from α, the
   measured c and verify cost v at that batch, (1 − α^(γ+1)) / ((1 − α)(γc + v)); beside the
   prediction from the tokens a round really gave (the coin's luck, and at batch 8 the loop
   running until its slowest row ends), so that what a round costs beyond γc + v shows apart;
   and the textbook figure with v = 1. Batch 1's autoregressive loop against the bandwidth
   (``ar_bandwidth_fraction``: the weights read per step over the measured bandwidth);
5. ``mesh``, with more than one device: α = 0.8, γ = 4 again on a tensor-parallel mesh over all
   of them (the target sharded once);
6. ``adaptive``, with ``--adaptive``: the adaptive program (a decode loop per verify width)
   against the static chain, every draft verified, per round.

A section that fails is recorded (its traceback under "errors") and the next runs; a section
that would start after ``--budget-seconds`` is skipped and recorded so. Progress goes to stderr
as it happens. On a device machine (the repository copied there, nothing installed)::

    PYTHONUNBUFFERED=1 timeout 540 python3 experiments/accelerator_check.py \\
        --out $OUT/accelerator.json 2>&1 | tee $OUT/log.txt

(``--out`` defaults to $OUT/accelerator.json where $OUT is set, else
experiments/results/<date>-accelerator-<device>.json.) Here::

    python experiments/accelerator_check.py --size tiny --out /tmp/check.json

On a GPU or TPU it should finish in under 8 minutes (most of it compiling: 32 forwards for the
roofline and c, two programs per γ and batch); ``--size tiny`` runs in about two minutes on a
2-core CPU (a test runs it that way).
"""

from __future__ import annotations

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a device machine has the repository, not an installed specjax
# a throwaway machine: no disk cache to fill, and jax's own settings (specjax then touches none
# of jax's cache internals, whatever jax version the machine has)
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import specjax as sj  # noqa: E402
from specjax import adaptive, roofline, shapes, theory, timing  # noqa: E402
from specjax.bench import finite_json  # noqa: E402


def models(size: str, dtype: str):
    target = sj.init_model(shapes.target_config(size, dtype=dtype), jax.random.key(0))
    draft = sj.init_model(shapes.draft_config(size, dtype=dtype), jax.random.key(1))
    return target, draft


def decode_seconds(target, draft, prompts, new_tokens, spec, mesh=None, repeats=3):
    """(median decode seconds of one greedy generate call, compiled first; its Stats)."""
    def run():
        return sj.generate(target, prompts, draft=draft if spec else None, spec=spec, mesh=mesh,
                           sampling=sj.SamplingParams(temperature=0, max_new_tokens=new_tokens),
                           allow_synthetic=True, key=0).stats
    stats = run()
    return statistics.median(run().decode_seconds for _ in range(repeats)), stats


def comparison(alpha, gamma, ar, ar_stats, sp, stats, c, v) -> dict:
    """One speculative row: the speed-up against the formula's prediction from α (and from the
    tokens a round really gave), the round's cost in autoregressive steps against γc + v."""
    step = ar / ar_stats.num_rounds  # an autoregressive step (its loop: new_tokens - 1 rounds)
    round_steps = sp / stats.num_rounds / step
    realized = ar_stats.num_rounds / stats.num_rounds  # tokens a round gave the batch
    return dict(alpha=alpha, gamma=gamma, ar_seconds=ar, spec_seconds=sp, speedup=ar / sp,
                predicted=theory.expected_tokens_per_round(alpha, gamma) / (gamma * c + v),
                predicted_v1=theory.speedup(alpha, gamma, c), rounds=stats.num_rounds,
                tokens_per_round=realized, predicted_from_rounds=realized / (gamma * c + v),
                round_steps=round_steps, formula_round_steps=gamma * c + v,
                measured_over_predicted=ar / sp / (theory.expected_tokens_per_round(alpha, gamma)
                                                   / (gamma * c + v)))


def main() -> None:
    backend = jax.default_backend()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=shapes.names(),
                    default="tiny" if backend == "cpu" else "llama-3.2-1b",
                    help="the target's shape (specjax/shapes.py); its draft is one layer a "
                         "quarter as wide")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="auto: float32 on CPU, bfloat16 on GPU and TPU")
    ap.add_argument("--out", default=None, help="the JSON file (default: $OUT/accelerator.json "
                                                "where $OUT is set, else experiments/results/"
                                                "<date>-accelerator-<device>.json)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--alphas", default="0.6,0.8,0.9")
    ap.add_argument("--gammas", default="2,4,8")
    ap.add_argument("--widths", default=",".join(map(str, roofline.WIDTHS)),
                    help="verify widths of the roofline report (1 and each γ + 1 always "
                         "included)")
    ap.add_argument("--adaptive", action="store_true",
                    help="also time the adaptive program against the static chain")
    ap.add_argument("--budget-seconds", type=float, default=420,
                    help="start no section after this long (default 420: 7 minutes)")
    args = ap.parse_args()
    alphas = [float(a) for a in args.alphas.split(",")]
    gammas = [int(g) for g in args.gammas.split(",")]
    widths = sorted({1, *(int(w) for w in args.widths.split(",")), *(g + 1 for g in gammas)})
    t_start = time.perf_counter()
    devices = jax.devices()
    kind = devices[0].device_kind
    dtype = args.dtype if args.dtype != "auto" else ("float32" if backend == "cpu"
                                                     else "bfloat16")
    out = pathlib.Path(args.out) if args.out else (
        pathlib.Path(os.environ["OUT"]) / "accelerator.json" if os.environ.get("OUT") else
        ROOT / "experiments" / "results" /
        f"{datetime.date.today()}-accelerator-{kind.replace(' ', '-').lower()}.json")
    result = dict(note="synthetic acceptance: benchmark only, not lossless; random weights",
                  device=dict(backend=backend, kind=kind, count=len(devices)),
                  jax=jax.__version__, platform=platform.platform(), size=args.size,
                  dtype=dtype, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                  sections={}, errors={})

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {message}", file=sys.stderr, flush=True)

    def save() -> None:
        result["seconds"] = time.perf_counter() - t_start
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(finite_json(result), indent=1, allow_nan=False) + "\n")
        os.replace(tmp, out)

    def section(name: str, run, required: bool = False) -> bool:
        """Run one section unless the budget is spent (``required``: whatever the budget);
        record its time or its failure; save."""
        spent = time.perf_counter() - t_start
        if spent > args.budget_seconds and not required:
            result["sections"][name] = (f"skipped: {spent:.0f} s spent, budget "
                                        f"{args.budget_seconds:g} s")
            log(f"{name}: skipped (time budget)")
            save()
            return False
        log(f"{name} ...")
        began = time.perf_counter()
        try:
            run()
            result["sections"][name] = round(time.perf_counter() - began, 1)
            log(f"{name}: done in {time.perf_counter() - began:.0f} s")
            return True
        except Exception:  # recorded, and the next section runs
            result["errors"][name] = traceback.format_exc()
            result["sections"][name] = "failed"
            log(f"{name}: FAILED\n{result['errors'][name]}")
            return False
        finally:
            save()

    state = {}

    def build():
        target, draft = models(args.size, dtype)
        state.update(target=target, draft=draft)
        result.update(target_parameters=sum(x.size for x in jax.tree.leaves(target.params)),
                      draft_parameters=sum(x.size for x in jax.tree.leaves(draft.params)))
    if not section("models", build, required=True):
        return finish(result, out)
    target, draft = state["target"], state["draft"]
    rng = np.random.default_rng(0)
    V = target.config.vocab_size

    def prompts(batch):
        return rng.integers(1, V, size=(batch, args.prompt_tokens)).tolist()

    capacity = sj.engine.cache_capacity(target.config, max(gammas), args.prompt_tokens
                                        + args.new_tokens + max(gammas) + 1)
    context = args.prompt_tokens + args.new_tokens // 2
    batches = (1, 8)  # the speculative runs; the roofline also at 32
    result["capacity"] = capacity

    def roof():
        bandwidth = timing.memory_bandwidth(mib=512 if backend == "cpu" else 2048)
        report = roofline.report(target, batches=(1, 8, 32), widths=widths, context=context,
                                 capacity=capacity, bandwidth=bandwidth, log=log)
        cell = {(c["batch"], c["width"]): c for c in report["cells"]}
        step = cell[1, 1]["ms"] / 1e3
        state.update(cell=cell, bandwidth=bandwidth)
        result["roofline"] = dict(
            step_ms=1e3 * step, weight_bytes=cell[1, 1]["weight_bytes"],
            bandwidth_bytes_per_second=bandwidth,
            fraction=cell[1, 1]["weight_bytes"] / step / bandwidth,
            verify_cost_by_width={str(w): cell[1, w]["steps"] for w in widths}, report=report)
    section("roofline", roof)

    def draft_step():
        timers = {(kind_, b): timing.forward_timer(model, 1, capacity, context, batch=b)
                  for b in batches for kind_, model in (("target", target), ("draft", draft))}
        seconds = timing.median_seconds(timers, 7)
        state["c"] = {b: seconds[("draft", b)] / seconds[("target", b)] for b in batches}
        result["draft_step_c"] = state["c"][1]
        result["draft_step_c_by_batch"] = {str(b): x for b, x in state["c"].items()}
    section("draft_step", draft_step)

    def verify_cost(batch: int, gamma: int) -> float:
        cell = state.get("cell", {}).get((batch, gamma + 1))
        return cell["steps"] if cell else float("nan")

    result["speculative"] = []
    for batch in batches:  # α's share a program; each γ compiles one
        def speculative(batch=batch):
            if "c" not in state:
                raise RuntimeError("no draft step c (its section failed)")
            batch_prompts = prompts(batch)
            ar, ar_stats = decode_seconds(target, draft, batch_prompts, args.new_tokens, None)
            if batch == 1 and "bandwidth" in state:
                result["ar_bandwidth_fraction"] = (state["cell"][1, 1]["weight_bytes"]
                                                   / (ar / ar_stats.num_rounds)
                                                   / state["bandwidth"])
            for gamma in gammas:
                for alpha in alphas:
                    spec = sj.SpecConfig(num_speculative_tokens=gamma,
                                         synthetic_acceptance=alpha)
                    sp, stats = decode_seconds(target, draft, batch_prompts, args.new_tokens,
                                               spec)
                    result["speculative"].append(dict(batch=batch, **comparison(
                        alpha, gamma, ar, ar_stats, sp, stats, state["c"][batch],
                        verify_cost(batch, gamma))))
                    save()
        section(f"batch {batch}", speculative)

    result["mesh"] = None
    if len(devices) > 1:
        def on_mesh():
            mesh = sj.make_mesh(data=1)
            sharded = sj.shard(target, mesh)  # once: each call would place it again
            batch_prompts = prompts(1)
            spec = sj.SpecConfig(num_speculative_tokens=4, synthetic_acceptance=0.8)
            ar, ar_stats = decode_seconds(sharded, draft, batch_prompts, args.new_tokens, None,
                                          mesh=mesh)
            sp, stats = decode_seconds(sharded, draft, batch_prompts, args.new_tokens, spec,
                                       mesh=mesh)
            # predicted with one device's c and v (the mesh's own are not measured)
            result["mesh"] = dict(devices=len(devices), **comparison(
                0.8, 4, ar, ar_stats, sp, stats, state.get("c", {}).get(1, float("nan")),
                verify_cost(1, 4)))
        section("mesh", on_mesh)

    result["adaptive"] = []
    if args.adaptive:
        def adaptive_program():
            spec = {name: sj.SpecConfig(num_speculative_tokens=4, synthetic_acceptance=0.8,
                                        **extra)
                    for name, extra in (("static", {}),
                                        ("adaptive",
                                         dict(survival_threshold=adaptive.EVERY_DRAFT)))}
            batch_prompts = prompts(1)
            got = {}
            for name, s in spec.items():
                seconds, stats = decode_seconds(target, draft, batch_prompts, args.new_tokens, s)
                got[name] = seconds / stats.num_rounds
            result["adaptive"].append(dict(
                batch=1, alpha=0.8, gamma=4, static_round_ms=1e3 * got["static"],
                adaptive_round_ms=1e3 * got["adaptive"],
                adaptive_over_static=got["adaptive"] / got["static"]))
        section("adaptive", adaptive_program)
    finish(result, out)


def finish(result: dict, out: pathlib.Path) -> None:
    """The table, from whatever was saved."""
    r = result
    print(f"{r['device']['kind']} x {r['device']['count']} ({r['device']['backend']}), jax "
          f"{r['jax']}, {r['size']} target ({r.get('target_parameters', 0) / 1e6:.1f}M "
          f"parameters, {r['dtype']}), draft {r.get('draft_parameters', 0) / 1e6:.1f}M; "
          f"synthetic acceptance: NOT LOSSLESS, benchmark only")
    roof = r.get("roofline")
    if roof:
        print(f"roofline: {roof['weight_bytes'] / 2**20:.0f} MiB of weights per "
              f"{roof['step_ms']:.2f} ms step = "
              f"{roof['weight_bytes'] / roof['step_ms'] / 1e6:.1f} GB/s against "
              f"{roof['bandwidth_bytes_per_second'] / 1e9:.1f} GB/s measured "
              f"({roof['fraction']:.0%})")
        print(roofline.format_report(roof["report"]))
    if "ar_bandwidth_fraction" in r:
        print(f"autoregressive decoding, batch 1: {r['ar_bandwidth_fraction']:.0%} of the "
              f"measured bandwidth")
    if "draft_step_c_by_batch" in r:
        print("draft step c (target steps): " + ", ".join(
            f"batch {b}: {x:.3f}" for b, x in r["draft_step_c_by_batch"].items()))
    rows = r.get("speculative") or []
    if rows:
        print(f"{'batch':>5} {'alpha':>5} {'gamma':>5} {'speed-up':>9} {'predicted':>9} "
              f"{'meas/pred':>9} {'tok/round':>9} {'from rounds':>11} {'round':>6} "
              f"{'γc+v':>6} {'v=1':>6}")
        for x in rows:
            print(f"{x['batch']:5d} {x['alpha']:5.2f} {x['gamma']:5d} {x['speedup']:8.2f}x "
                  f"{x['predicted']:8.2f}x {x['measured_over_predicted']:9.2f} "
                  f"{x['tokens_per_round']:9.2f} {x['predicted_from_rounds']:10.2f}x "
                  f"{x['round_steps']:6.2f} {x['formula_round_steps']:6.2f} "
                  f"{x['predicted_v1']:5.2f}x")
    if r.get("mesh"):
        m = r["mesh"]
        print(f"mesh over {m['devices']} devices, alpha 0.8, gamma 4: {m['speedup']:.2f}x "
              f"(predicted from one device's c and v: {m['predicted']:.2f}x)")
    for x in r.get("adaptive") or []:
        print(f"adaptive program, every draft verified, batch {x['batch']}, alpha 0.8, "
              f"gamma 4: a round {x['adaptive_round_ms']:.2f} ms against the static chain's "
              f"{x['static_round_ms']:.2f} ms ({x['adaptive_over_static']:.2f})")
    for name, text in r["errors"].items():
        print(f"section {name} FAILED: {text.strip().splitlines()[-1]}")
    print(f"wrote {out} in {r.get('seconds', 0):.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
