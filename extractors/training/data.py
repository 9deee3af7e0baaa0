"""COCO-format instances with Visual-Genome-style attributes -> validated training records and batches.

Reading (:func:`load_instances`) follows py-faster-rcnn's COCO loader where it has a rule and skips, with a
count per reason, whatever cannot be used safely:

* boxes: COCO ``[x, y, w, h]`` -> inclusive pixel boxes ``x1 = max(0, x)``, ``x2 = min(W - 1, x1 + max(0, w -
  1))`` (py-faster-rcnn ``coco.py``); a box partly outside the image is clipped (``box_clipped``), one with no
  pixel inside it, a non-finite or non-positive size is dropped (``box_outside_image`` / ``degenerate_box``);
* ``iscrowd`` regions are dropped (``crowd``), as in py-faster-rcnn;
* an unknown ``category_id`` drops the annotation (``unknown_category``), an unknown attribute id drops that
  attribute (``unknown_attribute``), an annotation of an unknown image is dropped (``unknown_image``);
* images without any usable box (``empty_image``) and images whose file is missing or empty
  (``missing_file``) are not trained on (py-faster-rcnn ``filter_roidb`` also drops box-less images).

Classes are the file's categories in id order (index 0 = background, Caffe order); attributes are the file's
``attributes`` table in id order (index 0 = "no attribute"), or the ids themselves when there is no table.

Batches (:class:`TrainBatches`) are a pure function of the iteration number: epoch permutation and flips
come from generators seeded with ``(seed, epoch)``, so a resumed run sees exactly the same images.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from extractors.preprocess import ImageLoadError, caffe_blob, load_rgb
from pipeline.core.console import get_logger
from pipeline.core.errors import UsageError
from pipeline.core.fileio import read_json

log = get_logger("train-detector")

SKIP_REASONS = (
    "box_clipped",
    "box_outside_image",
    "degenerate_box",
    "crowd",
    "unknown_category",
    "unknown_attribute",
    "unknown_image",
    "empty_image",
    "missing_file",
)


@dataclass
class ImageRecord:
    """One training image: inclusive pixel boxes (N, 4), class indices (N,), attribute indices (N, M) padded -1."""

    image_id: int
    path: Path
    width: int
    height: int
    boxes: np.ndarray
    labels: np.ndarray
    attributes: np.ndarray


@dataclass
class InstanceSet:
    """The usable images plus the class / attribute vocabularies and what was skipped."""

    records: list[ImageRecord]
    class_names: list[str]
    category_ids: list[int]
    attribute_names: list[str]
    attribute_ids: list[int]
    attribute_types: list[str]
    counts: Counter = field(default_factory=Counter)

    @property
    def num_classes(self) -> int:
        """Classes including background."""
        return len(self.class_names) + 1

    @property
    def num_attributes(self) -> int:
        """Attributes including "no attribute"."""
        return len(self.attribute_names) + 1


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _vocab(data: dict[str, Any], key: str, ann_file: Path) -> list[dict[str, Any]]:
    table = data.get(key, [])
    if not isinstance(table, list):
        raise UsageError(f"{ann_file}: '{key}' must be a list")
    out = []
    for entry in table:
        if not isinstance(entry, dict) or _as_int(entry.get("id")) is None:
            raise UsageError(f"{ann_file}: every entry of '{key}' needs an integer 'id'")
        out.append(entry)
    ids = [int(e["id"]) for e in out]
    if len(set(ids)) != len(ids):
        raise UsageError(f"{ann_file}: duplicate ids in '{key}'")
    return sorted(out, key=lambda e: int(e["id"]))


def convert_box(bbox: Any, width: int, height: int) -> tuple[np.ndarray | None, str | None]:
    """COCO ``[x, y, w, h]`` -> inclusive ``[x1, y1, x2, y2]`` clipped to the image, or ``(None, reason)``."""
    try:
        x, y, w, h = (float(v) for v in bbox)
    except (TypeError, ValueError):
        return None, "degenerate_box"
    if not all(math.isfinite(v) for v in (x, y, w, h)) or w <= 0 or h <= 0:
        return None, "degenerate_box"
    if x >= width or y >= height or x + w <= 0 or y + h <= 0:
        return None, "box_outside_image"
    x1, y1 = max(0.0, x), max(0.0, y)
    x2 = min(width - 1.0, x1 + max(0.0, w - 1.0))
    y2 = min(height - 1.0, y1 + max(0.0, h - 1.0))
    clipped = x < 0 or y < 0 or x + w > width or y + h > height
    return np.array([x1, y1, x2, y2], dtype=np.float32), ("box_clipped" if clipped else None)


@dataclass
class _LabelTables:
    """Class and attribute tables of an instances file: COCO ids -> 1-based contiguous indices (0 = none)."""

    names: list[str]
    cat_ids: list[int]
    cat_index: dict[int, int]
    attr_index: dict[int, int]
    attr_names: list[str]
    attr_ids: list[int]
    attr_types: list[str]


def _label_tables(data: dict[str, Any], ann_file: Path, class_names: list[str] | None) -> _LabelTables:
    """Read ``categories`` (required) and ``attributes`` (optional; without a table the ids are the indices)."""
    cats = _vocab(data, "categories", ann_file)
    if not cats:
        raise UsageError(f"{ann_file}: no 'categories' - the classes cannot be known")
    attrs = _vocab(data, "attributes", ann_file)
    if class_names is None:
        names = [str(c.get("name", c["id"])) for c in cats]
        cat_index = {int(c["id"]): i + 1 for i, c in enumerate(cats)}
    else:
        names = list(class_names)
        pos = {n: i + 1 for i, n in enumerate(names)}
        cat_index = {int(c["id"]): pos[str(c.get("name", c["id"]))] for c in cats if str(c.get("name", c["id"])) in pos}
    if attrs:
        attr_index = {int(a["id"]): i + 1 for i, a in enumerate(attrs)}
        attr_names = [str(a.get("name", a["id"])) for a in attrs]
        attr_types = [str(a.get("type", "")) for a in attrs]
        attr_ids = [int(a["id"]) for a in attrs]
    else:  # no table: the ids are the indices (1-based, 0 = no attribute)
        seen = sorted(
            {
                int(v)
                for a in data["annotations"]
                if isinstance(a, dict)
                for v in (a.get("attribute_ids") or [])
                if _as_int(v) is not None and int(v) > 0
            }
        )
        top = max(seen, default=0)
        attr_index = {i: i for i in range(1, top + 1)}
        attr_names = [str(i) for i in range(1, top + 1)]
        attr_types = [""] * top
        attr_ids = list(range(1, top + 1))
    return _LabelTables(names, [int(c["id"]) for c in cats], cat_index, attr_index, attr_names, attr_ids, attr_types)


def _image_table(data: dict[str, Any], ann_file: Path) -> dict[int, dict[str, Any]]:
    """``image id -> {entry, boxes, labels, attrs}`` with every image entry validated (id, file name, size)."""
    images: dict[int, dict[str, Any]] = {}
    for im in data["images"]:
        iid = _as_int(im.get("id")) if isinstance(im, dict) else None
        if iid is None or not isinstance(im.get("file_name"), str):
            raise UsageError(f"{ann_file}: an image entry lacks an integer 'id' or a 'file_name'")
        w, h = _as_int(im.get("width")), _as_int(im.get("height"))
        if w is None or h is None or w < 1 or h < 1:
            raise UsageError(f"{ann_file}: image {iid} lacks a positive integer 'width'/'height'")
        images[iid] = {"entry": im, "boxes": [], "labels": [], "attrs": []}
    return images


def _attach_annotations(
    data: dict[str, Any],
    ann_file: Path,
    images: dict[int, dict[str, Any]],
    tables: _LabelTables,
    max_attributes: int,
    counts: Counter,
) -> None:
    """Add each usable annotation's box, class and attributes to its image; count what is skipped and why."""
    for a in data["annotations"]:
        if not isinstance(a, dict):
            raise UsageError(f"{ann_file}: an annotation is not an object")
        iid = _as_int(a.get("image_id"))
        if iid not in images:
            counts["unknown_image"] += 1
            continue
        if a.get("iscrowd", 0):
            counts["crowd"] += 1
            continue
        cid = _as_int(a.get("category_id"))
        if cid not in tables.cat_index:
            counts["unknown_category"] += 1
            continue
        im = images[iid]
        box, reason = convert_box(a.get("bbox"), int(im["entry"]["width"]), int(im["entry"]["height"]))
        if box is None:
            counts[reason] += 1
            continue
        if reason:
            counts[reason] += 1
        raw_attrs = a.get("attribute_ids") or []
        if not isinstance(raw_attrs, list):
            raw_attrs = []
            counts["unknown_attribute"] += 1
        mapped: list[int] = []
        for v in raw_attrs:
            vi = _as_int(v)
            if vi is None or vi not in tables.attr_index:
                counts["unknown_attribute"] += 1
            elif tables.attr_index[vi] not in mapped:
                mapped.append(tables.attr_index[vi])
        im["boxes"].append(box)
        im["labels"].append(tables.cat_index[cid])
        im["attrs"].append(mapped[:max_attributes])


