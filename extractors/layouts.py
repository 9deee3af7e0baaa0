"""Weights layouts of the newer Visual Genome detectors (docs/extractor.md#weights-layouts): ``vinvl`` and
``grid-feats``.

* ``vinvl`` - microsoft/scene_graph_benchmark ``vinvl_vg_x152c4.pth``: a flat torch state dict of ``AttrRCNN``
  (every key may carry the ``module.`` prefix of a DataParallel save; a ``{"model": ...}`` wrapper is accepted).
  Names: ``backbone.body.{stem,layer1..3}`` (``conv{k}`` / ``bn{k}`` / ``downsample.{0,1}``), ``rpn.head.{conv,
  cls_logits, bbox_pred}``, ``rpn.anchor_generator.cell_anchors.0`` (optional; used when present),
  ``roi_heads.box.feature_extractor.head.layer4``, ``roi_heads.box.predictor.{cls_score, bbox_pred}``,
  ``attribute.predictor.{cls_embedding, fc_attr, attr_score}``, and optionally
  ``attribute.feature_extractor.head.layer4`` (the shared res5 saved twice: it must equal the box head's).
* ``grid-feats`` - facebookresearch/grid-feats-vqa detectron2 checkpoints (R-50, X-101, X-152, X-152++):
  ``backbone.stem`` / ``backbone.res2..res5`` (``conv{k}.norm``, ``shortcut``), plus the RPN, box head and
  attribute predictor, which grid extraction does not run (checked by name, not loaded). X-152++ adds
  ``conv2_offset`` (deformable res4/res5, DCNv1), run with ``torchvision.ops.deform_conv2d`` (:mod:`extractors.grid`).

Loading is strict: the first lines name every missing and every unexpected key (up to five each) in one
error line; shapes must match the architecture inferred from the file.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any, Mapping

import torch

from extractors.spec import BottomUpSpec, vinvl_x152c4
from extractors.weight_bounds import check_spec, dims, groups_of
from extractors.weights import WeightsError

ANCHORS = "proposal_generator.anchor_generator.cell_anchors.0"
_CONV = re.compile(r"^(backbone|roi_heads)\.(res(\d)|stem)\.(?:(\d+)\.)?(conv\d|shortcut)\.(norm\.)?(\w+)$")
_VINVL_FLAT = (
    ("proposal_generator.rpn_head.conv.", "rpn.head.conv."),
    ("proposal_generator.rpn_head.objectness_logits.", "rpn.head.cls_logits."),
    ("proposal_generator.rpn_head.anchor_deltas.", "rpn.head.bbox_pred."),
    ("proposal_generator.anchor_generator.", "rpn.anchor_generator."),
    ("roi_heads.cls_score.", "roi_heads.box.predictor.cls_score."),
    ("roi_heads.bbox_pred.", "roi_heads.box.predictor.bbox_pred."),
    ("roi_heads.attribute.", "attribute.predictor."),
)
VINVL_RES5 = "roi_heads.box.feature_extractor.head.layer4."
VINVL_RES5_COPY = "attribute.feature_extractor.head.layer4."
GRID_HEADS = (
    "proposal_generator.",
    "roi_heads.box_head.",
    "roi_heads.box_predictor.",
    "roi_heads.attribute_predictor.",
)


def _err(path: Any, layout: str, msg: str):
    return WeightsError(f"weights file {path} ({layout}): {msg}")


def to_vinvl_key(key: str) -> str:
    """Internal key (:class:`extractors.vinvl.VinVLDetector`) -> scene_graph_benchmark's name."""
    m = _CONV.match(key)
    if m:
        top, part, stage, block, conv, norm, leaf = m.groups()
        if part == "stem":
            return f"backbone.body.stem.{'bn1' if norm else 'conv1'}.{leaf}"
        head = VINVL_RES5 if top == "roi_heads" else f"backbone.body.layer{int(stage) - 1}."
        if conv == "shortcut":
            return f"{head}{block}.downsample.{1 if norm else 0}.{leaf}"
        return f"{head}{block}.{'bn' + conv[4:] if norm else conv}.{leaf}"
    for a, b in _VINVL_FLAT:
        if key.startswith(a):
            return b + key[len(a) :]
    return key


