"""Medusa heads and EAGLE: training, saving and loading, greedy equality, losslessness, caches."""

import dataclasses
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import perturbed, tiny_model
from test_adaptive import pairs_of_rows, scoring_the_drawn_token  # noqa: F401
from test_lossless import (  # noqa: F401
    PROMPT,
    exact_joint,
    g_test,
    generate_samples,
    later_samples,
    models,
    sample_rows,
    small_batch_samples,
    tail_joints,
    tail_pvalues,
)

import specjax as sj
from specjax import attention, engine, verify
from specjax.draft import eagle
from specjax.draft import heads as heads_lib
from specjax.draft.eagle import EagleProposer
from specjax.draft.medusa import MedusaProposer
from specjax.sampling import Filters, SamplingArrays
from specjax.train import TrainConfig
from specjax.train.data import sample_batch
from specjax.train.heads import HeadsObjective, train_heads
from specjax.tree import Tree

TREE = ((0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0))


def samples_of(target, rows=48, length=96, seed=1):
    """A token stream sampled from the target itself: what its heads should learn to predict."""
    rng = np.random.default_rng(seed)
    out = sj.generate(target, [[int(x)] for x in rng.integers(0, target.config.vocab_size, rows)],
                      sampling=sj.SamplingParams(temperature=0.7, max_new_tokens=length),
                      key=seed)
    return out.tokens[out.tokens >= 0].astype(np.int32)


def quick(steps=60, **kw):
    return TrainConfig(steps=steps, batch_size=8, seq_len=32, learning_rate=3e-3, warmup_steps=5,
                       checkpoint_every=20, eval_every=steps, eval_batches=2, weight_decay=0.0,
                       **kw)


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    """Medusa (3 heads) and EAGLE trained briefly on the shared test target's own samples, with a
    28-token draft vocabulary (of 32), plus the stream they were trained on."""
    tokens = samples_of(target)
    out = {"tokens": tokens}
    for method in ("medusa", "eagle"):
        out[method], out[method + "_evals"] = train_heads(
            target, method, tokens, quick(), tmp_path_factory.mktemp(method), num_heads=3,
            draft_vocab_size=28, heldout=tokens, progress=False)
    return out


# -- training -----------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_training_reduces_the_loss(target, trained, method):
    tokens = trained["tokens"]
    fresh = heads_lib.init_heads(target, method, jax.random.key(0), num_heads=3,
                                 vocab=trained[method].vocab.ids)
    objective = HeadsObjective(fresh.config, target.config)
    aux = {"target": target.params, "vocab": fresh.vocab.ids}
    batch = jnp.asarray(sample_batch(tokens, 8, 32, 12345, 0))
    before = float(objective(fresh.params["weights"], batch, aux))
    after = float(objective(trained[method].params["weights"], batch, aux))
    assert after < 0.9 * before, (before, after)
    assert trained[method + "_evals"][-1]["heldout_loss"] < before


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_training_resumes_to_the_same_weights(target, trained, method, tmp_path):
    tokens = trained["tokens"]
    cfg = quick(steps=6, seed=3)
    whole, _ = train_heads(target, method, tokens, cfg, tmp_path / "whole", num_heads=2,
                           progress=False)
    # max_seconds=0 stops after one step (checkpointing); the second call resumes from it.
    part, _ = train_heads(target, method, tokens, cfg, tmp_path / "split", num_heads=2,
                          progress=False, max_seconds=0)
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(part.params["weights"]),
                                                        jax.tree.leaves(whole.params["weights"])))
    resumed, _ = train_heads(target, method, tokens, cfg, tmp_path / "split", num_heads=2,
                             progress=False)
    for a, b in zip(jax.tree.leaves(resumed.params["weights"]),
                    jax.tree.leaves(whole.params["weights"])):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="other settings"):
        train_heads(target, method, tokens, cfg, tmp_path / "split", num_heads=2,
                    draft_vocab_size=20, progress=False)
    # other data (the stream with one token changed) under the same settings: refused too
    other = tokens.copy()
    other[len(other) // 2] = (int(other[len(other) // 2]) + 1) % target.config.vocab_size
    with pytest.raises(ValueError, match=r"other settings \(data\)"):
        train_heads(target, method, other, cfg, tmp_path / "split", num_heads=2, progress=False)


def test_training_on_the_targets_own_text_alternates_and_resumes(target, trained, tmp_path):
    """`--generated`: even steps train on stream windows (the batches a run without it sees),
    odd steps on rows of the target's own text, chosen by the step alone; the run records it,
    resumes to the same weights, and differs from a run without it. Bad rows are refused."""
    from specjax.train.heads import alternating_batches
    tokens = trained["tokens"]
    rows = np.arange(10 * 33).reshape(10, 33) % 32  # [n, seq_len + 1] rows
    cfg = quick(steps=4, seed=3)
    for step in range(4):
        batch = alternating_batches(tokens, rows, 5, cfg, step)
        if step % 2 == 0:
            np.testing.assert_array_equal(batch, sample_batch(tokens, 8, 32, 3, step))
        else:
            assert batch.shape == (5, 33) and all(any((r == g).all() for g in rows)
                                                  for r in batch)
            np.testing.assert_array_equal(batch, alternating_batches(tokens, rows, 5, cfg, step))
    assert not np.array_equal(alternating_batches(tokens, rows, 5, cfg, 1),
                              alternating_batches(tokens, rows, 5, cfg, 3))
    whole, _ = train_heads(target, "eagle", tokens, cfg, tmp_path / "whole", progress=False,
                           generated=rows, generated_rows=5)
    run = json.loads((tmp_path / "whole" / "run.json").read_text())
    assert run["generated"] == {"rows": 10, "length": 33, "per_step": 5}
    train_heads(target, "eagle", tokens, cfg, tmp_path / "split", progress=False,
                generated=rows, generated_rows=5, max_seconds=0)
    resumed, _ = train_heads(target, "eagle", tokens, cfg, tmp_path / "split", progress=False,
                             generated=rows, generated_rows=5)
    for a, b in zip(jax.tree.leaves(resumed.params["weights"]),
                    jax.tree.leaves(whole.params["weights"])):
        np.testing.assert_array_equal(a, b)
    without, _ = train_heads(target, "eagle", tokens, cfg, tmp_path / "without", progress=False)
    assert not all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(without.params["weights"]), jax.tree.leaves(whole.params["weights"])))
    for bad, match in [(rows[0], "need \\[n, L >= 3\\]"), (rows + 32, "outside the target's")]:
        with pytest.raises(ValueError, match=match):
            train_heads(target, "eagle", tokens, cfg, tmp_path / "bad", progress=False,
                        generated=bad)


def test_objective_weights_are_checked(target, trained, tmp_path):
    for ce, reg in [(-1.0, 1.0), (0.5, float("nan")), (0.0, 0.0)]:
        with pytest.raises(ValueError, match="must be finite, >= 0 and not both 0"):
            train_heads(target, "eagle", trained["tokens"], quick(steps=2), tmp_path,
                        ce_weight=ce, reg_weight=reg, progress=False)


