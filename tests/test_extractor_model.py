"""The assembled detector on real photos with small random weights: outputs, selection, batching, modes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from extract_helpers import caffe_frames, selector_for, tiny_spec

from extractors.preprocess import load_rgb
from extractors.random_weights import random_detector

PHOTOS = [
    "COCO_train2014_000000084002.jpg",
    "COCO_train2014_000000150367.jpg",
    "COCO_train2014_000000131486.jpg",
    "000456.jpg",
]


@pytest.fixture(scope="module")
def inputs(shared_data):
    spec = tiny_spec()
    ims = [load_rgb(shared_data / "photos" / p) for p in PHOTOS]
    blobs, frames = caffe_frames(ims, spec)
    return blobs, frames, [im.shape[:2] for im in ims]


@pytest.fixture(scope="module")
def model():
    return random_detector(tiny_spec(), seed=0).fold_batchnorm()


def _check(out, size, n_range, spec):
    h, w = size
    n = out.boxes.shape[0]
    assert n_range[0] <= n <= n_range[1]
    assert out.features.shape == (n, spec.feature_dim) and out.features.dtype == np.float32
    assert out.boxes.dtype == np.float32 and np.isfinite(out.features).all() and (out.features >= 0).all()
    b = out.boxes
    assert (b[:, 0] >= 0).all() and (b[:, 1] >= 0).all() and (b[:, 2] <= w).all() and (b[:, 3] <= h).all()
    assert (b[:, 2] >= b[:, 0]).all() and (b[:, 3] >= b[:, 1]).all()
    assert (out.image_w, out.image_h) == (w, h)
    assert out.class_ids.dtype == np.int64 and ((0 <= out.class_ids) & (out.class_ids < spec.num_classes - 1)).all()
    assert out.attr_ids.dtype == np.int64 and ((0 <= out.attr_ids) & (out.attr_ids < spec.num_attributes - 1)).all()
    assert ((0 < out.class_scores) & (out.class_scores <= 1)).all() and (
        (0 < out.attr_scores) & (out.attr_scores <= 1)
    ).all()


def test_adaptive_and_fixed_36_outputs(model, inputs):
    blobs, scales, sizes = inputs
    adaptive = model.detect(blobs, scales, selector_for(model.spec, boxes="adaptive"))
    fixed = model.detect(blobs, scales, selector_for(model.spec, boxes="36"))
    for a, f, size in zip(adaptive, fixed, sizes):
        _check(a, size, (10, 100), model.spec)
        _check(f, size, (36, 36), model.spec)
    # the boxes are proposals / scale: x2 never exceeds (W' - 1) / scale (the Caffe clip)
    for out, blob, f in zip(adaptive, blobs, scales):
        assert out.boxes[:, 2].max() <= (blob.shape[2] - 1) / f.im_scale + 1e-3
    # tighter bounds change the count as the rule says
    few = model.detect(blobs[:1], scales[:1], selector_for(model.spec, min_boxes=3, max_boxes=5))
    assert 3 <= few[0].boxes.shape[0] <= 5


def test_threshold_decides_the_adaptive_count(model, inputs):
    blobs, scales, sizes = inputs
    lo = model.detect(blobs[:1], scales[:1], selector_for(model.spec, conf_thresh=0.0, min_boxes=1, max_boxes=1000))
    hi = model.detect(blobs[:1], scales[:1], selector_for(model.spec, conf_thresh=1.01, min_boxes=1, max_boxes=1000))
    assert lo[0].boxes.shape[0] == model.spec.post_nms_topk or lo[0].boxes.shape[0] > 1  # every proposal kept
    assert hi[0].boxes.shape[0] == 1  # none passes: the single best by max_conf


def test_deterministic_and_batch_equals_single(model, inputs):
    blobs, scales, sizes = inputs
    rule = selector_for(model.spec, boxes="adaptive")
    batch = model.detect(blobs, scales, rule)
    again = model.detect(blobs, scales, rule)
    for a, b in zip(batch, again):
        assert np.array_equal(a.features, b.features) and np.array_equal(a.boxes, b.boxes)
    assert tuple(blobs[0].shape) == tuple(blobs[1].shape)  # two 640x480 photos share one backbone pass
    for i in (0, 2):  # one image that shared its backbone pass, one alone in its size group
        (single,) = model.detect([blobs[i]], [scales[i]], rule)
        # same regions; numbers equal up to float rounding of a batched vs single convolution
        assert single.boxes.shape == batch[i].boxes.shape
        np.testing.assert_allclose(single.boxes, batch[i].boxes, rtol=0, atol=1e-2)
        np.testing.assert_allclose(single.features, batch[i].features, rtol=1e-3, atol=1e-4)
        assert np.array_equal(single.class_ids, batch[i].class_ids)


def test_given_boxes_mode_pools_the_supplied_boxes(model, inputs):
    blobs, scales, sizes = inputs
    given = [np.array([[0, 0, 100, 80], [50.5, 60.25, 300, 400], [10, 10, 11, 11]], np.float32)] * 2
    outs = model.detect(blobs[:2], scales[:2], selector_for(model.spec, boxes="given"), given)
    for o in outs:
        assert o.boxes.shape == (3, 4) and o.features.shape == (3, model.spec.feature_dim)
        np.testing.assert_allclose(o.boxes, given[0], rtol=1e-6)
    assert not np.allclose(outs[0].features[0], outs[0].features[1])


def test_d2_preset_runs_maxnms_on_regressed_boxes(inputs):
    spec = tiny_spec(flavor="d2", rpn_min_size=0.0, box_reg_weights=(10.0, 10.0, 5.0, 5.0))
    model = random_detector(spec, seed=2).fold_batchnorm()
    assert model.proposal_generator.rpn_head.objectness_logits.out_channels == spec.num_anchors
    assert model.roi_heads.box_predictor.bbox_pred.out_features == (spec.num_classes - 1) * 4
    blobs, scales, sizes = inputs
    outs = model.detect(blobs[:2], scales[:2], selector_for(spec, "airsplay", min_boxes=10))
    for o, size in zip(outs, sizes):
        _check(o, size, (10, 36), spec)
    probs = model.class_probs(
        torch.zeros(1, spec.num_classes).index_fill_(1, torch.tensor([spec.num_classes - 1]), 10.0)
    )
    assert probs.shape == (1, spec.num_classes - 1) and probs.max() < 0.01  # background is the last logit in d2
