"""Text in, text out: sj.load_tokenizer over a tokenizer.json built here, and generate with it."""

import json

import numpy as np
import pytest
import tokenizers
from conftest import tiny_model

import specjax as sj

TEXT = ["def fibonacci(n):\n    if n < 2:\n        return n\n",
        "    return fibonacci(n - 1) + fibonacci(n - 2)\n", "import os\nimport sys\n"] * 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return path


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=7, vocab_size=320, max_pos=128)


def test_encode_decode_and_special_ids(folder):
    tok = sj.load_tokenizer(folder)
    assert tok.bos_token_id == 0 and tok.eos_token_ids == (1,)
    text = "def fibonacci(n):\n    return n\n"
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids) and len(ids) < len(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids + [-1, -1]) == text  # Generation padding is ignored


def test_generation_config_overrides_eos(folder, tmp_path):
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    assert sj.load_tokenizer(tmp_path).eos_token_ids == (1, 5)
    assert sj.load_tokenizer(tmp_path / "tokenizer.json").eos_token_ids == (1, 5)


def test_special_tokens_from_tokenizer_config(folder, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    tok = sj.load_tokenizer(tmp_path)
    assert tok.bos_token_id == 0 and tok.eos_token_ids == (1,)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        sj.load_tokenizer(tmp_path)


def test_generate_with_strings_returns_text(folder, model):
    tok = sj.load_tokenizer(folder)
    prompts = ["def fibonacci(n):", "import"]
    sampling = sj.SamplingParams(temperature=0, max_new_tokens=12, eos_token_id=299)
    out = sj.generate(model, prompts, sampling=sampling, tokenizer=tok, return_text=True)
    ids = sj.generate(model, [tok.encode(p) for p in prompts], sampling=sampling)
    np.testing.assert_array_equal(out.tokens, ids.tokens)
    # (this untrained model's embedding is padded past the tokenizer's ids, and emits some:
    # generate's text drops them, as Hugging Face's decode does)
    assert (out.tokens >= tok.vocab_size).any()
    assert out.text == [tok.decode(out.tokens[b, :out.lengths[b]], unknown="skip")
                        for b in range(2)]
    assert ids.text is None


def test_tokenizer_eos_is_the_default_stop(folder, model, tmp_path):
    tok = sj.load_tokenizer(folder)
    free = sj.generate(model, ["import"], tokenizer=tok, return_text=True,
                       sampling=sj.SamplingParams(temperature=0, max_new_tokens=30,
                                                  eos_token_id=[299]))
    stop = int(free.tokens[0, 4])
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": stop}))
    tok = sj.load_tokenizer(tmp_path)
    out = sj.generate(model, ["import"], tokenizer=tok,
                      sampling=sj.SamplingParams(temperature=0, max_new_tokens=30))
    first = list(free.tokens[0]).index(stop)
    assert out.lengths[0] == first + 1 and out.tokens[0, first] == stop
    # an empty eos_token_id turns it off (vLLM's ignore_eos): the row runs to max_new_tokens
    assert sj.SamplingParams(eos_token_id=[]).eos_token_id == ()
    on = sj.generate(model, ["import"], tokenizer=tok,
                     sampling=sj.SamplingParams(temperature=0, max_new_tokens=30,
                                                eos_token_id=[]))
    assert on.lengths[0] == 30 and on.tokens[0, first] == stop


def test_errors(folder, model, tmp_path):
    with pytest.raises(ValueError, match="tokenizer="):
        sj.generate(model, ["hello"])
    with pytest.raises(ValueError, match="return_text=True needs tokenizer="):
        sj.generate(model, [[1, 2]], return_text=True)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        sj.load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        sj.load_tokenizer(tmp_path)
    small = tiny_model(seed=1, vocab_size=100)
    with pytest.raises(ValueError, match="more than the target's vocab_size 100"):
        sj.generate(small, ["x"], tokenizer=sj.load_tokenizer(folder))


def test_decode_refuses_ids_outside_the_vocabulary(folder):
    tok = sj.load_tokenizer(folder)
    assert tok.decode([-1, *tok.encode("def f"), -1]) == tok.decode(tok.encode("def f"))
    for bad in (tok.vocab_size, 10 ** 6, -2):
        with pytest.raises(ValueError, match=f"decode got token id {bad}, outside"):
            tok.decode([1, bad])


def test_infinite_temperature_is_refused():
    for bad in (float("inf"), float("nan"), -0.5):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            sj.SamplingParams(temperature=bad)


def test_decode_takes_one_id_and_refuses_what_is_not_an_id(folder):
    """One id decodes as a row of one (it failed: 'int' object is not iterable); float ids
    were cut to ints and decoded; an unknown= that is not an option acted as "raise"."""
    tok = sj.load_tokenizer(folder)
    one = tok.encode("def")[0]
    assert tok.decode(one) == tok.decode([one]) == tok.decode(np.int64(one))
    assert tok.decode(np.asarray([one, -1], np.int32)) == tok.decode([one])
    assert tok.decode([]) == ""
    with pytest.raises(ValueError, match="decode takes integer token ids, got \\[1.9, 2.2\\]"):
        tok.decode([1.9, 2.2])
    with pytest.raises(ValueError, match="unknown must be 'raise' or 'skip', got 'drop'"):
        tok.decode([one], unknown="drop")


def test_save_tokenizer_keeps_every_eos_id(folder, tmp_path):
    """tokenizer_config.json names one EOS token: the others went missing on a round trip
    ((0, 3) came back as (0,)); they now go into generation_config.json, its other keys kept."""
    tok = sj.load_tokenizer(folder)
    several = sj.Tokenizer(tok.backend, 0, (1, 3))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    sj.save_tokenizer(several, tmp_path)
    assert sj.load_tokenizer(tmp_path).eos_token_ids == (1, 3)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {
        "temperature": 0.6, "eos_token_id": [1, 3]}
    sj.save_tokenizer(tok, tmp_path / "one")  # one EOS id: tokenizer_config.json holds it
    assert not (tmp_path / "one" / "generation_config.json").exists()
    assert sj.load_tokenizer(tmp_path / "one").eos_token_ids == (1,)
