"""VinVL regions and grid features on CUDA equal the CPU (``pytest -m gpu``; skipped, with the reason, without
CUDA): random narrow weights in the release layouts, fp32 (TF32 off) on both devices. Tolerances as in
``test_gpu_paths.py``: boxes 0.05 px, features 1e-3 of the largest value and cosine 0.9999 (the same arithmetic
in other summation orders and cuDNN algorithms)."""

from __future__ import annotations

import numpy as np
import pytest
from detector_helpers import random_grid_feats_file, save_vinvl
from test_grid import grid_spec
from test_vinvl import PHOTOS, narrow_spec
from typer.testing import CliRunner

from cli import app
from extractors.random_weights import random_detector
from pipeline.store import FeatureStore

pytestmark = pytest.mark.gpu


def _both(tmp_path, weights, paths, *extra):
    out = []
    for dev in ("cuda", "cpu"):
        res = CliRunner().invoke(
            app,
            [
                "extract",
                *paths,
                "--weights",
                str(weights),
                "--store",
                str(tmp_path / dev),
                "--device",
                dev,
                "--precision",
                "fp32",
                "--num-workers",
                "0",
                "--set",
                "extract.feature_dtype=float32",
                *extra,
            ],
        )
        assert res.exit_code == 0, res.output
        out.append(FeatureStore(tmp_path / dev))
    return out


def _close(a, b, classes=True):
    assert a["boxes"].shape == b["boxes"].shape
    assert float(np.abs(a["boxes"] - b["boxes"]).max()) <= 0.05
    fa, fb = a["features"].astype(np.float64), b["features"].astype(np.float64)
    assert float(np.abs(fa - fb).max() / max(np.abs(fb).max(), 1e-30)) <= 1e-3
    cos = (fa * fb).sum(1) / (np.linalg.norm(fa, axis=1) * np.linalg.norm(fb, axis=1) + 1e-30)
    assert float(cos.min()) >= 0.9999
    if classes:
        assert np.array_equal(a["class_ids"], b["class_ids"])


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_vinvl_regions_on_cuda_match_the_cpu(shared_data, tmp_path, mode):
    w = save_vinvl(random_detector(narrow_spec(), seed=3), tmp_path / "vinvl.pth")
    paths = [str(shared_data / "photos" / p) for p in PHOTOS]
    gpu, cpu = _both(tmp_path, w, paths, "--set", f"extract.recipes.vinvl.nms_filter={mode}")
    for key in cpu.keys():
        _close(gpu.get(key), cpu.get(key))


@pytest.mark.parametrize("deform", [(), (4, 5)])
def test_grid_on_cuda_matches_the_cpu(shared_data, tmp_path, deform):
    w = tmp_path / "X-152.pth"
    random_grid_feats_file(grid_spec(deform_stages=deform), w, seed=4)
    gpu, cpu = _both(
        tmp_path, w, [str(shared_data / "photos" / PHOTOS[0])], "--set", "extract.recipes.grid-feats.grid=7"
    )
    _close(gpu.get("132417"), cpu.get("132417"), classes=False)
