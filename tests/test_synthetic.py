"""Synthetic acceptance (SpecConfig.synthetic_acceptance): benchmark only and not lossless, so it
is refused unless asked for, labelled wherever it shows, and its accepted lengths follow the
given per-position α."""

import numpy as np
import pytest
from scipy import stats as scipy_stats

import specjax as sj
from specjax import bench

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 3]] * 16


def test_refused_unless_asked_for(target, draft):
    spec = sj.SpecConfig(num_speculative_tokens=3, synthetic_acceptance=0.8)
    with pytest.raises(ValueError, match=r"synthetic_acceptance=\(0.8, 0.8, 0.8\).*benchmarks"):
        sj.generate(target, [[1, 2, 3]], spec=spec, draft=draft)
    with pytest.raises(ValueError, match="allow_synthetic"):
        sj.warmup(target, spec=spec, draft=draft)
    with pytest.raises(ValueError, match="allow_synthetic"):  # before the first chunk
        next(sj.stream(target, [[1, 2, 3]], spec=spec, draft=draft))


@pytest.mark.parametrize("bad", [1.5, -0.1, (0.5, 0.5), "0.5", True, (0.5, 0.5, float("nan"))])
def test_bad_profiles_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="synthetic_acceptance must be"):
        sj.SpecConfig(num_speculative_tokens=3, synthetic_acceptance=bad)


def test_trees_are_refused():
    with pytest.raises(ValueError, match="chains, not trees"):
        sj.SpecConfig(tree=((0,), (1,)), synthetic_acceptance=0.5)


def _g_pvalue(counts, probs):
    expected = np.asarray(probs) * counts.sum()
    return scipy_stats.power_divergence(counts, expected, lambda_="log-likelihood").pvalue


def _length_counts(target, draft, method, alphas, temperature):
    out = sj.generate(target, PROMPTS, draft=draft if method == "draft_model" else None,
                      sampling=sj.SamplingParams(temperature=temperature, max_new_tokens=40),
                      spec=sj.SpecConfig(method=method, num_speculative_tokens=len(alphas),
                                         synthetic_acceptance=alphas),
                      key=3, allow_synthetic=True)
    assert out.stats.synthetic_acceptance == alphas
    row_rounds = out.stats.proposed_tokens / len(alphas)  # every row proposes γ a round
    return np.rint(out.stats.accepted_length_distribution * row_rounds)


def profile_probs(alphas):
    """P(k drafts accepted), k = 0 .. γ, when position i passes with alphas[i] until one fails."""
    alive = np.cumprod((1.0,) + tuple(alphas))
    return alive * np.append(1 - np.asarray(alphas), 1.0)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_accepted_lengths_follow_the_profile(target, draft, temperature):
    """Random tiny models accept almost nothing on their own; with α = (0.9, 0.6, 0.5) the
    counts of 0..3 accepted drafts per round follow the profile (G-test), and are far from
    another profile with the same values in a different order (the test has power)."""
    alphas = (0.9, 0.6, 0.5)
    counts = _length_counts(target, draft, "draft_model", alphas, temperature)
    assert counts.sum() > 500
    assert _g_pvalue(counts, profile_probs(alphas)) > 1e-3
    assert _g_pvalue(counts, profile_probs((0.6, 0.9, 0.5))) < 1e-6


def test_a_single_alpha_is_every_position():
    spec = sj.SpecConfig(num_speculative_tokens=4, synthetic_acceptance=0.7)
    assert spec.synthetic_acceptance == (0.7,) * 4
    assert "synthetic" in bench._label(spec)


def test_other_alphas_reuse_the_program(target, draft):
    """The α's travel with the request, not in the compiled program."""
    run = lambda a: sj.generate(  # noqa: E731
        target, [[1, 2, 3]], draft=draft, allow_synthetic=True,
        sampling=sj.SamplingParams(temperature=0, max_new_tokens=8),
        spec=sj.SpecConfig(num_speculative_tokens=3, synthetic_acceptance=a))
    run(0.8)
    out = run((0.5, 0.4, 0.3))
    assert out.stats.compile_seconds == 0 and out.stats.synthetic_acceptance == (0.5, 0.4, 0.3)


