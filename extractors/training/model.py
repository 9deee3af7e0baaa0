"""The training forward pass of the bottom-up Faster R-CNN and its four losses (+ the attribute loss).

:class:`DetectorForTraining` wraps a :class:`~extractors.bottom_up.BottomUpDetector` (same modules, same
state-dict keys under ``detector.``) and returns the losses of ``train.prototxt`` of the bottom-up model:

* ``rpn_cls``: 2-way softmax cross-entropy over the sampled anchors (Caffe ``SoftmaxWithLoss``, ignore -1,
  normalised by the number of sampled anchors);
* ``rpn_box``: smooth-L1 with sigma 3 on the positive anchors' raw deltas, summed and divided by the number
  of sampled anchors (``RPN_POSITIVE_WEIGHT = -1``);
* ``cls``: softmax cross-entropy over the sampled RoIs (background = 0);
* ``box``: smooth-L1 (sigma 1) on the ground-truth class's normalised deltas of the foreground RoIs, summed
  and divided by the number of sampled RoIs (Caffe ``SmoothL1Loss`` normalises by the batch);
* ``attr`` (weight 0.5 in ``train.prototxt``): the attribute head of Anderson et al. 2018 §3.1 on the
  foreground RoIs, fed with the embedding of the *ground-truth* class (``cls_embedding`` reads
  ``foreground_labels``); the target is uniform over the object's attributes ("no attribute", index 0, when
  it has none), i.e. the mean of one cross-entropy per attribute, normalised by the foreground RoIs.
  (Caffe's label layout for several attributes per object is not public; this multi-label form is the one
  the MILVLG port uses: per-box weights 1/n_attributes.)

Smooth-L1 with sigma s is ``F.smooth_l1_loss`` with ``beta = 1 / s^2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.detection._utils import BalancedPositiveNegativeSampler

from extractors.bottom_up import BottomUpDetector
from extractors.training.data import TrainImage
from extractors.training.targets import SamplingConfig, anchor_targets, sample_rois


@dataclass(frozen=True)
class LossConfig:
    """The ``loss`` section of a ``train_detector`` config: smooth-L1 sigmas (RPN, box head) and the attribute
    loss weight (bottom-up ``train.prototxt``)."""

    rpn_smooth_l1_sigma: float = 3.0
    smooth_l1_sigma: float = 1.0
    attr_loss_weight: float = 0.5


class DetectorForTraining(nn.Module):
    """``forward(images, sizes, targets) -> {loss name: scalar}`` for a detector built from the Caffe parts
    (``detector.trainable``: softmax RPN, ``+1`` boxes, background first)."""

    def __init__(self, detector: BottomUpDetector, sampling: SamplingConfig, losses: LossConfig) -> None:
        super().__init__()
        if not detector.trainable:
            raise ValueError("detector training implements the Caffe flavor (softmax RPN, +1 boxes, background first)")
        self.detector = detector
        self.sampling = sampling
        self.losses = losses
        self.rpn_sampler = BalancedPositiveNegativeSampler(sampling.rpn_batch_size, sampling.rpn_positive_fraction)
        self.roi_sampler = BalancedPositiveNegativeSampler(sampling.roi_batch_size, sampling.roi_positive_fraction)

    def forward(
        self, images: torch.Tensor, sizes: list[tuple[int, int]], batch: list[TrainImage]
    ) -> dict[str, torch.Tensor]:
        det = self.detector
        spec = det.spec
        feat = det.backbone(images)
        rpn = det.proposal_generator
        logits, deltas = rpn.rpn_head(feat)
        n, _, fh, fw = logits.shape
        a = spec.num_anchors
        # (N, 2, A, H, W) -> (N, H*W*A, 2): the (h, w, a) anchor order of the proposal layer
        rpn_logits = logits.float().view(n, 2, a, fh, fw).permute(0, 3, 4, 2, 1).reshape(n, -1, 2)
        rpn_deltas = deltas.float().view(n, a, 4, fh, fw).permute(0, 3, 4, 1, 2).reshape(n, -1, 4)
        anchors = rpn.anchor_generator(fh, fw)
        gts = [im.boxes.to(images.device) for im in batch]

        # --- RPN losses
        lab_list, tgt_list = [], []
        with torch.no_grad():
            for i in range(n):
                lab, tgt = anchor_targets(anchors, gts[i], sizes[i], self.sampling, self.rpn_sampler)
                lab_list.append(lab)
                tgt_list.append(tgt)
        rpn_labels = torch.stack(lab_list)
        rpn_targets = torch.stack(tgt_list)
        sampled = rpn_labels >= 0
        num_sampled = max(int(sampled.sum()), 1)
        loss_rpn_cls = F.cross_entropy(rpn_logits[sampled], rpn_labels[sampled], reduction="sum") / num_sampled
        pos = rpn_labels == 1
        beta = 1.0 / self.losses.rpn_smooth_l1_sigma**2
        loss_rpn_box = F.smooth_l1_loss(rpn_deltas[pos], rpn_targets[pos], beta=beta, reduction="sum") / num_sampled

        # --- proposals (no gradient) and RoI sampling
        with torch.no_grad():
            probs = torch.softmax(rpn_logits.detach(), dim=2)[..., 1]
            rois_list, samples = [], []
            for i in range(n):
                props = rpn._select(
                    probs[i],
                    rpn_deltas[i].detach(),
                    anchors,
                    sizes[i],
                    batch[i].scale,
                    pre_nms_topk=self.sampling.rpn_pre_nms_topk,
                    post_nms_topk=self.sampling.rpn_post_nms_topk,
                )
                s = sample_rois(
                    props,
                    gts[i],
                    batch[i].labels.to(images.device),
                    batch[i].attributes.to(images.device),
                    self.sampling,
                    self.roi_sampler,
                )
                samples.append(s)
                rois_list.append(
                    torch.cat([torch.full((s.rois.shape[0], 1), float(i), device=images.device), s.rois], 1)
                )
        rois = torch.cat(rois_list)
        labels = torch.cat([s.labels for s in samples])
        box_targets = torch.cat([s.deltas for s in samples])
        fg_mask = torch.cat([torch.arange(s.rois.shape[0], device=images.device) < s.num_fg for s in samples])

        # --- RoI head
        heads = det.roi_heads
        pooled = heads.pool(feat, rois)
        x = heads.res5(pooled).mean(dim=(2, 3))
        pred = heads.box_predictor
        cls_logits = pred.cls_score(x).float()
        box_deltas = pred.bbox_pred(x).float()
        num_rois = max(labels.numel(), 1)
        loss_cls = F.cross_entropy(cls_logits, labels, reduction="sum") / num_rois
        fg_idx = torch.nonzero(fg_mask).flatten()
        fg_labels = labels[fg_idx]
        cols = fg_labels[:, None] * 4 + torch.arange(4, device=labels.device)[None, :]
        fg_deltas = box_deltas[fg_idx[:, None], cols]
        loss_box = (
            F.smooth_l1_loss(fg_deltas, box_targets[fg_idx], beta=1.0 / self.losses.smooth_l1_sigma**2, reduction="sum")
            / num_rois
        )
        out = {"rpn_cls": loss_rpn_cls, "rpn_box": loss_rpn_box, "cls": loss_cls, "box": loss_box}
        if pred.has_attributes:
            out["attr"] = self.losses.attr_loss_weight * self._attribute_loss(
                pred, x[fg_idx], fg_labels, torch.cat([s.attributes for s in samples])[fg_idx]
            )
        return out

    @staticmethod
    def _attribute_loss(pred, x_fg: torch.Tensor, fg_labels: torch.Tensor, fg_attrs: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the attribute softmax against a uniform target over each object's attributes."""
        if x_fg.shape[0] == 0:
            return x_fg.sum() * 0.0
        h = torch.cat([x_fg, pred.cls_embed(fg_labels).to(x_fg.dtype)], dim=1)
        logits = pred.attr_linear2(F.relu(pred.attr_linear1(h))).float()
        valid = fg_attrs >= 0
        target = torch.zeros_like(logits)
        rows = torch.arange(fg_attrs.shape[0], device=logits.device)[:, None].expand_as(fg_attrs)
        target.index_put_(
            (rows[valid], fg_attrs[valid]), torch.ones(int(valid.sum()), device=logits.device), accumulate=True
        )
        none = ~valid.any(dim=1)
        target[none, 0] = 1.0
        target = target / target.sum(dim=1, keepdim=True)
        return -(target * F.log_softmax(logits, dim=1)).sum(dim=1).mean()