def _plain_keys(sd: Mapping[str, Any]) -> list[str]:
    return [k[7:] if k.startswith("module.") else k for k in sd]


def detect_vinvl(sd: Mapping[str, Any]) -> str | None:
    """``vinvl`` when the key names are scene_graph_benchmark's (a ``module.`` prefix ignored), else None."""
    keys = _plain_keys(sd)
    if any(k.startswith("backbone.body.") for k in keys) and any(k.startswith("roi_heads.box.") for k in keys):
        return "vinvl"
    return None


def detect_grid_feats(sd: Mapping[str, Any]) -> str | None:
    """``grid-feats`` when the backbone runs through ``backbone.res5`` (no ``roi_heads.res5``), else None."""
    keys = _plain_keys(sd)
    if detect_vinvl(sd) is None and any(k.startswith("backbone.res5.") for k in keys):
        if not any(k.startswith("roi_heads.res5.") for k in keys):
            return "grid-feats"
    return None


def normalise(sd: "OrderedDict[str, torch.Tensor]") -> "OrderedDict[str, torch.Tensor]":
    """Strip the ``module.`` prefix when *every* key carries it (maskrcnn_benchmark ``strip_prefix_if_present``)."""
    if sd and all(k.startswith("module.") for k in sd):
        return OrderedDict((k[7:], v) for k, v in sd.items())
    return sd


# --------------------------------------------------------------------------------------------------------
def _stage_blocks(sd: Mapping[str, Any], pattern: str) -> dict[int, int]:
    rx = re.compile(pattern)
    out: dict[int, int] = {}
    for k in sd:
        m = rx.match(k)
        if m:
            s, i = int(m.group(1)), int(m.group(2))
            out[s] = max(out.get(s, 0), i + 1)
    return out


