"""specjax's compiled programs kept on disk, so a new process reads what an earlier one compiled.

Compiling a speculative program takes seconds (4-7 s for the bundled pair on a 2-core CPU, more
for large targets on GPU and TPU), and a new process compiles every program again: each run of
the command line, each restarted notebook or script. So each time specjax compiles one of its
programs (a prefill, a decode loop, a stream segment) it does so with JAX's persistent
compilation cache pointed at a folder, ``~/.cache/specjax/xla`` by default
(``$XDG_CACHE_HOME/specjax/xla`` if that is set), and a later process with the same program
(JAX's cache key: the program's HLO, the devices, the jax version and the XLA flags) loads it
instead of compiling. Programs compiled in under ``MIN_COMPILE_SECONDS`` (0.2 s) are not
stored (in JAX's own folder: under its ``jax_persistent_cache_min_compile_time_secs``, 1 s by
default).

Only specjax's generation programs go there: the folder is set for their compile (in the
compiling thread's JAX configuration) and JAX's cache is reopened before and after it, so the
process's other compiles (specjax's small helpers included) follow its own JAX settings. JAX
keeps one cache open per process, so while a specjax compile runs, a compile in another thread
may use the same folder (and a specjax compile may land in the folder another thread's compile
opened); the reopening also drops what JAX's ``jax_compilation_cache_check_contents`` has
verified so far.

Which folder, in order:

* ``sj.set_compilation_cache(path)`` (None: no cache for specjax's programs);
* ``$SPECJAX_COMPILATION_CACHE``: a folder, or ``off``;
* JAX's own folder if the process has one (``JAX_COMPILATION_CACHE_DIR``,
  ``jax.config.update("jax_compilation_cache_dir", ...)``): specjax changes nothing then;
* the default folder. It is created readable and writable by you only, and used only if it is
  yours, not a symbolic link, and not writable by others: JAX runs what it finds in the cache as
  trusted code. Otherwise (or with no home folder) specjax's programs are not cached.

A program over more than one CPU device (a mesh of fake host devices, as in tests and the
multi-process demo) is never read from or written to any folder, JAX's own included: with jax
0.10.2 such a program loaded from the cache sometimes deadlocks, its devices waiting in
different collectives until XLA aborts the process (the 8-device MTP case of the sharded suite:
4 of 16 runs from a filled cache aborted, none of 16 compiled afresh; 2026-12-06). Compiling
them costs seconds; GPU and TPU programs are cached as before.

A folder given as a URL (``gs://bucket/cache``, for hosts that share one) is passed to JAX as
it is. ``jax_enable_compilation_cache=False`` turns it off whatever the folder. Only
``jax_compilation_cache_max_size`` bounds the folder's size (unbounded by default); delete it to
empty it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import stat
import threading

import jax
from jax._src import config as jax_config
from jax.experimental.compilation_cache import compilation_cache as jax_cache

log = logging.getLogger(__name__)

ENV = "SPECJAX_COMPILATION_CACHE"
OFF = ("0", "off", "false", "no", "none")

MIN_COMPILE_SECONDS = 0.2
"""specjax's programs compiled in at least this long are stored (JAX's default is 1 s; loading
one of the bundled pair's takes tens of milliseconds, so a 0.2 s compile is worth keeping)."""

_UNSET = object()
_JAX_OWN = object()  # specjax leaves the compile to the process's JAX settings
_chosen = _UNSET  # set_compilation_cache's choice: a folder, or None (off)
_lock = threading.RLock()  # one specjax compile at a time (JAX has one cache folder open)
_warned: set[str] = set()


def default_dir() -> pathlib.Path:
    """``$XDG_CACHE_HOME/specjax/xla``, or ``~/.cache/specjax/xla``."""
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base).expanduser() / "specjax" / "xla"


