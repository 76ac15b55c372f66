"""Training: loss goes down, a resumed run is identical to an uninterrupted one, distillation
pulls the student towards the teacher, the corpus split is by file."""

import dataclasses
import json
import pathlib
import shutil
import warnings

import jax
import numpy as np
import pytest
from conftest import tiny_config, tiny_model

import specjax as sj
from specjax import train
from specjax.draft.draft_model import load_paired_draft

CFG = tiny_config(vocab_size=32, hidden_size=16, layers=1)
GOLDEN_HELDOUT = [4, 13, 18, 28]  # of pkg/m0.py .. pkg/m39.py at 10%


def stream(n=4000, seed=0, noise_seed=None):
    """A learnable token stream: a repeated pattern (from seed) with 5% noise (noise_seed)."""
    pattern = np.random.default_rng(seed).integers(1, 32, size=50)
    rng = np.random.default_rng([seed, noise_seed or 0])
    tokens = np.tile(pattern, n // 50 + 1)[:n]
    noise = rng.random(n) < 0.05
    tokens[noise] = rng.integers(1, 32, size=noise.sum())
    return tokens.astype(np.uint16)


def settings(steps, **kw):
    return train.TrainConfig(**{**dict(steps=steps, batch_size=4, seq_len=16, learning_rate=3e-2,
                                       warmup_steps=2, checkpoint_every=3, eval_every=10,
                                       eval_batches=2), **kw})


def test_loss_goes_down(tmp_path):
    tokens = stream()
    heldout = stream(n=1000, noise_seed=1)  # the same pattern, other noise
    model, history = train.train(CFG, tokens, settings(30), tmp_path, heldout=heldout,
                                 progress=False)
    assert history[0]["step"] == 10 and history[-1]["step"] == 30
    start = train.evaluate(sj.init_model(CFG, jax.random.key(0)), heldout, 2, 4, 16)
    assert history[-1]["heldout_loss"] < start - 1.0, (start, history)


def test_resume_is_identical_to_an_uninterrupted_run(tmp_path, caplog):
    tokens = stream()
    straight, _ = train.train(CFG, tokens, settings(6), tmp_path / "a", progress=False)
    steps = lambda: sorted(int(p.name) for p in (tmp_path / "b" / "checkpoints").iterdir()  # noqa
                           if p.name.isdigit())
    half, _ = train.train(CFG, tokens, settings(6), tmp_path / "b", progress=False,
                          max_seconds=0)
    assert steps() == [1]  # the interrupted run stopped after one step and checkpointed it
    with caplog.at_level("INFO", logger=train.loop.log.name):
        resumed, _ = train.train(CFG, tokens, settings(6), tmp_path / "b", progress=False)
    assert steps()[-1] == 6
    # it went on from step 1 (a run that ignored the checkpoint would end with the same weights)
    assert f"resumed from step 1 in {tmp_path / 'b'}" in caplog.text
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(half.params), jax.tree.leaves(resumed.params)))


def test_distillation_moves_the_student_towards_the_teacher(tmp_path):
    teacher = tiny_model(seed=5, vocab_size=32)
    tokens = stream()
    batch = jax.numpy.asarray(train.sample_batch(tokens, 8, 16, 99, 0))
    student0 = sj.init_model(CFG, jax.random.key(0))
    before = float(train.distill_loss(CFG, student0.params, batch, teacher))
    student, _ = train.train(CFG, tokens, settings(40), tmp_path, teacher=teacher,
                             progress=False)
    after = float(train.distill_loss(CFG, student.params, batch, teacher))
    assert after < 0.7 * before, (before, after)


def test_a_mixed_batch_is_scored_as_its_parts_by_their_tokens():
    """MixedDistillObjective (draft-gen's windows and generated rows, of two lengths): the
    token-weighted mean of distill_loss over the parts, so one longer part is scored as its
    two halves would be together."""
    from specjax.train.loop import DistillObjective, MixedDistillObjective
    student = sj.init_model(CFG, jax.random.key(1)).params
    teacher = sj.init_model(CFG, jax.random.key(2)).params
    rng = np.random.default_rng(0)
    a, b = (jax.numpy.asarray(rng.integers(0, 32, shape), np.int32) for shape in [(2, 9), (3, 5)])
    mixed = MixedDistillObjective(CFG, CFG, ce_weight=0.1)
    plain = DistillObjective(CFG, CFG, ce_weight=0.1)
    want = (16 * plain(student, a, teacher) + 12 * plain(student, b, teacher)) / 28
    np.testing.assert_allclose(float(mixed(student, (a, b), teacher)), float(want), rtol=1e-6)
    np.testing.assert_allclose(float(mixed(student, (a[:1], a[1:]), teacher)),
                               float(plain(student, a, teacher)), rtol=1e-6)
    # the parts' weights matter: the mean of the two means is another number
    assert abs(float(want) - float((plain(student, a, teacher) + plain(student, b, teacher)) / 2)
               ) > 1e-4


