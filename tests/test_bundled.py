"""The pair shipped in checkpoints/: it loads, it is small, its cards are honest, and the
`specjax generate` default runs it end to end with output equal to plain decoding."""

import json
import pathlib
import re

import jax
import numpy as np
import pytest

import specjax as sj
from specjax import cli
from specjax.train import pair
from specjax.train.heads import heldout_figures

ROOT = pathlib.Path(__file__).resolve().parents[1]
CKPT = ROOT / "checkpoints"


@pytest.fixture(scope="module")
def bundled():
    target = sj.load_model(CKPT / "code-target", dtype="float32")
    draft = sj.load_draft_model(CKPT / "code-draft", dtype="float32")  # as it drafts
    return target, draft, sj.load_tokenizer(CKPT / "code-target")


def test_the_pair_loads_as_trained(bundled):
    target, draft, tok = bundled
    import dataclasses
    # the draft as exported: attending to the latest DRAFT_WINDOW positions
    windowed = dataclasses.replace(pair.DRAFT, sliding_window=pair.DRAFT_WINDOW)
    for model, want in [(target, pair.TARGET), (draft, windowed)]:
        assert dataclasses.replace(model.config, dtype="float32") == want
    assert sj.load_model(CKPT / "code-target", dtype="stored").config.dtype == "bfloat16"
    auto = sj.checkpoint.compute_dtype("auto", jax.default_backend()) or "bfloat16"
    assert sj.load_model(CKPT / "code-target").config.dtype == auto  # float32 on CPU
    assert tok.vocab_size == pair.VOCAB_SIZE and tok.eos_token_ids == (0,)
    text = "def fibonacci(n):\n    return n\n"
    assert tok.decode(tok.encode(text)) == text


def test_the_pair_is_small():
    size = sum(f.stat().st_size for f in CKPT.rglob("*") if f.is_file())
    assert size < 60 * 2 ** 20, f"checkpoints/ holds {size / 2**20:.1f} MiB"


@pytest.mark.parametrize("name", sorted(p.parent.name for p in CKPT.glob("*/config.json")))
def test_each_model_was_trained_for_the_context_it_declares(name):
    """A model that declares more positions than it was trained on (a model quietly worse past
    its trained length) records how it does out there, by position, and its card says so."""
    config = json.loads((CKPT / name / "config.json").read_text())
    info = json.loads((CKPT / name / "training.json").read_text())
    declared = config["max_position_embeddings"]
    trained = max(x["seq_len"] for x in (info["train"], info.get("soft_labels", {}).get(
        "train", {"seq_len": 0})))
    if trained >= declared:
        return
    long = info["acceptance"].get("long")
    assert long is not None, f"{name}: trained on {trained} positions, declares {declared}, " \
                             "and records no acceptance by position"
    reached = max(int(k.split("-")[1] or 10 ** 9) for k in long["by_position"])
    assert reached >= declared, (name, long)
    card = (CKPT / name / "README.md").read_text()
    assert f"trained on sequences of {trained} of its own tokens" in card
    assert pair.long_row(long).rstrip(" |\n") in card


@pytest.mark.parametrize("name", sorted(p.parent.name for p in CKPT.glob("*/drafter.json")))
def test_each_drafter_last_trained_over_its_targets_window(name):
    """A shipped head reads the target's states at every position the target declares: its
    last training (a continuation records the stage before it under continued_from) ran on
    sequences that long, as the card's command says."""
    record = json.loads((CKPT / name / "drafter.json").read_text())
    window = json.loads((CKPT / "code-target" / "config.json").read_text())[
        "max_position_embeddings"]
    last = record["training"]["train"]["seq_len"]
    assert last >= window, f"{name}: last trained on {last} positions, the target has {window}"
    assert f"--seq-len {last}" in (CKPT / name / "README.md").read_text()


@pytest.mark.parametrize("name", ["code-target", "code-draft"])
def test_model_cards_carry_the_recorded_figures(name):
    info = json.loads((CKPT / name / "training.json").read_text())
    card = (CKPT / name / "README.md").read_text()
    assert f"{info['heldout_loss']:.3f} nats/token" in card
    assert f"trained on sequences of {info['train']['seq_len']} tokens" in card
    assert ", ".join(f"{k} {v:.3f}" for k, v in info["heldout_loss_by_position"].items()
                     if k != "windows") in card
    assert f"{info['steps']} optimizer steps" in card
    greedy = info["acceptance"]["greedy"]["acceptance_rate"]
    assert f"greedy {greedy:.3f}" in card
    assert info["corpus"]["heldout_files"] == len(info["corpus"]["heldout"]) > 0


