"""Compiled programs kept on disk, so a new process reads what an earlier one compiled.

Compiling a speculative program takes seconds (4-7 s for the bundled pair on a 2-core CPU, more
for large targets on GPU and TPU), and a new process compiles every program again: each run of
the command line, each restarted notebook or script. Before specjax compiles its first program
it turns on JAX's persistent compilation cache in ``~/.cache/specjax/xla`` (``$XDG_CACHE_HOME``
if set), so a later process with the same programs (same models' shapes, method, γ, batch and
cache buckets, sampling filters, devices, jax version and XLA flags: JAX's cache key) loads them
instead of compiling. Programs compiled in under ``jax_persistent_cache_min_compile_time_secs``
(JAX's default, 1 s) are not stored.

* JAX's own setting wins: with ``JAX_COMPILATION_CACHE_DIR`` set, or
  ``jax.config.update("jax_compilation_cache_dir", ...)`` called, specjax changes nothing.
* ``SPECJAX_COMPILATION_CACHE``: a directory to use instead of the default, or ``off``.
* ``sj.set_compilation_cache(path)`` from Python, at any time: a directory, or None for off.

JAX treats the cache's contents as trusted code: keep it in a folder only you can write to (the
default folder is created with permissions 0700). Delete the folder to empty it.
"""

from __future__ import annotations

import logging
import os
import pathlib

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

log = logging.getLogger(__name__)

ENV = "SPECJAX_COMPILATION_CACHE"
OFF = ("", "0", "off", "false", "no", "none")

_UNSET = object()
_chosen = _UNSET  # set_compilation_cache's choice: a path, or None (off)
_ensured = False  # ensure() has run since the last choice


def default_dir() -> pathlib.Path:
    """``$XDG_CACHE_HOME/specjax/xla``, or ``~/.cache/specjax/xla``."""
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base).expanduser() / "specjax" / "xla"


def wanted() -> pathlib.Path | None:
    """The directory specjax would turn the cache on in (None: off): set_compilation_cache's
    choice, else ``$SPECJAX_COMPILATION_CACHE``, else ``default_dir()``."""
    if _chosen is not _UNSET:
        return _chosen
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in OFF else pathlib.Path(env).expanduser()
    return default_dir()


def current() -> str | None:
    """The directory JAX's persistent compilation cache uses now (None: off)."""
    return jax.config.jax_compilation_cache_dir


def ensure() -> None:
    """Turn the cache on in ``wanted()`` unless JAX already has a directory or it is off. Called
    before each program specjax compiles; does the work once."""
    global _ensured
    if _ensured:
        return
    _ensured = True
    path = wanted()
    if path is None or current() is not None:
        return
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        log.warning("no compilation cache: cannot create %s (%s)", path, err)
        return
    _use(str(path))
    log.info("compiled programs are cached in %s", path)


def set_compilation_cache(path: str | os.PathLike | None) -> None:
    """Keep compiled programs in the directory ``path`` (created if missing), so later processes
    load them instead of compiling; None turns the cache off (JAX's setting included). Takes
    effect from the next program compiled."""
    global _chosen, _ensured
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"set_compilation_cache takes a directory or None, not {path!r}")
    if path is None:
        _chosen, _ensured = None, True
        _use(None)
        return
    folder = pathlib.Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"compilation cache {str(path)!r} is a file, not a directory")
    _chosen, _ensured = folder, False
    _use(None)
    ensure()


def _use(path: str | None) -> None:
    jax.config.update("jax_compilation_cache_dir", path)
    # JAX decides whether a cache is in use at the first compile of the process and keeps the
    # answer (a process that compiled anything before this, loading a model say, would never
    # use it): reset makes the next compile look again.
    jax_cache.reset_cache()
