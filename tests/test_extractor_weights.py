"""Weights: every public layout written in its real container with random values, loaded strictly."""

from __future__ import annotations

import os
import pickle
from collections import OrderedDict

import numpy as np
import pytest
import torch
from detector_helpers import read_raw, save_layout
from extract_helpers import tiny_spec
from typer.testing import CliRunner

from cli import app
from extractors import weights as W
from extractors.random_weights import random_detector
from extractors.spec import BottomUpSpec

SUFFIX = {"milvlg": ".pth", "airsplay": ".pkl", "hf": ".bin"}
FLAVOR = {"milvlg": "caffe", "airsplay": "d2", "hf": "d2"}


def _write(tmp_path, layout, spec=None, seed=0):
    spec = (spec or tiny_spec()).with_(flavor=FLAVOR[layout])
    model = random_detector(spec, seed)
    path = save_layout(model.state_dict(), layout, tmp_path / f"w{SUFFIX[layout]}")
    return model, path


@pytest.mark.parametrize("layout", ["milvlg", "airsplay", "hf"])
def test_each_layout_roundtrips_through_its_container(tmp_path, layout):
    model, path = _write(tmp_path, layout, tiny_spec(stage_blocks=(2, 1, 3), res5_blocks=2))
    loaded, info = W.load_detector(path)
    assert info["layout"] == layout
    assert loaded.spec.flavor == FLAVOR[layout]
    assert loaded.spec.stage_blocks == (2, 1, 3) and loaded.spec.res5_blocks == 2
    assert (loaded.spec.num_classes, loaded.spec.num_attributes) == (21, 11)
    a, b = model.state_dict(), loaded.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert info["weights_sha256"] == W.sha256_file(path) and len(info["weights_sha256"]) == 64


def test_container_formats_are_the_public_ones(tmp_path):
    _, pkl = _write(tmp_path, "airsplay")
    with open(pkl, "rb") as fh:
        raw = W.RestrictedUnpickler(fh, encoding="latin1").load()
    assert set(raw) == {"model", "__author__"} and all(isinstance(v, np.ndarray) for v in raw["model"].values())
    assert "roi_heads.box_predictor.cls_embedding.weight" in raw["model"]
    assert not any(k.endswith("num_batches_tracked") for k in raw["model"])
    _, binf = _write(tmp_path, "hf")
    sd = torch.load(binf, weights_only=True)
    assert (
        "model" not in sd and sum(k.endswith("num_batches_tracked") for k in sd) == 1 + 4 * 4
    )  # tiny: stem + 4 blocks x (3 convs + shortcut)
    assert sd["proposal_generator.rpn_head.objectness_logits.weight"].shape[0] == 12
    _, pth = _write(tmp_path, "milvlg")
    sd = torch.load(pth, weights_only=True)["model"]
    assert sd["proposal_generator.rpn_head.objectness_logits.weight"].shape[0] == 24
    assert sd["roi_heads.box_predictor.bbox_pred.weight"].shape[0] == 21 * 4
    assert "roi_heads.box_predictor.attr_linear1.weight" in sd


def test_full_size_key_tables_match_the_reference():
    hf, opt = W.expected_table("hf", BottomUpSpec(flavor="d2"))
    assert len(hf) == 640 and not opt
    assert sum(int(np.prod(s)) for k, s in hf.items() if not k.endswith("num_batches_tracked")) == 65_545_214
    assert sum(k.endswith("num_batches_tracked") for k in hf) == 104
    air, opt = W.expected_table("airsplay", BottomUpSpec(flavor="d2"))
    assert len([k for k in air if not k.endswith("num_batches_tracked")]) == 536
    assert W.ANCHOR_KEY in opt and len(opt) == 1 + 104  # anchors and BatchNorm counters may be absent
    mil, _ = W.expected_table("milvlg", BottomUpSpec())
    want = {
        "backbone.stem.conv1.weight": (64, 3, 7, 7),
        "backbone.stem.conv1.norm.running_var": (64,),
        "backbone.res2.0.shortcut.weight": (256, 64, 1, 1),
        "backbone.res3.0.conv1.weight": (128, 256, 1, 1),
        "backbone.res4.0.shortcut.weight": (1024, 512, 1, 1),
        "backbone.res4.0.conv1.weight": (256, 512, 1, 1),
        "backbone.res4.22.conv3.weight": (1024, 256, 1, 1),
        W.ANCHOR_KEY: (12, 4),
        "proposal_generator.rpn_head.conv.weight": (512, 1024, 3, 3),
        "proposal_generator.rpn_head.objectness_logits.weight": (24, 512, 1, 1),
        "proposal_generator.rpn_head.anchor_deltas.weight": (48, 512, 1, 1),
        "roi_heads.res5.0.shortcut.weight": (2048, 1024, 1, 1),
        "roi_heads.res5.0.conv1.weight": (512, 1024, 1, 1),
        "roi_heads.res5.0.conv2.weight": (512, 512, 3, 3),
        "roi_heads.res5.2.conv1.weight": (512, 2048, 1, 1),
        "roi_heads.box_predictor.cls_score.weight": (1601, 2048),
        "roi_heads.box_predictor.bbox_pred.weight": (6404, 2048),
        "roi_heads.box_predictor.cls_embed.weight": (1601, 256),
        "roi_heads.box_predictor.attr_linear1.weight": (512, 2304),
        "roi_heads.box_predictor.attr_linear2.weight": (401, 512),
    }
    for k, s in want.items():
        assert mil[k] == s, k
    assert "backbone.res4.23.conv1.weight" not in mil and "roi_heads.res5.3.conv1.weight" not in mil
    assert hf["roi_heads.box_predictor.bbox_pred.weight"] == (6400, 2048)
    assert hf["roi_heads.box_predictor.fc_attr.weight"] == (512, 2304)


