"""Shared helpers for the extractor tests: a tiny detector spec and TSV decoding of the Caffe fixtures."""

from __future__ import annotations

import base64
import csv
import sys
from pathlib import Path

import numpy as np

from extractors.spec import BottomUpSpec

TINY = dict(
    stage_blocks=(1, 1, 1),
    res5_blocks=1,
    res2_bottleneck=4,
    stem_channels=8,
    num_classes=21,
    num_attributes=11,
    attr_embed_dim=8,
    attr_hidden=16,
    rpn_channels=16,
    post_nms_topk=60,
    pre_nms_topk=600,
    min_size=200,
    max_size=333,
)
TINY_SET = (
    "extract.spec={stage_blocks: [1, 1, 1], res5_blocks: 1, res2_bottleneck: 4, stem_channels: 8, num_classes: 21, "
    "num_attributes: 11, attr_embed_dim: 8, attr_hidden: 16, rpn_channels: 16, post_nms_topk: 60, pre_nms_topk: 600}"
)


def tiny_spec(**kw) -> BottomUpSpec:
    d = dict(TINY)
    d.update(kw)
    return BottomUpSpec(**d)


OBJ36_FIELDS = [
    "img_id",
    "img_h",
    "img_w",
    "objects_id",
    "objects_conf",
    "attrs_id",
    "attrs_conf",
    "num_boxes",
    "boxes",
    "features",
]


def read_obj36(path: Path) -> list[dict]:
    """Decode the LXMERT obj36 TSV (data/README.md: height before width, int64 ids, float32 arrays)."""
    csv.field_size_limit(sys.maxsize)
    rows = []
    with open(path, newline="") as fh:
        for r in csv.reader(fh, delimiter="\t"):
            d = dict(zip(OBJ36_FIELDS, r))
            n = int(d["num_boxes"])
            out = {"img_id": d["img_id"], "img_h": int(d["img_h"]), "img_w": int(d["img_w"]), "num_boxes": n}
            for k, dt in (
                ("objects_id", np.int64),
                ("objects_conf", np.float32),
                ("attrs_id", np.int64),
                ("attrs_conf", np.float32),
            ):
                out[k] = np.frombuffer(base64.b64decode(d[k]), dtype=dt)
            out["boxes"] = np.frombuffer(base64.b64decode(d["boxes"]), dtype=np.float32).reshape(n, 4)
            out["features"] = np.frombuffer(base64.b64decode(d["features"]), dtype=np.float32).reshape(n, -1)
            rows.append(out)
    return rows


def read_trainval36(path: Path) -> list[dict]:
    """Decode the BUTD trainval_36 TSV (width before height)."""
    csv.field_size_limit(sys.maxsize)
    rows = []
    with open(path, newline="") as fh:
        for r in csv.reader(fh, delimiter="\t"):
            n = int(r[3])
            rows.append(
                {
                    "image_id": int(r[0]),
                    "image_w": int(r[1]),
                    "image_h": int(r[2]),
                    "num_boxes": n,
                    "boxes": np.frombuffer(base64.b64decode(r[4]), dtype=np.float32).reshape(n, 4),
                    "features": np.frombuffer(base64.b64decode(r[5]), dtype=np.float32).reshape(n, -1),
                }
            )
    return rows


def selector_for(spec: BottomUpSpec, name: str = "caffe", boxes: str | None = None, **fields):
    """The selector of recipe ``name`` (configs/extract.yaml values) for a detector spec, with ``boxes`` mode
    (adaptive / 36 / given) and recipe fields overridden, resolved against the spec's own test values."""
    from extractors.recipes import recipe_from_config, resolve_recipe
    from extractors.selector import make_selector

    recipe = recipe_from_config({"recipe": name, "boxes": boxes}, "milvlg").with_(**fields)
    return make_selector(resolve_recipe(recipe, spec), spec)


def caffe_frames(images, spec: BottomUpSpec):
    """Caffe blobs (torch) and their Frames at the spec's test scale."""
    import torch

    from extractors.preprocess import Frame, caffe_blob

    blobs, frames = [], []
    for im in images:
        b, s = caffe_blob(im, spec.min_size, spec.max_size, spec.pixel_means)
        blobs.append(torch.from_numpy(b))
        frames.append(Frame(im.shape[0], im.shape[1], b.shape[1], b.shape[2], s))
    return blobs, frames
