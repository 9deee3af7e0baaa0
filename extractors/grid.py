"""Grid features (Jiang et al. 2020, "In Defense of Grid Features for VQA"; facebookresearch/grid-feats-vqa
``extract_grid_feature.py``): the res5 map of the whole image, stored as regions whose boxes are the cells.

* grid-feats-vqa models (``grid-feats`` layout, :class:`GridFeatsModel`): the detectron2 backbone through res5
  with ``RES5_DILATION`` forced to 1 (stride 2 on the first res5 block), FrozenBN eps 1e-5.
* the ``grid-feats`` weights layout (docs/extractor.md#weights-layouts): grid-feats-vqa's detectron2 checkpoints
  (R-50, X-101, X-152, X-152++), ``backbone.stem`` / ``backbone.res2..res5`` (``conv{k}.norm``, ``shortcut``), plus
  the RPN, box head and attribute predictor, which grid extraction does not run (checked by name, not loaded).
* C4 detectors: res5 is the RoI head's; it runs on the whole C4 map. VinVL's head already has stride 2 (the
  release's ``get_conv5_features`` equivalent); the Caffe R-101's dilated res5 (stride 1, dilation 2) is switched
  to stride 2 / dilation 1 with the same weights (``res5_dilation: 1``, what grid-feats-vqa does to its own
  models) or kept (``res5_dilation: 2``, a stride-16 map).
* X-152++ (``DEFORM_ON_PER_STAGE`` res4, res5): every 3x3 conv of those stages is a deformable convolution
  (Dai et al. 2017, DCNv1; detectron2 ``DeformBottleneckBlock``): offsets ``conv2_offset`` (3x3, with bias, the
  conv2 geometry) on the conv1 output, channel 2k = dy and 2k + 1 = dx of tap k = 3i + j, bilinear sampling with
  zeros outside, computed with ``torchvision.ops.deform_conv2d`` (one offset group, the conv's 32 groups).
* ``grid: k`` > 0 average-pools the map to k x k with ``adaptive_avg_pool2d`` (RSTNet / DLCT ``AdaptiveAvgPool2d
  ((7, 7))``); 0 keeps every cell. Cell boxes: the cell's (or bin's) span at the map's stride, clipped to the
  resized image, then scaled to original pixels per axis. Row-major order (RSTNet ``view(49, 2048)``).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import deform_conv2d

from extractors.detector import Detector, spec_backbone
from extractors.layouts import layout_error, normalise, plain_keys, stage_blocks, state_table, strict_check
from extractors.preprocess import Frame
from extractors.releases import Release, register_release
from extractors.resnet_caffe import ConvNorm
from extractors.selector import SELECTORS, Selector, to_original
from extractors.spec import DETECTRON2_PIXEL_MEANS_BGR, BottomUpSpec
from extractors.weight_bounds import check_spec, dims, groups_of
from pipeline.core.regions import RegionRecord

LAYOUT = "grid-feats"
X101_PIXEL_STD = (57.375, 57.120, 58.395)
GRID_HEADS = (
    "proposal_generator.",
    "roi_heads.box_head.",
    "roi_heads.box_predictor.",
    "roi_heads.attribute_predictor.",
)
"""Key prefixes of the heads a grid-feats-vqa file holds: checked by name, not loaded (grid extraction runs none)."""


class GridFeatsModel(Detector):
    """The backbone of a grid-feats-vqa detector (res2..res5 in ``backbone``; the heads are not run)."""

    def __init__(self, spec: BottomUpSpec) -> None:
        super().__init__(spec)
        self.backbone = spec_backbone(spec, tuple(spec.stage_blocks) + (spec.res5_blocks,))
        for s in spec.deform_stages:  # detectron2 DeformBottleneckBlock: conv2_offset (18 channels, bias) beside conv2
            for block in getattr(self.backbone, f"res{s}"):
                width = block.conv2.weight.shape[0]
                block.conv2_offset = nn.Conv2d(width, 18, 3, padding=1)
                nn.init.zeros_(block.conv2_offset.weight)
                nn.init.zeros_(block.conv2_offset.bias)
        self.freeze()

    def detect(self, blobs, frames, selector, given_boxes=None) -> list[RegionRecord]:
        if not getattr(selector, "whole_image", False):
            raise ValueError("grid-feats weights hold a backbone for grid features only: use --boxes grid")
        return selector.detect(self, blobs, frames)


def _conv(
    cn: ConvNorm, x: torch.Tensor, stride: int, dilation: int, offset_conv: nn.Conv2d | None = None
) -> torch.Tensor:
    pad = dilation if cn.weight.shape[-1] == 3 else 0
    w, b = cn._folded if cn._folded is not None else (cn.weight, None)
    if offset_conv is not None:  # DCNv1: offsets from the same input, with conv2's geometry
        offset = F.conv2d(x, offset_conv.weight, offset_conv.bias, stride, pad, dilation)
        y = deform_conv2d(
            x.float(),
            offset.float(),
            w.float(),
            None if b is None else b.float(),
            (stride, stride),
            (pad, pad),
            (dilation, dilation),
        )
    else:
        y = F.conv2d(x, w.to(x.dtype), None if b is None else b.to(x.dtype), stride, pad, dilation, cn.groups)
    return y if cn._folded is not None else cn.norm(y)


def run_stage(stage: nn.Sequential, x: torch.Tensor, first_stride: int, dilation: int) -> torch.Tensor:
    """A ResNet stage under the given geometry (the stride on the 1x1 or 3x3 conv as built; deformable 3x3 convs
    where the block has ``conv2_offset``)."""
    for i, block in enumerate(stage):
        stride = first_stride if i == 0 else 1
        s1, s3 = (stride, 1) if block.stride_in_1x1 else (1, stride)
        identity = x if block.shortcut is None else _conv(block.shortcut, x, stride, 1)
        y = F.relu_(_conv(block.conv1, x, s1, 1))
        y = F.relu_(_conv(block.conv2, y, s3, dilation, getattr(block, "conv2_offset", None)))
        x = F.relu_(_conv(block.conv3, y, 1, 1) + identity)
    return x


def run_res5(stage: nn.Sequential, x: torch.Tensor, dilation: int) -> torch.Tensor:
    """res5 under the given geometry: dilation 1 -> first block stride 2, dilation 2 -> stride 1 with dilated 3x3
    convs (maskrcnn_benchmark / detectron2 rule)."""
    return run_stage(stage, x, 2 if dilation == 1 else 1, dilation)


@torch.inference_mode()
def grid_map(model: nn.Module, blob: torch.Tensor, res5_dilation: int = 1) -> tuple[torch.Tensor, int]:
    """(1, D, h, w) float32 res5 map of one blob and its stride in resized pixels."""
    dev = next(model.parameters()).device
    x = torch.as_tensor(blob)[None].to(dev)
    if isinstance(model, GridFeatsModel):
        bb = model.backbone
        x = bb.stem(x)
        for i, name in enumerate(bb.stage_names[:-1]):
            x = run_stage(getattr(bb, name), x, 1 if i == 0 else 2, 1)
        return run_res5(getattr(bb, bb.stage_names[-1]), x, res5_dilation).float(), model.spec.feature_stride * (
            2 if res5_dilation == 1 else 1
        )
    c4 = model.backbone(x)
    return run_res5(model.roi_heads.res5, c4, res5_dilation).float(), model.spec.feature_stride * (
        2 if res5_dilation == 1 else 1
    )


def cell_edges(n: int, k: int) -> list[tuple[int, int]]:
    """``adaptive_avg_pool2d`` bins over n cells: [floor(i n / k), ceil((i + 1) n / k)) (k = 0: one cell each)."""
    if k <= 0:
        return [(i, i + 1) for i in range(n)]
    return [((i * n) // k, -((-(i + 1) * n) // k)) for i in range(k)]


def grid_cells(fmap: torch.Tensor, stride: int, frame: Frame, grid: int) -> tuple[torch.Tensor, np.ndarray]:
    """A (1, D, h, w) map -> its cells' features (N, D) on the map's device (pooled to ``grid`` x ``grid`` when
    > 0) and their boxes (N, 4) float32 in original pixels, computed on the host (they depend on shapes only)."""
    _, d, h, w = fmap.shape
    pooled = F.adaptive_avg_pool2d(fmap, (grid, grid)) if grid > 0 else fmap
    feats = pooled[0].permute(1, 2, 0).reshape(-1, d)
    ys, xs = cell_edges(h, grid), cell_edges(w, grid)
    boxes = torch.tensor(
        [
            [x0 * stride, y0 * stride, min(x1 * stride, frame.blob_w), min(y1 * stride, frame.blob_h)]
            for (y0, y1) in ys
            for (x0, x1) in xs
        ],
        dtype=torch.float32,
    )
    return feats, to_original(boxes, frame, "per-axis", "none").numpy().astype(np.float32)


class GridCells(Selector):
    """``--boxes grid``: the model's res5 map of the whole image, cells as regions (no RPN, no heads).

    The images of a batch run one by one (their maps differ in size), their cell features stay on the device and
    reach the host in one copy per batch, as the bottom-up path's (:mod:`extractors.to_host`)."""

    name = "grid"
    whole_image = True
    fields = ("grid", "res5_dilation")

    @classmethod
    def describe(cls, recipe) -> str:
        r = recipe
        return (
            f"grid: res5 map of the whole image (res5 dilation {r.res5_dilation}), "
            f"{'every cell' if r.grid == 0 else f'average-pooled to {r.grid}x{r.grid}'}; boxes = cells"
        )

    def detect(self, model: nn.Module, blobs, frames) -> list[RegionRecord]:
        r = self.recipe
        cells = []
        for blob, frame in zip(blobs, frames):
            fmap, stride = grid_map(model, blob, r.res5_dilation)
            cells.append(grid_cells(fmap, stride, frame, r.grid))
        if not cells:
            return []
        flat = torch.cat([f.reshape(-1) for f, _ in cells]).cpu().numpy()  # the batch's one device-to-host copy
        out, start = [], 0
        for (f, boxes), frame in zip(cells, frames):
            n = f.numel()
            feats = flat[start : start + n].reshape(tuple(f.shape)).astype(np.float32)
            start += n
            out.append(
                RegionRecord(
                    features=feats,
                    boxes=boxes,
                    image_w=int(frame.width),
                    image_h=int(frame.height),
                    class_ids=None,
                    class_scores=None,
                    attr_ids=None,
                    attr_scores=None,
                )
            )
        return out


