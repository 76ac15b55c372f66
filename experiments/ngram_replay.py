"""Replay n-gram lookup rules offline against the target's own continuations.

The target's greedy output does not depend on the drafts (speculative decoding is lossless), so
how many drafts a round accepts under any lookup rule follows from one greedy continuation per
prompt: each round looks the history up, accepts the longest prefix of the draft that agrees with
the continuation, and emits one more token. A round's cost is the verify forward's cost at its
width (drafts + 1), measured here in autoregressive steps; the predicted speed-up is tokens over
summed cost. At T = 1 the replay runs on sampled continuations: a point-mass draft d is accepted
with probability p(d), which is the probability that the sample equals d, so the prediction is
unbiased there too.

    .venv/bin/python experiments/ngram_replay.py [--target checkpoints/code-target]
        [--settings 4,2,4 8,2,8,1.5 12,2,8,1.5] [--rules longest-latest latest earliest frequent]
        [--max-new-tokens 128] [--samples 4] [--slope 0.067]

Settings are gamma,min,max[,length factor] as in bench_ngram.py. Rules say which occurrence of the
longest matching suffix wins: longest-latest (specjax's: the longest available continuation, the
latest among those), latest, earliest (Hugging Face's prompt lookup takes the first match), or
frequent (the continuation that most occurrences share). Without --slope the verify cost of each
width is timed here (the target's forward in a jitted loop); with it, width w costs
1 + slope × (w - 1) steps.
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics

from bench_ngram import PROMPT_SETS, setting

import specjax as sj
from specjax import timing


def occurrences(history: list[int], n_min: int, n_max: int) -> list[tuple[int, int]]:
    """(match length capped at n_max, end index e) of every earlier occurrence of the history's
    last tokens, for match lengths >= n_min."""
    last = len(history) - 1
    found = []
    for e in range(last):
        n = 0
        while n < n_max and e - n >= 0 and history[e - n] == history[last - n]:
            n += 1
        if n >= n_min:
            found.append((n, e))
    return found


def propose(history: list[int], spec: sj.SpecConfig, rule: str) -> list[int]:
    found = occurrences(history, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if not found:
        return []
    gamma, last = spec.num_speculative_tokens, len(history) - 1
    n = max(m for m, _ in found)
    ends = [e for m, e in found if m == n]
    continuation = lambda e: tuple(history[e + 1:e + 1 + min(gamma, last - e)])  # noqa: E731
    if rule == "longest-latest":
        e = max(ends, key=lambda e: (len(continuation(e)), e))
    elif rule == "latest":
        e = max(ends)
    elif rule == "earliest":
        e = min(ends)
    elif rule == "frequent":
        votes = collections.Counter(continuation(e) for e in ends)
        e = max(ends, key=lambda e: (votes[continuation(e)], len(continuation(e)), e))
    else:
        raise SystemExit(f"unknown rule {rule!r}")
    draft = list(continuation(e))
    factor = spec.prompt_lookup_length_factor
    return draft if factor is None else draft[:math.ceil(factor * n)]


def replay(prompt: list[int], continuation: list[int], spec, rule: str, cost) -> float:
    """Predicted speed-up over autoregressive decoding (the first token comes from the prefill in
    both, so it is not counted)."""
    p, spent = 1, 0.0
    while p < len(continuation):
        draft = propose(prompt + continuation[:p], spec, rule)
        accepted = 0
        while (accepted < len(draft) and p + accepted < len(continuation)
               and draft[accepted] == continuation[p + accepted]):
            accepted += 1
        spent += cost(len(draft) + 1)
        p += accepted + 1
    return (len(continuation) - 1) / spent


def verify_costs(target, widths, capacity: int = 512, repeats: int = 5):
    """Median time of a forward at each width over width 1 (cache filled to 200 slots),
    interleaved over repeats."""
    timers = {w: timing.forward_timer(target, w, capacity, 200) for w in widths}
    seconds = timing.median_seconds(timers, repeats)
    return {w: s / seconds[1] for w, s in seconds.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="checkpoints/code-target")
    ap.add_argument("--settings", nargs="+", default=["4,2,4", "8,2,8,1.5", "12,2,8,1.5"])
    ap.add_argument("--rules", nargs="+", default=["longest-latest"],
                    choices=["longest-latest", "latest", "earliest", "frequent"])
    ap.add_argument("--prompts", nargs="+", default=list(PROMPT_SETS), choices=list(PROMPT_SETS))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--samples", type=int, default=4,
                    help="sampled continuations per prompt at T > 0")
    ap.add_argument("--slope", type=float, help="verify cost per extra width, in decode steps")
    args = ap.parse_args()
    specs = {text: setting(text) for text in args.settings}
    target = sj.load_model(args.target, dtype="float32")
    tok = sj.load_tokenizer(args.target)
    top = max(s.num_speculative_tokens for s in specs.values()) + 1
    if args.slope is not None:
        table = {w: 1 + args.slope * (w - 1) for w in range(1, top + 1)}
    else:
        table = verify_costs(target, range(1, top + 1))
        print("verify cost by width (decode steps):",
              " ".join(f"{w}:{c:.2f}" for w, c in table.items()))
    print(f"{'prompts':15}{'setting':12}{'rule':16}{'predicted speed-up':>20}   per prompt")
    for name in args.prompts:
        prompts, temperature = PROMPT_SETS[name]
        runs = []  # (prompt index, prompt ids, continuation)
        for i, text in enumerate(prompts):
            ids = tok.encode(text)
            for key in range(1 if temperature == 0 else args.samples):
                out = sj.generate(target, [ids], key=key, sampling=sj.SamplingParams(
                    temperature=temperature, max_new_tokens=args.max_new_tokens))
                runs.append((i, list(ids), [int(t) for t in out.tokens[0] if t >= 0]))
        for text, spec in specs.items():
            for rule in args.rules:
                each = [statistics.mean(replay(ids, cont, spec, rule, table.__getitem__)
                                        for j, ids, cont in runs if j == i)
                        for i in range(len(prompts))]
                print(f"{name:15}{text:12}{rule:16}{statistics.mean(each):19.2f}x   "
                      + " ".join(f"{x:.2f}" for x in each))


if __name__ == "__main__":
    main()
