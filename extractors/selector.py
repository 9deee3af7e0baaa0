"""The selection step after the RoI head, as one swappable part: class probabilities -> selector -> regions.

A selector is made from a :class:`extractors.recipes.Recipe` (:func:`make_selector`) and owns everything
between the head's outputs and the regions written: which boxes compete, which NMS, which thresholds, how
many regions, and how boxes go back to original-image pixels (as torchvision's ``RoIHeads`` owns its
post-processing). Changing the selection touches a selector and one YAML (``configs/extract.yaml``).

* :class:`PerClassNMS` (Caffe ``generate_tsv.py``, MILVLG ``save_roi_features``; Anderson et al. 2018): for
  every foreground class c, greedy NMS at ``nms_thresh`` over *all* proposals ranked by ``p_c``; a proposal's
  ``max_conf = max_c p_c`` over the classes in which it survived; keep ``max_conf >= conf_thresh``, or the
  ``min_boxes`` / ``max_boxes`` best when outside that range; write the proposal boxes.
* :class:`NMSLadder` (airsplay ``detectron2_mscoco_proposal_maxnms.py``; HF ``modeling_frcnn.py do_nms``):
  per proposal its best foreground class and that class's regressed box (clipped to the resized image);
  class-agnostic NMS on those boxes at each threshold of the ladder until at least ``min_boxes`` survive;
  the first ``max_boxes``; write the regressed boxes.
* :class:`GivenBoxes`: the supplied boxes, in their order.

The rules are the module's functions: :func:`max_conf_vectorized` (Caffe's per-class ``max_conf``,
docs/extractor.md#box-selection), :func:`clamp_selection` (the ``conf_thresh`` / [min, max] rule) and
:func:`maxnms_select` (the ladder).
The per-class NMS is vectorised (:mod:`extractors.nms`): one ``+1``-area IoU matrix per image gives the overlap
graph shared by all classes, and a fixed-point iteration over it solves greedy NMS for every class (and every
image of a batch) at once. It is exactly greedy NMS per class (the same survivors as the loop in
:func:`max_conf_loop`, which the tests compare it with).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from extractors import box_coding, nms
from extractors.preprocess import Frame
from extractors.releases import release_of_flavor
from pipeline.core.errors import UsageError


def max_conf_vectorized(
    boxes: torch.Tensor, scores: torch.Tensor, thresh: float = 0.3, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-proposal max score over the classes in which greedy NMS (``+1`` IoU >= ``thresh``) keeps it.

    ``boxes`` (B, R, 4) or (R, 4); ``scores`` (B, R, K) or (R, K) foreground class scores (>= 0);
    ``valid`` (B, R) marks real proposals (padding neither suppresses nor is scored). Returns (B, R) or (R,)
    float32. On CPU :func:`extractors.nms.max_conf` (packed class words), on a GPU
    :func:`extractors.nms.max_conf_device` (the same fixed point with device operators, a few sweeps instead of one
    sequential step per rank).
    """
    if boxes.device.type == "cpu":
        return nms.max_conf(boxes, scores, thresh, valid)
    single = boxes.dim() == 2
    if single:
        boxes, scores = boxes[None], scores[None]
        valid = None if valid is None else valid[None]
    out = nms.max_conf_device(boxes, scores, thresh, valid)
    return out[0] if single else out


def max_conf_loop(boxes: torch.Tensor, scores: torch.Tensor, thresh: float = 0.3) -> torch.Tensor:
    """Reference: the ``generate_tsv.py`` loop, one Caffe NMS call per class. (R, 4), (R, K) -> (R,)."""
    max_conf = torch.zeros(boxes.shape[0], dtype=torch.float32, device=boxes.device)
    for c in range(scores.shape[1]):
        s = scores[:, c].float()
        keep = box_coding.nms_boxes(boxes.float(), s, thresh, legacy=True)
        max_conf[keep] = torch.maximum(max_conf[keep], s[keep])
    return max_conf


def clamp_selection(max_conf: torch.Tensor, conf_thresh: float, min_boxes: int, max_boxes: int) -> torch.Tensor:
    """Indices kept by the ``conf_thresh`` / [min_boxes, max_boxes] rule (proposal order when in range)."""
    keep = torch.nonzero(max_conf >= conf_thresh).flatten()
    if keep.numel() < min_boxes or keep.numel() > max_boxes:
        n = min_boxes if keep.numel() < min_boxes else max_boxes
        keep = torch.argsort(max_conf, descending=True, stable=True)[:n]
    return keep