def assert_long_figures(target, draft, tok, want, method="draft_model", out=None):
    """``pair.measure_long`` gives the figures ``want`` records, within rounding."""
    got = pair.measure_long(target, draft, tok, want["gamma"], want["max_new_tokens"],
                            method=method, out=out)
    assert got["by_position"].keys() == want["by_position"].keys()
    assert abs(got["mean_accepted_length"] - want["mean_accepted_length"]) < 0.1, (got, want)
    for bin_, value in want["by_position"].items():
        assert abs(got["by_position"][bin_] - value) < 0.2, (bin_, got, want)


def test_the_cards_acceptance_by_position_reproduces(bundled):
    """The shipped pair gives the acceptance by context position its cards state (greedy, the
    long bench prompts; export measured it in float32 on this kind of CPU), within rounding."""
    target, draft, tok = bundled
    info = json.loads((CKPT / "code-target" / "training.json").read_text())
    want = info["acceptance"]["long"]
    assert_long_figures(target, draft, tok, want)
    assert pair.long_row(want) in (CKPT / "code-target" / "README.md").read_text()


def test_the_draft_with_its_own_tokenizer_is_what_its_card_says(bundled):
    """code-draft-bpe4k: its own 4,096-token tokenizer, paired with the target's by bytes, and
    the greedy acceptance its card states on the bench prompts, within rounding; the output
    stays the target's."""
    from specjax.draft.draft_model import load_paired_draft
    target, _, tok = bundled
    folder = CKPT / "code-draft-bpe4k"
    draft = load_paired_draft(folder, tok, target.config.vocab_size, dtype="float32")
    assert sj.load_tokenizer(folder).vocab_size == pair.BPE4K_VOCAB
    assert draft.spelling is not None and draft.vocab.size <= pair.DRAFT_VOCAB_SIZE
    info = json.loads((folder / "training.json").read_text())
    card = (folder / "README.md").read_text()
    greedy = info["acceptance"]["greedy"]
    assert f"greedy {greedy['acceptance_rate']:.3f}" in card and "{" not in card
    assert f"{info['heldout_nats_per_byte']:.3f} nats per byte" in card
    prompts, max_new = pair._fitted_prompts(target, draft, tok, "short", greedy["gamma"], 128)
    spec = sj.SpecConfig(method="draft_model", num_speculative_tokens=greedy["gamma"])
    greedy_params = sj.SamplingParams(temperature=0.0, max_new_tokens=max_new)
    out = sj.generate(target, prompts, draft=draft, spec=spec, key=0, sampling=greedy_params)
    assert abs(out.stats.acceptance_rate - greedy["acceptance_rate"]) < 0.01, (
        out.stats.acceptance_rate, greedy)
    plain = sj.generate(target, prompts, sampling=greedy_params)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    # and the acceptance by context position its card states, past its trained length too
    want = info["acceptance"]["long"]
    assert_long_figures(target, draft, tok, want)


@pytest.mark.parametrize("name,low,high", [("short", 60, 200), ("long", 300, 900)])
def test_the_shipped_prompt_sets_are_held_out(name, low, high):
    """`specjax bench --prompts short|long`: ten prompts each, cut from files the pair never saw,
    of the lengths the docs give."""
    from specjax import bench
    prompts = bench.load_prompts(name)
    heldout = json.loads((CKPT / "code-target" / "training.json").read_text())["corpus"]["heldout"]
    tokenizer = sj.load_tokenizer(CKPT / "code-target")
    lengths = [len(tokenizer.encode(p["text"])) for p in prompts]
    assert len(prompts) == 10 and low <= min(lengths) and max(lengths) <= high, lengths
    assert all(p["source"].removeprefix("Lib/") in heldout for p in prompts)


def test_greedy_speculation_is_exact_up_to_the_end_of_the_context(bundled):
    """A 1,000-token prompt (two long held-out prompts) and 20 new tokens: the rounds reach the
    context's last position (1,024 with γ = 4), where the bundled pair is weakest; the draft
    model's output equals autoregressive decoding."""
    from specjax import bench
    target, draft, tok = bundled
    texts = [p["text"] for p in bench.load_prompts("long")]
    ids = (tok.encode(texts[-1]) + tok.encode(texts[-2]))[-1000:]
    greedy = sj.SamplingParams(temperature=0, max_new_tokens=20)
    plain = sj.generate(target, [ids], sampling=greedy)
    out = sj.generate(target, [ids], sampling=greedy, draft=draft, spec=sj.SpecConfig())
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    assert out.stats.accepted_length_by_position[-1][:2] == (512, 1024)
    assert out.stats.accepted_tokens > 0


