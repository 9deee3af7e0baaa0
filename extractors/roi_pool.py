"""RoI max pooling (Caffe ``ROIPooling`` == torchvision ``roi_pool``) with a deterministic CUDA backward.

torchvision's CUDA backward scatters each bin's gradient onto its argmax pixel with atomic adds, so where
RoIs overlap the sums come in a different order on every run, and under
``torch.use_deterministic_algorithms(True)`` it refuses to run. :class:`DeterministicRoIPool` keeps
torchvision's forward (the same max and argmax) and computes the backward as one ``index_add_`` over the
flattened feature map, which torch runs deterministically in that mode. Both backwards add the same terms;
only their order differs (equal results for sums that are exact, e.g. small integers).
"""

from __future__ import annotations

from typing import Any

import torch
from torchvision.ops import roi_pool as tv_roi_pool


class DeterministicRoIPool(torch.autograd.Function):
    """``roi_pool(feat, rois, (h, w), scale)`` whose input gradient is an ``index_add_`` at the saved argmax."""

    @staticmethod
    def forward(
        ctx: Any, feat: torch.Tensor, rois: torch.Tensor, height: int, width: int, scale: float
    ) -> torch.Tensor:
        out, argmax = torch.ops.torchvision.roi_pool(feat, rois, float(scale), int(height), int(width))
        ctx.save_for_backward(rois, argmax)
        ctx.feat_shape = feat.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rois, argmax = ctx.saved_tensors
        batch, channels, height, width = ctx.feat_shape
        plane = height * width
        image = rois[:, 0].long()
        base = (image[:, None] * channels + torch.arange(channels, device=grad.device)[None, :]) * plane  # (K, C)
        index = base[:, :, None, None] + argmax.long()  # position in the flattened (B, C, H, W) map
        valid = argmax >= 0  # -1: an empty bin, no input pixel
        flat = grad.new_zeros(batch * channels * plane)
        flat.index_add_(0, index[valid], grad.contiguous()[valid])
        return flat.view(batch, channels, height, width), None, None, None, None


def roi_pool(feat: torch.Tensor, rois: torch.Tensor, size: tuple[int, int], scale: float) -> torch.Tensor:
    """torchvision's ``roi_pool``; on CUDA under deterministic algorithms with a gradient to compute,
    :class:`DeterministicRoIPool` (same forward, deterministic backward)."""
    if feat.is_cuda and feat.requires_grad and torch.is_grad_enabled() and torch.are_deterministic_algorithms_enabled():
        return DeterministicRoIPool.apply(feat, rois, size[0], size[1], scale)
    return tv_roi_pool(feat, rois, size, scale)