def test_the_accelerator_check_runs_tiny_on_cpu(tmp_path):
    """experiments/accelerator_check.py, prepared here for a GPU or TPU host, at its CPU size:
    every section saved as it ends, the table printed from what was saved; run from outside
    the repository with no installed specjax on its path (a device machine has none); a
    section that fails is recorded and the next runs; a section past the time budget is
    skipped and recorded so."""
    import json
    import os
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    script = root / "experiments" / "accelerator_check.py"
    out = tmp_path / "check.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}
    # the venv's interpreter without its site-packages' editable specjax: -S drops site, and
    # PYTHONPATH gives back the libraries alone (their folder holds specjax only as a link)
    site = [p for p in sys.path if p.endswith("site-packages")]
    env["PYTHONPATH"] = os.pathsep.join(site)
    argv = [sys.executable, "-S", str(script), "--size", "tiny", "--out", str(out),
            "--prompt-tokens", "16", "--new-tokens", "16", "--gammas", "2,4",
            "--alphas", "0.8,0.9", "--widths", "3", "--adaptive"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "NOT LOSSLESS" in run.stdout and "roofline" in run.stdout
    result = json.loads(out.read_text())
    assert result["errors"] == {}, result["errors"]
    assert set(result["sections"]) == {"models", "roofline", "draft_step", "batch 1", "batch 8",
                                       "adaptive"}
    assert result["device"]["backend"] == "cpu" and result["size"] == "tiny"
    assert [(r["batch"], r["gamma"], r["alpha"]) for r in result["speculative"]] == [
        (b, g, a) for b in (1, 8) for g in (2, 4) for a in (0.8, 0.9)]
    for r in result["speculative"]:
        assert r["speedup"] > 0 and r["predicted"] > 0 and r["predicted_v1"] > 0
        assert r["tokens_per_round"] == pytest.approx(15 / r["rounds"])
        assert r["round_steps"] > 0 and r["formula_round_steps"] > 0
    assert 0 < result["ar_bandwidth_fraction"]
    roof = result["roofline"]
    assert roof["fraction"] > 0 and roof["verify_cost_by_width"]["1"] == 1
    report = roof["report"]
    assert {(c["batch"], c["width"]) for c in report["cells"]} == {
        (b, w) for b in (1, 8, 32) for w in (1, 3, 5)}  # 1 and each γ + 1 always
    assert set(report["knee_width"]) == {"1", "8", "32"}
    assert set(result["draft_step_c_by_batch"]) == {"1", "8"}
    # the adaptive program beside the static chain, every draft verified (asked for)
    assert [(r["batch"], r["gamma"]) for r in result["adaptive"]] == [(1, 4)]
    assert all(r["adaptive_round_ms"] > 0 and r["static_round_ms"] > 0
               and r["adaptive_over_static"] == pytest.approx(r["adaptive_round_ms"]
                                                      / r["static_round_ms"])
               for r in result["adaptive"])
    assert "adaptive program, every draft verified, batch 1" in run.stdout
    # a budget spent before the roofline: every later section skipped, each recorded, the
    # file written; a failing section recorded while the next runs (a draft step that fails
    # leaves the speculative rows without their c)
    short = tmp_path / "short.json"
    run = subprocess.run([*argv[:6], str(short), *argv[7:-1], "--budget-seconds", "0"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(short.read_text())
    assert isinstance(result["sections"]["models"], float)  # built whatever the budget
    assert all(str(result["sections"][s]).startswith("skipped: ")
               for s in ("roofline", "draft_step", "batch 1", "batch 8"))
    failing = tmp_path / "failing.json"  # a width of 0: the roofline fails, the rest runs
    run = subprocess.run([*argv[:6], str(failing), *argv[7:-1], "--widths", "0",
                          "--alphas", "0.8", "--gammas", "2"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(failing.read_text())
    assert result["sections"]["roofline"] == "failed" and "widths must be >= 1" in result[
        "errors"]["roofline"]
    assert "section roofline FAILED" in run.stdout
    assert isinstance(result["sections"]["batch 1"], float)
    assert result["speculative"][0]["predicted"] is None  # no verify cost measured: null


@pytest.mark.parametrize("name,published", [("llama-3.2-1b", 1.236e9), ("llama-3.1-8b", 8.030e9),
                                            ("qwen3-0.6b", 0.596e9), ("qwen3-4b", 4.022e9)])
def test_field_shapes_have_their_published_sizes(name, published):
    """sj.shapes: each target shape's parameter count is its model's published one (within 1%),
    and its draft is a valid, much smaller model with the same vocabulary."""
    target = sj.shapes.target_config(name, dtype="bfloat16")
    draft = sj.shapes.draft_config(name)
    assert abs(target.num_params / published - 1) < 0.01, target.num_params
    assert draft.vocab_size == target.vocab_size and draft.num_params < target.num_params / 4
    with pytest.raises(ValueError, match="unknown model shape 'gpt-5'"):
        sj.shapes.target_config("gpt-5")


def test_bench_with_a_target_shape(capsys, tmp_path):
    """specjax bench --target-shape: random weights in a field shape, a one-layer draft and a
    fresh EAGLE head, random prompts, synthetic acceptance 0.8 by default, labelled so; the
    roofline report at two batches."""
    import json

    from specjax.cli import main
    out = tmp_path / "bench.json"
    assert main(["bench", "--target-shape", "tiny", "--method", "draft_model,eagle",
                 "--gammas", "2", "--temperatures", "0", "--num-prompts", "2",
                 "--max-prompt-tokens", "12", "--max-new-tokens", "12", "--repeats", "1",
                 "--verify-repeats", "1", "--roofline", "--roofline-batches", "1,4",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "synthetic acceptance 0.8 (NOT LOSSLESS" in printed.err
    assert "2 random prompts of 12 tokens" in printed.out and "NOT LOSSLESS" in printed.out
    result = json.loads(out.read_text())
    s = result["settings"]
    assert s["target"] == "random weights, tiny shape" and s["prompt_tokens"] == [12, 12]
    assert s["target_params"] == sj.shapes.target_config("tiny").num_params
    assert [(r["method"], r["synthetic_acceptance"]) for r in result["rows"]] == [
        ("draft_model", [0.8, 0.8]), ("eagle", [0.8, 0.8])]
    assert all("identical_to_autoregressive" not in r for r in result["rows"])
    report = result["roofline"]["report"]
    assert {c["batch"] for c in report["cells"]} == {1, 4}
    with pytest.raises(SystemExit):  # an unknown shape is refused by the parser, named
        main(["bench", "--target-shape", "gpt-5"])
    assert "gpt-5" in capsys.readouterr().err
    # model folders and prompts beside a shape were ignored without a word
    with pytest.raises(SystemExit):
        main(["bench", "--target-shape", "tiny", "--target", str(tmp_path), "--eagle",
              str(tmp_path)])
    assert ("--target-shape benches random weights in that shape; --target, --eagle would be "
            "ignored: drop them") in capsys.readouterr().err
