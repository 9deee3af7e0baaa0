"""The extraction loop behind ``cli extract``: inputs -> DataLoader (parallel decoding) -> detector -> store.

Resumable (images already committed are skipped), shardable (``shard = (i, n)`` takes every n-th image of the
sorted input list), robust (a bad image goes to ``failures.jsonl`` in the store with its reason and the run
goes on: unreadable or undecodable files, inputs that are missing, dangling or looping links or folders,
images too thin for the network, and any image on which the detector raises). Keys are COCO ids when the file name carries one (``COCO_train2014_000000150367.jpg`` -> ``150367``),
otherwise the path relative to the input folder, made from the file name the OS gives by the bytes-safe rule
of :mod:`pipeline.core.keys` (failures records and messages carry the key's text form).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from extractors.bottom_up import BottomUpDetector
from extractors.inputs import input_problem, scan_images
from extractors.preprocess import ImageLoadError, load_rgb, recipe_blob
from extractors.selector import Selector
from pipeline.core import threads as thread_policy
from pipeline.core.console import get_logger, make_progress
from pipeline.core.errors import PipelineError, UsageError, exception_line
from pipeline.core.keys import key_from_name, key_to_text
from pipeline.core.training.precision import tf32
from pipeline.core.training.signals import StopOnSignal

log = get_logger("extract")
_COCO_ID = re.compile(r"^COCO_[A-Za-z]+\d*_(\d{12})$|^(\d{12})$")


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
        root = p if p.is_dir() else None
        scan = scan_images([p])
        for f in scan.files:
            items.append(ImageItem(image_key(f, root), f))
        for f, reason, detail in scan.problems:
            items.append(ImageItem(image_key(f, root), f, problem=(reason, detail)))
    return _unique(items)


def items_from_file_list(list_file: Path, base: Path | None = None) -> list[ImageItem]:
    """One image path per line (relative paths resolved against the list's folder or ``base``)."""
    if not list_file.is_file():
        raise UsageError(f"file list not found: {list_file}")
    root = base or list_file.parent
    items = []
    try:
        text = list_file.read_bytes().decode("utf-8", "surrogateescape")  # names that are not UTF-8 stay exact
    except OSError as exc:
        raise UsageError(f"cannot read file list {list_file}: {exc.strerror or exc}") from None
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            f = Path(line) if Path(line).is_absolute() else root / line
            items.append(ImageItem(image_key(f, root), f, problem=input_problem(f)))
    return _unique(items)


def items_from_coco(ann_file: Path, image_root: Path | None, with_boxes: bool) -> list[ImageItem]:
    """COCO ``images`` (key = image id) from an annotations file; ``with_boxes`` attaches its ``bbox``es
    (xywh -> x1, y1, x1 + w, y1 + h) as given boxes."""
    from pipeline.core.fileio import read_json

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
    return _unique(items)


def _unique(items: list[ImageItem]) -> list[ImageItem]:
    seen: dict[str, Path] = {}
    for it in items:
        if it.key in seen and seen[it.key] != it.path:
            raise UsageError(f"two images map to the same key {key_to_text(it.key)!r}: {key_to_text(str(seen[it.key]))} "
                             f"and {key_to_text(str(it.path))}")
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


def thin_image_reason(orig_hw: tuple[int, int], blob_hw: tuple[int, int], min_side: int) -> str | None:
    """Why an image is too thin for the network, or None.

    After the test-time resize (longest side capped) a 2000x2 photo becomes 1000x1: below the backbone's
    feature stride (``min_side``, 16 px for the ResNet-101 C4 detector) the feature map has no full cell, the
    detector either fails or sees nothing, so such images are refused with this reason before the model runs.
    """
    h, w = int(blob_hw[0]), int(blob_hw[1])
    if min(h, w) >= min_side:
        return None
    return (f"{orig_hw[1]}x{orig_hw[0]} image resizes to {w}x{h} for the network: its short side {min(h, w)} px is "
            f"below the {min_side} px minimum (the backbone's feature stride)")


def record_settings(identity: dict[str, Any], selector: Selector, precision: str) -> dict[str, Any]:
    """``identity`` with the resolved test-time recipe (``config.recipe``: its name and every value), its box
    selection in short (``config.boxes``) and the precision: what ``extract`` and ``caption --cache`` store next
    to the weights' SHA-256, and what :func:`pipeline.store.format.feature_settings_diff` compares."""
    r = selector.recipe
    config = dict(identity.get("config") or {})
    config["precision"] = str(precision)
    config["recipe"] = r.to_dict()
    config["boxes"] = {"mode": r.selector, "min": r.min_boxes, "max": r.max_boxes, "conf": r.conf_thresh, "nms": r.nms_thresh}
    return dict(identity, config=config)


class ExtractionInterrupted(PipelineError):
    """Stopped by SIGTERM/SIGINT after committing every finished image; rerunning the command resumes."""

    exit_code = 130


class ImageDataset(Dataset):
    """Decodes images into the recipe's blobs in DataLoader workers; failures are returned, never raised."""

    def __init__(self, items: list[ImageItem], recipe, max_pixels: int, min_side: int = 16) -> None:
        self.items, self.recipe, self.max_pixels = items, recipe, max_pixels
        self.min_side = min_side

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        it = self.items[i]
        if it.problem is not None:
            return {"item": it, "error": it.problem[0], "detail": it.problem[1]}
        try:
            rgb = load_rgb(it.path, self.max_pixels)
        except ImageLoadError as exc:
            return {"item": it, "error": exc.reason, "detail": exc.detail}
        try:
            blob, frame = recipe_blob(rgb, self.recipe)
        except (cv2.error, ValueError, MemoryError) as exc:
            return {"item": it, "error": "decode_error", "detail": f"cannot build the image blob: {exception_line(exc)}"}
        thin = thin_image_reason(rgb.shape[:2], blob.shape[1:], self.min_side)
        if thin is not None:
            return {"item": it, "error": "too_thin", "detail": thin}
        return {"item": it, "blob": torch.from_numpy(blob), "frame": frame, "size": rgb.shape[:2]}


def as_list(batch: list[Any]) -> list[Any]:
    """A DataLoader ``collate_fn`` that hands a batch over as the list of its items."""
    return batch


@contextmanager
def precision_context(precision: str, device: torch.device) -> Iterator[None]:
    """fp32 (strict: TF32 off for matmuls and cuDNN), tf32 (TF32 on, the default), bf16 (autocast, TF32 on for the rest).

    The TF32 rule is :func:`pipeline.core.training.precision.tf32`, the same in every command."""
    if precision not in ("fp32", "tf32", "bf16"):
        raise UsageError(f"precision must be fp32, tf32 or bf16, not {precision!r}")
    with tf32(precision != "fp32"):
        ctx = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
        with ctx:
            yield


@dataclass
class RunSummary:
    total: int = 0
    skipped: int = 0
    extracted: int = 0
    failed: int = 0
    boxes: int = 0
    seconds: float = 0.0
    failures: list[dict[str, str]] = field(default_factory=list)


def run_extraction(
    model: BottomUpDetector,
    items: list[ImageItem],
    writer,
    selector: Selector,
    *,
    batch_size: int = 4,
    workers: int = 0,
    precision: str = "fp32",
    max_pixels: int = 100_000_000,
    failures_path: Path | None = None,
    commit_every: int = 64,
) -> RunSummary:
    """Extract every item not yet in ``writer`` and add it; returns counts (bad images are listed, not raised).

    ``selector`` (:func:`extractors.selector.make_selector`) carries the resolved recipe whose preprocessing the
    image loader applies."""
    spec = model.spec
    dev = next(model.parameters()).device
    summary = RunSummary(total=len(items))
    todo = [it for it in items if not writer.has(it.key)]
    summary.skipped = len(items) - len(todo)
    if summary.skipped:
        log.info("resuming: %d of %d images already in the store", summary.skipped, len(items))
    fail_fh = open(failures_path, "w", encoding="utf-8") if failures_path is not None else None
    t0 = time.perf_counter()
    ds = ImageDataset(todo, selector.recipe, max_pixels, min_side=spec.feature_stride)
    since_commit = 0

    def fail(it: ImageItem, reason: str, detail: str) -> None:
        path = key_to_text(os.fsdecode(it.path))
        rec = {"key": key_to_text(it.key), "path": path, "reason": reason, "detail": key_to_text(detail)}
        summary.failures.append(rec)
        summary.failed += 1
        log.warning("skipped %s: %s (%s)", path, reason, rec["detail"])
        if fail_fh is not None:
            fail_fh.write(json.dumps(rec) + "\n")
            fail_fh.flush()

    try:
        with thread_policy.loader_threads(workers) as n, make_progress() as progress, StopOnSignal() as stop:
            loader = DataLoader(ds, batch_size=max(1, batch_size), shuffle=False, num_workers=n, collate_fn=as_list,
                                pin_memory=dev.type == "cuda", persistent_workers=False)
            task = progress.add_task("extract", total=len(todo))
            for batch in loader:
                since_commit += _extract_batch(batch, model, writer, selector, precision, dev, fail, summary)
                if commit_every and since_commit >= commit_every:
                    writer.commit()
                    since_commit = 0
                progress.advance(task, len(batch))
                if stop.signum is not None:  # SIGTERM / SIGINT: keep every finished image, then stop
                    writer.commit()
                    raise ExtractionInterrupted(
                        f"stopped by {signal.Signals(stop.signum).name} after {summary.extracted} new images, all committed "
                        f"to {writer.path}: run the same command again to resume")
        writer.commit()
    finally:
        if fail_fh is not None:
            fail_fh.close()
    summary.seconds = time.perf_counter() - t0
    return summary


def _extract_batch(batch: list[dict[str, Any]], model: BottomUpDetector, writer: Any, selector: Selector,
                   precision: str, dev: torch.device, fail: Any, summary: RunSummary) -> int:
    """Detect and add one loader batch (the per-image guard around the model and the store); returns images added."""
    good = []
    for rec in batch:
        it = rec["item"]
        if "error" in rec:
            fail(it, rec["error"], rec["detail"])
        elif selector.given and (it.boxes is None or len(it.boxes) == 0):
            fail(it, "no_boxes", "given-boxes mode and no box for this image")
        else:
            good.append(rec)
    added = 0
    for r, o in guarded_detect(model, good, selector, precision, dev, fail) if good else []:
        if o.boxes.shape[0] == 0:
            fail(r["item"], "no_regions", "the detector returned no region for this image")
            continue
        try:
            writer.add(r["item"].key, o.features, o.boxes, o.image_w, o.image_h, class_ids=o.class_ids,
                       class_scores=o.class_scores, attr_ids=o.attr_ids, attr_scores=o.attr_scores)
        except PipelineError as exc:  # e.g. NaN features: this image only, never the batch
            fail(r["item"], "invalid_output", str(exc))
            continue
        summary.extracted += 1
        summary.boxes += int(o.boxes.shape[0])
        added += 1
    return added


def _detect(model: BottomUpDetector, recs: list[dict[str, Any]], selector: Selector, precision: str,
            dev: torch.device) -> list[Any]:
    given = [_clip_given(r["item"].boxes, r["size"]) for r in recs] if selector.given else None
    with precision_context(precision, dev):
        return model.detect([r["blob"] for r in recs], [r["frame"] for r in recs], selector, given)


def guarded_detect(model: BottomUpDetector, recs: list[dict[str, Any]], selector: Selector, precision: str,
                   dev: torch.device, fail: Any) -> list[tuple[dict[str, Any], Any]]:
    """The per-image guard: run the batch; if the model raises, run each image alone and send the ones that
    still raise to ``fail(item, "model_error", detail)``, so one odd image never costs the others."""
    try:
        return list(zip(recs, _detect(model, recs, selector, precision, dev)))
    except (RuntimeError, ValueError, IndexError, TypeError, ZeroDivisionError, AssertionError) as exc:
        if len(recs) == 1:
            fail(recs[0]["item"], "model_error", exception_line(exc))
            return []
        log.debug("batch of %d failed (%s); retrying image by image", len(recs), exc)
    out = []
    for r in recs:
        out += guarded_detect(model, [r], selector, precision, dev, fail)
    return out


def _clip_given(boxes: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    h, w = size
    b = np.asarray(boxes, dtype=np.float32).reshape(-1, 4).copy()
    b[:, 0::2] = b[:, 0::2].clip(0, w)
    b[:, 1::2] = b[:, 1::2].clip(0, h)
    return b
