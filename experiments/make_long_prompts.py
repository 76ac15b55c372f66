"""Build specjax/data/long_prompts.json: prompts of 300-900 tokens cut from the held-out files of
the bundled pair's training corpus (issue 24, item 3), beside the short set of bench_prompts.json.

Each prompt is a held-out file's text from its start through a function definition line (as the
short set's prompts end), the first such line where the bundled tokenizer's count reaches the
prompt's length goal (goals spread evenly from 300 to 850 tokens, none over 900). Files are
taken in the order of the corpus record (checkpoints/code-target/training.json), skipping those
with no such cut. Needs the CPython 3.11 standard library the corpus was built from.

    python experiments/make_long_prompts.py [--count 10] [--out specjax/data/long_prompts.json]
"""

import argparse
import json
import pathlib
import re

import specjax as sj

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEF = re.compile(r"^\s*(async\s+)?def\s")


def cut(text: str, tokenizer, goal: int, most: int) -> str | None:
    """The text through the first ``def`` line at which the prompt has at least ``goal`` tokens
    and at most ``most``; None when there is none."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if DEF.match(line):
            prompt = "".join(lines[:i + 1])
            n = len(tokenizer.encode(prompt))
            if n > most:
                return None
            if n >= goal:
                return prompt
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=10)
    ap.add_argument("--low", type=int, default=300)
    ap.add_argument("--high", type=int, default=900)
    ap.add_argument("--out", default=str(ROOT / "specjax" / "data" / "long_prompts.json"))
    args = ap.parse_args()
    folder = sj.bundled("code-target")
    corpus = json.loads((folder / "training.json").read_text())["corpus"]
    tokenizer = sj.load_tokenizer(folder / "tokenizer.json")
    root = pathlib.Path(corpus["root"])
    step = (args.high - 50 - args.low) / max(args.count - 1, 1)
    goals = [round(args.low + k * step) for k in range(args.count)]
    prompts = []
    for name in corpus["heldout"]:
        if len(prompts) == len(goals):
            break
        text = (root / name).read_text(encoding="utf-8")
        prompt = cut(text, tokenizer, goals[len(prompts)], args.high)
        if prompt is not None:
            prompts.append({"source": f"Lib/{name}", "tokens": len(tokenizer.encode(prompt)),
                            "text": prompt})
    if len(prompts) < len(goals):
        raise SystemExit(f"only {len(prompts)} held-out files could be cut to the goals {goals}")
    about = (f"Long held-out prompts for `specjax bench --prompts long`: {len(prompts)} prompts of "
             f"{args.low}-{args.high} tokens (the bundled tokenizer's count), each a file's text "
             "from its start through a function definition line, from CPython "
             f"{corpus['python']} standard-library files in the held-out split of the bundled "
             "pair's training corpus (never trained on); built by "
             "experiments/make_long_prompts.py. Python Software Foundation License.")
    pathlib.Path(args.out).write_text(json.dumps({"about": about, "prompts": prompts},
                                                 indent=1) + "\n")
    print(f"{args.out}: " + ", ".join(f"{p['source']} {p['tokens']}" for p in prompts))


if __name__ == "__main__":
    main()
