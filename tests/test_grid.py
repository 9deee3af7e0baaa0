"""Grid features: ``cli extract --boxes grid`` equals a re-statement of facebookresearch/grid-feats-vqa
``extract_grid_feature.py`` (detectron2 ``read_image`` + ``ResizeShortestEdge(600, 1000)`` + backbone through
res5 with ``RES5_DILATION = 1``) and of RSTNet's 7x7 ``AdaptiveAvgPool2d``, on random weights saved in the
grid-feats detectron2 layout and VinVL's layout, on real photos whose scale is not exact.

The detectron2 re-statement reads the checkpoint's ``backbone.*`` tensors and runs its own stem, bottleneck
blocks (FrozenBN eps 1e-5, stride on the 3x3 conv for the X models) and res5 geometry.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from detector_helpers import grid_regions, random_grid_feats_file, save_layout, save_vinvl
from PIL import Image, ImageOps
from test_vinvl import _Net, narrow_spec
from typer.testing import CliRunner

from cli import app
from extractors.random_weights import random_detector
from extractors.spec import BottomUpSpec
from pipeline.store import FeatureStore

PHOTOS = [
    "COCO_train2014_000000132417.jpg",
    "COCO_train2014_000000131486.jpg",
]  # 500x333 -> 901x600; 407x640 -> 600x943
MEAN = torch.tensor([103.530, 116.280, 123.675]).view(1, 3, 1, 1)


def grid_spec(**kw) -> BottomUpSpec:
    base = dict(
        flavor="d2",
        stem_channels=16,
        res2_bottleneck=16,
        expansion=2,
        stage_blocks=(1, 2, 2),
        res5_blocks=2,
        res5_dilation=1,
        groups=4,
        stride_in_1x1=False,
        stem_pool="pad1",
        has_attributes=False,
        pixel_means=(103.530, 116.280, 123.675),
    )
    base.update(kw)
    return BottomUpSpec(**base)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("grid")
    random_grid_feats_file(grid_spec(), d / "X-152.pth", seed=4)
    save_vinvl(random_detector(narrow_spec(), seed=3), d / "vinvl.pth")
    return d


# --- detectron2 / grid-feats-vqa, re-stated -----------------------------------------------------------
def _d2_image(path, std=(1.0, 1.0, 1.0)):
    im = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
    bgr = np.asarray(im)[:, :, ::-1]
    h, w = bgr.shape[:2]
    scale = 600 / min(h, w)
    newh, neww = (600, scale * w) if h < w else (scale * h, 600)
    if max(newh, neww) > 1000:
        f = 1000 / max(newh, neww)
        newh, neww = newh * f, neww * f
    newh, neww = int(newh + 0.5), int(neww + 0.5)
    small = np.asarray(Image.fromarray(np.ascontiguousarray(bgr)).resize((neww, newh), Image.BILINEAR))
    x = torch.as_tensor(small.astype("float32").transpose(2, 0, 1))[None]
    return (x - MEAN) / torch.tensor(std).view(1, 3, 1, 1), (w, h), (neww, newh)


def _d2_backbone(sd, x):
    def conv_bn(x, p, stride=1, pad=0, groups=1, dilation=1):
        y = F.conv2d(x, sd[p + ".weight"], None, stride, pad, dilation, groups)
        scale = sd[p + ".norm.weight"] * (sd[p + ".norm.running_var"] + 1e-5).rsqrt()
        return y * scale.view(1, -1, 1, 1) + (sd[p + ".norm.bias"] - sd[p + ".norm.running_mean"] * scale).view(
            1, -1, 1, 1
        )

    x = F.max_pool2d(F.relu(conv_bn(x, "backbone.stem.conv1", 2, 3)), 3, 2, 1)
    groups = sd["backbone.res2.0.conv1.weight"].shape[0] // sd["backbone.res2.0.conv2.weight"].shape[1]
    for s in (2, 3, 4, 5):
        i = 0
        while f"backbone.res{s}.{i}.conv1.weight" in sd:
            p, stride = f"backbone.res{s}.{i}", (1 if s == 2 or i > 0 else 2)  # RES5_DILATION 1: res5 strides too
            out = F.relu(conv_bn(x, p + ".conv1"))
            out = F.relu(conv_bn(out, p + ".conv2", stride, 1, groups))
            out = conv_bn(out, p + ".conv3")
            short = conv_bn(x, p + ".shortcut", stride) if p + ".shortcut.weight" in sd else x
            x = F.relu(out + short)
            i += 1
    return x


def _cell_boxes(h, w, k, stride, resized, orig):
    def edges(n):
        return (
            [(i, i + 1) for i in range(n)]
            if k == 0
            else [(int(np.floor(i * n / k)), int(np.ceil((i + 1) * n / k))) for i in range(k)]
        )

    (rw, rh), (ow, oh) = resized, orig
    return np.array(
        [
            [
                x0 * stride * ow / rw,
                y0 * stride * oh / rh,
                min(x1 * stride, rw) * ow / rw,
                min(y1 * stride, rh) * oh / rh,
            ]
            for y0, y1 in edges(h)
            for x0, x1 in edges(w)
        ],
        dtype=np.float32,
    )


def _rows(fmap, k):
    pooled = F.adaptive_avg_pool2d(fmap, (k, k)) if k else fmap  # RSTNet DataProcessor: AdaptiveAvgPool2d((7, 7))
    return pooled[0].permute(1, 2, 0).reshape(-1, fmap.shape[1]).numpy()


def _extract(tmp_path, name, weights, *args):
    res = CliRunner().invoke(
        app,
        [
            "extract",
            "--device",
            "cpu",
            *args,
            "--weights",
            str(weights),
            "--store",
            str(tmp_path / name),
            "--workers",
            "0",
            "--set",
            "extract.feature_dtype=float32",
        ],
    )
    assert res.exit_code == 0, res.output
    return FeatureStore(tmp_path / name)


@pytest.mark.parametrize("k", [0, 7])
def test_grid_feats_layout_equals_the_release(tmp_path, shared_data, files, k):
    photos = [shared_data / "photos" / p for p in PHOTOS]
    st = _extract(
        tmp_path, "s", files / "X-152.pth", *map(str, photos), "--set", f"extract.recipes.grid-feats.grid={k}"
    )
    assert st.identity["layout"] == "grid-feats" and st.identity["config"]["recipe"]["name"] == "grid-feats"
    sd = {kk: v.float() for kk, v in torch.load(files / "X-152.pth", weights_only=True)["model"].items()}
    for f in photos:
        x, orig, resized = _d2_image(f)
        with torch.no_grad():
            fmap = _d2_backbone(sd, x)
        assert fmap.shape[2:] == (-(-resized[1] // 32), -(-resized[0] // 32))
        got = st.get(str(int(f.stem.split("_")[-1])))
        ref = _rows(fmap, k)
        assert got["features"].shape == ref.shape
        np.testing.assert_allclose(got["features"], ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
        np.testing.assert_allclose(
            got["boxes"], _cell_boxes(fmap.shape[2], fmap.shape[3], k, 32, resized, orig), rtol=0, atol=1e-3
        )


def test_vinvl_grid_is_the_res5_head_on_the_whole_map(tmp_path, shared_data, files):
    f = shared_data / "photos" / PHOTOS[0]
    st = _extract(
        tmp_path, "v", files / "vinvl.pth", str(f), "--boxes", "grid", "--set", "extract.recipes.grid-feats.grid=7"
    )
    net = _Net(files / "vinvl.pth")
    x, orig, resized = _d2_image(f)
    with torch.no_grad():
        fmap = net.layer(net.backbone(x), "roi_heads.box.feature_extractor.head.layer4", 2)
    got = st.get("132417")
    assert got["features"].shape == (49, fmap.shape[1])
    np.testing.assert_allclose(got["features"], _rows(fmap, 7), rtol=1e-4, atol=1e-4 * float(fmap.abs().max()))


def test_caffe_r101_grid_geometry_and_refusals(tmp_path, shared_data, files):
    """The dilated R-101 head gives a stride-32 map with ``res5_dilation: 1`` and stride 16 with 2; modulated or
    grouped deformable offsets and region extraction with grid-feats weights are refused in one line."""
    from extract_helpers import tiny_spec

    w = save_layout(random_detector(tiny_spec(), seed=1).state_dict(), "milvlg", tmp_path / "bua.pth")
    f = str(shared_data / "photos" / PHOTOS[1])  # 407x640 -> 600x943 (d2 rule)
    a = _extract(tmp_path, "a", w, f, "--boxes", "grid").get("131486")
    b = _extract(tmp_path, "b", w, f, "--boxes", "grid", "--set", "extract.recipes.grid-feats.res5_dilation=2").get(
        "131486"
    )
    assert a["boxes"].shape[0] == 19 * 30 and b["boxes"].shape[0] == 38 * 59
    sd = torch.load(files / "X-152.pth", weights_only=True)
    sd["model"]["backbone.res4.0.conv2_offset.weight"] = torch.zeros(27, 32, 3, 3)  # DCNv2 (modulated): 27 channels
    torch.save(sd, tmp_path / "X-152pp.pth")
    res = CliRunner().invoke(app, ["info", str(tmp_path / "X-152pp.pth")])
    assert res.exit_code != 0 and "27 offset channels" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(
        app,
        [
            "extract",
            "--device",
            "cpu",
            f,
            "--weights",
            str(files / "X-152.pth"),
            "--store",
            str(tmp_path / "r"),
            "--recipe",
            "vinvl",
        ],
    )
    assert res.exit_code == 2 and "grid features only" in res.output
    res = CliRunner().invoke(app, ["info", str(files / "X-152.pth")])
    assert res.exit_code == 0 and "layout: grid-feats" in res.output and "recipe: grid-feats" in res.output


def _deform_ref(x, w, off_w, off_b, stride, groups):
    """detectron2 ``DeformConv`` (DCNv1, one offset group) re-stated: offsets from a 3x3 conv, channel 2k = dy,
    2k + 1 = dx of tap k = 3i + j; each tap bilinearly sampled (zeros outside) with ``grid_sample``, then the
    tap's weights applied as a grouped 1x1 conv and summed."""
    offset = F.conv2d(x, off_w, off_b, stride, 1)
    n, c, h, w_in = x.shape
    ho, wo = offset.shape[2:]
    base_y = (torch.arange(ho, dtype=torch.float32) * stride - 1).view(1, ho, 1)
    base_x = (torch.arange(wo, dtype=torch.float32) * stride - 1).view(1, 1, wo)
    out = 0
    for k in range(9):
        i, j = divmod(k, 3)
        py = base_y + i + offset[:, 2 * k]
        px = base_x + j + offset[:, 2 * k + 1]
        grid = torch.stack([2 * px / (w_in - 1) - 1, 2 * py / (h - 1) - 1], dim=-1)
        tap = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=True)
        out = out + F.conv2d(tap, w[:, :, i : i + 1, j : j + 1], groups=groups)
    return out