def _image_records(
    images: dict[int, dict[str, Any]], root: Path, max_attributes: int, keep_empty: bool, counts: Counter
) -> list[ImageRecord]:
    """One :class:`ImageRecord` per image whose file exists (and that has boxes unless ``keep_empty``), by id."""
    records = []
    for iid, im in images.items():
        path = root / im["entry"]["file_name"]
        if not im["boxes"] and not keep_empty:
            counts["empty_image"] += 1
            continue
        try:
            ok = path.is_file() and path.stat().st_size > 0
        except OSError:
            ok = False
        if not ok:
            counts["missing_file"] += 1
            continue
        n = len(im["boxes"])
        attrs_arr = np.full((n, max_attributes), -1, dtype=np.int64)
        for j, lst in enumerate(im["attrs"]):
            attrs_arr[j, : len(lst)] = lst
        records.append(
            ImageRecord(
                image_id=iid,
                path=path,
                width=int(im["entry"]["width"]),
                height=int(im["entry"]["height"]),
                boxes=np.stack(im["boxes"]).astype(np.float32) if n else np.zeros((0, 4), np.float32),
                labels=np.asarray(im["labels"], dtype=np.int64),
                attributes=attrs_arr,
            )
        )
    records.sort(key=lambda r: r.image_id)
    return records


