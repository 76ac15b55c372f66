"""Files are untrusted input (issue 25): every hostile or corrupt file is refused with an error
that names it, before anything large is allocated."""

import json
import os
import pathlib
import shutil
import struct

import jax
import numpy as np
import pytest

import specjax as sj
from specjax import checkpoint

CFG = sj.ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "m"
    sj.save_model(sj.init_model(CFG, jax.random.key(0)), folder, format="hf")
    return folder


def copy(folder, tmp_path) -> pathlib.Path:
    dst = tmp_path / "copy"
    shutil.copytree(folder, dst)
    return dst


def shard(folder: pathlib.Path, names: dict[str, str]) -> None:
    """Replace model.safetensors by an index whose weight map sends every tensor to the file
    names[tensor] (default: one real shard file beside it)."""
    f = checkpoint.SafetensorsFile(folder / "model.safetensors")
    tensors = {n: f.get(n) for n in f.entries}
    checkpoint.write_safetensors(folder / "model-00001-of-00001.safetensors", tensors)
    (folder / "model.safetensors").unlink()
    weight_map = {n: names.get(n, "model-00001-of-00001.safetensors") for n in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(hf_folder, tmp_path, where):
    folder = copy(hf_folder, tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(folder / "model.safetensors", outside)
    name = {"parent": "../outside.safetensors", "absolute": str(outside),
            "symlink": "link.safetensors"}[where]
    if where == "symlink":
        os.symlink(outside, folder / name)
    shard(folder, {"model.norm.weight": name})
    with pytest.raises(sj.CheckpointError, match=f"names the shard file '{name}'.*refused"):
        sj.load_model(folder)
    index = folder / "model.safetensors.index.json"  # the same folder, an honest index: loads
    weight_map = json.loads(index.read_text())["weight_map"]
    index.write_text(json.dumps({"weight_map": {n: "model-00001-of-00001.safetensors"
                                                for n in weight_map}}))
    sj.load_model(folder)


def raw_safetensors(path: pathlib.Path, header: dict, data: bytes, header_len=None) -> None:
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob) if header_len is None else header_len)
                     + blob + data)


@pytest.mark.parametrize("case", ["header_length_past_the_file", "offsets_past_the_file",
                                  "offsets_overflow", "offsets_overlap", "size_not_shape",
                                  "huge_shape", "gap_in_data", "not_json"])
def test_a_hostile_safetensors_header_is_refused_before_reading(hf_folder, tmp_path, case):
    folder = copy(hf_folder, tmp_path)
    path = folder / "model.safetensors"
    data = bytes(64)
    one = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    header = {
        "header_length_past_the_file": {"a": one},
        "offsets_past_the_file": {"a": {**one, "data_offsets": [0, 1 << 40],
                                        "shape": [1 << 38]}},
        "offsets_overflow": {"a": {**one, "data_offsets": [0, 2**64 - 8],
                                   "shape": [2**61 - 1]}},
        "offsets_overlap": {"a": one, "b": {**one, "data_offsets": [8, 24]},
                            "c": {**one, "data_offsets": [24, 64], "shape": [10]}},
        "size_not_shape": {"a": {**one, "shape": [5]}, "b": {**one, "data_offsets": [16, 64],
                                                              "shape": [12]}},
        "huge_shape": {"a": {**one, "shape": [1 << 20, 1 << 20, 1 << 20],
                             "data_offsets": [0, 64]}},
        "gap_in_data": {"a": one, "b": {**one, "data_offsets": [32, 48]}},
        "not_json": None,
    }[case]
    if case == "not_json":
        path.write_bytes(struct.pack("<Q", 16) + b"{\"a\": [1, 2,,]}" + data)
    else:
        raw_safetensors(path, header, data, header_len=1 << 50 if case.startswith("header")
                        else None)
    with pytest.raises(sj.CheckpointError, match=f"{path.name}.*(corrupt|truncated)"):
        checkpoint.SafetensorsFile(path)  # the header alone: nothing read or allocated yet
    with pytest.raises(sj.CheckpointError, match=path.name):
        sj.load_model(folder)


@pytest.mark.parametrize("change,name", [
    ({"vocab_size": 10**12}, "vocab_size=1000000000000"),
    ({"vocab_size": 0}, "vocab_size must be an int >= 1, got 0"),
    ({"hidden_size": -16}, "hidden_size must be an int >= 1, got -16"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000"),
    ({"intermediate_size": 2**22, "hidden_size": 2**20, "num_attention_heads": 2**10,
      "num_key_value_heads": 2**10, "num_hidden_layers": 2**12}, "parameters"),
    ({"max_position_embeddings": 10**15}, "max_position_embeddings"),
    ({"num_attention_heads": "8"}, "num_attention_heads"),
])
def test_config_values_that_would_allocate_absurd_memory_are_refused(hf_folder, tmp_path,
                                                                     change, name):
    folder = copy(hf_folder, tmp_path)
    d = json.loads((folder / "config.json").read_text())
    d.update(change)
    (folder / "config.json").write_text(json.dumps(d))
    with pytest.raises(sj.CheckpointError, match=f"config.json.*{name}"):
        sj.load_model(folder)


def test_a_draft_vocabulary_for_another_model_is_refused_by_name(hf_folder, tmp_path):
    folder = copy(hf_folder, tmp_path)
    vocab_file = folder / "draft_vocab.npy"
    np.save(vocab_file, np.arange(0, 128, 2))  # ids of a 128-token vocabulary: not this one
    with pytest.raises(ValueError, match=f"{vocab_file}.*126"):
        sj.load_draft_model(folder)
    np.save(vocab_file, np.array([{"not": "ids"}], dtype=object))  # a pickle: never loaded
    with pytest.raises(ValueError, match=f"cannot read the draft vocabulary {vocab_file}"):
        sj.load_draft_model(folder)
    np.save(vocab_file, np.arange(8))
    assert sj.load_draft_model(folder).vocab.size == 8


def test_a_drafter_folder_for_another_target_or_with_a_foreign_vocab_is_refused(tmp_path):
    target = sj.init_model(CFG, jax.random.key(0))
    other = sj.init_model(CFG, jax.random.key(1))
    heads = sj.init_heads(target, "medusa", jax.random.key(2), num_heads=2)
    sj.save_heads(heads, tmp_path / "h", target)
    with pytest.raises(ValueError, match="trained for another target"):
        sj.load_heads(tmp_path / "h", other)
    np.save(tmp_path / "h" / "vocab.npy", np.array([1, 2, 999]))  # an id past the vocabulary
    with pytest.raises(ValueError, match="vocab.npy.*999"):
        sj.load_heads(tmp_path / "h", target)
