"""The training corpus: Python source files, split into train and held-out by file.

The default corpus is the Python standard library of the running interpreter (its own
``site-packages`` excluded): present on every machine with the same Python version, so anyone can
rebuild exactly the same data. Files are split by a hash of their path relative to the root, so
the split does not depend on the order files are found in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import sys
import sysconfig
from collections.abc import Iterable, Sequence

import numpy as np

from ..files import write_atomic

MAX_FILE_BYTES = 200_000  # generated tables and vendored blobs are not the code we want


@dataclasses.dataclass(frozen=True)
class Corpus:
    root: pathlib.Path
    train: tuple[pathlib.Path, ...]
    heldout: tuple[pathlib.Path, ...]

    def manifest(self) -> dict:
        """Everything needed to rebuild the same split, with sizes to check it."""
        rel = lambda files: [f.relative_to(self.root).as_posix() for f in files]  # noqa: E731
        digest = hashlib.sha256()
        for f in self.train + self.heldout:  # names and contents: any change shows
            digest.update(f.relative_to(self.root).as_posix().encode() + b"\0")
            digest.update(f.read_bytes())
        return {"root": str(self.root), "python": sys.version.split()[0],
                "sha256": digest.hexdigest(),
                "train_files": len(self.train), "heldout_files": len(self.heldout),
                "train_bytes": sum(f.stat().st_size for f in self.train),
                "heldout_bytes": sum(f.stat().st_size for f in self.heldout),
                "heldout": rel(self.heldout), "train": rel(self.train)}


def _heldout(relative: str, percent: float) -> bool:
    digest = hashlib.sha256(relative.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 10_000 < percent * 100


def python_corpus(root: str | pathlib.Path | None = None, heldout_percent: float = 2.0,
                  exclude: Sequence[str] = ("site-packages", "dist-packages", "__pycache__")
                  ) -> Corpus:
    """All ``*.py`` files under root (default: this interpreter's standard library), minus the
    excluded directory names and files over MAX_FILE_BYTES, split by file."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"]).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} does not exist")
    train, heldout = [], []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if any(part in exclude for part in rel.parts[:-1]) or not f.is_file():
            continue
        if f.stat().st_size > MAX_FILE_BYTES or f.stat().st_size == 0:
            continue
        (heldout if _heldout(rel.as_posix(), heldout_percent) else train).append(f)
    if not train or not heldout:
        raise ValueError(f"corpus under {root} has {len(train)} training and {len(heldout)} "
                         f"held-out files; need both")
    return Corpus(root, tuple(train), tuple(heldout))


def _read(files: Iterable[pathlib.Path]) -> Iterable[str]:
    for f in files:
        yield f.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: Sequence[pathlib.Path], vocab_size: int, out: pathlib.Path,
                    eos: str = "<|endoftext|>"):
    """Train a byte-level BPE tokenizer on files and save ``tokenizer.json`` in the folder out.
    Token 0 is the end-of-text token that separates files (and ends generations)."""
    import tokenizers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[eos], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_read(files), trainer)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "tokenizer.json", "", writer=lambda tmp: tok.save(str(tmp)))
    return tok


def encode_files(tokenizer, files: Sequence[pathlib.Path], out: pathlib.Path,
                 eos_id: int = 0) -> np.ndarray:
    """Encode files into one uint16 token stream (each file followed by eos_id), saved as .npy."""
    if tokenizer.get_vocab_size() > 65536:
        raise ValueError("uint16 token streams need a vocabulary of at most 65536")
    parts = []
    texts = list(_read(files))
    for i in range(0, len(texts), 256):
        for enc in tokenizer.encode_batch(texts[i:i + 256]):
            parts.append(np.asarray(enc.ids + [eos_id], np.uint16))
    tokens = np.concatenate(parts)
    out = pathlib.Path(out)
    save_npy(out if out.suffix == ".npy" else out.with_name(out.name + ".npy"), tokens)
    return tokens


def save_npy(path: pathlib.Path, array: np.ndarray) -> None:
    """``np.save`` to ``path`` as ``write_atomic`` writes: the old file or the new, never half."""
    def save(tmp: pathlib.Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, array)
    write_atomic(path, b"", writer=save)


def sample_batch(tokens: np.ndarray, batch: int, seq_len: int, seed: int, step: int) -> np.ndarray:
    """Random windows [batch, seq_len + 1] (inputs and shifted targets), a pure function of
    (seed, step), so a resumed run sees exactly the batches it would have seen. (Starts are
    drawn below len - seq_len - 1, one short of the last window: kept so, since any change to
    the draw would change every batch of runs already under way.)"""
    if len(tokens) < seq_len + 2:
        raise ValueError(f"token stream of {len(tokens)} is shorter than seq_len + 2")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
    return np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def sample_rows(rows: np.ndarray, n: int, seed: int, step: int) -> np.ndarray:
    """``n`` of ``rows`` [count, L] (the target's own text), drawn with replacement by a pure
    function of (seed, step), as ``sample_batch`` draws windows; int32."""
    pick = np.random.default_rng([seed + 1, step]).integers(0, len(rows), n)
    return np.asarray(rows[pick], np.int32)


def write_manifest(corpus: Corpus, path: pathlib.Path, **extra) -> None:
    write_atomic(path, json.dumps({**corpus.manifest(), **extra}, indent=1) + "\n")