def load_instances(
    ann_file: str | Path,
    image_root: str | Path | None = None,
    *,
    max_attributes: int = 16,
    class_names: list[str] | None = None,
    keep_empty: bool = False,
) -> InstanceSet:
    """Read and validate a COCO instances file (see the module docstring for what is skipped and why).

    ``class_names`` fixes the class order (e.g. the training set's when reading a validation split): a
    category whose name is not among them counts as unknown.
    """
    ann_file = Path(ann_file)
    data = read_json(ann_file, "COCO instances file")
    if not isinstance(data.get("images"), list) or not isinstance(data.get("annotations"), list):
        raise UsageError(f"{ann_file}: not a COCO instances file (needs 'images' and 'annotations' lists)")
    tables = _label_tables(data, ann_file, class_names)
    counts: Counter = Counter()
    images = _image_table(data, ann_file)
    _attach_annotations(data, ann_file, images, tables, max_attributes, counts)
    root = Path(image_root) if image_root is not None else ann_file.parent
    records = _image_records(images, root, max_attributes, keep_empty, counts)
    for reason in SKIP_REASONS:
        if counts[reason]:
            log.warning("%s: %s %d", ann_file.name, reason.replace("_", " "), counts[reason])
    return InstanceSet(
        records, tables.names, tables.cat_ids, tables.attr_names, tables.attr_ids, tables.attr_types, counts
    )


# ---------------------------------------------------------------------------------------------------------
@dataclass
class TrainImage:
    """A loaded, resized (and maybe flipped) image: blob (3, h, w), scaled boxes, labels, attributes."""

    blob: torch.Tensor
    scale: float
    boxes: torch.Tensor
    labels: torch.Tensor
    attributes: torch.Tensor
    image_id: int


