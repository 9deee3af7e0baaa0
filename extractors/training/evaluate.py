"""Evaluating a detector the way the captioner will see it: the extractor's own region selection.

For each image the detector runs exactly as ``cli extract`` runs it: the recipe of the ``eval`` config section
(:func:`extractors.recipes.recipe_from_config`; a detector trained here defaults to the Caffe recipe: per-class
NMS 0.3, confidence 0.2, 10-100 boxes, the *proposal* boxes). Then, per ground-truth
object, the selected box with the highest IoU (``+1`` pixel areas) is its match:

* ``recall``: fraction of objects whose match has IoU >= ``iou`` (0.5);
* ``class_accuracy``: among matched objects, the match's class (argmax over the foreground classes, as
  the store records it) is the object's class;
* ``attribute_accuracy``: among matched objects that have an attribute of the group ``attribute_group``
  (the attributes table's ``type``, e.g. ``colour``), the match's most probable attribute *of that group*
  is the object's; with no group, the most probable attribute is one of the object's attributes.

The loop is ``cli extract``'s: DataLoader workers decode the images into the recipe's blobs
(:class:`extractors.photos.PhotoDataset`, ``eval.num_workers``), ``eval.batch_size`` images go through the detector at
once (same-shape blobs share one backbone pass) under ``eval.precision``
(:func:`pipeline.core.precision.autocast`), and an image that cannot be decoded, is too thin for the network
or makes the model raise is counted in ``failed_images`` instead of stopping the run. Batching changes only the
float rounding of a batched convolution, never which image is scored how.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from extractors import box_coding
from extractors.bottom_up import BottomUpDetector
from extractors.factory import configure_recipe
from extractors.inputs import ImageItem
from extractors.photos import Photo, PhotoDataset, detect_guarded, photo_batches
from extractors.preprocess import DEFAULT_MAX_PIXELS
from extractors.selector import Selector, to_resized
from extractors.training.data import load_instances
from extractors.weights import load_detector
from pipeline.core.console import get_logger, make_progress
from pipeline.core.errors import Failure, UsageError
from pipeline.core.precision import autocast, resolve_precision

log = get_logger("eval-detector")


@torch.inference_mode()
def attribute_probs(
    model: BottomUpDetector, blobs: list[torch.Tensor], boxes: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Attribute probabilities (R_i, A-1) of given blob-pixel boxes (R_i, 4) per blob (the test-time head:
    argmax-class embedding), for a batch of blobs: as :meth:`BottomUpDetector.detect`, blobs of one shape share
    one backbone pass and the RoIs of the whole batch one res5 pass."""
    dev = next(model.parameters()).device
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, b in enumerate(blobs):
        groups.setdefault(tuple(b.shape[-2:]), []).append(i)
    order: list[int] = []
    pooled = []
    for idx in groups.values():
        feat = model.backbone(torch.stack([blobs[i] for i in idx]).to(dev))
        rois = torch.cat(
            [
                torch.cat([torch.full((boxes[i].shape[0], 1), float(j), device=dev), boxes[i].to(dev).float()], 1)
                for j, i in enumerate(idx)
            ]
        )
        pooled.append(model.roi_heads.pool(feat, rois))
        order += idx
    _, _, attr_logits = model.roi_heads.box_predictor(model._res5(torch.cat(pooled)))
    probs = model.attr_probs(attr_logits.float()).cpu()
    out: list[torch.Tensor] = [torch.empty(0)] * len(blobs)
    start = 0
    for i in order:
        out[i] = probs[start : start + boxes[i].shape[0]]
        start += boxes[i].shape[0]
    return out


