"""Box coders, clipping and NMS in the two conventions of the bottom-up ecosystem.

* **Legacy / Caffe** (``+1``): width = ``x2 - x1 + 1``, centre = ``x1 + 0.5 * width``; decoding follows
  py-faster-rcnn ``bbox_transform_inv`` exactly, i.e. ``x2 = ctr + 0.5 * w`` (no ``-1``), so
  ``decode(encode(b)) = b + [0, 0, 1, 1]`` - the original's quirk, kept on purpose. Overlaps use ``+1`` areas and
  Caffe ``cpu_nms`` suppresses when ``IoU >= thresh``.
* **detectron2** (no ``+1``): width = ``x2 - x1``, centre = ``x1 + 0.5 * width``, ``decode(encode(b)) = b``;
  torchvision NMS suppresses when ``IoU > thresh``.

Both decoders divide the deltas by ``weights`` and clamp ``dw, dh`` at ``log(1000/16)`` as MILVLG/detectron2 do
(Caffe itself does not clamp; the clamp only acts on deltas > 4.1, i.e. boxes > 62x their anchor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torchvision.ops import batched_nms, box_iou, nms

DEFAULT_SCALE_CLAMP = math.log(1000.0 / 16)


def encode(src: torch.Tensor, target: torch.Tensor, weights=(1.0, 1.0, 1.0, 1.0), legacy: bool = True) -> torch.Tensor:
    """R-CNN deltas ``(dx, dy, dw, dh)`` turning ``src`` boxes into ``target`` (Girshick et al. 2014, eq. 6-9)."""
    one = 1.0 if legacy else 0.0
    sw = src[:, 2] - src[:, 0] + one
    sh = src[:, 3] - src[:, 1] + one
    sx = src[:, 0] + 0.5 * sw
    sy = src[:, 1] + 0.5 * sh
    tw = target[:, 2] - target[:, 0] + one
    th = target[:, 3] - target[:, 1] + one
    tx = target[:, 0] + 0.5 * tw
    ty = target[:, 1] + 0.5 * th
    wx, wy, ww, wh = weights
    return torch.stack(
        (wx * (tx - sx) / sw, wy * (ty - sy) / sh, ww * torch.log(tw / sw), wh * torch.log(th / sh)), dim=1
    )


def decode(
    deltas: torch.Tensor,
    boxes: torch.Tensor,
    weights=(1.0, 1.0, 1.0, 1.0),
    legacy: bool = True,
    scale_clamp: float = DEFAULT_SCALE_CLAMP,
    x2_minus_one: bool = False,
) -> torch.Tensor:
    """Apply deltas (N, 4k) to boxes (N, 4) -> (N, 4k) (inverse R-CNN parameterisation, class-specific if k > 1).

    ``ctr' = d_x * w + ctr``, ``w' = exp(d_w) * w``; boxes ``[ctr' - w'/2, ctr' + w'/2]`` (py-faster-rcnn omits
    the ``-1`` in legacy mode, see the module docstring). ``x2_minus_one``: maskrcnn_benchmark ``BoxCoder.decode``
    (VinVL), ``[ctr' - w'/2, ctr' + w'/2 - 1]`` with the ``+1`` widths.
    """
    deltas = deltas.float()
    boxes = boxes.to(deltas.dtype)
    one = 1.0 if legacy else 0.0
    widths = boxes[:, 2] - boxes[:, 0] + one
    heights = boxes[:, 3] - boxes[:, 1] + one
    ctr_x = boxes[:, 0] + 0.5 * widths
    ctr_y = boxes[:, 1] + 0.5 * heights
    wx, wy, ww, wh = weights
    dx = deltas[:, 0::4] / wx
    dy = deltas[:, 1::4] / wy
    dw = torch.clamp(deltas[:, 2::4] / ww, max=scale_clamp)
    dh = torch.clamp(deltas[:, 3::4] / wh, max=scale_clamp)
    px = dx * widths[:, None] + ctr_x[:, None]
    py = dy * heights[:, None] + ctr_y[:, None]
    pw = torch.exp(dw) * widths[:, None]
    ph = torch.exp(dh) * heights[:, None]
    m1 = 1.0 if x2_minus_one else 0.0
    out = torch.stack((px - 0.5 * pw, py - 0.5 * ph, px + 0.5 * pw - m1, py + 0.5 * ph - m1), dim=2)
    return out.reshape(deltas.shape)


def clip(boxes: torch.Tensor, height: float, width: float, legacy: bool = True) -> torch.Tensor:
    """Clip x to [0, W-1] and y to [0, H-1] (legacy, Caffe ``clip_boxes``) or to [0, W], [0, H] (detectron2)."""
    one = 1.0 if legacy else 0.0
    b = boxes.reshape(-1, 4)
    x = b[:, 0::2].clamp(0, width - one)
    y = b[:, 1::2].clamp(0, height - one)
    return torch.stack((x[:, 0], y[:, 0], x[:, 1], y[:, 1]), dim=1).reshape(boxes.shape)


def _ge_threshold(thresh: float) -> float:
    """The largest float32 below ``thresh``: ``IoU > t'`` is ``IoU >= thresh`` for float32 IoUs."""
    return float(np.nextafter(np.float32(thresh), np.float32(-np.inf)))