def test_a_run_recorded_before_a_config_field_existed_still_resumes(tmp_path):
    """A run record written before specjax added a config field (here: the family fields of
    ModelConfig) resumes when the field is at its default, and not when it is set."""
    from specjax.train.loop import _check_run
    run = {"drafter": {"layer": {"hidden_size": 32, "hidden_act": "silu", "sandwich_norms": False,
                                 "layer_types": None}}, "train": {"steps": 6}}
    older = {"drafter": {"layer": {"hidden_size": 32}}, "train": {"steps": 6}}
    (tmp_path / "run.json").write_text(json.dumps(older))
    _check_run(tmp_path, run)  # the new fields at their defaults: the same run
    changed = {**run, "drafter": {"layer": {**run["drafter"]["layer"], "sandwich_norms": True}}}
    with pytest.raises(ValueError, match=r"other settings \(drafter.layer.sandwich_norms\)"):
        _check_run(tmp_path, changed)
    with pytest.raises(ValueError, match=r"other settings \(drafter.layer.hidden_size\)"):
        _check_run(tmp_path, {**run, "drafter": {"layer": {"hidden_size": 16}}})


def test_a_drafter_shape_is_initialised_by_one_program_however_often():
    """init_heads compiles one init per drafter shape (EAGLE's layer, an MTP module, the block
    drafter), not one per call (a jit built per call traced and compiled every time); keys still
    give different weights. A target of a shape no other test gives drafters."""
    from specjax.draft import dflash
    target = tiny_model(seed=5, vocab_size=24, hidden_size=24, layers=1, heads=2, kv_heads=1)
    programs = {"eagle": heads_lib._init_layer, "mtp": heads_lib._init_layer,
                "dflash": dflash._init_weights}
    for method, program in programs.items():
        before = program._cache_size()
        a, b, c = (sj.init_heads(target, method, jax.random.key(k), num_heads=2, block_size=4)
                   for k in (0, 1, 0))
        assert program._cache_size() == before + 1, method
        leaves = [jax.tree.leaves(h.params) for h in (a, b, c)]
        assert all(np.array_equal(x, z) for x, z in zip(leaves[0], leaves[2])), method
        assert not all(np.array_equal(x, y) for x, y in zip(leaves[0], leaves[1])), method


def test_draft_vocabulary_is_the_most_frequent_tokens():
    tokens = np.array([5, 5, 5, 2, 2, 7, 1, 1, 1, 1])
    np.testing.assert_array_equal(sj.draft.frequent_tokens(tokens, 10, 3), [1, 2, 5])
    # 7 and every unseen id tie at count 1 vs 0: 7 is more frequent; among unseen, smaller first
    np.testing.assert_array_equal(sj.draft.frequent_tokens(tokens, 10, 4), [1, 2, 5, 7])
    np.testing.assert_array_equal(sj.draft.frequent_tokens(tokens, 10, 5), [0, 1, 2, 5, 7])
    # a size past the vocabulary gave fewer ids, -1 all but one, ids past it were dropped
    for args, message in [((tokens, 10, 11), "size 11 is more than the vocabulary's 10"),
                          ((tokens, 10, -1), "size must be an int >= 1, got -1"),
                          ((np.array([1, 12]), 10, 2), "token ids in \\[0, 10\\), got 2 ids "
                                                       "from 1 to 12"),
                          ((np.array([1.5]), 10, 1), "token ids in \\[0, 10\\)")]:
        with pytest.raises(ValueError, match=message):
            sj.draft.frequent_tokens(*args)


