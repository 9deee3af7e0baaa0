"""The VinVL object-attribute detector (Zhang et al. 2021, "VinVL"; microsoft/scene_graph_benchmark ``AttrRCNN``
on maskrcnn_benchmark) in plain PyTorch + torchvision: ResNeXt-152 32x8d C4, single-level RPN, ROIAlign, res5
head, 1595-way classifier with class-specific boxes, 525-way attribute head (docs/recipes.md#vinvl).

Test time, per image (one backbone pass per equal-sized group, no padding, so batching changes nothing):

1. backbone (stride on the 3x3 conv, FrozenBN without eps) -> C4 map;
2. RPN (``RPNPostProcessor``): sigmoid objectness in (h, w, a) order, top ``pre_nms_topk`` -> ``+1`` decode with
   weights 1 -> clip to ``[0, W-1] x [0, H-1]`` -> drop boxes with ``x2 - x1 + 1 < 0`` -> NMS ``rpn_nms_thresh`` ->
   first ``post_nms_topk`` (NMS keep order);
3. ``ROIAlign(14, 1/16, sampling_ratio=0, aligned=False)`` -> res5 (stride 2) -> mean over 7x7 = the 2048-d
   ``box_features`` -> ``cls_score`` / ``bbox_pred``;
4. the recipe's post-processing (:mod:`extractors.vinvl.select`, ``nms_filter`` 0/1/2);
5. attribute head on the *selected* boxes: pooled res5 of those boxes ``‖ cls_embedding(label)`` ->
   ``fc_attr`` + ReLU -> ``attr_score`` (``AttributeRCNNPredictor``); with ``ignore_box_regression`` the boxes
   are the proposals themselves, so their pooled features are the rows already computed (the release
   recomputes the same numbers);
6. boxes back to original pixels per axis (``BoxList.resize``), no re-clip.

Grid features (``--boxes grid``) run the res5 head on the whole C4 map (:mod:`extractors.grid`).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import roi_align

from extractors import box_coding
from extractors.anchors import caffe_cell_anchors
from extractors.detector import Detector, spec_backbone
from extractors.preprocess import Frame
from extractors.resnet_caffe import make_res5
from extractors.rpn import AnchorGenerator, RPNHead
from extractors.selector import to_original, to_resized
from extractors.spec import DETECTRON2_PIXEL_MEANS_BGR, BottomUpSpec
from extractors.to_host import records_to_host, stack_to_device
from extractors.vinvl import select as vinvl_select
from pipeline.core.regions import RegionRecord


def vinvl_x152c4() -> BottomUpSpec:
    """VinVL ``vinvl_vg_x152c4``: ResNeXt-152 32x8d C4, 1594 classes + background, 524 attributes + none
    (microsoft/scene_graph_benchmark ``sgg_configs/vgattr/vinvl_x152c4.yaml``; docs/recipes.md#vinvl)."""
    return BottomUpSpec(
        flavor="vinvl",
        stem_channels=64,
        res2_bottleneck=256,
        expansion=1,
        stage_blocks=(3, 8, 36),
        res5_blocks=3,
        res5_dilation=1,
        bn_eps=0.0,
        groups=32,
        stride_in_1x1=False,
        stem_pool="pad1",
        rpn_channels=1024,
        anchor_sizes=(32.0, 64.0, 128.0, 256.0, 512.0),
        rpn_min_size=0.0,
        num_classes=1595,
        num_attributes=525,
        box_reg_weights=(10.0, 10.0, 5.0, 5.0),
        pixel_means=DETECTRON2_PIXEL_MEANS_BGR,
    )


def maskrcnn_anchor_table(spec: BottomUpSpec) -> torch.Tensor:
    """maskrcnn_benchmark ``generate_anchors``: py-faster-rcnn's table at scales ``anchor_sizes / anchor_stride``."""
    return caffe_cell_anchors(
        spec.anchor_stride, spec.anchor_ratios, tuple(s / spec.anchor_stride for s in spec.anchor_sizes)
    )


class AttributeHead(nn.Module):
    """``AttributeRCNNPredictor``: ``attr_score(ReLU(fc_attr([pool5 ; cls_embedding(label)])))``."""

    def __init__(self, spec: BottomUpSpec, in_dim: int) -> None:
        super().__init__()
        self.cls_embedding = nn.Embedding(spec.num_classes, spec.attr_embed_dim)
        self.fc_attr = nn.Linear(in_dim + spec.attr_embed_dim, spec.attr_hidden)
        self.attr_score = nn.Linear(spec.attr_hidden, spec.num_attributes)

    def forward(self, pooled: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.cat([pooled, self.cls_embedding(labels).to(pooled.dtype)], dim=1)
        return self.attr_score(F.relu(self.fc_attr(h)))


class VinVLHeads(nn.Module):
    """``roi_heads``: res5 head (``layer4``), box predictor, attribute predictor."""

    def __init__(self, spec: BottomUpSpec, in_channels: int) -> None:
        super().__init__()
        self.spec = spec
        self.res5, out = make_res5(spec, in_channels, spec.groups, spec.stride_in_1x1)  # ``layer4`` of the ResNeXt
        self.out_channels = out
        self.cls_score = nn.Linear(out, spec.num_classes)
        self.bbox_pred = nn.Linear(out, spec.num_classes * 4)
        self.attribute = AttributeHead(spec, out) if spec.has_attributes else None

    def pool(self, feat: torch.Tensor, rois: torch.Tensor) -> torch.Tensor:
        """Legacy ROIAlign (``aligned=False``, adaptive sampling) -> (K, C, r, r)."""
        r = self.spec.pooler_resolution
        return roi_align(
            feat.float(), rois.float(), (r, r), 1.0 / self.spec.feature_stride, sampling_ratio=0, aligned=False
        ).to(feat.dtype)


class VinVLDetector(Detector):
    """``backbone`` + ``proposal_generator`` + ``roi_heads`` with internal (detectron2-style) key names; the
    ``vinvl`` weights layout maps them to scene_graph_benchmark's (:mod:`extractors.vinvl.layout`)."""

    SHAPING = ("stage_blocks", "res2_bottleneck", "groups", "num_classes", "num_attributes", "rpn_channels")

    def __init__(self, spec: BottomUpSpec) -> None:
        super().__init__(spec)
        self.backbone = spec_backbone(spec, spec.stage_blocks)
        self.proposal_generator = nn.Module()
        self.proposal_generator.anchor_generator = AnchorGenerator(spec, maskrcnn_anchor_table)
        self.proposal_generator.rpn_head = RPNHead(
            self.backbone.out_channels, spec.rpn_channels, spec.num_anchors, softmax_objectness=False
        )
        self.roi_heads = VinVLHeads(spec, self.backbone.out_channels)
        self.freeze()

    def share_spec(self, spec: BottomUpSpec) -> None:
        self.roi_heads.spec = spec

    def scale_random_heads(self) -> None:
        """The bottom-up scaling, with the attribute logits spread so that some pass the 0.05 threshold."""
        self.roi_heads.bbox_pred.weight.mul_(0.02)
        self.roi_heads.cls_score.weight.mul_(0.3)
        if self.roi_heads.attribute is not None:
            self.roi_heads.attribute.attr_score.weight.mul_(4.0)

    # ----------------------------------------------------------------------------------------------------
    def proposals(self, feat: torch.Tensor, sizes: list[tuple[int, int]], variant: str) -> list[torch.Tensor]:
        """``RPNPostProcessor.forward_for_single_feature_map`` for each image of an equal-sized batch."""
        s = self.spec
        logits, deltas = self.proposal_generator.rpn_head(feat)
        n, a, h, w = logits.shape
        obj = torch.sigmoid(logits.float()).permute(0, 2, 3, 1).reshape(n, -1)
        deltas = deltas.float().view(n, a, 4, h, w).permute(0, 3, 4, 1, 2).reshape(n, -1, 4)
        anchors = self.proposal_generator.anchor_generator(h, w)
        out = []
        for i in range(n):
            k = min(s.pre_nms_topk, obj.shape[1])
            score, idx = obj[i].topk(k, sorted=True)
            boxes = box_coding.decode(
                deltas[i, idx],
                anchors[idx],
                (1.0, 1.0, 1.0, 1.0),
                legacy=True,
                scale_clamp=s.scale_clamp,
                x2_minus_one=True,
            )
            boxes = vinvl_select.clip_legacy(boxes, *sizes[i])
            keep = ((boxes[:, 2] - boxes[:, 0] + 1) >= s.rpn_min_size) & (
                (boxes[:, 3] - boxes[:, 1] + 1) >= s.rpn_min_size
            )
            boxes, score = boxes[keep], score[keep]
            out.append(boxes[vinvl_select.nms_keep(boxes, score, s.rpn_nms_thresh, variant)[: s.post_nms_topk]])
        return out

    def box_features(self, feat: torch.Tensor, boxes: list[torch.Tensor]) -> torch.Tensor:
        """Pooled res5 features (sum K_i, D) of resized-pixel boxes on an equal-sized batch's C4 map."""
        dev = feat.device
        rois = torch.cat(
            [
                torch.cat([torch.full((b.shape[0], 1), j, dtype=torch.float32, device=dev), b.float()], 1)
                for j, b in enumerate(boxes)
            ]
        )
        return self._res5(self.roi_heads.pool(feat, rois)).float()

    @torch.inference_mode()
    def detect(
        self, blobs: list[torch.Tensor], frames: list[Frame], selector, given_boxes: list[np.ndarray] | None = None
    ) -> list[RegionRecord]:
        """Regions of each blob with the resolved recipe of ``selector`` (``vinvl`` post-processing or given boxes)."""
        if getattr(selector, "whole_image", False):  # --boxes grid (extractors.grid)
            return selector.detect(self, blobs, frames)
        recipe = selector.recipe
        dev = next(self.parameters()).device
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, b in enumerate(blobs):
            groups[tuple(b.shape[-2:])].append(i)
        fields: list[dict] = [{}] * len(blobs)
        for (h, w), idx in groups.items():
            feat = self.backbone(stack_to_device([blobs[i] for i in idx], dev, self.channels_last))
            if selector.given:
                props = [
                    to_resized(
                        torch.as_tensor(given_boxes[i], dtype=torch.float32, device=dev).reshape(-1, 4),
                        frames[i],
                        "per-axis",
                    )
                    for i in idx
                ]
            else:
                props = self.proposals(feat, [(h, w)] * len(idx), recipe.nms_variant)
            feats = self.box_features(feat, props)
            logits = self.roi_heads.cls_score(feats).float()
            deltas = self.roi_heads.bbox_pred(feats).float()
            start = 0
            picks = []
            for j, i in enumerate(idx):
                sl = slice(start, start + props[j].shape[0])
                start = sl.stop
                if selector.given:
                    prob = torch.softmax(logits[sl], dim=-1)
                    score, label = prob[:, 1:].max(dim=1)
                    picks.append(
                        vinvl_select.VinVLPick(torch.arange(props[j].shape[0], device=dev), label + 1, score, props[j])
                    )
                else:
                    picks.append(vinvl_select.select(props[j], logits[sl], deltas[sl], (h, w), recipe, self.spec))
                picks[-1].rows = picks[-1].rows + sl.start
            attrs = self._attributes(
                feat, feats, picks, recipe, reuse=selector.given or bool(recipe.ignore_box_regression)
            )
            for j, i in enumerate(idx):
                fields[i] = self._fields(picks[j], feats, attrs[j], frames[i])
        return records_to_host(fields, [(f.width, f.height) for f in frames])  # one copy for the batch

    def _attributes(self, feat, feats, picks, recipe, reuse: bool) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        head = self.roi_heads.attribute
        if head is None:
            return [None] * len(picks)
        pooled = (
            feats[torch.cat([p.rows for p in picks])] if reuse else self.box_features(feat, [p.boxes for p in picks])
        )
        logits = head(pooled, torch.cat([p.labels for p in picks]))
        out, start = [], 0
        for p in picks:
            n = p.rows.numel()
            out.append(
                vinvl_select.attribute_top(logits[start : start + n], recipe.attr_thresh, recipe.max_attrs_per_image)
            )
            start += n
        return out

    def _fields(self, pick, feats, attr, frame: Frame) -> dict[str, torch.Tensor | None]:
        """One image's region fields on the device (:func:`extractors.to_host.records_to_host` copies the batch)."""
        return {
            "features": feats[pick.rows],
            "boxes": to_original(pick.boxes.float(), frame, "per-axis", "none"),
            "class_ids": pick.labels - 1,
            "class_scores": pick.scores,
            "attr_ids": None if attr is None else attr[0] - 1,
            "attr_scores": None if attr is None else attr[1],
        }
