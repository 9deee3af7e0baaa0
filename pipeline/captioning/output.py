"""Result files of ``cli caption``: formats, rows, COCO image ids, and the final file built from the journal.

Every format streams: rows go to a JSON-lines journal as they are produced (the ``.jsonl`` output itself, or
``<output>.journal.jsonl`` for the other formats, see :mod:`pipeline.captioning.journal`); ``.json``, ``.csv``
and ``coco`` files are then written from the journal line by line, atomically, at the end of a run.

Outputs are strict: JSON and JSON lines never hold ``NaN`` or ``Infinity`` (a non-finite score is ``null``), and a
CSV cell that starts like a spreadsheet formula (``=``, ``+``, ``-``, ``@``, tab, carriage return) is written with a
leading apostrophe (:func:`csv_cell`), so opening the file never runs a photo's name as a formula.

File names and keys are written with the bytes-safe rule of :mod:`pipeline.core.keys` (their text form), so a
name that is not valid UTF-8 (``caf\\xe9.jpg``) is kept losslessly in JSON, JSON lines and CSV.

COCO results (``--format coco``) are ``[{"image_id": int, "caption": str}]``, the file the COCO caption
evaluation server and its toolkit (``pycocoevalcap``) read. Image ids come from the file names as COCO names
its images (``COCO_val2014_000000391895.jpg`` -> 391895, ``000000391895.jpg`` -> 391895, ``391895.jpg``), or from
``--image-ids FILE``: a JSON object ``{file name or path: id}`` or a COCO annotations file (``images``).
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from pipeline.captioning.journal import dumps_row
from pipeline.core.errors import UsageError
from pipeline.core.fileio import atomic_write, read_json
from pipeline.core.keys import key_to_text

FORMATS = ("jsonl", "json", "csv", "coco")
_SUFFIX = {"jsonl": ".jsonl", "json": ".json", "csv": ".csv", "coco": ".json"}
_COCO_NAME = re.compile(r"^(?:COCO_[A-Za-z]+\d*_)?(\d+)$")


@dataclass(frozen=True)
class OutputPlan:
    """Where results go: the final file, its format, the journal rows stream into and the failures manifest."""

    path: Path
    fmt: str
    journal: Path
    failures: Path


def plan_output(output: Path, fmt: str | None) -> OutputPlan:
    """Check ``--output``/``--format`` before any work (a mismatch is a usage error)."""
    suffix = output.suffix.lower()
    if fmt is None:
        fmt = {".jsonl": "jsonl", ".json": "json", ".csv": "csv"}.get(suffix)
        if fmt is None:
            raise UsageError(f"--output must end in .jsonl, .json or .csv, not {output.name}")
    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if suffix != _SUFFIX[fmt]:
        raise UsageError(
            f"--format {fmt} writes a {_SUFFIX[fmt]} file; --output {output.name} ends in {suffix or 'nothing'}"
        )
    journal = output if fmt == "jsonl" else output.with_name(output.name + ".journal.jsonl")
    failures = output.with_name(output.name[: -len(suffix)] + ".failures.jsonl")
    return OutputPlan(output, fmt, journal, failures)


def load_id_map(path: Path) -> dict[str, int]:
    """``--image-ids``: ``{name: id}`` JSON, or a COCO annotations file (``images`` with ``id``/``file_name``)."""
    data = read_json(path, "image-id mapping")
    pairs = (
        [(im.get("file_name"), im.get("id")) for im in data["images"] if isinstance(im, dict)]
        if isinstance(data.get("images"), list)
        else list(data.items())
    )
    out: dict[str, int] = {}
    for name, iid in pairs:
        if not isinstance(name, str) or isinstance(iid, bool) or not isinstance(iid, int):
            raise UsageError(
                f"image-id mapping {path}: entry {name!r} -> {iid!r} is not a file name with an integer id"
            )
        out[name] = iid
    return out


def coco_image_id(path: Path, key: str, mapping: Mapping[str, int] | None = None) -> int | None:
    """The COCO id of a photo: from ``mapping`` (by key, path or file name) or its numeric file name; else None."""
    if mapping:
        for name in (key, str(path), path.name):
            if name in mapping:
                return int(mapping[name])
    m = _COCO_NAME.match(path.stem)
    return int(m.group(1)) if m else None


def coco_ids(items: Sequence[Any], mapping: Mapping[str, int] | None) -> dict[str, int]:
    """key -> COCO id for every item; one usage error (naming the file) when an id cannot be derived or repeats."""
    ids: dict[str, int] = {}
    seen: dict[int, Path] = {}
    for it in items:
        iid = coco_image_id(it.path, it.key, mapping)
        if iid is None:
            raise UsageError(
                f"--format coco: no image id for {key_to_text(str(it.path))} (ids come from numeric file names such as "
                "COCO_val2014_000000391895.jpg); pass --image-ids MAP.json ({name: id} or a COCO annotations file)"
            )
        if iid in seen:
            raise UsageError(
                f"--format coco: {key_to_text(str(seen[iid]))} and {key_to_text(str(it.path))} both have image id {iid}"
            )
        seen[iid] = it.path
        ids[it.key] = iid
    return ids


def result_row(res: Any, with_nbest: bool, image_id: int | None = None) -> dict[str, Any]:
    """The JSON row of one :class:`pipeline.captioning.engine.CaptionResult` (keys in their text form)."""
    out: dict[str, Any] = {"image": key_to_text(str(res.path)), "key": key_to_text(res.key)}
    if image_id is not None:
        out["image_id"] = image_id
    if res.error:
        out["error"] = res.error
        return out
    out["caption"] = res.caption
    out["score"] = round(float(res.score), 5)
    if with_nbest:
        out["nbest"] = [{"caption": c, "score": round(float(s), 5)} for c, s in res.nbest]
    return out


def failure_row(res: Any) -> dict[str, Any]:
    """A failures-manifest row: key, path, reason (short code) and detail, as ``extract`` writes them."""
    reason, _, detail = (res.error or "").partition(": ")
    return {"key": key_to_text(res.key), "path": key_to_text(str(res.path)), "reason": reason, "detail": detail}


def _write_json(rows: Iterable[Mapping[str, Any]], fh: BinaryIO, coco: bool) -> int:
    n = 0
    fh.write(b"[")
    for row in rows:
        if coco:
            if "caption" not in row:
                continue
            row = {"image_id": row["image_id"], "caption": row["caption"]}
        fh.write((",\n " if n else "\n ").encode() + dumps_row(row).rstrip(b"\n"))
        n += 1
    fh.write(b"\n]\n")
    return n


#: first characters that make a spreadsheet read a cell as a formula (OWASP "CSV injection")
FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\n", "\uff1d", "\uff0b", "\uff0d", "\uff20")


def csv_cell(value: Any) -> Any:
    """A CSV cell a spreadsheet shows as text: a string that starts like a formula (``=``, ``+``, ``-``, ``@``, tab,
    carriage return, or their full-width forms) gets a leading apostrophe (OWASP's advice); numbers are kept."""
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    return value


def _write_csv(rows: Iterable[Mapping[str, Any]], fh: BinaryIO, with_nbest: bool) -> int:
    text = io.TextIOWrapper(fh, encoding="utf-8", newline="", write_through=True)
    fields = ["image", "key", "caption", "score", "error"] + (["nbest"] if with_nbest else [])
    w = csv.DictWriter(text, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    n = 0
    for r in rows:
        if "nbest" in r:
            r = dict(r, nbest=" | ".join(f"{h['caption']} ({h['score']})" for h in r["nbest"]))
        w.writerow({k: csv_cell(v) for k, v in r.items()})
        n += 1
    text.flush()
    text.detach()
    return n


def finalize(plan: OutputPlan, rows: Iterator[Mapping[str, Any]], with_nbest: bool) -> int:
    """Write the final ``.json``/``.csv``/COCO file from the journal's rows (streamed); returns rows written."""
    written = [0]

    def write(fh: BinaryIO) -> None:
        if plan.fmt == "csv":
            written[0] = _write_csv(rows, fh, with_nbest)
        else:
            written[0] = _write_json(rows, fh, plan.fmt == "coco")

    if plan.fmt != "jsonl":
        atomic_write(plan.path, write)
    return written[0]
