"""Two commits of specjax side by side in one process: ``sj.generate`` with its defaults on the
bundled pair, greedy, every method timed interleaved with the other commit's, so a slow phase of
the machine hits both alike.

    python experiments/ab_commits.py d3de7ca                 # that commit against the work tree
    python experiments/ab_commits.py d3de7ca --methods ar,ngram --prompts 6 --repeats 7

The older package is extracted with ``git archive`` into a temporary folder and imported as
``specjax_old`` (specjax imports itself relatively, so the copy runs its own code). Prints each
method's decode time (the sum over the prompts, median of the repeats), new ÷ old, whether the
last repeat gave the same tokens, and both commits' speed-ups over their own autoregressive run.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
CKPT = ROOT / "checkpoints"


def setup(sj, num_prompts: int):
    bench = importlib.import_module(sj.__name__ + ".bench")
    tok = sj.load_tokenizer(CKPT / "code-target")
    target = sj.load_model(CKPT / "code-target")
    drafts = {"draft_model": sj.load_draft_model(CKPT / "code-draft"),
              "eagle": sj.load_heads(CKPT / "code-eagle", target),
              "medusa": sj.load_heads(CKPT / "code-medusa", target)}
    prompts = [tok.encode(p["text"]) for p in bench.load_prompts()[:num_prompts]]
    return target, drafts, prompts


def runner(sj, target, drafts, prompts, method: str, gamma: int, max_new_tokens: int):
    spec = None if method == "ar" else sj.SpecConfig(method=method,
                                                      num_speculative_tokens=gamma)
    sampling = sj.SamplingParams(temperature=0, max_new_tokens=max_new_tokens)

    def run():
        seconds, tokens = 0.0, []
        for p in prompts:
            out = sj.generate(target, [p], sampling=sampling, spec=spec,
                              draft=drafts.get(method))
            seconds += out.stats.decode_seconds
            tokens.append(out.tokens.tolist())
        return seconds, tokens
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="the older commit (anything git rev-parse takes)")
    ap.add_argument("--methods", default="ar,ngram,draft_model,eagle")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4, help="the first N bench prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    methods = args.methods.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.old, "specjax"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        (pathlib.Path(tmp) / "specjax").rename(pathlib.Path(tmp) / "specjax_old")
        sys.path.insert(0, tmp)
        import specjax_old as old

        import specjax as new
        runs = {}
        for name, sj in (("old", old), ("new", new)):
            target, drafts, prompts = setup(sj, args.prompts)
            for m in methods:
                runs[(name, m)] = runner(sj, target, drafts, prompts, m, args.gamma,
                                         args.max_new_tokens)
                runs[(name, m)]()  # compile
        times = {k: [] for k in runs}
        tokens = {}
        for _ in range(args.repeats):
            for k, run in runs.items():
                seconds, tokens[k] = run()
                times[k].append(seconds)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.prompts} bench prompts x {args.max_new_tokens} greedy tokens, gamma "
          f"{args.gamma}, median of {args.repeats} interleaved repeats; old = {args.old}")
    for m in methods:
        o, n = med[("old", m)], med[("new", m)]
        same = tokens[("old", m)] == tokens[("new", m)]
        print(f"  {m:12s} old {1e3 * o:8.1f} ms  new {1e3 * n:8.1f} ms  new/old {n / o:.3f}"
              f"  same tokens: {same}")
    if "ar" in methods:
        for name in ("old", "new"):
            ups = {m: round(med[(name, "ar")] / med[(name, m)], 2) for m in methods if m != "ar"}
            print(f"  {name} speed-ups over its own autoregressive run: {ups}")


if __name__ == "__main__":
    main()