# -- saving and loading -------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_save_load_round_trip_and_wrong_target(target, trained, method, tmp_path):
    d = trained[method]
    sj.save_heads(d, tmp_path / method, target)
    loaded = sj.load_heads(tmp_path / method, target)
    assert loaded.config == d.config
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(d.params)):
        np.testing.assert_array_equal(a, b)
    record = json.loads((tmp_path / method / "drafter.json").read_text())
    assert record["method"] == method and record["draft_vocab_size"] == 28
    # the same architecture with other weights (another seed) is refused, naming the weight
    other = tiny_model(seed=7, vocab_size=32, hidden_size=32, layers=2, heads=4, kv_heads=2,
                       max_pos=128)
    with pytest.raises(ValueError, match="trained for another target.*embed_tokens"):
        sj.load_heads(tmp_path / method, other)
    wider = tiny_model(seed=0, vocab_size=32, hidden_size=16, layers=2, heads=4, kv_heads=2,
                       max_pos=128)
    with pytest.raises(ValueError, match="hidden_size=32"):
        sj.load_heads(tmp_path / method, wider)
    # the same target stored in bfloat16 is still the same target
    half = sj.Model(target.config, jax.tree.map(lambda x: x.astype(jnp.bfloat16), target.params))
    sj.load_heads(tmp_path / method, half)
    with pytest.raises(FileNotFoundError, match="drafter.json"):
        sj.load_heads(tmp_path, target)
    # a corrupt or incomplete drafter.json is named in the error
    meta = tmp_path / method / "drafter.json"
    text = meta.read_text()
    meta.write_text(text[:len(text) // 2])
    with pytest.raises(ValueError, match=re.escape(str(meta)) + " is not valid JSON"):
        sj.load_heads(tmp_path / method, target)
    meta.write_text(json.dumps({k: v for k, v in record.items() if k != "method"}))
    with pytest.raises(ValueError, match=r"lacks \['method'\]"):
        sj.load_heads(tmp_path / method, target)
    # fields of the wrong type (they raised KeyError or TypeError from inside the loader)
    no_print = {k: v for k, v in record["target"].items() if k != "fingerprint"}
    for change, message in [({"target": []}, "target is \\[\\], not an object"),
                            ({"target": no_print}, "target.fingerprint is missing"),
                            ({"num_heads": "2"}, "num_heads is '2', not an int >= 0"),
                            ({"dtype": "float33"}, "dtype is 'float33', not float32"),
                            ({"taps": [1, "x"]}, "taps is \\[1, 'x'\\], not a list")]:
        meta.write_text(json.dumps({**record, **change}))
        with pytest.raises(ValueError, match=re.escape(str(meta)) + ": " + message):
            sj.load_heads(tmp_path / method, target)


def data_folder(folder, tokens):
    """A `--data` folder for `specjax train heads`: train.npy and heldout.npy (the same tokens)."""
    folder.mkdir()
    for name in ("train.npy", "heldout.npy"):
        np.save(folder / name, tokens.astype(np.uint16))
    return folder


def test_train_heads_refuses_bad_settings_before_training(target, trained, tmp_path, capsys):
    """`specjax train heads` with a setting it cannot train with: a one-line error naming the
    flag, exit 2, before any training (was: a traceback, a failure after training for
    --save-dtype, or a loss of NaN and exit 0 for a --seq-len too short for the deepest head)."""
    from specjax.train.heads import heads_main
    sj.save_model(target, tmp_path / "t")
    data = data_folder(tmp_path / "data", trained["tokens"])
    base = ["--target", str(tmp_path / "t"), "--data", str(data), "--workdir",
            str(tmp_path / "w"), "--steps", "1", "--batch-size", "2"]
    for argv, message in ((["medusa", "--steps", "0"], "--steps must be >= 1, got 0"),
                          (["medusa", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
                          (["medusa", "--num-heads", "0"], "--num-heads must be >= 1, got 0"),
                          (["medusa", "--minutes", "-1"], "--minutes must be >= 0 (0: one "
                                                          "step), got -1.0"),
                          (["medusa", "--learning-rate", "nan"], "--learning-rate must be"),
                          (["medusa", "--seq-len", "1"], "--seq-len must be >= 6 for medusa"),
                          (["mtp", "--num-heads", "3", "--seq-len", "4"],
                           "--seq-len must be >= 5 for mtp"),
                          (["dflash", "--block-size", "8", "--seq-len", "9"],
                           "--seq-len must be >= 10 for dflash"),
                          (["eagle", "--seq-len", "2"], "--seq-len must be >= 3 for eagle"),
                          (["dflash", "--taps", "1,,x"], "comma-separated layer indices"),
                          (["dflash", "--taps", "3,1"], "ascending distinct layer indices"),
                          (["dflash", "--taps", "99"], "--taps must be layers of the target"),
                          (["medusa", "--save-dtype", "bogus"], "invalid choice: 'bogus'")):
        with pytest.raises(SystemExit) as e:
            heads_main([argv[0], *base, *argv[1:]])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err, (argv, err)
        assert not (tmp_path / "w").exists(), argv  # nothing trained, not even a folder made


def test_init_continues_a_drafter_for_a_target_trained_further(target, trained, tmp_path):
    """`specjax train heads --init`: a drafter trained for an earlier version of the target (the
    same sizes, other weights) is refused for decoding, but training can start from its weights;
    the saved result is for the new target."""
    from specjax.train.heads import heads_main
    sj.save_heads(trained["eagle"], tmp_path / "old", target)
    newer = sj.Model(target.config, perturbed(target.params, 3, 0.05))
    with pytest.raises(ValueError, match="trained for another target"):
        sj.load_heads(tmp_path / "old", newer)
    start = heads_lib.load_heads(tmp_path / "old", newer, same_target=False)
    sj.save_model(newer, tmp_path / "newer")
    data = data_folder(tmp_path / "data", trained["tokens"])
    args = ["eagle", "--target", str(tmp_path / "newer"), "--data", str(data), "--steps", "1",
            "--batch-size", "2", "--seq-len", "16", "--learning-rate", "1e-9",
            "--init", str(tmp_path / "old")]
    with pytest.raises(SystemExit):  # the shape comes from --init
        heads_main(args + ["--workdir", str(tmp_path / "w0"), "--num-heads", "2"])
    with pytest.raises(SystemExit):  # another method than the folder's
        heads_main(["medusa"] + args[1:] + ["--workdir", str(tmp_path / "w1")])
    assert heads_main(args + ["--workdir", str(tmp_path / "w"), "--out",
                              str(tmp_path / "new")]) == 0
    continued = sj.load_heads(tmp_path / "new", newer)  # saved for the newer target
    assert continued.config == start.config
    np.testing.assert_array_equal(continued.vocab.ids, start.vocab.ids)
    for a, b in zip(jax.tree.leaves(continued.params["weights"]),
                    jax.tree.leaves(start.params["weights"])):  # one step at lr 1e-9
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=1e-2)
    card = (tmp_path / "new" / "README.md").read_text()
    assert "--init " + str(tmp_path / "old") in card and f"--data {data} " in card
    record = json.loads((tmp_path / "new" / "drafter.json").read_text())
    assert record["training"]["continued_from"]["folder"] == str(tmp_path / "old")


def test_a_run_over_two_sessions_keeps_both_sessions_evaluations(target, trained, tmp_path):
    """`specjax train heads` stopped by --minutes and run again: the saved drafter's training
    record (and card) hold the first session's held-out evaluation too, not only the last's."""
    from specjax.train.heads import heads_main
    sj.save_model(target, tmp_path / "t")
    data = data_folder(tmp_path / "data", trained["tokens"])
    args = ["medusa", "--target", str(tmp_path / "t"), "--data", str(data), "--steps", "4",
            "--batch-size", "2", "--seq-len", "16", "--num-heads", "2",
            "--workdir", str(tmp_path / "w")]  # an evaluation every step (steps // 4)
    assert heads_main(args + ["--minutes", "0"]) == 0  # one step, then it stops
    assert heads_main(args + ["--out", str(tmp_path / "out")]) == 0
    evals = json.loads((tmp_path / "out" / "drafter.json").read_text())["training"]["evals"]
    assert [e["step"] for e in evals] == [1, 2, 3, 4]
    assert "at step 1," in (tmp_path / "out" / "README.md").read_text()
    # --init and --out one folder (as the shipped commands are), over two sessions: the first
    # session's save rewrites --init, yet the record names what --init held when the run began
    shutil.copytree(tmp_path / "out", tmp_path / "same")
    began = json.loads((tmp_path / "same" / "drafter.json").read_text())["training"]
    again = ["medusa", "--target", str(tmp_path / "t"), "--data", str(data), "--steps", "4",
             "--batch-size", "2", "--seq-len", "16", "--workdir", str(tmp_path / "w2"),
             "--init", str(tmp_path / "same"), "--out", str(tmp_path / "same")]
    assert heads_main(again + ["--minutes", "0"]) == 0
    assert heads_main(again) == 0
    record = json.loads((tmp_path / "same" / "drafter.json").read_text())["training"]
    assert record["continued_from"]["training"] == began
    assert [e["step"] for e in record["evals"]] == [1, 2, 3, 4]


@pytest.mark.parametrize("method", ["medusa", "eagle", "mtp", "dflash"])
def test_heldout_loss_is_binned_by_the_position_each_draft_reads(method):
    """``heldout_loss_by_position`` (the cards' held-out loss by context position): the
    objective's terms score each value at the position of the last token its draft reads
    (Medusa head k at t reads x_t, EAGLE reads x_{t+1}, MTP module k x_{t+k}, a block its
    anchor's token), and each bin pools, term by term, the values scored there over the windows,
    combined by the terms' coefficients; the same objective is what training minimises."""
    from specjax.train.heads import Term, heldout_loss_by_position
    target = tiny_model(vocab_size=32, hidden_size=16, max_pos=600)
    drafter = heads_lib.init_heads(target, method, jax.random.key(1), num_heads=3, block_size=4,
                                   vocab=np.arange(0, 32, 2, dtype=np.int32))
    stream = np.random.default_rng(0).integers(0, 32, 3 * 601 + 40).astype(np.uint16)
    loss = heldout_loss_by_position(drafter, target, stream, batch_size=2)
    assert list(loss) == ["windows", "all", "0-256", "256-512", "512-600"]
    assert loss["windows"] == 3
    with pytest.raises(ValueError, match="windows=0 must be a positive int"):
        heldout_loss_by_position(drafter, target, stream, windows=0)
    objective = HeadsObjective(drafter.config, target.config)
    aux = {"target": target.params, "vocab": drafter.vocab.ids}
    windows = stream[:3 * 601].reshape(3, 601).astype(np.int32)
    batches = [jax.jit(objective.terms)(drafter.params["weights"], jnp.asarray(windows[i:i + 2]),
                                        aux) for i in (0, 2)]  # as it batches them
    terms = [Term(float(parts[0].coef), *(np.concatenate([np.asarray(x[i]) for x in parts])
                                          for i in (1, 2, 3))) for parts in zip(*batches)]
    T = 600
    if method == "dflash":  # one term: a block per anchor, all its values at the anchor
        (term,) = terms
        assert (term.positions == term.positions[:, :1]).all()
        assert 1 <= term.positions.min() and term.positions.max() <= T - 4
    else:
        first = {"medusa": [0, 0, 0], "eagle": [1, 1], "mtp": [1, 2, 3]}[method]
        assert [int(t.positions[0, 0]) for t in terms] == first
        last = {"medusa": [T - 2, T - 3, T - 4], "eagle": [T - 1] * 2, "mtp": [T - 1] * 3}[method]
        for t, end in zip(terms, last):  # one value per position from first to last
            np.testing.assert_array_equal(t.positions, np.broadcast_to(
                np.arange(t.positions[0, 0], end + 1), t.values.shape))
    # the numpy reference: per bin, each term's weighted mean there, by its coefficient
    for name, lo, hi in [("all", 0, T), ("0-256", 0, 256), ("256-512", 256, 512),
                         ("512-600", 512, T)]:
        expected = sum(t.coef * np.sum((t.weights * t.values)[(lo <= t.positions)
                                                              & (t.positions < hi)])
                       / np.sum(t.weights[(lo <= t.positions) & (t.positions < hi)])
                       for t in terms)
        assert loss[name] == pytest.approx(expected, rel=1e-5), name
    whole = float(objective(drafter.params["weights"], jnp.asarray(windows[:2]), aux))
    assert whole == pytest.approx(sum(float(t.coef * jnp.sum(t.weights * t.values)
                                            / jnp.sum(t.weights)) for t in batches[0]), rel=1e-5)


def test_card_figures_are_recorded_in_the_folder(target, trained, tmp_path, monkeypatch):
    """``record_long_acceptance`` and ``record_heldout_by_position`` (what `train heads --out`
    and experiments/drafter_long_acceptance.py and drafter_heldout_positions.py run) write their
    figures into drafter.json and as one line of README.md each (the held-out figures after the
    held-out loss, the acceptance before the load line), replacing the line an earlier run
    wrote; γ is at most the drafter's deepest draft (3 Medusa heads here)."""
    from specjax.train import heads as train_heads
    from specjax.train import pair
    folder = tmp_path / "d"
    sj.save_heads(trained["medusa"], folder, target)
    (folder / "README.md").write_text("# d\n\n* Held-out loss (the objective): 1.0.\n"
                                      "* Training: x.\n* Load with `x`.\n\nEnd.\n")
    for run, which in ((1, "all 2"), (2, "the first 3 of the 4")):
        loss = train_heads.record_heldout_by_position(folder, target, trained["tokens"][:300 * run],
                                                      windows=3)
        assert loss["windows"] == min(2 * run, 3)  # windows of the context (128) + 1
        card = (folder / "README.md").read_text().splitlines()
        lines = [x for x in card if x.startswith(train_heads.HELDOUT_LINE)]
        assert len(lines) == 1 and card[card.index(lines[0]) - 1].startswith("* Held-out loss (")
        assert f"pooled over {which} held-out windows of 128 tokens" in lines[0]
        assert lines[0].endswith(f"all {loss['all']:.3f}; 0-128 {loss['0-128']:.3f}.")
        assert json.loads((folder / "drafter.json").read_text())["heldout_loss_by_position"] \
            == loss
    asked = []

    def measured(target_, drafter, tokenizer, gamma, method="draft_model", **_):
        asked.append((gamma, method))
        return {"gamma": gamma, "max_new_tokens": 16, "mean_accepted_length": 1.0 + len(asked),
                "by_position": {"256-512": 1.25, "512-1024": 1.5}}
    monkeypatch.setattr(pair, "measure_long", measured)
    for run in (1, 2):
        long = train_heads.record_long_acceptance(folder, target, tokenizer=None)
        assert long["mean_accepted_length"] == 1.0 + run
        card = (folder / "README.md").read_text().splitlines()
        lines = [x for x in card if x.startswith(train_heads.LONG_LINE)]
        assert len(lines) == 1 and card[card.index(lines[0]) + 1].startswith("* Load with")
        assert f"mean accepted length {1.0 + run:.2f}; by the position a round starts at: " \
               "256-512 1.25, 512-1024 1.50." in lines[0]
        assert json.loads((folder / "drafter.json").read_text())["acceptance"]["long"] == long
    assert asked == [(3, "medusa")] * 2 and card[-1] == "End."
    assert card.index(lines[0]) == 5 and card[3].startswith(train_heads.HELDOUT_LINE)
    sj.load_heads(folder, target)  # the folder still loads
    assert not list(folder.glob(".*"))  # no temporary file left


@pytest.mark.parametrize("method,what", [("medusa", "3 Medusa heads"),
                                         ("eagle", "An EAGLE head (one decoder layer")])
def test_model_card_describes_each_kind(trained, method, what, tmp_path):
    """The card of `train heads --out` for a drafter without a layer (Medusa) and with one."""
    import argparse

    from specjax.train.heads import model_card
    args = argparse.Namespace(
        target="t", data="d", workdir="w", steps=60, minutes=None, init=None, draft_vocab_size=28,
        intermediate_size=None, layer_width=None, ce_weight=0.5, reg_weight=1.0, num_layers=2,
        block_size=16, taps=None, out=str(tmp_path / method), save_dtype="bfloat16")
    card = model_card(tmp_path / method, trained[method], args, quick(), trained[method + "_evals"],
                      60)
    assert card.startswith(f"# {method}\n\n{what}") and "{" not in card
    assert " --data d " in card and "float32 weights as trained" in card
    # trained on the target's own text too: the card says so, and counts its tokens
    args.generated, args.generated_rows, args.generated_length = "gen", 4, 65
    card = model_card(tmp_path / method, trained[method], args, quick(), trained[method + "_evals"],
                      60)
    assert "every other step instead 4 rows of the target's own text (`gen`" in card
    assert f"{30 * 8 * 32 + 30 * 4 * 64:,} tokens" in card and "--generated gen" in card


def test_narrow_eagle_head_saves_loads_and_decodes_greedy_exactly(target, tmp_path):
    """An EAGLE head with its own MLP width (narrower than the target's) keeps that width through
    save and load and decodes exactly as autoregressive greedy; Medusa has no such width."""
    d = heads_lib.init_heads(target, "eagle", jax.random.key(3), intermediate_size=24)
    assert d.config.layer.intermediate_size == 24 != target.config.intermediate_size
    assert d.params["weights"]["layer"]["mlp"]["up_proj"]["kernel"].shape[-1] == 24
    sj.save_heads(d, tmp_path / "narrow", target)
    loaded = sj.load_heads(tmp_path / "narrow", target)
    assert loaded.config == d.config
    prompts = [[1, 2, 3, 4, 5], [7, 1]]
    sampling = sj.SamplingParams(temperature=0, max_new_tokens=12)
    want = sj.generate(target, prompts, sampling=sampling).tokens
    got = sj.generate(target, prompts, sampling=sampling, draft=loaded,
                      spec=sj.SpecConfig(method="eagle", num_speculative_tokens=3)).tokens
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="intermediate_size=8.*only an EAGLE"):
        heads_lib.init_heads(target, "medusa", jax.random.key(0), intermediate_size=8)
    with pytest.raises(ValueError, match="intermediate_size=0"):
        heads_lib.init_heads(target, "eagle", jax.random.key(0), intermediate_size=0)


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_narrow_layer_reads_and_writes_the_target_features(target, tmp_path, method):
    """An EAGLE or MTP layer narrower than the target (``layer_width``): the fc reads the
    target's features into it, a projection writes its prediction back, the width survives save
    and load, and it decodes (chain and tree) exactly as autoregressive greedy."""
    d = heads_lib.init_heads(target, method, jax.random.key(3), layer_width=16, num_heads=3,
                             init_std=0.3)
    E = target.config.hidden_size
    w = d.params["weights"] if method == "eagle" else d.params["weights"]["0"]
    assert d.config.layer.hidden_size == 16 < E and d.config.hidden_size == E
    assert w["fc"]["kernel"].shape == (2 * E, 16) and w["proj"]["kernel"].shape == (16, E)
    assert w["norm"]["weight"].shape == (E,)
    assert d.config.layer.num_attention_heads == 16 // target.config.head_dim
    sj.save_heads(d, tmp_path / "narrow", target)
    assert json.loads((tmp_path / "narrow" / "drafter.json").read_text())["layer_width"] == 16
    loaded = sj.load_heads(tmp_path / "narrow", target)
    assert loaded.config == d.config
    prompts = [[1, 2, 3, 4, 5], [7, 1]]
    sampling = sj.SamplingParams(temperature=0, max_new_tokens=12)
    want = sj.generate(target, prompts, sampling=sampling).tokens
    for spec in [dict(num_speculative_tokens=3)] + [dict(tree=TREE)] * (method == "eagle"):
        got = sj.generate(target, prompts, sampling=sampling, draft=loaded,
                          spec=sj.SpecConfig(method=method, **spec)).tokens
        np.testing.assert_array_equal(got, want)
    # a full-width head has no projection
    assert "proj" not in heads_lib.init_heads(target, "eagle", jax.random.key(0)).params["weights"]
    for bad in (1, 2.5, True):
        with pytest.raises(ValueError, match=f"layer_width={bad!r}"):
            heads_lib.init_heads(target, method, jax.random.key(0), layer_width=bad)
    with pytest.raises(ValueError, match="layer_width=16: only an EAGLE or MTP"):
        heads_lib.init_heads(target, "medusa", jax.random.key(0), layer_width=16)


def test_generate_refuses_bad_drafters(target, draft, trained):
    prompts = [[1, 2, 3]]
    with pytest.raises(ValueError, match="needs draft= an sj.Heads"):
        sj.generate(target, prompts, spec=dict(method="medusa"), draft=draft)
    with pytest.raises(ValueError, match="the heads are 'eagle' heads"):
        sj.generate(target, prompts, spec=dict(method="medusa"), draft=trained["eagle"])
    with pytest.raises(ValueError, match="3 heads.*num_speculative_tokens=4"):
        sj.generate(target, prompts, spec=dict(method="medusa", num_speculative_tokens=4),
                    draft=trained["medusa"])
    with pytest.raises(ValueError, match="3 heads.*depth 4"):
        sj.generate(target, prompts, spec=dict(method="medusa", tree=[[0], [0, 0], [0, 0, 0],
                                                                      [0, 0, 0, 0]]),
                    draft=trained["medusa"])
    with pytest.raises(ValueError, match="draft must be an sj.Model"):
        sj.generate(target, prompts, spec=dict(method="draft_model"), draft=trained["eagle"])
    with pytest.raises(ValueError, match="num_heads"):
        heads_lib.init_heads(target, "medusa", jax.random.key(0), num_heads=0)
    with pytest.raises(ValueError, match="vocab"):
        heads_lib.init_heads(target, "eagle", jax.random.key(0), vocab=[0, 32])


# -- greedy equality ----------------------------------------------------------------------------

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
GREEDY = [("medusa", dict(num_speculative_tokens=3)), ("medusa", dict(tree=TREE)),
          ("eagle", dict(num_speculative_tokens=1)), ("eagle", dict(num_speculative_tokens=3)),
          ("eagle", dict(tree=TREE)),
          ("medusa", dict(num_speculative_tokens=3, survival_threshold=0.1)),
          ("eagle", dict(num_speculative_tokens=3, survival_threshold=0.1,
                         verify_costs=(1.0, 1.05, 1.1, 1.2), draft_cost=0.05))]


@pytest.mark.parametrize("method,spec", GREEDY, ids=["medusa-chain3", "medusa-tree",
                                                     "eagle-chain1", "eagle-chain3", "eagle-tree",
                                                     "medusa-adaptive", "eagle-adaptive-budget"])
def test_greedy_equals_autoregressive(target, trained, method, spec):
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=40)
    ref = sj.generate(target, PROMPTS, sampling=sampling)
    out = sj.generate(target, PROMPTS, sampling=sampling, spec=dict(method=method, **spec),
                      draft=trained[method])
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    # the trained heads are right often enough that multi-token rounds really happen
    assert out.stats.mean_accepted_length > 1.1, out.stats
    if spec.get("num_speculative_tokens", 3) > 1 and "survival_threshold" not in spec:
        assert out.stats.per_position_acceptance[1] > 0.02, out.stats


def test_eagle_trees_skip_trailing_leaves(target, trained, monkeypatch, fresh_programs):
    """EAGLE expands each tree level up to its last node with children (``Tree.expanded``): the
    same drafts, so the same sampled tokens and acceptance, as expanding every node; one node
    short is caught."""
    from test_tree import same_run, sampled_tree_runs
    runs = sampled_tree_runs(lambda: sj.generate(
        target, PROMPTS, sampling=sj.SamplingParams(temperature=0.8, max_new_tokens=30),
        spec=dict(method="eagle", tree=TREE), draft=trained["eagle"], key=5), monkeypatch)
    assert runs["trimmed"][1] > 0
    assert same_run(runs["trimmed"], runs["every node"])
    assert not same_run(runs["trimmed"], runs["one short"])


def accept_all(draft_tokens, target_tokens, valid=None):
    """Broken on purpose: a greedy verdict that accepts every draft."""
    G = draft_tokens.shape[1]
    tokens = jnp.concatenate([draft_tokens, target_tokens[:, G:]], axis=1)
    return verify.Verdict(tokens, jnp.full(draft_tokens.shape[:1], G, jnp.int32))


def accept_all_tree(tree, draft_tokens, target_tokens, valid=None):
    """Broken on purpose: a greedy tree verdict that accepts the first child of every node."""
    rows = jnp.arange(draft_tokens.shape[0])
    node, _, path, out = verify._walk(tree, draft_tokens, valid, None,
                                      lambda d, node, kid_tokens, kid_ok: kid_ok)
    return verify._tree_verdict(path, out, target_tokens[rows, node])


def differs_when_verification_accepts_everything(target, drafter, spec, monkeypatch) -> bool:
    """Whether greedy output with ``spec`` parts from autoregressive decoding once the greedy
    verdict (a chain's or a tree's) is broken to accept every draft (the greedy-equality tests'
    control)."""
    monkeypatch.setattr(verify, "greedy_verdict", accept_all)
    monkeypatch.setattr(verify, "greedy_tree_verdict", accept_all_tree)
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=40)
    ref = sj.generate(target, PROMPTS, sampling=sampling)
    out = sj.generate(target, PROMPTS, sampling=sampling, spec=spec, draft=drafter)
    return not np.array_equal(out.tokens, ref.tokens)


