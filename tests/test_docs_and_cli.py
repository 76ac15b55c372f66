"""The README's quick start runs as written, and `specjax demo` works and checks itself."""

import json
import pathlib
import re

import jax
import numpy as np
import pytest

import specjax as sj
from specjax import bench, cli, engine, theory
from specjax.bench import _varied_round
from specjax.checkpoint import compute_dtype

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
    # the formula's α (a draft passing given the ones before it passed), not the acceptance
    # rate (accepted over proposed, lower): the demo printed the theory at the wrong number
    alpha, c, predicted = re.search(
        r"theory at this acceptance \(alpha ([0-9.]+), c ~ ([0-9.]+) by layer count\): "
        r"([0-9.]+)x", printed).groups()
    assert float(alpha) >= rate
    assert abs(float(predicted) - sj.theory.speedup(float(alpha), 4, float(c))) < 0.06  # rounded
    # nothing to decode after the first token: no division by a decode speed of 0
    assert cli.main(["demo", "--max-new-tokens", "1", "--repeats", "1"]) == 0
    assert "speed-up n/a (nothing decoded after the first token)" in capsys.readouterr().out


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
    np.testing.assert_array_equal(one.params["lm_head"]["kernel"],
                                  model.params["lm_head"]["kernel"])
    assert list(one.params["layers"]) == ["0"]
    for a, b in zip(jax.tree.leaves(one.params["layers"]["0"]),
                    jax.tree.leaves(model.params["layers"]["0"])):
        np.testing.assert_array_equal(a, b)


def bpe_tokenizer(vocab_size: int):
    """A byte-level BPE of ``vocab_size`` tokens trained on a line of Python."""
    import tokenizers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x\n"] * 50, tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    """A tiny target and draft in HF format with a tokenizer, as `specjax generate` expects."""
    from conftest import tiny_model

    import specjax as sj
    root = tmp_path_factory.mktemp("models")
    tok = bpe_tokenizer(280)
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
    assert "(median of 3 interleaved passes each)" in printed
    spec_text = printed.split("\n\n")[0]
    assert spec_text.startswith("def f(x):") and len(spec_text) > len("def f(x):")
    # streamed as it is written (the default) or printed at the end: the same text
    assert cli.main(base + ["--no-stream"]) == 0
    assert capsys.readouterr().out.split("\n\n")[0] == spec_text
    modelless = base[:3] + base[5:]  # no --draft: refused where the method drafts without one
    assert cli.main(modelless + ["--method", "none"]) == 0
    assert capsys.readouterr().out.split("\n\n")[0] == spec_text
    assert cli.main(modelless + ["--speculative-config", '{"method": "ngram", '
                                                          '"num_speculative_tokens": 3}']) == 0
    assert capsys.readouterr().out.split("\n\n")[0] == spec_text
    assert cli.main(base + ["--speculative-config", '{"tree": [[0], [1], [0, 0]]}']) == 0
    assert capsys.readouterr().out.split("\n\n")[0] == spec_text
    # vLLM's form: the draft folder as the config's "model" (no --draft)
    vllm = [a for a in base if a not in ("--draft", str(model_folders / "d"))]
    assert cli.main(vllm + ["--speculative-config", json.dumps(
        {"model": str(model_folders / "d"), "num_speculative_tokens": 3})]) == 0
    out = capsys.readouterr().out
    assert out.split("\n\n")[0] == spec_text and "acceptance rate" in out
    ngram = modelless + ["--method", "ngram", "--num-speculative-tokens", "8",
                         "--prompt-lookup-min", "1"]
    figures = {}
    for extra in ([], ["--prompt-lookup-length-factor", "0.5"]):
        assert cli.main(ngram + extra) == 0
        text, figures[len(extra)] = capsys.readouterr().out.split("\n\n")[:2]
        assert text == spec_text
    # the factor reaches the lookup: a 1-token match now proposes one draft, not up to 8, so
    # fewer drafts are proposed for the same accepted ones
    acceptance = lambda line: float(line.split("acceptance rate ", 1)[1].split(",")[0])  # noqa: E731
    assert acceptance(figures[2]) > acceptance(figures[0])
    with pytest.raises(SystemExit):
        cli.main(base + ["--compare", "--repeats", "0"])
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(modelless + ["--method", "ngram", "--prompt-lookup-length-factor", "-1"])
    assert "--prompt-lookup-length-factor must be a finite number > 0 or None, got -1.0" in (
        capsys.readouterr().err)


def test_a_draft_folder_with_a_draft_vocabulary(model_folders, capsys, tmp_path):
    """generate and bench restrict a draft to the draft_vocab.npy its folder ships (unless told
    --full-draft-vocab); greedy output stays the target's; bad files are refused by name."""
    import shutil
    folder = tmp_path / "d"
    shutil.copytree(model_folders / "d", folder)
    np.save(folder / "draft_vocab.npy", np.arange(0, 300, 3))  # 100 of the 300 ids
    base = ["generate", "--target", str(model_folders / "t"), "--draft", str(folder),
            "--max-new-tokens", "12"]
    texts = []
    for argv in (base, base + ["--full-draft-vocab"], base[:3] + base[5:] + ["--method", "none"]):
        assert cli.main(argv) == 0
        texts.append(capsys.readouterr().out.split("\n\n")[0])
    assert texts[0] == texts[1] == texts[2]
    for extra, size, restricted in ([], 100, True), (["--full-draft-vocab"], 300, False):
        out = tmp_path / "bench.json"
        assert cli.main(["bench", "--target", str(model_folders / "t"), "--draft", str(folder),
                         "--gammas", "2", "--temperatures", "0", "--max-new-tokens", "8",
                         "--repeats", "1", "--verify-repeats", "2", "--num-prompts", "1",
                         "--max-prompt-tokens", "20", "--json", str(out)] + extra) == 0
        settings = json.loads(out.read_text())["settings"]
        assert settings["draft_vocab_size"] == size and restricted == (size < 300)
    capsys.readouterr()
    np.save(folder / "draft_vocab.npy", np.array([1, 1, 2]))
    with pytest.raises(SystemExit):
        cli.main(base)
    assert re.search("draft_vocab.npy: .*repeated token ids", capsys.readouterr().err)


