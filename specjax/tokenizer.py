"""Text in and out: a thin wrapper over a Hugging Face ``tokenizer.json`` (the `tokenizers`
library), with BOS/EOS ids read from the model folder's config files."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import reprlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from .files import read_json_object


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    backend: Any  # tokenizers.Tokenizer
    bos_token_id: int | None
    # every id that ends a generation: generation_config.json's, else config.json's, else
    # tokenizer_config.json's eos_token
    eos_token_ids: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids, with the tokenizer's own special tokens (BOS, if it adds one)."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, *,
               unknown: str = "raise") -> str:
        """Token ids -> text; -1 padding (as in Generation.tokens) is dropped. Any other id
        outside [0, vocab_size) is refused by name, or with ``unknown="skip"`` dropped (a model
        whose embedding is padded past the tokenizer's ids can emit them; generate's text does
        this, as Hugging Face's decode does). One row: a batch's rows are decoded one by one
        (``[tok.decode(row) for row in out.tokens]``; ``out.text`` holds them with tokenizer=)."""
        if unknown not in ("raise", "skip"):
            raise ValueError(f"decode's unknown must be 'raise' or 'skip', got {unknown!r}")
        rows = _rows(ids)
        if rows > 1:
            raise ValueError(f"decode takes one row of token ids, got rows "
                             f"{reprlib.repr(ids)}: decode each row ([tok.decode(row) for row in "
                             f"tokens]), or pass tokenizer= to generate for out.text")
        array = np.asarray(ids).reshape(-1)  # one id (0 axes): a row of one
        if array.size and array.dtype.kind not in "iu":  # floats were cut to ints
            raise ValueError(f"decode takes integer token ids, got {reprlib.repr(ids)}")
        ids = array.tolist()
        bad = [i for i in ids if i < -1 or i >= self.vocab_size]
        if bad and unknown == "skip":
            ids = [i for i in ids if 0 <= i < self.vocab_size]
        elif bad:
            raise ValueError(f"decode got token id {bad[0]}, outside [0, {self.vocab_size}) "
                             f"(-1 is padding and dropped)")
        return self.backend.decode([i for i in ids if i >= 0],
                                   skip_special_tokens=skip_special_tokens)


def _rows(ids) -> int:
    """How many axes ``ids`` has (0 or 1 for a row; 2 for a batch; a ragged list of rows counts
    as 2)."""
    try:
        return np.ndim(ids)
    except ValueError:  # numpy refuses ragged nesting
        return 2


def save_tokenizer(tokenizer: Tokenizer, path: str | os.PathLike,
                   model_max_length: int | None = None) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` naming its BOS/EOS tokens into a
    model folder, so ``transformers.AutoTokenizer`` and ``sj.load_tokenizer`` both read it. Each
    file is replaced atomically (a temporary sibling renamed over it). tokenizer_config.json
    names one EOS token; with several EOS ids they go into the folder's
    ``generation_config.json`` too (its other keys kept), where ``load_tokenizer`` reads them."""
    from .files import write_atomic
    folder = pathlib.Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "tokenizer.json", b"",
                 writer=lambda tmp: tokenizer.backend.save(str(tmp)))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if tokenizer.bos_token_id is not None:
        config["bos_token"] = tokenizer.backend.id_to_token(tokenizer.bos_token_id)
    if tokenizer.eos_token_ids:
        config["eos_token"] = tokenizer.backend.id_to_token(tokenizer.eos_token_ids[0])
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    write_atomic(folder / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    if len(tokenizer.eos_token_ids) > 1:
        path = folder / "generation_config.json"
        generation = read_json_object(path) if path.is_file() else {}
        generation["eos_token_id"] = [int(i) for i in tokenizer.eos_token_ids]
        write_atomic(path, json.dumps(generation, indent=2) + "\n")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load ``tokenizer.json`` from a model folder (or the file itself). BOS/EOS ids come from
    ``generation_config.json``, then ``config.json``, then ``tokenizer_config.json`` tokens."""
    try:
        import tokenizers
    except ImportError:
        raise ImportError("load_tokenizer needs the `tokenizers` package: "
                          "pip install tokenizers") from None
    path = pathlib.Path(path)
    file = path if path.is_file() else path / "tokenizer.json"
    if not file.exists():
        raise FileNotFoundError(f"no tokenizer.json at {file}")
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the library raises its own exception types
        raise ValueError(f"{file} is not a valid tokenizer.json ({e})") from None
    folder = file.parent
    bos, eos = None, ()
    for name in ("tokenizer_config.json", "config.json", "generation_config.json"):
        f = folder / name
        if not f.exists():
            continue
        d = read_json_object(f)
        if name == "tokenizer_config.json":  # token strings, not ids
            for key in ("bos_token", "eos_token"):
                tok = d.get(key)
                tok = tok.get("content") if isinstance(tok, dict) else tok
                tid = backend.token_to_id(tok) if tok else None
                if tid is not None and key == "bos_token":
                    bos = tid
                elif tid is not None:
                    eos = (tid,)
            continue
        if d.get("bos_token_id") is not None:
            bos = int(d["bos_token_id"])
        if d.get("eos_token_id") is not None:
            eos = _ids(d["eos_token_id"])
    return Tokenizer(backend, bos, eos)