@pytest.mark.parametrize("spec", [dict(num_speculative_tokens=3), dict(tree=TREE)],
                         ids=["chain", "tree"])
def test_greedy_check_fails_when_verification_accepts_everything(target, trained, monkeypatch,
                                                                 fresh_programs, spec):
    assert differs_when_verification_accepts_everything(
        target, trained["eagle"], dict(method="eagle", **spec), monkeypatch)


# -- EAGLE's own cache --------------------------------------------------------------------------

@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_eagle_cache_holds_true_features_after_each_round(target, trained, tree):
    """After every round, the head's cache up to the round's start equals a fresh pass over the
    accepted sequence with the target's own features: rollback and catch-up lose nothing."""
    check_eagle_cache(target, trained["eagle"], tree)


def test_eagle_cache_check_fails_without_the_true_features(target, trained, monkeypatch,
                                                           fresh_programs):
    """Control: a head that keeps its prefill features instead of the verifier's fails it."""
    monkeypatch.setattr(EagleProposer, "observe", lambda self, state, start, hidden: state)
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        check_eagle_cache(target, trained["eagle"], None)


def greedy_rounds(target, d, proposer, rounds=5):
    """PROMPTS prefilled and decoded greedily with ``proposer`` (drafter ``d``) through the
    engine's own program; yields (the lengths before the round, the state after it) per round."""
    plan = engine.Plan(target.config, proposer, 96, Filters(greedy=True))
    B, P = len(PROMPTS), 16
    padded = np.zeros((B, P), np.int32)
    for b, p in enumerate(PROMPTS):
        padded[b, :len(p)] = p
    request = engine.Request(
        keys=jax.random.split(jax.random.key(0), B),
        sampling=SamplingArrays(temperature=jnp.zeros((B,)), top_k=jnp.zeros((B,), jnp.int32),
                                top_p=jnp.ones((B,))),
        max_new_tokens=jnp.full((B,), 40, jnp.int32), eos=jnp.full((8,), -1, jnp.int32))
    program = engine.Program(plan)
    state = program.prefill(target.params, d.params, jnp.asarray(padded),
                            jnp.asarray([len(p) for p in PROMPTS], jnp.int32), request)
    for _ in range(rounds):
        old = np.asarray(state.length)
        state = program.step(target.params, d.params, request, state)
        yield old, state


