"""Sharded runs: the 8-device suite (tests/sharded_suite.py) in a subprocess, since fake CPU
devices must be configured before jax is imported, and a two-process jax.distributed run on
loopback against one process."""

import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env(devices: int) -> dict:
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()  # conftest's kept
                     if not f.startswith("--xla_force_host_platform_device_count"))
    return dict(os.environ, JAX_PLATFORMS="cpu",
                XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip())


def test_sharded_suite_on_8_devices():
    suite = ROOT / "tests" / "sharded_suite.py"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(suite)], cwd=ROOT, env=_env(8), capture_output=True, text=True,
                         timeout=1200)
    report = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, report
    n_tests = len(re.findall(r"^def test_", suite.read_text(), re.M))
    summary = run.stdout.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= n_tests and "skipped" not in summary and "failed" not in summary, report


def test_two_processes_equal_one(tmp_path):
    """Two processes of 4 devices each load the models from folders straight onto their mesh
    (a Hugging Face target split, each process reading its own slices; an orbax draft
    replicated: restoring it to one device first fails on a mesh over several processes)."""
    import specjax as sj
    from specjax.multihost import tiny_pair
    target, draft = tiny_pair(0)
    sj.save_model(target, tmp_path / "target", format="hf")
    sj.save_model(draft, tmp_path / "draft")
    script = [sys.executable, "-m", "specjax.multihost", "--target", str(tmp_path / "target"),
              "--draft", str(tmp_path / "draft")]
    two, one = tmp_path / "two.json", tmp_path / "one.json"
    run = subprocess.run([*script, "--local-demo", "--json", str(two)],
                         cwd=ROOT, env=_env(4), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 processes, 8 devices (4 local)" in run.stdout
    run = subprocess.run([*script, "--reference", "--json", str(one)],
                         cwd=ROOT, env=_env(1), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    a, b = json.loads(two.read_text()), json.loads(one.read_text())
    assert a.pop("fresh_keys_agree") is True  # key=None: the processes drew one seed
    assert set(a) == {"greedy", "sampled"} and len(a["greedy"]) == 4
    assert a == b


def test_a_model_axis_that_does_not_divide_the_devices_is_named():
    """--model 3 over 4 devices failed in make_mesh naming its data axis ("data must be an int
    >= 1, got 0" for --model 16), a value never given."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run([sys.executable, "-m", "specjax.multihost", "--coordinator",
                          f"127.0.0.1:{port}", "--num-processes", "1", "--process-id", "0",
                          "--cpu-devices", "--model", "3"],
                         cwd=ROOT, env=_env(4), capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "--model 3 must divide the 4 devices of all processes" in run.stderr, run.stderr[-2000:]
