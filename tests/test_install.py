"""Installs that work anywhere: a wheel built from this source tree, installed into a fresh
virtual environment, runs the main command from a folder outside the repository (the bundled
models travel inside the package); and sj.bundled says what to do when they are missing."""

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

import specjax as sj
from specjax import bundle as bundle_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _site_packages(python: pathlib.Path) -> pathlib.Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                          "['purelib'])"], capture_output=True, text=True, check=True)
    return pathlib.Path(out.stdout.strip())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """A wheel built from a copy of the files a clone has (no build isolation: setuptools is a
    test requirement, and nothing is downloaded)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("specjax", "checkpoints"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(dist), str(src)], check=True)
    (whl,) = dist.glob("specjax-*.whl")
    return whl


def test_the_wheel_carries_every_bundled_model_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"specjax/checkpoints/{p.relative_to(ROOT / 'checkpoints').as_posix()}"
               for p in (ROOT / "checkpoints").rglob("*") if p.is_file()}
    assert shipped and shipped <= names, sorted(shipped - names)[:5]
    assert {"specjax/__init__.py", "specjax/data/bench_prompts.json",
            "specjax/draft/registry.py", "specjax/train/loop.py"} <= names


def test_a_wheel_in_a_fresh_environment_runs_the_main_command(wheel, tmp_path):
    """The README's main command, from the console script of a fresh virtual environment that
    holds only the wheel (its dependencies come from the test environment through a .pth line,
    which adds a folder but not the editable install's finder), run outside the repository."""
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True)
    site = _site_packages(python)
    (site / "test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", bundle_lib.ENV)}
    where = subprocess.run([str(python), "-c", "import specjax as sj; print(sj.__file__); "
                            "print(sj.bundled('code-target'))"], cwd=away, env=env,
                           capture_output=True, text=True)
    assert where.returncode == 0, where.stderr
    module, target = where.stdout.split()
    assert pathlib.Path(module).is_relative_to(site), module
    assert pathlib.Path(target) == site / "specjax" / "checkpoints" / "code-target"
    run = subprocess.run([str(env_dir / "bin" / "specjax"), "generate", "--prompt",
                          "def fibonacci(n):", "--compare", "--repeats", "1",
                          "--max-new-tokens", "24", "--no-stream"],
                         cwd=away, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "output identical: True" in run.stdout, run.stdout
    assert "[speculative] 24 tokens" in run.stdout, run.stdout


def test_bundled_finds_the_repository_copy_and_honours_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(bundle_lib.ENV, raising=False)
    assert sj.bundled("code-draft") == ROOT / "checkpoints" / "code-draft"
    (tmp_path / "code-draft").mkdir()
    monkeypatch.setenv(bundle_lib.ENV, str(tmp_path))
    assert sj.bundled("code-draft") == tmp_path / "code-draft"
    # a folder that lacks the model falls through to the next place
    assert sj.bundled("code-target") == ROOT / "checkpoints" / "code-target"
    with pytest.raises(ValueError, match="'code-tagret'.*code-target, code-draft"):
        sj.bundled("code-tagret")


def test_missing_bundled_models_say_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(bundle_lib.ENV, raising=False)
    monkeypatch.setattr(bundle_lib, "_PACKAGE", tmp_path / "site" / "specjax")
    with pytest.raises(FileNotFoundError, match=r"'code-eagle' is not installed.*"
                       r"pip install git\+.*SPECJAX_CHECKPOINTS.*your own model folder"):
        sj.bundled("code-eagle")
    from specjax import cli
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "x"])
    err = capsys.readouterr().err
    assert "'code-target' is not installed" in err and "SPECJAX_CHECKPOINTS" in err, err
