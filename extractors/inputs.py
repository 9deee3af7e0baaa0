"""Expanding the image inputs of ``extract`` / ``caption`` / ``embed``, reporting every one that cannot be used.

Folders are scanned recursively (sorted, hidden entries skipped, the extension allowlist of
:data:`extractors.preprocess.IMAGE_EXTENSIONS`); files and globs are taken as given. Nothing is dropped
silently: a missing path, a glob that matches nothing, a dangling symbolic link, a link loop, and an entry
named like an image that is not a regular file (a folder ``x.jpg``, a FIFO) each come back as a *problem*
``(path, reason, detail)`` that the caller writes to its failures manifest and warns about by path.

Reasons: ``unreadable`` (missing, dangling link, link loop, no permission) and ``not_a_file``.
"""

from __future__ import annotations

import errno
import glob
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from extractors.preprocess import IMAGE_EXTENSIONS

Problem = tuple[Path, str, str]


@dataclass
class Scan:
    """Usable image files (in order, without duplicates) and the inputs that cannot be used."""

    files: list[Path] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def input_problem(path: Path) -> tuple[str, str] | None:
    """Why ``path`` cannot be read as an image file (``(reason, detail)``), or None for a regular file."""
    try:
        st = os.stat(path)
    except ValueError:  # an embedded NUL (from a file list or a COCO file): no file can have that name
        return "unreadable", "the path contains a NUL character"
    except FileNotFoundError:
        if os.path.islink(path):
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            return "unreadable", f"dangling symbolic link (points to {target}, which does not exist)"
        return "unreadable", "no such file or directory"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "unreadable", "symbolic link loop"
        return "unreadable", f"{type(exc).__name__}: {exc.strerror or exc}"
    if stat.S_ISDIR(st.st_mode):
        return "not_a_file", "a folder, not an image file"
    if not stat.S_ISREG(st.st_mode):
        kind = "FIFO" if stat.S_ISFIFO(st.st_mode) else "socket" if stat.S_ISSOCK(st.st_mode) else "device"
        return "not_a_file", f"a {kind}, not a regular file"
    return None


def _is_image_name(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS


def _scan_folder(root: Path, scan: Scan) -> None:
    entries: list[Path] = []

    def on_error(exc: OSError) -> None:
        where = Path(exc.filename) if exc.filename else root
        scan.problems.append((where, "unreadable", f"cannot list folder: {exc.strerror or exc}"))

    for folder, dirs, names in os.walk(root, onerror=on_error):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        base = Path(folder)
        for name in names + dirs:
            if not name.startswith(".") and _is_image_name(Path(name)):
                entries.append(base / name)
    for entry in sorted(set(entries)):
        problem = input_problem(entry)
        if problem is None:
            scan.files.append(entry)
        else:  # a folder named x.jpg is reported (and its contents are still scanned)
            scan.problems.append((entry, *problem))


def scan_images(paths: list[str | Path]) -> Scan:
    """Expand folders (recursive), files and globs into image files, and list every unusable input."""
    scan = Scan()
    for p in paths:
        p = Path(p)
        if p.is_dir():
            _scan_folder(p, scan)
            continue
        problem = input_problem(p)
        if problem is None:
            scan.files.append(p)
        elif problem[1] == "no such file or directory" and glob.has_magic(str(p)):
            matches = sorted(Path(g) for g in glob.glob(str(p), recursive=True))
            if not matches:
                scan.problems.append((p, "unreadable", "no file matches this pattern"))
            for m in matches:
                why = input_problem(m)
                if why is None:
                    scan.files.append(m)
                elif _is_image_name(m):
                    scan.problems.append((m, *why))
        else:
            scan.problems.append((p, *problem))
    seen: set[Path] = set()
    files = []
    for f in scan.files:
        if f not in seen:
            seen.add(f)
            files.append(f)
    scan.files = files
    return scan
