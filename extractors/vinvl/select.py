"""VinVL's test-time selection (maskrcnn_benchmark ``PostProcessor`` + ``AttributePostProcessor`` as used by
microsoft/scene_graph_benchmark; docs/recipes.md#vinvl), on one image in resized-image pixels.

* :func:`class_boxes`: per proposal and class, the proposal itself (``IGNORE_BOX_REGRESSION``, how the released
  features were made) or its class-specific regressed box (``+1`` coder, weights 10/10/5/5), clipped to
  ``[0, W-1] x [0, H-1]``.
* ``nms_filter`` 1 (``filter_results_peter``, the official extraction): per foreground class, NMS at 0.3 over all
  proposals; each proposal's best score among the classes that kept it; keep ``>= conf_thresh`` clamped to
  [min_boxes, max_boxes] best; sorted by score.
* ``nms_filter`` 0 (``filter_results``): per class, scores ``> conf_thresh`` then NMS at ``roi_nms_thresh``;
  concatenated class by class (one proposal may appear under several labels); over ``max_boxes``: scores
  at least the k-th; under ``min_boxes``: the threshold halves and the filter reruns, up to 10 times.
* ``nms_filter`` 2 (``filter_results_fast``): best foreground class per proposal, candidates ``> 0.01 *
  conf_thresh`` with non-negative size, one class-agnostic NMS at ``roi_nms_thresh``, sorted, the
  ``min(max(n >= conf_thresh, min_boxes), max_boxes)`` best. Only with ``ignore_box_regression`` (the release
  indexes the wrong boxes otherwise).
* NMS implementations (``nms_variant``): ``torchvision`` (scene_graph_benchmark at HEAD: ``IoU > t``, areas
  without ``+1``), ``legacy-cuda`` (maskrcnn_benchmark ``_C`` CUDA: ``+1`` areas, ``IoU > t``), ``legacy-cpu``
  (``_C`` CPU: ``+1`` areas, ``IoU >= t``).
* :func:`attribute_top`: softmax over the attributes, column 0 ("no attribute") zeroed, ``<= attr_thresh``
  zeroed, at most ``max_attrs_per_image`` non-zero entries per image; the best attribute per box (the first
  of the release's ``topk(16)``), score 0 when none survived.

Every selected region's feature is the pooled res5 of its *proposal* (``box_features`` rows), whatever box
is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchvision.ops import nms as tv_nms

from extractors import box_coding
from extractors import nms as pcnms
from extractors.recipes import CHOICES
from extractors.selector import SELECTORS, Selector
from pipeline.core.errors import UsageError

NMS_VARIANTS = CHOICES["nms_variant"]


@dataclass
class VinVLPick:
    """One image's selection: proposal rows (feature source), 1-based labels, scores, boxes (resized pixels)."""

    rows: torch.Tensor
    labels: torch.Tensor
    scores: torch.Tensor
    boxes: torch.Tensor


def nms_keep(boxes: torch.Tensor, scores: torch.Tensor, thresh: float, variant: str) -> torch.Tensor:
    """Greedy NMS in one of :data:`NMS_VARIANTS`; kept indices in decreasing score order."""
    if boxes.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=boxes.device)
    if variant == "torchvision":
        return tv_nms(boxes.float(), scores.float(), thresh)
    if variant == "legacy-cpu":
        return box_coding.nms_boxes(boxes.float(), scores.float(), thresh, legacy=True)
    one = torch.tensor([0.0, 0.0, 1.0, 1.0], device=boxes.device)
    return tv_nms(boxes.float() + one, scores.float(), thresh)  # +1 areas, IoU > t


