"""Crash trials for saves and training (issue 25), shared by tests/test_crash_safety.py (a few
trials, in CI) and experiments/crash_trials.py (many). Not collected by pytest.

A save trial: a folder holds a complete save of model A and a file of the user's; a child
process saves model B over it and is killed with SIGKILL at a random moment (sometimes after it
finished); the folder must then load, bit for bit, as A or as B, with the user's file intact.
A training trial: a child trains with a checkpoint every step and is killed at a random moment;
the run resumed here must end with exactly the parameters of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np

import specjax as sj

ROOT = pathlib.Path(__file__).resolve().parents[1]
# about 0.9M parameters (3.6 MB in float32): saves take tens of ms (safetensors) to hundreds
# (orbax), long enough to be cut inside
MODEL = dict(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
TARGET_SEED, OLD_SEED, NEW_SEED = 0, 1, 2
USER_FILE = ("NOTES.md", "the user's own notes\n")
KINDS = ("orbax", "hf", "heads")


def build(kind: str, seed: int):
    """(what to save, the target heads are saved for) for a trial kind."""
    cfg = sj.ModelConfig(**MODEL)
    if kind == "heads":
        target = sj.init_model(cfg, jax.random.key(TARGET_SEED))
        return sj.init_heads(target, "eagle", jax.random.key(seed)), target
    return sj.init_model(cfg, jax.random.key(seed)), None


def save(kind: str, thing, folder, target=None) -> None:
    if kind == "heads":
        sj.save_heads(thing, folder, target)
    else:
        sj.save_model(thing, folder, format=kind)


def load_leaves(kind: str, folder, target=None) -> list[np.ndarray]:
    """The saved weights as numpy arrays, in a fixed order (raises if the folder is broken)."""
    if kind == "heads":
        tree = sj.load_heads(folder, target).params["weights"]
    else:
        tree = sj.load_model(folder, dtype="stored").params
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape
                                    and np.array_equal(x, y) for x, y in zip(a, b))


CHILD = r"""
import pathlib, sys, time
sys.path.insert(0, sys.argv[4])
import crash_harness as h
kind, folder, scratch = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
thing, target = h.build(kind, h.NEW_SEED)
h.save(kind, thing, scratch, target)  # warm: imports and first-call costs
t0 = time.perf_counter()
h.save(kind, thing, scratch, target)  # how long a save (over an earlier one) takes
print("ready", time.perf_counter() - t0, flush=True)
sys.stdin.readline()
h.save(kind, thing, folder, target)
print("saved", flush=True)
"""


class SaveTrials:
    """Templates of the earlier save (A) and the references of both saves, per kind."""

    def __init__(self, workdir: pathlib.Path):
        self.workdir = workdir
        self.expected = {}
        for kind in KINDS:
            old, target = build(kind, OLD_SEED)
            new, _ = build(kind, NEW_SEED)
            template = workdir / f"template-{kind}"
            save(kind, old, template, target)
            (template / USER_FILE[0]).write_text(USER_FILE[1])
            save(kind, new, workdir / f"reference-{kind}", target)
            self.expected[kind] = (target, load_leaves(kind, template, target),
                                   load_leaves(kind, workdir / f"reference-{kind}", target))

    def check(self, kind: str, folder: pathlib.Path) -> str:
        """"old" or "new" for what the folder now holds; raises AssertionError when it holds
        neither (or lost the user's file)."""
        target, old, new = self.expected[kind]
        leaves = load_leaves(kind, folder, target)
        assert (folder / USER_FILE[0]).read_text() == USER_FILE[1], "the user's file was lost"
        if same(leaves, old):
            return "old"
        assert same(leaves, new), f"{folder} holds neither the earlier save nor the new one"
        return "new"

    def kill_trial(self, kind: str, trial: int, rng: random.Random) -> str:
        """One SIGKILL trial; returns "old" or "new" (raises when the model was lost)."""
        folder = self.workdir / f"trial-{kind}-{trial}" / "model"
        shutil.copytree(self.workdir / f"template-{kind}", folder)
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, kind, str(folder), str(folder.parent / "scratch"),
             str(pathlib.Path(__file__).parent)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=folder.parent)
        try:
            line = child.stdout.readline().split()
            assert line[:1] == ["ready"], f"child failed to start: {line}"
            seconds = float(line[1])
            child.stdin.write("go\n")
            child.stdin.flush()
            time.sleep(rng.uniform(0, 1.25 * seconds))
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
        outcome = self.check(kind, folder)
        shutil.rmtree(folder.parent)
        return outcome


TRAIN_CHILD = r"""
import pathlib, sys
sys.path.insert(0, sys.argv[2])
import crash_harness as h
print("ready", flush=True)
h.train_run(pathlib.Path(sys.argv[1]))
print("trained", flush=True)
"""

TRAIN_STEPS = 30


def train_run(workdir: pathlib.Path):
    """A small training run with a checkpoint after every step."""
    from specjax import train
    cfg = sj.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=44,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64)
    tokens = np.tile(np.random.default_rng(0).integers(1, 32, size=50), 40).astype(np.uint16)
    settings = train.TrainConfig(steps=TRAIN_STEPS, batch_size=4, seq_len=16,
                                 learning_rate=3e-2, warmup_steps=2, checkpoint_every=1,
                                 eval_every=100, eval_batches=1)
    model, _ = train.train(cfg, tokens, settings, workdir, progress=False)
    return model


def train_kill_trial(workdir: pathlib.Path, seconds: float, rng: random.Random) -> int:
    """Kill a training child at a random moment in its first ``seconds``; return the last step
    it had checkpointed (0: none). The caller resumes the run and compares."""
    child = subprocess.Popen([sys.executable, "-c", TRAIN_CHILD, str(workdir),
                              str(pathlib.Path(__file__).parent)],
                             stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONWARNINGS="ignore"))
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0, seconds))
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    steps = [int(p.name) for p in (workdir / "checkpoints").glob("*") if p.name.isdigit()] \
        if (workdir / "checkpoints").is_dir() else []
    return max(steps, default=0)


def summary(outcomes: dict) -> str:
    return json.dumps(outcomes, sort_keys=True)