def test_the_draft_ships_its_draft_vocabulary(bundled):
    """The bundled draft drafts from the DRAFT_VOCAB_SIZE ids in draft_vocab.npy (the card says
    so); loading it whole is one flag away."""
    _, draft, _ = bundled
    vocab = np.load(CKPT / "code-draft" / "draft_vocab.npy")
    assert vocab.shape == (pair.DRAFT_VOCAB_SIZE,) and len(np.unique(vocab)) == len(vocab)
    np.testing.assert_array_equal(draft.vocab.ids, vocab)
    assert draft.calibration is not None  # fitted over the draft vocabulary: used with it
    with pytest.warns(UserWarning, match="fitted over its draft vocabulary"):
        whole = sj.load_draft_model(CKPT / "code-draft", full_vocab=True)
    assert whole.vocab is None and whole.calibration is None  # not over the whole one
    card = (CKPT / "code-draft" / "README.md").read_text()
    assert f"the {pair.DRAFT_VOCAB_SIZE} most frequent tokens" in card


def test_the_draft_ships_a_calibration_fitted_for_its_weights():
    """calibration.json (adaptive lengths) records the weights it was fitted for, and they are
    the shipped draft's: retraining the draft without fitting it again fails here."""
    import warnings
    record = json.loads((CKPT / "code-draft" / "calibration.json").read_text())
    assert "fitted_for" in record
    for mode in ("greedy", "sampled"):  # the fit beats the raw confidence on held-out rows
        assert record["report"][mode]["ece"] < record["report"][mode]["ece_raw"] / 2, mode
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sj.load_draft_model(CKPT / "code-draft").calibration is not None


@pytest.mark.parametrize("name", ["code-eagle", "code-medusa", "code-mtp", "code-dflash"])
def test_the_heads_ship_a_calibration_fitted_for_their_weights(bundled, name):
    """The same for the heads (fitted on real rounds, `specjax train calibrate --heads`)."""
    import warnings
    record = json.loads((CKPT / name / "calibration.json").read_text())
    assert "fitted_for" in record and record["report"]["fit"] == "rounds"
    for mode in ("greedy", "sampled"):  # the fit beats the raw confidence on held-out prompts
        assert record["report"][mode]["ece"] < record["report"][mode]["ece_raw"], mode
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "calibration" in sj.load_heads(CKPT / name, bundled[0]).params


@pytest.mark.parametrize("name", ["code-eagle", "code-medusa", "code-mtp", "code-dflash"])
def test_the_heads_cards_command_names_the_data_they_were_trained_on(name):
    """A card's Command line reads the token folder its training record names (`--data`; the
    default, ~/specjax-work, is not what every drafter was trained on)."""
    training = json.loads((CKPT / name / "drafter.json").read_text())["training"]
    command = next(line for line in (CKPT / name / "README.md").read_text().splitlines()
                   if line.startswith("Command:"))
    data = command.split(" --data ", 1)[1].split()[0]
    home = lambda path: path.replace("/root/", "~/", 1)  # noqa: E731 (the run's home as ~)
    assert home(data) == home(training["data"]), (data, training["data"])


def test_the_draft_was_distilled_from_the_target(bundled):
    """A trained draft agrees with the target far more than chance (1 in 8192 for a random one)
    on the held-out bench prompts (the export measured 0.490 over 128 tokens)."""
    target, draft, tok = bundled
    from specjax.bench import load_prompts
    prompt = [tok.encode(p["text"]) for p in load_prompts()]
    out = sj.generate(target, prompt, draft=draft, spec=sj.SpecConfig(num_speculative_tokens=4),
                      sampling=sj.SamplingParams(temperature=0, max_new_tokens=48))
    assert out.stats.acceptance_rate > 0.15
    plain = sj.generate(target, prompt, sampling=sj.SamplingParams(temperature=0,
                                                                   max_new_tokens=48))
    np.testing.assert_array_equal(out.tokens, plain.tokens)