@pytest.mark.parametrize("layout", ["milvlg", "hf"])
def test_wrong_shape_missing_and_unexpected_keys_are_refused_naming_the_key(tmp_path, layout):
    model, _ = _write(tmp_path, layout)
    sd = OrderedDict((W.to_layout_key(k, layout), v.clone()) for k, v in model.state_dict().items())
    if layout == "hf":
        for k in list(sd):
            if k.endswith("running_var"):
                sd[k[: -len("running_var")] + "num_batches_tracked"] = torch.tensor(0)
    key = "backbone.res3.0.conv2.weight"
    bad = OrderedDict(sd)
    bad[key] = torch.zeros(3, 3, 3, 3)
    torch.save(bad, tmp_path / f"bad{SUFFIX[layout]}")
    with pytest.raises(W.WeightsError, match=rf"key '{key}' has shape \[3, 3, 3, 3\], expected \[8, 8, 3, 3\]"):
        W.load_detector(tmp_path / f"bad{SUFFIX[layout]}")
    gone = OrderedDict(sd)
    del gone["roi_heads.res5.0.conv3.norm.bias"]
    torch.save(gone, tmp_path / f"gone{SUFFIX[layout]}")
    with pytest.raises(W.WeightsError, match="missing key 'roi_heads.res5.0.conv3.norm.bias'"):
        W.load_detector(tmp_path / f"gone{SUFFIX[layout]}")
    extra = OrderedDict(sd)
    extra["roi_heads.box_predictor.rel_score.weight"] = torch.zeros(2, 2)
    torch.save(extra, tmp_path / f"extra{SUFFIX[layout]}")
    with pytest.raises(W.WeightsError, match="unexpected key 'roi_heads.box_predictor.rel_score.weight'"):
        W.load_detector(tmp_path / f"extra{SUFFIX[layout]}")


def test_preset_with_other_semantics_or_architecture_is_refused(tmp_path):
    _, pth = _write(tmp_path, "milvlg")
    with pytest.raises(W.WeightsError, match="expects d2"):
        W.load_detector(pth, tiny_spec(flavor="d2"))
    with pytest.raises(W.WeightsError, match="key 'backbone.stem.conv1.weight' has shape"):
        W.load_detector(pth, BottomUpSpec())  # the full R-101 preset vs a tiny file


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch " + os.environ.get("EVIL_MARK", "/tmp/never"),))


def test_malicious_pickle_is_refused_and_never_executed(tmp_path, monkeypatch):
    mark = tmp_path / "pwned"
    monkeypatch.setenv("EVIL_MARK", str(mark))
    evil = tmp_path / "faster_rcnn_from_caffe_attr.pkl"
    with open(evil, "wb") as fh:
        pickle.dump({"model": {"backbone.stem.conv1.weight": _Evil()}}, fh, protocol=2)
    with pytest.raises(W.WeightsError, match=r"refused.*(posix|os)\.system"):
        W.load_detector(evil)
    assert not mark.exists()
    # an object-dtype array would smuggle arbitrary objects: refused too
    obj = tmp_path / "obj.pkl"
    with open(obj, "wb") as fh:
        pickle.dump({"model": {"a": np.array([1, "x"], dtype=object)}}, fh, protocol=2)
    with pytest.raises(W.WeightsError):
        read_raw(obj)
    # a torch file carrying a pickled object is refused by weights_only loading
    bad_pth = tmp_path / "evil.pth"
    torch.save({"model": {"x": _Evil()}}, bad_pth)
    with pytest.raises(W.WeightsError, match="weights_only=True"):
        W.load_detector(bad_pth)
    assert not mark.exists()


def test_cli_info_reports_the_layout(tmp_path):
    _, pkl = _write(tmp_path, "airsplay")
    res = CliRunner().invoke(app, ["info", str(pkl)])
    assert res.exit_code == 0, res.output
    assert "layout: airsplay" in res.output and "semantics: d2" in res.output and "ResNet-14" in res.output
    assert W.sha256_file(pkl) in res.output.replace("\n", "")
    broken = tmp_path / "broken.bin"
    broken.write_bytes(b"not a torch file")
    res = CliRunner().invoke(app, ["info", str(broken)])
    assert res.exit_code == 1 and "cannot be read" in res.output and "Traceback" not in res.output


def test_milvlg_file_with_batchnorm_counters_and_without_anchors_loads(tmp_path):
    """The MILVLG .pth contents are undocumented (docs/extractor.md#weights-layouts): counters tolerated, anchors
    default to Caffe's."""
    model = random_detector(tiny_spec(), 0)
    sd = OrderedDict(model.state_dict())
    del sd[W.ANCHOR_KEY]
    sd["backbone.res2.0.conv1.norm.num_batches_tracked"] = torch.tensor(5)
    torch.save(sd, tmp_path / "bare.pth")
    loaded, info = W.load_detector(tmp_path / "bare.pth")
    assert info["layout"] == "milvlg" and not info["anchors_from_file"]
    assert loaded.proposal_generator.anchor_generator.cell_anchors[0][0].tolist() == [-38.0, -16.0, 53.0, 31.0]


def test_airsplay_file_without_attribute_head(tmp_path):
    """``faster_rcnn_from_caffe.pkl`` (no attribute head): loads as a detector without attribute outputs."""
    spec = tiny_spec(flavor="d2", has_attributes=False)
    path = save_layout(random_detector(spec, 0).state_dict(), "airsplay", tmp_path / "faster_rcnn_from_caffe.pkl")
    model, info = W.load_detector(path)
    assert info["layout"] == "airsplay" and not model.spec.has_attributes
    assert not hasattr(model.roi_heads.box_predictor, "attr_linear1")
    assert W.describe(path)["attributes"] == 0