def _d2_backbone_deform(sd, x):
    def bn(y, p):
        scale = sd[p + ".norm.weight"] * (sd[p + ".norm.running_var"] + 1e-5).rsqrt()
        return y * scale.view(1, -1, 1, 1) + (sd[p + ".norm.bias"] - sd[p + ".norm.running_mean"] * scale).view(
            1, -1, 1, 1
        )

    x = F.max_pool2d(
        F.relu(bn(F.conv2d(x, sd["backbone.stem.conv1.weight"], None, 2, 3), "backbone.stem.conv1")), 3, 2, 1
    )
    groups = sd["backbone.res2.0.conv1.weight"].shape[0] // sd["backbone.res2.0.conv2.weight"].shape[1]
    for s in (2, 3, 4, 5):
        i = 0
        while f"backbone.res{s}.{i}.conv1.weight" in sd:
            p, stride = f"backbone.res{s}.{i}", (1 if s == 2 or i > 0 else 2)
            out = F.relu(bn(F.conv2d(x, sd[p + ".conv1.weight"]), p + ".conv1"))
            if p + ".conv2_offset.weight" in sd:
                out = _deform_ref(
                    out,
                    sd[p + ".conv2.weight"],
                    sd[p + ".conv2_offset.weight"],
                    sd[p + ".conv2_offset.bias"],
                    stride,
                    groups,
                )
            else:
                out = F.conv2d(out, sd[p + ".conv2.weight"], None, stride, 1, 1, groups)
            out = F.relu(bn(out, p + ".conv2"))
            out = bn(F.conv2d(out, sd[p + ".conv3.weight"]), p + ".conv3")
            short = (
                bn(F.conv2d(x, sd[p + ".shortcut.weight"], None, stride), p + ".shortcut")
                if p + ".shortcut.weight" in sd
                else x
            )
            x = F.relu(out + short)
            i += 1
    return x