def test_generate_command_defaults_to_the_bundled_pair(capsys):
    argv = ["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "24"]
    assert cli.main(argv + ["--compare"]) == 0
    printed = capsys.readouterr().out
    assert "output identical: True" in printed
    rate = float(re.search(r"acceptance rate ([0-9.]+)", printed).group(1))
    assert 0 < rate <= 1 and "tokens/s" in printed and "mean accepted length" in printed
    completion = printed.split("\n\n")[0]
    assert completion.startswith("def fibonacci(n):") and len(completion) > len("def fibonacci(n):")
    assert cli.main(argv + ["--method", "none"]) == 0
    printed = capsys.readouterr().out
    assert printed.split("\n\n")[0] == completion
    # the Python API with its defaults gives the same text, all of it (one dtype rule for both)
    out = sj.generate(sj.load_model(CKPT / "code-target"), ["def fibonacci(n):"],
                      tokenizer=sj.load_tokenizer(CKPT / "code-target"), return_text=True,
                      sampling=sj.SamplingParams(temperature=0, max_new_tokens=24))
    assert printed.startswith("def fibonacci(n):" + out.text[0] + "\n\n[autoregressive]")


@pytest.mark.parametrize("method", ["medusa", "eagle", "dflash", "mtp"])
def test_bundled_drafters_load_and_are_accepted(bundled, method):
    """The shipped Medusa / EAGLE heads, block drafter and MTP modules were trained for the
    shipped target: they load for it (and only for it), keep greedy output exact and are
    accepted far more than chance; their cards give the long-prompt figures drafter.json
    records (EAGLE's are measured again below)."""
    target, draft, tok = bundled
    folder = CKPT / f"code-{method}"
    drafter = sj.load_heads(folder, target)
    with pytest.raises(ValueError, match="another target"):
        sj.load_heads(folder, sj.Model(target.config, {
            **target.params, "lm_head": {"kernel": -target.params["lm_head"]["kernel"]}}))
    card = (folder / "README.md").read_text()
    assert "self-distillation" in card
    meta = json.loads((folder / "drafter.json").read_text())
    assert pair.long_figures(meta["acceptance"]["long"]) in card
    # trained on the whole window: the held-out loss over it, by position bin
    # (experiments/drafter_heldout_positions.py; the held-out files are not in the repository)
    held = meta["heldout_loss_by_position"]
    assert list(held) == ["windows", "all", "0-256", "256-512", "512-1024"]
    assert held["windows"] == 180 and heldout_figures(held) in card
    assert meta["training"]["train"]["seq_len"] == 1024
    from specjax.bench import load_prompts
    prompt = [tok.encode(p["text"]) for p in load_prompts()[:3]]
    sampling = sj.SamplingParams(temperature=0, max_new_tokens=48)
    out = sj.generate(target, prompt, draft=drafter, sampling=sampling,
                      spec=sj.SpecConfig(method=method, num_speculative_tokens=3))
    np.testing.assert_array_equal(out.tokens, sj.generate(target, prompt,
                                                          sampling=sampling).tokens)
    # chance is about 1.0; measured on these 3 prompts: EAGLE 3.6, Medusa 1.3, dflash 1.88,
    # MTP 2.86
    assert out.stats.mean_accepted_length > {"eagle": 2.5, "medusa": 1.15, "dflash": 1.6,
                                             "mtp": 2.3}[method], out.stats


def test_the_eagle_cards_acceptance_by_position_reproduces(bundled):
    """code-eagle gives the acceptance by context position its card states (the long bench
    prompts; measured in float32 on this kind of CPU, experiments/drafter_long_acceptance.py),
    within rounding, with the text autoregressive decoding gives. One drafter only: each takes
    about 35 s on CI's machine; the script measures all four again."""
    target, _, tok = bundled
    drafter = sj.load_heads(CKPT / "code-eagle", target)
    want = json.loads((CKPT / "code-eagle" / "drafter.json").read_text())["acceptance"]["long"]
    runs = []
    assert_long_figures(target, drafter, tok, want, method="eagle", out=runs)
    prompts, max_new = pair._fitted_prompts(target, drafter, tok, "long", want["gamma"],
                                            want["max_new_tokens"])
    plain = sj.generate(target, prompts,
                        sampling=sj.SamplingParams(temperature=0, max_new_tokens=max_new))
    np.testing.assert_array_equal(runs[0].tokens, plain.tokens)


def test_generate_command_runs_eagle(capsys):
    argv = ["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "24",
            "--method", "eagle", "--compare"]
    assert cli.main(argv) == 0
    assert "output identical: True" in capsys.readouterr().out
