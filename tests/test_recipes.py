"""Test-time recipes: ``cli extract`` with the ``hf`` and ``airsplay`` recipes equals an independent
re-statement of each release's test-time pipeline (resize, selection, rescale as the release's code defines
them), on real photos whose scale is not exact; recipe fields reachable from ``--set``; bad fields refused.

The re-statements below are written from the releases' code (huggingface/transformers
``examples/research_projects/lxmert/processing_image.py`` + ``modeling_frcnn.py``; airsplay/py-bottom-up-attention
``demo/detectron2_mscoco_proposal_maxnms.py`` with detectron2's ``ResizeShortestEdge`` and
``detector_postprocess``) and share nothing with the project's recipe code but the network itself.
"""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest
import torch
from detector_helpers import save_layout
from extract_helpers import tiny_spec
from PIL import Image
from torchvision.ops import nms
from typer.testing import CliRunner

from cli import app
from extractors.random_weights import random_detector
from extractors.weights import load_detector
from pipeline.store import FeatureStore

PHOTOS = ["COCO_train2014_000000306661.jpg", "COCO_train2014_000000131486.jpg"]  # 640x427 and 407x640: inexact scales
MEAN = [102.9801, 115.9465, 122.7717]


def _extract(*args: str):
    """``cli extract`` pinned to the CPU: the claims here are exact equality with a CPU re-statement of each release
    (on CUDA, TF32 and other kernels move boxes by ~1e-2 px; the GPU path has its own tests under ``-m gpu``)."""
    return CliRunner().invoke(app, ["extract", "--device", "cpu", *args])


# --- the releases' definitions, re-stated -------------------------------------------------------------
def _shortest_edge(h: int, w: int, short: int, max_size: int) -> tuple[int, int]:
    """detectron2 / HF ``ResizeShortestEdge.get_transform`` size rule."""
    scale = short * 1.0 / min(h, w)
    newh, neww = (short, scale * w) if h < w else (scale * h, short)
    if max(newh, neww) > max_size:
        scale = max_size * 1.0 / max(newh, neww)
        newh, neww = newh * scale, neww * scale
    return int(newh + 0.5), int(neww + 0.5)


