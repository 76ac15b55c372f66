"""DraftVocab.widen as a gather against the scatter it was until 2026-12-07.

A drafter with a draft vocabulary (the bundled draft's 2,048 of the target's 8,192 ids) draws
from q over its own ids; at T > 0 the verifier reads q over the whole vocabulary, so each
round widens the chain's q's [B, γ, M] to [B, γ, V]. This times both ways: (1) the widen alone,
50 times inside one compiled loop (the sum of each result read, so none is skipped), at several
batch sizes and γ, the two interleaved (it cannot see a layout copy: a profile of the decode
program can, ``experiments/decode_profile.py``); (2) one round of ``sj.generate``'s own
program (``timing.round_timers``) for the bundled pair, a static chain at T = 0.8, with the
draft's vocabulary widened each way (two pytree classes, so both programs live in one
process), timed interleaved, median of repeats.

    .venv/bin/python experiments/widen_gather.py [--batch-size 1,4,16] [--gamma 8] [--repeats 7]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

import jax
import jax.numpy as jnp

import specjax as sj
from specjax import bench, timing
from specjax.draft.vocab import DraftVocab

CKPT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScatterVocab(DraftVocab):
    """The draft vocabulary with widen as it was until 2026-12-07: a scatter along the last axis."""

    def widen(self, sub, vocab_size):
        full = jnp.zeros(sub.shape[:-1] + (vocab_size,), jnp.float32)
        return full.at[..., self.ids].set(sub)


def widen_timer(vocab: DraftVocab, V: int, shape: tuple[int, ...]):
    """A timer (``timing.median_seconds``) of one widen of q's of ``shape`` [..., M]: 50 inside
    one compiled loop, seconds per widen. Compiles before returning."""
    def run(sub, vocab):
        def body(i, acc):
            return acc + vocab.widen(sub * (1.0 + i), V).sum()
        return jax.lax.fori_loop(0, 50, body, 0.0)
    f = jax.jit(run)
    sub = jax.random.uniform(jax.random.key(0), shape)
    timing.timed(f, sub, vocab)
    return lambda: timing.timed(f, sub, vocab)[1] / 50


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", default="1,4,16")
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    target = sj.load_model(CKPT / "code-target")
    draft = sj.load_draft_model(CKPT / "code-draft")
    V, v = target.config.vocab_size, draft.vocab
    old = ScatterVocab(v.ids, v.head, v.softcap)
    sizes = [int(b) for b in args.batch_size.split(",")]
    print(f"draft vocabulary {v.size} of {V} ids; jax {jax.__version__}, {jax.devices()[0]}")
    print("\n(1) the widen alone, µs a call (50 in one compiled loop; median of interleaved "
          "repeats)")
    print(f"{'batch':>6} {'γ':>3} {'scatter':>9} {'gather':>9} {'ratio':>6}")
    for B in sizes:
        for G in sorted({1, 4, args.gamma}):
            t = timing.median_seconds({k: widen_timer(x, V, (B, G, v.size))
                                       for k, x in (("s", old), ("g", v))}, args.repeats)
            s, g = t["s"], t["g"]
            print(f"{B:>6} {G:>3} {s * 1e6:9.0f} {g * 1e6:9.0f} {s / g:6.2f}", flush=True)
    print(f"\n(2) one round of generate's program, bundled pair, static γ {args.gamma}, T 0.8, "
          f"ms (median of {args.repeats} interleaved)")
    tok = sj.load_tokenizer(CKPT / "code-target")
    prompt = tok.encode(bench.load_prompts()[0]["text"])
    sampling = sj.SamplingParams(temperature=0.8, max_new_tokens=256)
    spec = sj.SpecConfig(num_speculative_tokens=args.gamma)
    print(f"{'batch':>6} {'AR step':>8} {'scatter':>9} {'gather':>9} {'ratio':>6}")
    for B in sizes:
        timers = {"ar": timing.round_timers(target, prompt, sampling=sampling, batch=B)["round"]}
        for name, vocab in (("scatter", old), ("gather", v)):
            timers[name] = timing.round_timers(
                target, prompt, sampling=sampling, spec=spec,
                draft=dataclasses.replace(draft, vocab=vocab), batch=B)["round"]
        s = timing.median_seconds(timers, args.repeats)
        print(f"{B:>6} {s['ar'] * 1e3:8.2f} {s['scatter'] * 1e3:9.2f} {s['gather'] * 1e3:9.2f} "
              f"{s['scatter'] / s['gather']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
