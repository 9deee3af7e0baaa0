"""Expanding the image inputs of ``extract`` / ``caption`` / ``embed``, reporting every one that cannot be used.

Folders are scanned recursively (sorted, hidden entries skipped, the extension allowlist of
:data:`extractors.preprocess.IMAGE_EXTENSIONS`); files and globs are taken as given. Nothing is dropped
silently: a missing path, a glob that matches nothing, a dangling symbolic link, a link loop, and an entry
named like an image that is not a regular file (a folder ``x.jpg``, a FIFO) each come back as a *problem*
``(path, reason, detail)`` that the caller writes to its failures manifest and warns about by path.

Reasons: ``unreadable`` (missing, dangling link, link loop, no permission) and ``not_a_file``.

Inputs become :class:`ImageItem` records (key, path, given boxes, problem) for every command: keys are COCO ids
when the file name carries one (``COCO_train2014_000000150367.jpg`` -> ``150367``), otherwise the path relative
to the input folder, made from the file name the OS gives by the bytes-safe rule of :mod:`pipeline.core.keys`.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from extractors.preprocess import IMAGE_EXTENSIONS
from pipeline.core.errors import UsageError
from pipeline.core.fileio import read_json
from pipeline.core.keys import key_from_name, key_to_text

_COCO_ID = re.compile(r"^COCO_[A-Za-z]+\d*_(\d{12})$|^(\d{12})$")

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


@dataclass
class ImageItem:
    key: str
    path: Path
    boxes: np.ndarray | None = None  # given boxes (N, 4) x1y1x2y2 in original pixels
    problem: tuple[str, str] | None = None  # (reason, detail) found before reading: missing, dangling link, ...


def image_key(path: Path, root: Path | None) -> str:
    """COCO id if the file stem is a COCO name (``COCO_train2014_000000150367`` or ``000000150367``), else
    the path relative to ``root`` (posix) or the file name."""
    m = _COCO_ID.match(path.stem)
    if m:
        return str(int(m.group(1) or m.group(2)))
    if root is not None:
        try:
            return key_from_name(path.relative_to(root).as_posix())
        except ValueError:
            pass
    return key_from_name(path.name)


def items_from_paths(paths: list[str | Path]) -> list[ImageItem]:
    """Folders (recursive), files and globs -> items; duplicate keys are a usage error.

    Inputs that cannot be images (a missing path, a dangling or looping link, a folder named like an image)
    become items carrying their ``problem``: the run reports each by path and goes on.
    """
    items: list[ImageItem] = []
    for p in paths:
        p = Path(p)
        root = p if p.is_dir() else glob_root(p)
        scan = scan_images([p])
        for f in scan.files:
            items.append(ImageItem(image_key(f, root), f))
        for f, reason, detail in scan.problems:
            items.append(ImageItem(image_key(f, root), f, problem=(reason, detail)))
    return unique_items(rekey_collisions(items))


def glob_root(pattern: Path) -> Path | None:
    """The folder a glob pattern is relative to (its parts before the first wildcard), None for a plain path:
    ``trip/*/IMG_0001.JPG`` -> ``trip``, so the matches are keyed ``day1/IMG_0001.JPG``, ``day2/IMG_0001.JPG``."""
    if not glob.has_magic(str(pattern)):
        return None
    parts = []
    for part in pattern.parts:
        if glob.has_magic(part):
            break
        parts.append(part)
    return Path(*parts) if parts else Path(".")


def rekey_collisions(items: list[ImageItem]) -> list[ImageItem]:
    """Different files that got one key (``a/x.jpg`` and ``b/x.jpg`` given as two folders) are keyed by their
    paths relative to the folder they share instead of being refused; keys that do not collide are kept."""
    paths: dict[str, set[Path]] = {}
    for it in items:
        paths.setdefault(it.key, set()).add(it.path)
    clash = {k for k, ps in paths.items() if len(ps) > 1}
    if not clash:
        return items
    out = []
    for it in items:
        if it.key in clash:
            group = sorted(paths[it.key])
            base = Path(os.path.commonpath([os.path.abspath(q) for q in group]))
            rel = Path(os.path.abspath(it.path)).relative_to(base)
            it = ImageItem(key_from_name(rel.as_posix()), it.path, it.boxes, it.problem)
        out.append(it)
    return out


def decode_text(raw: bytes) -> str:
    """A text file as saved by any editor: a UTF-8 byte-order mark (Windows Notepad) is dropped, UTF-16 with its
    mark is decoded as such, and bytes that are not UTF-8 stay exact (``surrogateescape``) for file names."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        return raw.decode("utf-16", "surrogatepass")
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    return raw.decode("utf-8", "surrogateescape")


def items_from_file_list(list_file: Path, base: Path | None = None) -> list[ImageItem]:
    """One image path per line (relative paths resolved against the list's folder or ``base``)."""
    if not list_file.is_file():
        raise UsageError(f"file list not found: {list_file}")
    root = base or list_file.parent
    items = []
    try:
        text = decode_text(list_file.read_bytes())
    except OSError as exc:
        raise UsageError(f"cannot read file list {list_file}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"file list {list_file} starts with a UTF-16 byte-order mark but is not UTF-16 text ({exc.reason} at "
            f"byte {exc.start}): save it as UTF-8 or UTF-16"
        ) from None
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            f = Path(line) if Path(line).is_absolute() else root / line
            items.append(ImageItem(image_key(f, root), f, problem=input_problem(f)))
    return unique_items(items)


def items_from_coco(ann_file: Path, image_root: Path | None, with_boxes: bool) -> list[ImageItem]:
    """COCO ``images`` (key = image id) from an annotations file; ``with_boxes`` attaches its ``bbox``es
    (xywh -> x1, y1, x1 + w, y1 + h) as given boxes."""
    data = read_json(ann_file, "COCO annotations file")
    if not isinstance(data.get("images"), list):
        raise UsageError(f"{ann_file}: not a COCO annotations file (no 'images' list)")
    root = image_root or ann_file.parent
    boxes: dict[int, list[list[float]]] = {}
    if with_boxes:
        for a in data.get("annotations", []):
            try:
                x, y, w, h = (float(v) for v in a["bbox"])
                boxes.setdefault(int(a["image_id"]), []).append([x, y, x + w, y + h])
            except (KeyError, TypeError, ValueError):
                raise UsageError(f"{ann_file}: annotation {a.get('id', '?')} has no valid 'bbox'") from None
    items = []
    for im in data["images"]:
        try:
            iid, name = int(im["id"]), str(im["file_name"])
        except (KeyError, TypeError, ValueError):
            raise UsageError(f"{ann_file}: an image entry lacks 'id' or 'file_name'") from None
        b = np.asarray(boxes.get(iid, []), dtype=np.float32).reshape(-1, 4) if with_boxes else None
        items.append(ImageItem(str(iid), root / name, b, problem=input_problem(root / name)))
    return unique_items(items)


def unique_items(items: list[ImageItem]) -> list[ImageItem]:
    """``items`` without repeats, in order; two paths with one key are a usage error."""
    seen: dict[str, Path] = {}
    for it in items:
        if it.key in seen and seen[it.key] != it.path:
            raise UsageError(
                f"two images map to the same key {key_to_text(it.key)!r}: {key_to_text(str(seen[it.key]))} "
                f"and {key_to_text(str(it.path))}"
            )
        seen[it.key] = it.path
    out, done = [], set()
    for it in items:
        if it.key not in done:
            done.add(it.key)
            out.append(it)
    return out


def shard_items(items: list[ImageItem], index: int, count: int, block: int = 1) -> list[ImageItem]:
    """Every ``count``-th block of ``block`` consecutive items, starting at block ``index`` (shards are disjoint
    and cover the list). ``block = 1``: every n-th image (``--shard``); ``block = batch size`` (torchrun) keeps
    each image in the same batch as a one-process run."""
    if count < 1 or not 0 <= index < count:
        raise UsageError(f"shard {index}/{count} is invalid: need 0 <= i < n")
    block = max(1, int(block))
    return [it for start in range(index * block, len(items), count * block) for it in items[start : start + block]]