def _hf_blob(path, short=800, max_size=1333):
    """HF ``Preprocess.__call__`` on a BGR image: float tensor, interpolate, normalise; sizes, scales_yx."""
    img = torch.as_tensor(cv2.imread(str(path))).float()  # BGR: what the model was trained on
    newh, neww = _shortest_edge(img.shape[0], img.shape[1], short, max_size)
    x = torch.nn.functional.interpolate(
        img.permute(2, 0, 1).unsqueeze(0), (newh, neww), mode="bilinear", align_corners=False
    ).squeeze(0)
    x = (x - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor([1.0, 1.0, 1.0]).view(3, 1, 1)
    raw, size = torch.tensor([img.shape[:2]]), torch.tensor([x.shape[-2:]])
    return x, tuple(x.shape[-2:]), torch.true_divide(raw, size)[0]


def _airsplay_blob(path, short=600, max_size=1000):
    """detectron2 ``ResizeTransform.apply_image`` (PIL bilinear on uint8) + ``preprocess_image``."""
    raw = cv2.imread(str(path))
    newh, neww = _shortest_edge(raw.shape[0], raw.shape[1], short, max_size)
    img = np.asarray(Image.fromarray(raw).resize((neww, newh), Image.BILINEAR))
    x = torch.as_tensor(img.astype("float32").transpose(2, 0, 1))
    x = (x - torch.Tensor(MEAN).view(3, 1, 1)) / torch.Tensor([1.0, 1.0, 1.0]).view(3, 1, 1)
    return x, raw.shape[:2]


def _network(model, x):
    """Proposals (resized pixels), class logits, box deltas and pooled features: the shared network."""
    feat = model.backbone(x[None])
    (props,) = model.proposal_generator(feat, [tuple(x.shape[-2:])], [1.0])
    rois = torch.cat([torch.zeros(props.shape[0], 1), props], 1)
    feats = model._res5(model.roi_heads.pool(feat, rois))
    logits, deltas, _ = model.roi_heads.box_predictor(feats)
    return props, logits, deltas, feats


def _apply_deltas(deltas, boxes, weights=(10.0, 10.0, 5.0, 5.0)):
    """detectron2 / HF ``Box2BoxTransform.apply_deltas``."""
    widths, heights = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    ctr_x, ctr_y = boxes[:, 0] + 0.5 * widths, boxes[:, 1] + 0.5 * heights
    wx, wy, ww, wh = weights
    dx, dy = deltas[:, 0::4] / wx, deltas[:, 1::4] / wy
    dw = torch.clamp(deltas[:, 2::4] / ww, max=math.log(1000.0 / 16))
    dh = torch.clamp(deltas[:, 3::4] / wh, max=math.log(1000.0 / 16))
    px, py = dx * widths[:, None] + ctr_x[:, None], dy * heights[:, None] + ctr_y[:, None]
    pw, ph = torch.exp(dw) * widths[:, None], torch.exp(dh) * heights[:, None]
    out = torch.zeros_like(deltas)
    out[:, 0::4], out[:, 1::4], out[:, 2::4], out[:, 3::4] = px - 0.5 * pw, py - 0.5 * ph, px + 0.5 * pw, py + 0.5 * ph
    return out


def _max_boxes(props, logits, deltas, size):
    """Softmax, drop the background (last) column, class boxes clipped to ``size``, best class per proposal."""
    scores = torch.softmax(logits, dim=-1)[:, :-1]
    boxes = _apply_deltas(deltas, props).reshape(-1, 4)
    h, w = size
    boxes[:, 0].clamp_(min=0, max=w)
    boxes[:, 1].clamp_(min=0, max=h)
    boxes[:, 2].clamp_(min=0, max=w)
    boxes[:, 3].clamp_(min=0, max=h)
    boxes = boxes.view(props.shape[0], -1, 4)
    max_scores, max_classes = scores.max(1)
    return boxes[torch.arange(props.shape[0]), max_classes], max_scores, max_classes


def hf_reference(model, path):
    """HF ``GeneralizedRCNN.inference`` + ``ROIOutputs.inference`` / ``do_nms`` (ladder 0.5, 0.6, 0.7; 36..36)."""
    x, size, scale_yx = _hf_blob(path)
    props, logits, deltas, feats = _network(model, x)
    max_boxes, max_scores, _ = _max_boxes(props, logits, deltas, size)
    for t in (0.5, 0.6, 0.7):
        keep = nms(max_boxes, max_scores, t)[:36]
        if 36 <= keep.shape[-1] <= 36:
            break
    boxes = max_boxes[keep].clone()
    boxes[:, 0::2] *= scale_yx[1]
    boxes[:, 1::2] *= scale_yx[0]
    return boxes.numpy(), feats[keep].numpy()


def airsplay_reference(model, path):
    """airsplay ``doit``: ladder ``np.arange(0.3, 1.0, 0.1)`` until >= 36, first 36; ``detector_postprocess``."""
    x, (height, width) = _airsplay_blob(path)
    size = tuple(x.shape[-2:])
    props, logits, deltas, feats = _network(model, x)
    max_boxes, max_scores, _ = _max_boxes(props, logits, deltas, size)
    for t in np.arange(0.3, 1.0, 0.1):
        keep = nms(max_boxes, max_scores, t)[:36]
        if len(keep) >= 36:
            break
    boxes = max_boxes[keep].clone()
    boxes[:, 0::2] *= width / size[1]
    boxes[:, 1::2] *= height / size[0]
    boxes[:, 0].clamp_(min=0, max=width)
    boxes[:, 1].clamp_(min=0, max=height)
    boxes[:, 2].clamp_(min=0, max=width)
    boxes[:, 3].clamp_(min=0, max=height)
    nonempty = (boxes[:, 2] - boxes[:, 0] > 0) & (boxes[:, 3] - boxes[:, 1] > 0)
    return boxes[nonempty].numpy(), feats[keep][nonempty].numpy()


# --- tests ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A random detector at reduced widths saved in the HF ``pytorch_model.bin`` and airsplay ``.pkl`` layouts."""
    spec = tiny_spec(flavor="d2", rpn_min_size=0.0, box_reg_weights=(10.0, 10.0, 5.0, 5.0))
    sd = random_detector(spec, seed=5).state_dict()
    d = tmp_path_factory.mktemp("weights")
    return {
        "hf": save_layout(sd, "hf", d / "pytorch_model.bin"),
        "airsplay": save_layout(sd, "airsplay", d / "faster_rcnn_from_caffe_attr.pkl"),
    }


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    lt, rb = np.maximum(a[:, :2], b[:, :2]), np.minimum(a[:, 2:], b[:, 2:])
    inter = np.clip(rb - lt, 0, None).prod(1)
    area = lambda x: (x[:, 2] - x[:, 0]) * (x[:, 3] - x[:, 1])  # noqa: E731
    return inter / (area(a) + area(b) - inter)


@pytest.mark.parametrize("layout,reference", [("hf", hf_reference), ("airsplay", airsplay_reference)])
def test_recipe_equals_the_release_pipeline(tmp_path, shared_data, weights, layout, reference):
    files = [shared_data / "photos" / p for p in PHOTOS]
    store = tmp_path / "s"
    res = _extract(
        *map(str, files),
        "--weights",
        str(weights[layout]),
        "--store",
        str(store),
        "--workers",
        "0",
        "--set",
        "extract.feature_dtype=float32",
    )
    assert res.exit_code == 0, res.output
    st = FeatureStore(store)
    assert st.identity["config"]["recipe"]["name"] == layout  # chosen from the layout
    model = load_detector(weights[layout])[0].fold_batchnorm()
    model.set_test_recipe(pre_nms_topk=6000, post_nms_topk=300, rpn_nms_thresh=0.7)
    with torch.inference_mode():
        for f in files:
            ref_boxes, ref_feats = reference(model, f)
            got = st.get(str(int(f.stem.split("_")[-1])))
            assert got["boxes"].shape == ref_boxes.shape and ref_boxes.shape[0] >= 30
            assert _iou(got["boxes"], ref_boxes).min() >= 0.999  # same boxes, same order
            np.testing.assert_allclose(got["boxes"], ref_boxes, rtol=0, atol=1e-3)
            np.testing.assert_allclose(
                got["features"], ref_feats, rtol=1e-5, atol=1e-5 * float(np.abs(ref_feats).max())
            )


def test_hf_colour_switch_reproduces_the_local_file_bug(tmp_path, shared_data, weights):
    """``colour: rgb`` feeds RGB as the HF demo does for local files; the output changes."""
    f = str(shared_data / "photos" / PHOTOS[0])
    outs = []
    for colour in ("bgr", "rgb"):
        res = _extract(
            f,
            "--weights",
            str(weights["hf"]),
            "--store",
            str(tmp_path / colour),
            "--workers",
            "0",
            "--set",
            f"extract.recipes.hf.colour={colour}",
            "--set",
            "extract.min_size=400",
        )
        assert res.exit_code == 0, res.output
        outs.append(FeatureStore(tmp_path / colour).get("306661"))
    assert not np.allclose(outs[0]["features"].astype(np.float32), outs[1]["features"].astype(np.float32))


def _run(tmp_path, photo, name, weights_path, *sets):
    args = [a for s in sets for a in ("--set", s)]
    res = _extract(str(photo), "--weights", str(weights_path), "--store", str(tmp_path / name), "--workers", "0", *args)
    assert res.exit_code == 0, res.output
    return FeatureStore(tmp_path / name).get("306661")


@pytest.fixture()
def photo(shared_data):
    return shared_data / "photos" / PHOTOS[0]


def test_set_changes_the_ladder_and_the_per_class_nms(tmp_path, weights, photo):
    small = "extract.min_size=300"
    base = _run(tmp_path, photo, "ladder0", weights["hf"], small)
    tight = _run(tmp_path, photo, "ladder1", weights["hf"], small, "extract.recipes.hf.ladder=[0.2]")
    assert base["boxes"].shape[0] == 36
    assert not np.array_equal(base["boxes"], tight["boxes"])
    caffe = ["extract.recipe=caffe", small, "extract.max_size=500"]
    a = _run(tmp_path, photo, "pc0", weights["hf"], *caffe)
    b = _run(tmp_path, photo, "pc1", weights["hf"], *caffe, "extract.recipes.caffe.nms_thresh=0.7")
    assert a["boxes"].shape != b["boxes"].shape or not np.array_equal(a["boxes"], b["boxes"])


@pytest.mark.parametrize(
    "setting,needle",
    [
        ("extract.recipes.hf.ladder=[0.5, x]", "ladder"),
        ("extract.recipes.hf.ladder=0.5", "ladder"),
        ("extract.recipes.hf.nms_threshold=0.5", "nms_threshold"),
        ("extract.recipes.caffe.nms_thresh=high", "nms_thresh"),
        ("extract.recipes.caffe.pixel_mean=[1, 2]", "pixel_mean"),
        ("extract.recipes.airsplay.selector=best", "selector"),
        ("extract.nms_thresh=[0.3]", "nms_thresh"),
        ("extract.recipe=detectron", "recipe"),
    ],
)
def test_bad_recipe_fields_are_one_line_usage_errors(tmp_path, weights, photo, setting, needle):
    res = _extract(
        str(photo), "--weights", str(weights["hf"]), "--store", str(tmp_path / "s"), "--workers", "0", "--set", setting
    )
    assert res.exit_code == 2, res.output
    err = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and needle in err[0] and "Traceback" not in res.output


def test_info_prints_the_recipe_and_the_store_records_it(tmp_path, weights, photo):
    res = CliRunner().invoke(app, ["info", str(weights["hf"])])
    assert res.exit_code == 0, res.output
    assert "recipe: hf" in res.output and "NMS ladder 0.5, 0.6, 0.7" in res.output and '"min_size": 800' in res.output
    res = CliRunner().invoke(app, ["info", str(weights["airsplay"]), "--set", "extract.recipe=caffe"])
    assert res.exit_code == 0 and "recipe: caffe" in res.output and "per-class NMS 0.3" in res.output
    assert '"min_size": 600' in res.output  # the weights' own test scale fills the caffe recipe's nulls
    _run(
        tmp_path, photo, "s", weights["airsplay"], "extract.recipes.airsplay.ladder=[0.4, 0.8]", "extract.min_size=300"
    )
    st = FeatureStore(tmp_path / "s")
    rec = st.identity["config"]["recipe"]
    assert (
        rec["name"] == "airsplay"
        and rec["ladder"] == [0.4, 0.8]
        and rec["min_size"] == 300
        and rec["interpolation"] == "pil-bilinear"
    )
    assert st.identity["weights_sha256"] and set(rec) >= {
        "colour",
        "pixel_mean",
        "pre_nms_topk",
        "selector",
        "rescale",
        "clip",
    }
