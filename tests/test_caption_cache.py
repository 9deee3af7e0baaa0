"""`caption --cache` accepts any store that agrees on what determines the features, and names the field
that differs when it refuses."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from store_helpers import IDENTITY, add_image, synthetic_image
from test_caption import checkpoint, detector, run_caption  # noqa: F401  (the tiny captioner and detector)
from typer.testing import CliRunner

from cli import app
from pipeline.core.errors import UsageError
from pipeline.core.identity import FeatureIdentity
from pipeline.store import FeatureStore, open_writer

EXTRACTED = {
    "name": "bottom-up-random",
    "weights_sha256": "abc",
    "layout": "random",
    "config": {
        "spec": {"min_size": 160},
        "precision": "fp32",
        "boxes": {"mode": "adaptive", "min": 10, "max": 100, "conf": 0.2, "nms": 0.3},
    },
}


def feature_settings_diff(stored: dict, given: dict) -> list[str]:
    return FeatureIdentity.from_dict(stored).settings_diff(FeatureIdentity.from_dict(given))


def test_feature_settings_diff_names_the_field() -> None:
    captioned = {
        "name": "other-name",
        "weights_sha256": "abc",
        "layout": "milvlg",
        "config": {"spec": {"min_size": 160}, "boxes": dict(EXTRACTED["config"]["boxes"])},
    }
    assert feature_settings_diff(EXTRACTED, captioned) == []  # name, layout: not feature settings; fp32 default
    captioned["config"]["boxes"]["max"] = 36
    assert feature_settings_diff(EXTRACTED, captioned) == ["config.boxes.max (stored 100, given 36)"]
    assert feature_settings_diff(EXTRACTED, dict(EXTRACTED, weights_sha256="def")) == [
        'weights_sha256 (stored "abc", given "def")'
    ]
    bf16 = dict(EXTRACTED, config=dict(EXTRACTED["config"], precision="bf16"))
    assert feature_settings_diff(EXTRACTED, bf16) == ['config.precision (stored "fp32", given "bf16")']
    recipe = dict(EXTRACTED, config=dict(EXTRACTED["config"], recipe={"rescale": "caffe"}))
    assert feature_settings_diff(recipe, dict(recipe, config=dict(recipe["config"], recipe={"rescale": "d2"}))) == [
        'config.recipe.rescale (stored "caffe", given "d2")'
    ]


def test_writer_in_features_mode_keeps_the_store_identity_and_dtype(tmp_path: Path) -> None:
    with open_writer(tmp_path / "s", IDENTITY, feature_dtype="float32") as w:
        add_image(w, synthetic_image(0))
    given = dict(IDENTITY, name="renamed", layout="x")
    with pytest.raises(UsageError, match="different extractor"):
        open_writer(tmp_path / "s", given)
    with open_writer(tmp_path / "s", given, match="features") as w:
        add_image(w, synthetic_image(1))
    st = FeatureStore(tmp_path / "s")
    assert st.identity == IDENTITY and st.feature_dtype == "float32" and len(st) == 2
    other = dict(IDENTITY, config={"boxes": [10, 36]})
    with pytest.raises(
        UsageError,
        match=r"weights_sha256 \(stored \"0+\", given \"1+\"\); config\.boxes \(stored \[10, 30\], given \[10, 36\]\)",
    ):
        open_writer(tmp_path / "s", dict(other, weights_sha256="1" * 64), match="features")


def test_caption_reuses_a_store_written_by_extract(
    checkpoint: Path,  # noqa: F811
    detector: Path,  # noqa: F811
    shared_data: Path,
    tmp_path: Path,
) -> None:
    photo = tmp_path / "000456.jpg"
    shutil.copy(shared_data / "photos" / "000456.jpg", photo)
    store = tmp_path / "store"
    res = CliRunner().invoke(
        app,
        [
            "extract",
            str(photo),
            "--weights",
            str(detector),
            "--store",
            str(store),
            "--workers",
            "0",
            "--set",
            "extract.min_size=160",
            "--set",
            "extract.max_size=256",
        ],
    )
    assert res.exit_code == 0, res.output
    segments = sorted(p.name for p in store.glob("seg-*.h5"))
    res = run_caption(str(photo), "--model", str(checkpoint), "--weights", str(detector), "--cache", str(store))
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in store.glob("seg-*.h5")) == segments  # read from the store, nothing re-extracted
    res = run_caption(
        str(photo),
        "--model",
        str(checkpoint),
        "--weights",
        str(detector),
        "--cache",
        str(store),
        "--set",
        'caption.boxes="36"',
    )
    assert res.exit_code == 2 and "config.boxes.max (stored 100, given 36)" in res.output
