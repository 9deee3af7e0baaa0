"""Crash-safe file writes and validated reads (JSON) shared by every stage."""

from __future__ import annotations

import json
import os
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