def check_eagle_cache(target, d, tree):
    proposer = EagleProposer(d.config, 3, None if tree is None else Tree(tree))
    multi = 0
    for old, state in greedy_rounds(target, d, proposer):
        length = np.asarray(state.length)
        multi += int(np.sum(length - old >= 2))
        for b in range(len(PROMPTS)):
            # the whole history row (fixed shape: one compile); a causal pass makes the entries
            # before the row's length independent of what lies after it
            seq = jnp.asarray(state.history[b:b + 1])
            n = seq.shape[1]
            positions = jnp.arange(n)[None]
            _, hidden, _ = sj.forward(target, seq, positions, sj.KVCache.init(target.config, 1, n))
            _, ref = heads_lib.eagle_forward(
                d.config, d.params["weights"], hidden[:, :-1],
                heads_lib.embed(target.params, seq[:, 1:]), positions[:, :-1],
                sj.KVCache.init(d.config.layer, 1, n - 1))
            upto = old[b]  # the round's catch-up rewrote pairs up to slot old - 1
            cache = state.draft_state.cache
            np.testing.assert_allclose(cache.k[:, b, :, :upto], ref.k[:, 0, :, :upto], atol=2e-5)
            np.testing.assert_allclose(cache.v[:, b, :, :upto], ref.v[:, 0, :, :upto], atol=2e-5)
            # and the features kept for the next catch-up are the target's along the path
            f = state.draft_state.features
            got = np.asarray(f.feats[b, :length[b] - f.start[b]])
            np.testing.assert_allclose(got, hidden[0, f.start[b]:length[b]], atol=2e-5)
    assert multi > 0


