"""Crash-safe file writes and validated reads (JSON) shared by every stage.

Files the program keeps for itself (lock files, journals, logs, temporary names) are opened only through
:func:`open_own_file` and :func:`create_new_file`: neither follows a symbolic link nor writes into anything but a
regular file with one name, so a link planted in a shared folder can never make a run cut or overwrite the file
it points at. Anything else at such a path is refused in one line naming it, untouched.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from pipeline.core.errors import PipelineError, UsageError, annotate_os_error


def _file_mode() -> int:
    """The mode a plain ``open()`` would give a new file (0666 minus the umask); mkstemp uses 0600."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


_MODE = _file_mode()


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it survives a power loss (best effort on odd filesystems)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a fifo"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a special file"


def not_own_file(path: Path, what: str, found: str) -> UsageError:
    """The one-line refusal for something at ``path`` that is not ``what`` of ours (``found`` says what it is)."""
    if found == "a symbolic link":
        why = f"is a symbolic link; the {what} is never written through a link (it could point at any file)"
    else:
        why = f"is {found}, not a regular file; the {what} is only ever a regular file of this program"
    return UsageError(f"{path} {why}: nothing was changed; remove it or choose another path")


def check_own_path(path: str | Path, what: str) -> None:
    """Refuse (:func:`not_own_file`) anything at ``path`` but a regular file with one name; a missing path passes.
    Reads nothing and changes nothing: for a check before the work, e.g. of every file of a journal."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise annotate_os_error(exc, f"inspect the {what}", path)
    _check_stat(path, what, st)


def _check_stat(path: Path, what: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise not_own_file(path, what, _kind(st.st_mode))
    if st.st_nlink > 1:
        raise not_own_file(path, what, f"a file with {st.st_nlink} names (a hard link to another file)")


def open_own_file(
    path: str | Path, what: str, *, append: bool = False, truncate: bool = False, mode: int = 0o666
) -> int:
    """Open (created if missing) a file the program keeps for itself, read-write; returns the descriptor.

    Never follows a symbolic link at ``path`` (``O_NOFOLLOW``); a link, a folder, a fifo, a device, or a regular
    file with several names (a hard link) is refused with one line naming ``path`` and ``what``, before anything is
    written, truncated or even opened for a special file (a fifo is never waited on: ``O_NONBLOCK`` until the
    descriptor is checked with ``fstat``). ``append`` writes at the end (``O_APPEND``); ``truncate`` empties the
    file, only after the checks. Whether a regular file's content is the program's is the caller's rule (a lock
    file's holder record, a journal's position file).
    """
    path = Path(path)
    check_own_path(path, what)  # a special file is refused before it is opened
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_APPEND if append else 0)
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link planted after the check
            raise not_own_file(path, what, "a symbolic link") from None
        if exc.errno == errno.EISDIR:
            raise not_own_file(path, what, "a folder") from None
        raise annotate_os_error(exc, f"open the {what}", path)
    try:
        _check_stat(path, what, os.fstat(fd))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException as exc:
        os.close(fd)
        if isinstance(exc, OSError):
            raise annotate_os_error(exc, f"open the {what}", path)
        raise
    return fd


def create_new_file(path: str | Path, what: str) -> None:
    """Create ``path`` as a new empty regular file of ours (``O_CREAT | O_EXCL | O_NOFOLLOW``): anything already
    there, a planted link included, is refused in one line and left as it is. For temporary names that a library
    then opens by name (HDF5): the name is then a fresh file of ours, never a link's target."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, _MODE)
    except FileExistsError:
        try:
            st_mode = os.lstat(path).st_mode
            found = "a file" if stat.S_ISREG(st_mode) else _kind(st_mode)
        except OSError:
            found = "something"
        raise UsageError(
            f"{path} already exists ({found}); the {what} is only written under a new name of its own: "
            "nothing was changed; remove it and run again"
        ) from None
    except OSError as exc:
        raise annotate_os_error(exc, f"create the {what}", path)
    os.close(fd)


def remove_entry(path: str | Path) -> None:
    """Remove what is at ``path`` without following a link: a link or a file is unlinked (a link's target is never
    touched), a real folder is removed with what is in it; a missing path is fine. For leftovers of a killed run."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Write a file atomically: ``write`` fills a temporary file in the same folder, then it is renamed.

    A reader (or a crash at any instant) sees either the old file or the complete new one, never a part.
    An ``OSError`` (no permission, read-only or full disk) propagates annotated with the action and the
    final path (see :func:`pipeline.core.errors.os_error_message`), the temporary file removed.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise annotate_os_error(exc, "create folder", path.parent)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        exc.filename = str(path)
        raise annotate_os_error(exc, "write", path)
    try:
        os.fchmod(fd, _MODE)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            exc.filename, exc.filename2 = str(path), None
            annotate_os_error(exc, "write", path)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (:func:`atomic_write`)."""
    return atomic_write(path, lambda fh: fh.write(data))


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` as UTF-8 to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any, indent: int | None = 1) -> Path:
    """Write ``obj`` as JSON (plus a newline) to ``path`` atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")


def read_json(path: str | Path, what: str = "JSON file", expect: type | None = dict) -> Any:
    """Read and parse a JSON file; a missing file is a usage error, a corrupt one names the file."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{what} not found: {path}")
    try:
        with path.open("r", encoding="utf-8-sig") as fh:  # a byte-order mark (Windows editors) is not an error
            obj = json.load(fh)
    except ValueError as exc:  # a JSONDecodeError, a UnicodeDecodeError, or an integer past int's digit limit
        raise PipelineError(f"{what} {path} is not valid JSON: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise PipelineError(f"{what} {path} is nested too deeply to be read") from None
    except OSError as exc:
        raise annotate_os_error(exc, f"read {what}", path)
    if expect is not None and not isinstance(obj, expect):
        raise PipelineError(f"{what} {path} must hold a JSON {expect.__name__}, not {type(obj).__name__}")
    return obj
