"""Training targets: RPN anchor labels (``anchor_target_layer``) and RoI sampling (``proposal_target_layer``).

Both follow py-faster-rcnn with the bottom-up configuration (``faster_rcnn_end2end_resnet.yml``) and reuse
torchvision's :class:`~torchvision.models.detection._utils.Matcher` and
:class:`~torchvision.models.detection._utils.BalancedPositiveNegativeSampler`; overlaps and box targets use the
legacy ``+1`` convention of :mod:`extractors.box_coding` (torchvision's ``BoxCoder`` has no ``+1``, so it is
not used).

* RPN: anchors that leave the image (``allowed_border = 0``) are ignored; IoU >= 0.7 positive, < 0.3
  negative, and for every ground-truth box its best anchors (ties included) are positive; 64 anchors per
  image, at most half positive; regression targets are raw deltas (``RPN_NORMALIZE_TARGETS = False``).
* RoIs: the RPN proposals plus the ground-truth boxes; IoU >= 0.5 foreground, [0, 0.5) background; 64 per
  image, at most half foreground; regression targets normalised by the stds (0.1, 0.1, 0.2, 0.2)
  (``BBOX_NORMALIZE_TARGETS_PRECOMPUTED``), i.e. encoded with weights (10, 10, 5, 5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchvision.models.detection._utils import BalancedPositiveNegativeSampler, Matcher

from extractors import box_coding


@dataclass(frozen=True)
class SamplingConfig:
    """The ``sampling`` section of a ``train_detector`` config: anchor and RoI sampling (py-faster-rcnn
    ``TRAIN.RPN_*`` / ``TRAIN.*``) and the training-time proposal counts before and after the RPN's NMS."""

    rpn_batch_size: int = 64
    rpn_positive_fraction: float = 0.5
    rpn_positive_overlap: float = 0.7
    rpn_negative_overlap: float = 0.3
    rpn_pre_nms_topk: int = 12000
    rpn_post_nms_topk: int = 2000
    roi_batch_size: int = 64
    roi_positive_fraction: float = 0.5
    fg_thresh: float = 0.5
    bg_thresh_hi: float = 0.5
    bg_thresh_lo: float = 0.0
    bbox_normalize_stds: tuple[float, float, float, float] = (0.1, 0.1, 0.2, 0.2)

    @property
    def box_weights(self) -> tuple[float, float, float, float]:
        return tuple(1.0 / s for s in self.bbox_normalize_stds)  # type: ignore[return-value]


def anchor_targets(
    anchors: torch.Tensor,
    gt: torch.Tensor,
    size: tuple[int, int],
    cfg: SamplingConfig,
    sampler: BalancedPositiveNegativeSampler,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (labels (A,) with 1 = sampled positive, 0 = sampled negative, -1 = not sampled; deltas (A, 4)).

    ``anchors`` (A, 4) and ``gt`` (G, 4) are blob-pixel inclusive boxes; ``size`` is the image's (h, w).
    """
    h, w = size
    n = anchors.shape[0]
    labels = torch.full((n,), -1, dtype=torch.int64, device=anchors.device)
    deltas = anchors.new_zeros((n, 4))
    inside = (anchors[:, 0] >= 0) & (anchors[:, 1] >= 0) & (anchors[:, 2] < w) & (anchors[:, 3] < h)
    idx = torch.nonzero(inside).flatten()
    if idx.numel() == 0:
        return labels, deltas
    if gt.shape[0] == 0:
        labels[idx] = 0
    else:
        iou = box_coding.legacy_iou(gt, anchors[idx])  # (G, A_in)
        reachable = iou.max(dim=1).values > 0  # a box no anchor touches cannot make low-quality positives
        matcher = Matcher(cfg.rpn_positive_overlap, cfg.rpn_negative_overlap, allow_low_quality_matches=True)
        if bool(reachable.any()):
            gt_idx = torch.nonzero(reachable).flatten()
            m = matcher(iou[gt_idx])
            pos = m >= 0
            lab = torch.where(pos, 1, torch.where(m == Matcher.BELOW_LOW_THRESHOLD, 0, -1))
            matched = gt[gt_idx[m.clamp(min=0)]]
            deltas[idx[pos]] = box_coding.encode(anchors[idx[pos]], matched[pos], (1.0, 1.0, 1.0, 1.0), legacy=True)
        else:
            lab = torch.zeros(idx.numel(), dtype=torch.int64, device=anchors.device)
        labels[idx] = lab
    pos_mask, neg_mask = sampler([labels.clamp(min=-1)])
    out = torch.full_like(labels, -1)
    out[pos_mask[0].bool()] = 1
    out[neg_mask[0].bool()] = 0
    return out, deltas


@dataclass
class SampledRois:
    rois: torch.Tensor  # (R, 4) blob pixels
    labels: torch.Tensor  # (R,) class index, 0 = background
    deltas: torch.Tensor  # (R, 4) normalised regression targets (zeros for background)
    attributes: torch.Tensor  # (R, M) attribute indices of the matched box, -1 padded (background: all -1)
    num_fg: int


def sample_rois(
    proposals: torch.Tensor,
    gt: torch.Tensor,
    gt_labels: torch.Tensor,
    gt_attrs: torch.Tensor,
    cfg: SamplingConfig,
    sampler: BalancedPositiveNegativeSampler,
) -> SampledRois:
    """Label and sample RoIs from ``proposals`` + ``gt`` (foreground first, as the Caffe layer orders them)."""
    cand = torch.cat([proposals, gt]) if gt.shape[0] else proposals
    n = cand.shape[0]
    if gt.shape[0] == 0:
        matched = torch.full((n,), -1, dtype=torch.int64, device=cand.device)
        max_iou = cand.new_zeros((n,))
    else:
        iou = box_coding.legacy_iou(gt, cand)
        max_iou, matched = iou.max(dim=0)
    fg = max_iou >= cfg.fg_thresh
    bg = (max_iou < cfg.bg_thresh_hi) & (max_iou >= cfg.bg_thresh_lo)
    labels = torch.full((n,), -1, dtype=torch.int64, device=cand.device)
    labels[bg] = 0
    labels[fg] = 1
    pos_mask, neg_mask = sampler([labels])
    pos = torch.nonzero(pos_mask[0]).flatten()
    neg = torch.nonzero(neg_mask[0]).flatten()
    keep = torch.cat([pos, neg])
    rois = cand[keep]
    out_labels = torch.zeros(keep.numel(), dtype=torch.int64, device=cand.device)
    deltas = cand.new_zeros((keep.numel(), 4))
    attrs = torch.full(
        (keep.numel(), gt_attrs.shape[1] if gt_attrs.dim() == 2 else 1), -1, dtype=torch.int64, device=cand.device
    )
    if pos.numel():
        g = matched[pos]
        out_labels[: pos.numel()] = gt_labels[g]
        deltas[: pos.numel()] = box_coding.encode(cand[pos], gt[g], cfg.box_weights, legacy=True)
        attrs[: pos.numel()] = gt_attrs[g]
    return SampledRois(rois, out_labels, deltas, attrs, int(pos.numel()))