def maxnms_select(
    boxes: torch.Tensor,
    fg_scores: torch.Tensor,
    min_boxes: int,
    max_boxes: int,
    thresholds=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
) -> tuple[torch.Tensor, torch.Tensor]:
    """airsplay "maxnms": ``boxes`` (R, K, 4) class boxes, ``fg_scores`` (R, K) -> (kept proposal ids, their boxes).

    Stops at the first threshold that leaves at least ``min_boxes`` proposals (the last one otherwise).
    """
    r = fg_scores.shape[0]
    best_score, best_cls = fg_scores.float().max(dim=1)
    best_boxes = boxes[torch.arange(r, device=boxes.device), best_cls]
    keep = best_score.new_zeros((0,), dtype=torch.long)
    for t in thresholds:
        keep = box_coding.nms_boxes(best_boxes, best_score, t, legacy=False)
        if keep.numel() >= min_boxes:
            break
    keep = keep[:max_boxes]
    return keep, best_boxes[keep]


@dataclass
class Selected:
    """One image's choice: proposal indices in output order and their boxes (N, 4) in original pixels."""

    keep: torch.Tensor
    boxes: torch.Tensor


def to_original(boxes: torch.Tensor, frame: Frame, rescale: str, clip: str) -> torch.Tensor:
    """Resized-image boxes -> original pixels.

    ``im-scale``: ``boxes / im_scale`` (Caffe: ``rois / im_scale``). ``per-axis``: ``x * (W / W')``,
    ``y * (H / H')`` in float32 (HF ``scales_yx``, detectron2 ``Boxes.scale``). ``clip``: ``resized`` clips to
    ``[0, W'] x [0, H']`` first; ``resized-and-original`` also clips to ``[0, W] x [0, H]`` afterwards.
    """
    b = boxes.float()
    if clip in ("resized", "resized-and-original"):
        b = box_coding.clip(b, frame.blob_h, frame.blob_w, legacy=False)
    if rescale == "im-scale":
        b = b / frame.im_scale
    else:
        sx, sy = frame.scale_xy
        b = b.clone()
        b[:, 0::2] *= torch.tensor(sx, dtype=torch.float32, device=b.device)
        b[:, 1::2] *= torch.tensor(sy, dtype=torch.float32, device=b.device)
    if clip == "resized-and-original":
        b = box_coding.clip(b, frame.height, frame.width, legacy=False)
    return b


def to_resized(boxes: torch.Tensor, frame: Frame, rescale: str) -> torch.Tensor:
    """Original-pixel boxes -> resized-image boxes (given-boxes mode): ``* im_scale`` or per axis ``* W'/W``."""
    b = boxes.float()
    if rescale == "im-scale":
        return b * frame.im_scale
    b = b.clone()
    b[:, 0::2] *= frame.blob_w / frame.width
    b[:, 1::2] *= frame.blob_h / frame.height
    return b


class Selector:
    """Base: ``__call__(rois, fg, deltas, frames)`` -> one :class:`Selected` per image; ``box_coder``: the coder
    of the detector's box regression (:class:`extractors.box_coding.BoxCoder`, for selectors that decode it).

    ``rois`` (R_i, 4) proposals in resized pixels, ``fg`` (R_i, K) foreground class probabilities, ``deltas``
    (R_i, 4 * bbox_classes) box regression, ``frames`` the images' :class:`Frame`.
    """

    name = "selector"
    given = False
    #: the recipe fields only this selection reads: a recipe of another selection leaves them out of its
    #: identity (:meth:`extractors.recipes.Recipe.to_dict`)
    fields: tuple[str, ...] = ()

    def __init__(self, recipe, spec, box_coder: box_coding.BoxCoder | None = None) -> None:
        self.recipe, self.spec, self.box_coder = recipe, spec, box_coder

    @classmethod
    def check(cls, recipe, where: str) -> None:
        """Refuse, in one :class:`UsageError` line, recipe values this selection cannot run together."""

    #: the ``selection`` row of ``cli info WEIGHTS`` and of the run's log, formatted with the recipe as ``r``
    #: (a selection whose row needs more than a format string overrides :meth:`describe`)
    summary = "{r.selector}"

    @classmethod
    def describe(cls, recipe) -> str:
        """The ``selection`` row for ``recipe`` (:func:`extractors.recipes.describe_recipe`)."""
        return cls.summary.format(r=recipe)

    def __call__(self, rois, fg, deltas, frames) -> list[Selected]:  # pragma: no cover - interface
        raise NotImplementedError


