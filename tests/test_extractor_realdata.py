"""Preprocessing and output conventions against the real Caffe rows in ../shared/data (data/README.md)."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from extract_helpers import read_obj36, read_trainval36

from extractors.preprocess import caffe_blob, compute_scale, load_rgb
from extractors.selector import clamp_selection


@pytest.fixture(scope="module")
def obj36(shared_data):
    return read_obj36(shared_data / "butd" / "caffe_obj36_train2014.tsv")


def test_scale_rule_600_1000():
    assert compute_scale(480, 640) == 1.25  # 640x480 -> 600x800
    assert compute_scale(333, 500) == pytest.approx(600 / 333)
    assert compute_scale(360, 640) == 1000 / 640  # 600/360*640 = 1066.7 > 1000: capped by the long side
    assert compute_scale(100, 167) == 1000 / 167  # 6 * 167 = 1002 > 1000: capped
    assert compute_scale(100, 166) == 6.0  # 996 <= 1000: shortest side rule
    # the cap compares the *rounded* long side: 600 * 902 / 541 = 1000.37 rounds to 1000, so no cap
    assert compute_scale(541, 902) == 600 / 541


def test_fixture_sizes_scales_and_caffe_box_clipping(shared_data, obj36):
    """Image sizes equal the photos'; every row's largest x2 (y2) is exactly (W' - 1) / scale (H' - 1), the
    Caffe clip in the resized blob divided by our scale -> our scale and resized size equal Caffe's."""
    assert len(obj36) == 10
    for row in obj36:
        rgb = load_rgb(shared_data / "photos" / f"{row['img_id']}.jpg")
        assert rgb.shape[:2] == (row["img_h"], row["img_w"])
        blob, scale = caffe_blob(rgb)
        assert blob.dtype == np.float32 and min(blob.shape[1:]) <= 600 and max(blob.shape[1:]) <= 1000
        assert 600 in blob.shape[1:] or 1000 in blob.shape[1:]
        boxes = row["boxes"]
        assert boxes.dtype == np.float32 and boxes.shape == (36, 4)
        assert (boxes[:, 0] >= 0).all() and (boxes[:, 1] >= 0).all()
        assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
        x_edge = (blob.shape[2] - 1) / scale
        y_edge = (blob.shape[1] - 1) / scale
        assert boxes[:, 2].max() == pytest.approx(x_edge, abs=2e-4)
        assert boxes[:, 3].max() == pytest.approx(y_edge, abs=2e-4)
        assert (boxes[:, 2] <= x_edge + 2e-4).all() and (boxes[:, 3] <= y_edge + 2e-4).all()
        assert boxes[:, 2].max() <= row["img_w"] and boxes[:, 3].max() <= row["img_h"]
    first = obj36[0]
    assert first["img_id"] == "COCO_train2014_000000132417" and boxes.max() < 640
    assert first["boxes"][:, 2].max() == pytest.approx(499.5, abs=1e-4)
    assert (first["objects_id"] < 1600).all() and (first["attrs_id"] < 400).all()


def test_trainval36_row(shared_data):
    (row,) = read_trainval36(shared_data / "butd" / "caffe_trainval36_150367.tsv")
    rgb = load_rgb(shared_data / "photos" / "COCO_train2014_000000150367.jpg")
    blob, scale = caffe_blob(rgb)
    assert (row["image_w"], row["image_h"]) == (rgb.shape[1], rgb.shape[0]) == (640, 480)
    assert blob.shape == (3, 600, 800) and scale == 1.25
    assert row["boxes"][:, 2].max() == pytest.approx((800 - 1) / 1.25, abs=1e-4)
    assert row["boxes"][:, 3].max() == pytest.approx((600 - 1) / 1.25, abs=1e-4)
    assert row["boxes"][0].tolist() == pytest.approx([0, 277.6827, 583.3728, 479.2], abs=1e-3)


def test_blob_is_bgr_mean_subtracted_before_linear_resize(shared_data):
    rgb = load_rgb(shared_data / "photos" / "COCO_train2014_000000084002.jpg")
    blob, scale = caffe_blob(rgb)
    bgr = cv2.imread(str(shared_data / "photos" / "COCO_train2014_000000084002.jpg")).astype(np.float32)
    bgr -= np.array([102.9801, 115.9465, 122.7717], np.float32)
    want = cv2.resize(bgr, None, None, fx=1.25, fy=1.25, interpolation=cv2.INTER_LINEAR).transpose(2, 0, 1)
    # PIL and OpenCV decode baseline JPEGs with the same IDCT up to +-1 grey level
    assert np.abs(blob - want).mean() < 0.5 and blob.shape == want.shape
    assert abs(float(blob[0].mean()) - float(rgb[:, :, 2].mean() - 102.9801)) < 0.5  # channel 0 = blue


def test_real_class_scores_under_the_selection_rule(obj36):
    """The obj36 rows are 36-box Caffe outputs: the clamp returns 36 ids for any confidence vector, and the rows
    whose class confidences are all >= 0.2 keep proposal (not score) order as generate_tsv does."""
    for row in obj36:
        import torch

        conf = torch.from_numpy(row["objects_conf"].copy())
        keep = clamp_selection(conf, 0.2, 36, 36)
        assert keep.numel() == 36 and sorted(keep.tolist()) == list(range(36))
        if (conf >= 0.2).all():
            assert keep.tolist() == list(range(36))
        else:
            assert (conf[keep][:-1] >= conf[keep][1:]).all()
    assert any(not np.all(np.diff(r["objects_conf"]) <= 0) for r in obj36)  # stored rows are not score-sorted
