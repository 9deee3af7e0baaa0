"""Shrunk networks of the released architectures: what the ``size="tiny"`` benches run (the code path, not the
figure; the test suite runs them on CPU)."""

from __future__ import annotations

from typing import Any

from extractors.spec import BottomUpSpec, caffe_r101


def tiny_caffe_r101(**changes: Any) -> BottomUpSpec:
    """The Caffe R-101 with one block per stage, narrow channels and 20 classes / 10 attributes, plus ``changes``."""
    return caffe_r101().with_(
        stage_blocks=(1, 1, 1),
        res5_blocks=1,
        res2_bottleneck=4,
        stem_channels=8,
        num_classes=21,
        num_attributes=11,
        attr_embed_dim=8,
        attr_hidden=16,
        rpn_channels=16,
        **changes,
    )
