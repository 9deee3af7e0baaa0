"""The contract every detector of a release implements (:class:`Detector`), so that extraction, the recipes and
the releases' records (:mod:`extractors.releases`) talk to one interface.

A detector is built from a :class:`~extractors.spec.BottomUpSpec`, runs frozen and in eval mode, and offers:

* :meth:`Detector.detect` - a batch of preprocessed blobs and their frames -> one
  :class:`~pipeline.core.regions.RegionRecord` per image, the selector choosing the regions;
* :meth:`Detector.set_test_recipe` - test-time values of the spec (input scale, proposal counts, NMS) changed in
  place, the fields that shape the weights (:attr:`Detector.SHAPING`) refused;
* :meth:`Detector.fold_batchnorm` - the frozen batch norms folded into their convolutions (same function).

:class:`~extractors.bottom_up.BottomUpDetector`, :class:`~extractors.vinvl.detector.VinVLDetector` and
:class:`~extractors.grid.GridFeatsModel` subclass it; the VinVL and grid-feats detectors build their backbone from
the spec with :func:`spec_backbone`; the bottom-up and VinVL detectors run their res5 RoI head with
:meth:`Detector._res5`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from extractors.preprocess import Frame
from extractors.resnet_caffe import ResNetC4, fold_all
from extractors.spec import BottomUpSpec
from pipeline.core.regions import RegionRecord


class Detector(nn.Module):
    """Base of the releases' detectors: ``spec``, ``roi_chunk`` (RoIs per res5 call, 0 = all) and
    ``channels_last`` (``extract.channels_last``), plus the three methods of the module docstring."""

    #: spec fields that shape the weights: :meth:`set_test_recipe` refuses to change them
    SHAPING: tuple[str, ...] = ()

    @property
    def trainable(self) -> bool:
        """Whether :mod:`extractors.training` trains this detector (the bottom-up detector built from the Caffe
        parts); False by default."""
        return False

    def __init__(self, spec: BottomUpSpec) -> None:
        super().__init__()
        self.spec = spec
        self.roi_chunk = 0
        self.channels_last = False  # extract.channels_last (extractors.to_host.use_channels_last)

    def freeze(self) -> None:
        """Eval mode and no gradients: the detectors only extract (training has its own modules)."""
        self.eval()
        for p in self.parameters():
            p.requires_grad_(False)

    def set_test_recipe(self, **changes: Any) -> "Detector":
        """Change test-time settings of the spec in place; a field of :attr:`SHAPING` must stay as it is."""
        new = self.spec.with_(**changes)
        for name in self.SHAPING:
            if getattr(new, name) != getattr(self.spec, name):
                raise ValueError(f"{name} shapes the weights and cannot change after the model is built")
        self.spec = new
        self.share_spec(new)
        return self

    def share_spec(self, spec: BottomUpSpec) -> None:
        """Hand a changed spec to the submodules that read it (none by default)."""

    def scale_random_heads(self) -> None:
        """Rescale freshly drawn head weights (:func:`extractors.random_weights.random_detector`) so that seeded
        random features have a trained detector's spread: small box deltas, class scores with some confidence.
        Nothing by default."""

    def fold_batchnorm(self) -> "Detector":
        """Fold the frozen BNs into the convs (faster inference, same function)."""
        fold_all(self)
        return self

    def _res5(self, pooled: torch.Tensor) -> torch.Tensor:
        """The res5 RoI head (``roi_heads.res5``, ``roi_heads.out_channels``: the bottom-up and VinVL detectors) on
        pooled RoIs (K, C, r, r), ``roi_chunk`` RoIs per call, mean over H, W -> (K, ``out_channels``)."""
        heads = self.roi_heads
        if pooled.shape[0] == 0:
            return pooled.new_zeros((0, heads.out_channels))
        step = self.roi_chunk if self.roi_chunk > 0 else pooled.shape[0]
        return torch.cat([heads.res5(pooled[i : i + step]).mean(dim=(2, 3)) for i in range(0, pooled.shape[0], step)])

    def detect(
        self,
        blobs: list[torch.Tensor],
        frames: list[Frame],
        selector: Any,
        given_boxes: list[np.ndarray] | None = None,
    ) -> list[RegionRecord]:
        """Regions of a batch of blobs (3, H', W') with their :class:`Frame`; ``selector``
        (:func:`extractors.selector.make_selector`) chooses them and puts their boxes in original pixels."""
        raise NotImplementedError


def spec_backbone(spec: BottomUpSpec, stage_blocks: tuple[int, ...]) -> ResNetC4:
    """The stem and ``stage_blocks`` stages of the spec's ResNet / ResNeXt: widths, BN eps, groups, the stride on
    the 1x1 or the 3x3 conv and the stem's pooling as the spec says."""
    return ResNetC4(
        stage_blocks,
        spec.stem_channels,
        spec.res2_bottleneck,
        spec.expansion,
        spec.bn_eps,
        groups=spec.groups,
        stride_in_1x1=spec.stride_in_1x1,
        stem_pool=spec.stem_pool,
    )
