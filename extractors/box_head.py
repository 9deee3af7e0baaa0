"""The RoI head: ROIPool 14x14 on C4, res5 (stride 1, dilation 2), mean pooling, and the predictors.

* ``roi_pool5`` (Caffe ROIPooling == torchvision ``roi_pool``; :mod:`extractors.roi_pool` for a deterministic
  CUDA backward): 14x14 max bins at ``1/16``.
* res5: ``res5_blocks`` bottlenecks; with dilation > 1 the first block has stride 1 and every 3x3 conv has
  dilation = pad = 2 (test.prototxt ``res5*_branch2b``), so a 14x14 RoI stays 14x14.
* ``pool5_flat``: global average over the 14x14 map -> the 2048-d region feature (non-negative: after ReLU).
* Predictor (``FastRCNNOutputLayers`` / ``BUACaffeFastRCNNOutputLayers``): ``cls_score`` (C logits),
  class-specific ``bbox_pred``, and the attribute head of Anderson et al. 2018 §3.1:
  ``a = softmax(W2 ReLU(W1 [f ; E[argmax_c s_c]] + b1) + b2)`` with E the 256-d class embedding (argmax over
  all C logits, background included, as the ``ArgMax`` layer of test.prototxt).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from extractors.resnet_caffe import make_res5
from extractors.roi_pool import roi_pool
from extractors.spec import BottomUpSpec


class BoxPredictor(nn.Module):
    """Classifier, class-specific regression and attribute predictor (MILVLG key names)."""

    def __init__(self, spec: BottomUpSpec, in_dim: int) -> None:
        super().__init__()
        self.cls_score = nn.Linear(in_dim, spec.num_classes)
        self.bbox_pred = nn.Linear(in_dim, spec.bbox_classes * 4)
        nn.init.normal_(self.cls_score.weight, std=0.01)
        nn.init.normal_(self.bbox_pred.weight, std=0.001)
        nn.init.zeros_(self.cls_score.bias)
        nn.init.zeros_(self.bbox_pred.bias)
        self.has_attributes = spec.has_attributes
        if spec.has_attributes:
            self.cls_embed = nn.Embedding(spec.num_classes, spec.attr_embed_dim)
            self.attr_linear1 = nn.Linear(in_dim + spec.attr_embed_dim, spec.attr_hidden)
            self.attr_linear2 = nn.Linear(spec.attr_hidden, spec.num_attributes)
            nn.init.normal_(self.attr_linear2.weight, std=0.01)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(class logits (R, C), box deltas (R, 4K), attribute logits (R, A) or None)."""
        logits = self.cls_score(x)
        deltas = self.bbox_pred(x)
        attr = None
        if self.has_attributes:
            labels = torch.argmax(logits, dim=1)
            h = torch.cat([x, self.cls_embed(labels).to(x.dtype)], dim=1)
            attr = self.attr_linear2(F.relu(self.attr_linear1(h)))
        return logits, deltas, attr


class Res5ROIHeads(nn.Module):
    """``roi_heads``: pooling + res5 + predictor."""

    def __init__(self, spec: BottomUpSpec, in_channels: int) -> None:
        super().__init__()
        self.spec = spec
        self.res5, out = make_res5(spec, in_channels)  # the Caffe R-101 backbone: no groups, stride on the 1x1
        self.out_channels = out
        self.box_predictor = BoxPredictor(spec, out)
        self.spatial_scale = 1.0 / spec.feature_stride

    def pool(self, feat: torch.Tensor, rois: torch.Tensor) -> torch.Tensor:
        """ROIPool (K, C, 14, 14); ``rois`` = (K, 5) ``[batch_index, x1, y1, x2, y2]`` in blob pixels."""
        r = self.spec.pooler_resolution
        if feat.dtype in (torch.float32, torch.float64):
            return roi_pool(feat, rois.to(feat.dtype), (r, r), self.spatial_scale)
        # max pooling is exact in any dtype; the CPU kernel has no bf16/fp16 version
        return roi_pool(feat.float(), rois.float(), (r, r), self.spatial_scale).to(feat.dtype)
