"""Cell anchors and their grid: the py-faster-rcnn table (Caffe) and detectron2's ``DefaultAnchorGenerator``.

The Caffe table (docs/extractor.md#anchors) comes from ``generate_anchors(base 16, ratios, scales)``: base box
``[0, 0, 15, 15]`` (centre 7.5), ratio enumeration with rounding, then scale enumeration, ratio-major order.
The checkpoint's stored ``cell_anchors.0`` is what the detector uses; these functions build the defaults and
are tested against the published 12-row table.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _whctrs(anchor: np.ndarray) -> tuple[float, float, float, float]:
    w = anchor[2] - anchor[0] + 1
    h = anchor[3] - anchor[1] + 1
    return w, h, anchor[0] + 0.5 * (w - 1), anchor[1] + 0.5 * (h - 1)


def _mkanchors(ws: np.ndarray, hs: np.ndarray, x_ctr: float, y_ctr: float) -> np.ndarray:
    ws, hs = ws[:, None], hs[:, None]
    return np.hstack((x_ctr - 0.5 * (ws - 1), y_ctr - 0.5 * (hs - 1), x_ctr + 0.5 * (ws - 1), y_ctr + 0.5 * (hs - 1)))


def caffe_cell_anchors(base_size: int = 16, ratios=(0.5, 1.0, 2.0), scales=(4, 8, 16, 32)) -> torch.Tensor:
    """py-faster-rcnn ``generate_anchors``: (len(ratios)*len(scales), 4) float32, ratio-major, centre (7.5, 7.5).

    Ratio step: ``ws = round(sqrt(w*h / r))``, ``hs = round(ws * r)`` around the base centre; scale step:
    ``ws * s``, ``hs * s`` around the same centre; widths follow the ``x2 - x1 + 1`` convention.
    """
    base = np.array([0, 0, base_size - 1, base_size - 1], dtype=np.float64)
    w, h, xc, yc = _whctrs(base)
    size = w * h
    ratios_arr = np.asarray(ratios, dtype=np.float64)
    ws = np.round(np.sqrt(size / ratios_arr))
    hs = np.round(ws * ratios_arr)
    ratio_anchors = _mkanchors(ws, hs, xc, yc)
    out = []
    scales_arr = np.asarray(scales, dtype=np.float64)
    for anchor in ratio_anchors:
        aw, ah, axc, ayc = _whctrs(anchor)
        out.append(_mkanchors(aw * scales_arr, ah * scales_arr, axc, ayc))
    return torch.from_numpy(np.vstack(out).astype(np.float32))


def d2_cell_anchors(sizes=(64.0, 128.0, 256.0, 512.0), ratios=(0.5, 1.0, 2.0)) -> torch.Tensor:
    """detectron2 ``generate_cell_anchors``: size-major, centred at 0, ``w = sqrt(size^2 / r)``, ``h = r * w``."""
    rows = []
    for size in sizes:
        area = float(size) ** 2
        for r in ratios:
            w = math.sqrt(area / r)
            h = r * w
            rows.append([-w / 2.0, -h / 2.0, w / 2.0, h / 2.0])
    return torch.tensor(rows, dtype=torch.float32)


def grid_anchors(cell: torch.Tensor, feat_h: int, feat_w: int, stride: int, offset: float = 0.0) -> torch.Tensor:
    """All anchors of a (feat_h, feat_w) map: shifts ``(arange * stride + offset)``, order (h, w, a), a fastest.

    Same order as Caffe ``proposal_layer`` (``anchors.reshape(K*A, 4)``) and detectron2 ``grid_anchors``.
    """
    dev = cell.device
    sx = torch.arange(feat_w, device=dev, dtype=torch.float32) * stride + offset
    sy = torch.arange(feat_h, device=dev, dtype=torch.float32) * stride + offset
    yy, xx = torch.meshgrid(sy, sx, indexing="ij")
    shifts = torch.stack([xx.reshape(-1), yy.reshape(-1), xx.reshape(-1), yy.reshape(-1)], dim=1)
    return (shifts[:, None, :] + cell.float()[None, :, :]).reshape(-1, 4)
