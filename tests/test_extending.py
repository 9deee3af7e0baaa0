"""docs/extending.md, followed to the letter: its toy captioner (one module + one YAML) and toy importer (one
module + one Format record) are written into a temporary folder exactly as printed, loaded through
BUTD_PLUGINS, and run through the CLI (import, export, info, train, evaluate)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from pipeline.store import FeatureStore
from train_helpers import make_world_run

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "extending.md"


def documented_files(dest: Path) -> list[str]:
    """Write every block that follows ``<!-- file: NAME -->`` in docs/extending.md to ``dest/NAME``."""
    blocks = re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", DOC.read_text(), re.S)
    dest.mkdir(parents=True, exist_ok=True)
    for name, body in blocks:
        (dest / name).write_text(body)
    return [name for name, _ in blocks]


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> dict[str, str]:
    plugins = tmp_path_factory.mktemp("plugins")
    assert sorted(documented_files(plugins)) == ["toy.yaml", "toy_captioner.py", "toy_importer.py"]
    return dict(
        os.environ,
        BUTD_PLUGINS="toy_captioner,toy_importer",
        PYTHONPATH=os.pathsep.join([str(plugins), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        BUTD_NO_PROGRESS="1",
        OMP_NUM_THREADS="1",
        BUTD_THREADS="1",
    )


def test_toy_importer_imports_and_exports_through_the_cli(cli, tmp_path, plugin_env):
    help_text = cli("import-features", "--help", env=plugin_env).stdout
    assert "toy-npz" in help_text and "one KEY.npz per image" in help_text
    assert "toy-npz" in cli("export-features", "--help", env=plugin_env).stdout
    rng = np.random.default_rng(0)
    src = tmp_path / "toy"
    src.mkdir()
    expected = {}
    for key, k in (("a", 3), ("b", 1), ("c", 5)):
        feats = rng.random((k, 16), dtype=np.float32)
        xs, ys = np.sort(rng.uniform(0, 60, (k, 2)), axis=1), np.sort(rng.uniform(0, 40, (k, 2)), axis=1)
        boxes = np.stack([xs[:, 0], ys[:, 0], xs[:, 1], ys[:, 1]], axis=1).astype(np.float32)
        np.savez(src / f"{key}.npz", features=feats, boxes=boxes, size=np.array([60, 40]))
        expected[key] = (feats, boxes)
    store = tmp_path / "store"
    res = cli(
        "import-features", str(src), "--format", "toy-npz", "--store", str(store), "--dtype", "float32", env=plugin_env
    )
    assert res.returncode == 0, res.stderr
    assert "imported: 3" in res.stdout
    st = FeatureStore(store)
    assert sorted(st.keys()) == ["a", "b", "c"] and st.identity["name"] == "imported:toy-npz"
    for key, (feats, boxes) in expected.items():
        np.testing.assert_array_equal(st.get(key)["features"], feats)
        np.testing.assert_array_equal(st.get(key)["boxes"], boxes)
        assert st.image_size(key) == (60, 40)
    out = tmp_path / "toy.txt"
    res = cli("export-features", str(store), "--format", "toy-npz", "--output", str(out), env=plugin_env)
    assert res.returncode == 0 and "rows written: 3" in res.stdout, res.stderr
    assert sorted(out.read_text().splitlines()) == ["a\t3", "b\t1", "c\t5"]
    (src / "bad.npz").write_bytes(b"not a zip")  # the reader's PipelineError: one line, exit 2 (a bad input file)
    res = cli("import-features", str(src), "--format", "toy-npz", "--store", str(tmp_path / "s2"), env=plugin_env)
    assert res.returncode == 2 and res.stderr.count("error:") == 1 and "not a toy feature file" in res.stderr


def test_toy_captioner_is_built_trained_and_evaluated_through_the_cli(cli, tmp_path, plugin_env):
    res = cli("info", "--model", "toy", env=plugin_env)
    assert res.returncode == 0, res.stderr
    # image 2048*32+32, embedding 10000*32, GRU cell 2*(96*32)+2*96, output 32*10000+10000 (vocabulary 10,000)
    assert "parameters: 721904 " in res.stdout and "hidden: 32" in res.stdout
    assert "parameters: 364416 " in cli("info", "--model", "toy", "--set", "hidden=16", env=plugin_env).stdout

    run = make_world_run(tmp_path, num_images=40)
    res = cli(
        "train",
        "--out",
        str(tmp_path / "out"),
        "--set",
        "train.model=toy",
        "--set",
        f"train.store={run / 'features/store'}",
        "--set",
        f"train.data={run / 'data'}",
        "--set",
        "train.stages=[xe]",
        "--set",
        "train.preload=memory",
        "--device",
        "cpu",
        "--num-workers",
        "0",
        env=plugin_env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    stage = tmp_path / "out" / "train-toy"
    log = [json.loads(line) for line in (stage / "log.jsonl").read_text().splitlines()]
    epochs = sorted({r["epoch"] for r in log if r.get("stage") == "xe" and "epoch" in r})
    assert epochs == [0, 1]  # the card's schedule: xe epochs 2
    metrics = tmp_path / "metrics.json"
    res = cli(
        "evaluate",
        "--model",
        str(stage / "best.pt"),
        "--store",
        str(run / "features/store"),
        "--data",
        str(run / "data"),
        "--split",
        "test",
        "--metrics",
        "bleu,cider",
        "--set",
        "evaluate.tokenizer=simple",
        "--output",
        str(metrics),
        env=plugin_env,
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(metrics.read_text())
    assert (
        report["model"] == "toy" and report["decoding"]["beam_size"] == 2 and report["decoding"]["max_len"] == 16
    )  # the card's decoding
    assert 0.0 <= report["metrics"]["CIDEr"] and report["num_images"] > 0


def test_a_plugin_that_cannot_be_imported_is_one_line(cli, plugin_env):
    res = cli("info", env=dict(plugin_env, BUTD_PLUGINS="toy_captioner,no_such_plugin"))
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0
    assert "BUTD_PLUGINS: cannot import 'no_such_plugin'" in res.stderr
