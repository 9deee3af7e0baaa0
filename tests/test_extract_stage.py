"""Extraction as a stage (extractors/stage.py): `cli extract` and the demo run the same stage function through
run_stage, write the same store, and a store-as-stage accumulates (a new pass) where the demo's stage is strict."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from extract_helpers import TINY_SET
from typer.testing import CliRunner

from cli import app
from extractors.stage import ExtractJob, extract_features
from pipeline.core.config import load_config
from pipeline.core.errors import UsageError
from pipeline.store import FeatureStore

SETTINGS = [TINY_SET, "extract.min_size=200", "extract.max_size=333", "extract.num_workers=0", "extract.batch_size=2"]


def _photos(tmp_path: Path, shared_data: Path, names: list[str]) -> Path:
    d = tmp_path / "photos"
    d.mkdir(exist_ok=True)
    for n in names:
        shutil.copy(shared_data / "photos" / n, d / n)
    return d


def _cli(*args: str):
    sets = [x for s in SETTINGS for x in ("--set", s)]
    return CliRunner().invoke(app, ["extract", *args, "--weights", "random", *sets])


def test_cli_and_demo_path_write_the_same_store_through_run_stage(tmp_path, shared_data):
    photos = _photos(tmp_path, shared_data, ["000456.jpg", "000542.jpg", "001150.jpg"])
    cli_store = tmp_path / "cli-store"
    res = _cli(str(photos), "--store", str(cli_store))
    assert res.exit_code == 0, res.output
    assert "extracted 3, skipped (already in store) 0, failed 0 of 3 images" in res.output
    manifest = json.loads((cli_store / "manifest.json").read_text())  # the CLI went through run_stage
    assert manifest["stage"] == "cli-store" and manifest["summary"]["extracted"] == 3
    assert (
        manifest["config"]["job"]["paths"] == [str(photos.absolute())]
        and manifest["config"]["job"]["weights"] == "random"
    )
    assert not (cli_store / "running.json").exists()

    section = load_config("extract", None, SETTINGS).extract
    result = extract_features(tmp_path / "run", "features", section, ExtractJob("random", (str(photos),)))
    assert not result.skipped and result.outputs == {"store": "store", "failures": "failures.jsonl"}
    a, b = FeatureStore(cli_store), FeatureStore(result.directory / "store")
    assert sorted(a.keys()) == sorted(b.keys()) == ["000456.jpg", "000542.jpg", "001150.jpg"]
    assert a.identity == b.identity
    for key in a.keys():
        ra, rb = a.get(key), b.get(key)
        np.testing.assert_array_equal(ra["features"], rb["features"])
        np.testing.assert_array_equal(ra["boxes"], rb["boxes"])
        np.testing.assert_array_equal(ra["class_ids"], rb["class_ids"])
    # the demo's stage is strict: done -> skipped; another config -> refused (no silent mix in one stage)
    assert extract_features(tmp_path / "run", "features", section, ExtractJob("random", (str(photos),))).skipped
    other = load_config("extract", None, [*SETTINGS, "extract.conf_thresh=0.3"]).extract
    with pytest.raises(UsageError, match="different config"):
        extract_features(tmp_path / "run", "features", other, ExtractJob("random", (str(photos),)))


def test_a_cli_store_accumulates_new_inputs_and_skips_a_finished_pass(tmp_path, shared_data):
    photos = _photos(tmp_path, shared_data, ["000456.jpg", "000542.jpg"])
    store = tmp_path / "feats"
    assert _cli(str(photos / "000456.jpg"), "--store", str(store)).exit_code == 0
    again = _cli(str(photos / "000456.jpg"), "--store", str(store))
    assert again.exit_code == 0 and "already done with this config" in again.output
    assert "extracted 1, skipped (already in store) 0" in again.output  # the finished pass, as recorded
    more = _cli(str(photos), "--store", str(store))  # other inputs: a new pass over the same store
    assert more.exit_code == 0 and "extracted 1, skipped (already in store) 1, failed 0 of 2 images" in more.output
    assert sorted(FeatureStore(store).keys()) == ["000456.jpg", "000542.jpg"]
    assert json.loads((store / "manifest.json").read_text())["summary"]["already_in_store"] == 1


def test_usage_errors_leave_no_stage_folder(tmp_path, shared_data):
    photos = _photos(tmp_path, shared_data, ["000456.jpg"])
    for args in (["--boxes", "17"], ["--boxes", "given"]):
        res = _cli(str(photos), "--store", str(tmp_path / "s"), *args)
        assert res.exit_code == 2 and res.output.count("error:") == 1
    res = CliRunner().invoke(
        app, ["extract", str(photos), "--weights", str(tmp_path / "nope.pth"), "--store", str(tmp_path / "s")]
    )
    assert res.exit_code == 2 and "weights file not found" in res.output
    assert not (tmp_path / "s").exists()
