"""What is trained and how: freezing, SGD parameter groups, the warm-up + step schedule, BN calibration.

* Freezing (Caffe ``lr_mult: 0``; detectron2 ``FREEZE_AT``): every BatchNorm is frozen (statistics and affine
  are buffers of :class:`~extractors.resnet_caffe.FrozenBatchNorm2d`); ``freeze_at`` k additionally fixes the
  stem (k >= 1) and the first k - 1 residual stages. The bottom-up ``train.prototxt`` freezes conv1, res2
  and res3: ``freeze_at: 3``.
* SGD with momentum 0.9 and weight decay 5e-4 (``solver.prototxt``); biases get ``bias_lr_factor`` x the
  learning rate (Caffe ``lr_mult: 2`` on the heads' biases) and ``weight_decay_bias``.
* Learning rate (detectron2 ``WarmupMultiStepLR``):
  ``lr(it) = base_lr * w(it) * gamma ^ #{s in steps : s <= it}``, with the linear warm-up
  ``w(it) = warmup_factor * (1 - it / warmup_iters) + it / warmup_iters`` for ``it < warmup_iters``, else 1
  (the Caffe solver is the special case ``warmup_iters = 0``, ``steps = [350000]``, ``gamma = 0.1``).
* BN calibration (from scratch only; no ImageNet statistics to freeze; :func:`calibration_batch`): one forward pass
  over training images sets every frozen BN to the per-channel mean and variance of its input, in network
  order, so each conv output starts normalised (``gamma = 1``, ``beta = 0``); the statistics then stay
  frozen as in the original.
"""

from __future__ import annotations

import torch
from torch import nn

from extractors.bottom_up import BottomUpDetector
from extractors.resnet_caffe import FrozenBatchNorm2d
from extractors.training.data import TrainBatches, pad_blobs
from pipeline.core.errors import PipelineError


def set_trainable(det: BottomUpDetector, freeze_at: int) -> list[str]:
    """Mark parameters trainable except the frozen stages; returns the frozen module prefixes."""
    frozen = []
    if freeze_at >= 1:
        frozen.append("backbone.stem.")
    frozen += [f"backbone.{name}." for name in det.backbone.stage_names[: max(0, freeze_at - 1)]]
    for name, p in det.named_parameters():
        p.requires_grad_(not any(name.startswith(f) for f in frozen))
    return frozen


def param_groups(
    model: nn.Module, base_lr: float, weight_decay: float, weight_decay_bias: float, bias_lr_factor: float
) -> list[dict]:
    """Two SGD groups: weights and biases (``lr_scale`` is applied by :func:`apply_lr`)."""
    weights, biases = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (biases if name.endswith(".bias") else weights).append(p)
    groups = [{"params": weights, "lr": base_lr, "weight_decay": weight_decay, "lr_scale": 1.0}]
    if biases:
        groups.append(
            {
                "params": biases,
                "lr": base_lr * bias_lr_factor,
                "weight_decay": weight_decay_bias,
                "lr_scale": bias_lr_factor,
            }
        )
    return groups


def lr_at(
    it: int, base_lr: float, warmup_iters: int, warmup_factor: float, steps: list[int] | tuple[int, ...], gamma: float
) -> float:
    """The learning rate of iteration ``it`` (0-based), see the module docstring."""
    factor = 1.0
    if it < warmup_iters:
        alpha = it / warmup_iters
        factor = warmup_factor * (1.0 - alpha) + alpha
    return base_lr * factor * gamma ** sum(1 for s in steps if s <= it)


def apply_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)


@torch.no_grad()
def calibrate_batchnorm(
    det: BottomUpDetector, images: torch.Tensor, rois: torch.Tensor, eps_floor: float = 1e-4
) -> int:
    """Set each frozen BN's statistics from the data it sees (see the module docstring); returns how many.

    ``images`` (N, 3, H, W) go through the backbone; ``rois`` (K, 5) ``[batch index, x1, y1, x2, y2]`` are
    pooled from its output and go through res5, so the head's BNs are calibrated on region features.
    """
    hooks = []
    count = 0

    def pre_hook(module: FrozenBatchNorm2d, args):
        nonlocal count
        x = args[0].float()
        mean = x.mean(dim=(0, 2, 3))
        var = x.var(dim=(0, 2, 3), unbiased=False).clamp_min(eps_floor)
        module.running_mean.copy_(mean)
        module.running_var.copy_(var - module.eps if bool((var > module.eps).all()) else var)
        module.weight.fill_(1.0)
        module.bias.zero_()
        count += 1

    for m in det.modules():
        if isinstance(m, FrozenBatchNorm2d):
            hooks.append(m.register_forward_pre_hook(pre_hook))
    try:
        feat = det.backbone(images)
        pooled = det.roi_heads.pool(feat, rois)
        det.roi_heads.res5(pooled)
    finally:
        for h in hooks:
            h.remove()
    return count


def calibration_batch(
    dataset: TrainBatches, n_iters: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images of the first ``n_iters`` iterations and RoIs for :func:`calibrate_batchnorm`: every ground-truth
    box plus four jittered copies (up to +-20% of its size, from a generator seeded with ``seed``)."""
    images = []
    for it in range(n_iters):
        images += dataset[it]["images"]
    if not images:
        raise PipelineError("BN calibration: no training image could be decoded")
    blob, _ = pad_blobs(images)
    g = torch.Generator().manual_seed(seed)
    rois = []
    for i, im in enumerate(images):
        b = im.boxes
        jitter = (torch.rand((b.shape[0] * 4, 4), generator=g) - 0.5) * 0.4
        wh = (b[:, 2:] - b[:, :2] + 1).repeat(4, 2)
        boxes = torch.cat([b, b.repeat(4, 1) + jitter * wh])
        rois.append(torch.cat([torch.full((boxes.shape[0], 1), float(i)), boxes], 1))
    return blob.to(device), torch.cat(rois).to(device)
