"""One writer per artifact: an advisory ``flock`` on a small lock file, with the holder written inside it.

Every file or folder a command writes (a feature store, a stage folder of a run directory, ``caption``'s
output and journal, a gallery, a pictures folder, the converted-checkpoint cache) is guarded by one
:class:`WriterLock`. The first process takes the lock and writes who it is (pid, host, start time, command)
into the lock file; a second process is refused at once with one line naming that holder, before it reads
or changes anything, so nothing already committed is touched.

Stale locks cannot block: ``flock`` belongs to the open file, and the kernel drops it when the holder dies
(SIGKILL included), so a lock file left by a killed process is simply taken over. The one case where a dead
process still "holds" it is a child that inherited the descriptor (a DataLoader worker outliving its
parent for a few seconds); a lock whose recorded holder on this host no longer runs is therefore retried
for up to :data:`ORPHAN_WAIT` seconds before it is refused, and the refusal says the holder is gone.

A lock file is never followed through a link and never written over a file that is not a lock file of ours: it
is opened with :func:`pipeline.core.fileio.open_own_file` (a symbolic link, a folder, a fifo, a device or a hard
link at the lock path is refused in one line naming it), and, once the ``flock`` is held (so no holder is writing
it), its content must be empty or a holder record as :func:`acquire_lock` writes it (a JSON object of at most
:data:`RECORD_LIMIT` bytes with an integer ``pid`` and no key but ``pid``, ``host``, ``since`` and ``command``);
anything else is refused, the file left byte for byte as it was.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any

from pipeline.core.errors import UsageError, annotate_os_error
from pipeline.core.fileio import open_own_file

#: seconds to wait for a lock whose recorded holder is dead (its inheriting children are ending)
ORPHAN_WAIT = 10.0
#: the largest lock file that can hold a holder record (the record itself is well under 1 KB)
RECORD_LIMIT = 4096
_RECORD_KEYS = frozenset({"pid", "host", "since", "command"})


def _holder_record() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv[:6]))[:200],
    }


def read_holder(lock_path: str | Path) -> dict[str, Any]:
    """The holder recorded in a lock file (empty when unreadable or never written)."""
    try:
        data = json.loads(Path(lock_path).read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def is_lock_content(data: bytes) -> bool:
    """Whether ``data`` is what a lock file of ours holds: nothing (blank) or one holder record."""
    if not data.strip():
        return True
    if len(data) > RECORD_LIMIT:
        return False
    try:
        record = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return False
    return (
        isinstance(record, dict)
        and set(record) <= _RECORD_KEYS
        and isinstance(record.get("pid"), int)
        and not isinstance(record.get("pid"), bool)
    )


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return True  # unknown: assume it runs
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe_holder(holder: dict[str, Any]) -> str:
    """``pid 123 on host h since 2026-01-01T00:00:00+00:00`` (or ``an unknown process``)."""
    if not holder.get("pid"):
        return "an unknown process"
    text = f"pid {holder['pid']} on host {holder.get('host', '?')}"
    if holder.get("since"):
        text += f" since {holder['since']}"
    if holder.get("command"):
        text += f", `{holder['command']}`"
    return text


class WriterLock:
    """A held lock; :meth:`release` (or leaving the ``with`` block, or the process ending) frees it."""

    def __init__(self, path: Path, fd: int, what: str) -> None:
        self.path, self.what = path, what
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Free the lock (the holder record is cleared first, so a reader never sees a stale name)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> "WriterLock":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            if self._fd is not None:
                os.close(self._fd)
        except Exception:  # noqa: BLE001
            pass


def acquire_lock(lock_path: str | Path, what: str, hint: str = "wait for it to finish") -> WriterLock:
    """Take the lock at ``lock_path`` (created if missing) for writing ``what`` (e.g. "caption output out.jsonl").

    Refused with a :class:`~pipeline.core.errors.UsageError` (one line: what, the holder, ``hint``) when another
    process holds it. Never blocks for long: a live holder is refused at once, a dead recorded holder (the lock
    kept by an inheriting child) is retried for at most :data:`ORPHAN_WAIT` seconds.
    """
    lock_path = Path(lock_path)
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise annotate_os_error(exc, f"create the lock file of {what}", lock_path)
    fd = open_own_file(lock_path, f"lock file of {what}", mode=0o644)
    deadline = time.monotonic() + ORPHAN_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = read_holder(lock_path)
            orphan = holder.get("host") == socket.gethostname() and not _alive(holder.get("pid"))
            if orphan and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            os.close(fd)
            gone = " (no longer running; a process it started still holds the lock)" if orphan else ""
            raise UsageError(
                f"{what} is being written by another process: {describe_holder(holder)}{gone} "
                f"[lock {lock_path}]; {hint}"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise annotate_os_error(exc, f"lock {what}", lock_path)
    _check_content(fd, lock_path, what)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_holder_record()) + "\n").encode("utf-8"), 0)
    except OSError:
        pass  # the lock holds; only the holder's name for a refused process is missing
    return WriterLock(lock_path, fd, what)


def _check_content(fd: int, lock_path: Path, what: str) -> None:
    """Under the held ``flock`` (so no holder is writing it): refuse, untouched, a file not a lock file of ours."""
    try:
        data = os.pread(fd, RECORD_LIMIT + 1, 0)
    except OSError as exc:
        _let_go(fd)
        raise annotate_os_error(exc, f"read the lock file of {what}", lock_path)
    if not is_lock_content(data):
        _let_go(fd)
        raise UsageError(
            f"{lock_path} is not a lock file of butd-caption (it holds other data); the lock file of "
            f"{what} is never written over another file: nothing was changed; remove it or choose another "
            "path"
        )


def _let_go(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
