"""Two commits of specjax side by side in one process: ``sj.generate`` with its defaults on the
bundled pair, greedy, every method timed interleaved with the other commit's, so a slow phase of
the machine hits both alike.

    python experiments/ab_commits.py d3de7ca                 # that commit against the work tree
    python experiments/ab_commits.py d3de7ca --methods ar,ngram --prompts 6 --repeats 7
    python experiments/ab_commits.py 4ec6d03 --methods ar,draft_model,eagle --temperature 0.8 \
        --tree '[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]'
    python experiments/ab_commits.py HEAD --methods ar,draft_model,draft_model~0.2 --gamma 2 \
        --batch 16 --temperature 0.8 --max-new-tokens 96
    python experiments/ab_commits.py HEAD --with-checkpoints --methods ar,draft_model \
        --prompt-set long --prompts 10          # the models shipped at HEAD against the tree's
    python experiments/ab_commits.py HEAD --temperature 0.8 --top-p 0.9   # or --top-k 50

``bpe4k`` is the draft model ``code-draft-bpe4k`` (a tokenizer of its own, read spelled).
A method written ``name~X`` runs adaptive lengths with ``survival_threshold=X``. ``--batch B``
runs the prompts as batches of B rows (cycled to fill them) instead of one at a time.

The older package is extracted with ``git archive`` into a temporary folder and imported as
``specjax_old`` (specjax imports itself relatively, so the copy runs its own code). Prints each
method's decode time (the sum over the prompts, median of the repeats), new ÷ old, whether the
last repeat gave the same tokens, tokens accepted per round, and both commits' speed-ups over
their own autoregressive run (prompt i uses key i, in both).
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
CKPT = ROOT / "checkpoints"


def setup(sj, num_prompts: int, ckpt: pathlib.Path = CKPT, prompt_set: str = "short"):
    bench = importlib.import_module(sj.__name__ + ".bench")
    tok = sj.load_tokenizer(ckpt / "code-target")
    target = sj.load_model(ckpt / "code-target")
    drafts = {"draft_model": sj.load_draft_model(ckpt / "code-draft"),
              "eagle": sj.load_heads(ckpt / "code-eagle", target),
              "medusa": sj.load_heads(ckpt / "code-medusa", target),
              "dflash": sj.load_heads(ckpt / "code-dflash", target),
              "mtp": sj.load_heads(ckpt / "code-mtp", target)}
    if (ckpt / "code-draft-bpe4k").is_dir():  # the draft with a tokenizer of its own
        paired = importlib.import_module(sj.__name__ + ".draft.draft_model").load_paired_draft
        drafts["bpe4k"] = paired(ckpt / "code-draft-bpe4k", tok, target.config.vocab_size)
    prompts = [tok.encode(p["text"]) for p in bench.load_prompts(prompt_set)[:num_prompts]]
    return target, drafts, prompts


def runner(sj, target, drafts, prompts, method: str, gamma: int, max_new_tokens: int,
           temperature: float, tree, batch: int = 1, top_p: float = 1.0, top_k: int = 0):
    method, _, threshold = method.partition("~")
    draft = drafts.get(method)
    method = "draft_model" if method == "bpe4k" else method
    spec = None if method == "ar" else sj.SpecConfig(
        method=method, **(dict(tree=tree) if tree else dict(num_speculative_tokens=gamma)),
        **(dict(survival_threshold=float(threshold)) if threshold else {}))
    sampling = sj.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                 max_new_tokens=max_new_tokens)
    cycled = [prompts[i % len(prompts)] for i in range(-(-len(prompts) // batch) * batch)]
    groups = [cycled[i:i + batch] for i in range(0, len(cycled), batch)]

    def run():
        seconds, tokens, accepted, rounds = 0.0, [], 0, 0
        for i, group in enumerate(groups):
            out = sj.generate(target, group, sampling=sampling, spec=spec,
                              draft=draft, key=i)
            seconds += out.stats.decode_seconds
            tokens.append(out.tokens.tolist())
            accepted += out.stats.accepted_tokens
            rounds += out.stats.num_rounds
        return seconds, tokens, accepted / max(rounds, 1)
    return run


def old_package(commit: str, tmp: str, with_checkpoints: bool = False):
    """specjax as of ``commit``, extracted with ``git archive`` into ``tmp`` (with its
    checkpoints/ when asked) and imported as ``specjax_old``."""
    paths = ["specjax"] + (["checkpoints"] if with_checkpoints else [])
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, *paths],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    (pathlib.Path(tmp) / "specjax").rename(pathlib.Path(tmp) / "specjax_old")
    sys.path.insert(0, tmp)
    return importlib.import_module("specjax_old")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="the older commit (anything git rev-parse takes)")
    ap.add_argument("--methods", default="ar,ngram,draft_model,eagle")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4, help="the first N bench prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1, help="rows per generate call")
    ap.add_argument("--with-checkpoints", action="store_true",
                    help="the old commit runs its own checkpoints/ too (default: both run the "
                         "work tree's), so a retrained model is compared with the one before")
    ap.add_argument("--prompt-set", default="short", help="bench prompt set: short or long")
    ap.add_argument("--tree", type=json.loads, default=None,
                    help="a static tree for every method, e.g. '[[0],[1],[0,0]]'")
    args = ap.parse_args()
    tree = None if args.tree is None else tuple(tuple(p) for p in args.tree)
    methods = args.methods.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        old = old_package(args.old, tmp, args.with_checkpoints)

        import specjax as new
        runs = {}
        old_ckpt = pathlib.Path(tmp) / "checkpoints" if args.with_checkpoints else CKPT
        setups = {name: (sj, *setup(sj, args.prompts, ckpt, args.prompt_set))
                  for name, sj, ckpt in (("old", old, old_ckpt), ("new", new, CKPT))}
        for m in methods:  # each method's old and new runs back to back: the fairest pairing
            for name, (sj, target, drafts, prompts) in setups.items():
                runs[(name, m)] = runner(sj, target, drafts, prompts, m, args.gamma,
                                         args.max_new_tokens, args.temperature, tree,
                                         args.batch, args.top_p, args.top_k)
                runs[(name, m)]()  # compile
        times = {k: [] for k in runs}
        tokens, accepted = {}, {}
        for _ in range(args.repeats):
            for k, run in runs.items():
                seconds, tokens[k], accepted[k] = run()
                times[k].append(seconds)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.prompts} {args.prompt_set} bench prompts (batch {args.batch}) x "
          f"{args.max_new_tokens} tokens "
          f"at T = "
          f"{args.temperature}{f', top-p {args.top_p}' if args.top_p < 1 else ''}"
          f"{f', top-k {args.top_k}' if args.top_k else ''}, "
          f"{f'tree {args.tree}' if tree else f'gamma {args.gamma}'}, "
          f"median of {args.repeats} interleaved repeats; old = {args.old}"
          f"{' with its checkpoints' if args.with_checkpoints else ''}")
    for m in methods:
        o, n = med[("old", m)], med[("new", m)]
        same = tokens[("old", m)] == tokens[("new", m)]
        print(f"  {m:12s} old {1e3 * o:8.1f} ms  new {1e3 * n:8.1f} ms  new/old {n / o:.3f}"
              f"  same tokens: {same}  accepted per round old {accepted[('old', m)]:.2f} "
              f"new {accepted[('new', m)]:.2f}")
    if "ar" in methods:
        for name in ("old", "new"):
            ups = {m: round(med[(name, "ar")] / med[(name, m)], 2) for m in methods if m != "ar"}
            print(f"  {name} speed-ups over its own autoregressive run: {ups}")


if __name__ == "__main__":
    main()
