"""How many heavy programs sixty mixed requests compile, counted from ``jax_log_compiles``.

The requests a notebook user makes in an afternoon: batch 2, prompts of 3-40 tokens cut from the
bench's held-out texts, 8-48 new tokens, temperature 0 / 0.7 / 1 (top_k 20 or 40 when sampling),
γ 2 or 4, the bundled pair (draft model) through the Python API with its defaults. A heavy
program is a compilation of one of the engine's stages (prefill, decode); every other
compilation (key folding, small helpers) is counted apart. Each request must return its full
length of valid token ids.

    .venv/bin/python experiments/compile_count.py [--requests 60] [--seed 0]
"""

from __future__ import annotations

import argparse
import logging
import re
import time

import jax
import numpy as np

import specjax as sj
from specjax import bench

HEAVY = re.compile(r"jit\((prefill_state|decode|round_step)\)")


class CompileLog(logging.Handler):
    """Collects the names of the functions jax compiles."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Finished XLA compilation of"):
            self.names.append(message.split(" of ", 1)[1].split(" in ")[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    target = sj.load_model(sj.bundled("code-target"))
    draft = sj.load_draft_model(sj.bundled("code-draft"))
    tokenizer = sj.load_tokenizer(sj.bundled("code-target"))
    texts = [tokenizer.encode(p["text"]) for p in bench.load_prompts()]
    rng = np.random.default_rng(args.seed)

    handler = CompileLog()
    logging.getLogger("jax").addHandler(handler)  # records of jax's modules propagate to it
    jax.config.update("jax_log_compiles", True)
    t0 = time.perf_counter()
    for i in range(args.requests):
        prompts = []
        for _ in range(2):
            ids = texts[rng.integers(len(texts))]
            n = int(rng.integers(3, 41))
            start = int(rng.integers(0, max(1, len(ids) - n)))
            prompts.append(ids[start:start + n])
        temperature = float(rng.choice([0.0, 0.7, 1.0]))
        top_k = 0 if temperature == 0 else int(rng.choice([20, 40]))
        max_new = int(rng.integers(8, 49))
        gamma = int(rng.choice([2, 4]))
        out = sj.generate(target, prompts, draft=draft, key=i,
                          spec=sj.SpecConfig(num_speculative_tokens=gamma),
                          sampling=sj.SamplingParams(temperature=temperature, top_k=top_k,
                                                     max_new_tokens=max_new))
        assert (out.lengths == max_new).all(), (i, out.lengths, max_new)
        assert ((out.tokens >= 0) & (out.tokens < target.config.vocab_size)).all(), i
    seconds = time.perf_counter() - t0
    jax.config.update("jax_log_compiles", False)
    heavy = [n for n in handler.names if HEAVY.search(n)]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {args.requests} requests "
          f"(batch 2, prompts 3-40 tokens, 8-48 new, temperature 0/0.7/1, gamma 2/4), "
          f"{seconds:.0f} s in all")
    print(f"heavy programs compiled: {len(heavy)}")
    for name in sorted(set(heavy)):
        print(f"  {heavy.count(name):3d}  {name}")
    print(f"other compilations: {len(handler.names) - len(heavy)}")


if __name__ == "__main__":
    main()
