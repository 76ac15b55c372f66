"""Writing a user's files so that a crash loses nothing.

A save that is interrupted (an exception, Ctrl-C, SIGKILL, a power cut) must leave either the
complete earlier save or the complete new one, never neither and never a mix:

* one file: ``write_atomic`` writes a temporary sibling, flushes and fsyncs it, renames it over
  the target (atomic on POSIX) and fsyncs the folder;
* a folder of several files (a model, a drafter): ``replace_folder`` gives a fresh temporary
  sibling folder to write the whole new save into; on success the files of the old folder that
  the save does not own (a README, a tokenizer the user put there) are linked or copied in,
  everything is fsynced, and the two folders are swapped with one ``renameat2(RENAME_EXCHANGE)``
  (Linux), so the folder's path always names a complete save. Where that call is missing (other
  systems, some file systems) the swap is two renames; a crash between them leaves the folder's
  path empty, with the earlier save beside it as ``.<name>.specjax-old-*``, which
  ``recover_folder`` (called by the loaders) moves back.

Temporary siblings are named ``.<name>.specjax-new-*``; one left by a crash is removed by the next
save of the same folder, and no loader looks at it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import glob
import os
import pathlib
import shutil
import uuid
from collections.abc import Callable, Iterator

NEW, OLD = ".specjax-new-", ".specjax-old-"


def fsync_path(path: pathlib.Path) -> None:
    """fsync a file or a folder (a folder's entry list, after a rename into it)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems refuse fsync on a folder
        if e.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: pathlib.Path) -> None:
    """fsync every file and folder under root, folders after their contents."""
    for folder, _, names in os.walk(root, topdown=False):
        for name in names:
            p = pathlib.Path(folder) / name
            if not p.is_symlink():
                fsync_path(p)
        fsync_path(pathlib.Path(folder))


def new_file_mode() -> int:
    """The mode ``open`` gives a new file here (0o666 less the process's umask): for files a
    library wrote with a private mode of its own (safetensors writes 0o600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def read_json_object(path: str | os.PathLike, remedy: str = "",
                     error: type[Exception] = ValueError) -> dict:
    """The JSON object (a dict) in the file ``path``; ``error`` naming the file, with ``remedy``
    after it, when the file is not valid JSON or holds something other than an object."""
    import json
    path = pathlib.Path(path)
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path} is not valid JSON ({e}){remedy}") from None
    if not isinstance(record, dict):
        raise error(f"{path} must hold a JSON object, got {type(record).__name__}{remedy}")
    return record


def write_atomic(path: str | os.PathLike, data: str | bytes,
                 writer: Callable[[pathlib.Path], None] | None = None) -> None:
    """Replace ``path`` with ``data`` (text is UTF-8) or with what ``writer(tmp)`` writes to a
    temporary sibling: at every instant ``path`` holds the old contents or the new ones."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}{NEW}{uuid.uuid4().hex[:8]}")
    try:
        if writer is not None:
            writer(tmp)
        else:
            with open(tmp, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


_libc = None


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Swap two paths atomically (Linux renameat2 with RENAME_EXCHANGE); False where this system
    or file system cannot."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            _libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                                        ctypes.c_char_p, ctypes.c_uint]
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if _libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _siblings(folder: pathlib.Path, kind: str) -> list[pathlib.Path]:
    # escaped: a folder named "m[12]" must not match another's ".m1..." siblings
    return sorted(folder.parent.glob(f".{glob.escape(folder.name)}{kind}*"))


def recover_folder(folder: str | os.PathLike) -> None:
    """If a save's two-rename swap was cut between its renames (the folder's path is empty and
    the earlier save waits beside it), move the earlier save back. A no-op otherwise."""
    folder = pathlib.Path(folder)
    if folder.exists():
        return
    old = _siblings(folder, OLD)
    if old:
        os.rename(old[-1], folder)
        fsync_path(folder.parent)


def _carry(src: pathlib.Path, dst: pathlib.Path) -> None:
    """Put ``src`` (a file or a folder) at ``dst``: hard links where possible, else copies."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(src, dst)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


@contextlib.contextmanager
def replace_folder(folder: str | os.PathLike,
                   owned: Callable[[str], bool]) -> Iterator[pathlib.Path]:
    """Write a new save of ``folder`` into the yielded temporary folder; when the block ends
    without an exception, the entries of the old folder for which ``owned(name)`` is false and
    that the new save did not write are carried over, and the new folder replaces the old one
    in one atomic swap. On an exception the temporary folder is removed and ``folder`` is
    untouched. A ``folder`` that is a symbolic link is saved where it points (replacing the
    link by a real folder left the old save there, for anyone loading it by its own path)."""
    folder = pathlib.Path(folder).absolute()
    if folder.is_symlink():
        folder = folder.resolve()
    recover_folder(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} exists and is not a folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    for stale in _siblings(folder, NEW):  # left by a save that was killed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = folder.with_name(f".{folder.name}{NEW}{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
        if folder.is_dir():  # the user's files (those the new save did not write) stay
            for entry in folder.iterdir():
                if not owned(entry.name) and not os.path.lexists(tmp / entry.name):
                    _carry(entry, tmp / entry.name)
        fsync_tree(tmp)
        try:  # a process working in the folder works in the new one after the swap
            inside = pathlib.Path.cwd() == folder
        except OSError:
            inside = False
        if not folder.exists():
            os.rename(tmp, folder)
        elif _exchange(tmp, folder):
            pass  # tmp now holds the earlier save
        else:
            old = folder.with_name(f".{folder.name}{OLD}{uuid.uuid4().hex[:8]}")
            os.rename(folder, old)
            os.rename(tmp, folder)
            tmp = old
        fsync_path(folder.parent)
        if inside:
            os.chdir(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)  # the earlier save, now replaced
