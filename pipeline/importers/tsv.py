"""Bottom-up-attention TSV files: the original BUTD format and LXMERT's ``obj36`` format (read and write).

Both are tab-separated, header-less, one image per ``\\r\\n``-terminated line, arrays as standard base64 of
C-order little-endian buffers (peteanderson80/bottom-up-attention ``tools/generate_tsv.py``; airsplay/lxmert):

* ``butd``:  image_id, image_w, image_h, num_boxes, boxes f32[K,4], features f32[K,D]   (width first)
* ``obj36``: img_id, img_h, img_w, objects_id i64[K], objects_conf f32[K], attrs_id i64[K],
  attrs_conf f32[K], num_boxes, boxes f32[K,4], features f32[K,D]                       (height first)

The ``image_id`` column holds the key's text form (:func:`pipeline.core.keys.key_to_text`: backslash escapes
for undecodable bytes, control characters, tabs and line breaks), so any key a store holds is written on one
line and read back exactly; a plain id (``397133``) is written as itself.

Files are streamed line by line (a line is ~400 KB for 36 boxes); nothing else is held in memory.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from pipeline.core.errors import PipelineError
from pipeline.core.keys import key_from_text, key_to_text
from pipeline.importers.formats import Format, register_format
from pipeline.importers.untrusted import MAX_ROW_BYTES

Record = dict[str, Any]

BUTD_COLUMNS = ("image_id", "image_w", "image_h", "num_boxes", "boxes", "features")
OBJ36_COLUMNS = (
    "img_id",
    "img_h",
    "img_w",
    "objects_id",
    "objects_conf",
    "attrs_id",
    "attrs_conf",
    "num_boxes",
    "boxes",
    "features",
)
#: column -> (the record field it holds, how it is stored): ``key`` the image id, ``int`` a decimal number,
#: ``num_boxes`` the region count K, ``<i8`` / ``<f4`` base64 of one value per region, ``boxes`` base64 float32
#: (K, 4), ``features`` base64 float32 (K, D)
COLUMN_FIELDS = {
    "image_id": ("key", "key"),
    "img_id": ("key", "key"),
    "image_w": ("image_w", "int"),
    "img_w": ("image_w", "int"),
    "image_h": ("image_h", "int"),
    "img_h": ("image_h", "int"),
    "objects_id": ("class_ids", "<i8"),
    "objects_conf": ("class_scores", "<f4"),
    "attrs_id": ("attr_ids", "<i8"),
    "attrs_conf": ("attr_scores", "<f4"),
    "num_boxes": ("", "num_boxes"),
    "boxes": ("boxes", "boxes"),
    "features": ("features", "features"),
}
COCO_STEM = re.compile(r"^COCO_[a-z]+\d{4}_0*(\d+)$")


def _int(text: bytes, column: str, where: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise PipelineError(f"{where}: column {column} is not an integer: {text[:40]!r}") from None


def _array(text: bytes, dtype: str, count: int | None, column: str, where: str) -> np.ndarray:
    """Decode a base64 field; ``count`` (if given) is the exact number of elements expected."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise PipelineError(f"{where}: column {column} is not valid base64 ({exc})") from None
    item = np.dtype(dtype).itemsize
    if len(raw) % item or (count is not None and len(raw) != count * item):
        want = f"{count * item}" if count is not None else f"a multiple of {item}"
        raise PipelineError(f"{where}: column {column} decodes to {len(raw)} bytes, expected {want}")
    return np.frombuffer(raw, dtype=dtype)


def _features(text: bytes, k: int, where: str) -> np.ndarray:
    flat = _array(text, "<f4", None, "features", where)
    if k <= 0 or flat.size % k or flat.size == 0:
        raise PipelineError(f"{where}: features hold {flat.size} floats, not a multiple of num_boxes={k}")
    return flat.reshape(k, -1)


def coco_key(raw: str) -> str:
    """``COCO_train2014_000000132417`` -> ``132417``; other ids unchanged."""
    m = COCO_STEM.match(raw)
    return str(int(m.group(1))) if m else raw


def _key(field: bytes, where: str) -> str:
    """The key of an ``image_id`` field: UTF-8 text form (undecodable bytes kept as surrogate escapes)."""
    try:
        text = field.decode("utf-8")
    except UnicodeDecodeError:
        text = field.decode("utf-8", "surrogateescape")
    try:
        return key_from_text(text)
    except PipelineError as exc:
        raise PipelineError(f"{where}: image id column: {exc}") from None


def _key_field(key: str) -> bytes:
    return key_to_text(key).encode("utf-8")


def iter_lines(path: Path) -> Iterator[tuple[str, list[bytes] | None]]:
    """(``file:line``, tab-split fields) for every non-empty line, streaming; a line longer than
    :data:`~pipeline.importers.untrusted.MAX_ROW_BYTES` is skipped unread and yields ``None`` for its fields."""
    with path.open("rb") as fh:
        lineno = 0
        while line := fh.readline(MAX_ROW_BYTES + 1):
            lineno += 1
            if len(line) > MAX_ROW_BYTES:
                while line and not line.endswith(b"\n"):  # the rest of the row, in bounded pieces
                    line = fh.readline(1 << 20)
                yield f"{path}:{lineno}", None
                continue
            line = line.rstrip(b"\r\n")
            if line:
                yield f"{path}:{lineno}", line.split(b"\t")