def match_objects(gt: torch.Tensor, det: torch.Tensor, iou: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per ground-truth box (G, 4): (hit mask, index of its best selected box among ``det`` (D, 4)).

    Boxes are inclusive pixel boxes; IoU uses ``+1`` areas like the rest of the Caffe pipeline. A box may match
    several objects (proposal recall, not one-to-one detection matching).
    """
    if gt.shape[0] == 0 or det.shape[0] == 0:
        return torch.zeros(gt.shape[0], dtype=torch.bool), torch.zeros(gt.shape[0], dtype=torch.long)
    best_iou, best = box_coding.legacy_iou(gt.float(), det.float()).max(dim=1)
    return best_iou >= iou, best


@dataclass
class _Tally:
    """Running counts of one evaluation (see :func:`evaluate_model`)."""

    iou: float
    group: list[int]
    images: int = 0
    objects: int = 0
    found: int = 0
    cls_ok: int = 0
    attr_total: int = 0
    attr_ok: int = 0
    boxes: int = 0
    failed: list[str] = field(default_factory=list)

    def boxes_and_classes(self, rec: Any, out: Any) -> tuple[torch.Tensor, list[int]] | None:
        """Count one image's objects, recall and class hits; returns the matched selected box (original pixels)
        of every found object and the object's ground-truth row (None when none is found)."""
        self.images += 1
        self.boxes += out.boxes.shape[0]
        gt = torch.from_numpy(rec.boxes)
        self.objects += gt.shape[0]
        if gt.shape[0] == 0 or out.boxes.shape[0] == 0:
            return None
        det_boxes = torch.from_numpy(out.boxes)
        hit, best = match_objects(gt, det_boxes, self.iou)
        self.found += int(hit.sum())
        pred_cls = torch.from_numpy(out.class_ids)[best] + 1  # store ids are 0-based foreground ids
        self.cls_ok += int((pred_cls[hit] == torch.from_numpy(rec.labels)[hit]).sum())
        if not bool(hit.any()):
            return None
        return det_boxes[best[hit]], torch.nonzero(hit).flatten().tolist()

    def attributes(self, rec: Any, probs: torch.Tensor, hit_rows: list[int]) -> None:
        """Score the attribute of each found object (``hit_rows``: their ground-truth rows; ``probs`` their
        matched boxes' attribute probabilities)."""
        for row, g in enumerate(hit_rows):
            gt_attrs = [a for a in rec.attributes[g].tolist() if a >= 1]
            if self.group:
                want = [a for a in gt_attrs if a in self.group]
                if not want:
                    continue
                cols = torch.tensor(self.group) - 1
                pred = int(cols[int(torch.argmax(probs[row, cols]))]) + 1
            else:
                want = gt_attrs or [0]
                pred = int(torch.argmax(probs[row])) + 1 if gt_attrs else 0
            self.attr_total += 1
            self.attr_ok += pred in want


def _score_batch(
    model: BottomUpDetector,
    batch: list[Photo],
    records: list[Any],
    rule: Selector,
    precision: str,
    dev: torch.device,
    tally: _Tally,
) -> None:
    """Detect one loader batch at once, count its boxes and classes, then the attributes of the found objects
    (one batched pass of the attribute head over the matched boxes)."""

    def fail(photo: Photo, failure: Failure) -> None:
        tally.failed.append(f"{photo.item.path}: {failure.reason} ({failure.detail})")

    good = []
    for photo in batch:
        if photo.failure is not None:
            fail(photo, photo.failure)
        else:
            good.append(photo)
    blobs, boxes, found = [], [], []
    for photo, out in detect_guarded(model, good, rule, precision, dev, fail):
        rec = records[int(photo.item.key)]
        matched = tally.boxes_and_classes(rec, out)
        if matched is None or not model.spec.has_attributes:
            continue
        blobs.append(photo.blob)
        boxes.append(to_resized(matched[0], photo.frame, rule.recipe.rescale))
        found.append((rec, matched[1]))
    if blobs:
        with autocast(dev, precision):
            probs = attribute_probs(model, blobs, boxes)
        for (rec, rows), p in zip(found, probs):
            tally.attributes(rec, p, rows)


def evaluate_model(
    model: BottomUpDetector,
    ann_file: str | Path,
    image_root: str | Path | None,
    classes: list[str],
    attributes: list[str] | None = None,
    *,
    rule: Selector | None = None,
    iou: float = 0.5,
    attribute_group: str = "colour",
    limit: int | None = None,
    batch_size: int = 1,
    workers: int = 0,
    precision: str = "fp32",
) -> dict[str, Any]:
    """Recall / class accuracy / attribute accuracy of ``model`` on a COCO instances split (see the module doc).

    ``batch_size`` images go through the detector at once (same-shape images share the backbone pass, as in
    ``cli extract``); ``workers`` DataLoader processes decode the images and build the recipe's blobs
    (:class:`extractors.photos.PhotoDataset`); ``precision`` is ``auto | fp32 | tf32 | bf16``
    (:mod:`pipeline.core.precision`; no fp16 for the detector). None of them changes which image is scored how.
    """
    precision = resolve_precision(precision, next(model.parameters()).device, "eval.precision", fp16=False)
    if int(batch_size) < 1 or int(workers) < 0:
        raise UsageError(f"eval.batch_size must be >= 1 and eval.num_workers >= 0, got {batch_size} and {workers}")
    if rule is None:
        _recipe, rule = configure_recipe(model, "butd", None, "eval")
    data = load_instances(ann_file, image_root, class_names=classes, keep_empty=True)
    if attributes is not None and data.attribute_names != list(attributes):
        raise UsageError(
            f"{ann_file}: its attributes table {data.attribute_names[:5]}... differs from the detector's "
            f"{list(attributes)[:5]}..."
        )
    group = [i + 1 for i, t in enumerate(data.attribute_types) if attribute_group and t == attribute_group]
    if attribute_group and not group:
        log.warning(
            "%s: no attribute of type %r; attribute accuracy uses any of the object's attributes",
            ann_file,
            attribute_group,
        )
    records = data.records[:limit] if limit is not None else data.records
    dev = next(model.parameters()).device
    tally = _Tally(iou=iou, group=group)
    ds = PhotoDataset(
        [ImageItem(str(i), Path(rec.path)) for i, rec in enumerate(records)],
        rule.recipe,
        DEFAULT_MAX_PIXELS,
        model.spec.feature_stride,
    )
    with make_progress() as progress:
        task = progress.add_task("evaluate", total=len(ds))
        for batch in photo_batches(ds, int(batch_size), int(workers), pin_memory=dev.type == "cuda"):
            _score_batch(model, batch, records, rule, precision, dev, tally)
            progress.advance(task, len(batch))
    return _result(tally, rule, attribute_group)


def _result(t: _Tally, rule: Selector, attribute_group: str) -> dict[str, Any]:
    recipe = rule.recipe
    result = {
        "images": t.images,
        "objects": t.objects,
        "recall": round(t.found / t.objects, 4) if t.objects else 0.0,
        "class_accuracy": round(t.cls_ok / t.found, 4) if t.found else 0.0,
        "attribute_accuracy": round(t.attr_ok / t.attr_total, 4) if t.attr_total else 0.0,
        "attribute_group": attribute_group if t.group else "any",
        "boxes_per_image": round(t.boxes / t.images, 2) if t.images else 0.0,
        "iou": t.iou,
        "selection": {
            "recipe": recipe.name,
            "selector": recipe.selector,
            "min_boxes": recipe.min_boxes,
            "max_boxes": recipe.max_boxes,
            "conf": recipe.conf_thresh,
            "nms": recipe.nms_thresh,
        },
    }
    if t.failed:
        result["failed_images"] = len(t.failed)
        log.warning("%d images could not be evaluated, e.g. %s", len(t.failed), t.failed[0])
    return result


def evaluate_weights(
    weights: str | Path,
    ann_file: str | Path,
    image_root: str | Path | None = None,
    *,
    device: str | torch.device = "cpu",
    section: Any = None,
    **options: Any,
) -> dict[str, Any]:
    """:func:`evaluate_model` on a ``butd`` weights file (its class and attribute names map the split's ids), with
    the recipe of the config ``section`` (the ``eval`` section of ``configs/train_detector.yaml``). ``options``:
    the keyword arguments of :func:`evaluate_model` other than ``rule`` (``iou``, ``limit``, ``precision``, ...)."""
    model, info = load_detector(weights)
    if info["layout"] != "butd":
        raise UsageError(
            f"{weights}: evaluation needs a butd detector file (it names its classes); got the {info['layout']} layout"
        )
    model = model.to(device).fold_batchnorm()
    _recipe, rule = configure_recipe(model, info["layout"], section, "eval")
    return evaluate_model(model, ann_file, image_root, info["classes"], info["attributes"], rule=rule, **options)


def summary_line(result: dict[str, Any]) -> str:
    return (
        f"recall@{result['iou']} {result['recall']:.3f}, class accuracy {result['class_accuracy']:.3f}, "
        f"{result['attribute_group']}-attribute accuracy {result['attribute_accuracy']:.3f} "
        f"({result['objects']} objects, {result['images']} images, {result['boxes_per_image']} boxes/image)"
    )