class PerClassNMS(Selector):
    """Caffe / MILVLG: per-class NMS over the proposals, ``max_conf`` threshold, [min, max] clamp."""

    name = "per-class-nms"

    summary = (
        "per-class NMS {r.nms_thresh:g} over the proposals, keep max score >= {r.conf_thresh:g}, "
        "{r.min_boxes}..{r.max_boxes} boxes; proposal boxes"
    )

    def __call__(self, rois, fg, deltas, frames) -> list[Selected]:
        r = self.recipe
        orig = [to_original(rois[i], frames[i], r.rescale, r.clip) for i in range(len(rois))]
        n = len(orig)
        if n == 0:
            return []
        r_max = max(b.shape[0] for b in orig)
        k = fg[0].shape[1]
        dev = orig[0].device
        boxes_pad = torch.zeros((n, r_max, 4), device=dev)
        scores_pad = torch.zeros((n, r_max, k), device=dev)
        valid = torch.zeros((n, r_max), dtype=torch.bool, device=dev)
        for i in range(n):
            m = orig[i].shape[0]
            boxes_pad[i, :m], scores_pad[i, :m], valid[i, :m] = orig[i], fg[i], True
        max_conf = self.max_conf(boxes_pad, scores_pad, valid)
        out = []
        for i in range(n):
            m = orig[i].shape[0]
            keep = clamp_selection(max_conf[i, :m], r.conf_thresh, r.min_boxes, r.max_boxes)
            out.append(Selected(keep, orig[i][keep]))
        return out

    def max_conf(self, boxes: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """(B, R) per-proposal max class score over the classes whose greedy NMS (``+1`` areas, ``IoU >=
        nms_thresh``, Caffe ``cpu_nms``) keeps it: :func:`max_conf_vectorized`."""
        return max_conf_vectorized(boxes, scores, self.recipe.nms_thresh, valid)


class NMSLadder(Selector):
    """airsplay / HF "maxnms": best class per proposal, its regressed box, class-agnostic NMS ladder."""

    name = "nms-ladder"

    @classmethod
    def describe(cls, recipe) -> str:
        r = recipe
        return (
            f"best class per proposal, its regressed box; NMS ladder {', '.join(f'{t:g}' for t in r.ladder)} "
            f"until >= {r.min_boxes}, first {r.max_boxes}"
        )

    def class_boxes(self, rois: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """(R, K, 4) regressed box per foreground class in resized pixels (the box coder the detector was built
        with)."""
        spec = self.spec
        boxes = self.box_coder.decode(deltas, rois, spec.box_reg_weights, spec.scale_clamp)
        boxes = boxes.view(rois.shape[0], spec.bbox_classes, 4)
        if spec.bbox_classes == spec.num_classes:  # regression rows include the background: drop it
            bg = spec.background_index
            boxes = torch.cat([boxes[:, :bg], boxes[:, bg + 1 :]], dim=1)
        return boxes

    def __call__(self, rois, fg, deltas, frames) -> list[Selected]:
        r = self.recipe
        out = []
        for i, frame in enumerate(frames):
            cls_boxes = self.class_boxes(rois[i], deltas[i])
            if r.clip in ("resized", "resized-and-original"):
                cls_boxes = box_coding.clip(cls_boxes, frame.blob_h, frame.blob_w, legacy=False)
            keep, best = maxnms_select(cls_boxes, fg[i], r.min_boxes, r.max_boxes, thresholds=r.ladder)
            boxes = to_original(
                best, frame, r.rescale, "resized-and-original" if r.clip == "resized-and-original" else "none"
            )
            if r.drop_empty:
                nonempty = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
                keep, boxes = keep[nonempty], boxes[nonempty]
            out.append(Selected(keep, boxes))
        return out


class GivenBoxes(Selector):
    """Features pooled on supplied boxes: every box, in order, written as given (original pixels)."""

    name = "given"
    given = True

    summary = "given boxes (features pooled on supplied boxes)"

    def __call__(self, rois, fg, deltas, frames) -> list[Selected]:
        r = self.recipe
        out = []
        for i, frame in enumerate(frames):
            keep = torch.arange(rois[i].shape[0], device=rois[i].device)
            out.append(Selected(keep, to_original(rois[i], frame, r.rescale, "none")))
        return out


SELECTORS: dict[str, type[Selector]] = {
    "per-class-nms": PerClassNMS,
    "nms-ladder": NMSLadder,
    "given": GivenBoxes,
}
"""Selection name -> class; a release module adds the selections only its detector runs (``grid``: the whole-image
res5 map of :mod:`extractors.grid`; ``vinvl``: :mod:`extractors.vinvl.select`)."""


def make_selector(recipe, spec) -> Selector:
    """The selector a recipe names, bound to the detector's spec (class layout) and to the box coder of the parts
    its release builds the detector from (``Release.parts``). The release of the spec's semantics names the
    selections its detector runs; another one is a one-line :class:`UsageError`."""
    release = release_of_flavor(spec.flavor)  # every extractor module imported: each selection is registered
    if recipe.selector not in release.selectors:
        raise UsageError(
            f"recipe {recipe.name!r} (selector {recipe.selector}) does not run on {spec.flavor} weights: "
            f"their detector ({release.name} release) runs {', '.join(release.selectors)}"
        )
    if recipe.selector not in SELECTORS:
        raise ValueError(f"release {release.name} runs selection {recipe.selector!r}, which no module registers")
    coder = getattr(release.parts, "box_coder", None)  # None: the release's detector decodes its own boxes
    return SELECTORS[recipe.selector](recipe, spec, coder)
