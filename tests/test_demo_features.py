"""The demo's feature switch: ``--features region,grid`` (config pieces; the full run is the demo itself)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli import app
from extractors.recipes import recipe_from_config
from pipeline.core.config import load_config
from pipeline.core.errors import UsageError
from pipeline.demo import demo_feature_kinds, grid_extract_section


def test_grid_section_and_kinds():
    cfg = load_config("demo", None, ["demo.grid=5"])
    assert demo_feature_kinds(cfg) == ["region"] and demo_feature_kinds(cfg, ["region", "grid"]) == ["region", "grid"]
    for bad in (["grid", "grid"], ["regions"], []):
        with pytest.raises(UsageError, match="demo features"):
            demo_feature_kinds(cfg, bad)
    r = recipe_from_config(grid_extract_section(cfg), "butd", "caffe")
    assert (r.name, r.selector, r.grid, r.min_size, r.pixel_mean) == ("grid-feats", "grid", 5, None, None)
    assert recipe_from_config(cfg.extract, "butd", "caffe").name == "caffe"


def test_cli_refuses_an_unknown_feature_kind(tmp_path):
    res = CliRunner().invoke(
        app, ["demo", "--out", str(tmp_path / "d"), "--features", "region,pixels", "--num-images", "20"]
    )
    assert res.exit_code == 2 and "demo features" in res.output