def legacy_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU with ``+1`` areas, ``(x2 - x1 + 1) * (y2 - y1 + 1)`` (Caffe ``bbox_overlaps`` / ``cpu_nms``)."""
    one = torch.tensor([0.0, 0.0, 1.0, 1.0], device=a.device, dtype=a.dtype)
    return box_iou(a + one, b + one)


def nms_boxes(
    boxes: torch.Tensor, scores: torch.Tensor, thresh: float, legacy: bool = True, idxs: torch.Tensor | None = None
) -> torch.Tensor:
    """Greedy NMS, indices in decreasing score order.

    Legacy: Caffe ``cpu_nms`` (``+1`` areas, suppress when ``IoU >= thresh``), computed by torchvision on boxes
    shifted by ``+1`` at x2/y2 (identical intersection and areas) with the threshold nudged to the next float
    below. ``idxs`` runs independent NMS per group (torchvision ``batched_nms``).
    """
    if legacy:
        boxes = boxes + torch.tensor([0.0, 0.0, 1.0, 1.0], device=boxes.device, dtype=boxes.dtype)
        thresh = _ge_threshold(thresh)
    if idxs is None:
        return nms(boxes, scores, thresh)
    return batched_nms(boxes, scores, idxs, thresh)


@dataclass(frozen=True)
class BoxCoder:
    """One convention of the module docstring as a part a detector is built with: ``legacy`` (``+1`` widths, clip
    to ``size - 1``, Caffe ``cpu_nms``) or detectron2's (no ``+1``, clip to ``size``, torchvision NMS)."""

    legacy: bool

    def decode(self, deltas: torch.Tensor, boxes: torch.Tensor, weights, scale_clamp: float) -> torch.Tensor:
        """:func:`decode` in this convention."""
        return decode(deltas, boxes, weights, legacy=self.legacy, scale_clamp=scale_clamp)

    def clip(self, boxes: torch.Tensor, height: float, width: float) -> torch.Tensor:
        """:func:`clip` in this convention."""
        return clip(boxes, height, width, legacy=self.legacy)

    def nms(self, boxes: torch.Tensor, scores: torch.Tensor, thresh: float) -> torch.Tensor:
        """:func:`nms_boxes` in this convention."""
        return nms_boxes(boxes, scores, thresh, legacy=self.legacy)


LEGACY = BoxCoder(legacy=True)
"""py-faster-rcnn ``bbox_transform_inv`` / ``clip_boxes`` / ``cpu_nms`` (Caffe)."""

DETECTRON2 = BoxCoder(legacy=False)
"""detectron2 ``Box2BoxTransform`` / ``Boxes.clip`` / torchvision ``nms``."""