# -- distributions ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_drafters(models, tmp_path_factory):
    """test_lossless's V = 8 target with briefly trained Medusa (3 heads) and EAGLE."""
    target, _ = models
    tokens = samples_of(target, rows=32, length=60)
    drafters = {m: train_heads(target, m, tokens, quick(steps=30),
                               tmp_path_factory.mktemp("v8" + m), num_heads=3,
                               progress=False)[0] for m in ("medusa", "eagle")}
    return target, drafters


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_heads_are_calibrated_on_real_rounds(tiny_drafters, method, tmp_path):
    """specjax.adaptive.calibrate_rounds: every draft of the chain is verified, a draft is
    scored when the ones before it in its round were accepted, and the fit on half the prompts
    predicts the other half's acceptance; saved beside the heads, it loads with them."""
    from specjax import adaptive
    target, drafters = tiny_drafters
    heads = drafters[method]
    rng = np.random.default_rng(3)
    # 24 prompts: calibrate_rounds below runs quarters of 24 the same way (one program); the
    # last 8 from their own generator, so that the 96 below stay the ones this test was set on
    more = np.random.default_rng(4)
    prompts = ([list(rng.integers(0, 8, 4)) for _ in range(16)]
               + [list(more.integers(0, 8, 4)) for _ in range(8)])
    gamma = 3
    out = sj.generate(target, prompts, draft=heads, key=0,
                      sampling=sj.SamplingParams(temperature=0.8, max_new_tokens=24),
                      spec=sj.SpecConfig(method=method, num_speculative_tokens=gamma,
                                         survival_threshold=adaptive.EVERY_DRAFT))
    s = out.stats
    assert (s.proposed_length_distribution[:-1] == 0).all()  # every round drafts all γ
    points = np.asarray(s.reliability).reshape(-1, 3)
    drafts = points[:, 2].sum()
    assert drafts == s.accepted_tokens + s.rejecting_rounds  # accepted, and the first rejected
    assert abs(np.sum(points[:, 1] * points[:, 2]) - s.accepted_tokens) < 1e-3
    # the fit needs many prompts: 8 prompts' rounds differ from 8 others' by 0.1-0.4 in
    # acceptance at the same confidence
    many = [list(rng.integers(0, 8, 4)) for _ in range(96)]
    cal, report = adaptive.calibrate_rounds(target, heads, many, gamma=gamma,
                                            max_new_tokens=24)
    for mode in ("greedy", "sampled"):
        r = report[mode]
        assert r["samples"] > 1500 and min(r["a"]) > 0 and len(r["a"]) == gamma
        assert r["ece"] <= max(r["ece_raw"], 0.1), r  # fitted on other prompts; no worse
    # sampled, the raw confidence (the largest probability of q) is far from the acceptance
    # (min(p, q) summed): the fit corrects it on prompts it never saw
    assert report["sampled"]["ece"] < 0.6 * report["sampled"]["ece_raw"], report["sampled"]
    heads_lib.save_heads(heads, tmp_path / method, target)
    adaptive.save_calibration(cal, tmp_path / method, report, heads)
    loaded = sj.load_heads(tmp_path / method, target)
    np.testing.assert_allclose(loaded.params["calibration"].b, cal.b)
    # beside other weights (the heads trained again), the file is ignored, with a warning
    other = heads_lib.Heads(heads.config, {**heads.params, "weights": jax.tree.map(
        lambda x: x * 1.5, heads.params["weights"])})
    heads_lib.save_heads(other, tmp_path / "other", target)
    (tmp_path / "other" / "calibration.json").write_text(
        (tmp_path / method / "calibration.json").read_text())
    with pytest.warns(UserWarning, match="fitted for other weights.*calibrate --heads"):
        assert "calibration" not in sj.load_heads(tmp_path / "other", target).params
    with pytest.raises(ValueError, match="method 'ngram' has no adaptive lengths"):
        adaptive.calibrate_rounds(target, heads, prompts, method="ngram")


