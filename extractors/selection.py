"""Box selection after the RoI head: the Caffe ``generate_tsv.py`` rule and the detectron2-port "maxnms".

**Caffe** (``get_detections_from_im``, docs/extractor.md#box-selection; MILVLG ``save_roi_features``): for every
foreground class c, greedy NMS at 0.3 over *all* proposals ranked by that class's score; each proposal keeps
``max_conf = max(score_c)`` over the classes in which it survived. Proposals with ``max_conf >= 0.2`` are kept;
if fewer than ``min_boxes`` (more than ``max_boxes``), the ``min_boxes`` (``max_boxes``) highest ``max_conf``
are taken instead (score-descending order; otherwise proposal order).

The per-class NMS is vectorised: one ``+1``-area IoU matrix per image, packed into 64-bit words, shared by all
classes, and one pass over the rank positions that updates the suppression bitsets of every class (and every
image of a batch) at once. It is exactly greedy NMS per class (the same survivors as the loop in
:func:`max_conf_loop`, which the tests compare it with).

**maxnms** (airsplay ``detectron2_mscoco_proposal_maxnms.py``): per proposal the best foreground class and its
regressed box; class-agnostic NMS on those boxes at 0.3, 0.4, ... 0.9 until at least ``min_boxes`` survive;
keep the first ``max_boxes``.
"""

from __future__ import annotations

import torch

from extractors import box_coding, nms

_BITS = 64


def _pack_rows(mask: torch.Tensor) -> torch.Tensor:
    """(..., R, R) bool -> (..., R, ceil(R/64)) int64 bitsets (bit j of word w = column 64*w + j)."""
    *lead, r, _ = mask.shape
    words = (r + _BITS - 1) // _BITS
    pad = words * _BITS - r
    m = torch.nn.functional.pad(mask.to(torch.int64), (0, pad)).view(*lead, r, words, _BITS)
    weights = torch.bitwise_left_shift(torch.ones(_BITS, dtype=torch.int64, device=mask.device), torch.arange(_BITS, device=mask.device))
    return (m * weights).sum(-1)  # distinct bits: the sum is the OR (2^63 wraps to the sign bit, no carries)


def max_conf_vectorized(boxes: torch.Tensor, scores: torch.Tensor, thresh: float = 0.3, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per-proposal max score over the classes in which greedy NMS (``+1`` IoU >= ``thresh``) keeps it.

    ``boxes`` (B, R, 4) or (R, 4); ``scores`` (B, R, K) or (R, K) foreground class scores (>= 0);
    ``valid`` (B, R) marks real proposals (padding never suppresses a real one: it ranks last).
    Returns (B, R) or (R,) float32. On CPU: :func:`extractors.nms.max_conf` (same result, faster).
    """
    if boxes.device.type == "cpu":
        return nms.max_conf(boxes, scores, thresh, valid)
    single = boxes.dim() == 2
    if single:
        boxes, scores = boxes[None], scores[None]
        valid = None if valid is None else valid[None]
    b, r, k = scores.shape
    if r == 0:
        out = scores.new_zeros((b, 0))
        return out[0] if single else out
    scores = scores.float()
    iou = torch.stack([box_coding.legacy_iou(boxes[i].float(), boxes[i].float()) for i in range(b)])
    over = _pack_rows(iou >= torch.tensor(thresh, dtype=torch.float32))  # (B, R, W)
    rank_scores = scores.transpose(1, 2)  # (B, K, R)
    if valid is not None:
        rank_scores = torch.where(valid[:, None, :], rank_scores, torch.full_like(rank_scores, -1.0))
    order = torch.argsort(rank_scores, dim=2, descending=True, stable=True)  # (B, K, R)
    words = over.shape[-1]
    over_flat = over.reshape(b * r, words)
    # per rank step, for every (image, class) row: the box id, its bitset word and bit, its row in over_flat
    order_t = order.permute(2, 0, 1).reshape(r, b * k).contiguous()  # (R, B*K)
    word_idx = torch.bitwise_right_shift(order_t, 6).unsqueeze(-1)  # (R, B*K, 1)
    bit = torch.bitwise_left_shift(torch.ones_like(order_t), torch.bitwise_and(order_t, _BITS - 1))
    row_idx = order_t + (torch.arange(b, device=boxes.device) * r).repeat_interleave(k).view(1, b * k)
    suppressed = torch.zeros((b * k, words), dtype=torch.int64, device=boxes.device)
    kept_t = torch.empty((r, b * k), dtype=torch.bool, device=boxes.device)
    for step in range(r):
        word = torch.gather(suppressed, 1, word_idx[step]).squeeze(1)
        alive = torch.bitwise_and(word, bit[step]) == 0
        kept_t[step] = alive
        rows = torch.index_select(over_flat, 0, row_idx[step])
        suppressed |= rows * alive.unsqueeze(1)
    kept = kept_t.view(r, b, k).permute(1, 2, 0)  # (B, K, R) in rank order
    kept_by_box = torch.zeros_like(kept).scatter_(2, order, kept)
    max_conf = torch.where(kept_by_box, rank_scores, torch.zeros_like(rank_scores)).amax(dim=1).clamp_min(0.0)
    if valid is not None:
        max_conf = torch.where(valid, max_conf, torch.zeros_like(max_conf))
    return max_conf[0] if single else max_conf


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
