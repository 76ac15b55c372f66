"""Nothing lost on a crash (issue 25): a save interrupted at any point leaves the folder holding
the complete earlier save or the complete new one, with the user's own files; a training run
killed at any moment resumes to the parameters of an uninterrupted run."""

import os
import pathlib
import random
import shutil
import threading
import time

import crash_harness as h
import jax
import numpy as np
import pytest

import specjax as sj
from specjax import checkpoint, files
from specjax.draft import heads as heads_lib


class Interrupt(BaseException):
    """Stands for Ctrl-C (KeyboardInterrupt) or any exception raised inside a save."""


class Injector:
    """Counts the save's steps (file writes, fsyncs, renames, links, copies, orbax saves) and
    interrupts the k-th: before it runs, after it ran, or (writes) half-way through."""

    def __init__(self, monkeypatch, k: int, mode: str):
        self.count, self.k, self.mode, self.hit = 0, k, mode, False
        targets = [(os, "rename"), (os, "replace"), (os, "link"), (shutil, "copy2"),
                   (files, "fsync_path"), (files, "_exchange"), (shutil, "rmtree")]
        for module, name in targets:
            monkeypatch.setattr(module, name, self.wrap(getattr(module, name)))
        monkeypatch.setattr(pathlib.Path, "write_text", self.wrap(pathlib.Path.write_text,
                                                                  partial=True))
        monkeypatch.setattr(np, "save", self.wrap(np.save, partial=True))
        monkeypatch.setattr(checkpoint, "write_safetensors",
                            self.wrap(checkpoint.write_safetensors, partial=True))
        import orbax.checkpoint as ocp
        monkeypatch.setattr(ocp.StandardCheckpointer, "save",
                            self.wrap(ocp.StandardCheckpointer.save))

    def wrap(self, fn, partial=False):
        def step(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread() or (
                    self.mode == "partial" and not partial):
                return fn(*args, **kwargs)  # orbax's own threads are not interrupted here
            self.count += 1
            mine = self.count  # steps nested inside this one count after it
            if mine == self.k and self.mode == "before":
                self.hit = True
                raise Interrupt(fn.__name__)
            if mine == self.k and self.mode == "partial":
                self.hit = True
                self._write_half(fn, args, kwargs)
                raise Interrupt(fn.__name__)
            out = fn(*args, **kwargs)
            if mine == self.k and self.mode == "after":
                self.hit = True
                raise Interrupt(fn.__name__)
            return out
        return step

    @staticmethod
    def _write_half(fn, args, kwargs):
        """Run the write into memory-free scratch, then leave half its bytes at the path."""
        if fn is pathlib.Path.write_text:
            path, data = args[0], args[1].encode()
        elif fn is np.save:
            path = pathlib.Path(args[0]) if not hasattr(args[0], "write") else None
            if path is None:
                return
            import io
            buf = io.BytesIO()
            np.save(buf, args[1])
            data = buf.getvalue()
            path = path if path.suffix == ".npy" else path.with_name(path.name + ".npy")
        else:  # write_safetensors(path, tensors): the whole file, then cut it
            path = pathlib.Path(args[0])
            fn(*args, **kwargs)
            data = path.read_bytes()
        with open(path, "wb") as f:
            f.write(data[:len(data) // 2])


@pytest.fixture(scope="module")
def trials(tmp_path_factory):
    return h.SaveTrials(tmp_path_factory.mktemp("crash"))


@pytest.mark.parametrize("kind", h.KINDS)
def test_a_save_interrupted_at_every_step_loses_nothing(trials, kind, tmp_path, monkeypatch):
    new, target = h.build(kind, h.NEW_SEED)
    outcomes = {"old": 0, "new": 0}
    for mode in ("before", "after", "partial"):
        k = 0
        while True:
            k += 1
            folder = tmp_path / f"{mode}-{k}" / "model"
            shutil.copytree(trials.workdir / f"template-{kind}", folder)
            with monkeypatch.context() as m:
                injector = Injector(m, k, mode)
                try:
                    h.save(kind, new, folder, target)
                except Interrupt:
                    pass
            outcome = trials.check(kind, folder)  # raises unless old or new, user file kept
            outcomes[outcome] += 1
            if not injector.hit:  # k is past the save's last step: it completed
                assert outcome == "new"
                break
            shutil.rmtree(folder.parent)
        # orbax writes its files from C++ (the SIGKILL trials cut those): partial writes here
        # are ours (specjax.json, config.json, safetensors, drafter.json, vocab.npy)
        assert k > (1 if mode == "partial" else 5), \
            f"the save of {kind} made only {k - 1} {mode} steps: the injector missed them"
    assert outcomes["old"] > 0 and outcomes["new"] > 0, outcomes
    # no temporary sibling outlives a completed save
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]


def test_sigkill_during_saves_loses_nothing(trials):
    """SIGKILL at random moments during a save: 12 trials over the three kinds, three children
    at a time (experiments/crash_trials.py runs many more)."""
    from concurrent.futures import ThreadPoolExecutor
    rngs = [random.Random(trial) for trial in range(12)]
    with ThreadPoolExecutor(3) as pool:
        outcomes = list(pool.map(lambda t: (h.KINDS[t % 3], trials.kill_trial(
            h.KINDS[t % 3], t, rngs[t])), range(12)))
    counts = {o: sum(1 for _, x in outcomes if x == o) for o in ("old", "new")}
    print("SIGKILL trials:", counts)
    assert counts["old"] > 0, outcomes  # some kills landed before the save was complete


def test_two_rename_fallback_and_recovery(trials, tmp_path, monkeypatch):
    """Where the atomic swap is missing the save falls back to two renames; a crash between
    them leaves the folder's path empty, and the loader moves the earlier save back."""
    kind = "orbax"
    new, _ = h.build(kind, h.NEW_SEED)
    folder = tmp_path / "model"
    shutil.copytree(trials.workdir / f"template-{kind}", folder)
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    h.save(kind, new, folder)  # the fallback, uninterrupted
    assert trials.check(kind, folder) == "new"
    shutil.rmtree(folder)
    shutil.copytree(trials.workdir / f"template-{kind}", folder)
    real = os.rename

    def rename(a, b):
        if pathlib.Path(b) == folder.absolute():  # the new save's rename into place, after
            raise Interrupt("between the renames")  # the earlier save was moved aside
        return real(a, b)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(Interrupt):
        h.save(kind, new, folder)
    monkeypatch.setattr(os, "rename", real)
    assert not folder.exists()
    assert trials.check(kind, folder) == "old"  # load_model recovered it
    h.save(kind, new, folder)  # the next save removes the killed save's temporary folder
    assert trials.check(kind, folder) == "new"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_user_file_beside_the_model_survives_and_a_tokenizer_is_replaced(tmp_path):
    model = sj.init_model(sj.ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1), jax.random.key(0))
    folder = tmp_path / "m"
    sj.save_model(model, folder, format="hf")
    (folder / "README.md").write_text("mine")
    (folder / "sub").mkdir()
    (folder / "sub" / "data.txt").write_text("also mine")
    sj.save_model(model, folder, format="orbax")  # the other format: the HF files go
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["README.md", "params", "specjax.json", "sub"], names
    assert (folder / "sub" / "data.txt").read_text() == "also mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_training_killed_at_random_moments_resumes_to_the_same_parameters(tmp_path):
    t0 = time.perf_counter()
    straight = h.train_run(tmp_path / "straight")
    seconds = time.perf_counter() - t0  # about what a child's run takes, compiling included
    rng = random.Random(1)
    checkpointed = []
    for trial in range(2):
        workdir = tmp_path / f"killed-{trial}"
        checkpointed.append(h.train_kill_trial(workdir, seconds=seconds, rng=rng))
        resumed = h.train_run(workdir)
        for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    print("last checkpointed step before each kill:", checkpointed, f"of {h.TRAIN_STEPS}")


def test_heads_save_keeps_a_user_file_and_drops_a_stale_calibration(tmp_path):
    target = sj.init_model(sj.ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=2,
                                          num_key_value_heads=1), jax.random.key(0))
    heads = sj.init_heads(target, "medusa", jax.random.key(1), num_heads=2)
    folder = tmp_path / "heads"
    sj.save_heads(heads, folder, target)
    (folder / "calibration.json").write_text("{}")
    (folder / "notes.txt").write_text("mine")
    sj.save_heads(heads, folder, target, files={"README.md": "card"})
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md", "drafter.json", "notes.txt", "vocab.npy", "weights"]
    assert heads_lib.load_heads(folder, target).config.method == "medusa"