def clip_legacy(boxes: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``BoxList.clip_to_image``: x to [0, W-1], y to [0, H-1] (``TO_REMOVE = 1``)."""
    return box_coding.clip(boxes, h, w, legacy=True)


def class_boxes(
    props: torch.Tensor,
    deltas: torch.Tensor | None,
    num_classes: int,
    size: tuple[int, int],
    ignore: bool,
    weights=(10.0, 10.0, 5.0, 5.0),
    scale_clamp: float = box_coding.DEFAULT_SCALE_CLAMP,
) -> torch.Tensor:
    """(R, C, 4) box per proposal and class (background included), clipped to the resized image."""
    h, w = size
    if ignore or deltas is None:
        boxes = props.float()[:, None, :].expand(props.shape[0], num_classes, 4)
    else:
        boxes = box_coding.decode(deltas, props, weights, legacy=True, scale_clamp=scale_clamp, x2_minus_one=True).view(
            -1, num_classes, 4
        )
    return clip_legacy(boxes.contiguous(), h, w)


def _count_rule(sorted_scores: torch.Tensor, conf: float, lo: int, hi: int) -> int:
    n = int((sorted_scores >= conf).sum())
    return min(max(n, lo), hi)


def filter_peter(boxes: torch.Tensor, probs: torch.Tensor, recipe, same_boxes: bool) -> VinVLPick:
    """``nms_filter`` 1; ``same_boxes``: every class shares the proposal box (one overlap graph for all classes)."""
    r, c = probs.shape
    if same_boxes and recipe.nms_variant != "legacy-cuda":
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[:, 1:] = pcnms.per_class_keep(
            boxes[:, 0], probs[:, 1:], recipe.nms_thresh, legacy=recipe.nms_variant == "legacy-cpu"
        )
    else:
        mask = torch.zeros_like(probs, dtype=torch.bool)
        for j in range(1, c):
            mask[nms_keep(boxes[:, j], probs[:, j], recipe.nms_thresh, recipe.nms_variant), j] = True
    dists = torch.where(mask, probs, torch.zeros_like(probs))
    best, label = dists.max(dim=1)
    rows = torch.nonzero(best).flatten()
    order = torch.argsort(best[rows], descending=True, stable=True)
    rows = rows[order]
    take = rows[: _count_rule(best[rows], recipe.conf_thresh, recipe.min_boxes, recipe.max_boxes)]
    lab = label[take]
    return VinVLPick(take, lab, best[take], boxes[take, lab])


def _filter_standard_once(boxes: torch.Tensor, probs: torch.Tensor, recipe, thresh: float) -> VinVLPick:
    rows, labels, scores = [], [], []
    above = probs > thresh
    for j in range(1, probs.shape[1]):
        idx = torch.nonzero(above[:, j]).flatten()
        if idx.numel() == 0:
            continue
        keep = idx[nms_keep(boxes[idx, j], probs[idx, j], recipe.roi_nms_thresh, recipe.nms_variant)]
        rows.append(keep)
        labels.append(torch.full_like(keep, j))
        scores.append(probs[keep, j])
    if not rows:
        z = torch.zeros(0, dtype=torch.long, device=probs.device)
        return VinVLPick(z, z, probs.new_zeros(0), boxes.new_zeros((0, 4)))
    rows_t, labels_t, scores_t = torch.cat(rows), torch.cat(labels), torch.cat(scores)
    n = rows_t.numel()
    if n > recipe.max_boxes > 0:
        kth = torch.kthvalue(scores_t.cpu(), n - recipe.max_boxes + 1).values.item()
        sel = torch.nonzero(scores_t >= kth).flatten()
        rows_t, labels_t, scores_t = rows_t[sel], labels_t[sel], scores_t[sel]
    return VinVLPick(rows_t, labels_t, scores_t, boxes[rows_t, labels_t])


def filter_standard(boxes: torch.Tensor, probs: torch.Tensor, recipe) -> VinVLPick:
    """``nms_filter`` 0 with the caller's retry: the threshold halves while fewer than ``min_boxes`` survive
    (10 tries)."""
    thresh = recipe.conf_thresh
    pick = _filter_standard_once(boxes, probs, recipe, thresh)
    tries = 0
    while pick.rows.numel() < recipe.min_boxes and tries < 10:
        thresh /= 2.0
        pick = _filter_standard_once(boxes, probs, recipe, thresh)
        tries += 1
    return pick


def filter_fast(props: torch.Tensor, probs: torch.Tensor, recipe) -> VinVLPick:
    """``nms_filter`` 2 on the (clipped) proposal boxes."""
    best, label = probs[:, 1:].max(dim=1)
    label = label + 1
    ws, hs = props[:, 2] - props[:, 0], props[:, 3] - props[:, 1]
    cand = torch.nonzero((ws >= 0) & (hs >= 0) & (best > recipe.conf_thresh * 0.01)).flatten()
    kept = cand[nms_keep(props[cand], best[cand], recipe.roi_nms_thresh, recipe.nms_variant)]
    order = torch.argsort(best[kept], descending=True, stable=True)
    kept = kept[order]
    take = kept[: _count_rule(best[kept], recipe.conf_thresh, recipe.min_boxes, recipe.max_boxes)]
    return VinVLPick(take, label[take], best[take], props[take])


def select(
    props: torch.Tensor, logits: torch.Tensor, deltas: torch.Tensor | None, size: tuple[int, int], recipe, spec
) -> VinVLPick:
    """The release's ``PostProcessor`` for one image: ``props`` (R, 4) clipped proposals, ``logits`` (R, C)."""
    probs = torch.softmax(logits.float(), dim=-1)
    ignore = bool(recipe.ignore_box_regression)
    boxes = class_boxes(
        props, None if ignore else deltas, probs.shape[1], size, ignore, spec.box_reg_weights, spec.scale_clamp
    )
    if recipe.nms_filter == 1:
        return filter_peter(boxes, probs, recipe, same_boxes=ignore)
    if recipe.nms_filter == 0:
        return filter_standard(boxes, probs, recipe)
    return filter_fast(boxes[:, 0], probs, recipe)


def attribute_top(attr_logits: torch.Tensor, thresh: float, per_image: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K,) best attribute index (1-based, the release's ``attr_labels[:, 0]``) and its post-processed score."""
    scores = torch.softmax(attr_logits.float(), dim=-1).clone()
    if scores.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=scores.device), scores.new_zeros(0)
    raw_best = scores[:, 1:].argmax(dim=1) + 1
    scores[:, 0] = 0.0
    above = scores > thresh
    n = int(above.sum())
    scores[~above] = 0.0
    if n > per_image > 0:
        kth = torch.kthvalue(scores.flatten().cpu(), n - per_image + 1).values.item()
        scores[scores < kth] = 0.0
    top, idx = scores.max(dim=1)
    idx = torch.where(top > 0, idx, raw_best)  # nothing survived: the most probable attribute, score 0
    return idx, top


class VinVLPostProcess(Selector):
    """The ``vinvl`` selection: the post-processing above, run inside
    :meth:`extractors.vinvl.detector.VinVLDetector.detect`, which needs the full class probabilities, the proposals
    in resized pixels and the attribute head."""

    name = "vinvl"
    fields = (
        "nms_filter",
        "ignore_box_regression",
        "roi_nms_thresh",
        "nms_variant",
        "attr_thresh",
        "max_attrs_per_image",
    )

    @classmethod
    def check(cls, recipe, where: str) -> None:
        """``nms_filter`` 2 indexes the proposals with the rows of the regressed boxes: it runs only on the
        proposals themselves (``ignore_box_regression``)."""
        if recipe.nms_filter == 2 and not recipe.ignore_box_regression:
            raise UsageError(
                f"{where}: nms_filter 2 needs ignore_box_regression true (with regression the release writes "
                "boxes of the wrong proposal; docs/recipes.md#vinvl)"
            )

    @classmethod
    def describe(cls, recipe) -> str:
        r = recipe
        how = {
            0: f"per class: score > {r.conf_thresh:g}, NMS {r.roi_nms_thresh:g}",
            1: f"per-class NMS {r.nms_thresh:g} over the proposals, keep best kept score >= {r.conf_thresh:g}",
            2: f"best class, one NMS {r.roi_nms_thresh:g}, keep >= {r.conf_thresh:g}",
        }[r.nms_filter]
        return (
            f"VinVL nms_filter {r.nms_filter}: {how}, {r.min_boxes}..{r.max_boxes} boxes; "
            f"{'proposal' if r.ignore_box_regression else 'regressed'} boxes, {r.nms_variant} NMS; "
            f"attributes > {r.attr_thresh:g}, at most {r.max_attrs_per_image} per image"
        )


SELECTORS["vinvl"] = VinVLPostProcess
