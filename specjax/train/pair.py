"""Build the bundled target/draft pair, in resumable stages.

    specjax train pair data   --workdir W            corpus split, tokenizer, token streams
    specjax train pair target --workdir W [--minutes M]   train (or continue) the target
    specjax train pair target-long --workdir W [--from FOLDER] [--minutes M]
        continue the target (default: the bundled one) on sequences as long as its context
    specjax train pair draft  --workdir W [--minutes M]   distil the draft from the target
    specjax train pair draft-long --workdir W [--from FOLDER] [--minutes M]
        distil the draft (default: from the bundled one) again from target-long, at its lengths
    specjax train pair draft-gen --workdir W [--from FOLDER] [--teacher FOLDER] [--minutes M]
        distil the draft (default: from the bundled one) again from the target (--teacher,
        default the bundled one), on its training windows and on text the target wrote
        (generated first, into W/draft-gen-text)
    specjax train pair draft-gen-long ...   the same on rows as long as the context
    specjax train pair export --workdir W --out checkpoints/ [--long | --gen | --gen-long]
        write the two model folders (--long: from target-long and draft-long; --gen: the
        target (--from, default the bundled one) again and draft-gen, or --draft-from FOLDER)
    specjax train pair draft-bpe4k --workdir W [--minutes M]   a draft of the bundled draft's
        size with a tokenizer of its own (4,096-token BPE), trained on the same files
    specjax train pair draft-bpe4k-kd --workdir W [--teacher FOLDER] [--minutes M]   fine-tune
        it on text the target writes (generated first, ten minutes of it, kept in W/bpe4k/kd)
    specjax train pair export-bpe4k --workdir W --out checkpoints/   write it as code-draft-bpe4k
    specjax train pair draft-bpe4k-soft --workdir W [--from FOLDER] [--teacher FOLDER]
        distil it token by token from the target where the two tokenizers cut the text alike
    specjax train pair export-bpe4k-soft --workdir W --out checkpoints/   write that one

Each stage reads what the earlier ones left in the work directory, and refuses flags it does
not read; the training stages resume from their latest checkpoint, so a run can be stopped
and resumed any number of times. A stage that starts from or distils from a model folder
refuses one whose tokenizer is not the work directory's. The exact settings are the constants
in specjax/train/pair.py; ``data`` records the corpus manifest next to the tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import pathlib

import numpy as np

from ..config import ModelConfig
from .data import encode_files, python_corpus, save_npy, train_tokenizer, write_manifest
from .loop import (
    POSITION_BINS,
    TrainConfig,
    configure_logging,
    eval_log,
    evaluate,
    loss_by_position,
    train,
)

VOCAB_SIZE = 8192
# Sizes chosen for this 2-core CPU: a 32M target trained at 550 tokens/s here, too slow to train
# well in a few hours; this 15.7M one trains at about 1.4k tokens/s (measured in the log).
TARGET = ModelConfig(vocab_size=VOCAB_SIZE, hidden_size=384, intermediate_size=1024,
                     num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                     max_position_embeddings=1024)
DRAFT = ModelConfig(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=384,
                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    max_position_embeddings=1024)
# The target's schedule was first set to 8000 steps; at step 825 (after two resumed runs) it was
# cut to 1800 so that the cosine decay completes within the next run (run.json edited to match).
TARGET_TRAINING = TrainConfig(steps=1800, batch_size=16, seq_len=256, learning_rate=1e-3,
                              warmup_steps=200, checkpoint_every=25, eval_every=200, seed=0)
SCHEDULE_NOTES = {"target": " (the schedule was first set for 8000 steps and cut to 1800 at "
                             "step 825, so the learning rate dropped from 9.9e-4 to 7.0e-4 there)",
                  "draft": " (the schedule was first set for 1200 steps and extended to 2400 at "
                            "step 1200, so the learning rate rose from 2.0e-4 back to 1.2e-3 "
                            "there)",
                  "target-long": "; continued from the target trained 1800 steps on 16 x 256 "
                                 "tokens (7.4M tokens, peak lr 0.001, `specjax train pair "
                                 "target`), with a fresh optimizer state",
                  "draft-long": "; continued from the draft distilled 2400 steps on 16 x 256 "
                                "tokens (9.8M tokens, peak lr 0.002, `specjax train pair draft`), "
                                "with a fresh optimizer state"}
DRAFT_TRAINING = TrainConfig(steps=2400, batch_size=16, seq_len=256, learning_rate=2e-3,
                             warmup_steps=100, checkpoint_every=25, eval_every=200, seed=1,
                             distill_ce_weight=0.1)
# Issue 24: the shipped target was trained on 256-token sequences only. Its training continues
# from the shipped weights on sequences as long as its context, into workdir/target-long
# (`specjax train pair target-long`, resumable; a fresh optimizer state, so a warm-up again).
# A first run at peak 5e-4 for 3000 steps had its loss at positions 0-256 worse than the shipped
# model's after 342 steps (3.29 against 3.19) while later positions fell below it; this schedule
# is short enough to finish in one session and peaks lower, near where the shipped run ended.
TARGET_LONG_TRAINING = TrainConfig(steps=600, batch_size=4, seq_len=1024, learning_rate=3e-4,
                                   warmup_steps=50, checkpoint_every=25, eval_every=200,
                                   eval_batches=4, seed=2)
# The draft is then distilled again from that target at the same lengths, continuing from the
# shipped draft (`specjax train pair draft-long`, into workdir/draft-long).
DRAFT_LONG_TRAINING = TrainConfig(steps=300, batch_size=4, seq_len=1024, learning_rate=5e-4,
                                  warmup_steps=30, checkpoint_every=25, eval_every=100,
                                  eval_batches=4, seed=3, distill_ce_weight=0.1)
LONG_RUNS = (("target-long", TARGET, TARGET_LONG_TRAINING),
             ("draft-long", DRAFT, DRAFT_LONG_TRAINING))
"""What ``export --long`` writes as code-target and code-draft."""
# Issue 27: a draft with another tokenizer, to measure drafting across tokenizers on. A
# byte-level BPE of 4,096 tokens trained on the same training files, and a draft of the bundled
# draft's shape trained on them with the next-token loss (a teacher with another tokenizer gives
# no per-token targets to distil), at the long run's lengths.
BPE4K_VOCAB = 4096
DRAFT_BPE4K = dataclasses.replace(DRAFT, vocab_size=BPE4K_VOCAB)
DRAFT_BPE4K_TRAINING = TrainConfig(steps=4000, batch_size=8, seq_len=512, learning_rate=2e-3,
                                   warmup_steps=100, checkpoint_every=25, eval_every=250,
                                   eval_batches=4, seed=4)
# A data-trained draft agrees with the target less than a distilled one of the same loss per
# byte (acceptance 0.34 against code-draft's 0.49, greedy); with another tokenizer there are no
# per-token distributions to distil, so the draft is then fine-tuned on text the target wrote
# (sequence-level distillation): continuations of training-stream windows, half greedy, half
# sampled at T = 1 (`specjax train pair draft-bpe4k-kd`).
KD_PROMPT, KD_NEW, KD_BATCH = 64, 192, 64
DRAFT_BPE4K_KD_TRAINING = TrainConfig(steps=800, batch_size=16, seq_len=256, learning_rate=5e-4,
                                      warmup_steps=50, checkpoint_every=25, eval_every=200,
                                      eval_batches=4, seed=5)
# Then token by token at every target token's end (the draft reading each target token as its
# spelling, as the chain does): its distribution over its drafting vocabulary is trained
# towards the target's, restricted to the same tokens and renormalised
# (`specjax train pair draft-bpe4k-soft`, specjax/train/crossvocab.py). Sequences alone taught
# it the target's greedy choices (acceptance 0.338 -> 0.526) but not its distribution (T = 0.8:
# 0.283 -> 0.303, against code-draft's 0.407).
DRAFT_BPE4K_SOFT_TRAINING = TrainConfig(steps=600, batch_size=16, seq_len=256, learning_rate=3e-4,
                                        warmup_steps=30, checkpoint_every=25, eval_every=150,
                                        eval_batches=4, seed=6, distill_ce_weight=0.1)
SOFT_DRAFT_LEN = 320  # draft tokens read per window of seq_len target tokens (about 1.15 x)
# half of each soft-label batch is the target's own text (continuations of training windows,
# chunks of KD_BATCH, half greedy, half at T = 1), generated for this long first
SOFT_GENERATE_MINUTES, SOFT_GENERATED_SHARE = 5.0, 0.5
# Issue 18 / 24: the draft is then distilled again on the text it drafts for, the target's own:
# each batch is windows of the training stream at the full context (the long run's lengths) and
# continuations the target wrote of training windows (half greedy, half at T = 1; generated
# first, DRAFT_GEN_MINUTES, into workdir/draft-gen-text, resumable), every position scored
# against the bundled target's distribution (`specjax train pair draft-gen`, from the bundled
# draft, into workdir/draft-gen).
DRAFT_GEN_TRAINING = TrainConfig(steps=1200, batch_size=2, seq_len=1024, learning_rate=3e-4,
                                 warmup_steps=30, checkpoint_every=25, eval_every=200,
                                 eval_batches=4, seed=8, distill_ce_weight=0.1)
DRAFT_GEN_ROWS = 8  # generated rows (KD_PROMPT + KD_NEW tokens each) per batch, beside the windows
DRAFT_GEN_MINUTES = 6.0
# Issue 24, tried and not shipped: once more on the target's text at every position of the
# context: rows of DRAFT.max_position_embeddings tokens, prompts of 64, 320 or 576 training tokens
# continued by the target to the window's end (`long_rows`), beside one training window a step
# (`specjax train pair draft-gen-long`, from the draft-gen draft, into workdir/draft-gen-long). It
# drafted no better on held-out long prompts (experiments/results/2026-12-05-long-positions.md).
DRAFT_GEN_LONG_TRAINING = TrainConfig(steps=600, batch_size=1, seq_len=1024, learning_rate=2e-4,
                                      warmup_steps=30, checkpoint_every=25, eval_every=200,
                                      eval_batches=4, seed=9, distill_ce_weight=0.1)
DRAFT_GEN_LONG_ROWS = 3
DRAFT_GEN_LONG_MINUTES = 8.0
GEN_RUNS = (("target-long", TARGET, TARGET_LONG_TRAINING),
            ("draft-gen", DRAFT, DRAFT_GEN_TRAINING))
"""What ``export --gen`` writes: the shipped target again (read from its folder, the
target-long run's last step) and the draft distilled on the target's own text."""
GEN_LONG_RUNS = (GEN_RUNS[0], ("draft-gen-long", DRAFT, DRAFT_GEN_LONG_TRAINING))
"""What ``export --gen-long`` writes: the same, with the draft-gen-long draft."""
SCHEDULE_NOTES["draft-gen"] = (
    f" (and, in each step, {DRAFT_GEN_ROWS} rows of {KD_PROMPT + KD_NEW} tokens of the target's "
    "own text: its continuations of training windows, half greedy, half at T = 1); continued "
    "from the draft distilled 300 steps on 4 x 1024 tokens (`specjax train pair draft-long`) "
    "after 2400 steps on 16 x 256 (`specjax train pair draft`), with a fresh optimizer state")
SCHEDULE_NOTES["draft-gen-long"] = (
    f" (and, in each step, {DRAFT_GEN_LONG_ROWS} rows of {DRAFT.max_position_embeddings} tokens "
    "of the target's own text: training-file prompts of 64, 320 or 576 tokens continued by the "
    "target to the window's end, half greedy, half at T = 1); continued from the draft distilled "
    f"{DRAFT_GEN_TRAINING.steps} steps on the target's own text at positions 0-256 "
    "(`specjax train pair draft-gen`), itself from `draft-long` and `draft`, with a fresh "
    "optimizer state")
# The bundled draft drafts from the most frequent tokens of the training stream only (its LM
# head cut to these columns, `draft_vocab.npy`; see specjax/draft/vocab.py).
DRAFT_VOCAB_SIZE = 2048
# Export ships the draft attending to the latest DRAFT_WINDOW positions only (a Mistral-layout
# config): trained on whole 1,024-token windows, its held-out loss at positions 512-1024 is no
# worse with the window (3.420 full, 3.404 windowed), its drafts on held-out long windows are
# about 1% fewer (2.525 and 2.494 tokens a round greedy), and a draft step at 900 tokens of context
# costs about a quarter less (experiments/results/2026-12-05-draft-window.md).
DRAFT_WINDOW = 256

# How export fits the draft's calibration (adaptive lengths; `specjax train calibrate`'s
# settings): function-definition prompts from held-out files (calibration_prompts), the target's
# own text from them.
CALIBRATION = dict(num_prompts=256, max_new_tokens=128, temperature=0.8)

log = logging.getLogger(__name__)


def rebuild_steps(long: bool, gen: str | None) -> str:
    """The card's chain of stages that builds an exported pair from nothing: each stage that
    continues a model reads the export before it (A: target and draft; B: their -long
    continuations; C: the draft trained on the target's own text beside that target; D: that
    draft trained on again on rows that fill the context, ``gen`` "draft-gen-long")."""
    steps = ["`data`", "`target`", "`draft`", "`export --out A`"]
    if not long and gen is None:
        return ", ".join(steps)
    steps += ["`target-long --from A/code-target`", "`draft-long --from A/code-draft`",
              "`export --long --out B`"]
    if gen is None:
        return ", ".join(steps)
    steps += ["`draft-gen --from B/code-draft --teacher B/code-target`",
              "`export --gen --from B/code-target --out C`"]
    if gen == "draft-gen-long":
        steps += ["`draft-gen-long --from C/code-draft --teacher B/code-target`",
                  "`export --gen-long --from B/code-target --out D`"]
    return ", ".join(steps)


def stage_data(workdir: pathlib.Path, corpus_root: pathlib.Path | None = None,
               vocab_size: int = VOCAB_SIZE) -> None:
    corpus = python_corpus(corpus_root)
    tok = train_tokenizer(corpus.train, vocab_size, workdir / "tokenizer")
    train_tokens = encode_files(tok, corpus.train, workdir / "train.npy")
    heldout_tokens = encode_files(tok, corpus.heldout, workdir / "heldout.npy")
    write_manifest(corpus, workdir / "corpus.json", vocab_size=vocab_size,
                   train_tokens=int(train_tokens.size), heldout_tokens=int(heldout_tokens.size))
    print(f"corpus: {len(corpus.train)} train files ({train_tokens.size} tokens), "
          f"{len(corpus.heldout)} held-out files ({heldout_tokens.size} tokens) from {corpus.root}")


def _tokens(workdir: pathlib.Path, stage: str = "data") -> tuple[np.ndarray, np.ndarray]:
    """The token streams ``stage`` writes into ``workdir`` (the stage named if they are not
    there)."""
    if not (workdir / "train.npy").exists() or not (workdir / "heldout.npy").exists():
        raise SystemExit(f"{workdir} has no token streams: run `specjax train pair {stage}` "
                         f"first")
    return (np.load(workdir / "train.npy", mmap_mode="r"),
            np.load(workdir / "heldout.npy", mmap_mode="r"))


def _log_eval(workdir: pathlib.Path, name: str):
    return eval_log(workdir / f"{name}-evals.jsonl")


def stage_target(workdir: pathlib.Path, minutes: float | None, config: ModelConfig = TARGET,
                 settings: TrainConfig = TARGET_TRAINING, progress: bool = True) -> None:
    tokens, heldout = _tokens(workdir)
    model, history = train(config, tokens, settings, workdir / "target", heldout=heldout,
                           progress=progress,
                           on_eval=_log_eval(workdir, "target"),
                           max_seconds=None if minutes is None else minutes * 60)
    print(f"target: held-out loss {history[-1]['heldout_loss']:.4f} at step "
          f"{history[-1]['step']}")


def stage_target_long(workdir: pathlib.Path, minutes: float | None, start: pathlib.Path,
                      config: ModelConfig = TARGET, settings: TrainConfig = TARGET_LONG_TRAINING,
                      progress: bool = True) -> None:
    """Continue the target's training on sequences of ``settings.seq_len`` tokens from the model
    in the folder ``start`` (the shipped target: its stored weights, computed in float32), into
    workdir/target-long; resumes from its latest checkpoint there (``start`` is then unused)."""
    _same_tokenizer(start, workdir, "target")
    tokens, heldout = _tokens(workdir)
    init = _start(start, config, "target")
    model, history = train(config, tokens, settings, workdir / "target-long", heldout=heldout,
                           init=init, progress=progress, on_eval=_log_eval(workdir, "target-long"),
                           max_seconds=None if minutes is None else minutes * 60)
    print(f"target-long: held-out loss {history[-1]['heldout_loss']:.4f} at step "
          f"{history[-1]['step']} (sequences of {settings.seq_len})")


def _same_tokenizer(folder: pathlib.Path, workdir: pathlib.Path, role: str) -> None:
    """Refuse a model folder whose tokenizer.json is not the work directory's (from ``data``):
    its ids would mean other text than the token streams a stage trains or generates on (a
    pair built with ``data --corpus``, or from another Python's standard library, has its own
    8,192 tokens). A folder without tokenizer.json (a draft sharing its target's) passes."""
    mine, theirs = workdir / "tokenizer" / "tokenizer.json", pathlib.Path(folder) / "tokenizer.json"
    if not theirs.is_file() or not mine.is_file():
        return
    if json.loads(mine.read_text()).get("model") != json.loads(theirs.read_text()).get("model"):
        raise SystemExit(f"the {role} in {folder} reads another tokenizer ({theirs}) than this "
                         f"work directory's token streams ({mine}): train it from scratch here, "
                         f"or build the work directory from the same corpus")


def _start(folder: pathlib.Path, config: ModelConfig, role: str):
    """The model in ``folder`` in float32 as ``config`` computes it (a draft's attention window,
    set at export, dropped: stages train on whole windows), refused unless it has the shape
    ``config`` trains."""
    from ..checkpoint import load_model
    from ..model import Model
    init = load_model(folder, dtype="float32")
    found = dataclasses.replace(init.config, dtype=config.dtype)
    if role.startswith("draft") and found.layer_types is None:
        found = dataclasses.replace(found, sliding_window=config.sliding_window)
    if found != config:
        raise SystemExit(f"{folder} holds another model than the {role} this stage trains "
                         f"({init.config} against {config})")
    return Model(dataclasses.replace(config, dtype=init.config.dtype), init.params)


def _restore(config: ModelConfig, settings: TrainConfig, run: pathlib.Path):
    import jax
    import jax.numpy as jnp

    from ..model import Model, init_model
    from .loop import TrainState, _differences, _manager, optimizer
    record = run / "run.json"
    if record.is_file():  # trained with other settings: named here, not by orbax's shapes
        old = json.loads(record.read_text())
        changed = (_differences(old.get("model"), json.loads(json.dumps(
            dataclasses.asdict(config))), "model.")
                   + _differences(old.get("train"), json.loads(json.dumps(
                       dataclasses.asdict(settings))), "train."))
        if changed:
            raise SystemExit(f"{run} was trained with other settings than this stage exports "
                             f"({', '.join(changed)})")
    ocp, manager = _manager(run)
    step = manager.latest_step()
    if step is None:
        raise SystemExit(f"no checkpoint in {run}")
    params = init_model(config, jax.random.key(0)).params
    state = TrainState(params, optimizer(settings).init(params), jnp.zeros((), jnp.int32))
    state = manager.restore(step, args=ocp.args.StandardRestore(state))
    manager.close()
    return Model(config, state.params), step


def stage_draft(workdir: pathlib.Path, minutes: float | None, config: ModelConfig = DRAFT,
                settings: TrainConfig = DRAFT_TRAINING, target: ModelConfig = TARGET,
                target_settings: TrainConfig = TARGET_TRAINING, progress: bool = True,
                teacher_run: str = "target", run: str = "draft",
                start: pathlib.Path | None = None) -> None:
    """Distil the draft from the target trained in workdir/``teacher_run`` into workdir/``run``,
    from scratch or, with ``start``, from the model in that folder (computed in float32; unused
    once the run has a checkpoint to resume from)."""
    tokens, heldout = _tokens(workdir)
    teacher, step = _restore(target, target_settings, workdir / teacher_run)
    init = None if start is None else _start(start, config, "draft")
    print(f"distilling from {teacher_run} at step {step}")
    model, history = train(config, tokens, settings, workdir / run, heldout=heldout,
                           teacher=teacher, init=init, progress=progress,
                           on_eval=_log_eval(workdir, run),
                           max_seconds=None if minutes is None else minutes * 60)
    print(f"{run}: held-out loss {history[-1]['heldout_loss']:.4f} at step "
          f"{history[-1]['step']}")


def stage_draft_long(workdir: pathlib.Path, minutes: float | None, start: pathlib.Path,
                     progress: bool = True) -> None:
    """Distil the draft again from target-long at its sequence length, from ``start``."""
    stage_draft(workdir, minutes, DRAFT, DRAFT_LONG_TRAINING, TARGET, TARGET_LONG_TRAINING,
                progress=progress, teacher_run="target-long", run="draft-long", start=start)


def stage_draft_gen(workdir: pathlib.Path, minutes: float | None, start: pathlib.Path,
                    target_folder: pathlib.Path | None = None, config: ModelConfig = DRAFT,
                    settings: TrainConfig = DRAFT_GEN_TRAINING, rows: int = DRAFT_GEN_ROWS,
                    generate_minutes: float = DRAFT_GEN_MINUTES, progress: bool = True,
                    run_name: str = "draft-gen", lengths=None) -> None:
    """Distil the draft in ``start`` again from the target in ``target_folder`` (default the
    bundled one), on batches of ``settings.batch_size`` training windows of
    ``settings.seq_len`` tokens and ``rows`` of the target's own continuations of training
    windows (``_generated_text`` with ``lengths``, generated first into
    workdir/``run_name``-text), into workdir/``run_name`` (resumable; computed in float32)."""
    from ..bundle import bundled
    from ..checkpoint import load_model
    from ..model import Model
    from .data import sample_batch, sample_rows
    from .loop import MixedDistillObjective, digest, fit, teacher_record
    target_folder = target_folder or bundled("code-target")
    _same_tokenizer(target_folder, workdir, "target (--teacher)")
    teacher = load_model(target_folder, dtype="float32")
    init = _start(start, config, "draft")
    if init.config.vocab_size != teacher.config.vocab_size:
        raise SystemExit(f"{start} has a vocabulary of {init.config.vocab_size}, the target "
                         f"{target_folder} one of {teacher.config.vocab_size}")
    tokens, heldout = _tokens(workdir)
    generated = _generated_text(workdir / f"{run_name}-text", teacher, tokens, generate_minutes,
                                lengths)
    s = settings

    def batches(step):
        return (sample_batch(tokens, s.batch_size, s.seq_len, s.seed, step),
                sample_rows(generated, rows, s.seed, step))

    def evaluate_fn(params):
        return evaluate(Model(config, params), heldout, s.eval_batches, 4, s.seq_len)

    objective = MixedDistillObjective(config, teacher.config, s.distill_temperature,
                                      s.distill_ce_weight)
    run = {"model": dataclasses.asdict(config), "train": dataclasses.asdict(s),
           **teacher_record(teacher), "teacher_folder": str(target_folder),
           "start": str(start), "generated_rows": rows, "generated_total": len(generated),
           "data": digest(tokens, generated)}
    params, history = fit(objective, init.params, teacher.params, None, s, workdir / run_name,
                          run, evaluate_fn=evaluate_fn, progress=progress,
                          on_eval=_log_eval(workdir, run_name),
                          max_seconds=None if minutes is None else minutes * 60, batches=batches)
    print(f"{run_name}: held-out loss {history[-1]['heldout_loss']:.4f} at step "
          f"{history[-1]['step']} ({len(generated)} rows of the target's text)")


def stage_draft_bpe4k(workdir: pathlib.Path, minutes: float | None,
                      config: ModelConfig = DRAFT_BPE4K,
                      settings: TrainConfig = DRAFT_BPE4K_TRAINING, progress: bool = True) -> None:
    """Train the draft's tokenizer (``config.vocab_size`` tokens) on the training files of
    ``data``'s manifest (once), encode them into workdir/bpe4k, and train (or continue) the
    draft on them into workdir/draft-bpe4k."""
    folder = workdir / "bpe4k"
    if not (folder / "heldout.npy").exists():
        if not (workdir / "corpus.json").is_file():
            raise SystemExit(f"{workdir} has no corpus.json: run `specjax train pair data` "
                             f"first")
        corpus = python_corpus(json.loads((workdir / "corpus.json").read_text())["root"])
        tok = train_tokenizer(corpus.train, config.vocab_size, folder / "tokenizer")
        encode_files(tok, corpus.train, folder / "train.npy")
        encode_files(tok, corpus.heldout, folder / "heldout.npy")
    tokens, heldout = _tokens(folder, "draft-bpe4k")
    model, history = train(config, tokens, settings, workdir / "draft-bpe4k",
                           heldout=heldout, progress=progress,
                           on_eval=_log_eval(workdir, "draft-bpe4k"),
                           max_seconds=None if minutes is None else minutes * 60)
    print(f"draft-bpe4k: held-out loss {history[-1]['heldout_loss']:.4f} (its own tokens) at "
          f"step {history[-1]['step']}")


def _continuations(target, stream: np.ndarray, i: int,
                   lengths: tuple[int, int] | None = None) -> tuple[np.ndarray, float]:
    """Chunk ``i`` of the target's own text: KD_BATCH windows of ``stream`` (a pure function of
    ``i``) continued by the target, greedy for even ``i``, at T = 1 for odd: (target ids
    [KD_BATCH, prompt + new], seconds it took). ``lengths`` is (prompt, new), default
    (KD_PROMPT, KD_NEW) cut to the target's context."""
    import time

    from ..config import SamplingParams
    from ..engine import generate
    if lengths is None:
        context = target.config.max_position_embeddings  # a small one cuts both
        n = min(KD_PROMPT, context // 4)
        lengths = (n, min(KD_NEW, context - n))
    n, new = lengths
    rng = np.random.default_rng([7, i])
    starts = rng.integers(0, len(stream) - n, KD_BATCH)
    prompts = np.stack([np.asarray(stream[s:s + n], np.int64) for s in starts])
    began = time.perf_counter()
    out = generate(target, prompts.tolist(), key=i, sampling=SamplingParams(
        temperature=0.0 if i % 2 == 0 else 1.0, max_new_tokens=new))
    tokens = np.asarray(out.tokens)[:, :new]  # no end-of-text token: every row runs ``new`` long
    return np.concatenate([prompts, tokens], 1), time.perf_counter() - began


def long_rows(context: int, prompts: tuple[int, ...] = (64, 320, 576)):
    """Row lengths for ``_generated_text`` that fill the whole ``context``: chunk i's prompt is
    ``prompts[(i // 2) % len(prompts)]`` tokens (a greedy and a sampled chunk each), continued to
    the context's end, so the target's own text covers every position from the shortest prompt on."""
    def lengths(i: int) -> tuple[int, int]:
        n = prompts[(i // 2) % len(prompts)]
        return n, context - n
    return lengths


def stage_draft_bpe4k_kd(workdir: pathlib.Path, minutes: float | None,
                         generate_minutes: float = 10.0, config: ModelConfig = DRAFT_BPE4K,
                         settings: TrainConfig = DRAFT_BPE4K_KD_TRAINING,
                         start_settings: TrainConfig = DRAFT_BPE4K_TRAINING,
                         target_folder: pathlib.Path | None = None,
                         progress: bool = True) -> None:
    """Sequence-level distillation of the draft with its own tokenizer: while there is less
    than ``generate_minutes`` of generation in workdir/bpe4k/kd (chunks of KD_BATCH
    continuations, each chunk a file, so it resumes), the target (``target_folder``, default the
    bundled one) continues training-stream windows; the text is encoded with the draft's
    tokenizer, and the draft from workdir/draft-bpe4k is fine-tuned on it into
    workdir/draft-bpe4k-kd (resumable)."""
    from ..bundle import bundled
    from ..checkpoint import load_model
    from ..tokenizer import load_tokenizer
    folder = workdir / "bpe4k"
    kd = folder / "kd"
    kd.mkdir(parents=True, exist_ok=True)
    target_folder = target_folder or bundled("code-target")
    _same_tokenizer(target_folder, workdir, "target (--teacher)")
    chunks = sorted(kd.glob("chunk-*.npy"))
    spent = sum(float(np.load(c, mmap_mode="r")[0]) for c in chunks)  # seconds, stored first
    if spent < generate_minutes * 60:
        target = load_model(target_folder)
        tok = load_tokenizer(target_folder)
        own = load_tokenizer(folder / "tokenizer")
        stream = np.load(workdir / "train.npy", mmap_mode="r")
        while spent < generate_minutes * 60:
            i = len(chunks)
            rows, seconds = _continuations(target, stream, i)
            ids = []
            for row in rows:
                ids += own.encode(tok.decode(row.tolist()), add_special_tokens=False) + [0]
            spent += seconds
            path = kd / f"chunk-{i:05d}.npy"
            save_npy(path, np.concatenate([[seconds], ids]).astype(np.float64))
            chunks.append(path)
            log.info("kd chunk %d: %d tokens, %.0f s of %.0f", i, len(ids), spent,
                     generate_minutes * 60)
    tokens = np.concatenate([np.load(c)[1:] for c in chunks]).astype(np.uint16)
    _, heldout = _tokens(folder, "draft-bpe4k")
    init, _ = _restore(config, start_settings, workdir / "draft-bpe4k")
    model, history = train(config, tokens, settings, workdir / "draft-bpe4k-kd", heldout=heldout,
                           init=init, progress=progress,
                           on_eval=_log_eval(workdir, "draft-bpe4k-kd"),
                           max_seconds=None if minutes is None else minutes * 60)
    print(f"draft-bpe4k-kd: {len(tokens)} tokens of the target's text; held-out loss "
          f"{history[-1]['heldout_loss']:.4f} at step {history[-1]['step']}")


def _generated_text(folder: pathlib.Path, target, stream: np.ndarray,
                    minutes: float, lengths=None) -> np.ndarray:
    """The target's continuations of ``stream`` windows (``_continuations``) as rows [n, L] of
    target ids, generated into ``folder`` (a file a chunk, its seconds in times.jsonl) until
    ``minutes`` of generation are there; resumes. ``lengths``, a function of the chunk's index
    giving (prompt, new) (``long_rows``), must give every chunk the same total."""
    folder.mkdir(parents=True, exist_ok=True)
    times = folder / "times.jsonl"
    recorded = {}  # chunk -> seconds; a line a crash cut short is skipped
    for line in (times.read_text().splitlines() if times.exists() else ()):
        try:
            record = json.loads(line)
            recorded[int(record["chunk"])] = float(record["seconds"])
        except (ValueError, KeyError, TypeError):
            continue
    # the chunks whose time was recorded; one written just before a crash, without its time, is
    # made again (so the generation's minutes count every chunk once)
    chunks = []
    while len(chunks) in recorded and (folder / f"chunk-{len(chunks):05d}.npy").is_file():
        chunks.append(folder / f"chunk-{len(chunks):05d}.npy")
    spent = sum(recorded[i] for i in range(len(chunks)))
    while spent < minutes * 60:
        i = len(chunks)
        rows, seconds = _continuations(target, stream, i, None if lengths is None else lengths(i))
        path = folder / f"chunk-{i:05d}.npy"
        save_npy(path, rows.astype(np.int32))
        cut = times.exists() and not times.read_bytes().endswith(b"\n") and times.stat().st_size
        with open(times, "a") as f:  # after a line a crash cut short, on a line of its own
            f.write(("\n" if cut else "") + json.dumps({"chunk": i, "seconds": seconds}) + "\n")
        spent += seconds
        chunks.append(path)
        log.info("target text chunk %d: %d rows, %.0f s of %.0f", i, len(rows), spent,
                 minutes * 60)
    return np.concatenate([np.load(c) for c in chunks])


def stage_draft_bpe4k_soft(workdir: pathlib.Path, minutes: float | None,
                           start: pathlib.Path, config: ModelConfig = DRAFT_BPE4K,
                           settings: TrainConfig = DRAFT_BPE4K_SOFT_TRAINING,
                           target_folder: pathlib.Path | None = None,
                           progress: bool = True) -> dict:
    """Distil the draft with its own tokenizer in ``start`` (a model folder with its
    tokenizer.json and draft_vocab.npy, as export-bpe4k writes it) token by token from the
    target (``target_folder``, default the bundled one) at the positions where the two cut the
    text alike (``crossvocab.SoftLabelObjective``), the draft reading each target token as its
    spelling as the chain does, into workdir/draft-bpe4k-soft (resumable). Each batch is
    windows of the target's training stream and, SOFT_GENERATED_SHARE of it, of the target's
    own continuations of training windows (the text it drafts for when the target writes;
    generated first, SOFT_GENERATE_MINUTES, into workdir/soft-gen, resumable). Returns the
    teacher-forced acceptance estimate (``crossvocab.expected_acceptance``) on held-out windows
    before and after."""
    import jax
    import jax.numpy as jnp

    from ..bundle import bundled
    from ..checkpoint import load_model
    from ..draft.draft_model import VOCAB_FILE, load_paired_draft
    from ..model import Model
    from ..tokenizer import load_tokenizer
    from . import crossvocab
    from .loop import digest, fit, teacher_record
    target_folder = target_folder or bundled("code-target")
    _same_tokenizer(target_folder, workdir, "target (--teacher)")
    teacher = load_model(target_folder, dtype="float32")
    target_tokenizer = load_tokenizer(target_folder)
    spelling = load_paired_draft(start, target_tokenizer, teacher.config.vocab_size).spelling
    aligner = crossvocab.Aligner(target_tokenizer, load_tokenizer(start),
                                 np.load(pathlib.Path(start) / VOCAB_FILE), np.asarray(spelling))
    init = _start(start, config, "draft with its own tokenizer")
    tokens, heldout = _tokens(workdir)
    generated = _generated_text(workdir / "soft-gen", teacher, tokens, SOFT_GENERATE_MINUTES)
    s = settings
    own = round(s.batch_size * SOFT_GENERATED_SHARE)

    def windows(stream, size, seed, step):
        return aligner.batch(stream, size, s.seq_len, SOFT_DRAFT_LEN, seed, step)

    def batches(step):
        parts = [windows(tokens, s.batch_size - own, s.seed, step),
                 windows(generated, own, s.seed + 1, step)]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    held = [windows(heldout, s.batch_size, 12345, i) for i in range(s.eval_batches)]
    objective = crossvocab.SoftLabelObjective(config, teacher.config, s.distill_ce_weight)
    aux = (teacher.params, jnp.asarray(aligner.draft_ids), jnp.asarray(aligner.target_of))
    step_loss = jax.jit(objective)

    def evaluate_fn(params):
        return float(np.mean([float(step_loss(params, jax.tree.map(jnp.asarray, b), aux))
                              for b in held]))

    def estimate(model):
        runs = [crossvocab.expected_acceptance(teacher, model, aligner, b) for b in held]
        return {k: round(float(np.mean([r[k] for r in runs])), 4) for k in runs[0]}

    before = estimate(init)
    run = {"model": dataclasses.asdict(config), "train": dataclasses.asdict(s),
           **teacher_record(teacher), "objective": "soft labels at "
           "aligned boundaries, the draft reading target tokens spelled", "start": str(start),
           "draft_len": SOFT_DRAFT_LEN, "generated_share": SOFT_GENERATED_SHARE,
           "generated_rows": len(generated), "data": digest(tokens, generated)}
    params, history = fit(objective, init.params, aux, None, s, workdir / "draft-bpe4k-soft",
                          run, evaluate_fn=evaluate_fn, progress=progress,
                          on_eval=_log_eval(workdir, "draft-bpe4k-soft"),
                          max_seconds=None if minutes is None else minutes * 60, batches=batches)
    after = estimate(Model(config, params))
    print(f"draft-bpe4k-soft: held-out objective {history[-1]['heldout_loss']:.4f} at step "
          f"{history[-1]['step']}; teacher-forced acceptance at aligned positions "
          f"{json.dumps(before)} -> {json.dumps(after)}")
    return {"before": before, "after": after}


def calibration_prompts(workdir: pathlib.Path, tokenizer, num_prompts: int) -> list[list[int]]:
    """What calibrations are fitted on (``specjax train calibrate``, export): prompts of 15 lines
    ending with a function definition, like a request to complete a function, cut from the
    held-out files that no shipped bench prompt set draws from (so the bench still scores the
    calibration on files it never saw), encoded."""
    from ..adaptive import definition_prompts
    from ..bench import PROMPT_SETS, load_prompts
    corpus = json.loads((workdir / "corpus.json").read_text())
    root = pathlib.Path(corpus["root"])
    benched = {p.get("source", "").removeprefix("Lib/") for name in PROMPT_SETS
               for p in load_prompts(name)}
    texts = [(root / f).read_text(encoding="utf-8", errors="replace")
             for f in corpus["heldout"] if f not in benched and (root / f).is_file()]
    return [tokenizer.encode(t) for t in definition_prompts(texts, num_prompts)]


def _fitted_prompts(target, draft, tokenizer, prompt_set: str, gamma: int, max_new_tokens: int
                    ) -> tuple[list[list[int]], int]:
    """A bench prompt set encoded, and the new-token count, fitted into the smaller model's
    context (a small model's context: each prompt keeps its end)."""
    from ..bench import load_prompts
    room = target.config.max_position_embeddings
    own = getattr(getattr(draft, "config", None), "max_position_embeddings", None)  # heads: none
    room = room if own is None else min(room, own)
    max_new_tokens = min(max_new_tokens, room // 4)
    keep = room - max_new_tokens - gamma - 1
    return [tokenizer.encode(p["text"])[-keep:] for p in load_prompts(prompt_set)], max_new_tokens


def measure_acceptance(target, draft, tokenizer, gamma: int = 4, max_new_tokens: int = 128
                       ) -> dict:
    """Acceptance of the draft against the target on the bench's held-out prompts, greedy and at
    T = 0.8 (all prompts in one batch: acceptance does not depend on batching)."""
    from ..config import SamplingParams, SpecConfig
    from ..engine import generate
    prompts, max_new_tokens = _fitted_prompts(target, draft, tokenizer, "short", gamma,
                                              max_new_tokens)
    spec = SpecConfig(method="draft_model", num_speculative_tokens=gamma)
    out = {}
    for name, temperature in [("greedy", 0.0), ("t0.8", 0.8)]:
        stats = generate(target, prompts, draft=draft, spec=spec, key=0, sampling=SamplingParams(
            temperature=temperature, max_new_tokens=max_new_tokens)).stats
        out[name] = {"gamma": gamma, "acceptance_rate": round(stats.acceptance_rate, 4),
                     "mean_accepted_length": round(stats.mean_accepted_length, 3),
                     "per_position_acceptance": [round(float(a), 3)
                                                 for a in stats.per_position_acceptance]}
    return out


def measure_long(target, draft, tokenizer, gamma: int = 4, max_new_tokens: int = 64,
                 method: str = "draft_model", out: list | None = None) -> dict:
    """The draft's greedy mean accepted length on the long bench prompts (``--prompts long``,
    300-900 tokens; each cut to its end where a small context needs it), overall and by the
    context position a round starts at (``Stats.accepted_length_by_position``). ``method``:
    the drafter's (a draft model, or heads as ``sj.load_heads`` gives them); ``out``: a list
    the Generation is appended to (its prompts: ``_fitted_prompts(..., "long", ...)``)."""
    from ..config import SamplingParams, SpecConfig
    from ..engine import generate
    prompts, max_new_tokens = _fitted_prompts(target, draft, tokenizer, "long", gamma,
                                              max_new_tokens)
    result = generate(target, prompts, draft=draft, key=0,
                      spec=SpecConfig(method=method, num_speculative_tokens=gamma),
                      sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
    if out is not None:
        out.append(result)
    stats = result.stats
    return {"gamma": gamma, "max_new_tokens": max_new_tokens,
            "mean_accepted_length": round(stats.mean_accepted_length, 3),
            "by_position": {f"{lo}-{'' if hi is None else hi}": round(m, 3)
                            for lo, hi, m, _ in stats.accepted_length_by_position}}


CARD = """# {folder}

The {role} of specjax's bundled speculative-decoding pair: a Llama-architecture decoder trained
from scratch on this machine (2-core CPU) on Python source code. {blurb}

| | |
| --- | --- |
| parameters | {params:,} ({params_m:.1f}M) |
| shape | hidden {hidden}, {layers} layers, {heads} heads ({kv} key/value heads), MLP {inter}, vocabulary {vocab}, context {ctx}{attends} |
| stored as | bfloat16 safetensors, Hugging Face `{layout}` layout (`sj.load_model` computes in float32 on CPU and in bfloat16 on GPU/TPU by default) |
| training | {steps} optimizer steps of {batch} sequences x {seq} tokens ({tokens:.1f}M tokens), AdamW, peak lr {lr}, cosine decay{distil}{note} |
| held-out loss | {loss:.3f} nats/token on held-out files (next-token cross-entropy, also for a distilled draft; 32 batches, stored bf16 weights) |
| context | trained on sequences of {seq} tokens, `max_position_embeddings` {ctx}; held-out loss by position in windows of {window} tokens: {by_position} |
| acceptance (draft vs target, γ = 4, bench prompts) | greedy {acc_g:.3f} (mean accepted length {len_g:.2f}); T = 0.8: {acc_t:.3f} ({len_t:.2f}) |
{long_row}{vocab_row}
**Data.** The CPython {python} standard library (`Lib/**/*.py`, site-packages excluded, files
over 200 kB dropped): {train_files} training files ({train_tokens:,} tokens) and {heldout_files}
held-out files ({heldout_tokens:,} tokens), split by a hash of each file's path
(`specjax/train/data.py`); the held-out file list is in `training.json`. Tokenizer: byte-level BPE,
{vocab} tokens, trained on the training files; token 0 `<|endoftext|>` ends a file and is the EOS.

**Rebuild.** {rebuild} (`specjax train pair STAGE --workdir W ...`; settings are the constants
in `specjax/train/pair.py`, and each training stage resumes from its checkpoints). Each stage
that continues a model reads the folder given with `--from` (and `--teacher`), by default the
bundled ones; `export` writes into `--out`. The shipped target's and draft's first schedules were
changed by hand during training (docs/training.md): the constants give the same settings, not
those changes.

It is a small model for benchmarks and demos: it writes plausible-looking Python, not correct
programs.
"""


def _attends(written: ModelConfig) -> str:
    """The card's words for an exported model's attention window (none without one)."""
    window = written.sliding_window
    return "" if window is None else (
        f"; it attends to the latest {window} positions only (a sliding window set at export, "
        "`pair.DRAFT_WINDOW`; trained attending to every position)")


def stage_export(workdir: pathlib.Path, out: pathlib.Path,
                 runs=(("target", TARGET, TARGET_TRAINING), ("draft", DRAFT, DRAFT_TRAINING)),
                 draft_vocab_size: int = DRAFT_VOCAB_SIZE, calibration: dict | None = None,
                 shipped: dict[str, pathlib.Path] | None = None,
                 draft_window: int | None = DRAFT_WINDOW) -> None:
    """Write the trained runs as model folders under ``out`` (code-target, code-draft) with
    their cards; with both, the draft's acceptance and its calibration for adaptive lengths
    (``calibration``: the fit's settings, default CALIBRATION). A run named in ``shipped`` is
    read from that model folder (as its run's last step) instead of its checkpoints. The draft
    is written attending to the latest ``draft_window`` positions (None, or a window as long as
    its context: all of them); every figure is measured as it is written."""
    import shutil
    calibration = calibration or CALIBRATION

    from ..checkpoint import _model_file, cast, hf_architecture, load_model, save_model
    from ..draft.draft_model import VOCAB_FILE, load_draft_model
    from ..draft.vocab import frequent_tokens
    from ..files import replace_folder
    from ..model import Model
    from ..tokenizer import load_tokenizer
    _, heldout = _tokens(workdir)
    corpus = json.loads((workdir / "corpus.json").read_text())
    prompts = None
    if {name.removesuffix("-long").removesuffix("-gen") for name, _, _ in runs} >= {
            "target", "draft"}:  # the calibration's prompts, before minutes of measuring
        try:
            prompts = calibration_prompts(workdir, load_tokenizer(workdir / "tokenizer"),
                                          calibration["num_prompts"])
        except ValueError as e:
            raise SystemExit(f"export fits the draft's calibration on held-out function "
                             f"definitions: {e}") from None
    info = {}
    # Each folder is written whole into a temporary sibling and swapped in at the end, so an
    # interrupted export leaves the earlier folders as they were (specjax/files.py).
    swaps = contextlib.ExitStack()
    with swaps:
        for name, config, settings in runs:
            role = name.removesuffix("-long").removesuffix("-gen")  # the folder it is shipped as
            if name in (shipped or {}):
                _same_tokenizer(shipped[name], workdir, role)
                model, step = _start(shipped[name], config, role), settings.steps
            else:
                model, step = _restore(config, settings, workdir / name)
            folder = out / f"code-{role}"
            if (role == "draft" and draft_window is not None
                    and draft_window < config.max_position_embeddings):
                model = Model(dataclasses.replace(model.config, sliding_window=draft_window),
                              model.params)
            where = swaps.enter_context(replace_folder(folder, _model_file))
            save_model(cast(model, "bfloat16"), where, format="hf", eos_token_id=0)  # <|endoftext|>
            if role == "target":
                shutil.copy(workdir / "tokenizer" / "tokenizer.json", where / "tokenizer.json")
            else:
                np.save(where / VOCAB_FILE, frequent_tokens(np.load(workdir / "train.npy",
                                                                    mmap_mode="r"),
                                                            config.vocab_size, draft_vocab_size))
            # the draft restricted to its draft vocabulary, as it drafts (its loss is the whole
            # head's)
            stored = (load_draft_model if role == "draft" else load_model)(where, dtype="float32")
            whole = stored.model if role == "draft" else stored
            info[role] = dict(run=name, folder=folder, where=where, model=stored, config=config,
                              written=whole.config,
                              settings=settings, step=step,
                              loss=evaluate(whole, heldout, batches=32),
                              by_position=loss_by_position(whole, heldout))
            print(f"{folder}: {name} step {step}, held-out loss {info[role]['loss']:.4f}")
        acceptance = {}
        if "target" in info and "draft" in info:
            tokenizer = load_tokenizer(info["target"]["where"])
            acceptance = measure_acceptance(info["target"]["model"], info["draft"]["model"],
                                            tokenizer)
            acceptance["long"] = measure_long(info["target"]["model"], info["draft"]["model"],
                                              tokenizer)
            print(f"acceptance (γ=4): {json.dumps(acceptance)}")
            # adaptive lengths' calibration, fitted for these weights (an earlier one would be
            # carried over otherwise, and ignored on load: it records the weights it was fit for)
            from ..adaptive import calibrate, save_calibration
            fitted, report = calibrate(
                info["target"]["model"], info["draft"]["model"],
                prompts,
                temperature=calibration["temperature"],
                max_new_tokens=calibration["max_new_tokens"])
            report["command"] = "specjax train pair export (fit as `specjax train calibrate " + \
                " ".join(f"--{k.replace('_', '-')} {v}" for k, v in calibration.items()) + "`)"
            save_calibration(fitted, info["draft"]["where"], report, info["draft"]["model"])
            print("calibration: held-out ECE " + ", ".join(
                f"{m} {report[m]['ece']:.3f}" for m in ("greedy", "sampled")))
        long = any(d["run"].endswith("-long") for d in info.values())
        gen = [d["run"] for d in info.values() if d["run"].startswith("draft-gen")]
        rebuild = rebuild_steps(long, gen[0] if gen else None)
        for name, d in info.items():
            c, s = d["config"], d["settings"]
            (d["where"] / "training.json").write_text(json.dumps(
                {"steps": d["step"], "heldout_loss": d["loss"],
                 "heldout_loss_by_position": d["by_position"], "params": c.num_params,
                 "train": dataclasses.asdict(s), "acceptance": acceptance,
                 "corpus": {k: v for k, v in corpus.items() if k != "train"}}, indent=1) + "\n")
            acc = acceptance or {k: {"acceptance_rate": float("nan"),
                                     "mean_accepted_length": float("nan")}
                                 for k in ("greedy", "t0.8")}
            role, blurb = (("target", "The draft next to it (`../code-draft`) was distilled from it.")
                           if name == "target" else
                           ("draft", "Distilled from the target (`../code-target`, whose tokenizer "
                                     "it shares): KL to the target's next-token distributions plus "
                                     f"{s.distill_ce_weight} x cross-entropy to the data."))
            (d["where"] / "README.md").write_text(CARD.format(
                folder=d["folder"].name, role=role, blurb=blurb, params=c.num_params,
                params_m=c.num_params / 1e6, hidden=c.hidden_size, layers=c.num_hidden_layers,
                heads=c.num_attention_heads, kv=c.num_key_value_heads, inter=c.intermediate_size,
                vocab=c.vocab_size, ctx=c.max_position_embeddings, steps=d["step"],
                attends=_attends(d["written"]), layout=hf_architecture(d["written"]),
                batch=s.batch_size, seq=s.seq_len, tokens=d["step"] * s.batch_size * s.seq_len / 1e6,
                lr=s.learning_rate, distil=(", distilled from the target" if name == "draft" else ""),
                note=SCHEDULE_NOTES.get(d["run"], ""), rebuild=rebuild,
                loss=d["loss"], acc_g=acc["greedy"]["acceptance_rate"],
                window=min(c.max_position_embeddings, POSITION_BINS[-1][1]),
                by_position=", ".join(f"{k} {v:.3f}" for k, v in d["by_position"].items()
                                      if k != "windows"),
                len_g=acc["greedy"]["mean_accepted_length"], acc_t=acc["t0.8"]["acceptance_rate"],
                len_t=acc["t0.8"]["mean_accepted_length"], python=corpus.get("python", "?"),
                long_row=long_row(acc.get("long")),
                train_files=corpus.get("train_files", 0), heldout_files=corpus.get("heldout_files", 0),
                train_tokens=corpus.get("train_tokens", 0),
                heldout_tokens=corpus.get("heldout_tokens", 0),
                vocab_row=("" if name == "target" else
                           f"| draft vocabulary | drafts only from the {draft_vocab_size} most "
                           f"frequent tokens of the training files (`{VOCAB_FILE}`; "
                           f"`sj.load_draft_model` applies it, `--full-draft-vocab` ignores it) |\n")))


BPE4K_CARD = """# code-draft-bpe4k

A draft for `../code-target` that does not share its tokenizer: a byte-level BPE of {vocab}
tokens (`tokenizer.json` here) against the target's 8,192, trained on the same training files.
It has the bundled draft's body (its embedding and LM head are half as wide, for half the
vocabulary), trained from scratch with the next-token loss on its own tokenization, then on text
the target wrote (distillation by sequences){soft}. It is there to measure drafting across tokenizers (`docs/draft-model.md`): `specjax generate
--draft checkpoints/code-draft-bpe4k` pairs it with the target by the tokens' bytes.

| | |
| --- | --- |
| parameters | {params:,} ({params_m:.1f}M) |
| shape | hidden {hidden}, {layers} layers, {heads} heads ({kv} key/value heads), MLP {inter}, vocabulary {vocab}, context {ctx} |
| stored as | bfloat16 safetensors, Hugging Face `LlamaForCausalLM` layout |
| training | {steps} optimizer steps of {batch} sequences x {seq} tokens ({tokens:.1f}M tokens), AdamW, peak lr {lr}, cosine decay{kd} |
| held-out loss | {loss:.3f} nats per token of its own, {per_byte:.3f} nats per byte (`code-draft`: {draft_per_byte:.3f} nats per byte) |
| shared tokens | {shared} of its {vocab} tokens are target tokens (the same bytes); it reads each target token as its spelling in its own tokens (at most {width}) |
| draft vocabulary | drafts only from its {draft_vocab} most frequent tokens (`draft_vocab.npy`) |
| coverage (held-out text) | the target puts {target_mass:.3f} of its probability on tokens this draft can propose; the draft puts {draft_mass:.3f} of its own there |
| acceptance (γ = 4, bench prompts) | greedy {acc_g:.3f} (mean accepted length {len_g:.2f}), T = 0.8 {acc_t:.3f} ({len_t:.2f}); `code-draft` as shipped when this was exported, on the same prompts: greedy {same_g:.3f} ({same_len_g:.2f}), T = 0.8 {same_t:.3f} ({same_len_t:.2f}) |
{context_rows}
**Rebuild.** `specjax train pair data --workdir W`, `specjax train pair draft-bpe4k --workdir W`,
`specjax train pair draft-bpe4k-kd --workdir W` (each resumable), `specjax train pair
export-bpe4k --workdir W`{soft_rebuild} (settings: the constants in `specjax/train/pair.py`).
"""


def bpe4k_context_rows(seq_len: int, ctx: int, long: dict, reference: dict) -> str:
    """The bpe4k card's rows on its context: trained length against declared, and
    ``measure_long``'s figures beside code-draft's (positions are the target's)."""
    beyond = (": past that it agrees with the target less, as the next row shows"
              if seq_len < ctx else "")
    return (f"| context | trained on sequences of {seq_len} of its own tokens (about "
            f"{round(seq_len * BPE4K_TARGET_TOKENS_PER_TOKEN)} target tokens), "
            f"`max_position_embeddings` {ctx}{beyond} |\n"
            + long_row(long).replace(" |\n", f"; `code-draft`: mean accepted length "
                                     f"{reference['mean_accepted_length']:.2f}, "
                                     + ", ".join(f"{k} {v:.2f}" for k, v in
                                                 reference["by_position"].items()) + " |\n"))


BPE4K_TARGET_TOKENS_PER_TOKEN = 0.93
"""Target tokens per token of code-draft-bpe4k, on the long bench prompts (6,638 against 7,133):
its vocabulary is half the target's, so its tokens are a little shorter."""


def stage_export_bpe4k(workdir: pathlib.Path, out: pathlib.Path,
                       config: ModelConfig = DRAFT_BPE4K,
                       settings: TrainConfig = DRAFT_BPE4K_TRAINING,
                       draft_vocab_size: int = DRAFT_VOCAB_SIZE,
                       kd_settings: TrainConfig = DRAFT_BPE4K_KD_TRAINING) -> None:
    """Write workdir/draft-bpe4k as ``out``/code-draft-bpe4k with its tokenizer, its draft
    vocabulary and a card that measures it against ``out``/code-target beside code-draft."""
    import shutil

    from ..checkpoint import _model_file, cast, save_model
    from ..draft.draft_model import VOCAB_FILE
    from ..draft.vocab import frequent_tokens
    from ..files import replace_folder
    folder = workdir / "bpe4k"
    tokens, heldout = _tokens(folder, "draft-bpe4k")
    model, step = _restore(config, settings, workdir / "draft-bpe4k")
    kd, kd_note = workdir / "draft-bpe4k-kd", ""
    if kd.exists():  # fine-tuned on the target's text: ship that
        model, kd_step = _restore(config, kd_settings, kd)
        k = kd_settings
        kd_tokens = sum(np.load(c, mmap_mode="r").size - 1
                        for c in (workdir / "bpe4k" / "kd").glob("chunk-*.npy"))
        kd_note = (f"; then fine-tuned {kd_step} steps of {k.batch_size} x {k.seq_len} tokens "
                   f"(peak lr {k.learning_rate}) on {kd_tokens / 1e6:.2f}M tokens of text the "
                   f"target wrote (continuations of training windows, half greedy, half at "
                   f"T = 1: sequence-level distillation)")
    dest = out / "code-draft-bpe4k"
    with replace_folder(dest, _model_file) as where:
        save_model(cast(model, "bfloat16"), where, format="hf", eos_token_id=0)
        shutil.copy(folder / "tokenizer" / "tokenizer.json", where / "tokenizer.json")
        np.save(where / VOCAB_FILE, frequent_tokens(tokens, config.vocab_size,
                                                    draft_vocab_size))
        _describe_bpe4k(where, workdir, out, heldout, config, settings, step, kd_note,
                        draft_vocab_size)


def _describe_bpe4k(where: pathlib.Path, workdir: pathlib.Path, out: pathlib.Path,
                    heldout: np.ndarray, config: ModelConfig, settings: TrainConfig, step: int,
                    kd_note: str, draft_vocab_size: int, extra: dict | None = None) -> None:
    """Measure the draft with its own tokenizer written in ``where`` against ``out``/code-target
    beside code-draft, and write its training.json (with ``extra``) and card."""
    from ..checkpoint import load_model
    from ..draft.draft_model import load_draft_model, load_paired_draft, vocab_coverage
    from ..draft.vocab import token_pairs
    from ..tokenizer import load_tokenizer
    corpus = json.loads((workdir / "corpus.json").read_text())
    target = load_model(out / "code-target", dtype="float32")
    tokenizer = load_tokenizer(out / "code-target")
    same = load_draft_model(out / "code-draft", dtype="float32")
    paired = load_paired_draft(where, tokenizer, target.config.vocab_size, dtype="float32")
    loss = evaluate(paired.model, heldout, batches=32)
    same_loss = evaluate(same.model, np.load(workdir / "heldout.npy", mmap_mode="r"),
                         batches=32)
    # nats per byte: the mean loss per token times tokens per byte of the held-out files
    per_byte = loss * len(heldout) / corpus["heldout_bytes"]
    same_per_byte = same_loss * corpus["heldout_tokens"] / corpus["heldout_bytes"]
    target_heldout = np.load(workdir / "heldout.npy", mmap_mode="r")
    coverage = vocab_coverage(target, paired, [target_heldout[i:i + 256].tolist()
                                               for i in range(0, 256 * 16, 256)])
    acceptance = measure_acceptance(target, paired, tokenizer)
    reference = measure_acceptance(target, same, tokenizer)
    acceptance["long"] = measure_long(target, paired, tokenizer)
    reference["long"] = measure_long(target, same, tokenizer)
    print(f"{where}: step {step}, loss {loss:.4f} ({per_byte:.4f} nats/byte, code-draft "
          f"{same_per_byte:.4f}); acceptance {json.dumps(acceptance)}; code-draft "
          f"{json.dumps(reference)}; coverage {json.dumps(coverage)}")
    s, c = settings, config
    soft = "soft_labels" in (extra or {})
    (where / "training.json").write_text(json.dumps(
        {"steps": step, "fine_tuned_on_target_text": kd_note.removeprefix("; then "),
         "heldout_loss": loss, "heldout_nats_per_byte": per_byte,
         "code_draft_nats_per_byte": same_per_byte, "params": c.num_params,
         "train": dataclasses.asdict(s), "acceptance": acceptance,
         "code_draft_acceptance": reference, "coverage": coverage, **(extra or {})},
        indent=1) + "\n")
    (where / "README.md").write_text(BPE4K_CARD.format(
        vocab=c.vocab_size, params=c.num_params, params_m=c.num_params / 1e6,
        hidden=c.hidden_size, layers=c.num_hidden_layers, heads=c.num_attention_heads,
        kv=c.num_key_value_heads, inter=c.intermediate_size, ctx=c.max_position_embeddings,
        steps=step, batch=s.batch_size, seq=s.seq_len, kd=kd_note,
        tokens=step * s.batch_size * s.seq_len / 1e6, lr=s.learning_rate, loss=loss,
        per_byte=per_byte, draft_per_byte=same_per_byte,
        shared=len(token_pairs(load_tokenizer(where), tokenizer)),
        width=int(paired.spelling.shape[1]), draft_vocab=draft_vocab_size,
        target_mass=coverage["target_mass"], draft_mass=coverage["draft_mass"],
        acc_g=acceptance["greedy"]["acceptance_rate"],
        len_g=acceptance["greedy"]["mean_accepted_length"],
        acc_t=acceptance["t0.8"]["acceptance_rate"],
        len_t=acceptance["t0.8"]["mean_accepted_length"],
        same_g=reference["greedy"]["acceptance_rate"],
        same_len_g=reference["greedy"]["mean_accepted_length"],
        same_t=reference["t0.8"]["acceptance_rate"],
        same_len_t=reference["t0.8"]["mean_accepted_length"],
        soft=("; then, token by token, towards the target's next-token distribution at the end "
              "of every target token, reading the text as the chain does (each target token "
              "spelled in its tokens), on the training files and on text the target wrote "
              "(token-level distillation)" if soft else ""),
        context_rows=bpe4k_context_rows(s.seq_len, c.max_position_embeddings,
                                        acceptance["long"], reference["long"]),
        soft_rebuild=(", then `specjax train pair draft-bpe4k-soft --workdir W` and `specjax "
                      "train pair export-bpe4k-soft --workdir W`" if soft else "")))


def stage_export_bpe4k_soft(workdir: pathlib.Path, out: pathlib.Path,
                            config: ModelConfig = DRAFT_BPE4K,
                            settings: TrainConfig = DRAFT_BPE4K_SOFT_TRAINING,
                            draft_vocab_size: int = DRAFT_VOCAB_SIZE) -> None:
    """Write workdir/draft-bpe4k-soft over ``out``/code-draft-bpe4k (the folder it started
    from: its tokenizer and draft vocabulary are kept, its training record extended), measured
    and described as export-bpe4k does."""
    import shutil

    from ..checkpoint import _model_file, cast, save_model
    from ..draft.draft_model import VOCAB_FILE
    from ..files import replace_folder
    from ..tokenizer import load_tokenizer
    dest = out / "code-draft-bpe4k"
    before = json.loads((dest / "training.json").read_text())
    run = json.loads((workdir / "draft-bpe4k-soft" / "run.json").read_text())
    if pathlib.Path(run["start"]).resolve() != dest.resolve():
        raise SystemExit(f"draft-bpe4k-soft started from {run['start']}, not {dest}")
    earlier = before.get("soft_labels")
    if earlier is not None:  # exported once already: describe what preceded that export
        if "fine_tuned_before" not in earlier:
            raise SystemExit(f"{dest} already holds a soft-label export whose record lacks what "
                             f"preceded it: write the folder it started from back first")
        before = {**before, "fine_tuned_on_target_text": earlier["fine_tuned_before"],
                  "acceptance": earlier["acceptance_before"]}
    model, step = _restore(config, settings, workdir / "draft-bpe4k-soft")
    folder = workdir / "bpe4k"
    if not (folder / "heldout.npy").exists():  # the held-out files in the draft's tokens
        corpus = json.loads((workdir / "corpus.json").read_text())
        root = pathlib.Path(corpus["root"])
        folder.mkdir(parents=True, exist_ok=True)
        encode_files(load_tokenizer(dest).backend, [root / f for f in corpus["heldout"]],
                     folder / "heldout.npy")
    heldout = np.load(folder / "heldout.npy", mmap_mode="r")
    s = settings
    note = (f"; then {before['fine_tuned_on_target_text']}; then {step} steps of {s.batch_size}"
            f" windows of {s.seq_len} target tokens (peak lr {s.learning_rate}; "
            f"{run['generated_share']:.0%} of them of {run['generated_rows']} continuations the "
            f"target wrote) towards the target's next-token distribution at every target "
            f"token's end, each target token read as its spelling (token-level distillation, "
            f"`specjax train pair draft-bpe4k-soft`)")
    extra = {"soft_labels": {"steps": step, "train": dataclasses.asdict(s),
                             "draft_len": run["draft_len"],
                             "acceptance_before": before["acceptance"],
                             # so that a second export describes the same history
                             "fine_tuned_before": before["fine_tuned_on_target_text"]}}
    with replace_folder(dest, _model_file) as where:
        save_model(cast(model, "bfloat16"), where, format="hf", eos_token_id=0)
        for name in ("tokenizer.json", VOCAB_FILE):
            shutil.copy(dest / name, where / name)
        _describe_bpe4k(where, workdir, out, heldout, config,
                        TrainConfig(**before["train"]), before["steps"], note,
                        draft_vocab_size, extra)


def long_row(long: dict | None) -> str:
    """The card's row for ``measure_long``'s figures."""
    if not long:
        return ""
    return (f"| acceptance by context position (greedy, γ = {long['gamma']}, "
            f"{long['max_new_tokens']} new tokens after each long bench prompt) | "
            f"{long_figures(long)} |\n")


def long_figures(long: dict) -> str:
    """``measure_long``'s figures in words, as the cards give them."""
    return (f"mean accepted length {long['mean_accepted_length']:.2f}; by the position a round "
            f"starts at: " + ", ".join(f"{k} {v:.2f}" for k, v in long["by_position"].items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="specjax train pair", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["data", "target", "target-long", "draft", "draft-long",
                                      "draft-gen", "draft-gen-long",
                                      "export", "draft-bpe4k", "draft-bpe4k-kd",
                                      "draft-bpe4k-soft", "export-bpe4k",
                                      "export-bpe4k-soft"])
    ap.add_argument("--workdir", type=pathlib.Path, required=True)
    ap.add_argument("--minutes", type=float, help="stop (after a checkpoint) after this long")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("checkpoints"))
    ap.add_argument("--from", dest="start", type=pathlib.Path, default=None,
                    help="target-long, draft-long, draft-gen, draft-bpe4k-soft: the model "
                         "folder to continue from (default: the bundled code-target, "
                         "code-draft, code-draft, code-draft-bpe4k); export --gen: the target "
                         "to write beside the draft")
    ap.add_argument("--teacher", type=pathlib.Path, default=None,
                    help="draft-gen, draft-gen-long, draft-bpe4k-soft: the target folder to "
                         "distil from and generate with (default: the bundled code-target)")
    ap.add_argument("--gen", action="store_true",
                    help="export: write draft-gen as code-draft, with the target (--from, "
                         "default the bundled one) written again beside it")
    ap.add_argument("--gen-long", action="store_true",
                    help="export: as --gen, with the draft-gen-long draft")
    ap.add_argument("--draft-from", type=pathlib.Path, default=None,
                    help="export --gen / --gen-long: the draft folder to write (and measure) "
                         "instead of the run's last step, e.g. the shipped code-draft")
    ap.add_argument("--long", action="store_true",
                    help="export: write target-long and draft-long as code-target and "
                         "code-draft")
    ap.add_argument("--corpus", type=pathlib.Path,
                    help="data: a folder of .py files (default: this Python's standard library)")
    ap.add_argument("--verbose", action="store_true",
                    help="also show the INFO logs of orbax and absl")
    from ..cli import show_defaults
    args = show_defaults(ap).parse_args(argv)
    configure_logging(args.verbose)
    if args.minutes is not None and not args.minutes >= 0:
        ap.error(f"--minutes must be >= 0 (0: stop after the first step; leave it out for no "
                 f"limit), got {args.minutes}")
    # a flag the stage does not read is refused (export --from without --gen exported the work
    # directory's own runs without a word)
    gen_export = args.stage == "export" and (args.gen or args.gen_long)
    uses = {"start": args.stage in ("target-long", "draft-long", "draft-gen", "draft-gen-long",
                                    "draft-bpe4k-soft") or gen_export,
            "teacher": args.stage in ("draft-gen", "draft-gen-long", "draft-bpe4k-kd",
                                      "draft-bpe4k-soft"),
            "corpus": args.stage == "data",
            "gen": args.stage == "export", "gen_long": args.stage == "export",
            "long": args.stage == "export", "draft_from": args.stage == "export"}
    for name, used in uses.items():
        value = getattr(args, name)
        if value not in (None, False) and not used:
            flag = {"start": "--from"}.get(name, "--" + name.replace("_", "-"))
            ap.error(f"{flag} is not read by stage {args.stage!r}"
                     + (" (export reads --from with --gen or --gen-long)"
                        if name == "start" and args.stage == "export" else ""))
    if args.stage == "export":
        if args.long + args.gen + args.gen_long > 1:
            ap.error("export takes one of --long, --gen and --gen-long")
        if args.draft_from is not None and not (args.gen or args.gen_long):
            ap.error("--draft-from is for export --gen or --gen-long")
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.stage == "data":
        try:
            stage_data(args.workdir, args.corpus)
        except (FileNotFoundError, ValueError) as e:
            ap.error(f"--corpus: {e}")
    elif args.stage == "target":
        stage_target(args.workdir, args.minutes)
    elif args.stage == "target-long":
        from ..bundle import bundled
        stage_target_long(args.workdir, args.minutes, args.start or bundled("code-target"))
    elif args.stage == "draft":
        stage_draft(args.workdir, args.minutes)
    elif args.stage == "draft-long":
        from ..bundle import bundled
        stage_draft_long(args.workdir, args.minutes, args.start or bundled("code-draft"))
    elif args.stage == "draft-gen":
        from ..bundle import bundled
        stage_draft_gen(args.workdir, args.minutes, args.start or bundled("code-draft"),
                        target_folder=args.teacher)
    elif args.stage == "draft-gen-long":
        from ..bundle import bundled
        stage_draft_gen(args.workdir, args.minutes, args.start or bundled("code-draft"),
                        target_folder=args.teacher, settings=DRAFT_GEN_LONG_TRAINING, rows=DRAFT_GEN_LONG_ROWS,
                        generate_minutes=DRAFT_GEN_LONG_MINUTES, run_name="draft-gen-long",
                        lengths=long_rows(DRAFT.max_position_embeddings))
    elif args.stage == "draft-bpe4k":
        stage_draft_bpe4k(args.workdir, args.minutes)
    elif args.stage == "draft-bpe4k-kd":
        stage_draft_bpe4k_kd(args.workdir, args.minutes, target_folder=args.teacher)
    elif args.stage == "draft-bpe4k-soft":
        from ..bundle import bundled
        stage_draft_bpe4k_soft(args.workdir, args.minutes,
                               args.start or bundled("code-draft-bpe4k"),
                               target_folder=args.teacher)
    elif args.stage == "export-bpe4k":
        stage_export_bpe4k(args.workdir, args.out)
    elif args.stage == "export-bpe4k-soft":
        stage_export_bpe4k_soft(args.workdir, args.out)
    else:
        if args.gen or args.gen_long:
            from ..bundle import bundled
            runs = GEN_LONG_RUNS if args.gen_long else GEN_RUNS
            shipped = {"target-long": args.start or bundled("code-target")}
            if args.draft_from is not None:
                shipped[runs[1][0]] = args.draft_from
            stage_export(args.workdir, args.out, runs=runs, shipped=shipped)
        else:
            stage_export(args.workdir, args.out, **({"runs": LONG_RUNS} if args.long else {}))
    return 0
