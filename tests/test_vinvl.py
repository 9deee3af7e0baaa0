"""VinVL (microsoft/scene_graph_benchmark ``AttrRCNN``): ``cli extract`` on random weights saved in the release's
``vinvl_vg_x152c4.pth`` layout equals a re-statement of the release's test-time pipeline written here from
maskrcnn_benchmark's code, on real photos whose scale is not exact.

The re-statement reads the weights file itself (``module.``-prefixed scene_graph_benchmark names) and runs
its own ResNeXt (stride on the 3x3 conv, FrozenBN without eps), legacy anchor generator, ``+1`` box coder,
``RPNPostProcessor``, ``ROIAlign(aligned=False)``, ``PostProcessor`` (``filter_results``,
``filter_results_peter``, ``filter_results_fast``) and ``AttributePostProcessor``; it shares no code with
the project's extractor.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from detector_helpers import save_vinvl
from PIL import Image
from torchvision.ops import nms, roi_align
from typer.testing import CliRunner

from cli import app
from extractors.preprocess import mrcnn_size
from extractors.random_weights import random_detector
from extractors.vinvl import select as vinvl_select
from extractors.vinvl import vinvl_x152c4
from pipeline.store import FeatureStore

PHOTOS = [
    "COCO_train2014_000000132417.jpg",
    "COCO_train2014_000000387267.jpg",
]  # 500x333 -> 900x600 (d2: 901); 640x360 -> 999x562
MEAN = torch.tensor([103.530, 116.280, 123.675])


def narrow_spec():
    return vinvl_x152c4().with_(
        stem_channels=16,
        res2_bottleneck=16,
        groups=4,
        stage_blocks=(1, 2, 2),
        res5_blocks=2,
        rpn_channels=32,
        num_classes=41,
        num_attributes=31,
    )


@pytest.fixture(scope="module")
def vinvl_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vinvl") / "vinvl_vg_x152c4.pth"
    save_vinvl(random_detector(narrow_spec(), seed=3), path)
    return path


# --- maskrcnn_benchmark / scene_graph_benchmark, re-stated ---------------------------------------------
def _get_size(w, h, size=600, max_size=1000):
    mn, mx = float(min(w, h)), float(max(w, h))
    if mx / mn * size > max_size:
        size = int(round(max_size * mn / mx))
    if (w <= h and w == size) or (h <= w and h == size):
        return h, w
    return (int(size * h / w), size) if w < h else (size, int(size * w / h))


def _image(path):
    im = Image.open(path).convert("RGB")
    oh, ow = _get_size(*im.size)
    im = im.resize((ow, oh), Image.BILINEAR)
    t = torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).float().div(255)  # ToTensor
    return ((t[[2, 1, 0]] * 255) - MEAN.view(3, 1, 1))[None], (ow, oh)


class _Net:
    def __init__(self, path):
        sd = torch.load(path, weights_only=True)
        self.sd = {k[len("module.") :]: v.float() for k, v in sd.items()}
        self.groups = (
            self.sd["backbone.body.layer1.0.conv1.weight"].shape[0]
            // self.sd["backbone.body.layer1.0.conv2.weight"].shape[1]
        )

    def bn(self, x, p):  # maskrcnn_benchmark FrozenBatchNorm2d: no eps
        scale = self.sd[p + ".weight"] * self.sd[p + ".running_var"].rsqrt()
        return x * scale.view(1, -1, 1, 1) + (self.sd[p + ".bias"] - self.sd[p + ".running_mean"] * scale).view(
            1, -1, 1, 1
        )

    def block(self, x, p, stride):  # BottleneckWithFixedBatchNorm, STRIDE_IN_1X1 False
        out = F.relu(self.bn(F.conv2d(x, self.sd[p + "conv1.weight"]), p + "bn1"))
        out = F.relu(
            self.bn(F.conv2d(out, self.sd[p + "conv2.weight"], stride=stride, padding=1, groups=self.groups), p + "bn2")
        )
        out = self.bn(F.conv2d(out, self.sd[p + "conv3.weight"]), p + "bn3")
        idt = (
            self.bn(F.conv2d(x, self.sd[p + "downsample.0.weight"], stride=stride), p + "downsample.1")
            if p + "downsample.0.weight" in self.sd
            else x
        )
        return F.relu(out + idt)

    def layer(self, x, prefix, first_stride):
        i = 0
        while f"{prefix}.{i}.conv1.weight" in self.sd:
            x = self.block(x, f"{prefix}.{i}.", first_stride if i == 0 else 1)
            i += 1
        return x

    def backbone(self, x):
        x = F.relu(
            self.bn(
                F.conv2d(x, self.sd["backbone.body.stem.conv1.weight"], stride=2, padding=3), "backbone.body.stem.bn1"
            )
        )
        x = F.max_pool2d(x, 3, 2, 1)
        for s in (1, 2, 3):
            x = self.layer(x, f"backbone.body.layer{s}", 1 if s == 1 else 2)
        return x

    def head(self, c4, boxes):
        pooled = roi_align(c4, [boxes], (14, 14), 1 / 16, 0, False)
        return self.layer(pooled, "roi_heads.box.feature_extractor.head.layer4", 2).mean((2, 3))

    def lin(self, x, p):
        return F.linear(x, self.sd[p + ".weight"], self.sd[p + ".bias"])


def _generate_anchors(stride=16, sizes=(32, 64, 128, 256, 512), ratios=(0.5, 1.0, 2.0)):
    base = np.array([1, 1, stride, stride], dtype=np.float64) - 1
    w, h = base[2] - base[0] + 1, base[3] - base[1] + 1
    cx, cy = base[0] + 0.5 * (w - 1), base[1] + 0.5 * (h - 1)
    out = []
    for r in ratios:
        ws = np.round(np.sqrt(w * h / r))
        hs = np.round(ws * r)
        for s in np.array(sizes, dtype=np.float64) / stride:
            aw, ah = ws * s, hs * s
            out.append([cx - 0.5 * (aw - 1), cy - 0.5 * (ah - 1), cx + 0.5 * (aw - 1), cy + 0.5 * (ah - 1)])
    return torch.tensor(out, dtype=torch.float32)


def _decode(codes, boxes, weights):
    wx, wy, ww, wh = weights
    widths, heights = boxes[:, 2] - boxes[:, 0] + 1, boxes[:, 3] - boxes[:, 1] + 1
    cx, cy = boxes[:, 0] + 0.5 * widths, boxes[:, 1] + 0.5 * heights
    dx, dy = codes[:, 0::4] / wx, codes[:, 1::4] / wy
    dw, dh = (codes[:, 2::4] / ww).clamp(max=np.log(1000.0 / 16)), (codes[:, 3::4] / wh).clamp(max=np.log(1000.0 / 16))
    px, py = dx * widths[:, None] + cx[:, None], dy * heights[:, None] + cy[:, None]
    pw, ph = torch.exp(dw) * widths[:, None], torch.exp(dh) * heights[:, None]
    out = torch.zeros_like(codes)
    out[:, 0::4], out[:, 1::4], out[:, 2::4], out[:, 3::4] = (
        px - 0.5 * pw,
        py - 0.5 * ph,
        px + 0.5 * pw - 1,
        py + 0.5 * ph - 1,
    )
    return out


def _clip(b, w, h):
    b = b.clone()
    b[..., 0::2] = b[..., 0::2].clamp(0, w - 1)
    b[..., 1::2] = b[..., 1::2].clamp(0, h - 1)
    return b


def _proposals(net, c4, w, h):
    t = F.relu(F.conv2d(c4, net.sd["rpn.head.conv.weight"], net.sd["rpn.head.conv.bias"], padding=1))
    obj = F.conv2d(t, net.sd["rpn.head.cls_logits.weight"], net.sd["rpn.head.cls_logits.bias"])
    reg = F.conv2d(t, net.sd["rpn.head.bbox_pred.weight"], net.sd["rpn.head.bbox_pred.bias"])
    n, a, fh, fw = obj.shape
    obj = obj.permute(0, 2, 3, 1).reshape(n, -1).sigmoid()[0]
    reg = reg.view(n, a, 4, fh, fw).permute(0, 3, 4, 1, 2).reshape(n, -1, 4)[0]
    cell = net.sd["rpn.anchor_generator.cell_anchors.0"]
    sx, sy = torch.arange(0, fw * 16, 16, dtype=torch.float32), torch.arange(0, fh * 16, 16, dtype=torch.float32)
    yy, xx = torch.meshgrid(sy, sx, indexing="ij")
    shifts = torch.stack((xx.reshape(-1), yy.reshape(-1), xx.reshape(-1), yy.reshape(-1)), 1)
    anchors = (shifts.view(-1, 1, 4) + cell.view(1, -1, 4)).reshape(-1, 4)
    score, idx = obj.topk(min(6000, obj.numel()), sorted=True)
    boxes = _clip(_decode(reg[idx], anchors[idx], (1, 1, 1, 1)), w, h)
    keep = ((boxes[:, 2] - boxes[:, 0] + 1) >= 0) & ((boxes[:, 3] - boxes[:, 1] + 1) >= 0)
    boxes, score = boxes[keep], score[keep]
    return boxes[nms(boxes, score, 0.7)[:300]]


def _post(probs, boxes, mode, thresh=0.2):
    """-> (rows, labels, scores, class boxes) of filter_results (0), filter_results_peter (1), filter_results_fast
    (2)."""
    c = probs.shape[1]
    if mode == 1:
        mask = torch.zeros_like(probs)
        for j in range(1, c):
            mask[nms(boxes[:, j], probs[:, j], 0.3), j] = 1
        s, lab = (mask * probs).max(1)
        rows = s.nonzero().squeeze(1)
        s, lab = s[rows], lab[rows]
        idx = torch.sort(s, descending=True, stable=True)[1]
        n = int((s >= thresh).sum())
        idx = idx[:10] if n < 10 else idx[:100] if n > 100 else idx[:n]
        return rows[idx], lab[idx], s[idx], boxes[rows[idx], lab[idx]]
    if mode == 2:
        s, lab = probs[:, 1:].max(1)
        lab = lab + 1
        b = boxes[:, 0]
        cand = (((b[:, 2] - b[:, 0]) >= 0) & ((b[:, 3] - b[:, 1]) >= 0) & (s > thresh * 0.01)).nonzero().squeeze(1)
        kept = cand[nms(b[cand], s[cand], 0.5)]
        kept = kept[torch.sort(s[kept], descending=True, stable=True)[1]]
        n = min(max(int((s[kept] >= thresh).sum()), 10), 100)
        kept = kept[:n]
        return kept, lab[kept], s[kept], b[kept]
    for _ in range(11):
        rows, labs, scs = [], [], []
        for j in range(1, c):
            inds = (probs[:, j] > thresh).nonzero().squeeze(1)
            if len(inds):
                k = inds[nms(boxes[inds, j], probs[inds, j], 0.5)]
                rows.append(k), labs.append(torch.full_like(k, j)), scs.append(probs[k, j])
        rows, labs, scs = torch.cat(rows), torch.cat(labs), torch.cat(scs)
        if len(rows) > 100:
            kth = torch.kthvalue(scs, len(rows) - 100 + 1)[0]
            sel = scs >= kth
            rows, labs, scs = rows[sel], labs[sel], scs[sel]
        if len(rows) >= 10:
            break
        thresh /= 2
    return rows, labs, scs, boxes[rows, labs]


def vinvl_reference(net, path, mode=1, ignore=True):
    x, (ow, oh) = _image(path)
    w0, h0 = Image.open(path).size
    with torch.no_grad():
        c4 = net.backbone(x)
        props = _proposals(net, c4, ow, oh)
        feats = net.head(c4, props)
        probs = F.softmax(net.lin(feats, "roi_heads.box.predictor.cls_score"), -1)
        c = probs.shape[1]
        if ignore:
            boxes = props.repeat(1, c)
        else:
            boxes = _decode(net.lin(feats, "roi_heads.box.predictor.bbox_pred"), props, (10, 10, 5, 5))
        boxes = _clip(boxes.view(-1, c, 4), ow, oh)
        rows, labels, scores, out = _post(probs, boxes, mode)
        attr_in = torch.cat([net.head(c4, out), net.sd["attribute.predictor.cls_embedding.weight"][labels]], 1)
        attr = F.softmax(
            net.lin(F.relu(net.lin(attr_in, "attribute.predictor.fc_attr")), "attribute.predictor.attr_score"), -1
        )
        attr[:, 0] = 0
        n = int((attr > 0.05).sum())
        attr[attr <= 0.05] = 0
        if n > 100:
            attr[attr < torch.kthvalue(attr.flatten(), n - 100 + 1)[0]] = 0
        a_s, a_l = attr.topk(16, dim=1)
        rect = out.clone()
        rect[:, 0::2] *= w0 / ow
        rect[:, 1::2] *= h0 / oh
    return {
        "boxes": rect.numpy(),
        "features": feats[rows].numpy(),
        "class_ids": (labels - 1).numpy(),
        "scores": scores.numpy(),
        "attr_ids": (a_l[:, 0] - 1).numpy(),
        "attr_scores": a_s[:, 0].numpy(),
    }


def _iou(a, b):
    lt, rb = np.maximum(a[:, :2], b[:, :2]), np.minimum(a[:, 2:], b[:, 2:])
    inter = np.clip(rb - lt, 0, None).prod(1)
    area = lambda x: (x[:, 2] - x[:, 0]) * (x[:, 3] - x[:, 1])  # noqa: E731
    same = np.abs(a - b).max(1) < 1e-3  # identical degenerate (zero-width) boxes clipped at the border
    return np.where(same, 1.0, inter / np.maximum(area(a) + area(b) - inter, 1e-9))


# --- tests ----------------------------------------------------------------------------------------------
def test_weight_independent_facts():
    """The anchor table, the resize rule and the stored anchors (reference tables of maskrcnn_benchmark)."""
    cell = _generate_anchors()
    assert (
        cell[0].tolist() == [-15, -4, 30, 19]
        and cell[5].tolist() == [-8, -8, 23, 23]
        and cell[14].tolist() == [-168, -344, 183, 359]
    )
    assert mrcnn_size(333, 500, 600, 1000) == (600, 900) and mrcnn_size(683, 1024, 600, 1000) == (600, 899)
    assert mrcnn_size(500, 1000, 600, 1000) == (500, 1000) and mrcnn_size(600, 2000, 600, 1000) == (300, 1000)
    assert torch.equal(random_detector(narrow_spec()).proposal_generator.anchor_generator.cell_anchors[0], cell)


def test_older_identities_are_unchanged():
    """The ResNeXt / VinVL / grid fields stay out of a bottom-up identity, so stores written before them resume."""
    from extractors.recipes import recipe_from_config
    from extractors.spec import caffe_r101

    assert not {"groups", "stride_in_1x1", "stem_pool", "pixel_std"} & set(caffe_r101().to_dict())
    assert {"groups", "stride_in_1x1", "stem_pool"} <= set(narrow_spec().to_dict())
    caffe = recipe_from_config({"recipe": "caffe"}, "milvlg").to_dict()
    assert not {"nms_filter", "to_bgr255", "grid", "res5_dilation", "nms_variant"} & set(caffe)
    assert {"nms_filter", "to_bgr255", "nms_variant"} <= set(recipe_from_config({"recipe": "vinvl"}, "vinvl").to_dict())


@pytest.mark.parametrize("mode,ignore", [(1, True), (2, True), (0, True), (1, False)])
def test_extract_equals_the_release_pipeline(tmp_path, shared_data, vinvl_file, mode, ignore):
    files = [shared_data / "photos" / p for p in PHOTOS]
    store = tmp_path / "s"
    res = CliRunner().invoke(
        app,
        [
            "extract",
            "--device",
            "cpu",
            *map(str, files),
            "--weights",
            str(vinvl_file),
            "--store",
            str(store),
            "--workers",
            "0",
            "--set",
            "extract.feature_dtype=float32",
            "--set",
            f"extract.recipes.vinvl.nms_filter={mode}",
            "--set",
            f"extract.recipes.vinvl.ignore_box_regression={str(ignore).lower()}",
        ],
    )
    assert res.exit_code == 0, res.output
    st = FeatureStore(store)
    assert st.identity["layout"] == "vinvl" and st.identity["config"]["recipe"]["name"] == "vinvl"
    assert st.identity["config"]["recipe"]["nms_filter"] == mode
    net = _Net(vinvl_file)
    for f in files:
        ref = vinvl_reference(net, f, mode, ignore)
        got = st.get(str(int(f.stem.split("_")[-1])))
        assert got["boxes"].shape == ref["boxes"].shape and 10 <= ref["boxes"].shape[0] <= 100
        assert _iou(got["boxes"], ref["boxes"]).min() >= 0.999  # same boxes, same order
        np.testing.assert_array_equal(got["class_ids"], ref["class_ids"])
        np.testing.assert_allclose(got["class_scores"], ref["scores"], rtol=1e-4, atol=1e-6)
        has = ref["attr_scores"] > 0
        assert has.sum() >= 5
        np.testing.assert_array_equal(got["attr_ids"][has], ref["attr_ids"][has])
        np.testing.assert_allclose(
            got["features"], ref["features"], rtol=1e-4, atol=1e-4 * float(np.abs(ref["features"]).max())
        )
        if ignore:  # rect and feature come from the same proposal
            assert len(set(map(tuple, got["boxes"].round(3).tolist()))) == len(got["boxes"]) or mode == 0


def test_layout_variants_and_refusals(tmp_path, shared_data, vinvl_file):
    """No ``module.`` prefix, a ``{"model": ...}`` wrapper, no anchors or res5 copy: same output; a missing, extra
    or mislabelled key, a truncated file and a pickle with code are refused in one line, exit != 0."""
    photo = str(shared_data / "photos" / PHOTOS[0])
    model = random_detector(narrow_spec(), seed=3)
    outs = []
    for i, kw in enumerate([{}, {"module_prefix": False, "wrap": True, "anchors": False, "copies": False}]):
        p = save_vinvl(model, tmp_path / f"w{i}.pth", **kw)
        res = CliRunner().invoke(
            app,
            [
                "extract",
                "--device",
                "cpu",
                photo,
                "--weights",
                str(p),
                "--store",
                str(tmp_path / f"s{i}"),
                "--workers",
                "0",
            ],
        )
        assert res.exit_code == 0, res.output
        outs.append(FeatureStore(tmp_path / f"s{i}").get("132417"))
    np.testing.assert_array_equal(outs[0]["boxes"], outs[1]["boxes"])
    sd = torch.load(vinvl_file, weights_only=True)
    bad = {
        "missing": {k: v for k, v in sd.items() if "fc_attr.bias" not in k},
        "extra": {**sd, "module.roi_heads.box.predictor.extra.weight": torch.zeros(2)},
        "shape": {**sd, "module.roi_heads.box.predictor.cls_score.bias": torch.zeros(7)},
        "copy": {
            **sd,
            "module.attribute.feature_extractor.head.layer4.0.conv1.weight": sd[
                "module.attribute.feature_extractor.head.layer4.0.conv1.weight"
            ]
            + 1,
        },
    }
    for name, d in bad.items():
        torch.save(d, tmp_path / f"{name}.pth")
    (tmp_path / "trunc.pth").write_bytes(vinvl_file.read_bytes()[:5000])
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "evil.pth").write_bytes(pickle.dumps({"module.backbone.body.stem.conv1.weight": Evil()}))
    needles = {
        "missing": "1 missing key ('attribute.predictor.fc_attr.bias')",
        "extra": "unexpected key ('roi_heads.box.predictor.extra.weight')",
        "shape": "cls_score.bias' has shape [7]",
        "copy": "differs from the box head",
        "trunc": "cannot be read",
        "evil": "cannot be read",
    }
    for name, needle in needles.items():
        res = CliRunner().invoke(app, ["info", str(tmp_path / f"{name}.pth")])
        assert res.exit_code != 0 and needle in res.output, (name, res.output)
        assert "Traceback" not in res.output and "pwned" not in res.output
    res = CliRunner().invoke(app, ["info", str(vinvl_file)])
    assert (
        res.exit_code == 0
        and "layout: vinvl" in res.output
        and "recipe: vinvl" in res.output
        and "ResNeXt" in res.output
    )


def test_labelmap_names_and_refusals(tmp_path, shared_data, vinvl_file):
    import json

    lm = {
        "label_to_idx": {f"obj{i}": i + 1 for i in range(40)},
        "attribute_to_idx": {f"att{i}": i + 1 for i in range(30)},
    }
    (tmp_path / "lm.json").write_text(json.dumps(lm))
    photo = str(shared_data / "photos" / PHOTOS[0])
    res = CliRunner().invoke(
        app,
        [
            "extract",
            "--device",
            "cpu",
            photo,
            "--weights",
            str(vinvl_file),
            "--store",
            str(tmp_path / "s"),
            "--workers",
            "0",
            "--set",
            f"extract.labelmap={tmp_path / 'lm.json'}",
        ],
    )
    assert res.exit_code == 0, res.output
    assert len(FeatureStore(tmp_path / "s").identity["config"]["labelmap_sha256"]) == 64
    lm["label_to_idx"] = {f"obj{i}": i + 1 for i in range(39)}
    (tmp_path / "bad.json").write_text(json.dumps(lm))
    res = CliRunner().invoke(
        app,
        [
            "extract",
            "--device",
            "cpu",
            photo,
            "--weights",
            str(vinvl_file),
            "--store",
            str(tmp_path / "s2"),
            "--workers",
            "0",
            "--set",
            f"extract.labelmap={tmp_path / 'bad.json'}",
        ],
    )
    assert res.exit_code != 0 and "names 39 classes" in res.output
    res = CliRunner().invoke(
        app,
        [
            "extract",
            "--device",
            "cpu",
            photo,
            "--weights",
            str(vinvl_file),
            "--store",
            str(tmp_path / "s3"),
            "--workers",
            "0",
            "--set",
            "extract.recipes.vinvl.nms_filter=2",
            "--set",
            "extract.recipes.vinvl.ignore_box_regression=false",
        ],
    )
    assert res.exit_code == 2 and "nms_filter 2 needs ignore_box_regression" in res.output


def test_nms_variants_and_the_shared_graph_path():
    """``nms_variant``: torchvision (IoU > t, no +1), legacy-cuda (+1 areas, >), legacy-cpu (+1 areas, >=); the
    one-overlap-graph path of ``nms_filter`` 1 keeps what the per-class loop keeps."""
    boxes = torch.tensor([[0.0, 0.0, 9.0, 9.0], [0.0, 0.0, 9.0, 4.0]])  # IoU 36/81 without +1, 50/100 with +1
    scores = torch.tensor([0.9, 0.8])
    assert vinvl_select.nms_keep(boxes, scores, 0.5, "torchvision").tolist() == [0, 1]
    assert vinvl_select.nms_keep(boxes, scores, 0.5, "legacy-cuda").tolist() == [0, 1]
    assert vinvl_select.nms_keep(boxes, scores, 0.5, "legacy-cpu").tolist() == [0]
    assert vinvl_select.nms_keep(boxes, scores, 0.44, "torchvision").tolist() == [0]  # 36 / 81 > 0.44
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(120, 2, generator=g) * 300
    props = torch.cat([xy, xy + 20 + torch.rand(120, 2, generator=g) * 150], 1)
    probs = torch.softmax(torch.randn(120, 31, generator=g) * 2, 1)
    cls_boxes = props[:, None, :].expand(120, 31, 4).contiguous()
    for variant in ("torchvision", "legacy-cpu"):
        recipe = SimpleNamespace(nms_variant=variant, nms_thresh=0.3, conf_thresh=0.2, min_boxes=10, max_boxes=100)
        a = vinvl_select.filter_peter(cls_boxes, probs, recipe, same_boxes=True)
        b = vinvl_select.filter_peter(cls_boxes, probs, recipe, same_boxes=False)
        assert torch.equal(a.rows, b.rows) and torch.equal(a.labels, b.labels) and a.rows.numel() >= 10