def row_thunk(
    fields: list[bytes] | None, where: str, decode: Callable[[list[bytes], str], Record]
) -> Callable[[], Record]:
    """The ``decode()`` a reader yields for one row of :func:`iter_lines` (an over-long row is a bad row)."""

    def thunk() -> Record:
        if fields is None:
            raise PipelineError(f"{where}: the row is longer than {MAX_ROW_BYTES} bytes (not read)")
        return decode(fields, where)

    return thunk


def _row_header(fields: list[bytes], columns: tuple[str, ...], layout: str, where: str) -> tuple[str, int, str]:
    """``(key, num_boxes, where)`` of a row laid out as ``columns``; the returned ``where`` names the image, for
    the errors of the other columns."""
    if len(fields) != len(columns):
        raise PipelineError(
            f"{where}: expected {len(columns)} tab-separated columns ({layout}), found {len(fields)} (truncated row?)"
        )
    key = _key(fields[0], where)
    k = _int(fields[columns.index("num_boxes")], "num_boxes", where)
    return key, k, f"{where} (image {key_to_text(key)})"


def _decode_row(columns: tuple[str, ...], layout: str, fields: list[bytes], where: str, keys: str) -> Record:
    """One row laid out as ``columns`` (the format called ``layout`` in errors) -> record, fields in file order."""
    raw, k, where = _row_header(fields, columns, layout, where)
    rec: Record = {"key": coco_key(raw) if keys == "coco-id" else raw}
    for text, column in zip(fields, columns):
        field, stored = COLUMN_FIELDS[column]
        if stored == "int":
            rec[field] = _int(text, column, where)
        elif stored == "boxes":
            rec[field] = _array(text, "<f4", k * 4, column, where).reshape(k, 4)
        elif stored == "features":
            rec[field] = _features(text, k, where)
        elif stored.startswith("<"):
            rec[field] = _array(text, stored, k, column, where)
    return rec


def decode_butd(fields: list[bytes], where: str, keys: str = "raw") -> Record:
    """One original BUTD row -> record (float32 arrays as stored in the file)."""
    return _decode_row(BUTD_COLUMNS, "BUTD TSV", fields, where, keys)


def decode_obj36(fields: list[bytes], where: str, keys: str = "coco-id") -> Record:
    """One LXMERT obj36 row -> record with class and attribute ids/confidences."""
    return _decode_row(OBJ36_COLUMNS, "obj36 TSV", fields, where, keys)


def _decode_keys(
    decode: Callable[[list[bytes], str, str], Record], fields: list[bytes], where: str, keys: str
) -> Record:
    return decode(fields, where, keys)


def tsv_reader(
    decode: Callable[[list[bytes], str, str], Record],
) -> Callable[..., Iterator[tuple[str, Callable[[], Record]]]]:
    """A source reader yielding (where, decode-thunk) per row, so a bad row can be skipped and reported."""

    def read(sources: list[Path], keys: str, **_: Any) -> Iterator[tuple[str, Callable[[], Record]]]:
        for path in sources:
            if not path.is_file():
                raise PipelineError(f"TSV file not found: {path}")
            for where, fields in iter_lines(path):
                yield where, row_thunk(fields, where, partial(_decode_keys, decode, keys=keys))

    return read


def _b64(arr: np.ndarray, dtype: str) -> bytes:
    return base64.b64encode(np.ascontiguousarray(arr, dtype=dtype).tobytes())


def _encode_row(columns: tuple[str, ...], fmt: str, rec: Record) -> bytes:
    """A record -> one ``\\r\\n``-terminated row laid out as ``columns`` (the format ``fmt``); the per-region fields
    the format needs must be in the record."""
    for field, stored in (COLUMN_FIELDS[column] for column in columns):
        if stored.startswith("<") and field not in rec:
            raise PipelineError(
                f"image {key_to_text(rec['key'])}: the store has no {field}, which the {fmt} format needs"
            )
    feats = np.asarray(rec["features"])
    cells = []
    for field, stored in (COLUMN_FIELDS[column] for column in columns):
        if stored == "key":
            cells.append(_key_field(rec["key"]))
        elif stored == "int":
            cells.append(str(rec[field]).encode())
        elif stored == "num_boxes":
            cells.append(str(len(feats)).encode())
        elif stored == "features":
            cells.append(_b64(feats, "<f4"))
        else:
            cells.append(_b64(rec[field], "<f4" if stored == "boxes" else stored))
    return b"\t".join(cells) + b"\r\n"


def encode_butd(rec: Record) -> bytes:
    return _encode_row(BUTD_COLUMNS, "butd", rec)


def encode_obj36(rec: Record) -> bytes:
    return _encode_row(OBJ36_COLUMNS, "obj36", rec)


def write_tsv(out: BinaryIO, records: Iterator[Record], fmt: str) -> int:
    """Write records in ``fmt`` (``butd`` or ``obj36``) to ``out``; returns the row count."""
    encode = {"butd": encode_butd, "obj36": encode_obj36}[fmt]
    n = 0
    for rec in records:
        out.write(encode(rec))
        n += 1
    return n


# both from the Caffe model: peteanderson80/bottom-up-attention tools/generate_tsv.py, and LXMERT's obj36 files
# (airsplay/lxmert extract_coco_image.py)
for fmt, decode, default_keys, help_line in (
    ("butd", decode_butd, "raw", "original bottom-up TSV, trainval_36 or adaptive 10-100 boxes"),
    ("obj36", decode_obj36, "coco-id", "LXMERT obj36 TSV, with object and attribute ids"),
):
    register_format(
        Format(
            f"{fmt}-tsv",
            tsv_reader(decode),
            default_keys,
            False,
            partial(write_tsv, fmt=fmt),
            help=help_line,
        )
    )