def test_batches_are_a_function_of_seed_and_step():
    tokens = stream()
    a = train.sample_batch(tokens, 4, 16, 0, 7)
    np.testing.assert_array_equal(a, train.sample_batch(tokens, 4, 16, 0, 7))
    assert not np.array_equal(a, train.sample_batch(tokens, 4, 16, 0, 8))
    assert a.shape == (4, 17)
    with pytest.raises(ValueError, match="shorter"):
        train.sample_batch(tokens[:10], 1, 16, 0, 0)


def test_corpus_split_by_file_and_tokenizer(tmp_path):
    root = tmp_path / "src"
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    for i in range(200):
        (root / "pkg" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    (root / "tests" / "test_x.py").write_text("assert True\n")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "other.py").write_text("x = 1\n")
    corpus = train.python_corpus(root, heldout_percent=10)
    names = {f.name for f in corpus.train} | {f.name for f in corpus.heldout}
    assert "other.py" not in names and len(names) == 201
    assert not set(corpus.train) & set(corpus.heldout) and 5 < len(corpus.heldout) < 40
    assert train.python_corpus(root, heldout_percent=10) == corpus  # deterministic
    # The split is a fixed function of the relative path (same on every machine and OS).
    assert train.data._heldout("pkg/m0.py", 10) is False
    assert [i for i in range(40) if train.data._heldout(f"pkg/m{i}.py", 10)] == GOLDEN_HELDOUT
    tok = train.train_tokenizer(corpus.train, 300, tmp_path / "tok")
    stream_ = train.encode_files(tok, corpus.heldout, tmp_path / "heldout.npy")
    assert stream_.dtype == np.uint16 and (stream_ == 0).sum() == len(corpus.heldout)
    loaded = sj.load_tokenizer(tmp_path / "tok")
    text = corpus.heldout[0].read_text()
    assert loaded.decode(loaded.encode(text)) == text


