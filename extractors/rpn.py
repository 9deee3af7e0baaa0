"""Region proposal network on C4 (Ren et al. 2015, §3.1): the Caffe and detectron2 test-time proposal stages.

Head: 3x3 conv (C4 -> ``rpn_channels``) + ReLU, then 1x1 ``objectness_logits`` and 1x1 ``anchor_deltas``
(4 per anchor, channel ``4a + k``). The parts a release builds its proposal stage from:

* the anchor table (spec -> cell anchors): :func:`caffe_anchor_table` (py-faster-rcnn ``generate_anchors`` with
  ``anchor_scales``) or :func:`d2_anchor_table` (detectron2 ``DefaultAnchorGenerator`` at ``anchor_sizes``), passed
  to :class:`AnchorGenerator`;
* the proposal stage, :class:`RPN` or :class:`DetectronRPN`, with its objectness and its box coder
  (:class:`extractors.box_coding.BoxCoder`).

Objectness: :class:`RPN` (Caffe) reads 2A channels as (2, A): channels ``0..A-1`` background, ``A..2A-1``
foreground, probability = 2-way softmax (``rpn_cls_prob_reshape``), score = foreground probability.
:class:`DetectronRPN`: A logits, score = the logit (sigmoid is monotone; detectron2 ranks by logits).

Proposals (``ProposalLayer.forward`` / MILVLG ``find_top_bua_rpn_proposals``, docs/extractor.md#region-proposals):
:class:`RPN`: decode (``+1``), clip to [0, W-1], drop boxes with ``w + 1 < min_size * scale``, top ``pre_nms`` by
score, NMS 0.7 (``+1`` areas, ``>=``), first ``post_nms``. :class:`DetectronRPN`: top ``pre_nms`` by logit first,
then decode, clip to [0, W], drop empty boxes, NMS 0.7 (torchvision), first ``post_nms``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from extractors import box_coding
from extractors.anchors import caffe_cell_anchors, d2_cell_anchors, grid_anchors
from extractors.spec import BottomUpSpec

AnchorTable = Callable[[BottomUpSpec], torch.Tensor]
"""spec -> the (A, 4) cell anchors a detector holds by default (the checkpoint's own table replaces them)."""


def caffe_anchor_table(spec: BottomUpSpec) -> torch.Tensor:
    """py-faster-rcnn ``generate_anchors(base anchor_stride, anchor_ratios, anchor_scales)`` (Caffe)."""
    return caffe_cell_anchors(spec.anchor_stride, spec.anchor_ratios, spec.anchor_scales)


def d2_anchor_table(spec: BottomUpSpec) -> torch.Tensor:
    """detectron2 ``DefaultAnchorGenerator`` at ``anchor_sizes``, ``anchor_ratios``."""
    return d2_cell_anchors(spec.anchor_sizes, spec.anchor_ratios)


class _BufferList(nn.Module):
    """Anchors as persistent buffers named ``0, 1, ...`` (state-dict key ``cell_anchors.0``)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        for i, t in enumerate(tensors):
            self.register_buffer(str(i), t)

    def __getitem__(self, i: int) -> torch.Tensor:
        return getattr(self, str(i))


class AnchorGenerator(nn.Module):
    """Holds the cell anchors loaded from the checkpoint (defaults: ``table(spec)``, the release's own table)."""

    def __init__(self, spec: BottomUpSpec, table: AnchorTable) -> None:
        super().__init__()
        self.table = table
        self.cell_anchors = _BufferList([table(spec)])
        self.stride = spec.anchor_stride

    def forward(self, feat_h: int, feat_w: int) -> torch.Tensor:
        return grid_anchors(self.cell_anchors[0], feat_h, feat_w, self.stride, 0.0)


class RPNHead(nn.Module):
    def __init__(self, in_channels: int, hidden: int, num_anchors: int, softmax_objectness: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, hidden, 3, padding=1)
        self.objectness_logits = nn.Conv2d(hidden, num_anchors * (2 if softmax_objectness else 1), 1)
        self.anchor_deltas = nn.Conv2d(hidden, num_anchors * 4, 1)
        for m in (self.conv, self.objectness_logits, self.anchor_deltas):
            nn.init.normal_(m.weight, std=0.01)
            nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.relu(self.conv(x))
        return self.objectness_logits(h), self.anchor_deltas(h)


class RPN(nn.Module):
    """``proposal_generator``: anchors + head + test-time proposal selection, as the Caffe ``ProposalLayer``
    (softmax objectness, :data:`~extractors.box_coding.LEGACY` box coder, :func:`caffe_anchor_table` unless
    ``anchor_table`` is given)."""

    anchor_table: AnchorTable = staticmethod(caffe_anchor_table)
    coder: box_coding.BoxCoder = box_coding.LEGACY
    softmax_objectness = True

    def __init__(self, spec: BottomUpSpec, in_channels: int, anchor_table: AnchorTable | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.anchor_generator = AnchorGenerator(spec, anchor_table or self.anchor_table)
        self.rpn_head = RPNHead(
            in_channels, spec.rpn_channels, spec.num_anchors, softmax_objectness=self.softmax_objectness
        )

    def objectness(self, logits: torch.Tensor) -> torch.Tensor:
        """(N, 2A, H, W) logits -> (N, H*W*A) foreground probabilities (``rpn_cls_prob_reshape``)."""
        n, _, h, w = logits.shape
        a = self.spec.num_anchors
        prob = torch.softmax(logits.view(n, 2, a, h, w), dim=1)[:, 1]  # foreground = second half
        return prob.permute(0, 2, 3, 1).reshape(n, -1)

    def scores_and_deltas(self, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per image (N, H*W*A) scores and (N, H*W*A, 4) deltas in the (h, w, a) anchor order."""
        logits, deltas = self.rpn_head(feat)
        n, _, h, w = logits.shape
        a = self.spec.num_anchors
        scores = self.objectness(logits.float())
        deltas = deltas.float().view(n, a, 4, h, w).permute(0, 3, 4, 1, 2).reshape(n, -1, 4)
        return scores, deltas

    def forward(
        self, feat: torch.Tensor, image_sizes: list[tuple[int, int]], scales: list[float]
    ) -> list[torch.Tensor]:
        """Proposal boxes (R_i, 4) in blob coordinates for each image of ``feat`` (equal-sized batch)."""
        scores, deltas = self.scores_and_deltas(feat)
        anchors = self.anchor_generator(feat.shape[-2], feat.shape[-1])
        return [self._select(scores[i], deltas[i], anchors, image_sizes[i], scales[i]) for i in range(feat.shape[0])]

    def _select(
        self,
        scores: Tensor,
        deltas: Tensor,
        anchors: Tensor,
        size: tuple[int, int],
        scale: float,
        pre_nms_topk: int | None = None,
        post_nms_topk: int | None = None,
    ) -> Tensor:
        """One image's proposals: the release's candidates (:meth:`_candidates`), NMS at ``rpn_nms_thresh``, the
        first ``post_nms_topk`` kept. ``pre_nms_topk`` / ``post_nms_topk`` override the spec's test values
        (training uses 12000 / 2000, py-faster-rcnn ``TRAIN.RPN_PRE/POST_NMS_TOP_N``)."""
        s = self.spec
        pre = s.pre_nms_topk if pre_nms_topk is None else pre_nms_topk
        post = s.post_nms_topk if post_nms_topk is None else post_nms_topk
        found = self._candidates(scores, deltas, anchors, size, scale, pre)
        if found is None:
            # an image smaller than min_size (16 px at original scale) has no admissible proposal; Caffe
            # would fail on it - we fall back to the whole image as the single proposal, NMS and cut skipped
            h, w = size
            return torch.tensor([[0.0, 0.0, w - 1.0, h - 1.0]], device=deltas.device)
        boxes, scores = found
        keep = self.coder.nms(boxes, scores, s.rpn_nms_thresh)[:post]
        return boxes[keep]

    def _candidates(
        self, scores: Tensor, deltas: Tensor, anchors: Tensor, size: tuple[int, int], scale: float, pre: int
    ) -> tuple[Tensor, Tensor] | None:
        """py-faster-rcnn ``ProposalLayer.forward`` up to its NMS: decode (``+1``), clip to [0, W-1], drop boxes
        with ``w + 1`` or ``h + 1`` below ``rpn_min_size * scale``, sort by score, the first ``pre``. The boxes and
        their scores; None when the size filter leaves no box."""
        s = self.spec
        h, w = size
        boxes = self.coder.decode(deltas, anchors, (1.0, 1.0, 1.0, 1.0), s.scale_clamp)
        boxes = self.coder.clip(boxes, h, w)
        min_size = s.rpn_min_size * scale
        keep = ((boxes[:, 2] - boxes[:, 0] + 1) >= min_size) & ((boxes[:, 3] - boxes[:, 1] + 1) >= min_size)
        if not bool(keep.any()):
            return None
        boxes, scores = boxes[keep], scores[keep]
        order = torch.argsort(scores, descending=True, stable=True)[:pre]
        return boxes[order], scores[order]


class DetectronRPN(RPN):
    """The proposal stage of the detectron2 ports (``RPN`` + ``find_top_rpn_proposals``): objectness logits,
    :data:`~extractors.box_coding.DETECTRON2` box coder, :func:`d2_anchor_table` unless ``anchor_table`` is given."""

    anchor_table: AnchorTable = staticmethod(d2_anchor_table)
    coder: box_coding.BoxCoder = box_coding.DETECTRON2
    softmax_objectness = False

    def objectness(self, logits: torch.Tensor) -> torch.Tensor:
        """(N, A, H, W) logits -> (N, H*W*A) logits (detectron2 ranks by logits)."""
        n, a, h, w = logits.shape
        return logits.view(n, a, h, w).permute(0, 2, 3, 1).reshape(n, -1)

    def _candidates(
        self, scores: Tensor, deltas: Tensor, anchors: Tensor, size: tuple[int, int], scale: float, pre: int
    ) -> tuple[Tensor, Tensor]:
        """detectron2 ``find_top_rpn_proposals`` up to its NMS: the first ``pre`` by logit, decode, clip to
        [0, W], drop boxes not wider and taller than ``rpn_min_size`` (blob pixels: ``scale`` is not used). The
        boxes and their scores, possibly none."""
        s = self.spec
        h, w = size
        order = torch.argsort(scores, descending=True, stable=True)[:pre]
        boxes = self.coder.decode(deltas[order], anchors[order], (1.0, 1.0, 1.0, 1.0), s.scale_clamp)
        scores = scores[order]
        boxes = self.coder.clip(boxes, h, w)
        keep = ((boxes[:, 2] - boxes[:, 0]) > s.rpn_min_size) & ((boxes[:, 3] - boxes[:, 1]) > s.rpn_min_size)
        return boxes[keep], scores[keep]
