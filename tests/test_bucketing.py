"""Extraction batches of equal blob shape across the folder, written in input order (extractors.bucketing)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class _P:
    index: int
    blob: torch.Tensor


def test_shape_buckets_fill_by_shape_and_release_the_oldest_over_the_window() -> None:
    from extractors.bucketing import ShapeBuckets

    b = ShapeBuckets(batch_size=2, window=3)
    shapes = [(3, 4, 5), (3, 5, 4), (3, 4, 5), (3, 6, 6), (3, 7, 7), (3, 8, 8)]
    ready = [[p.index for p in g] for i, s in enumerate(shapes) for g in b.add(_P(i, torch.zeros(s)))]
    assert ready == [[0, 2], [1]]  # a full bucket; then 4 waiting > 3: the bucket of the oldest photo (1)
    assert [[p.index for p in g] for g in b.flush()] == [[3], [4], [5]] and len(b) == 0


def test_in_order_applies_each_outcome_once_in_input_order() -> None:
    from extractors.bucketing import InOrder

    seen: list = []
    o = InOrder([0, 1, 2, 3], lambda x: seen.append(x) or 1)
    o.put(2, "c")
    assert o.release() == 0 and seen == []
    o.put(0, "a")
    assert o.release() == 1 and seen == ["a"]
    o.put(3, "d")
    o.put(1, "b")
    assert o.release() == 3 and seen == ["a", "b", "c", "d"]


class _Store:
    """An in-memory writer with the store's has/add/commit (the run's only calls)."""

    def __init__(self) -> None:
        self.path, self.records, self.order = Path("mem"), {}, []

    def has(self, key: str) -> bool:
        return key in self.records

    def add(self, key: str, rec) -> None:
        self.records[key] = rec
        self.order.append(key)

    def commit(self) -> None:
        pass


def test_extraction_batches_equal_shapes_across_the_folder_and_writes_in_input_order(tmp_path) -> None:
    import cv2

    from extractors.inputs import ImageItem
    from extractors.random_weights import random_detector
    from extractors.recipes import apply_recipe, recipe_from_config
    from extractors.run import run_extraction
    from extractors.selector import make_selector
    from extractors.spec import caffe_r101

    spec = caffe_r101().with_(
        min_size=64,
        max_size=96,
        post_nms_topk=20,
        stage_blocks=(1, 1, 1),
        res5_blocks=1,
        res2_bottleneck=4,
        stem_channels=8,
        rpn_channels=16,
    )
    model = random_detector(spec, seed=0).fold_batchnorm()
    recipe = apply_recipe(model, recipe_from_config({"recipe": "caffe", "boxes": "adaptive"}, "milvlg"))
    rng = np.random.default_rng(0)
    items = []
    for i, (h, w) in enumerate([(60, 80), (80, 60), (60, 80), (90, 90), (80, 60), (60, 80)]):
        path = tmp_path / f"im{i}.png"
        cv2.imwrite(str(path), rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        items.append(ImageItem(f"k{i}", path))
    items.insert(3, ImageItem("missing", tmp_path / "missing.png", problem=("unreadable", "no such file")))
    batches: list[int] = []  # images per backbone pass
    model.backbone.register_forward_pre_hook(lambda mod, args: batches.append(int(args[0].shape[0])))
    runs = {}
    for window in (0, 4):  # 0: each loader batch as it comes; 4: across the folder
        store = _Store()
        batches.clear()
        summary = run_extraction(
            model, items, store, make_selector(recipe, model.spec), batch_size=3, bucket_window=window
        )
        runs[window] = (store, list(batches), summary)
    (one, b_one, s_one), (many, b_many, s_many) = runs[0], runs[4]
    # loader batches of 3 (k0 k1 k2 | missing k3 k4 | k5): 5 passes; across the folder: 60x80 x3, 80x60 x2, 90x90
    assert b_one == [2, 1, 1, 1, 1] and b_many == [3, 2, 1], (b_one, b_many)
    assert many.order == [f"k{i}" for i in range(6)] == one.order  # input order, the missing photo skipped
    assert [f["key"] for f in s_many.failures] == ["missing"] == [f["key"] for f in s_one.failures] and s_many.done == 6
    for k in many.order:  # the same regions (a CPU convolution over another batch differs in float rounding only)
        a, b = many.records[k], one.records[k]
        assert a.boxes.shape == b.boxes.shape and np.allclose(a.boxes, b.boxes, atol=1e-3)
        assert np.allclose(a.features, b.features, rtol=1e-4, atol=1e-5)


def test_bucket_window_setting() -> None:
    import pytest

    from extractors.stage import bucket_window
    from pipeline.core.config import Config
    from pipeline.core.errors import ConfigError

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert bucket_window(Config({"bucket_window": "auto"}), cuda) == 4 and bucket_window(Config({}), cpu) == 0
    assert bucket_window(Config({"bucket_window": 2}), cpu) == 2
    for bad in (-1, "many", True):
        with pytest.raises(ConfigError, match="bucket_window"):
            bucket_window(Config({"bucket_window": bad}), cpu)


def test_channels_last_switch_gives_the_same_regions_to_rounding(tmp_path) -> None:
    """extract.channels_last: NHWC weights and inputs; on CPU the regions equal the default layout's to float
    rounding."""
    from extractors.preprocess import recipe_blob
    from extractors.random_weights import random_detector
    from extractors.recipes import apply_recipe, recipe_from_config
    from extractors.selector import make_selector
    from extractors.spec import caffe_r101
    from extractors.to_host import use_channels_last

    spec = caffe_r101().with_(
        min_size=64,
        max_size=96,
        post_nms_topk=20,
        stage_blocks=(1, 1, 1),
        res5_blocks=1,
        res2_bottleneck=4,
        stem_channels=8,
        rpn_channels=16,
    )
    model = random_detector(spec, seed=0).fold_batchnorm()
    recipe = apply_recipe(model, recipe_from_config({"recipe": "caffe", "boxes": "adaptive"}, "milvlg"))
    rule = make_selector(recipe, model.spec)
    rng = np.random.default_rng(1)
    decoded = [recipe_blob(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8), recipe) for _ in range(2)]
    blobs, frames = [torch.from_numpy(d[0]) for d in decoded], [d[1] for d in decoded]
    plain = model.detect(blobs, frames, rule)
    use_channels_last(model, True)
    convs = [m.weight for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in convs) and any(
        not w.is_contiguous() for w in convs
    )
    nhwc = model.detect(blobs, frames, rule)
    for a, b in zip(plain, nhwc):
        assert a.boxes.shape == b.boxes.shape and np.allclose(a.boxes, b.boxes, atol=1e-3)
        assert np.allclose(a.features, b.features, rtol=1e-4, atol=1e-5)
