"""VinVL feature TSVs and RSTNet / DLCT grid HDF5 files (docs/extractor.md#feature-store).

``vinvl-tsv`` reads two row kinds, both tab-separated with the image key first:

* the released Oscar / VinVL ``*.feature.tsv``: ``key \\t num_boxes \\t base64(float32[num_boxes * D])`` with
  D = 2054 (the 2048-d region feature followed by the 6-d position ``[x1/W, y1/H, x2/W, y2/H, w/W, h/H]``,
  MMF ``_norm_box``; pzzhang/VinVL#11) or D = 2048. The boxes come back from the position times the image size
  (``--sizes``); a 2048-d row has no boxes and is refused;
* scene_graph_benchmark's own prediction TSV: ``key \\t {"objects": [{"rect": [x1, y1, x2, y2], "conf": c,
  "feature": base64(float32[2048]), ...}]}``: boxes from ``rect`` (original pixels), features decoded. Class
  names are not imported (the store keeps vocabulary ids; ``conf`` alone is not a class).

The store keeps every column of the row as the feature (2054-d rows stay 2054-d, what Oscar-style models
read). ``export-features --format vinvl-tsv`` writes the released layout: features get the 6-d position appended
(2048 -> 2054), 2054-d features (imported from a VinVL TSV) are written as they are.

``grid-hdf5`` reads RSTNet's ``X101_grid_feats_coco_*.hdf5`` / DLCT's grid datasets ``'%d_grids'`` [N, 2048]
(N = 49 for the 7x7 pooled grid-feats-vqa maps). The files hold no boxes: a square N = k * k grid gets the k x k
equal cells of the image (``--sizes``) as boxes, an approximation of the pooled bins (docs/recipes.md#grid).
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.keys import key_to_text
from pipeline.importers.formats import Format, register_format, require_sizes
from pipeline.importers.tsv import coco_key, iter_lines, row_thunk
from pipeline.importers.untrusted import parse_json, read_dataset
from pipeline.store.segment import open_hdf5_readonly

POSITION = 6
Record = dict[str, Any]


def position(boxes: np.ndarray, w: int, h: int) -> np.ndarray:
    """MMF ``_norm_box``: ``[x1/W, y1/H, x2/W, y2/H, (x2-x1)/W, (y2-y1)/H]`` (original pixels, no +1, no clip)."""
    b = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    x1, y1, x2, y2 = b[:, 0], b[:, 1], b[:, 2], b[:, 3]
    return np.stack([x1 / w, y1 / h, x2 / w, y2 / h, (x2 - x1) / w, (y2 - y1) / h], axis=1).astype(np.float32)


def _b64_floats(text: bytes | str, where: str, what: str) -> np.ndarray:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise PipelineError(f"{where}: {what} is not valid base64") from None
    if len(raw) % 4:
        raise PipelineError(f"{where}: {what} has {len(raw)} bytes, not a float32 array")
    arr = np.frombuffer(raw, dtype="<f4")
    if not np.isfinite(arr).all():
        raise PipelineError(f"{where}: {what} holds non-finite values")
    return arr


def _size(key: str, raw: str, sizes: dict[str, tuple[int, int]], where: str) -> tuple[int, int]:
    for k in (key, raw):
        if k in sizes:
            return sizes[k]
    raise PipelineError(f"{where}: image {key_to_text(key)} has no size in the --sizes file")


def decode_vinvl(fields: list[bytes], where: str, keys: str, sizes: dict[str, tuple[int, int]]) -> Record:
    """One ``vinvl-tsv`` row (either kind) -> record."""
    try:
        raw = fields[0].decode("utf-8")
    except UnicodeDecodeError:
        raise PipelineError(f"{where}: the image key is not UTF-8") from None
    key = coco_key(raw) if keys == "coco-id" else raw
    where = f"{where} (image {key_to_text(raw)})"
    w, h = _size(key, raw, sizes, where)
    if len(fields) == 3:
        try:
            k = int(fields[1])
        except ValueError:
            raise PipelineError(f"{where}: num_boxes {fields[1][:20]!r} is not an integer") from None
        flat = _b64_floats(fields[2], where, "the feature column")
        if k <= 0 or flat.size % k:
            raise PipelineError(f"{where}: {flat.size} floats do not split into {k} boxes")
        feats = flat.reshape(k, -1)
        if feats.shape[1] <= 2048 or feats.shape[1] - POSITION < 1:
            raise PipelineError(f"{where}: {feats.shape[1]}-d rows carry no box position (the released 2054-d rows do)")
        pos = feats[:, -POSITION:]
        boxes = np.stack([pos[:, 0] * w, pos[:, 1] * h, pos[:, 2] * w, pos[:, 3] * h], axis=1).astype(np.float32)
        return {"key": key, "features": feats.copy(), "boxes": boxes, "image_w": w, "image_h": h}
    if len(fields) != 2:
        raise PipelineError(
            f"{where}: expected 3 (key, num_boxes, features) or 2 (key, json) tab-separated columns, "
            f"found {len(fields)}"
        )
    row = parse_json(fields[1], where, "the predictions column")
    objects = row.get("objects") if isinstance(row, dict) else None
    if not isinstance(objects, list):
        raise PipelineError(f"{where}: not a scene_graph_benchmark prediction row (json with an objects list)")
    if not objects:
        raise PipelineError(f"{where}: no objects")
    rects, feats = [], []
    for i, obj in enumerate(objects):
        rect = obj.get("rect") if isinstance(obj, dict) else None
        feature = obj.get("feature") if isinstance(obj, dict) else None
        good_rect = isinstance(rect, list) and len(rect) == 4 and all(_is_number(v) for v in rect)
        if not good_rect or not isinstance(feature, str):
            raise PipelineError(f"{where}: object {i} lacks a rect of 4 numbers and a base64 feature")
        rects.append(rect)
        feats.append(_b64_floats(feature, where, f"object {i} feature"))
    if len({f.size for f in feats}) != 1:
        lengths = sorted({f.size for f in feats})[:4]
        raise PipelineError(f"{where}: the objects' features differ in length ({lengths} floats)")
    boxes = np.asarray(rects, dtype=np.float32)
    return {"key": key, "features": np.stack(feats), "boxes": boxes, "image_w": w, "image_h": h}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_vinvl(
    sources: list[Path], keys: str, sizes: dict[str, tuple[int, int]] | None = None, **_: Any
) -> Iterator[tuple[str, Callable[[], Record]]]:
    sizes = require_sizes(sizes, "VinVL TSVs")
    for path in sources:
        if not path.is_file():
            raise UsageError(f"VinVL TSV file not found: {path}")
        for where, fields in iter_lines(path):
            yield where, row_thunk(fields, where, partial(decode_vinvl, keys=keys, sizes=sizes))


def write_vinvl(out: BinaryIO, records: Iterator[Record]) -> int:
    """The released layout: ``key \\t num_boxes \\t base64(float32[K * 2054])`` (position appended to 2048-d)."""
    n = 0
    for rec in records:
        feats = np.asarray(rec["features"], dtype=np.float32)
        if feats.shape[1] != 2048 + POSITION:
            feats = np.concatenate([feats, position(rec["boxes"], rec["image_w"], rec["image_h"])], axis=1)
        blob = base64.b64encode(np.ascontiguousarray(feats, dtype="<f4").tobytes())
        out.write(b"\t".join([key_to_text(rec["key"]).encode("utf-8"), str(len(feats)).encode(), blob]) + b"\n")
        n += 1
    return n


def read_grid_hdf5(
    sources: list[Path], keys: str = "raw", sizes: dict[str, tuple[int, int]] | None = None, **_: Any
) -> Iterator[tuple[str, Callable[[], Record]]]:
    sizes = require_sizes(sizes, "grid HDF5 files")
    for path in sources:
        if not path.is_file():
            raise UsageError(f"grid HDF5 file not found: {path}")
        with open_hdf5_readonly(path) as fh:
            names = sorted((n[: -len("_grids")] for n in fh.keys() if n.endswith("_grids")), key=lambda k: (len(k), k))
            if not names:
                raise PipelineError(
                    f"{path} is an HDF5 file but holds no '<id>_grids' datasets (RSTNet / DLCT grid features)"
                )
            for key in names:
                where = f"{path}:{key}_grids"

                def decode(key: str = key, where: str = where) -> Record:
                    feats = read_dataset(fh, f"{key}_grids", where, ndim=2)
                    k = math.isqrt(feats.shape[0])
                    if k * k != feats.shape[0]:
                        raise PipelineError(f"{where}: {feats.shape[0]} cells is not a square grid")
                    w, h = _size(key, key, sizes, where)
                    xs, ys = np.arange(k + 1) * (w / k), np.arange(k + 1) * (h / k)
                    boxes = np.array(
                        [[xs[j], ys[i], xs[j + 1], ys[i + 1]] for i in range(k) for j in range(k)], dtype=np.float32
                    )
                    return {"key": key, "features": feats, "boxes": boxes, "image_w": w, "image_h": h}

                yield where, decode


register_format(
    Format(
        "vinvl-tsv",
        read_vinvl,
        "raw",
        True,
        write_vinvl,
        help="VinVL / Oscar feature TSV (2054-d rows with the 6-d box position) "
        "or scene_graph_benchmark predictions TSV",
    )
)
register_format(
    Format(
        "grid-hdf5",
        read_grid_hdf5,
        "raw",
        True,
        None,
        help="RSTNet / DLCT grid features HDF5 ('<id>_grids', 7x7 = 49 cells)",
    )
)