def test_generate_command_pairs_a_draft_with_its_own_tokenizer(model_folders, capsys,
                                                                tmp_path):
    """A draft folder with a tokenizer.json of its own (a smaller BPE on the same text) drafts
    the tokens it shares with the target: the output equals plain decoding, and the command
    says how many tokens are shared and how much probability they carry."""
    from conftest import tiny_model

    import specjax as sj
    tok = bpe_tokenizer(262)
    sj.save_model(tiny_model(seed=3, vocab_size=270, hidden_size=8, layers=1, max_pos=128),
                  tmp_path / "d", format="hf")
    tok.save(str(tmp_path / "d" / "tokenizer.json"))
    assert cli.main(["generate", "--target", str(model_folders / "t"), "--draft",
                     str(tmp_path / "d"), "--prompt", "def f(x):", "--max-new-tokens", "12",
                     "--temperature", "0", "--compare", "--repeats", "1", "--no-stream"]) == 0
    printed = capsys.readouterr().out
    assert "output identical: True" in printed
    shared = re.search(r"draft tokenizer: (\d+) tokens shared with the target's; on this text "
                       r"they carry ([0-9.]+) of the target's probability and ([0-9.]+) of the "
                       r"draft's", printed)
    assert shared, printed
    assert 256 < int(shared.group(1)) <= 262  # the byte alphabet, the special token, merges
    assert 0 < float(shared.group(2)) <= 1 and 0 < float(shared.group(3)) <= 1
    # string-level drafts from the same folder: the same output
    assert cli.main(["generate", "--target", str(model_folders / "t"), "--draft",
                     str(tmp_path / "d"), "--prompt", "def f(x):", "--max-new-tokens", "12",
                     "--temperature", "0", "--compare", "--repeats", "1", "--no-stream",
                     "--draft-tokenizer-level", "string"]) == 0
    assert "output identical: True" in capsys.readouterr().out
    # the bench pairs it the same way and reports the coverage on its prompts
    assert cli.main(["bench", "--target", str(model_folders / "t"), "--draft",
                     str(tmp_path / "d"), "--gammas", "2", "--temperatures", "0",
                     "--max-new-tokens", "8", "--repeats", "1", "--verify-repeats", "1",
                     "--num-prompts", "2", "--max-prompt-tokens", "30"]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"draft with its own tokenizer: \d+ tokens shared with the target's, "
                     r"carrying [0-9.]+ of the target's and [0-9.]+ of the draft's", printed)
    assert "identical to autoregressive on every prompt: True" in printed


def test_generate_command_errors(model_folders, capsys, tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--target", str(tmp_path / "missing")])
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--target", str(model_folders / "t"), "--speculative-config", "{x"])
    assert "not valid JSON" in capsys.readouterr().err
    # vLLM's "model" key names the draft folder; it must not contradict --draft
    with pytest.raises(SystemExit):
        cli.main(["generate", "--target", str(model_folders / "t"), "--draft", str(tmp_path),
                  "--speculative-config", json.dumps({"model": str(model_folders / "d")})])
    assert "give one" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--target", str(model_folders / "t"),
                  "--speculative-config", '{"model": 3}'])
    assert "must be a draft folder path, got 3" in capsys.readouterr().err
    for argv, message in [(["--seed", str(2 ** 64)], "key seed 18446744073709551616"),
                          (["--prompt", ""], "--prompt '' encodes to no tokens"),
                          (["--stop", "\\x"], "--stop '\\\\x': a bad escape"),
                          (["--method", "ngram"], "method 'ngram' drafts without a model; drop "
                                                  "--draft"),
                          (["--method", "none", "--compare"], "give a speculative --method"),
                          # a setting's error in the words of its flag (it named the Python
                          # field: "SamplingParams.top_p must be ...")
                          (["--top-p", "1.5"], "error: --top-p must be in [1.2e-38, 1]"),
                          (["--method", "ngram", "--prompt-lookup-min", "0"],
                           "error: --prompt-lookup-min must be an int >= 1, got 0")]:
        with pytest.raises(SystemExit):
            cli.main(["generate", "--target", str(model_folders / "t"), "--draft",
                      str(model_folders / "d")] + argv)
        assert message in capsys.readouterr().err, argv
    # the draft a method gets by default does not fit a target of one's own: said before
    # anything compiles, naming the flag to give
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--target", str(model_folders / "t"), "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "compiling" not in err
    assert "the default draft of --method draft_model (a bundled one, for the bundled target; " \
           "give --draft DIR): draft vocab_size 8192 != target vocab_size 300" in err, err
    with pytest.raises(SystemExit):  # longer than the target's context
        cli.main(["generate", "--target", str(model_folders / "t"), "--method", "ngram"])
    err = capsys.readouterr().err
    assert "compiling" not in err and "beyond the target's max_position_embeddings=128" in err