# --------------------------------------------------------------------------------------------------------
def infer_grid_spec(sd, path="?") -> BottomUpSpec:
    """The architecture of a grid-feats-vqa state dict (depth, widths, groups; the X-101 pixel std)."""
    deform = tuple(
        sorted({int(k.split(".")[1][3:]) for k in sd if re.match(r"^backbone\.res\d\.\d+\.conv2_offset\.weight$", k)})
    )
    for k in sd:
        if k.endswith("conv2_offset.weight") and tuple(sd[k].shape[:1]) != (18,):
            raise layout_error(
                path,
                LAYOUT,
                f"key '{k}' has {sd[k].shape[0] if sd[k].dim() else 'no'} offset channels: only DCNv1 with one "
                "deformable group (18, the X-152++ model) is supported, not modulated or grouped offsets",
            )
    stages = stage_blocks(sd, r"^backbone\.res(\d)\.(\d+)\.conv1\.weight$")
    if sorted(stages) != [2, 3, 4, 5]:
        raise layout_error(path, LAYOUT, "backbone.res2 .. backbone.res5 not found")
    bott, groups = groups_of(sd, "backbone.res2.0.conv2.weight", path, LAYOUT)
    out2 = dims(sd, "backbone.res2.0.conv3.weight", 4, path, LAYOUT)[0]
    blocks = tuple(stages[s] for s in (2, 3, 4))
    std = X101_PIXEL_STD if (groups > 1 and blocks == (3, 4, 23)) else (1.0, 1.0, 1.0)
    stem = dims(sd, "backbone.stem.conv1.weight", 4, path, LAYOUT)[0]
    spec = BottomUpSpec(
        flavor="d2",
        stem_channels=stem,
        res2_bottleneck=bott,
        expansion=out2 // bott,
        stage_blocks=blocks,
        res5_blocks=stages[5],
        res5_dilation=1,
        groups=groups,
        stride_in_1x1=groups == 1,
        stem_pool="pad1",
        has_attributes=False,
        pixel_means=DETECTRON2_PIXEL_MEANS_BGR,
        pixel_std=std,
        deform_stages=deform,
    )
    return check_spec(spec, path, LAYOUT, "architecture")


