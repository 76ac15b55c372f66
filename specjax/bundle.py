"""Where the bundled models are: the trained pair and its drafters that ship with specjax.

In a source checkout (an editable install, or the repository on ``sys.path``) they are the
repository's ``checkpoints/`` folder; a wheel (``pip install .``, ``pip install git+...``)
carries the same folders inside the package, as ``specjax/checkpoints/``. ``SPECJAX_CHECKPOINTS``
names another folder holding them, and is looked in first.

    target = sj.load_model(sj.bundled("code-target"))
"""

from __future__ import annotations

import os
import pathlib

NAMES = ("code-target", "code-draft", "code-eagle", "code-medusa", "code-dflash", "code-mtp",
         "code-draft-bpe4k")
ENV = "SPECJAX_CHECKPOINTS"

_PACKAGE = pathlib.Path(__file__).resolve().parent


def search_path() -> list[pathlib.Path]:
    """The folders looked in, in order: ``$SPECJAX_CHECKPOINTS``, the repository's
    ``checkpoints/`` beside the package, the package's own ``checkpoints/`` (a wheel)."""
    dirs = [pathlib.Path(os.environ[ENV]).expanduser()] if os.environ.get(ENV) else []
    return dirs + [_PACKAGE.parent / "checkpoints", _PACKAGE / "checkpoints"]


def bundled(name: str = "code-target") -> pathlib.Path:
    """The folder of the bundled model ``name`` (one of ``NAMES``), wherever this install keeps
    it; a clear ``FileNotFoundError`` saying what to do when it is nowhere."""
    if name not in NAMES:
        raise ValueError(f"no bundled model is named {name!r}: the bundled models are "
                         f"{', '.join(NAMES)}")
    dirs = search_path()
    for d in dirs:
        if (d / name).is_dir():
            return d / name
    raise FileNotFoundError(
        f"the bundled model {name!r} is not installed (looked in "
        f"{', '.join(str(d) for d in dirs)}). Install specjax from its repository (a clone, "
        f"`pip install git+<repository URL>` or a wheel built from it: each ships the bundled "
        f"models), set {ENV} to a folder that holds {name}/, or pass your own model folder.")
