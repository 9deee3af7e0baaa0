"""The ``vinvl`` weights layout (docs/extractor.md#weights-layouts): microsoft/scene_graph_benchmark
``vinvl_vg_x152c4.pth``, a flat torch state dict of ``AttrRCNN`` (every key may carry the ``module.`` prefix of a
DataParallel save; a ``{"model": ...}`` wrapper is accepted).

Names: ``backbone.body.{stem,layer1..3}`` (``conv{k}`` / ``bn{k}`` / ``downsample.{0,1}``), ``rpn.head.{conv,
cls_logits, bbox_pred}``, ``rpn.anchor_generator.cell_anchors.0`` (optional; used when present),
``roi_heads.box.feature_extractor.head.layer4``, ``roi_heads.box.predictor.{cls_score, bbox_pred}``,
``attribute.predictor.{cls_embedding, fc_attr, attr_score}``, and optionally
``attribute.feature_extractor.head.layer4`` (the shared res5 saved twice: it must equal the box head's).
:class:`extractors.vinvl.detector.VinVLDetector` keeps detectron2-style names; :func:`to_vinvl_key` maps them.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any, Mapping

import torch

from extractors.layouts import layout_error, plain_keys, stage_blocks, state_table, strict_check
from extractors.spec import BottomUpSpec
from extractors.vinvl.detector import VinVLDetector, vinvl_x152c4
from extractors.weight_bounds import check_spec, dims, groups_of

LAYOUT = "vinvl"
FLAVOR = "vinvl"  # the spec semantics of maskrcnn_benchmark detectors (extractors.spec.FLAVORS)
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


def to_vinvl_key(key: str) -> str:
    """Internal key (:class:`extractors.vinvl.detector.VinVLDetector`) -> scene_graph_benchmark's name."""
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


def detect_vinvl(sd: Mapping[str, Any]) -> str | None:
    """``vinvl`` when the key names are scene_graph_benchmark's (a ``module.`` prefix ignored), else None."""
    keys = plain_keys(sd)
    if any(k.startswith("backbone.body.") for k in keys) and any(k.startswith("roi_heads.box.") for k in keys):
        return LAYOUT
    return None


def infer_vinvl_spec(sd: Mapping[str, torch.Tensor], path: Any = "?") -> BottomUpSpec:
    """The architecture a ``vinvl`` state dict describes (depth, widths, groups, classes, attributes, anchors)."""
    stages = stage_blocks(sd, r"^backbone\.body\.layer(\d+)\.(\d+)\.conv1\.weight$")
    res5 = stage_blocks(sd, r"^roi_heads\.box\.feature_extractor\.head\.layer(4)\.(\d+)\.conv1\.weight$").get(4, 0)
    if sorted(stages) != list(range(1, 1 + len(stages))) or not stages or not res5:
        raise layout_error(
            path, LAYOUT, "backbone.body.layer1.. and roi_heads.box.feature_extractor.head.layer4 not found"
        )
    stem = dims(sd, "backbone.body.stem.conv1.weight", 4, path, LAYOUT)[0]
    bott, groups = groups_of(sd, "backbone.body.layer1.0.conv2.weight", path, LAYOUT)
    out2 = dims(sd, "backbone.body.layer1.0.conv3.weight", 4, path, LAYOUT)[0]
    a = dims(sd, "rpn.head.cls_logits.weight", 4, path, LAYOUT)[0]
    if a % 3 or out2 % bott:
        raise layout_error(
            path, LAYOUT, f"{a} anchors per cell or res2 widths {bott}/{out2} do not fit the VinVL architecture"
        )
    kw: dict[str, Any] = {}
    has_attr = "attribute.predictor.attr_score.weight" in sd
    if has_attr:
        kw = {
            "num_attributes": dims(sd, "attribute.predictor.attr_score.weight", 2, path, LAYOUT)[0],
            "attr_embed_dim": dims(sd, "attribute.predictor.cls_embedding.weight", 2, path, LAYOUT)[1],
            "attr_hidden": dims(sd, "attribute.predictor.fc_attr.weight", 2, path, LAYOUT)[0],
        }
    spec = vinvl_x152c4().with_(
        stem_channels=stem,
        res2_bottleneck=bott,
        expansion=out2 // bott,
        groups=groups,
        stage_blocks=tuple(stages[s] for s in sorted(stages)),
        res5_blocks=res5,
        rpn_channels=dims(sd, "rpn.head.conv.weight", 4, path, LAYOUT)[0],
        anchor_sizes=tuple(32.0 * 2**i for i in range(a // 3)),
        num_classes=dims(sd, "roi_heads.box.predictor.cls_score.weight", 2, path, LAYOUT)[0],
        has_attributes=has_attr,
        **kw,
    )
    return check_spec(spec, path, LAYOUT, "architecture")


def vinvl_tables(spec: BottomUpSpec) -> tuple["OrderedDict[str, tuple[int, ...]]", set[str]]:
    table: OrderedDict[str, tuple[int, ...]] = OrderedDict()
    optional = {to_vinvl_key(ANCHORS)}
    for k, shp in state_table(VinVLDetector, spec).items():
        table[to_vinvl_key(k)] = shp
        if to_vinvl_key(k).startswith(VINVL_RES5):
            copy = VINVL_RES5_COPY + to_vinvl_key(k)[len(VINVL_RES5) :]
            table[copy] = shp
            optional.add(copy)
    return table, optional


def check_vinvl(path: Any, sd: Mapping[str, torch.Tensor], spec: BottomUpSpec) -> None:
    """Strict key / shape check; the attribute head's res5 copy must equal the box head's (one shared module)."""
    table, optional = vinvl_tables(spec)
    strict_check(path, LAYOUT, sd, table, optional)
    for k in sd:
        if k.startswith(VINVL_RES5_COPY) and not torch.equal(sd[k], sd[VINVL_RES5 + k[len(VINVL_RES5_COPY) :]]):
            raise layout_error(
                path, LAYOUT, f"key '{k}' differs from the box head's res5 (the release shares one module)"
            )


def load_vinvl(path: Any, layout: str, sd: Mapping[str, torch.Tensor], spec: BottomUpSpec | None = None):
    """Strictly check and load a ``vinvl`` state dict -> (:class:`VinVLDetector`, info)."""
    inferred = infer_vinvl_spec(sd, path)
    spec = inferred if spec is None else spec
    if spec.flavor != FLAVOR:
        raise layout_error(
            path,
            LAYOUT,
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
        "layout": LAYOUT,
        "semantics": "vinvl (maskrcnn_benchmark: +1 boxes, sigmoid RPN, ROIAlign, background first)",
        "architecture": f"ResNeXt-{depth} {spec.groups}x{width}d C4 "
        f"(blocks {list(spec.stage_blocks) + [spec.res5_blocks]}), feature {spec.feature_dim}-d",
        "classes": spec.num_classes,
        "attributes": spec.num_attributes if spec.has_attributes else 0,
        "anchors_in_file": to_vinvl_key(ANCHORS) in sd,
    }, spec
