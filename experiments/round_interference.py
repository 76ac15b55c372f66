"""What a round costs beyond its two forwards, split: the parts disturbing each other, and the rest.

Four programs, each ``timing.INNER`` repetitions from one state of ``sj.generate``'s own loop
(bundled pair, bench prompt 1 after 64 tokens, γ 4), timed interleaved in one process:

* propose   the proposer's propose alone (as ``timing.round_timers``' "propose")
* verify    the target's forward over γ + 1 tokens alone (as ``timing.forward_timer``)
* both      the two back to back in one loop, the forward fed the first draft and the next
            propose waiting for the forward, nothing else: what they cost together when each
            evicts the other's weights and buffers from the CPU's caches
* round     generate's whole round (``round_timers``' "round")
* const     the same round with the proposer's drafts replaced by constants (no draft forward):
            verification and bookkeeping on top of the verify forward

so both / (propose + verify) is the interference, round / both what the round adds to its two
forwards (verification, bookkeeping, the data dependencies between them), const / verify the
round's own work with no drafter in it.

    .venv/bin/python experiments/round_interference.py [--method eagle] [--repeats 21]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp

import specjax as sj
from specjax import bench, engine, sampling, timing
from specjax.cache import KVCache
from specjax.draft import Draft
from specjax.draft.draft_model import as_draft_model

CKPT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"


def constant(proposer):
    """The proposer with its propose replaced by γ zero drafts (its state left as it was)."""
    class Constant(type(proposer)):
        def propose(self, params, state, history, length, keys, sampling_params, filters):
            return Draft(jnp.zeros((history.shape[0], self.gamma), jnp.int32), None), state
    return Constant(**{f.name: getattr(proposer, f.name) for f in dataclasses.fields(proposer)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="draft_model", choices=["draft_model", "eagle"])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    tok = sj.load_tokenizer(CKPT / "code-target")
    target = sj.load_model(CKPT / "code-target")
    draft = (sj.load_draft_model(CKPT / "code-draft") if args.method == "draft_model"
             else sj.load_heads(CKPT / "code-eagle", target))
    prompt = tok.encode(bench.load_prompts()[0]["text"])
    sp = sj.SamplingParams(temperature=args.temperature, max_new_tokens=256)
    spec = sj.SpecConfig(method=args.method, num_speculative_tokens=4)
    timers = timing.round_timers(target, prompt, spec=spec, draft=draft, decoded=64, sampling=sp)
    # the same state round_timers times from, for the hand-built programs
    _, _, plan, target, draft_params, inputs = engine._prepare(
        target, [prompt], sp, spec, draft, None, 0, None, False, None, None, False)
    params = target.params
    state = engine._STAGES["prefill"](plan, params, draft_params, inputs.prompts, inputs.lengths,
                                      inputs.request)
    while int(state.num_generated[0]) < 64:
        state = engine._STAGES["round"](plan, params, draft_params, inputs.request, state)
    view = as_draft_model(target)
    G = plan.gamma
    tcache = KVCache.init(view.config, 1, state.cache.capacity).rollback(state.length)

    def program(propose: bool, verify: bool):
        def run(plan, target_params, draft_params, request, state, tcache):
            keys, _ = engine.round_keys(request.keys, state.step)

            def body(_, carry):
                draft_state, tc, total = carry
                first = jnp.ones((1, 1), jnp.int32)
                if propose:
                    # after the last forward, as in a round (else XLA may overlap the two)
                    after = state.length + (total * 0).astype(jnp.int32)
                    s = dataclasses.replace(state, draft_state=draft_state, length=after)
                    d, draft_state = engine._propose(plan, target_params, draft_params, request,
                                                     s, keys)
                    for x in jax.tree.leaves(d):  # every output feeds the result
                        total = total + jnp.sum(x.astype(jnp.float32))
                    first = d.tokens[:, :1]
                if verify:
                    tokens = jnp.concatenate([first, jnp.ones((1, G), jnp.int32)], 1)
                    positions = tcache.length[:, None] + jnp.arange(G + 1)[None, :]
                    logits, tc = view.logits(tokens, positions, tc)
                    total = total + jnp.sum(sampling.argmax(logits).astype(jnp.float32))
                    tc = tc.rollback(tcache.length)
                return draft_state, tc, total
            return jax.lax.fori_loop(0, timing.INNER, body, (state.draft_state, tcache,
                                                             jnp.zeros((), jnp.float32)))[2]
        exe = jax.jit(engine._with_blocks(run), static_argnums=0).lower(
            plan, params, draft_params, inputs.request, state, tcache).compile()
        return lambda: timing.timed(exe, params, draft_params, inputs.request, state,
                                    tcache)[1] / timing.INNER

    const_plan = dataclasses.replace(plan, proposer=constant(plan.proposer))
    const = timing._REPEATED["round"].lower(const_plan, None, params, draft_params,
                                            inputs.request, state).compile()
    tm = {"propose": program(True, False), "verify": program(False, True),
          "both": program(True, True), "round": timers["round"],
          "const": lambda: timing.timed(const, params, draft_params, inputs.request,
                                        state)[1] / timing.INNER}
    for f in tm.values():
        f()
    t0 = time.perf_counter()
    m = {k: 1e6 * statistics.median(v) for k, v in timing.interleaved(tm, args.repeats).items()}
    p, v = m["propose"], m["verify"]
    print(f"{args.method}, γ {G}, T = {args.temperature}, median of {args.repeats} interleaved "
          f"repeats ({time.perf_counter() - t0:.0f} s), µs per round:")
    print("  " + "  ".join(f"{k} {x:.0f}" for k, x in m.items()))
    print(f"  both / (propose + verify) {m['both'] / (p + v):.3f}   round / both "
          f"{m['round'] / m['both']:.3f}   round / (propose + verify) {m['round'] / (p + v):.3f}"
          f"   const / verify {m['const'] / v:.3f}")


if __name__ == "__main__":
    main()