def infer_vinvl_spec(sd: Mapping[str, torch.Tensor], path: Any = "?") -> BottomUpSpec:
    """The architecture a ``vinvl`` state dict describes (depth, widths, groups, classes, attributes, anchors)."""
    L = "vinvl"
    stages = _stage_blocks(sd, r"^backbone\.body\.layer(\d+)\.(\d+)\.conv1\.weight$")
    res5 = _stage_blocks(sd, r"^roi_heads\.box\.feature_extractor\.head\.layer(4)\.(\d+)\.conv1\.weight$").get(4, 0)
    if sorted(stages) != list(range(1, 1 + len(stages))) or not stages or not res5:
        raise _err(path, L, "backbone.body.layer1.. and roi_heads.box.feature_extractor.head.layer4 not found")
    stem = dims(sd, "backbone.body.stem.conv1.weight", 4, path, L)[0]
    bott, groups = groups_of(sd, "backbone.body.layer1.0.conv2.weight", path, L)
    out2 = dims(sd, "backbone.body.layer1.0.conv3.weight", 4, path, L)[0]
    a = dims(sd, "rpn.head.cls_logits.weight", 4, path, L)[0]
    if a % 3 or out2 % bott:
        raise _err(path, L, f"{a} anchors per cell or res2 widths {bott}/{out2} do not fit the VinVL architecture")
    kw: dict[str, Any] = {}
    has_attr = "attribute.predictor.attr_score.weight" in sd
    if has_attr:
        kw = {
            "num_attributes": dims(sd, "attribute.predictor.attr_score.weight", 2, path, L)[0],
            "attr_embed_dim": dims(sd, "attribute.predictor.cls_embedding.weight", 2, path, L)[1],
            "attr_hidden": dims(sd, "attribute.predictor.fc_attr.weight", 2, path, L)[0],
        }
    spec = vinvl_x152c4().with_(
        stem_channels=stem,
        res2_bottleneck=bott,
        expansion=out2 // bott,
        groups=groups,
        stage_blocks=tuple(stages[s] for s in sorted(stages)),
        res5_blocks=res5,
        rpn_channels=dims(sd, "rpn.head.conv.weight", 4, path, L)[0],
        anchor_sizes=tuple(32.0 * 2**i for i in range(a // 3)),
        num_classes=dims(sd, "roi_heads.box.predictor.cls_score.weight", 2, path, L)[0],
        has_attributes=has_attr,
        **kw,
    )
    return check_spec(spec, path, L, "architecture")


def internal_table(spec: BottomUpSpec) -> "OrderedDict[str, tuple[int, ...]]":
    from extractors.vinvl import VinVLDetector  # noqa: PLC0415 -- cycle: extractors.vinvl registers this layout

    with torch.device("meta"):
        model = VinVLDetector(spec)
    return OrderedDict((k, tuple(v.shape)) for k, v in model.state_dict().items())


def strict_check(
    path: Any,
    layout: str,
    sd: Mapping[str, torch.Tensor],
    table: Mapping[str, tuple[int, ...]],
    optional: set[str],
    allowed_prefixes: tuple[str, ...] = (),
) -> None:
    """One line naming every missing and unexpected key (five of each at most), then the first wrong shape."""
    missing = [k for k in table if k not in sd and k not in optional]
    extra = [k for k in sd if k not in table and not k.startswith(allowed_prefixes)]
    if missing or extra:
        parts = []
        for name, keys in (("missing", missing), ("unexpected", extra)):
            if keys:
                parts.append(
                    f"{len(keys)} {name} key{'s' if len(keys) > 1 else ''} "
                    f"({', '.join(repr(k) for k in keys[:5])}{', ...' if len(keys) > 5 else ''})"
                )
        raise _err(path, layout, "; ".join(parts))
    for k, shp in table.items():
        if k in sd and tuple(sd[k].shape) != tuple(shp):
            raise _err(path, layout, f"key '{k}' has shape {list(sd[k].shape)}, expected {list(shp)}")
    for k, v in sd.items():
        if not v.is_floating_point() or not bool(torch.isfinite(v).all()):
            raise _err(
                path, layout, f"key '{k}' holds {'non-float' if not v.is_floating_point() else 'non-finite'} values"
            )


def vinvl_tables(spec: BottomUpSpec) -> tuple["OrderedDict[str, tuple[int, ...]]", set[str]]:
    table: OrderedDict[str, tuple[int, ...]] = OrderedDict()
    optional = {to_vinvl_key(ANCHORS)}
    for k, shp in internal_table(spec).items():
        table[to_vinvl_key(k)] = shp
        if to_vinvl_key(k).startswith(VINVL_RES5):
            copy = VINVL_RES5_COPY + to_vinvl_key(k)[len(VINVL_RES5) :]
            table[copy] = shp
            optional.add(copy)
    return table, optional


def check_vinvl(path: Any, sd: Mapping[str, torch.Tensor], spec: BottomUpSpec) -> None:
    """Strict key / shape check; the attribute head's res5 copy must equal the box head's (one shared module)."""
    table, optional = vinvl_tables(spec)
    strict_check(path, "vinvl", sd, table, optional)
    for k in sd:
        if k.startswith(VINVL_RES5_COPY) and not torch.equal(sd[k], sd[VINVL_RES5 + k[len(VINVL_RES5_COPY) :]]):
            raise _err(path, "vinvl", f"key '{k}' differs from the box head's res5 (the release shares one module)")


def load_vinvl(path: Any, layout: str, sd: Mapping[str, torch.Tensor], spec: BottomUpSpec | None = None):
    """Strictly check and load a ``vinvl`` state dict -> (:class:`VinVLDetector`, info)."""
    from extractors.vinvl import VinVLDetector  # noqa: PLC0415 -- cycle: extractors.vinvl registers this loader

    inferred = infer_vinvl_spec(sd, path)
    spec = inferred if spec is None else spec
    if spec.flavor != "vinvl":
        raise _err(
            path,
            "vinvl",
            f"the preset expects {spec.flavor} semantics, the file is a VinVL (maskrcnn_benchmark) detector",
        )
    check_vinvl(path, sd, spec)
    model = VinVLDetector(spec)
    back = {to_vinvl_key(k): k for k in model.state_dict()}
    internal = OrderedDict((back[k], v.float()) for k, v in sd.items() if k in back)
    model.load_state_dict(internal, strict=False)
    return model, {"anchors_from_file": to_vinvl_key(ANCHORS) in sd}


def describe_vinvl(layout: str, sd: Mapping[str, torch.Tensor], path: Any) -> tuple[dict[str, Any], BottomUpSpec]:
    """``cli info`` facts (strict-checked) for a ``vinvl`` file."""
    spec = infer_vinvl_spec(sd, path)
    check_vinvl(path, sd, spec)
    depth = 3 * (sum(spec.stage_blocks) + spec.res5_blocks) + 2
    width = spec.res2_bottleneck // spec.groups
    return {
        "layout": "vinvl",
        "semantics": "vinvl (maskrcnn_benchmark: +1 boxes, sigmoid RPN, ROIAlign, background first)",
        "architecture": f"ResNeXt-{depth} {spec.groups}x{width}d C4 "
        f"(blocks {list(spec.stage_blocks) + [spec.res5_blocks]}), feature {spec.feature_dim}-d",
        "classes": spec.num_classes,
        "attributes": spec.num_attributes if spec.has_attributes else 0,
        "anchors_in_file": to_vinvl_key(ANCHORS) in sd,
    }, spec


# --------------------------------------------------------------------------------------------------------
def grid_tables(spec: BottomUpSpec) -> "OrderedDict[str, tuple[int, ...]]":
    from extractors.grid import GridFeatsModel  # noqa: PLC0415 -- cycle: extractors.grid registers this layout

    with torch.device("meta"):
        model = GridFeatsModel(spec)
    return OrderedDict((k, tuple(v.shape)) for k, v in model.state_dict().items())


def load_grid_feats(path: Any, layout: str, sd: Mapping[str, torch.Tensor], spec: BottomUpSpec | None = None):
    """Strictly check a grid-feats-vqa state dict (backbone loaded, heads checked by name) -> (model, info)."""
    from extractors.grid import (  # noqa: PLC0415 -- cycle: extractors.grid registers this loader
        GridFeatsModel,
        infer_grid_spec,
    )

    spec = infer_grid_spec(sd, path)
    strict_check(path, "grid-feats", sd, grid_tables(spec), set(), GRID_HEADS)
    model = GridFeatsModel(spec)
    model.load_state_dict(OrderedDict((k, v.float()) for k, v in sd.items() if k.startswith("backbone.")), strict=True)
    return model, {"anchors_from_file": False}


def describe_grid_feats(layout: str, sd: Mapping[str, torch.Tensor], path: Any) -> tuple[dict[str, Any], BottomUpSpec]:
    """``cli info`` facts (strict-checked) for a ``grid-feats`` file."""
    from extractors.grid import infer_grid_spec  # noqa: PLC0415 -- cycle: extractors.grid registers this describer

    spec = infer_grid_spec(sd, path)
    strict_check(path, "grid-feats", sd, grid_tables(spec), set(), GRID_HEADS)
    depth = 3 * (sum(spec.stage_blocks) + spec.res5_blocks) + 2
    name = (
        f"ResNeXt-{depth} {spec.groups}x{spec.res2_bottleneck // spec.groups}d"
        if spec.groups > 1
        else f"ResNet-{depth}"
    )
    return {
        "layout": "grid-feats",
        "semantics": "d2 (detectron2 backbone through res5; grid features only)",
        "architecture": f"{name} through res5 (blocks {list(spec.stage_blocks) + [spec.res5_blocks]}), "
        f"feature {spec.feature_dim}-d",
        "pixel_std": ", ".join(f"{v:g}" for v in spec.pixel_std),
        "classes": 0,
        "attributes": 0,
        "deformable": ", ".join(f"res{s}" for s in spec.deform_stages) or "none",
    }, spec
