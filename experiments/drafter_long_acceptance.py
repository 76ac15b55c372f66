"""The shipped drafters' greedy acceptance on the long bench prompts (300-900 tokens), overall
and by the context position a round starts at, written into each folder's drafter.json
(``acceptance.long``) and README.md (``specjax.train.heads.record_long_acceptance``; training
with ``specjax train heads`` records it too). tests/test_bundled.py checks the shipped figures.

    .venv/bin/python experiments/drafter_long_acceptance.py        # the four shipped drafters
    .venv/bin/python experiments/drafter_long_acceptance.py checkpoints/code-eagle
"""

from __future__ import annotations

import argparse
import pathlib

import specjax as sj
from specjax.train.heads import record_long_acceptance

ROOT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints"


def drafter_arguments(doc: str) -> argparse.Namespace:
    """The drafter folders (default: the four shipped) and --target of a script on the
    shipped drafters' cards."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="*", type=pathlib.Path,
                    default=[ROOT / f"code-{m}" for m in ("eagle", "medusa", "dflash", "mtp")])
    ap.add_argument("--target", type=pathlib.Path, default=ROOT / "code-target")
    return ap.parse_args()


def main() -> None:
    args = drafter_arguments(__doc__)
    target, tokenizer = sj.load_model(args.target), sj.load_tokenizer(args.target)
    print(f"target {args.target} ({target.config.dtype})")
    for folder in args.folders:
        long = record_long_acceptance(folder, target, tokenizer)
        print(f"{folder.name}: {long}")


if __name__ == "__main__":
    main()
