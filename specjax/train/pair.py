"""Build the bundled target/draft pair, in resumable stages.

    specjax train pair data   --workdir W            corpus split, tokenizer, token streams
    specjax train pair target --workdir W [--minutes M]   train (or continue) the target
    specjax train pair draft  --workdir W [--minutes M]   distil the draft from the target
    specjax train pair export --workdir W --out checkpoints/   write the two model folders

Each stage reads what the earlier ones left in the work directory; ``target`` and ``draft``
resume from their latest checkpoint, so a run can be spread over several sessions. The exact
settings are the constants in specjax/train/pair.py; ``data`` records the corpus manifest
next to the tokens.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib

import numpy as np

from ..config import ModelConfig
from .data import encode_files, python_corpus, train_tokenizer, write_manifest
from .loop import TrainConfig, evaluate, train

VOCAB_SIZE = 8192
# Sizes chosen for this 2-core CPU: a 32M target trained at 550 tokens/s here, too slow to train
# well in a few sessions; this 15.7M one trains at about 1.4k tokens/s (measured in the log).
TARGET = ModelConfig(vocab_size=VOCAB_SIZE, hidden_size=384, intermediate_size=1024,
                     num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                     max_position_embeddings=1024)
DRAFT = ModelConfig(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=384,
                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    max_position_embeddings=1024)
TARGET_TRAINING = TrainConfig(steps=8000, batch_size=16, seq_len=256, learning_rate=1e-3,
                              warmup_steps=200, checkpoint_every=25, eval_every=200, seed=0)
DRAFT_TRAINING = TrainConfig(steps=3000, batch_size=16, seq_len=256, learning_rate=2e-3,
                             warmup_steps=100, checkpoint_every=25, eval_every=200, seed=1,
                             distill_ce_weight=0.1)

log = logging.getLogger(__name__)


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


def _tokens(workdir: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
    if not (workdir / "train.npy").exists() or not (workdir / "heldout.npy").exists():
        raise SystemExit(f"{workdir} has no token streams: run `specjax train pair data` first")
    return (np.load(workdir / "train.npy", mmap_mode="r"),
            np.load(workdir / "heldout.npy", mmap_mode="r"))


def _log_eval(workdir: pathlib.Path, name: str):
    def on_eval(step: int, loss: float) -> None:
        with open(workdir / f"{name}-evals.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "heldout_loss": loss}) + "\n")
    return on_eval


def stage_target(workdir: pathlib.Path, minutes: float | None, config: ModelConfig = TARGET,
                 settings: TrainConfig = TARGET_TRAINING, progress: bool = True) -> None:
    tokens, heldout = _tokens(workdir)
    model, history = train(config, tokens, settings, workdir / "target", heldout=heldout,
                           progress=progress,
                           on_eval=_log_eval(workdir, "target"),
                           max_seconds=minutes * 60 if minutes else None)
    print(f"target: held-out loss {history[-1]['heldout_loss']:.4f} at step "
          f"{history[-1]['step']}")


def _restore(config: ModelConfig, settings: TrainConfig, run: pathlib.Path):
    from ..model import Model, init_model
    from .loop import TrainState, _manager, optimizer
    import jax
    import jax.numpy as jnp
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
                target_settings: TrainConfig = TARGET_TRAINING, progress: bool = True) -> None:
    tokens, heldout = _tokens(workdir)
    teacher, step = _restore(target, target_settings, workdir / "target")
    print(f"distilling from the target at step {step}")
    model, history = train(config, tokens, settings, workdir / "draft", heldout=heldout,
                           teacher=teacher, progress=progress, on_eval=_log_eval(workdir, "draft"),
                           max_seconds=minutes * 60 if minutes else None)
    print(f"draft: held-out loss {history[-1]['heldout_loss']:.4f} at step "
          f"{history[-1]['step']}")


def stage_export(workdir: pathlib.Path, out: pathlib.Path,
                 runs=(("target", TARGET, TARGET_TRAINING), ("draft", DRAFT, DRAFT_TRAINING))
                 ) -> None:
    from ..checkpoint import cast, save_model
    import shutil
    _, heldout = _tokens(workdir)
    for name, config, settings in runs:
        model, step = _restore(config, settings, workdir / name)
        loss = evaluate(model, heldout, batches=32)
        folder = out / f"code-{name}"
        save_model(cast(model, "bfloat16"), folder, format="hf", eos_token_id=0)  # <|endoftext|>
        if name == "target":
            shutil.copy(workdir / "tokenizer" / "tokenizer.json", folder / "tokenizer.json")
        (folder / "training.json").write_text(json.dumps(
            {"steps": step, "heldout_loss": loss, "params": config.num_params}, indent=1) + "\n")
        print(f"{folder}: step {step}, held-out loss {loss:.4f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="specjax train pair", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["data", "target", "draft", "export"])
    ap.add_argument("--workdir", type=pathlib.Path, required=True)
    ap.add_argument("--minutes", type=float, help="stop (after a checkpoint) after this long")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("checkpoints"))
    ap.add_argument("--corpus", type=pathlib.Path,
                    help="data: a folder of .py files (default: this Python's standard library)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.stage == "data":
        stage_data(args.workdir, args.corpus)
    elif args.stage == "target":
        stage_target(args.workdir, args.minutes)
    elif args.stage == "draft":
        stage_draft(args.workdir, args.minutes)
    else:
        stage_export(args.workdir, args.out)
    return 0
