"""The README's quick start runs as written, and `specjax demo` works and checks itself."""

import pathlib
import re

import numpy as np
import pytest

from specjax import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_quick_start_runs():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\s+```python\n(.*?)```", text, re.S).group(1)
    scope = {}
    exec(compile(block, "README quick start", "exec"), scope)
    out = scope["out"]
    assert out.tokens.shape == (2, 64) and (out.lengths == 64).all()
    assert (out.tokens >= 0).all() and (out.tokens < 512).all()
    assert 0 <= out.stats.acceptance_rate <= 1
    assert 1 <= out.stats.mean_accepted_length <= 5


def test_demo_greedy_matches_autoregressive(capsys):
    assert cli.main(["demo", "--max-new-tokens", "12", "--repeats", "1"]) == 0
    printed = capsys.readouterr().out
    assert "greedy output identical to autoregressive: True" in printed
    rate = float(re.search(r"acceptance rate ([0-9.]+)", printed).group(1))
    assert 0 < rate <= 1


@pytest.mark.parametrize("argv", [["demo", "--repeats", "0"], ["demo", "--draft-layers", "8"],
                                  ["demo", "--temperature", "-1"]])
def test_demo_rejects_bad_options(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_first_layers_shares_embedding_and_head():
    import jax
    from conftest import tiny_model
    model = tiny_model(layers=2)
    one = cli.first_layers(model, 1)
    assert one.config.num_hidden_layers == 1
    np.testing.assert_array_equal(one.params["lm_head"]["kernel"], model.params["lm_head"]["kernel"])
    for a, b in zip(jax.tree.leaves(one.params["layers"]), jax.tree.leaves(model.params["layers"])):
        np.testing.assert_array_equal(a, b[:1])


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    """A tiny target and draft in HF format with a tokenizer, as `specjax generate` expects."""
    import json
    import tokenizers
    import specjax as sj
    from conftest import tiny_model
    root = tmp_path_factory.mktemp("models")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x\n"] * 50, tokenizers.trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    sj.save_model(tiny_model(seed=1, vocab_size=300, max_pos=128), root / "t", format="hf",
                  eos_token_id=299)
    sj.save_model(tiny_model(seed=2, vocab_size=300, hidden_size=8, layers=1, max_pos=128),
                  root / "d", format="hf")
    tok.save(str(root / "t" / "tokenizer.json"))
    assert json.loads((root / "t" / "config.json").read_text())["eos_token_id"] == 299
    return root


def test_generate_command_matches_method_none(model_folders, capsys):
    base = ["generate", "--target", str(model_folders / "t"), "--draft", str(model_folders / "d"),
            "--prompt", "def f(x):", "--max-new-tokens", "12"]
    assert cli.main(base + ["--compare"]) == 0
    printed = capsys.readouterr().out
    assert "output identical: True" in printed and "acceptance rate" in printed
    spec_text = printed.split("\n\n")[0]
    assert cli.main(base + ["--method", "none"]) == 0
    assert capsys.readouterr().out.split("\n\n")[0] == spec_text
    assert cli.main(base + ["--speculative-config", '{"method": "ngram", '
                                                     '"num_speculative_tokens": 3}']) == 0
    assert capsys.readouterr().out.split("\n\n")[0] == spec_text


def test_generate_command_errors(model_folders, capsys, tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--target", str(tmp_path / "missing")])
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--target", str(model_folders / "t"), "--speculative-config", "{x"])
    assert "not valid JSON" in capsys.readouterr().err
