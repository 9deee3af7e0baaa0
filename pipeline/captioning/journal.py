"""Append-only JSON-lines files with a committed position: how ``cli caption`` streams and resumes.

A :class:`Journal` is a group of JSON-lines files (the results, the failures manifest, a gallery's records)
plus one small position file ``<first file>.committed`` (JSON: the byte length of every file at the last
commit, the number of committed rows, and the settings the rows were made with). A batch is appended with a
single ``write`` per file, the files are fsynced, then the position file is replaced atomically
(:func:`pipeline.core.fileio.atomic_write_json`). Reopening truncates every file to its committed length, so
a batch torn by a crash (or a full disk) is dropped and redone, and reads back the keys already committed so
that a rerun only does the rest. Memory is one batch plus the set of committed keys. Every file of a journal (and
its position file) is checked before anything is read or cut: a symbolic link, a folder, a fifo or a hard link at
one of its paths is refused in one line, untouched (:func:`pipeline.core.fileio.open_own_file`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.core.console import get_logger
from pipeline.core.errors import PipelineError, UsageError, annotate_os_error
from pipeline.core.fileio import atomic_write_json, check_own_path, open_own_file, read_json
from pipeline.core.locks import WriterLock, acquire_lock

log = get_logger("caption")

VERSION = 1


def strict(value: Any) -> Any:
    """``value`` with every NaN or infinite number replaced by None: strict JSON (``NaN`` is no JSON token)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps_row(row: Mapping[str, Any]) -> bytes:
    """One strict JSON line (ASCII: non-ASCII and undecodable file-name characters are ``\\u`` escapes; a
    non-finite number, e.g. the score of a diverged model, is ``null``)."""
    try:
        text = json.dumps(row, ensure_ascii=True, allow_nan=False)
    except ValueError:
        text = json.dumps(strict(row), ensure_ascii=True, allow_nan=False)
    return (text + "\n").encode("ascii")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class Journal:
    """Results files appended batch by batch; ``done`` holds the keys committed by earlier runs.

    ``files`` maps a role (``results``, ``failures``, ...) to a path; the first role's rows carry ``key``.
    ``settings`` must match the ones a resumed journal was written with (else a usage error naming the
    field), unless ``force`` starts every file afresh. ``products`` are files made from the journal (the final
    ``.json``/``.csv``): like the first file, a fresh start refuses to replace one it did not
    write (a non-empty file with no position file next to the journal) unless ``force``. One writer: ``lock`` (a held
    :class:`~pipeline.core.locks.WriterLock`, released by :meth:`close`) or else ``<first file>.lock`` is taken
    before anything is read, truncated or cleared, so a second process is refused naming the first.
    """

    def __init__(
        self,
        files: Mapping[str, Path],
        settings: Mapping[str, Any],
        force: bool = False,
        lock: WriterLock | None = None,
        products: Sequence[Path] = (),
    ) -> None:
        if not files:
            raise ValueError("a journal needs at least one file")
        self.files = {role: Path(p) for role, p in files.items()}
        self.main = next(iter(self.files))
        self.products = [Path(p) for p in products]
        main = self.files[self.main]
        self.lock = lock or acquire_lock(
            main.with_name(main.name + ".lock"), f"{main}", "wait for it to finish or choose another output"
        )
        try:
            for path in [*self.files.values(), self._state_path()]:  # a link or a special file: refused, untouched
                check_own_path(path, "caption journal file")
            self._open(settings, force)
        except BaseException:
            self.lock.release()
            raise

    def _state_path(self) -> Path:
        main = self.files[self.main]
        return main.with_name(main.name + ".committed")

    def _open(self, settings: Mapping[str, Any], force: bool) -> None:
        self.state_path = self._state_path()
        self.settings = json.loads(json.dumps(dict(settings)))  # plain JSON types, comparable with a re-read
        self.done: set[str] = set()
        self.rows = 0
        state = self._start(force)
        self.sizes = {role: int(state["files"].get(role, 0)) for role in self.files}
        self._fds: dict[str, int] = {}
        for role, path in self.files.items():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = open_own_file(path, "caption journal file")
            except OSError as exc:
                self.close()
                raise annotate_os_error(exc, "open for appending", path) from None
            except PipelineError:
                self.close()
                raise
            self._fds[role] = fd
            try:
                os.ftruncate(fd, self.sizes[role])  # drop whatever a killed (or failed) run wrote after its last commit
                os.lseek(fd, 0, os.SEEK_END)
            except OSError as exc:
                self.close()
                raise annotate_os_error(exc, "cut back to its committed length", path) from None
        if state["rows"]:
            self.done = {row["key"] for row in self.read(self.main)}
            self.rows = int(state["rows"])
        self._save()

    def _start(self, force: bool) -> dict[str, Any]:
        fresh = {"version": VERSION, "files": {}, "rows": 0, "settings": self.settings}
        main = self.files[self.main]
        if force or not self.state_path.exists():
            for path in [] if force else [main, *self.products]:
                if path.exists() and path.stat().st_size > 0:
                    raise UsageError(
                        f"{path} exists and was not written by `caption` (no {self.state_path.name} next to "
                        f"{main.name}): pass --force to overwrite it, or choose another --output"
                    )
            return fresh
        state = read_json(self.state_path, "caption position file")
        if state.get("version") != VERSION or not isinstance(state.get("files"), dict):
            raise PipelineError(
                f"caption position file {self.state_path} is not one this version writes; pass --force to start over"
            )
        old = state.get("settings") or {}
        changed = sorted(k for k in set(old) | set(self.settings) if old.get(k) != self.settings.get(k))
        if changed:
            raise UsageError(
                f"{main} holds captions made with other settings ({', '.join(changed)} differ): pass --force to start "
                "it over, or choose another --output"
            )
        for role, path in self.files.items():
            size = int(state["files"].get(role, 0))
            have = path.stat().st_size if path.exists() else 0
            if have < size:
                raise PipelineError(
                    f"{path} is shorter ({have} bytes) than its committed length {size} ({self.state_path}): "
                    "it was changed outside `caption`; pass --force to start over"
                )
        if state["rows"]:
            log.info("resuming %s: %d photos already done", main, int(state["rows"]))
        return state

    def read(self, role: str) -> Iterator[dict[str, Any]]:
        """Stream the committed rows of one file (a line that is not JSON is an error naming the file)."""
        path, limit = self.files[role], self.sizes[role]
        done = 0
        with path.open("rb") as fh:
            for lineno, line in enumerate(fh, 1):
                done += len(line)
                if done > limit:
                    break
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise PipelineError(
                        f"{path} line {lineno} is not JSON ({exc}); pass --force to start over"
                    ) from None
                yield row

    def append(self, batches: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
        """Append one batch (rows per role) and commit it: after this returns a kill loses none of it."""
        role = self.main
        try:
            for role, rows in batches.items():
                if rows:
                    _write_all(self._fds[role], b"".join(dumps_row(r) for r in rows))
            for role, fd in self._fds.items():
                if batches.get(role):
                    os.fsync(fd)
        except OSError as exc:  # a full disk, a file-size limit: drop the torn batch now, name the file
            self._rollback()
            raise annotate_os_error(exc, "append captions to", self.files[role]) from None
        committed = dict(self.sizes)
        for role, fd in self._fds.items():
            if batches.get(role):
                self.sizes[role] = os.lseek(fd, 0, os.SEEK_CUR)
        main_rows = batches.get(self.main) or []
        try:
            self._save(self.rows + len(main_rows))
        except OSError:  # the position file could not be replaced: the batch is not committed, cut it off now
            self.sizes = committed
            self._rollback()
            raise
        self.done.update(str(r["key"]) for r in main_rows)
        self.rows += len(main_rows)

    def _rollback(self) -> None:
        """Cut every file back to its committed length (best effort: the next open does it too)."""
        for role, fd in self._fds.items():
            try:
                os.ftruncate(fd, self.sizes[role])
                os.lseek(fd, 0, os.SEEK_END)
            except OSError:
                log.warning("could not cut %s back to its committed length; the next run will", self.files[role])

    def _save(self, rows: int | None = None) -> None:
        atomic_write_json(
            self.state_path,
            {
                "version": VERSION,
                "files": dict(self.sizes),
                "rows": self.rows if rows is None else rows,
                "settings": self.settings,
            },
        )

    def close(self) -> None:
        """Close the files and free the lock (the committed rows stay readable with :meth:`read`)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        self.lock.release()

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
