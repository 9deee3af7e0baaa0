"""Reading values out of public feature files without trusting them (docs/extractor.md#importing-untrusted-files).

One home for the bounds and the checks every format's reader applies before a record reaches the store:

* :func:`parse_json`: a JSON field with its nesting depth checked by a bracket scan before parsing (no
  recursion on the input) and every number bounded in length and finite;
* :func:`read_dataset`: an HDF5 dataset reached by a hard link only (soft and external links are refused
  before they are followed), numeric, of the expected rank, no zero-sized axis, bounded in size;
* :func:`numeric_array`: the same kind, rank and size checks for any other array, and :func:`read_npy` for an
  ``.npy`` file or npz member, checked from its header before its data is read;
* :func:`check_record`: the whole record (arrays, image size, per-region fields, the per-image pooled vector)
  validated as the store would, so a row is accepted or refused completely before the store sees it.

Every refusal is a :class:`~pipeline.core.errors.PipelineError` naming the row's file and line or key: the
import lists it as a bad row (``--skip-bad``) or stops on it with the rows before it committed.
"""

from __future__ import annotations

import json
import re
import zipfile
from typing import Any, BinaryIO, NamedTuple

import h5py
import numpy as np
from h5py import h5l

from pipeline.core.errors import PipelineError
from pipeline.core.regions import OPTIONAL_FIELDS
from pipeline.store.format import MAX_POOLED_DIM
from pipeline.store.validate import MAX_IMAGE_SIDE, validate_image

MAX_ROW_BYTES = 64 << 20
"""Longest TSV row read (a 100-box row of 2054-d float32 features in base64 is about 1.1 MB)."""
MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays and objects in a JSON field (a prediction row nests 3 deep)."""
MAX_NUMBER_CHARS = 64
"""Longest number literal in a JSON field (a float32 written in full fits in 50 characters)."""
MAX_ARRAY_ELEMENTS = 1 << 28
"""Most elements of one image's array (1 GiB of float32; 1000 regions of 2054-d features hold 2 million)."""
NUMERIC_KINDS = "fiu"  # float, signed and unsigned integer: what the store casts to its dtypes

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _bounded_number(text: str, where: str) -> str:
    if len(text) > MAX_NUMBER_CHARS:
        raise PipelineError(f"{where}: a JSON number of {len(text)} digits (at most {MAX_NUMBER_CHARS} are read)")
    return text


def _parse_float(text: str, where: str) -> float:
    value = float(_bounded_number(text, where))
    if not np.isfinite(value):
        raise PipelineError(f"{where}: the JSON number {text} is out of the float range")
    return value


def _refuse_constant(name: str, where: str) -> None:
    raise PipelineError(f"{where}: JSON holds {name}, not a number")


def json_depth(text: str) -> int:
    """Deepest nesting of ``[``/``{`` in ``text``, brackets inside strings not counted: a linear scan in bounded
    memory (only the brackets are kept, then summed a block at a time)."""
    brackets = _STRING.sub('""', text).encode("utf-8", "surrogatepass").translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for start in range(0, len(brackets), 1 << 20):
        block = np.frombuffer(brackets, dtype=np.uint8, count=min(1 << 20, len(brackets) - start), offset=start)
        level = depth + np.cumsum(1 - 2 * ((block >> 2) & 1).astype(np.int32))  # [ { open (+1), ] } close (-1)
        deepest, depth = max(deepest, int(level.max())), int(level[-1])
    return deepest


def parse_json(data: bytes | str, where: str, what: str = "the JSON column") -> Any:
    """Parse one JSON field of an untrusted row: depth at most :data:`MAX_JSON_DEPTH`, numbers at most
    :data:`MAX_NUMBER_CHARS` characters and finite, no ``NaN``/``Infinity``; anything else is a PipelineError."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError:
        raise PipelineError(f"{where}: {what} is not UTF-8") from None
    if json_depth(text) > MAX_JSON_DEPTH:
        raise PipelineError(f"{where}: {what} is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(
            text,
            parse_int=lambda s: int(_bounded_number(s, where)),
            parse_float=lambda s: _parse_float(s, where),
            parse_constant=lambda s: _refuse_constant(s, where),
        )
    except ValueError as exc:  # JSONDecodeError included
        raise PipelineError(f"{where}: {what} is not valid JSON ({str(exc).splitlines()[0][:80]})") from None


def numeric_array(arr: Any, where: str, what: str, ndim: int) -> np.ndarray:
    """``arr`` as an ndarray if it is numeric (float or integer), of rank ``ndim``, with no zero-sized axis and at
    most :data:`MAX_ARRAY_ELEMENTS` elements."""
    dtype = getattr(arr, "dtype", None)
    if dtype is None or dtype.kind not in NUMERIC_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise PipelineError(f"{where}: {what} is not a numeric array (dtype {dtype})")
    shape = tuple(int(n) for n in (arr.shape or ()))  # an HDF5 dataset with no dataspace has shape None
    if len(shape) != ndim:
        raise PipelineError(f"{where}: {what} has shape {shape}, expected {ndim} axes")
    if 0 in shape:
        raise PipelineError(f"{where}: {what} has shape {shape}: an empty axis")
    if int(np.prod(shape, dtype=np.float64)) > MAX_ARRAY_ELEMENTS:
        raise PipelineError(f"{where}: {what} has shape {shape}, more than {MAX_ARRAY_ELEMENTS} elements")
    return arr


def read_npy(fp: BinaryIO, where: str, what: str, ndim: int) -> np.ndarray:
    """An ``.npy`` array from an open binary stream (a file or an npz member), its header checked by
    :func:`numeric_array` before any data is read: a header cannot make the reader allocate more than the bound,
    and object (pickled) arrays are never loaded."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fp)
        header = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(version)
        if header is None:
            raise PipelineError(f"{where}: {what} is an .npy file of version {version} (1.0 and 2.0 are read)")
        shape, fortran, dtype = header(fp)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise PipelineError(f"{where}: {what} is not a readable .npy array ({str(exc).splitlines()[0][:80]})") from None
    numeric_array(_Header(shape, dtype), where, what, ndim)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    try:
        data = fp.read(nbytes)
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise PipelineError(f"{where}: {what} cannot be read ({str(exc).splitlines()[0][:80]})") from None
    if len(data) != nbytes:
        raise PipelineError(f"{where}: {what} holds {len(data)} bytes of data, its header says {nbytes}")
    return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C")