def test_x152pp_deformable_res4_res5_equal_the_release(tmp_path, shared_data):
    random_grid_feats_file(grid_spec(deform_stages=(4, 5)), tmp_path / "X-152pp.pth", seed=6)
    sd = {k: v.float() for k, v in torch.load(tmp_path / "X-152pp.pth", weights_only=True)["model"].items()}
    assert sd["backbone.res4.0.conv2_offset.weight"].shape[0] == 18 and "backbone.res3.0.conv2_offset.weight" not in sd
    f = shared_data / "photos" / PHOTOS[0]
    st = _extract(tmp_path, "pp", tmp_path / "X-152pp.pth", str(f), "--set", "extract.recipes.grid-feats.grid=7")
    x, orig, resized = _d2_image(f)
    with torch.no_grad():
        fmap = _d2_backbone_deform(sd, x)
        plain = _d2_backbone(sd, x)
    assert not torch.allclose(fmap, plain, rtol=1e-3)  # the offsets matter
    ref = _rows(fmap, 7)
    np.testing.assert_allclose(st.get("132417")["features"], ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
    res = CliRunner().invoke(app, ["info", str(tmp_path / "X-152pp.pth")])
    assert res.exit_code == 0 and "deformable: res4, res5" in res.output


@pytest.mark.parametrize("k", [0, 7])
def test_a_batch_of_grid_maps_reaches_the_host_in_one_copy_with_the_per_image_arrays(k):
    """``GridCells.detect`` keeps each image's cells on the device and copies the batch once (the ``.cpu()`` and
    its ``.numpy()``), giving exactly the arrays of :func:`grid_regions` image by image (a ``.cpu()`` and a
    ``.numpy()`` each). The proxy also counts each image's ``.numpy()`` of its host-computed boxes (no device read)."""
    from types import SimpleNamespace

    from bench.proxies import count
    from extractors.grid import GridCells, GridFeatsModel, grid_map
    from extractors.preprocess import Frame

    torch.manual_seed(0)
    spec = grid_spec()
    model = GridFeatsModel(spec).eval()
    g = torch.Generator().manual_seed(1)
    blobs = [torch.rand(3, 96, 160, generator=g) * 255 - 120, torch.rand(3, 128, 96, generator=g) * 255 - 120]
    frames = [
        Frame(height=60, width=100, blob_h=96, blob_w=160, im_scale=1.6),
        Frame(height=200, width=150, blob_h=128, blob_w=96, im_scale=0.64),
    ]
    cells = GridCells(SimpleNamespace(res5_dilation=1, grid=k), spec)
    got = cells.detect(model, blobs, frames)
    assert len(got) == 2
    for rec, blob, frame in zip(got, blobs, frames):
        fmap, stride = grid_map(model, blob, 1)
        want = grid_regions(fmap, stride, frame, k)
        assert (rec.image_w, rec.image_h) == (frame.width, frame.height)
        for name in ("features", "boxes"):
            a, b = getattr(rec, name), getattr(want, name)
            assert a.dtype == b.dtype == np.float32 and a.shape == b.shape and np.array_equal(a, b), name
        assert rec.class_ids is None and rec.attr_ids is None
    assert got[0].features.shape[0] == (49 if k else 3 * 5) and got[1].features.shape[0] == (49 if k else 4 * 3)
    assert count(lambda: cells.detect(model, blobs, frames))["syncs"] == 2 + 2
    assert count(lambda: [grid_regions(*grid_map(model, b, 1), f, k) for b, f in zip(blobs, frames)])["syncs"] == 2 * 3
    assert cells.detect(model, [], []) == []
