"""Shrunk networks of the released architectures: what the ``size="tiny"`` benches and the extraction proxy
(:mod:`bench.proxies`) run (the code path, not the figure; the test suite runs them on CPU)."""

from __future__ import annotations

from typing import Any

from extractors.spec import BottomUpSpec, caffe_r101
from extractors.vinvl import vinvl_x152c4


def shallow(spec: BottomUpSpec, **changes: Any) -> BottomUpSpec:
    """``spec`` with one bottleneck in each of res2..res4 and in res5 and a 16-channel RPN conv, plus ``changes``
    (the widths of the network being shrunk)."""
    return spec.with_(stage_blocks=(1, 1, 1), res5_blocks=1, rpn_channels=16, **changes)


def narrow_caffe_r101(**changes: Any) -> BottomUpSpec:
    """The Caffe R-101, :func:`shallow` with an 8-channel stem and 4-channel res2 bottleneck, its class and
    attribute heads as released, plus ``changes``."""
    return shallow(caffe_r101(), res2_bottleneck=4, stem_channels=8, **changes)


def tiny_caffe_r101(**changes: Any) -> BottomUpSpec:
    """:func:`narrow_caffe_r101` with 20 classes / 10 attributes and a narrow attribute head, plus ``changes``."""
    return narrow_caffe_r101(num_classes=21, num_attributes=11, attr_embed_dim=8, attr_hidden=16, **changes)


def tiny_vinvl_x152c4(**changes: Any) -> BottomUpSpec:
    """VinVL's X-152 C4, :func:`shallow` with 16-channel stem and res2 bottleneck in 4 groups (a grouped 3x3 conv
    needs a width divisible by its groups) and 20 classes / 10 attributes, plus ``changes``."""
    return shallow(
        vinvl_x152c4(), stem_channels=16, res2_bottleneck=16, groups=4, num_classes=21, num_attributes=11, **changes
    )