@pytest.mark.parametrize("method,spec,block,setting", [
    ("medusa", dict(tree=((0,), (1,), (0, 0))), 4, (0.7, 5, 0.9)),
    ("medusa", dict(num_speculative_tokens=2), None, (1.0, 0, 1.0)),
    ("eagle", dict(num_speculative_tokens=2), None, (1.0, 0, 1.0)),
    ("eagle", dict(num_speculative_tokens=2), None, (0.7, 5, 0.9)),
    ("eagle", dict(tree=((0,), (1,), (0, 0))), 4, (0.8, 5, 1.0))],
    ids=["medusa-tree-in-blocks-t0.7-k5-p0.9", "medusa-chain-t1", "eagle-chain-t1",
         "eagle-chain-t0.7-k5-p0.9", "eagle-tree-in-blocks-t0.8-k5"])
def test_first_three_tokens_follow_the_target(tiny_drafters, monkeypatch, method, spec, block,
                                              setting):
    """At T = 1 and with top-k and top-p (the settings of test_lossless.py); block=4: the
    target's and EAGLE's attention walk their caches in 4-slot blocks."""
    if block is not None:
        monkeypatch.setattr(attention, "BLOCK", block)
    target, drafters = tiny_drafters
    t, k, p = setting
    sampling = sj.SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=3)
    samples = generate_samples(target, drafters[method], sampling,
                               sj.SpecConfig(method=method, **spec))
    assert g_test(samples, exact_joint(target, t, k, p)) > 1e-3


def test_bfloat16_eagle_follows_the_target(tiny_drafters, tmp_path):
    """EAGLE as accelerators run it by default: the target and the head in bfloat16 (the head
    loaded for the bfloat16 target takes its dtype; probabilities in float32), sampled at the
    setting with every filter on. The sample follows the bfloat16 target's own distribution, in
    calls of 64 rows as test_lossless's bfloat16 cases (bfloat16 products round differently
    over more rows)."""
    target, drafters = tiny_drafters
    half = sj.checkpoint.cast(target, "bfloat16")
    heads_lib.save_heads(drafters["eagle"], tmp_path / "eagle", target)
    head = sj.load_heads(tmp_path / "eagle", half)
    assert head.config.layer.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(head.params["weights"])} == {jnp.dtype("bfloat16")}
    t, k, p = 0.7, 5, 0.9
    sampling = sj.SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=3)
    samples = small_batch_samples(half, head, sampling,
                                  sj.SpecConfig(method="eagle", num_speculative_tokens=2))
    assert g_test(samples, exact_joint(half, t, k, p)) > 1e-3


# per method, a threshold at which the V = 8 drafters' rows propose different numbers of drafts
# in the same rounds (EAGLE: 1 or 2, Medusa: 0 or 2; identity calibration: they ship none)
ADAPTIVE = {"eagle": 0.2, "medusa": 0.5}


def adaptive_greedy_stats(target, drafter, method: str, gamma: int, threshold: float):
    """Greedy decoding of PROMPTS with adaptive lengths of ``method`` at ``threshold``: checks
    that the output equals autoregressive decoding's and that rounds stopped at different depths
    (fewer than 90% drafting all γ, over 10% at least 2), and returns its Stats."""
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=40)
    ref = sj.generate(target, PROMPTS, sampling=sampling)
    out = sj.generate(target, PROMPTS, sampling=sampling, draft=drafter,
                      spec=dict(method=method, num_speculative_tokens=gamma,
                                survival_threshold=threshold))
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    lengths = out.stats.proposed_length_distribution
    assert lengths[gamma] < 0.9 and lengths[2:].sum() > 0.1, lengths
    return out.stats


def adaptive_pvalue(target, drafter, method: str, threshold: float, t: float = 0.8,
                    k: int = 5, p: float = 1.0, *, lengths_vary: bool = True,
                    **budget) -> float:
    """The G-test p-value of the first three tokens sampled with adaptive lengths of ``method``
    at ``threshold`` (temperature t, top-k k, top-p p, chains of 3; ``budget``: SpecConfig's
    verify_costs and draft_cost) against the target's exact joint. ``lengths_vary``: also check
    that the rounds of that sampling run really proposed different lengths (at least two
    lengths in over a fifth of the rounds each, fewer than 4 in 80%)."""
    sampling = sj.SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=3)
    spec = sj.SpecConfig(method=method, num_speculative_tokens=3, survival_threshold=threshold,
                         **budget)
    out = sample_rows(target, drafter, sampling, spec)
    if lengths_vary:
        lengths = out.stats.proposed_length_distribution
        assert (lengths > 0.2).sum() >= 2 and lengths[3] < 0.8, lengths
    return g_test(out.tokens, exact_joint(target, t, k, p))


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_adaptive_lengths_follow_the_target(tiny_drafters, pairs_of_rows, method):
    """Adaptive lengths for the heads: confidence from the head's own distribution, read
    before the draw (EAGLE's sampled q; Medusa's softmax, whose argmax is its draft)."""
    target, drafters = tiny_drafters
    assert adaptive_pvalue(target, drafters[method], method, ADAPTIVE[method]) > 1e-3


def test_eagle_thresholds_share_one_program(tiny_drafters):
    """A riding proposer's threshold is data of the call too (adaptive.Tuning): EAGLE at three
    thresholds runs one program, each call with its own number (fewer drafts at a higher
    threshold), greedy-exact."""
    target, drafters = tiny_drafters
    prompts = [[1, 2, 3], [4, 5, 6, 7, 0, 1], [2], [3, 1, 4, 1, 5, 7, 2, 6]]  # V = 8
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=40)
    ref = sj.generate(target, prompts, sampling=sampling)
    proposed, compiled, compile_seconds = [], [], []
    for threshold in (0.05, ADAPTIVE["eagle"], 0.9):
        out = sj.generate(target, prompts, sampling=sampling, draft=drafters["eagle"],
                          spec=dict(method="eagle", num_speculative_tokens=3,
                                    survival_threshold=threshold))
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        proposed.append(out.stats.proposed_tokens)
        compiled.append(engine.PROGRAMS.compiled)
        compile_seconds.append(out.stats.compile_seconds)
    assert compiled[1:] == compiled[:1] * 2 and compile_seconds[1:] == [0, 0], compiled
    assert proposed[0] > proposed[2], proposed


def test_budget_lengths_follow_the_target_with_eagle(tiny_drafters, pairs_of_rows):
    """EAGLE under the verify budget (widths priced so that rounds verify 1 or 2 of the 3
    drafts), at T = 0.7 with top-k 5 and top-p 0.9. Lengths that score the drawn draft, or a
    uniform q reported for drafts drawn from EAGLE's, fail it (p < 1e-60, run as throwaway
    edits)."""
    target, drafters = tiny_drafters
    assert adaptive_pvalue(target, drafters["eagle"], "eagle", ADAPTIVE["eagle"], 0.7, 5, 0.9,
                           verify_costs=(1.0, 1.1, 1.2, 1.4), draft_cost=0.05) > 1e-3