def folder() -> str | None:
    """The folder specjax's next program is compiled with (None: not cached). Creates the
    default folder if it is the one."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    target = _target()
    return jax.config.jax_compilation_cache_dir if target is _JAX_OWN else target


def _local(path) -> str:
    """A local folder's path, a ``file://`` URL's path part included (pathlib would read
    "file:///tmp/x" as the relative folder "file:/tmp/x")."""
    path = str(path)
    return path[len("file://"):] if path.startswith("file://") else path


def _remote(path) -> bool:
    """A folder JAX reaches by URL (``gs://bucket/cache``): used as given, never made or
    checked here."""
    return "://" in str(path) and not str(path).startswith("file://")


def set_compilation_cache(path: str | os.PathLike | None) -> None:
    """Keep specjax's compiled programs in the folder ``path`` (created now; OSError if it
    cannot be), so later processes load them instead of compiling; None: do not cache them.
    Takes effect from the next program compiled; JAX's own settings are left as they are."""
    global _chosen
    if path is None:
        _chosen = None
        return
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"set_compilation_cache takes a folder or None, not {path!r}")
    if _remote(path):
        _chosen = str(path)
        return
    where = pathlib.Path(_local(path)).expanduser().resolve()
    if where.exists() and not where.is_dir():
        raise NotADirectoryError(f"compilation cache {str(path)!r} is a file, not a folder")
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    _chosen = str(where)


def disk_cached(devices) -> bool:
    """Whether a program over ``devices`` may go through a disk cache: not when they are more
    than one CPU device (the module docstring)."""
    devices = list(devices)
    return not (len(devices) > 1 and all(d.platform == "cpu" for d in devices))


@contextlib.contextmanager
def compiling(devices=()):
    """Around each compile of a specjax program over ``devices`` (none named: one device):
    JAX's cache pointed at ``folder()`` for this thread, and reopened before and after, so the
    compile reads and writes that folder and the process's compiles before and after it do not
    (other threads' at the same time may: the module docstring). A program over several CPU
    devices is compiled with the cache off (``disk_cached``)."""
    if not disk_cached(devices):
        with _lock, jax_config.enable_compilation_cache(False):
            jax_cache.reset_cache()
            try:
                yield
            finally:
                jax_cache.reset_cache()
        return
    target = _target()
    if target is _JAX_OWN:
        yield
        return
    with _lock, jax_config.compilation_cache_dir(target), \
            jax_config.persistent_cache_min_compile_time_secs(MIN_COMPILE_SECONDS):
        jax_cache.reset_cache()  # JAX opens its folder once and keeps it: reopen it now ...
        try:
            yield
        finally:
            jax_cache.reset_cache()  # ... and again after, from the process's own settings


def _target():
    """A folder (str), None (off) or _JAX_OWN."""
    if not jax.config.jax_enable_compilation_cache:
        return _JAX_OWN  # off for the whole process
    if _chosen is not _UNSET:
        return _chosen
    env = os.environ.get(ENV)
    if env is not None and env.strip():
        if env.strip().lower() in OFF:
            return None
        return _usable(env, chosen=True)
    if jax.config.jax_compilation_cache_dir is not None:
        return _JAX_OWN
    return _usable(None, chosen=False)


def _usable(path: str | None, chosen: bool) -> str | None:
    """``path`` (None: the default folder) created if missing and resolved, or None (with a
    note in the log) if it cannot serve: it cannot be made, is not a writable folder, or (the
    default only) is not safely ours."""
    if path is not None and _remote(path):
        return path
    try:
        where = pathlib.Path(_local(path)).expanduser() if path else default_dir()
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = where.lstat()
        problem = None
        if not chosen and stat.S_ISLNK(info.st_mode):
            problem = "a symbolic link"
        elif not (where.is_dir() and os.access(where, os.W_OK | os.X_OK)):
            problem = "not a writable folder"
        elif not chosen and hasattr(os, "getuid") and (
                info.st_uid != os.getuid() or info.st_mode & 0o022):
            problem = "owned by another user or writable by others"
        where = where.resolve()
    except (OSError, RuntimeError, KeyError) as err:  # RuntimeError: no home folder
        where, problem = path or "the default folder", f"unusable ({err})"
    if problem is None:
        return str(where)
    note = f"specjax's programs are not cached on disk: {where} is {problem}"
    if note not in _warned:
        _warned.add(note)
        log.log(logging.WARNING if chosen else logging.INFO, note)
    return None
