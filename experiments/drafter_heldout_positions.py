"""The shipped drafters' held-out loss by context position: each drafter's training objective on
the bundled target's held-out files (the CPython standard library files its training.json
lists, encoded with its tokenizer, as `specjax train pair data` encodes them), in windows of
1,024 tokens, by the position of the last token a draft reads; written into each folder's
drafter.json (``heldout_loss_by_position``) and README.md
(``specjax.train.heads.record_heldout_by_position``; `specjax train heads --out` records it
too). tests/test_bundled.py checks that each card says what its drafter.json holds.

    .venv/bin/python experiments/drafter_heldout_positions.py      # the four shipped drafters
    .venv/bin/python experiments/drafter_heldout_positions.py checkpoints/code-eagle

It needs the Python whose standard library the target was trained on (3.11.7; the files must
match the manifest's hash), and refuses another.
"""

from __future__ import annotations

import json
import pathlib
import tempfile

from drafter_long_acceptance import drafter_arguments

import specjax as sj
from specjax.train.data import encode_files, python_corpus
from specjax.train.heads import record_heldout_by_position


def heldout_stream(target_folder: pathlib.Path):
    """The target's held-out token stream, rebuilt from this interpreter's standard library;
    SystemExit unless the files and the token count are the ones its training.json records."""
    recorded = json.loads((target_folder / "training.json").read_text())
    corpus = python_corpus()
    manifest = corpus.manifest()
    if manifest["sha256"] != recorded["corpus"]["sha256"]:
        raise SystemExit(f"the standard library under {corpus.root} (Python "
                         f"{manifest['python']}) is not the corpus {target_folder} was trained "
                         f"on (Python {recorded['corpus']['python']}): its hash differs")
    tokenizer = sj.load_tokenizer(target_folder).backend
    with tempfile.TemporaryDirectory() as tmp:
        tokens = encode_files(tokenizer, corpus.heldout, pathlib.Path(tmp) / "heldout.npy")
    expected = recorded["corpus"]["heldout_tokens"]
    if tokens.size != expected:
        raise SystemExit(f"{tokens.size} held-out tokens, not the {expected} training.json "
                         f"records: another tokenizer?")
    return tokens


def main() -> None:
    args = drafter_arguments(__doc__)
    heldout = heldout_stream(args.target)
    target = sj.load_model(args.target)
    print(f"target {args.target} ({target.config.dtype}), {heldout.size} held-out tokens")
    for folder in args.folders:
        print(f"{folder.name}: {record_heldout_by_position(folder, target, heldout)}", flush=True)


if __name__ == "__main__":
    main()