def load_train_image(
    rec: ImageRecord, min_size: int, max_size: int, pixel_means, flip: bool, max_pixels: int = 100_000_000
) -> TrainImage | str:
    """Decode, flip (py-faster-rcnn ``x1' = W - x2 - 1``) and resize one record; a failure is returned as text."""
    try:
        rgb = load_rgb(rec.path, max_pixels)
    except ImageLoadError as exc:
        return f"{rec.path}: {exc.reason} ({exc.detail})"
    h, w = rgb.shape[:2]
    if (w, h) != (rec.width, rec.height):
        return f"{rec.path}: decoded size {w}x{h} differs from the annotated {rec.width}x{rec.height}"
    boxes = rec.boxes.copy()
    if flip:
        rgb = np.ascontiguousarray(rgb[:, ::-1])
        x1 = w - boxes[:, 2] - 1
        x2 = w - boxes[:, 0] - 1
        boxes[:, 0], boxes[:, 2] = x1, x2
    blob, scale = caffe_blob(rgb, min_size, max_size, pixel_means)
    return TrainImage(
        torch.from_numpy(blob),
        scale,
        torch.from_numpy(boxes * scale),
        torch.from_numpy(rec.labels),
        torch.from_numpy(rec.attributes),
        rec.image_id,
    )


class TrainBatches(Dataset):
    """Item ``it`` = this rank's images of training iteration ``it`` (a pure function of ``it``).

    Iteration ``it`` of an epoch of ``len(records) // (batch * world)`` iterations takes positions
    ``[it * batch * world, ...)`` of the epoch's permutation; rank ``r`` takes its ``batch``-sized slice.
    Flips are drawn with the permutation (probability 0.5, py-faster-rcnn ``USE_FLIPPED``).
    """

    def __init__(
        self,
        records: list[ImageRecord],
        batch: int,
        seed: int,
        min_size: int,
        max_size: int,
        pixel_means,
        flip: bool = True,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        if batch < 1:
            raise UsageError("detector_train.images_per_batch must be >= 1")
        if len(records) < batch * world:
            raise UsageError(
                f"{len(records)} usable training images is fewer than one batch ({batch} x {world} processes)"
            )
        self.records, self.batch, self.seed, self.flip = records, batch, seed, flip
        self.min_size, self.max_size, self.means = min_size, max_size, tuple(pixel_means)
        self.rank, self.world = rank, world
        self.per_epoch = len(records) // (batch * world)
        self._cache: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:  # not used for sampling (iterations are open-ended)
        return self.per_epoch

    def _epoch(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache is None or self._cache[0] != epoch:
            g = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + epoch)
            perm = torch.randperm(len(self.records), generator=g)
            flips = torch.rand(len(self.records), generator=g) < 0.5
            self._cache = (epoch, perm, flips)
        return self._cache[1], self._cache[2]

    def indices(self, it: int) -> list[tuple[int, bool]]:
        epoch, step = divmod(int(it), self.per_epoch)
        perm, flips = self._epoch(epoch)
        start = step * self.batch * self.world + self.rank * self.batch
        pos = perm[start : start + self.batch].tolist()
        return [(i, bool(flips[i]) and self.flip) for i in pos]

    def __getitem__(self, it: int) -> dict[str, Any]:
        images, failures = [], []
        for i, flip in self.indices(it):
            out = load_train_image(self.records[i], self.min_size, self.max_size, self.means, flip)
            (failures if isinstance(out, str) else images).append(out)
        return {"iteration": int(it), "images": images, "failures": failures}


def collate_one(batch: list[dict[str, Any]]) -> dict[str, Any]:
    return batch[0]


def pad_blobs(images: list[TrainImage]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Stack blobs into (N, 3, Hmax, Wmax), zero padding at the bottom/right (= the pixel mean)."""
    hmax = max(im.blob.shape[1] for im in images)
    wmax = max(im.blob.shape[2] for im in images)
    out = images[0].blob.new_zeros((len(images), 3, hmax, wmax))
    sizes = []
    for i, im in enumerate(images):
        _, h, w = im.blob.shape
        out[i, :, :h, :w] = im.blob
        sizes.append((h, w))
    return out, sizes