def detect_grid_feats(sd: Mapping[str, Any]) -> str | None:
    """``grid-feats`` when the backbone runs through ``backbone.res5`` with detectron2's names (no
    ``roi_heads.res5``, no maskrcnn_benchmark ``backbone.body``), else None."""
    keys = plain_keys(sd)
    if any(k.startswith("backbone.res5.") for k in keys):
        if not any(k.startswith(("roi_heads.res5.", "backbone.body.")) for k in keys):
            return LAYOUT
    return None


def load_grid_feats(path: Any, layout: str, sd: Mapping[str, torch.Tensor], spec: BottomUpSpec | None = None):
    """Strictly check a grid-feats-vqa state dict (backbone loaded, heads checked by name) -> (model, info)."""
    spec = infer_grid_spec(sd, path)
    strict_check(path, LAYOUT, sd, state_table(GridFeatsModel, spec), set(), GRID_HEADS)
    model = GridFeatsModel(spec)
    model.load_state_dict(OrderedDict((k, v.float()) for k, v in sd.items() if k.startswith("backbone.")), strict=True)
    return model, {"anchors_from_file": False}


def describe_grid_feats(layout: str, sd: Mapping[str, torch.Tensor], path: Any) -> tuple[dict[str, Any], BottomUpSpec]:
    """``cli info`` facts (strict-checked) for a ``grid-feats`` file."""
    spec = infer_grid_spec(sd, path)
    strict_check(path, LAYOUT, sd, state_table(GridFeatsModel, spec), set(), GRID_HEADS)
    depth = 3 * (sum(spec.stage_blocks) + spec.res5_blocks) + 2
    name = (
        f"ResNeXt-{depth} {spec.groups}x{spec.res2_bottleneck // spec.groups}d"
        if spec.groups > 1
        else f"ResNet-{depth}"
    )
    return {
        "layout": LAYOUT,
        "semantics": "d2 (detectron2 backbone through res5; grid features only)",
        "architecture": f"{name} through res5 (blocks {list(spec.stage_blocks) + [spec.res5_blocks]}), "
        f"feature {spec.feature_dim}-d",
        "pixel_std": ", ".join(f"{v:g}" for v in spec.pixel_std),
        "classes": 0,
        "attributes": 0,
        "deformable": ", ".join(f"res{s}" for s in spec.deform_stages) or "none",
    }, spec


SELECTORS["grid"] = GridCells

register_release(
    Release(
        name="grid-feats",
        source="facebookresearch/grid-feats-vqa extract_grid_feature.py (RSTNet / DLCT 7x7 pooling)",
        layouts=(LAYOUT,),
        catalogue=("grid-r-50", "grid-x-101", "grid-x-152", "grid-x-152pp"),
        identity="grid-feats",
        import_formats=("grid-hdf5",),  # RSTNet's and DLCT's 7x7 grid HDF5 files
        detect=detect_grid_feats,
        normalise=normalise,
        load=load_grid_feats,
        describe=describe_grid_feats,
        detector=GridFeatsModel,
        selectors=("grid",),
        grid_only=True,
    )
)
