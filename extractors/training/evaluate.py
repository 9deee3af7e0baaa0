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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from extractors import box_coding
from extractors.bottom_up import BottomUpDetector
from extractors.preprocess import ImageLoadError, load_rgb, recipe_blob
from extractors.selector import Selector, to_resized
from extractors.training.data import load_instances
from extractors.weights import load_detector
from pipeline.core.console import get_logger, track
from pipeline.core.errors import UsageError

log = get_logger("eval-detector")


@torch.inference_mode()
def _attribute_probs(model: BottomUpDetector, blob: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """Attribute probabilities (R, A-1) of given blob-pixel boxes (the test-time head: argmax-class embedding)."""
    feat = model.backbone(blob[None])
    rois = torch.cat([torch.zeros((boxes.shape[0], 1), device=boxes.device), boxes], 1)
    x = model._res5(model.roi_heads.pool(feat, rois))
    _, _, attr_logits = model.roi_heads.box_predictor(x)
    return model.attr_probs(attr_logits.float())


def match_objects(gt: torch.Tensor, det: torch.Tensor, iou: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per ground-truth box (G, 4): (hit mask, index of its best selected box among ``det`` (D, 4)).

    Boxes are inclusive pixel boxes; IoU uses ``+1`` areas like the rest of the Caffe pipeline. A box may match
    several objects (proposal recall, not one-to-one detection matching).
    """
    if gt.shape[0] == 0 or det.shape[0] == 0:
        return torch.zeros(gt.shape[0], dtype=torch.bool), torch.zeros(gt.shape[0], dtype=torch.long)
    best_iou, best = box_coding.legacy_iou(gt.float(), det.float()).max(dim=1)
    return best_iou >= iou, best


def evaluate_model(model: BottomUpDetector, ann_file: str | Path, image_root: str | Path | None, classes: list[str],
                   attributes: list[str] | None = None, *, rule: Selector | None = None, iou: float = 0.5,
                   attribute_group: str = "colour", limit: int | None = None) -> dict[str, Any]:
    """Recall / class accuracy / attribute accuracy of ``model`` on a COCO instances split (see the module doc)."""
    if rule is None:
        from extractors.factory import configure_recipe

        _recipe, rule = configure_recipe(model, {"layout": "butd", "config": {}}, None, "eval")
    recipe = rule.recipe
    data = load_instances(ann_file, image_root, class_names=classes, keep_empty=True)
    if attributes is not None and data.attribute_names != list(attributes):
        raise UsageError(f"{ann_file}: its attributes table {data.attribute_names[:5]}... differs from the detector's {list(attributes)[:5]}...")
    group = [i + 1 for i, t in enumerate(data.attribute_types) if attribute_group and t == attribute_group]
    if attribute_group and not group:
        log.warning("%s: no attribute of type %r; attribute accuracy uses any of the object's attributes", ann_file, attribute_group)
    records = data.records[:limit] if limit is not None else data.records
    dev = next(model.parameters()).device
    spec = model.spec
    n_obj = found = cls_ok = attr_total = attr_ok = boxes_total = images = 0
    failed: list[str] = []
    for rec in track(records, "evaluate"):
        try:
            rgb = load_rgb(rec.path)
        except ImageLoadError as exc:
            failed.append(f"{rec.path}: {exc.reason}")
            continue
        blob, frame = recipe_blob(rgb, recipe)
        out = model.detect([torch.from_numpy(blob)], [frame], rule)[0]
        images += 1
        boxes_total += out.boxes.shape[0]
        gt = torch.from_numpy(rec.boxes)
        n_obj += gt.shape[0]
        if gt.shape[0] == 0 or out.boxes.shape[0] == 0:
            continue
        det_boxes = torch.from_numpy(out.boxes)
        hit, best = match_objects(gt, det_boxes, iou)
        found += int(hit.sum())
        pred_cls = torch.from_numpy(out.class_ids)[best] + 1  # store ids are 0-based foreground ids
        cls_ok += int((pred_cls[hit] == torch.from_numpy(rec.labels)[hit]).sum())
        if not bool(hit.any()) or not spec.has_attributes:
            continue
        hit_idx = torch.nonzero(hit).flatten()
        probs = _attribute_probs(model, torch.from_numpy(blob).to(dev), to_resized(det_boxes[best[hit_idx]], frame, recipe.rescale).to(dev)).cpu()
        for row, g in enumerate(hit_idx.tolist()):
            gt_attrs = [a for a in rec.attributes[g].tolist() if a >= 1]
            if group:
                want = [a for a in gt_attrs if a in group]
                if not want:
                    continue
                cols = torch.tensor(group) - 1
                pred = int(cols[int(torch.argmax(probs[row, cols]))]) + 1
            else:
                want = gt_attrs or [0]
                pred = int(torch.argmax(probs[row])) + 1 if gt_attrs else 0
            attr_total += 1
            attr_ok += pred in want
    result = {
        "images": images,
        "objects": n_obj,
        "recall": round(found / n_obj, 4) if n_obj else 0.0,
        "class_accuracy": round(cls_ok / found, 4) if found else 0.0,
        "attribute_accuracy": round(attr_ok / attr_total, 4) if attr_total else 0.0,
        "attribute_group": attribute_group if group else "any",
        "boxes_per_image": round(boxes_total / images, 2) if images else 0.0,
        "iou": iou,
        "selection": {"recipe": recipe.name, "selector": recipe.selector, "min_boxes": recipe.min_boxes, "max_boxes": recipe.max_boxes,
                      "conf": recipe.conf_thresh, "nms": recipe.nms_thresh},
    }
    if failed:
        result["failed_images"] = len(failed)
        log.warning("%d images could not be decoded, e.g. %s", len(failed), failed[0])
    return result


def evaluate_weights(weights: str | Path, ann_file: str | Path, image_root: str | Path | None = None, *, device: str | torch.device = "cpu",
                     section: Any = None, iou: float = 0.5, attribute_group: str = "colour", limit: int | None = None) -> dict[str, Any]:
    """:func:`evaluate_model` on a ``butd`` weights file (its class and attribute names map the split's ids), with
    the recipe of the config ``section`` (the ``eval`` section of ``configs/train_detector.yaml``)."""
    from extractors.factory import configure_recipe

    model, info = load_detector(weights)
    if info["layout"] != "butd":
        raise UsageError(f"{weights}: evaluation needs a butd detector file (it names its classes); got the {info['layout']} layout")
    model = model.to(device).fold_batchnorm()
    _recipe, rule = configure_recipe(model, {"layout": info["layout"], "config": {}}, section, "eval")
    return evaluate_model(model, ann_file, image_root, info["classes"], info["attributes"], rule=rule, iou=iou,
                          attribute_group=attribute_group, limit=limit)


def summary_line(result: dict[str, Any]) -> str:
    return (f"recall@{result['iou']} {result['recall']:.3f}, class accuracy {result['class_accuracy']:.3f}, "
            f"{result['attribute_group']}-attribute accuracy {result['attribute_accuracy']:.3f} "
            f"({result['objects']} objects, {result['images']} images, {result['boxes_per_image']} boxes/image)")


