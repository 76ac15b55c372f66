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
