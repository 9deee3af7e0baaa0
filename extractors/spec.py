"""The architecture description of a bottom-up Faster R-CNN (depth, widths, class counts, test-time recipe).

One frozen dataclass holds everything that shapes the network or its test-time behaviour, so that presets
(the full R-101 of Anderson et al. 2018, or small CPU variants) differ only in data, never in code.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from pipeline.core.errors import UsageError

CAFFE_PIXEL_MEANS_BGR = (102.9801, 115.9465, 122.7717)
"""py-faster-rcnn ``PIXEL_MEANS`` in BGR order (``lib/fast_rcnn/config.py``; docs/recipes.md)."""

DETECTRON2_PIXEL_MEANS_BGR = (103.530, 116.280, 123.675)
"""detectron2's default ``PIXEL_MEAN`` (BGR, 0-255), which maskrcnn_benchmark configs (VinVL's ``vinvl_x152c4.yaml``)
and grid-feats-vqa use too (docs/recipes.md#vinvl)."""

FLAVORS = ("caffe", "d2", "vinvl")


@dataclass(frozen=True)
class BottomUpSpec:
    """Architecture + test-time recipe of the detector.

    ``flavor`` selects the semantics that differ between the Caffe original (and MILVLG's caffe mode) and the
    detectron2 ports (airsplay / HF-lxmert), docs/extractor.md#flavors:

    * ``caffe``: 24-channel 2-way softmax objectness (background first), Caffe anchor table (centre 7.5,
      ratio-major), legacy ``+1`` box coder with weights (1,1,1,1) for RPN and box head, clip to ``size-1``,
      min proposal size ``16*scale``, classifier with background at index 0 and class-specific regression
      over all ``num_classes`` (6404 outputs), attribute softmax over all ``num_attributes`` (index 0 =
      "no attribute").
    * ``d2``: 12-channel sigmoid objectness, detectron2 anchors (centre 0, size-major), box coder without
      ``+1`` (RPN weights 1, box head weights 10/10/5/5), clip to ``size``, min size 0, background and
      "no attribute" as the *last* row, regression over the foreground classes only (6400 outputs).
    * ``vinvl`` (maskrcnn_benchmark, VinVL ``vinvl_vg_x152c4``; docs/recipes.md#vinvl): ResNeXt with the stride on
      the 3x3 conv, FrozenBN without eps, stem pool pad 1; 15 sigmoid anchors of the legacy generator (``+1``,
      centre 7.5, ``anchor_sizes``), ``+1`` box coder (``x2 = ctr + w/2 - 1``), ROIAlign 14x14 (aligned=False),
      res5 with stride 2 on the 3x3 conv (7x7), background first with class-specific boxes over all classes,
      the attribute head fed with the *selected* label (:mod:`extractors.vinvl.detector`).
    """

    flavor: str = "caffe"
    # backbone (caffe-style ResNet, stride on the 1x1 conv)
    stem_channels: int = 64
    res2_bottleneck: int = 64  # bottleneck width of res2; doubles every stage
    expansion: int = 4  # out channels = 4 * bottleneck width
    stage_blocks: tuple[int, ...] = (3, 4, 23)  # res2, res3, res4 (C4 backbone)
    res5_blocks: int = 3
    res5_dilation: int = 2  # Caffe test.prototxt: res5 stride 1, dilation 2 (14x14 stays 14x14)
    bn_eps: float = 1e-5
    groups: int = 1  # ResNeXt cardinality of every 3x3 conv (VinVL X-152 32x8d: 32, res2_bottleneck = 32 * 8)
    stride_in_1x1: bool = True  # False: the block stride sits on the 3x3 conv (ResNeXt, STRIDE_IN_1X1 False)
    stem_pool: str = (
        "caffe"  # caffe: 3x3/2 pad 0 ceil mode; pad1: 3x3/2 pad 1 floor mode (maskrcnn_benchmark, detectron2)
    )
    deform_stages: tuple[int, ...] = ()  # stages whose 3x3 convs are deformable (DCNv1; grid-feats X-152++: res4, res5)
    # RPN
    rpn_channels: int = 512
    anchor_stride: int = 16
    anchor_ratios: tuple[float, ...] = (0.5, 1.0, 2.0)
    anchor_scales: tuple[float, ...] = (4.0, 8.0, 16.0, 32.0)  # caffe: multiples of the 16-px base anchor
    anchor_sizes: tuple[float, ...] = (64.0, 128.0, 256.0, 512.0)  # d2: absolute sizes
    pre_nms_topk: int = 6000
    post_nms_topk: int = 300
    rpn_nms_thresh: float = 0.7
    rpn_min_size: float = 16.0  # "at original image scale": multiplied by the image scale (caffe flavor)
    # RoI head
    pooler_resolution: int = 14
    num_classes: int = 1601  # including background
    num_attributes: int = 401  # including "no attribute"
    attr_embed_dim: int = 256
    attr_hidden: int = 512
    has_attributes: bool = True
    box_reg_weights: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)
    scale_clamp: float = math.log(1000.0 / 16)
    # input
    min_size: int = 600
    max_size: int = 1000
    pixel_means: tuple[float, float, float] = CAFFE_PIXEL_MEANS_BGR
    pixel_std: tuple[float, float, float] = (1.0, 1.0, 1.0)  # grid-feats X-101: (57.375, 57.120, 58.395)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}, not {self.flavor!r}")
        if len(self.stage_blocks) < 1 or any(b < 1 for b in self.stage_blocks) or self.res5_blocks < 1:
            raise ValueError("every ResNet stage needs at least one block")

    # derived sizes -------------------------------------------------------------------------------------
    @property
    def background_first(self) -> bool:
        """Background at class row 0 and regression rows for every class (caffe, vinvl) vs last / foreground only
        (d2)."""
        return self.flavor != "d2"

    @property
    def anchor_field(self) -> str:
        """The field whose entries, times ``anchor_ratios``, make the cell anchors: ``anchor_scales`` (the Caffe
        table) or ``anchor_sizes`` (detectron2's and maskrcnn_benchmark's)."""
        return "anchor_scales" if self.flavor == "caffe" else "anchor_sizes"

    @property
    def num_anchors(self) -> int:
        return len(getattr(self, self.anchor_field)) * len(self.anchor_ratios)

    @property
    def c4_channels(self) -> int:
        """Channels of the last backbone stage (res4 for R-101: 1024)."""
        return self.res2_bottleneck * (2 ** (len(self.stage_blocks) - 1)) * self.expansion

    @property
    def feature_dim(self) -> int:
        """Channels of res5 = the pooled region feature size (2048 for R-101)."""
        return self.c4_channels * 2

    @property
    def background_index(self) -> int:
        return 0 if self.background_first else self.num_classes - 1

    @property
    def bbox_classes(self) -> int:
        """Rows of class-specific regression: all classes (caffe) or the foreground ones (d2)."""
        return self.num_classes if self.background_first else self.num_classes - 1

    @property
    def feature_stride(self) -> int:
        return 4 * 2 ** (len(self.stage_blocks) - 1)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data; the ResNeXt / VinVL fields only when they differ from their defaults, so a
        ResNet-101 identity (and a store written before those fields existed) stays the same."""
        d = asdict(self)
        d.pop("extra")
        for key, default in NEWER_DEFAULTS.items():
            if d[key] == default:
                d.pop(key)
        return d

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)} - {"extra"}

    def with_(self, **changes: Any) -> "BottomUpSpec":
        """A copy with ``changes`` applied (the dataclass checks run again)."""
        return replace(self, **changes)

    def with_overrides(self, overrides: dict[str, Any], key: str = "spec") -> "BottomUpSpec":
        """A copy with user overrides from config section ``key`` (lists become tuples); an unknown or invalid
        key is a :class:`~pipeline.core.errors.UsageError` naming ``key``."""
        known = self.field_names()
        bad = sorted(set(overrides) - known)
        if bad:
            raise UsageError(f"unknown {key} key {bad[0]!r} (known: {', '.join(sorted(known))})")
        try:
            return self.with_(**{k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()})
        except (TypeError, ValueError) as exc:
            raise UsageError(f"invalid {key}: {exc}") from None


NEWER_DEFAULTS: dict[str, Any] = {
    "groups": 1,
    "stride_in_1x1": True,
    "stem_pool": "caffe",
    "pixel_std": (1.0, 1.0, 1.0),
    "deform_stages": (),
}
"""Fields added for ResNeXt / VinVL / grid-feats, left out of :meth:`BottomUpSpec.to_dict` at these values."""


def caffe_r101() -> BottomUpSpec:
    """The Caffe / MILVLG caffe-mode R-101 (docs/extractor.md#flavors)."""
    return BottomUpSpec()


def d2_r101() -> BottomUpSpec:
    """The airsplay / HF-lxmert R-101 semantics at the Caffe test scale 600/1000 (docs/extractor.md#flavors)."""
    return BottomUpSpec(flavor="d2", rpn_min_size=0.0, box_reg_weights=(10.0, 10.0, 5.0, 5.0))