class _Header(NamedTuple):
    shape: tuple[int, ...]
    dtype: np.dtype


def read_dataset(group: Any, name: str, where: str, ndim: int) -> np.ndarray:
    """The array of dataset ``name`` in an open h5py ``group``, checked before it is read: reached by a hard link
    (a soft or external link is refused, not followed), a dataset (not a group), and :func:`numeric_array`."""
    link = name.encode("utf-8", "surrogateescape")
    try:
        exists = group.id.links.exists(link)
        kind = group.id.links.get_info(link).type if exists else None
    except (KeyError, ValueError, RuntimeError, OSError):
        exists, kind = False, None
    if not exists:
        raise PipelineError(f"{where}: dataset {name} is missing")
    if kind == h5l.TYPE_SOFT:
        raise PipelineError(f"{where}: {name} is a soft link (only datasets stored in the file are read)")
    if kind == h5l.TYPE_EXTERNAL:
        raise PipelineError(f"{where}: {name} is an external link (only datasets stored in the file are read)")
    if kind != h5l.TYPE_HARD:
        raise PipelineError(f"{where}: {name} is a user-defined link (only datasets stored in the file are read)")
    try:
        obj = group[name]
    except (KeyError, ValueError, RuntimeError, OSError) as exc:
        raise PipelineError(f"{where}: {name} cannot be opened ({str(exc).splitlines()[0]})") from None
    if not isinstance(obj, h5py.Dataset):
        what = "a group" if isinstance(obj, h5py.Group) else type(obj).__name__
        raise PipelineError(f"{where}: {name} is {what}, not a dataset")
    if h5py.check_vlen_dtype(obj.dtype) is not None or h5py.check_string_dtype(obj.dtype) is not None:
        raise PipelineError(f"{where}: {name} is not a numeric array (dtype {obj.dtype})")
    numeric_array(obj, where, name, ndim)  # kind, rank and size from the header, before any data is read
    try:
        return np.asarray(obj[()])
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        raise PipelineError(f"{where}: {name} cannot be read ({str(exc).splitlines()[0]})") from None


def check_size(width: Any, height: Any, where: str) -> tuple[int, int]:
    """An image size: two integers (not bools or floats) in 1..MAX_IMAGE_SIDE."""
    for value in (width, height):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise PipelineError(f"{where}: image size {width!r}x{height!r} is not two integers")
    if not (0 < width <= MAX_IMAGE_SIDE and 0 < height <= MAX_IMAGE_SIDE):
        raise PipelineError(f"{where}: image size {width}x{height} is outside 1..{MAX_IMAGE_SIDE}")
    return int(width), int(height)


def check_record(rec: dict[str, Any], where: str) -> None:
    """Validate a decoded record completely, as the store will (:func:`pipeline.store.validate_image`), so that a
    malformed row is refused before it can open, shape or enter the store."""
    feats = numeric_array(rec.get("features"), where, "features", 2)
    boxes = numeric_array(rec.get("boxes"), where, "boxes", 2)
    w, h = check_size(rec.get("image_w"), rec.get("image_h"), where)
    extras = {name: numeric_array(rec[name], where, name, 1) for name in OPTIONAL_FIELDS if rec.get(name) is not None}
    validate_image(rec.get("key"), feats, np.asarray(boxes, dtype=np.float32), w, h, extras, None, where)
    if rec.get("pooled") is not None:
        pooled = numeric_array(rec["pooled"], where, "pooled vector", 1)
        if pooled.shape[0] > MAX_POOLED_DIM:
            raise PipelineError(f"{where}: pooled vector of {pooled.shape[0]} values (at most {MAX_POOLED_DIM})")
        if not np.isfinite(pooled).all():
            raise PipelineError(f"{where}: pooled vector contains NaN or infinity")
