"""Seeded random bottom-up detectors for smoke tests and benchmarks (never for real features)."""

from __future__ import annotations

import torch

from extractors.spec import BottomUpSpec


def random_detector(spec: BottomUpSpec, seed: int = 0):
    """A detector with seeded random weights and well-scaled frozen BN (smoke tests and benchmarks only).

    Built on the meta device and materialised once (no wasted default initialisation of 65M parameters).
    """
    from extractors.bottom_up import BottomUpDetector
    from extractors.resnet_caffe import ConvNorm
    from extractors.vinvl import VinVLDetector

    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = VinVLDetector(spec) if spec.flavor == "vinvl" else BottomUpDetector(spec)
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
        # the anchors are data, not weights: the flavor's own table
        from extractors.rpn import AnchorGenerator

        model.proposal_generator.anchor_generator.cell_anchors[0].copy_(AnchorGenerator(spec).cell_anchors[0])
        # small box deltas (proposals near their anchors, as in a trained RPN) and a classifier with some
        # confidence so that the selection thresholds matter
        model.proposal_generator.rpn_head.anchor_deltas.weight.mul_(0.02)
        if spec.flavor == "vinvl":  # VinVL heads: same scaling; attribute logits spread so that some pass 0.05
            model.roi_heads.bbox_pred.weight.mul_(0.02)
            model.roi_heads.cls_score.weight.mul_(0.3)
            if model.roi_heads.attribute is not None:
                model.roi_heads.attribute.attr_score.weight.mul_(4.0)
        else:
            model.roi_heads.box_predictor.bbox_pred.weight.mul_(0.02)
            model.roi_heads.box_predictor.cls_score.weight.mul_(4.0)
    return model


def random_grid_feats_file(
    spec, path, seed: int = 0, num_classes: int = 1601, num_attributes: int = 400, wrap: bool = True
):
    """A grid-feats-vqa detectron2 checkpoint with seeded random weights: the backbone of ``spec`` (``flavor d2``,
    4 stages; ``deform_stages`` add the X-152++ ``conv2_offset`` convs) plus the RPN / box head / attribute predictor keys the release saves (``{"model": ...}``)."""
    from collections import OrderedDict

    from extractors.grid import GridFeatsModel
    from extractors.resnet_caffe import ConvNorm

    gen = torch.Generator().manual_seed(seed)
    model = GridFeatsModel(spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                torch.randn(p.shape, generator=gen)
                * (2.0 / p[0].numel()) ** 0.5
                * (0.5 if "conv2_offset" in name else 1.0)
            )
        for name, m in model.named_modules():
            if isinstance(m, ConvNorm):
                n = m.norm.num_features
                m.norm.running_mean.copy_(torch.randn(n, generator=gen) * 0.1)
                m.norm.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
                m.norm.weight.copy_(
                    (0.2 if name.endswith(("conv3", "shortcut")) else 1.0) * (1.0 + 0.1 * torch.randn(n, generator=gen))
                )
                m.norm.bias.copy_(torch.randn(n, generator=gen) * 0.1)
    sd = OrderedDict(model.state_dict())
    c5, a = spec.feature_dim, 15
    heads = {
        "proposal_generator.rpn_head.conv.weight": (c5, c5, 3, 3),
        "proposal_generator.rpn_head.conv.bias": (c5,),
        "proposal_generator.rpn_head.objectness_logits.weight": (a, c5, 1, 1),
        "proposal_generator.rpn_head.objectness_logits.bias": (a,),
        "proposal_generator.rpn_head.anchor_deltas.weight": (4 * a, c5, 1, 1),
        "proposal_generator.rpn_head.anchor_deltas.bias": (4 * a,),
        "roi_heads.box_head.fc1.weight": (1024, c5),
        "roi_heads.box_head.fc1.bias": (1024,),
        "roi_heads.box_head.fc2.weight": (1024, 1024),
        "roi_heads.box_head.fc2.bias": (1024,),
        "roi_heads.box_predictor.cls_score.weight": (num_classes, 1024),
        "roi_heads.box_predictor.cls_score.bias": (num_classes,),
        "roi_heads.box_predictor.bbox_pred.weight": (4 * (num_classes - 1), 1024),
        "roi_heads.box_predictor.bbox_pred.bias": (4 * (num_classes - 1),),
        "roi_heads.attribute_predictor.obj_embed.weight": (num_classes, 256),
        "roi_heads.attribute_predictor.fc.0.weight": (512, 1024 + 256),
        "roi_heads.attribute_predictor.fc.0.bias": (512,),
        "roi_heads.attribute_predictor.attr_score.weight": (num_attributes, 512),
        "roi_heads.attribute_predictor.attr_score.bias": (num_attributes,),
    }
    for k, shp in heads.items():
        sd[k] = torch.randn(shp, generator=gen) * 0.01
    torch.save({"model": dict(sd), "iteration": 0} if wrap else dict(sd), path)
    return model
