"""The assembled bottom-up Faster R-CNN (Anderson et al. 2018, §3.1): C4 ResNet + RPN + res5 RoI head.

Test time: backbone on each image blob -> proposals -> ROIPool 14x14 -> res5 -> ``pool5_flat`` -> class /
box / attribute probabilities -> the selector of the recipe (:mod:`extractors.selector`: Caffe per-class NMS,
the NMS ladder of the detectron2 ports, or given boxes) -> per-image :class:`RegionRecord` in original-image
pixels. The recipes (preprocessing, proposal settings, selection, rescaling per release) are in
:mod:`extractors.recipes` and docs/recipes.md.

Batching: images whose blobs have the same size share one backbone pass (no padding, so a batched image gives
the numbers of the image alone to float rounding: a convolution over another batch sums in another order); the
res5 head runs once over the RoIs of the whole batch.
Presets are registered in :data:`extractors.EXTRACTORS` as spec factories.

The detector is assembled from :class:`BottomUpParts`: the backbone (:func:`c4_backbone`), the proposal stage
(:class:`extractors.rpn.RPN`, the Caffe ``ProposalLayer``, or :class:`extractors.rpn.DetectronRPN`), the box head
(:class:`extractors.box_head.Res5ROIHeads`), the box coder of the box head's regression and the attribute
probabilities. Each release record below names its parts (``Release.parts``); a detector built from
a spec alone takes the parts of the release of the spec's semantics (:func:`parts_of`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from extractors import EXTRACTORS, box_coding
from extractors.box_head import Res5ROIHeads
from extractors.detector import Detector
from extractors.preprocess import Frame
from extractors.releases import Release, register_release, release_of_flavor
from extractors.resnet_caffe import ResNetC4
from extractors.rpn import RPN, DetectronRPN
from extractors.selector import Selector, to_resized
from extractors.spec import BottomUpSpec, caffe_r101, d2_r101
from extractors.to_host import records_to_host, stack_to_device
from pipeline.core.regions import RegionRecord


def caffe_attr_probs(attr_logits: torch.Tensor) -> torch.Tensor:
    """Caffe ``attr_prob[:, 1:]``: softmax over all A attributes, then "no attribute" (index 0) dropped."""
    return torch.softmax(attr_logits, dim=1)[:, 1:]


def d2_attr_probs(attr_logits: torch.Tensor) -> torch.Tensor:
    """HF ``ROIOutputs``: softmax over the A-1 real attributes (the last logit, "no attribute", left out)."""
    return torch.softmax(attr_logits[:, :-1], dim=1)


def c4_backbone(spec: BottomUpSpec) -> ResNetC4:
    """The C4 ResNet of every bottom-up release (res2..res4; the stem and strides as the spec says)."""
    return ResNetC4(spec.stage_blocks, spec.stem_channels, spec.res2_bottleneck, spec.expansion, spec.bn_eps)


@dataclass(frozen=True)
class BottomUpParts:
    """The parts the bottom-up network is assembled from, as torchvision's ``FasterRCNN`` takes its components.

    ``proposals``: the proposal stage class, built as ``proposals(spec, in_channels)``; ``box_coder``: the coder of
    the box head's class-specific regression (:class:`extractors.selector.NMSLadder`); ``attr_probs``: attribute
    logits (R, A) -> probabilities (R, A-1) without "no attribute"; ``trainable``: :mod:`extractors.training`
    implements these parts (softmax RPN, ``+1`` boxes, background first); ``backbone``: spec -> the backbone
    (``out_channels``: its C4 width); ``box_head``: (spec, in_channels) -> the RoI head (pooling, res5, box,
    class and attribute predictors)."""

    proposals: type[RPN]
    box_coder: box_coding.BoxCoder
    attr_probs: Callable[[torch.Tensor], torch.Tensor]
    trainable: bool = False
    backbone: Callable[[BottomUpSpec], nn.Module] = c4_backbone
    box_head: Callable[[BottomUpSpec, int], nn.Module] = Res5ROIHeads


CAFFE_PARTS = BottomUpParts(RPN, box_coding.LEGACY, caffe_attr_probs, trainable=True)
"""Caffe ``test.prototxt`` / MILVLG caffe mode: ``ProposalLayer``, ``+1`` boxes, softmax over all attributes."""

DETECTRON2_PARTS = BottomUpParts(DetectronRPN, box_coding.DETECTRON2, d2_attr_probs)
"""The detectron2 ports (airsplay, HF-lxmert): detectron2 RPN and box coder, ``ROIOutputs`` attributes."""


def parts_of(spec: BottomUpSpec) -> BottomUpParts | None:
    """The parts the release of ``spec``'s semantics builds its bottom-up detector from (None: that release's
    detector is another network)."""
    parts = release_of_flavor(spec.flavor).parts
    return parts if isinstance(parts, BottomUpParts) else None


class BottomUpDetector(Detector):
    """``backbone`` + ``proposal_generator`` + ``roi_heads`` (state-dict keys = MILVLG caffe-mode layout)."""

    SHAPING = (
        "flavor",
        "stem_channels",
        "res2_bottleneck",
        "expansion",
        "stage_blocks",
        "res5_blocks",
        "rpn_channels",
        "num_classes",
        "num_attributes",
        "attr_embed_dim",
        "attr_hidden",
        "has_attributes",
        "anchor_ratios",
    )

    def __init__(self, spec: BottomUpSpec, parts: BottomUpParts | None = None) -> None:
        """``parts``: those of the release of ``spec``'s semantics (:func:`parts_of`) when not given."""
        super().__init__(spec)
        parts = parts_of(spec) if parts is None else parts
        if parts is None:
            raise ValueError(f"no bottom-up parts for {spec.flavor} semantics: their release builds another detector")
        self.parts = parts
        self.backbone = parts.backbone(spec)
        self.proposal_generator = parts.proposals(spec, self.backbone.out_channels)
        self.roi_heads = parts.box_head(spec, self.backbone.out_channels)
        self.freeze()

    @property
    def trainable(self) -> bool:
        return self.parts.trainable

    def share_spec(self, spec: BottomUpSpec) -> None:
        self.proposal_generator.spec = self.roi_heads.spec = spec

    def scale_random_heads(self) -> None:
        self.roi_heads.box_predictor.bbox_pred.weight.mul_(0.02)
        self.roi_heads.box_predictor.cls_score.weight.mul_(4.0)

    # ----------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def detect(
        self,
        blobs: list[torch.Tensor],
        frames: list[Frame],
        selector: Selector,
        given_boxes: list[np.ndarray] | None = None,
    ) -> list[RegionRecord]:
        """Probabilities -> selector -> regions for a batch of blobs (3, H', W') made by the recipe's
        preprocessing (:func:`extractors.preprocess.recipe_blob`), with their :class:`Frame`.

        ``selector`` (:func:`extractors.selector.make_selector`) chooses the regions and puts their boxes in
        original pixels; with a given-boxes selector, ``given_boxes`` are (N_i, 4) original-pixel boxes whose
        features are pooled instead of proposals.
        """
        if getattr(selector, "whole_image", False):  # --boxes grid (extractors.grid)
            return selector.detect(self, blobs, frames)
        dev = next(self.parameters()).device
        n = len(blobs)
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, b in enumerate(blobs):
            groups[tuple(b.shape[-2:])].append(i)
        rois_per_image: list[torch.Tensor] = [None] * n  # type: ignore[list-item]
        pooled_parts: list[tuple[list[int], torch.Tensor, list[int]]] = []
        for (h, w), idx in groups.items():
            batch = stack_to_device([blobs[i] for i in idx], dev, self.channels_last)  # pinned blobs stay pinned
            feat = self.backbone(batch)
            if selector.given:
                assert given_boxes is not None, "the given-boxes selector needs boxes"
                props = [
                    to_resized(
                        torch.as_tensor(given_boxes[i], dtype=torch.float32, device=dev).reshape(-1, 4),
                        frames[i],
                        selector.recipe.rescale,
                    )
                    for i in idx
                ]
            else:
                props = self.proposal_generator(feat, [(h, w)] * len(idx), [frames[i].im_scale for i in idx])
            rois = torch.cat(
                [
                    torch.cat([torch.full((p.shape[0], 1), j, dtype=torch.float32, device=dev), p], 1)
                    for j, p in enumerate(props)
                ]
            )
            for j, i in enumerate(idx):
                rois_per_image[i] = props[j]
            pooled_parts.append((idx, self.roi_heads.pool(feat, rois), [p.shape[0] for p in props]))
        # res5 over all RoIs of the batch at once
        order: list[int] = []
        counts: list[int] = []
        pooled = []
        for idx, pool, cnt in pooled_parts:
            order += idx
            counts += cnt
            pooled.append(pool)
        feats = self._res5(torch.cat(pooled))
        logits, deltas, attr_logits = self.roi_heads.box_predictor(feats)
        feats, logits, deltas = feats.float(), logits.float(), deltas.float()
        attr_logits = attr_logits.float() if attr_logits is not None else None
        per_image = {}
        start = 0
        for i, c in zip(order, counts):
            per_image[i] = slice(start, start + c)
            start += c
        return self._regions(rois_per_image, per_image, feats, logits, deltas, attr_logits, frames, selector)

    def class_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Foreground class probabilities (R, C-1) in vocabulary order (softmax over all C, background dropped)."""
        prob = torch.softmax(logits, dim=1)
        bg = self.spec.background_index
        return prob[:, 1:] if bg == 0 else prob[:, :bg]

    def attr_probs(self, attr_logits: torch.Tensor) -> torch.Tensor:
        """Attribute probabilities (R, A-1) without "no attribute", by the parts' rule (:func:`caffe_attr_probs`,
        :func:`d2_attr_probs`)."""
        return self.parts.attr_probs(attr_logits)

    def _regions(self, rois, per_image, feats, logits, deltas, attr_logits, frames, selector) -> list[RegionRecord]:
        n = len(rois)
        fg = self.class_probs(logits)
        attr = self.attr_probs(attr_logits) if attr_logits is not None else None
        picked = selector(
            [rois[i] for i in range(n)],
            [fg[per_image[i]] for i in range(n)],
            [deltas[per_image[i]] for i in range(n)],
            frames,
        )
        chosen = [p.keep for p in picked]
        # the kept rows of every image at once (rows of the batch's flat RoI tensors), then one copy to the host
        rows = (
            torch.cat([per_image[i].start + chosen[i].to(fg.device) for i in range(n)])
            if n
            else torch.zeros(0, dtype=torch.long)
        )
        cs, ci = (
            fg[rows].max(dim=1)
            if rows.numel()
            else (fg.new_zeros(0), torch.zeros(0, dtype=torch.long, device=fg.device))
        )
        if attr is not None:
            a_s, a_i = (
                attr[rows].max(dim=1)
                if rows.numel()
                else (fg.new_zeros(0), torch.zeros(0, dtype=torch.long, device=fg.device))
            )
        kept, start = feats[rows], 0
        fields = []
        for i in range(n):
            k = slice(start, start + chosen[i].numel())
            start = k.stop
            fields.append(
                {
                    "features": kept[k],
                    "boxes": picked[i].boxes,
                    "class_ids": ci[k],
                    "class_scores": cs[k],
                    "attr_ids": a_i[k] if attr is not None else None,
                    "attr_scores": a_s[k] if attr is not None else None,
                }
            )
        return records_to_host(fields, [(frames[i].width, frames[i].height) for i in range(n)])


# presets -------------------------------------------------------------------------------------------------
@EXTRACTORS.register("bottom-up-caffe-r101")
def preset_caffe_r101() -> BottomUpSpec:
    """The Caffe / MILVLG caffe-mode ResNet-101 VG detector (1600 classes + background, 400 attributes)."""
    return caffe_r101()


@EXTRACTORS.register("bottom-up-d2-r101")
def preset_d2_r101() -> BottomUpSpec:
    """The airsplay / HF-lxmert port of the same network (detectron2 semantics, see :class:`BottomUpSpec`)."""
    return d2_r101()


# releases ------------------------------------------------------------------------------------------------
# The bottom-up layouts (milvlg, butd, airsplay, hf) are read by extractors.weights; each release names its own.
register_release(
    Release(
        name="caffe",
        source=(
            "peteanderson80/bottom-up-attention tools/generate_tsv.py (Caffe; = MILVLG bottom-up-attention.pytorch "
            "caffe mode)"
        ),
        layouts=("milvlg", "butd"),
        flavor="caffe",
        preset="bottom-up-caffe-r101",
        catalogue=("bua-r101", "bua-r101-fix36", "bua-r152"),
        # the bottom-up TSVs (generate_tsv.py; LXMERT's obj36 files ran the same model) and the files made from
        # them: ruotianluo's cocobu npz/npy (from the adaptive TSVs) and M2's coco_detections.hdf5
        import_formats=("butd-tsv", "obj36-tsv", "cocobu", "m2-hdf5"),
        detector=BottomUpDetector,
        parts=CAFFE_PARTS,
        random_identity="bottom-up-random",
    )
)
register_release(
    Release(
        name="hf",
        source="huggingface/transformers examples/research_projects/lxmert (unc-nlp/frcnn-vg-finetuned)",
        layouts=("hf",),
        flavor="d2",
        preset="bottom-up-d2-r101",
        catalogue=("frcnn-vg-finetuned",),
        detector=BottomUpDetector,
        parts=DETECTRON2_PARTS,
        random_identity="bottom-up-random",
    )
)
register_release(
    Release(
        name="airsplay",
        source="airsplay/py-bottom-up-attention demo/detectron2_mscoco_proposal_maxnms.py",
        layouts=("airsplay",),
        preset="bottom-up-d2-r101",
        detector=BottomUpDetector,
        parts=DETECTRON2_PARTS,
    )
)