def test_eagle_lengths_that_look_at_the_drawn_draft_fail_the_same_test(tiny_drafters,
                                                                       monkeypatch,
                                                                       pairs_of_rows):
    target, drafters = tiny_drafters
    monkeypatch.setattr(eagle, "draw_scored", scoring_the_drawn_token(eagle.draw_scored))
    assert adaptive_pvalue(target, drafters["eagle"], "eagle", ADAPTIVE["eagle"],
                           lengths_vary=False) < 1e-6


def reporting_uniform_q(propose, vocab_size: int | None = None):
    """Broken on purpose: ``propose`` whose drafts report a uniform q instead of the
    distribution they were drawn from (``vocab_size`` given: also drafts that are point
    masses, Medusa's argmax, reported as drawn from a uniform q)."""
    def wrong_q(self, *args, **kwargs):
        draft, state = propose(self, *args, **kwargs)
        shape = ((*draft.tokens.shape, vocab_size) if draft.probs is None
                 else draft.probs.shape)  # (a tree's probs: a row per node, the root's too)
        uniform = jnp.full(shape, 1.0 / shape[-1], jnp.float32)
        return dataclasses.replace(draft, probs=uniform), state
    return wrong_q


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_reporting_the_wrong_q_fails_the_same_test(tiny_drafters, monkeypatch, fresh_programs,
                                                   method):
    """A drafter that samples from q but reports another distribution to the verifier (here a
    uniform one) breaks losslessness; so does one whose argmax drafts (point masses, Medusa's)
    are said to come from a soft q. The distribution test must see both."""
    target, drafters = tiny_drafters
    proposer = {"eagle": EagleProposer, "medusa": MedusaProposer}[method]
    monkeypatch.setattr(proposer, "propose", reporting_uniform_q(proposer.propose, 8))
    t, k = 0.8, 5
    sampling = sj.SamplingParams(temperature=t, top_k=k, max_new_tokens=3)
    samples = generate_samples(target, drafters[method], sampling,
                               sj.SpecConfig(method=method, num_speculative_tokens=2))
    assert g_test(samples, exact_joint(target, t, k, 1.0)) < 1e-6


@pytest.mark.parametrize("method,spec,block", [("eagle", dict(num_speculative_tokens=3), 4),
                                               ("medusa", dict(num_speculative_tokens=3), None),
                                               ("eagle", dict(tree=TREE), None),
                                               ("medusa", dict(tree=TREE), None)],
                         ids=["eagle-chain3-in-blocks", "medusa-chain3", "eagle-tree",
                              "medusa-tree"])
def test_later_tokens_follow_the_target_in_a_mixed_batch(tiny_drafters, tail_joints, monkeypatch,
                                                         method, spec, block):
    """Tokens 5 and 6 of rows alternating between two prompt lengths: several rounds, so the
    features handed from one verification to the next round's drafts are in play (with a tree:
    those of the path the verifier took, its accepted nodes compacted in the caches)."""
    if block is not None:
        monkeypatch.setattr(attention, "BLOCK", block)
    target, drafters = tiny_drafters
    spec = dict(spec)
    out = later_samples(target, drafters[method], spec.pop("num_speculative_tokens", None),
                        method=method, **spec)
    assert out.stats.per_position_acceptance[1] > 0.02  # rounds with 2+ accepted drafts occur
    assert min(tail_pvalues(out.tokens, tail_joints)) > 1e-3


# -- the bench ----------------------------------------------------------------------------------

def test_bench_runs_several_methods_against_one_baseline(target, draft, trained):
    """specjax bench --method draft_model,medusa,eagle: one AR baseline, a row per method, and
    for each its propose timed apart from the round (c) and measured over predicted."""
    from specjax.bench import run_bench
    specs = [sj.SpecConfig(method=m, num_speculative_tokens=2)
             for m in ("draft_model", "medusa", "eagle")]
    result = run_bench(target, PROMPTS[:2], specs, draft=draft,
                       drafters={m: trained[m] for m in ("medusa", "eagle")},
                       temperatures=(0.0,), max_new_tokens=12, repeats=1, verify_repeats=2)
    rows = result["rows"]
    assert [r["method"] for r in rows] == ["draft_model", "medusa", "eagle"]
    assert len({r["ar_tokens_per_second"] for r in rows}) == 1  # one shared baseline
    assert all(r["identical_to_autoregressive"] for r in rows)
    for r in rows:
        assert np.isfinite(r["draft_cost_per_draft"]) and r["c"] > 0
        # both parts timed (which is larger is a timing, not a test, on a busy machine)
        assert r["propose_ms"] > 0 and r["round_ms"] > 0 and r["round_over_parts"] > 0
        assert np.isfinite(r["measured_over_predicted"]) and r["c"] != r["draft_cost_per_draft"]
    with pytest.raises(ValueError, match="needs a drafter"):
        run_bench(target, PROMPTS[:2], specs[2:], temperatures=(0.0,))


def test_the_propose_timer_times_the_proposal(target, trained):
    """timing.round_timers' propose program keeps the drafts live: a proposer whose state does
    not change (Medusa, n-gram) is not compiled away (the program still multiplies by every head
    and reads the history)."""
    from specjax import timing
    E, prompt = target.config.hidden_size, PROMPTS[3] * 3
    sampling = sj.SamplingParams(temperature=0.0, max_new_tokens=16)
    heads = trained["medusa"]
    medusa = timing.round_timers(target, prompt, sampling=sampling, decoded=4, draft=heads,
                                 spec=dict(method="medusa", num_speculative_tokens=3))
    flops = medusa["propose"].executable.cost_analysis()["flops"]
    assert flops >= heads.config.num_heads * 2 * E * E, flops
    ngram = timing.round_timers(target, prompt, sampling=sampling, decoded=4,
                                spec=dict(method="ngram", num_speculative_tokens=3))
    cost = ngram["propose"].executable.cost_analysis()
    assert cost["flops"] > 0 and cost["bytes accessed"] >= 4 * 256, cost  # the [1, S] history


def test_round_timers_verify_at_a_chosen_width(target):
    """``round_timers(width=w)`` times a per-row-length chain's round verifying over w tokens
    (experiments/round_widths.py): a wider round computes more; a width generate's loop never
    uses, or a chain of static length, is refused by name."""
    from specjax import engine, timing
    prompt, sampling = PROMPTS[3] * 3, sj.SamplingParams(temperature=0.0, max_new_tokens=16)
    spec = dict(method="ngram", num_speculative_tokens=3)
    widths = engine.loop_widths(3)
    flops = [timing.round_timers(target, prompt, sampling=sampling, decoded=4, spec=spec,
                                 width=w)["round"].executable.cost_analysis()["flops"]
             for w in (widths[0], widths[-1])]
    assert flops[0] < flops[1], flops
    with pytest.raises(ValueError, match="width=99"):
        timing.round_timers(target, prompt, sampling=sampling, decoded=4, spec=spec, width=99)
    with pytest.raises(ValueError, match="width=2"):
        timing.round_timers(target, prompt, sampling=sampling, decoded=4, width=2)
