"""Box selection after the RoI head: the Caffe ``generate_tsv.py`` rule and the detectron2-port "maxnms".

**Caffe** (``get_detections_from_im``, docs/extractor.md#box-selection; MILVLG ``save_roi_features``): for every
foreground class c, greedy NMS at 0.3 over *all* proposals ranked by that class's score; each proposal keeps
``max_conf = max(score_c)`` over the classes in which it survived. Proposals with ``max_conf >= 0.2`` are kept;
if fewer than ``min_boxes`` (more than ``max_boxes``), the ``min_boxes`` (``max_boxes``) highest ``max_conf``
are taken instead (score-descending order; otherwise proposal order).

The per-class NMS is vectorised (:mod:`extractors.nms`): one ``+1``-area IoU matrix per image gives the overlap
graph shared by all classes, and a fixed-point iteration over it solves greedy NMS for every class (and every
image of a batch) at once. It is exactly greedy NMS per class (the same survivors as the loop in
:func:`max_conf_loop`, which the tests compare it with).

**maxnms** (airsplay ``detectron2_mscoco_proposal_maxnms.py``): per proposal the best foreground class and its
regressed box; class-agnostic NMS on those boxes at 0.3, 0.4, ... 0.9 until at least ``min_boxes`` survive;
keep the first ``max_boxes``.
"""

from __future__ import annotations

import torch

from extractors import box_coding, nms

def max_conf_vectorized(boxes: torch.Tensor, scores: torch.Tensor, thresh: float = 0.3, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per-proposal max score over the classes in which greedy NMS (``+1`` IoU >= ``thresh``) keeps it.

    ``boxes`` (B, R, 4) or (R, 4); ``scores`` (B, R, K) or (R, K) foreground class scores (>= 0);
    ``valid`` (B, R) marks real proposals (padding neither suppresses nor is scored). Returns (B, R) or (R,)
    float32. On CPU :func:`extractors.nms.max_conf` (packed class words), on a GPU :func:`extractors.nms.max_conf_device`
    (the same fixed point with device operators, a few sweeps instead of one sequential step per rank).
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


def maxnms_select(boxes: torch.Tensor, fg_scores: torch.Tensor, min_boxes: int, max_boxes: int, thresholds=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)) -> tuple[torch.Tensor, torch.Tensor]:
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
