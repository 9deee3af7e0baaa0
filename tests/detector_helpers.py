"""Writers of detector weights files in the releases' own layouts, and other helpers the detector tests share.

The product reads these layouts (:mod:`extractors.weights`, :mod:`extractors.vinvl.layout`,
:mod:`extractors.grid`); writing them is what the tests need to make seeded random files of every release:
MILVLG / airsplay / HF bottom-up files, VinVL's scene_graph_benchmark state dict and a grid-feats-vqa detectron2
checkpoint.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from extractors import grid as G
from extractors import weights as W
from extractors.grid import GridFeatsModel
from extractors.preprocess import Frame
from extractors.resnet_caffe import ConvNorm
from extractors.vinvl import layout as L
from pipeline.core.errors import UsageError
from pipeline.core.regions import RegionRecord


def read_raw(path: str | Path) -> tuple[str, "OrderedDict[str, torch.Tensor]"]:
    """Read a weights file -> (layout, flat state dict of tensors) without checking shapes."""
    layout, sd, _ = W.read_weights(path)
    return layout, sd


def save_layout(model_sd: Mapping[str, torch.Tensor], layout: str, path: str | Path) -> Path:
    """Write an internal state dict in a public layout and container (MILVLG torch file, airsplay pickle, HF state
    dict with counters)."""
    path = Path(path)
    out: OrderedDict[str, Any] = OrderedDict()
    for k, v in model_sd.items():
        out[W.to_layout_key(k, layout)] = v.detach().cpu().contiguous()
        if layout == "hf" and k.endswith(".norm.running_var"):
            out[k[: -len("running_var")] + W.NBT] = torch.tensor(0, dtype=torch.int64)
    if layout == "airsplay":
        arrays = OrderedDict((k, v.numpy()) for k, v in out.items())
        with open(path, "wb") as fh:
            pickle.dump({"model": arrays, "__author__": "butd-caption test"}, fh, protocol=2)
    elif layout == "milvlg":
        torch.save({"model": dict(out)}, path)
    elif layout == "hf":
        torch.save(dict(out), path)
    else:
        raise UsageError(f"unknown weights layout {layout!r}")
    return path


def save_vinvl(
    model: torch.nn.Module,
    path: str | Path,
    module_prefix: bool = True,
    anchors: bool = True,
    copies: bool = True,
    wrap: bool = False,
) -> Path:
    """Write a :class:`VinVLDetector` in the release's layout (its key names, the ``module.`` prefix of a
    DataParallel save, the attribute head's res5 copy, the ``{"model": ...}`` wrapper)."""
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for k, v in model.state_dict().items():
        if k == L.ANCHORS and not anchors:
            continue
        name = L.to_vinvl_key(k)
        out[name] = v.detach().cpu().contiguous()
        if copies and name.startswith(L.VINVL_RES5):
            out[L.VINVL_RES5_COPY + name[len(L.VINVL_RES5) :]] = out[name]
    if module_prefix:
        out = OrderedDict(("module." + k, v) for k, v in out.items())
    torch.save({"model": dict(out)} if wrap else dict(out), path)
    return Path(path)


def random_grid_feats_file(
    spec, path, seed: int = 0, num_classes: int = 1601, num_attributes: int = 400, wrap: bool = True
):
    """A grid-feats-vqa detectron2 checkpoint with seeded random weights: the backbone of ``spec`` (``flavor d2``,
    4 stages; ``deform_stages`` add the X-152++ ``conv2_offset`` convs) plus the RPN / box head / attribute predictor
    keys the release saves (``{"model": ...}``)."""
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


def grid_regions(fmap: torch.Tensor, stride: int, frame: Frame, grid: int) -> RegionRecord:
    """A (1, D, h, w) map -> one :class:`RegionRecord` of cells (one image; :class:`GridCells` copies a batch at
    once)."""
    feats, boxes = G.grid_cells(fmap, stride, frame, grid)
    return RegionRecord(
        features=feats.cpu().numpy().astype(np.float32),
        boxes=boxes,
        image_w=int(frame.width),
        image_h=int(frame.height),
        class_ids=None,
        class_scores=None,
        attr_ids=None,
        attr_scores=None,
    )
