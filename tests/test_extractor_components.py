"""Every detector component against its definition on small inputs (docs/extractor.md)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from extract_helpers import tiny_spec

from extractors import box_coding, selector
from extractors.anchors import caffe_cell_anchors, d2_cell_anchors, grid_anchors
from extractors.bottom_up import CAFFE_PARTS, BottomUpDetector, c4_backbone
from extractors.box_head import Res5ROIHeads
from extractors.random_weights import random_detector
from extractors.resnet_caffe import BasicStem, ConvNorm, ResNetC4
from extractors.rpn import DetectronRPN

CAFFE_TABLE = [
    [-38, -16, 53, 31],
    [-84, -40, 99, 55],
    [-176, -88, 191, 103],
    [-360, -184, 375, 199],
    [-24, -24, 39, 39],
    [-56, -56, 71, 71],
    [-120, -120, 135, 135],
    [-248, -248, 263, 263],
    [-14, -36, 29, 51],
    [-36, -80, 51, 95],
    [-80, -168, 95, 183],
    [-168, -344, 183, 359],
]


def test_caffe_anchors_equal_the_published_table():
    a = caffe_cell_anchors(16, (0.5, 1.0, 2.0), (4, 8, 16, 32))
    assert a.tolist() == [[float(v) for v in row] for row in CAFFE_TABLE]
    wh = (a[:, 2:] - a[:, :2] + 1).tolist()
    assert wh[0] == [92, 48] and wh[4] == [64, 64] and wh[11] == [352, 704]


def test_d2_anchors_are_size_major_and_centred_at_zero():
    a = d2_cell_anchors()
    assert a.shape == (12, 4)
    assert torch.allclose(a[0], torch.tensor([-45.2548, -22.6274, 45.2548, 22.6274]), atol=1e-3)
    assert torch.allclose(a[:, :2] + a[:, 2:], torch.zeros(12, 2), atol=1e-4)
    assert torch.allclose((a[3::3, 2] - a[3::3, 0]) / (a[0:9:3, 2] - a[0:9:3, 0]), torch.full((3,), 2.0))


def test_grid_anchor_order_is_h_w_a_with_a_fastest():
    cell = caffe_cell_anchors()
    g = grid_anchors(cell, 3, 5, 16)
    assert g.shape == (3 * 5 * 12, 4)
    # anchor index (h, w, a) = (h * W + w) * A + a, shifted by (16 w, 16 h)
    h, w, a = 2, 3, 7
    assert (
        g[(h * 5 + w) * 12 + a].tolist() == (cell[a] + torch.tensor([16.0 * w, 16.0 * h, 16.0 * w, 16.0 * h])).tolist()
    )


def test_legacy_box_coding_matches_py_faster_rcnn_and_roundtrips_with_its_plus_one():
    g = torch.Generator().manual_seed(0)
    src = torch.rand(50, 2, generator=g) * 300
    src = torch.cat([src, src + 5 + torch.rand(50, 2, generator=g) * 200], 1)
    tgt = src + torch.randn(50, 4, generator=g) * 10
    tgt[:, 2:] = torch.maximum(tgt[:, 2:], tgt[:, :2] + 2)
    d = box_coding.encode(src, tgt, legacy=True)
    # encode definition (+1 widths, centre x1 + 0.5 w)
    sw = src[:, 2] - src[:, 0] + 1
    tw = tgt[:, 2] - tgt[:, 0] + 1
    assert torch.allclose(d[:, 0], ((tgt[:, 0] + 0.5 * tw) - (src[:, 0] + 0.5 * sw)) / sw, atol=1e-5)
    assert torch.allclose(d[:, 2], torch.log(tw / sw), atol=1e-5)
    back = box_coding.decode(d, src, legacy=True)
    # bbox_transform_inv writes x2 = ctr + 0.5 w (no -1): decoding a +1 encoding lands one pixel further
    assert torch.allclose(back, tgt + torch.tensor([0.0, 0.0, 1.0, 1.0]), atol=1e-3)
    # zero deltas give the anchor shifted by one at x2/y2 (the Caffe quirk), weighted deltas divide
    z = box_coding.decode(torch.zeros(1, 4), torch.tensor([[0.0, 0.0, 15.0, 15.0]]), legacy=True)
    assert z.tolist() == [[0.0, 0.0, 16.0, 16.0]]
    w = (10.0, 10.0, 5.0, 5.0)
    assert torch.allclose(box_coding.decode(d * torch.tensor(w), src, w, legacy=True), back, atol=1e-3)


def test_d2_box_coding_roundtrips_exactly_and_clamps():
    src = torch.tensor([[10.0, 20.0, 110.0, 70.0], [0.0, 0.0, 5.0, 9.0]])
    tgt = torch.tensor([[12.0, 18.0, 150.0, 90.0], [1.0, 2.0, 4.0, 30.0]])
    w = (10.0, 10.0, 5.0, 5.0)
    d = box_coding.encode(src, tgt, w, legacy=False)
    assert torch.allclose(box_coding.decode(d, src, w, legacy=False), tgt, atol=1e-4)
    big = box_coding.decode(
        torch.tensor([[0.0, 0.0, 100.0, 0.0]]), torch.tensor([[0.0, 0.0, 16.0, 16.0]]), legacy=False
    )
    assert math.isclose(float(big[0, 2] - big[0, 0]), 1000.0, rel_tol=1e-4)  # exp(log(1000/16)) * 16


def test_clip_conventions():
    b = torch.tensor([[-5.0, -3.0, 900.0, 700.0]])
    assert box_coding.clip(b, 600, 800, legacy=True).tolist() == [[0.0, 0.0, 799.0, 599.0]]
    assert box_coding.clip(b, 600, 800, legacy=False).tolist() == [[0.0, 0.0, 800.0, 600.0]]


def _cpu_nms(dets: np.ndarray, scores: np.ndarray, thresh: float) -> list[int]:
    """Direct transcription of Caffe ``cpu_nms`` semantics (+1 areas, suppress when ovr >= thresh)."""
    x1, y1, x2, y2 = dets.T.astype(np.float64)
    areas = (x2 - x1 + 1) * (y2 - y1 + 1)
    order = np.argsort(-scores, kind="stable")
    suppressed = np.zeros(len(dets), bool)
    keep = []
    for i in order:
        if suppressed[i]:
            continue
        keep.append(int(i))
        for j in order:
            if suppressed[j] or j == i:
                continue
            w = max(0.0, min(x2[i], x2[j]) - max(x1[i], x1[j]) + 1)
            h = max(0.0, min(y2[i], y2[j]) - max(y1[i], y1[j]) + 1)
            inter = w * h
            if inter / (areas[i] + areas[j] - inter) >= thresh:
                suppressed[j] = True
    return keep


def test_legacy_nms_equals_caffe_cpu_nms_including_the_equality_case():
    g = np.random.default_rng(1)
    for _ in range(5):
        xy = g.uniform(0, 200, (60, 2))
        boxes = np.concatenate([xy, xy + g.uniform(5, 120, (60, 2))], 1).astype(np.float32)
        scores = g.permutation(60).astype(np.float32)
        got = box_coding.nms_boxes(torch.from_numpy(boxes), torch.from_numpy(scores), 0.3, legacy=True).tolist()
        assert sorted(got) == sorted(_cpu_nms(boxes, scores, 0.3))
    # two 10x10 (+1 convention) boxes overlapping by exactly 1/3 of the union (IoU = 0.5): Caffe suppresses
    boxes = torch.tensor([[0.0, 0.0, 9.0, 9.0], [0.0, 0.0, 9.0, 4.0]])  # areas 100, 50, inter 50 -> IoU 0.5
    assert box_coding.nms_boxes(boxes, torch.tensor([1.0, 0.5]), 0.5, legacy=True).tolist() == [0]
    assert box_coding.nms_boxes(boxes, torch.tensor([1.0, 0.5]), 0.5, legacy=False).tolist() == [0, 1]


def _caffe_roi_pool(feat: np.ndarray, roi: np.ndarray, ph: int, pw: int, scale: float) -> np.ndarray:
    """Direct transcription of Caffe ``ROIPoolForward`` for one RoI."""
    c, h, w = feat.shape
    rs_w, rs_h = int(round(roi[0] * scale)), int(round(roi[1] * scale))
    re_w, re_h = int(round(roi[2] * scale)), int(round(roi[3] * scale))
    rh, rw = max(re_h - rs_h + 1, 1), max(re_w - rs_w + 1, 1)
    bh, bw = rh / ph, rw / pw
    out = np.zeros((c, ph, pw), np.float32)
    for i in range(ph):
        for j in range(pw):
            hs = min(max(int(math.floor(i * bh)) + rs_h, 0), h)
            he = min(max(int(math.ceil((i + 1) * bh)) + rs_h, 0), h)
            ws = min(max(int(math.floor(j * bw)) + rs_w, 0), w)
            we = min(max(int(math.ceil((j + 1) * bw)) + rs_w, 0), w)
            if he > hs and we > ws:
                out[:, i, j] = feat[:, hs:he, ws:we].reshape(c, -1).max(1)
    return out


def test_roi_pool_matches_the_caffe_definition():
    spec = tiny_spec()
    heads = Res5ROIHeads(spec, spec.c4_channels)
    g = torch.Generator().manual_seed(3)
    feat = torch.randn(2, spec.c4_channels, 20, 30, generator=g)
    rois = torch.tensor(
        [
            [0, 0.0, 0.0, 100.0, 60.0],
            [1, 37.3, 12.9, 250.2, 301.7],
            [0, 400.0, 300.0, 470.0, 330.0],
            [1, 5.0, 5.0, 6.0, 7.0],
        ]
    )
    got = heads.pool(feat, rois).numpy()
    assert got.shape == (4, spec.c4_channels, 14, 14)
    for k, r in enumerate(rois.numpy()):
        want = _caffe_roi_pool(feat[int(r[0])].numpy(), r[1:], 14, 14, 1 / 16)
        np.testing.assert_allclose(got[k], want, rtol=0, atol=0)


def test_dilated_res5_keeps_14x14_and_stride_sits_on_the_1x1_conv():
    spec = tiny_spec(res5_blocks=2)
    heads = Res5ROIHeads(spec, spec.c4_channels)
    x = torch.randn(3, spec.c4_channels, 14, 14)
    y = heads.res5(x)
    assert y.shape == (3, spec.feature_dim, 14, 14)
    b0 = heads.res5[0]
    assert (b0.conv1.stride, b0.conv2.stride, b0.conv2.dilation, b0.conv2.padding) == (1, 1, 2, 2)
    undilated = Res5ROIHeads(spec.with_(res5_dilation=1), spec.c4_channels)
    assert undilated.res5(x).shape[-2:] == (7, 7)
    bb = ResNetC4((2, 2, 2), 8, 4)
    assert (bb.res3[0].conv1.stride, bb.res3[0].conv2.stride, bb.res3[0].shortcut.stride) == (2, 1, 2)
    assert bb.res3[1].shortcut is None


@pytest.mark.parametrize("h,w", [(600, 800), (601, 999), (333, 500)])
def test_stem_uses_caffe_ceil_mode_pooling(h, w):
    stem = BasicStem(8)
    out = stem(torch.zeros(1, 3, h, w))
    conv = lambda n: (n + 2 * 3 - 7) // 2 + 1  # noqa: E731
    pool = lambda n: math.ceil((n - 3) / 2) + 1  # noqa: E731  (Caffe pooling_layer.cpp, pad 0)
    assert tuple(out.shape[-2:]) == (pool(conv(h)), pool(conv(w)))


def test_frozen_bn_and_its_folding_are_the_caffe_batchnorm_scale():
    cn = ConvNorm(4, 6, 3, padding=1)
    g = torch.Generator().manual_seed(5)
    cn.norm.running_mean.copy_(torch.randn(6, generator=g))
    cn.norm.running_var.copy_(torch.rand(6, generator=g) + 0.1)
    cn.norm.weight.copy_(torch.randn(6, generator=g))
    cn.norm.bias.copy_(torch.randn(6, generator=g))
    x = torch.randn(2, 4, 9, 9, generator=g)
    y = F.conv2d(x, cn.weight, padding=1)
    n = cn.norm
    want = (y - n.running_mean.view(1, -1, 1, 1)) / torch.sqrt(n.running_var.view(1, -1, 1, 1) + 1e-5) * n.weight.view(
        1, -1, 1, 1
    ) + n.bias.view(1, -1, 1, 1)
    assert torch.allclose(cn(x), want, atol=1e-5)
    cn.fold()
    assert torch.allclose(cn(x), want, atol=1e-4)


def test_attribute_head_uses_argmax_class_embedding_including_background():
    spec = tiny_spec()
    model = random_detector(spec, seed=1)
    pred = model.roi_heads.box_predictor
    x = torch.rand(7, spec.feature_dim)
    logits, deltas, attr = pred(x)
    assert logits.shape == (7, 21) and deltas.shape == (7, 21 * 4) and attr.shape == (7, 11)
    labels = logits.argmax(1)
    h = torch.cat([x, pred.cls_embed.weight[labels]], 1)
    want = F.linear(
        F.relu(F.linear(h, pred.attr_linear1.weight, pred.attr_linear1.bias)),
        pred.attr_linear2.weight,
        pred.attr_linear2.bias,
    )
    assert torch.allclose(attr, want, atol=1e-5)
    probs = model.attr_probs(attr)
    assert torch.allclose(probs, torch.softmax(attr, 1)[:, 1:])  # caffe: softmax over 401, "no attribute" dropped


def _random_case(g: torch.Generator, r: int, k: int):
    xy = torch.rand(r, 2, generator=g) * 500
    boxes = torch.cat([xy, xy + 10 + torch.rand(r, 2, generator=g) * 300], 1)
    scores = torch.softmax(torch.randn(r, k + 1, generator=g) * 3, 1)[:, 1:]
    return boxes, scores


@pytest.mark.parametrize("r,k,t", [(1, 3, 0.3), (17, 5, 0.3), (64, 40, 0.5), (65, 7, 0.3), (130, 20, 0.1)])
def test_vectorized_per_class_nms_equals_the_loop(r, k, t):
    g = torch.Generator().manual_seed(r * 31 + k)
    boxes, scores = _random_case(g, r, k)
    torch.testing.assert_close(
        selector.max_conf_vectorized(boxes, scores, t), selector.max_conf_loop(boxes, scores, t), rtol=0, atol=0
    )


def test_vectorized_nms_equals_the_loop_at_real_size_300x1600_and_batched():
    g = torch.Generator().manual_seed(7)
    b1, s1 = _random_case(g, 300, 1600)
    b2, s2 = _random_case(g, 250, 1600)
    loop1 = selector.max_conf_loop(b1, s1, 0.3)
    loop2 = selector.max_conf_loop(b2, s2, 0.3)
    boxes = torch.zeros(2, 300, 4)
    scores = torch.zeros(2, 300, 1600)
    boxes[0], scores[0] = b1, s1
    boxes[1, :250], scores[1, :250] = b2, s2
    valid = torch.zeros(2, 300, dtype=torch.bool)
    valid[0] = True
    valid[1, :250] = True
    got = selector.max_conf_vectorized(boxes, scores, 0.3, valid)
    torch.testing.assert_close(got[0], loop1, rtol=0, atol=0)
    torch.testing.assert_close(got[1, :250], loop2, rtol=0, atol=0)
    assert (got[1, 250:] == 0).all()
    assert (loop1 > 0).sum() > 100  # a non-trivial case: many proposals survive in some class


def test_selection_threshold_and_clamps():
    conf = torch.tensor([0.1, 0.5, 0.19999, 0.2, 0.9, 0.05])
    assert selector.clamp_selection(conf, 0.2, 1, 100).tolist() == [1, 3, 4]  # in range: proposal order, >= 0.2
    assert selector.clamp_selection(conf, 0.2, 5, 100).tolist() == [4, 1, 3, 2, 0]  # too few: top 5 by score
    assert selector.clamp_selection(conf, 0.2, 1, 2).tolist() == [4, 1]  # too many: top 2
    many = torch.linspace(0.21, 0.99, 150)
    assert selector.clamp_selection(many, 0.2, 10, 100).numel() == 100
    assert selector.clamp_selection(many, 0.2, 36, 36).numel() == 36
    assert selector.clamp_selection(torch.full((300,), 0.01), 0.2, 10, 100).numel() == 10
    assert selector.clamp_selection(torch.full((300,), 0.01), 0.2, 36, 36).numel() == 36


def test_maxnms_picks_best_class_box_and_relaxes_threshold():
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0], [50.0, 50.0, 60.0, 60.0]])
    cls_boxes = torch.stack([boxes, boxes + 100], 1)  # (R, K=2, 4)
    scores = torch.tensor([[0.9, 0.1], [0.2, 0.7], [0.3, 0.4]])
    keep, kept_boxes = selector.maxnms_select(cls_boxes, scores, 2, 36)
    assert keep.tolist() == [0, 1, 2]  # score order 0.9, 0.7, 0.4; no overlap between the chosen boxes
    assert torch.equal(kept_boxes[0], boxes[0])  # class 0 is best for proposal 0
    assert torch.equal(kept_boxes[1], boxes[1] + 100)  # class 1 box for proposal 1
    keep, _ = selector.maxnms_select(torch.stack([boxes, boxes], 1), scores, 3, 36)
    assert keep.numel() == 3  # 0 and 1 overlap (IoU 0.68): only a threshold >= 0.7 keeps both


def _proposal_layer_reference(fg, deltas, anchors, im_h, im_w, scale, pre, post, thresh, min_size=16):
    """numpy transcription of py-faster-rcnn ``ProposalLayer.forward`` (test mode) on flat (h, w, a) arrays."""
    w = anchors[:, 2] - anchors[:, 0] + 1.0
    h = anchors[:, 3] - anchors[:, 1] + 1.0
    cx, cy = anchors[:, 0] + 0.5 * w, anchors[:, 1] + 0.5 * h
    pcx, pcy = deltas[:, 0] * w + cx, deltas[:, 1] * h + cy
    pw, ph = np.exp(deltas[:, 2]) * w, np.exp(deltas[:, 3]) * h
    boxes = np.stack([pcx - 0.5 * pw, pcy - 0.5 * ph, pcx + 0.5 * pw, pcy + 0.5 * ph], 1)
    boxes[:, 0::2] = boxes[:, 0::2].clip(0, im_w - 1)
    boxes[:, 1::2] = boxes[:, 1::2].clip(0, im_h - 1)
    ms = min_size * scale
    keep = ((boxes[:, 2] - boxes[:, 0] + 1) >= ms) & ((boxes[:, 3] - boxes[:, 1] + 1) >= ms)
    boxes, fg = boxes[keep], fg[keep]
    order = np.argsort(-fg, kind="stable")[:pre]
    boxes, fg = boxes[order], fg[order]
    kept = _cpu_nms(boxes, fg, thresh)[:post]
    return boxes[kept]


def test_rpn_softmax_objectness_and_proposals_follow_the_caffe_proposal_layer():
    from extractors.rpn import RPN

    spec = tiny_spec(pre_nms_topk=200, post_nms_topk=40)
    rpn = RPN(spec, spec.c4_channels)
    g = torch.Generator().manual_seed(11)
    fh, fw, a = 6, 9, spec.num_anchors
    logits = torch.randn(1, 2 * a, fh, fw, generator=g) * 2
    deltas = torch.randn(1, 4 * a, fh, fw, generator=g) * 0.3

    def head(_x):
        return logits, deltas

    rpn.rpn_head.forward = head  # feed known head outputs through the real proposal code
    scores, flat = rpn.scores_and_deltas(torch.zeros(1, spec.c4_channels, fh, fw))
    # channel a is background, channel A + a foreground, for anchor a at cell (h, w)
    h, w, k = 4, 2, 5
    want = torch.softmax(torch.stack([logits[0, k, h, w], logits[0, a + k, h, w]]), 0)[1]
    assert torch.isclose(scores[0, (h * fw + w) * a + k], want)
    assert torch.equal(flat[0, (h * fw + w) * a + k], deltas[0, 4 * k : 4 * k + 4, h, w])
    im_h, im_w, scale = 90, 140, 0.6
    got = rpn(torch.zeros(1, spec.c4_channels, fh, fw), [(im_h, im_w)], [scale])[0]
    anchors = grid_anchors(rpn.anchor_generator.cell_anchors[0], fh, fw, 16).numpy()
    ref = _proposal_layer_reference(scores[0].numpy(), flat[0].numpy(), anchors, im_h, im_w, scale, 200, 40, 0.7)
    assert got.shape == ref.shape and got.shape[0] > 5
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-3)


def test_the_bottom_up_detector_is_built_from_the_parts_it_is_given():
    """Backbone, proposal stage and box head come from the ``BottomUpParts`` passed in, in that order; the
    release's own parts give the same state-dict keys and shapes as the detector built from the spec alone."""
    calls = []

    def backbone(spec):
        calls.append("backbone")
        return c4_backbone(spec)

    def head(spec, in_channels):
        calls.append(("box_head", in_channels))
        return Res5ROIHeads(spec, in_channels)

    spec = tiny_spec()
    parts = dataclasses.replace(CAFFE_PARTS, backbone=backbone, box_head=head, proposals=DetectronRPN)
    det = BottomUpDetector(spec, parts)
    assert calls == ["backbone", ("box_head", det.backbone.out_channels)]
    assert type(det.proposal_generator) is DetectronRPN and det.parts is parts
    plain = BottomUpDetector(spec).state_dict()
    given = BottomUpDetector(spec, CAFFE_PARTS).state_dict()
    assert [(k, tuple(v.shape)) for k, v in plain.items()] == [(k, tuple(v.shape)) for k, v in given.items()]