BENCH_FIELDS = {
    "label", "depth", "verify_tokens", "tree", "method", "temperature", "gamma",
    "ar_tokens_per_second", "spec_tokens_per_second", "speedup",
    "speedup_per_repeat", "ar_ttft_ms", "spec_ttft_ms", "ar_tpot_ms", "spec_tpot_ms",
    "acceptance_rate", "alpha", "accepted_length_distribution", "mean_accepted_length",
    "per_position_acceptance", "proposal_rate", "accepted_length_by_position",
    "rounds", "row_rounds", "proposed_tokens", "accepted_tokens", "c", "verify_cost",
    "predicted_speedup", "ar_round_ms",
    "predicted_speedup_with_verify_cost", "measured_over_predicted", "propose_ms", "round_ms",
    "round_over_parts", "round_verify_tokens", "draft_cost_per_draft", "target_step_ms",
    "verify_capacity"}


def test_bench_json_has_every_field(model_folders, capsys, tmp_path, monkeypatch):
    out = tmp_path / "bench.json"
    timed = []  # (tokens, capacity) of every forward the bench times
    forward_timer = bench.forward_timer
    monkeypatch.setattr(bench, "forward_timer", lambda model, T, capacity, *a, **k: (
        timed.append((T, capacity)) or forward_timer(model, T, capacity, *a, **k)))
    assert cli.main(["bench", "--target", str(model_folders / "t"), "--draft",
                     str(model_folders / "d"), "--gammas", "1,3", "--temperatures", "0,0.8",
                     "--max-new-tokens", "10", "--repeats", "2", "--verify-repeats", "2",
                     "--tree", "[[0], [1], [0, 0]]", "--num-prompts", "2",
                     "--max-prompt-tokens", "40", "--roofline", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "per-position acceptance" in printed and "of the roofline" in printed
    assert "identical to autoregressive on every prompt: True" in printed
    def no_constants(name):
        raise AssertionError(f"{name} in the JSON: not standard JSON")
    result = json.loads(out.read_text(), parse_constant=no_constants)
    assert result["settings"]["prompts"] == 2 and result["machine"]["cpu_count"] >= 1
    assert result["settings"]["dtype"] == (
        compute_dtype("auto", jax.default_backend()) or "float32")  # tiny models are float32
    roof = result["roofline"]
    model = sj.load_model(model_folders / "t")
    weights = sum(x.nbytes for x in jax.tree.leaves(model.params))
    if not model.config.tie_word_embeddings:  # a step reads one row of the input embedding
        weights -= model.params["embed_tokens"]["embedding"].nbytes
    assert roof["weight_bytes"] == weights and roof["bandwidth_bytes_per_second"] > 0
    assert roof["fraction"] == pytest.approx(
        weights / (roof["step_ms"] / 1e3) / roof["bandwidth_bytes_per_second"])
    rows = result["rows"]
    assert [(r["temperature"], r["label"]) for r in rows] == [
        (t, label) for t in (0, 0.8) for label in ("chain 1", "chain 3", "tree 3/2")]
    # each temperature's rows are counted in the step timed in its own repeats, not one pooled
    steps = {t: {r["target_step_ms"] for r in rows if r["temperature"] == t} for t in (0, 0.8)}
    assert all(len(s) == 1 for s in steps.values()) and steps[0] != steps[0.8]
    # each forward timed in the cache capacity its own program runs in: the tiny target's
    # context (128) caps the tier, so autoregressive decoding's is 128 and a chain of γ's 128 + γ
    assert result["settings"]["parts_capacity"] == engine.cache_capacity(model.config, 0, 1) == 128
    assert (1, 128) in timed and sorted(set(timed)) == sorted(timed)  # each once
    for r in rows:
        assert BENCH_FIELDS <= set(r), BENCH_FIELDS - set(r)
        assert r["verify_capacity"] == 128 + r["verify_tokens"] - 1
        assert (r["verify_tokens"], r["verify_capacity"]) in timed
        assert len(r["per_position_acceptance"]) == r["depth"]
        # prompts of 40 tokens, 10 new: every round starts in the first bin
        assert [b[:2] + b[3:] for b in r["accepted_length_by_position"]] == [
            [0, 256, r["rounds"]]]
        assert r["accepted_length_by_position"][0][2] == pytest.approx(
            r["mean_accepted_length"])
        assert len(r["speedup_per_repeat"]) == 2
        assert r["ar_tokens_per_second"] > 0 and r["spec_tokens_per_second"] > 0
        assert r["speedup"] == pytest.approx(r["spec_tokens_per_second"]
                                             / r["ar_tokens_per_second"])
        assert 0 <= r["acceptance_rate"] <= 1 and 1 <= r["mean_accepted_length"] <= r["depth"] + 1
        assert r["proposed_tokens"] == r["gamma"] * r["rounds"]  # a draft model always proposes γ
        assert r["c"] > 0 and r["verify_cost"] > 0
        assert r["propose_ms"] > 0 and r["round_ms"] > 0  # which is larger is a timing
        # the step each row's figures are in: timed in its own temperature's repeats
        step = r["target_step_ms"]
        assert step > 0 and r["c"] == pytest.approx(r["propose_ms"] / step / r["gamma"])
        assert r["measured_over_predicted"] == pytest.approx(
            r["speedup"] / r["predicted_speedup_with_verify_cost"])
        if r["tree"] is None:
            assert r["predicted_speedup"] == pytest.approx(
                theory.speedup(r["alpha"], r["gamma"], r["c"]))
            assert r["predicted_speedup_with_verify_cost"] == pytest.approx(
                theory.expected_tokens_per_round(r["alpha"], r["gamma"])
                / (r["gamma"] * r["c"] + r["verify_cost"]))
            # α counts each round's rejection: accepted / (accepted + rounds not fully accepted)
            full = r["accepted_length_distribution"][-1] * r["rounds"]
            assert r["alpha"] == pytest.approx(
                r["accepted_tokens"] / (r["accepted_tokens"] + r["rounds"] - full))
        else:  # the formula is for chains: a tree's prediction starts from its measured length
            assert r["tree"] == [[0], [1], [0, 0]] and r["depth"] == 2 and r["verify_tokens"] == 4
            assert r["predicted_speedup"] is None
            assert r["predicted_speedup_with_verify_cost"] == pytest.approx(
                r["mean_accepted_length"] / (r["gamma"] * r["c"] + r["verify_cost"]))
    assert all(r["identical_to_autoregressive"] for r in rows if r["temperature"] == 0)
    assert not any("identical_to_autoregressive" in r for r in rows if r["temperature"] > 0)
    # latency percentiles over every call (2 prompts x 2 repeats), ordered, AR and spec
    for r in rows:
        for side in ("ar", "spec"):
            for name in ("ttft_ms", "tpot_ms"):
                q = r["latency"][side][name]
                assert 0 < q["p50"] <= q["p95"] <= q["p99"], (side, name, q)
    assert "TTFT" in printed and "p50/p95/p99" in printed
    # memory: the weights as loaded, caches of the call's rows, the decode program's buffers
    draft = sj.load_model(model_folders / "d")
    for r in rows:
        m = r["memory"]["spec"]
        assert m["target_bytes"] == sum(x.nbytes for x in jax.tree.leaves(model.params))
        assert m["draft_bytes"] in (0, sum(x.nbytes for x in jax.tree.leaves(draft.params)))
        assert m["cache_bytes"] > r["memory"]["ar"]["cache_bytes"] > 0  # the draft's cache too
        # XLA's analysis of the decode program (CPU reports it): at least the verify forward's
        # float32 logits over the vocabulary for every verified position of the call's row
        assert m["program_temp_bytes"] >= r["verify_tokens"] * model.config.vocab_size * 4
    assert "memory, MiB" in printed


def test_bench_adaptive_rows(model_folders, capsys, tmp_path):
    """--survival-threshold adds adaptive chains beside the static ones (and --verify-budget the
    same with the batch's verify budget, its costs measured at each --batch-size); their c is
    per draft proposed and the static-γ prediction is not given for them; --plots writes PNGs.
    Two calls: the batch sizes with the static and adaptive rows, then the budget rows at one
    batch size (whose other rows' programs the first call compiled)."""
    out = tmp_path / "bench.json"
    common = ["bench", "--target", str(model_folders / "t"), "--draft", str(model_folders / "d"),
              "--gammas", "3", "--survival-threshold", "0.1", "--temperatures", "0",
              "--max-new-tokens", "10", "--repeats", "1", "--verify-repeats", "1",
              "--num-prompts", "2", "--max-prompt-tokens", "40"]
    assert cli.main([*common, "--batch-size", "1,2", "--plot", str(tmp_path / "png"),
                     "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["settings"]["batch_size"] for r in runs] == [1, 2]
    for run in runs:
        assert [(r["label"], r["idle_rounds"]) for r in run["rows"]] == [
            ("chain 3", None), ("chain 3 adaptive 0.1", None)]
        assert "verify_budget" not in run["settings"] or not run["settings"]["verify_budget"]
        assert all(r["batch_size"] == run["settings"]["batch_size"] for r in run["rows"])
        assert all(r["identical_to_autoregressive"] for r in run["rows"])
        scored = run["rows"][1]  # the adaptive chain: its predictions against its verdicts
        assert bool(scored["reliability"]) == (scored["proposed_tokens"] > 0)
        assert sum(n for _, _, n in scored["reliability"]) <= scored["proposed_tokens"]
        # a figure that does not apply is null (standard JSON: no NaN)
        assert run["rows"][0]["reliability"] == [] and run["rows"][0]["calibration_error"] is None
        # one TPOT per generate call: 2 prompts (one a call at batch 1), 1 repeat
        calls = 2 // run["settings"]["batch_size"]
        assert all(len(r["tpot_samples_ms"]["spec"]) == len(r["tpot_samples_ms"]["ar"]) == calls
                   and min(r["tpot_samples_ms"]["spec"]) > 0 for r in run["rows"])
        for r in run["rows"]:
            # TPOT is a row's at every batch size: at batch 2 the one call's own (1 repeat)
            if calls == 1:
                assert r["ar_tpot_ms"] == pytest.approx(r["tpot_samples_ms"]["ar"][0])
                assert r["spec_tpot_ms"] == pytest.approx(r["tpot_samples_ms"]["spec"][0])
            # rates per row-round: a row's drafts a round, never more than γ
            assert r["rounds"] <= r["row_rounds"] <= run["settings"]["batch_size"] * r["rounds"]
            assert r["mean_proposed"] == r["proposed_tokens"] / r["row_rounds"] <= 3
    for name in ("speedup_vs_gamma.png", "acceptance_per_position.png", "tpot.png",
                 "speedup_vs_batch.png", "reliability.png"):
        assert (tmp_path / "png" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    static, adaptive = runs[0]["rows"]
    assert static["survival_threshold"] is None and adaptive["survival_threshold"] == 0.1
    assert adaptive["identical_to_autoregressive"]
    step = adaptive["target_step_ms"]
    assert adaptive["c"] == pytest.approx(adaptive["propose_ms"] / step
                                          / max(adaptive["mean_proposed"], 1e-9))
    assert adaptive["predicted_speedup"] is None
    assert adaptive["predicted_speedup_with_verify_cost"] is None
    # the budget rows, their costs measured at this batch size
    assert cli.main([*common, "--batch-size", "2", "--verify-budget", "--without-rests",
                     "--json", str(out)]) == 0
    run = json.loads(out.read_text())  # one batch size: the run itself
    costs = run["settings"]["verify_budget"]["verify_costs"]
    assert len(costs) == 4 and costs[0] == 1.0
    assert [(r["label"], r["idle_rounds"]) for r in run["rows"]] == [
        ("chain 3", None), ("chain 3 adaptive 0.1", None),
        ("chain 3 adaptive 0.1 budget", 16), ("chain 3 adaptive 0.1 budget no rests", 0)]
    assert run["rows"][-1]["verify_costs"] == costs
    assert all(r["batch_size"] == 2 and r["identical_to_autoregressive"] for r in run["rows"])
    assert cli.main(["bench", "--target", str(model_folders / "t"), "--method", "ngram",
                     "--gammas", "2", "--survival-threshold", "0.5", "--temperatures", "0",
                     "--max-new-tokens", "4", "--repeats", "1", "--verify-repeats", "1",
                     "--num-prompts", "1", "--max-prompt-tokens", "40"]) == 0
    assert "no adaptive variants for ngram" in capsys.readouterr().err


def test_bench_budget_costs_of_heads_are_logged(target, monkeypatch):
    """The verify budget's costs line for heads alone (no draft model: measure_costs times no
    draft, so its budget has no decline cost) names what a round verifying none costs."""
    from specjax import adaptive

    class Logged(Exception):
        pass

    def log(message):
        if message.startswith("verify budget"):
            raise Logged(message)
    monkeypatch.setattr(adaptive, "measure_costs",
                        lambda *a, **kw: adaptive.Budget.of([2.0, 2.4, 2.6]))
    spec = sj.SpecConfig(method="eagle", num_speculative_tokens=2, survival_threshold=0.5)
    with pytest.raises(Logged, match=r"costs \[1.0, 1.2, 1.3\] steps, a draft in a round 0.000, "
                                     r"a round's fixed part 0.000, a round verifying none 1.000"):
        bench.run_bench(target, [[1, 2, 3]], [spec], drafters={"eagle": None}, budget=True,
                        log=log)


def test_plot_series():
    """What the figures draw: speed-up against γ groups a method's static chains into one
    series per temperature (adaptive, budgeted and synthetic rows left out; a tree one point at
    its depth; batch sizes told apart when there are several); TPOT samples put the
    autoregressive baseline first, once per temperature."""
    from specjax import plots

    def row(method, depth, speedup, t=0.0, batch=1, **kw):
        return dict(method=method, label=f"chain {depth}", depth=depth, speedup=speedup,
                    temperature=t, batch_size=batch, tree=None, survival_threshold=None,
                    verify_costs=None, synthetic_acceptance=None,
                    tpot_samples_ms={"ar": [2.0, 2.2], "spec": [1.0 * depth, 1.1]}, **kw)
    rows = [row("draft_model", 4, 1.5), row("draft_model", 2, 1.3), row("ngram", 2, 1.1),
            row("draft_model", 4, 1.2, t=0.8), {**row("draft_model", 4, 1.7),
                                                  "survival_threshold": 0.1},
            {**row("draft_model", 3, 1.4), "tree": [[0]], "label": "tree 5/3"}]
    assert plots.speedup_by_gamma(rows) == {
        0.0: {"draft_model": [(2, 1.3), (4, 1.5)], "ngram": [(2, 1.1)],
              "draft_model tree 5/3": [(3, 1.4)]},
        0.8: {"draft_model": [(4, 1.2)]}}
    two = plots.speedup_by_gamma([row("ngram", 2, 1.1), row("ngram", 2, 0.9, batch=8)])
    assert two == {0.0: {"ngram (batch 1)": [(2, 1.1)], "ngram (batch 8)": [(2, 0.9)]}}
    # variants of one method that differ beyond γ are series of their own (two suffix factors
    # were drawn as one zig-zag line); lookahead's label names γ + 1 as N
    variants = [{**row("suffix", g, s), "label": f"chain {g} own x{f}"}
                for g, f, s in [(4, 1, 1.5), (4, 2, 1.9), (8, 1, 1.4), (8, 2, 2.2)]]
    variants += [{**row("lookahead", g, s), "label": f"W8 N{g + 1} G4"}
                 for g, s in [(2, 1.1), (3, 1.2)]]
    assert plots.speedup_by_gamma(variants) == {0.0: {
        "suffix own x1": [(4, 1.5), (8, 1.4)], "suffix own x2": [(4, 1.9), (8, 2.2)],
        "lookahead W8 G4": [(2, 1.1), (3, 1.2)]}}
    tpot = plots.tpot_samples(rows[:3])
    assert list(tpot[0.0]) == ["autoregressive", "draft_model chain 4", "draft_model chain 2",
                               "ngram chain 2"]
    assert tpot[0.0]["draft_model chain 4"] == [4.0, 1.1]


def test_bench_suffix_with_a_corpus_per_pass(model_folders, capsys, tmp_path, monkeypatch):
    """--suffix-cache: the suffix variants draft from earlier prompts' outputs through a
    SuffixCache that each pass (the warm-up and every timed repeat) starts empty."""
    from specjax.draft import suffix
    passes = []
    fresh = suffix.SuffixCache.fresh
    monkeypatch.setattr(suffix.SuffixCache, "fresh",
                        lambda self: passes.append(len(self)) or fresh(self))
    read = []  # what each variant's timed round drafts from: the cache its warm-up filled
    round_timers = bench.round_timers
    monkeypatch.setattr(bench, "round_timers", lambda *a, draft, **k: (
        read.append(len(draft)) or round_timers(*a, draft=draft, **k)))
    out = tmp_path / "suffix.json"
    workload = ROOT / "specjax" / "data" / "repeat_prompts.json"
    assert cli.main(["bench", "--target", str(model_folders / "t"), "--method", "suffix",
                     "--gammas", "3", "--temperatures", "0", "--max-new-tokens", "8",
                     "--repeats", "2", "--verify-repeats", "1", "--prompts", str(workload),
                     "--num-prompts", "3", "--max-prompt-tokens", "40", "--suffix-cache", "256",
                     "--suffix-own-spec-factor", "1,4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]  # one chain per own-text spec factor
    assert [r["label"] for r in rows] == ["chain 3 own x1", "chain 3 own x4"]
    assert all(r["method"] == "suffix" and r["identical_to_autoregressive"] for r in rows)
    assert f"3 prompts from {workload}, batch 1" in capsys.readouterr().out  # not "held-out"
    assert result["settings"]["drafters"]["suffix"].startswith("SuffixCache(")
    assert passes == [0] * 6  # each variant's warm-up and two repeats, each from an empty copy
    assert len(read) == 2 and all(n >= 3 * 8 for n in read), read  # 3 outputs of 8 tokens


def test_bench_prediction_for_chains_of_varied_length():
    """A chain whose rounds propose fewer than γ drafts (n-gram, suffix): the bench's prediction
    weighs each length's tokens and the verify width its loop runs for it."""
    costs, a = {1: 1.0, 2: 1.2, 3: 1.3, 5: 1.5}, 0.6
    tokens, verify = _varied_round(a, [0, 0, 0, 0, 1], 1, costs)  # always γ: the static formula
    assert tokens == pytest.approx(theory.expected_tokens_per_round(a, 4)) and verify == 1.5
    tokens, verify = _varied_round(a, [0.5, 0, 0.5, 0, 0], 1, costs)
    assert tokens == pytest.approx(0.5 + 0.5 * (1 + a + a * a))
    assert verify == pytest.approx(0.5 * 1.0 + 0.5 * 1.3)
    # two rows: a round verifies at its widest row's width, nothing only when neither drafts
    assert _varied_round(a, [0.5, 0, 0.5, 0, 0], 2, costs) == pytest.approx(
        (tokens, 0.25 * 1.0 + 0.75 * 1.3))
    assert _varied_round(a, [0, 0, 0, 1, 0], 1, costs)[1] == 1.5  # 3 drafts: no width-4 loop


def test_bench_ngram_and_errors(model_folders, capsys, tmp_path, monkeypatch):
    from specjax import bench
    picked = []  # the verify width of each round the bench times (round_timers' own choice)

    def recorded(*args, **kwargs):
        timers = round_timers(*args, **kwargs)
        picked.append(timers["round"].width)
        return timers
    round_timers = bench.round_timers
    monkeypatch.setattr(bench, "round_timers", recorded)
    out = tmp_path / "ngram.json"
    assert cli.main(["bench", "--target", str(model_folders / "t"), "--method", "ngram",
                     "--gammas", "2", "--temperatures", "0", "--max-new-tokens", "32",
                     "--repeats", "1", "--verify-repeats", "1", "--num-prompts", "1",
                     "--max-prompt-tokens", "40", "--prompt-lookup-min", "1",
                     "--prompt-lookup-max", "3", "--prompt-lookup-length-factor", "1.5",
                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    row, = result["rows"]
    assert row["method"] == "ngram" and row["identical_to_autoregressive"]
    # the lookup and the round are timed (which is larger is a timing, not a test: with one
    # sample on a busy machine the lookup once took 1.2 ms against a 0.2 ms round; that the
    # propose program really runs the lookup is tests/test_heads.py's compiled-program check)
    assert row["c"] > 0 and row["propose_ms"] > 0 and row["round_ms"] > 0
    assert row["lookup"] == {"min": 1, "max": 3, "length_factor": 1.5}
    assert row["label"] == "chain 2 (1..3 x1.5)"
    # its rounds propose 0..2 drafts: the prediction follows the lengths and the widths
    lengths = row["proposed_length_distribution"]
    assert len(lengths) == 3 and sum(lengths) == pytest.approx(1) and lengths[0] < 1 > lengths[2]
    assert [w for w, _ in row["verify_cost_by_width"]] == [1, 2, 3]
    tokens, verify = _varied_round(row["alpha"], lengths, 1, dict(row["verify_cost_by_width"]))
    assert row["predicted_verify_cost"] == pytest.approx(verify)
    assert row["predicted_speedup_with_verify_cost"] == pytest.approx(
        tokens / (2 * row["c"] + verify))
    # its timed round verified at the width its loop picked there; its parts are that width's
    costs, step = dict(row["verify_cost_by_width"]), row["target_step_ms"]
    assert picked == [row["round_verify_tokens"]] and picked[0] in costs
    assert row["round_over_parts"] == pytest.approx(
        row["round_ms"] / (row["propose_ms"] + costs[row["round_verify_tokens"]] * step))
    capsys.readouterr()
    for argv, message in [(["--gammas", "0"], "gammas must be ints >= 1"),
                          (["--gammas", "x"], "comma-separated ints"),
                          (["--tree", "[[0, 0]]"], "has no parent"),
                          (["--tree", "[[0"], "--tree is not valid JSON"),
                          (["--gammas", ""], "nothing to compare: --gammas gives no γ"),
                          (["--gammas", "2,,4"], "an empty item in '2,,4'"),
                          (["--gammas", "2,2"], "a value given twice in '2,2'"),
                          (["--method", "draft_model,draft_model"], "given twice"),
                          (["--repeats", "0"], "repeats must be an int >= 1"),
                          (["--verify-repeats", "0"], "verify_repeats must be an int >= 1"),
                          (["--num-prompts", "0"], "--num-prompts must be >= 1"),
                          (["--max-prompt-tokens", "0"], "--max-prompt-tokens must be >= 1"),
                          (["--prompts", str(tmp_path / "none.json")], "cannot read bench prompts"),
                          (["--method", "ngram", "--prompt-lookup-length-factor", "0"],
                           "--prompt-lookup-length-factor must be a finite number > 0"),
                          (["--temperatures", "0,inf"], "temperature must be a finite number"),
                          (["--top-p", "1.5"], "--top-p must be in [1.2e-38, 1]"),
                          (["--method", "ngram", "--tree", "[[0]]"],
                           "--tree is not supported by method 'ngram'"),
                          (["--json", str(tmp_path / "none" / "x.json")], "does not exist"),
                          (["--json", str(tmp_path)], "is a folder: give the file"),
                          (["--plot", str(tmp_path / "a-file")], "is a file: give the folder"),
                          (["--roofline", "--roofline-batches", "0"],
                           "--roofline-batches values must be ints >= 1, got 0"),
                          (["--method", "suffix", "--suffix-cache", "0"],
                           "--suffix-cache must be a number of tokens >= 16")]:
        (tmp_path / "a-file").write_text("")
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", "--target", str(model_folders / "t"), "--draft",
                      str(model_folders / "d")] + argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err, argv
        assert "specjax bench: error:" in err  # the subcommand's own parser, its usage line


def test_train_help_and_bad_subcommands(capsys):
    assert cli.main(["train", "--help"]) == 0
    assert "specjax train heads {medusa,eagle,dflash,mtp}" in capsys.readouterr().out
    for argv, named in ((["train"], "got none"), (["train", "fit"], "got 'fit'")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2 and named in capsys.readouterr().err


def test_help_says_every_default(capsys):
    """--help states each option's default (0 and 0.0 included), once, in every command."""
    def help_of(argv):
        with pytest.raises(SystemExit) as e:
            cli.main([*argv, "--help"])
        assert e.value.code == 0
        return " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    text = help_of(["generate"])
    for option, default in (("--temperature TEMPERATURE", "0.0"), ("--top-k TOP_K", "0"),
                            ("--seed SEED", "0"), ("--max-new-tokens MAX_NEW_TOKENS", "128"),
                            ("--num-speculative-tokens GAMMA", "4")):
        assert f"{option} (default: {default})" in text, option
    assert "--compare also run plain autoregressive decoding and print the speed-up --stop" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default 2)" in text and "(default 2) (default" not in text  # said once
    assert "--repeats REPEATS timed passes per variant (median) (default: 3)" in help_of(["bench"])
    assert "--steps STEPS the schedule's length (default: 600)" in help_of(["train", "heads"])
    assert "--num-prompts NUM_PROMPTS half fit" in help_of(["train", "calibrate"])


def test_train_heads_names_missing_inputs(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "heads", "eagle", "--data", str(tmp_path), "--workdir",
                  str(tmp_path / "run")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--data {tmp_path}: no train.npy or heldout.npy there" in err
    np.save(tmp_path / "train.npy", np.zeros(10, np.int32))
    np.save(tmp_path / "heldout.npy", np.zeros(10, np.int32))
    with pytest.raises(SystemExit):
        cli.main(["train", "heads", "eagle", "--data", str(tmp_path), "--workdir",
                  str(tmp_path / "run"), "--target", str(tmp_path / "nothing")])
    assert f"--target {tmp_path / 'nothing'}:" in capsys.readouterr().err


def test_train_calibrate_names_missing_inputs(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "calibrate", "--data", str(tmp_path / "none")])
    assert e.value.code == 2
    assert f"--data {tmp_path / 'none'}: no corpus.json there" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "calibrate", "--data", str(tmp_path), "--prompts", "windows"])
    assert e.value.code == 2
    assert f"--data {tmp_path}: no heldout.npy there" in capsys.readouterr().err
    np.save(tmp_path / "heldout.npy", np.zeros(64 * 32, np.int32))
    with pytest.raises(SystemExit, match="2048 tokens, fewer than 256 prompts x 64 tokens"):
        cli.main(["train", "calibrate", "--data", str(tmp_path), "--prompts", "windows"])
    with pytest.raises(SystemExit):
        cli.main(["train", "calibrate", "--data", str(tmp_path), "--prompts", "windows",
                  "--num-prompts", "32", "--draft", str(tmp_path / "nothing")])
    assert f"{tmp_path / 'nothing'} does not exist" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")  # --out can't be made: refused before any fitting
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "calibrate", "--data", str(tmp_path), "--prompts", "windows",
                  "--num-prompts", "32", "--out", str(tmp_path / "a-file" / "cal")])
    assert e.value.code == 2 and f"--out {tmp_path / 'a-file' / 'cal'}:" in \
        capsys.readouterr().err
    for extra, message in ((["--draft", "a", "--heads", "b"], "give --draft or --heads"),
                           (["--heads", "b", "--fit", "teacher"], "--heads fits on real rounds"),
                           (["--gamma", "8"], "--gamma is the chain of --fit rounds"),
                           (["--fit", "rounds", "--gamma", "0"], "--gamma must be >= 1, got 0"),
                           (["--fit", "rounds", "--num-prompts", "3"],
                            "--num-prompts must be >= 4 for --fit rounds"),
                           (["--num-prompts", "1"], "--num-prompts must be >= 2 for --fit teacher"),
                           (["--temperature", "0"], "--temperature must be > 0"),
                           (["--temperature", "nan"], "--temperature must be > 0")):
        with pytest.raises(SystemExit) as e:
            cli.main(["train", "calibrate", "--data", str(tmp_path), *extra])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_python_dash_m_and_version():
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "specjax", "--version"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == f"specjax {sj.__version__}"


def test_bench_lookahead_counts_the_window_in_its_verify_width(model_folders, tmp_path):
    """--method lookahead with --lookahead-window/--lookahead-candidates: the row's label, its
    tree, and a verify width that includes the window's positions (1 + G(N-1) + W(N-1))."""
    out = tmp_path / "lookahead.json"
    assert cli.main(["bench", "--target", str(model_folders / "t"), "--method", "lookahead",
                     "--gammas", "2", "--lookahead-window", "3", "--lookahead-candidates", "2",
                     "--temperatures", "0", "--max-new-tokens", "8", "--repeats", "1",
                     "--verify-repeats", "1", "--num-prompts", "2", "--max-prompt-tokens", "24",
                     "--json", str(out)]) == 0
    row, = json.loads(out.read_text())["rows"]
    assert row["label"] == "W3 N3 G2" and row["identical_to_autoregressive"]
    assert row["verify_tokens"] == 1 + 2 * 2 + 3 * 2
    assert row["tree"] == [[0], [1], [0, 0], [1, 0]]
