"""Seeded random bottom-up detectors for smoke tests and benchmarks (never for real features)."""

from __future__ import annotations

import torch

from extractors.releases import release_of_flavor
from extractors.resnet_caffe import ConvNorm
from extractors.spec import BottomUpSpec


def random_detector(spec: BottomUpSpec, seed: int = 0):
    """A detector with seeded random weights and well-scaled frozen BN (smoke tests and benchmarks only).

    Built on the meta device and materialised once (no wasted default initialisation of 65M parameters).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = release_of_flavor(spec.flavor).detector(spec)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen) * (2.0 / fan_in) ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
        for name, m in model.named_modules():
            if isinstance(m, ConvNorm):
                n = m.norm.num_features
                m.norm.running_mean.copy_(torch.randn(n, generator=gen) * 0.1)
                m.norm.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
                gamma = 0.2 if name.endswith("conv3") or name.endswith("shortcut") else 1.0
                m.norm.weight.copy_(gamma * (1.0 + 0.1 * torch.randn(n, generator=gen)))
                m.norm.bias.copy_(torch.randn(n, generator=gen) * 0.1)
        # the anchors are data, not weights: the table the detector's anchor generator was built with
        anchors = model.proposal_generator.anchor_generator
        anchors.cell_anchors[0].copy_(anchors.table(spec))
        # small box deltas (proposals near their anchors, as in a trained RPN) and a classifier with some
        # confidence so that the selection thresholds matter
        model.proposal_generator.rpn_head.anchor_deltas.weight.mul_(0.02)
        model.scale_random_heads()
    return model