def assert_run_starts_at(pair, config, settings, run, folder):
    """The run (two steps at a learning rate of 1e-9) ends where it started: the model in
    ``folder``, read in float32."""
    model, step = pair._restore(config, settings, run)
    assert step == 2
    for a, b in zip(jax.tree.leaves(model.params),
                    jax.tree.leaves(sj.load_model(folder, dtype="float32").params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_pair_stages_end_to_end(tmp_path):
    """data -> target -> draft (distilled) -> export, on a tiny corpus with tiny models; the
    exported folders load with sj.load_model / sj.load_tokenizer and decode speculatively."""
    from specjax.train import pair
    root = tmp_path / "src"
    root.mkdir()
    for i in range(400):  # enough that the 2% held-out split gets some files
        (root / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + 1\n\n" * 3)
    work = tmp_path / "work"
    pair.stage_data(work, root, vocab_size=300)
    target = tiny_config(vocab_size=300, hidden_size=32, layers=2, heads=2, kv_heads=1)
    draft = tiny_config(vocab_size=300, hidden_size=16, layers=1, heads=1, kv_heads=1)
    quick = train.TrainConfig(steps=4, batch_size=2, seq_len=16, checkpoint_every=2,
                              eval_every=4, eval_batches=1)
    pair.stage_target(work, None, target, quick, progress=False)
    pair.stage_draft(work, None, draft, quick, target, quick, progress=False)
    fit = dict(num_prompts=4, max_new_tokens=8, temperature=0.8)
    exported = tmp_path / "out"
    pair.stage_export(work, tmp_path / "out", (("target", target, quick),
                                               ("draft", draft, quick)), draft_vocab_size=100,
                      calibration=fit, draft_window=8)
    t = sj.load_model(tmp_path / "out" / "code-target")
    d = sj.load_draft_model(tmp_path / "out" / "code-draft")
    # the draft shipped with an attention window (as Mistral), the target without; the card says so
    assert d.model.config.sliding_window == 8 and t.config.sliding_window is None
    assert json.loads((exported / "code-draft" / "config.json").read_text())[
        "architectures"] == ["MistralForCausalLM"]
    card = (exported / "code-draft" / "README.md").read_text()
    assert "attends to the latest 8 positions" in card and "`MistralForCausalLM` layout" in card
    assert "`LlamaForCausalLM` layout" in (exported / "code-target" / "README.md").read_text()
    # a stage continuing from the windowed draft trains it attending to every position again:
    # the same logits within the window, others past it
    ids = np.arange(1, 17)[None] % 300
    windowed = np.asarray(sj.logits(sj.load_model(exported / "code-draft", dtype="float32"), ids))
    whole = np.asarray(sj.logits(pair._start(exported / "code-draft", draft, "draft"), ids))
    np.testing.assert_allclose(whole[:, :8], windowed[:, :8], atol=1e-5)
    assert np.abs(whole[:, 8:] - windowed[:, 8:]).max() > 1e-3
    vocab = np.asarray(d.vocab.ids)  # the 100 most frequent training tokens
    counts = np.bincount(np.load(work / "train.npy"), minlength=300)
    assert len(vocab) == 100 and counts[vocab].min() >= np.delete(counts, vocab).max()
    tok = sj.load_tokenizer(tmp_path / "out" / "code-target")
    assert t.config.num_hidden_layers == 2
    # exported in bfloat16 (what "stored" keeps; the default computes in float32 on CPU)
    assert sj.load_model(tmp_path / "out" / "code-target", dtype="stored").config.dtype == (
        "bfloat16")
    out = sj.generate(t, ["def f1(x):"], tokenizer=tok, draft=d, spec=sj.SpecConfig(),
                      sampling=sj.SamplingParams(temperature=0, max_new_tokens=8),
                      return_text=True)
    assert isinstance(out.text[0], str)
    assert out.text[0] == tok.decode(out.tokens[0, :out.lengths[0]])
    assert tok.eos_token_ids == (0,)  # the end-of-text token, recorded by export
    assert (work / "target-evals.jsonl").exists() and (work / "draft-evals.jsonl").exists()
    # a draft with a tokenizer of its own (280 tokens), trained on the same files and shipped
    # beside them with its tokenizer and a card measuring it against code-draft
    own = tiny_config(vocab_size=280, hidden_size=16, layers=1, heads=1, kv_heads=1)
    pair.stage_draft_bpe4k(work, None, own, quick, progress=False)
    # then fine-tuned on text the target writes (one chunk of generation is enough here)
    pair.stage_draft_bpe4k_kd(work, None, 1e-4, own, quick, quick,
                              target_folder=tmp_path / "out" / "code-target", progress=False)
    (chunk,) = (work / "bpe4k" / "kd").glob("chunk-*.npy")
    assert np.load(chunk).size > pair.KD_BATCH * 48  # the target's text (16 + 48 ids), encoded
    pair.stage_export_bpe4k(work, tmp_path / "out", own, quick, draft_vocab_size=100,
                            kd_settings=quick)
    paired = load_paired_draft(tmp_path / "out" / "code-draft-bpe4k", tok, 300)
    assert paired.spelling is not None and paired.vocab.size <= 100
    info = json.loads((tmp_path / "out" / "code-draft-bpe4k" / "training.json").read_text())
    assert info["steps"] == 4 and 0 < info["coverage"]["target_mass"] <= 1
    assert 0 <= info["acceptance"]["greedy"]["acceptance_rate"] <= 1
    assert "code_draft_acceptance" in info
    card = (tmp_path / "out" / "code-draft-bpe4k" / "README.md").read_text()
    assert "280" in card and "{" not in card and "export-bpe4k" in card
    assert "then fine-tuned 4 steps" in card and info["fine_tuned_on_target_text"]
    # its context as trained (16 of its tokens) against declared (64), measured by position
    # on the long prompts beside code-draft's; the table ends before the rebuild paragraph
    assert info["acceptance"]["long"]["by_position"] and info["code_draft_acceptance"]["long"]
    assert "| context | trained on sequences of 16 of its own tokens" in card
    assert "as the next row shows |\n| acceptance by context position" in card
    assert " |\n\n**Rebuild.**" in card
    # target-long continues the exported target on longer sequences, resumably, from its
    # weights: at step 0 (no update yet) it is the exported model
    longer = train.TrainConfig(steps=2, batch_size=2, seq_len=64, checkpoint_every=1,
                               eval_every=2, eval_batches=1, learning_rate=1e-9, warmup_steps=1)
    with pytest.raises(SystemExit, match="another model"):
        pair.stage_target_long(work, None, tmp_path / "out" / "code-draft", target, longer,
                               progress=False)
    pair.stage_target_long(work, None, tmp_path / "out" / "code-target", target, longer,
                           progress=False)
    assert_run_starts_at(pair, target, longer, work / "target-long", exported / "code-target")
    # draft-long distils the exported draft again from target-long, from its weights; export
    # --long ships the two as code-target and code-draft with cards that say so
    with pytest.raises(SystemExit, match="another model"):
        pair.stage_draft(work, None, draft, longer, target, longer, progress=False,
                         teacher_run="target-long", run="draft-long",
                         start=tmp_path / "out" / "code-target")
    pair.stage_draft(work, None, draft, longer, target, longer, progress=False,
                     teacher_run="target-long", run="draft-long",
                     start=tmp_path / "out" / "code-draft")
    assert_run_starts_at(pair, draft, longer, work / "draft-long", exported / "code-draft")
    pair.stage_export(work, tmp_path / "long", (("target-long", target, longer),
                                                ("draft-long", draft, longer)),
                      draft_vocab_size=100, calibration=fit)
    for name in ("code-target", "code-draft"):
        info = json.loads((tmp_path / "long" / name / "training.json").read_text())
        card = (tmp_path / "long" / name / "README.md").read_text()
        assert info["steps"] == 2 and info["train"]["seq_len"] == 64
        assert "sequences of 64 tokens" in card and "continued from the" in card
        assert "export --long" in card and "{" not in card
    # draft-gen distils the exported draft again from the exported target, on training windows
    # and on the target's own text (one chunk: 16-token windows continued 48 tokens, greedy for
    # chunk 0); from the draft's weights. export --gen ships it beside the target, read from its
    # folder and written again unchanged.
    shipped = tmp_path / "out" / "code-target"
    with pytest.raises(SystemExit, match="another model"):
        pair.stage_draft_gen(work, None, shipped, target_folder=shipped, config=draft,
                             settings=longer, rows=3, generate_minutes=1e-4, progress=False)
    pair.stage_draft_gen(work, None, tmp_path / "out" / "code-draft", target_folder=shipped,
                         config=draft, settings=longer, rows=3, generate_minutes=1e-4,
                         progress=False)
    assert_run_starts_at(pair, draft, longer, work / "draft-gen", exported / "code-draft")
    (chunk,) = (work / "draft-gen-text").glob("chunk-*.npy")
    rows = np.load(chunk)
    assert rows.shape == (pair.KD_BATCH, 64)
    teacher_model = sj.load_model(shipped)
    greedy = sj.generate(teacher_model, rows[:4, :16].tolist(),
                         sampling=sj.SamplingParams(temperature=0, max_new_tokens=48))
    np.testing.assert_array_equal(np.asarray(greedy.tokens)[:, :48], rows[:4, 16:])
    pair.stage_export(work, tmp_path / "gen", (("target-long", target, longer),
                                               ("draft-gen", draft, longer)),
                      draft_vocab_size=100, calibration=fit, shipped={"target-long": shipped})
    for a, b in zip(jax.tree.leaves(sj.load_model(shipped, dtype="stored").params),
                    jax.tree.leaves(sj.load_model(tmp_path / "gen" / "code-target",
                                                  dtype="stored").params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    card = (tmp_path / "gen" / "code-draft" / "README.md").read_text()
    assert "`draft-gen --from B/code-draft --teacher B/code-target`, `export --gen --from " \
           "B/code-target --out C`" in card and "{" not in card
    assert f"{pair.DRAFT_GEN_ROWS} rows of" in card
    assert json.loads((tmp_path / "gen" / "code-target" / "training.json").read_text())[
        "acceptance"] == json.loads((tmp_path / "gen" / "code-draft" / "training.json"
                                     ).read_text())["acceptance"]
    # draft-gen-long: the same stage on rows that fill the context (prompts of 16 or 32 tokens
    # continued to 64), from the draft-gen draft; export --gen-long ships it with its own rebuild
    pair.stage_draft_gen(work, None, tmp_path / "gen" / "code-draft", target_folder=shipped,
                         config=draft, settings=longer, rows=2, generate_minutes=1e-4,
                         progress=False, run_name="draft-gen-long",
                         lengths=pair.long_rows(64, (16, 32)))
    assert_run_starts_at(pair, draft, longer, work / "draft-gen-long",
                         tmp_path / "gen" / "code-draft")
    (chunk,) = (work / "draft-gen-long-text").glob("chunk-*.npy")
    assert np.load(chunk).shape == (pair.KD_BATCH, 64)
    pair.stage_export(work, tmp_path / "gen-long", (("target-long", target, longer),
                                                    ("draft-gen-long", draft, longer)),
                      draft_vocab_size=100, calibration=fit, shipped={"target-long": shipped})
    card = (tmp_path / "gen-long" / "code-draft" / "README.md").read_text()
    assert "`export --gen-long --from B/code-target --out D`" in card
    assert "`draft-gen-long --from C/code-draft --teacher B/code-target`" in card
    assert f"{pair.DRAFT_GEN_LONG_ROWS} rows of" in card and "{" not in card
    # each export fits the draft's calibration for its own weights; a calibration beside other
    # weights is ignored, with a warning naming the file
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("out", "long"):
            assert sj.load_draft_model(tmp_path / name / "code-draft").calibration is not None
    stale = tmp_path / "stale"  # another model's folder (the target's), the draft's file
    shutil.copytree(tmp_path / "out" / "code-target", stale)
    shutil.copy(tmp_path / "out" / "code-draft" / "calibration.json", stale)
    with pytest.warns(UserWarning, match="calibration.json was fitted for other weights"):
        assert sj.load_draft_model(stale).calibration is None
    for name in ("code-target", "code-draft"):  # model cards with the measured figures
        info = json.loads((tmp_path / "out" / name / "training.json").read_text())
        assert info["steps"] == 4 and info["corpus"]["heldout_files"] > 0
        assert 0 <= info["acceptance"]["greedy"]["acceptance_rate"] <= 1
        card = (tmp_path / "out" / name / "README.md").read_text()
        assert f"{info['heldout_loss']:.3f} nats/token" in card and "{" not in card
        by_position = info["heldout_loss_by_position"]  # the tiny context: one bin, cut at 64
        assert list(by_position) == ["windows", "0-64"] and by_position["windows"] > 0
        assert f"0-64 {by_position['0-64']:.3f}" in card and "sequences of 16 tokens" in card
        long = info["acceptance"]["long"]  # the long prompts, cut to the tiny context
        assert long["gamma"] == 4 and list(long["by_position"]) == ["0-256"]
        assert f"mean accepted length {long['mean_accepted_length']:.2f}; by the position a " \
               f"round starts at: 0-256 {long['by_position']['0-256']:.2f}" in card


def test_resuming_with_other_settings_is_refused(tmp_path):
    tokens = stream()
    train.train(CFG, tokens, settings(2), tmp_path, progress=False)
    with pytest.raises(ValueError, match="train.learning_rate"):
        train.train(CFG, tokens, train.TrainConfig(
            steps=2, batch_size=4, seq_len=16, learning_rate=1e-4, warmup_steps=2,
            checkpoint_every=3, eval_every=10, eval_batches=2), tmp_path, progress=False)
    # another token stream under the same settings
    with pytest.raises(ValueError, match=r"other settings \(data\)"):
        train.train(CFG, stream(noise_seed=1), settings(2), tmp_path, progress=False)


def test_a_distillation_resumed_against_another_teacher_is_refused(tmp_path, caplog):
    """The teacher's weights are part of the run (a draft begun while its target trained on,
    then resumed, would be distilled from two teachers): a teacher trained further, same config,
    is refused by name; a run recorded before specjax kept data and weights resumes."""
    tokens = stream()
    teacher = tiny_model(seed=5, vocab_size=32)
    train.train(CFG, tokens, settings(4), tmp_path, teacher=teacher, progress=False,
                max_seconds=0)
    further = sj.Model(teacher.config, jax.tree.map(lambda x: x * 1.01, teacher.params))
    with pytest.raises(ValueError, match=r"other settings \(teacher_weights\.[^)]*\)"):
        train.train(CFG, tokens, settings(4), tmp_path, teacher=further, progress=False)
    record = json.loads((tmp_path / "run.json").read_text())
    for later in ("data", "teacher_weights"):
        del record[later]
    (tmp_path / "run.json").write_text(json.dumps(record))
    with caplog.at_level("INFO", logger=train.loop.log.name):
        train.train(CFG, tokens, settings(4), tmp_path, teacher=teacher, progress=False)
    assert f"resumed from step 1 in {tmp_path}" in caplog.text


def test_weight_decay_skips_norms_and_biases():
    params = sj.init_model(tiny_config(attention_bias=True), jax.random.key(0)).params
    mask = train.loop._decayed(params)
    layer = mask["layers"]["0"]
    assert layer["mlp"]["up_proj"]["kernel"] and mask["embed_tokens"]["embedding"]
    assert not mask["norm"]["weight"] and not layer["input_layernorm"]["weight"]
    assert not layer["self_attn"]["q_proj"]["bias"]


def test_the_cards_rebuild_chain_reads_each_export_before_it(tmp_path, monkeypatch):
    """The shipped pair's Rebuild line (target, draft, their -long continuations, the draft on
    the target's own text), run through `specjax train pair` with the stages recorded instead
    of run: each stage that continues a model reads the export before it, never the bundled
    folders (their default), and draft-gen distils from the -long target."""
    from specjax.train import pair
    calls = []
    for stage in ("stage_data", "stage_target", "stage_draft", "stage_export",
                  "stage_target_long", "stage_draft_long", "stage_draft_gen"):
        monkeypatch.setattr(pair, stage, lambda *a, _s=stage, **k: calls.append((_s, a, k)))
    monkeypatch.chdir(tmp_path)
    chain = pair.rebuild_steps(True, "draft-gen")
    steps = [s.strip(" `") for s in chain.split(",")]
    for step in steps:
        assert pair.main([*step.split(), "--workdir", "W"]) == 0, step
    got = {name: (a, k) for name, a, k in calls}
    A, B = pathlib.Path("A"), pathlib.Path("B")
    assert got["stage_target_long"][0][2] == A / "code-target"
    assert got["stage_draft_long"][0][2] == A / "code-draft"
    assert got["stage_draft_gen"][0][2] == B / "code-draft"
    assert got["stage_draft_gen"][1]["target_folder"] == B / "code-target"
    exports = [(a[1], k) for name, a, k in calls if name == "stage_export"]
    assert [out for out, _ in exports] == [A, B, pathlib.Path("C")]
    assert exports[-1][1]["shipped"]["target-long"] == B / "code-target"
    assert [name for name, _, _ in calls] == [
        "stage_data", "stage_target", "stage_draft", "stage_export", "stage_target_long",
        "stage_draft_long", "stage_export", "stage_draft_gen", "stage_export"]


def test_train_pair_refuses_bad_settings_by_flag(tmp_path, monkeypatch, capsys):
    """`specjax train pair`: a negative --minutes, conflicting export flags and a missing
    corpus are one-line errors (exit 2) before anything runs; --minutes 0 is a limit of zero
    (stop after the first step), not "no limit"."""
    from specjax.train import pair
    for argv, message in ((["target", "--minutes", "-1"], "--minutes must be >= 0"),
                          (["export", "--long", "--gen"], "export takes one of --long, --gen"),
                          (["export", "--draft-from", "x"], "--draft-from is for export --gen"),
                          (["data", "--corpus", str(tmp_path / "none")], "--corpus: "),
                          # flags a stage does not read (export --from without --gen exported
                          # the work directory's own runs without a word)
                          (["export", "--from", "x"], "--from is not read by stage 'export' "
                                                      "(export reads --from with --gen"),
                          (["target", "--teacher", "x"], "--teacher is not read by stage "
                                                         "'target'"),
                          (["draft", "--corpus", "x"], "--corpus is not read by stage 'draft'"),
                          (["data", "--long"], "--long is not read by stage 'data'")):
        with pytest.raises(SystemExit) as e:
            pair.main([*argv, "--workdir", str(tmp_path / "W")])
        assert e.value.code == 2 and message in capsys.readouterr().err, argv
    calls = []
    monkeypatch.setattr(pair, "train", lambda *a, **k: calls.append(k) or (
        None, [{"heldout_loss": 1.0, "step": 1}]))
    monkeypatch.setattr(pair, "_tokens", lambda workdir, stage="data": (None, None))
    for minutes, limit in (("0", 0), ("1.5", 90)):
        assert pair.main(["target", "--minutes", minutes, "--workdir", str(tmp_path / "W")]) == 0
        assert calls.pop()["max_seconds"] == limit
    assert pair.main(["target", "--workdir", str(tmp_path / "W")]) == 0
    assert calls.pop()["max_seconds"] is None


def test_generated_text_resumes_after_a_crash_between_a_chunk_and_its_time(tmp_path,
                                                                           monkeypatch):
    """A crash after a chunk of the target's text is written but before its time is appended
    (or halfway through that line): the resumed generation makes that chunk again, counts each
    chunk's seconds once, and the times file reads back whole."""
    from specjax.train import pair
    made = []

    def continuations(target, stream, i, lengths=None):
        made.append(i)
        return np.full((2, 3), i, np.int32), 25.0
    monkeypatch.setattr(pair, "_continuations", continuations)
    rows = pair._generated_text(tmp_path, None, None, minutes=1)  # 25 s a chunk: 3 chunks
    assert made == [0, 1, 2] and rows.shape == (6, 3)
    lines = (tmp_path / "times.jsonl").read_text().splitlines()
    (tmp_path / "times.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:9])  # torn
    made.clear()
    rows = pair._generated_text(tmp_path, None, None, minutes=1)
    assert made == [2] and rows.shape == (6, 3) and (rows[-2:] == 2).all()
    made.clear()
    rows = pair._generated_text(tmp_path, None, None, minutes=1.5)  # 90 s: one more chunk
    assert made == [3] and rows.shape == (8, 3)


@pytest.mark.parametrize("field,value,message", [
    ("grad_clip", -1.0, "grad_clip must be a finite number > 0"),  # trained uphill (loss 16.7)
    ("grad_clip", 0.0, "grad_clip must be a finite number > 0"),  # never learned (ln V)
    ("learning_rate", float("nan"), "learning_rate must be a finite number > 0"),
    ("warmup_steps", -1, "warmup_steps must be an int >= 0"),
    ("min_lr_ratio", 1.5, "min_lr_ratio must be in \\[0, 1\\]"),
    ("weight_decay", -0.1, "weight_decay must be a finite number >= 0"),
    ("distill_temperature", 0.0, "distill_temperature must be a finite number > 0"),
    ("seed", -1, "seed must be an int >= 0"),  # was numpy's "expected non-negative integer"
    ("steps", 10.5, "steps must be an int >= 1"),
])
def test_train_config_names_a_bad_number(field, value, message):
    with pytest.raises(ValueError, match=f"TrainConfig.{message}"):
        settings(4, **{field: value}) if field != "steps" else train.TrainConfig(steps=value)


def test_streams_are_checked_before_anything_is_written(tmp_path):
    """Ids past the vocabulary (they trained every parameter to NaN and checkpointed it), a
    held-out stream too short for a window (found only at the first evaluation, eval_every
    steps in) and a seq_len past the model's context: named errors, and no run.json."""
    tokens = stream()
    wrong = tokens.copy()
    wrong[7] = CFG.vocab_size + 6
    cases = [(dict(tokens=wrong), "token stream holds token ids 1..38, outside the model's "
                                  "vocabulary \\[0, 32\\)"),
             (dict(heldout=tokens[:17]), "held-out stream of 17 tokens is shorter than "
                                        "seq_len \\+ 2 = 18"),
             (dict(cfg=settings(4, seq_len=CFG.max_position_embeddings + 1)),
              "seq_len=65 is longer than the model's context")]
    for kw, message in cases:
        kw = {"tokens": tokens, "cfg": settings(4), **kw}
        with pytest.raises(ValueError, match=message):
            train.train(CFG, kw.pop("tokens"), kw.pop("cfg"), tmp_path, progress=False, **kw)
        assert not (tmp_path / "run.json").exists()


def test_a_run_that_failed_before_its_first_checkpoint_may_start_again(tmp_path, monkeypatch):
    """run.json records the settings before the first step; a run that failed before any
    checkpoint (out of memory, a bad batch size) holds nothing to resume, so other settings
    start afresh there (they were refused as "a run with other settings")."""
    def out_of_memory(*_):
        raise MemoryError("no room for this batch")
    with monkeypatch.context() as m:
        m.setattr(train.loop, "_step", out_of_memory)
        with pytest.raises(MemoryError):
            train.train(CFG, stream(), settings(4, batch_size=64), tmp_path, progress=False)
    assert (tmp_path / "run.json").exists()
    train.train(CFG, stream(), settings(4), tmp_path, progress=False)
    assert json.loads((tmp_path / "run.json").read_text())["train"]["batch_size"] == 4
    with pytest.raises(ValueError, match="other settings"):  # now it holds checkpoints
        train.train(CFG, stream(), settings(4, batch_size=8), tmp_path, progress=False)


def test_a_diverged_run_keeps_its_last_good_checkpoint(tmp_path, monkeypatch):
    """A loss that turns NaN stops the run at its next checkpoint with a named error, and the
    checkpoint before it stays the latest (a NaN state was saved and resumed from)."""
    real_step, taken = train.loop._step, []

    def diverging(*args):  # NaN from the fourth step on
        state, loss = real_step(*args)
        taken.append(1)
        return state, loss * (np.nan if len(taken) > 3 else 1.0)
    monkeypatch.setattr(train.loop, "_step", diverging)
    with pytest.raises(FloatingPointError, match="loss is nan at step 6; .* keeps its last "
                                                 "checkpoint \\(step 3\\)"):
        train.train(CFG, stream(), settings(9), tmp_path, progress=False)
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()
                  if p.name.isdigit()) == [3]


def test_loss_by_position_names_a_bad_count():
    """windows=-1 dropped the last window without a word (a slice), windows=0 blamed the
    stream's length, batch_size=0 failed inside range()."""
    model = sj.init_model(CFG, jax.random.key(0))
    tokens = stream(n=400)
    assert train.loop.loss_by_position(model, tokens, windows=2)["windows"] == 2
    for kw, message in [(dict(windows=-1), "windows must be an int >= 1, got -1"),
                        (dict(windows=0), "windows must be an int >= 1, got 0"),
                        (dict(batch_size=0), "batch_size must be an int >= 1, got 0")]:
        with pytest.raises(ValueError, match=message):
            train.loop.loss_by_position(model, tokens, **kw)


def test_a_stage_refuses_a_model_of_another_tokenizer(tmp_path):
    """A stage that continues or distils from a model folder (the bundled ones by default)
    refuses one whose tokenizer is not the work directory's: its ids meant other text than the
    token streams (a work directory built with `data --corpus` has its own 8,192 tokens)."""
    from specjax.train import pair
    work, other = tmp_path / "work", tmp_path / "other"
    (work / "tokenizer").mkdir(parents=True)
    other.mkdir()
    model = {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []}
    (work / "tokenizer" / "tokenizer.json").write_text(json.dumps({"model": model}))
    (other / "tokenizer.json").write_text(json.dumps({"model": {**model, "vocab": {"b": 0,
                                                                                   "a": 1}}}))
    with pytest.raises(SystemExit, match="the target in .*other reads another tokenizer"):
        pair._same_tokenizer(other, work, "target")
    with pytest.raises(SystemExit, match="reads another tokenizer"):  # before any training
        pair.stage_target_long(work, None, other, CFG, settings(2))
    (other / "tokenizer.json").write_text(json.dumps({"model": model, "added_tokens": []}))
    pair._same_tokenizer(other, work, "target")  # the same tokens
    (other / "tokenizer.json").unlink()
    pair._same_tokenizer(other, work, "draft")  # a draft sharing its target's: nothing to check


def test_exporting_the_soft_draft_again_describes_the_same_history(tmp_path, monkeypatch):
    """export-bpe4k-soft writes over the folder it started from. Run again (after an
    interrupted export, a resumed run), it read its own earlier record: the card told the
    token-level distillation twice and gave the improved acceptance (0.6016) as the one before
    it (0.5264). Shown on the shipped folder's record, the measuring stubbed out."""
    from specjax.draft.draft_model import VOCAB_FILE
    from specjax.train import pair
    shipped = sj.bundle.bundled("code-draft-bpe4k")
    dest = tmp_path / "out" / "code-draft-bpe4k"
    dest.mkdir(parents=True)
    for name in ("training.json", "tokenizer.json", VOCAB_FILE):
        shutil.copy(shipped / name, dest / name)
    run = tmp_path / "W" / "draft-bpe4k-soft"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"start": str(dest), "generated_share": 0.5,
                                              "generated_rows": 5056, "draft_len": 64}))
    (tmp_path / "W" / "bpe4k").mkdir()
    np.save(tmp_path / "W" / "bpe4k" / "heldout.npy", np.zeros(8, np.uint16))
    tiny = tiny_model(seed=1)
    monkeypatch.setattr(pair, "_restore", lambda *a: (tiny, 600))
    told = []

    def describe(where, workdir, out, heldout, config, settings, step, note, vocab, extra):
        told.append((note, extra["soft_labels"]))
        record = json.loads((dest / "training.json").read_text())
        record.update({"fine_tuned_on_target_text": note.removeprefix("; then "),
                       "acceptance": {"greedy": {"acceptance_rate": 0.99}}, **extra})
        (where / "training.json").write_text(json.dumps(record))
    monkeypatch.setattr(pair, "_describe_bpe4k", describe)
    for _ in range(2):
        pair.stage_export_bpe4k_soft(tmp_path / "W", tmp_path / "out")
    (first, first_soft), (second, second_soft) = told
    assert first == second and second.count("token-level distillation") == 1
    assert first_soft["acceptance_before"]["greedy"]["acceptance_rate"] == 0.5264
    assert second_soft["acceptance_before"] == first_soft["acceptance_before"]
    assert second_soft["fine_tuned_before"].startswith("fine-tuned 800 steps")


def test_export_refuses_a_corpus_too_small_to_calibrate_on_before_measuring(tmp_path,
                                                                           monkeypatch):
    """The draft's calibration needs held-out function definitions; a small --corpus had too
    few, and export failed on it only after minutes of measuring (loss, acceptance), every
    time (no flag lowers the count)."""
    from specjax.train import pair
    work = tmp_path / "W"
    (work / "tokenizer").mkdir(parents=True)
    shutil.copy(sj.bundle.bundled("code-target") / "tokenizer.json", work / "tokenizer")
    for name in ("train.npy", "heldout.npy"):
        np.save(work / name, np.zeros(64, np.uint16))
    (tmp_path / "a.py").write_text("x = 1\n" * 40)
    (work / "corpus.json").write_text(json.dumps({"root": str(tmp_path), "heldout": ["a.py"]}))

    def measuring(*_):
        raise AssertionError("measuring began")
    monkeypatch.setattr(pair, "_restore", measuring)
    with pytest.raises(SystemExit, match="export fits the draft's calibration on held-out "
                                         "function definitions: the texts have 0 function"):
        pair.stage_export(work, tmp_path / "out")


def test_export_names_a_run_trained_with_other_settings(tmp_path):
    """A run trained with other shapes or settings than the stage exports: the fields named
    (it failed inside orbax: "Requested shape ... is not compatible with the stored shape")."""
    from specjax.train import pair
    train.train(CFG, stream(), settings(2), tmp_path / "run", progress=False)
    model, step = pair._restore(CFG, settings(2), tmp_path / "run")
    assert step == 2
    wider = dataclasses.replace(CFG, hidden_size=32, head_dim=None)
    with pytest.raises(SystemExit, match="trained with other settings than this stage "
                                         "exports \\(model.head_dim, model.hidden_size, "
                                         "train.steps\\)"):
        pair._restore(wider, settings(3), tmp_path / "run")
