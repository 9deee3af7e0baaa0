"""docs/extending.md, followed to the letter: its toy captioner (one module + one YAML), toy importer (one
module + one Format record) and toy detector release (one module + one Release record) are written into a
temporary folder exactly as printed, loaded through BUTD_PLUGINS, and run through the CLI (import, export,
info, train, evaluate, extract): each command in a child forked from an interpreter that started ``cli.py`` with
the plugins' environment (tests/forked_cli.py), a plugin that cannot be imported in a ``cli.py`` of its own."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from detector_helpers import save_layout
from extract_helpers import tiny_spec
from forked_cli import ForkedCli
from PIL import Image
from train_helpers import make_world_run

from extractors.random_weights import random_detector
from pipeline.store import FeatureStore

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
    assert sorted(documented_files(plugins)) == ["toy.yaml", "toy_captioner.py", "toy_importer.py", "toy_release.py"]
    return dict(
        os.environ,
        BUTD_PLUGINS="toy_captioner,toy_importer",
        PYTHONPATH=os.pathsep.join([str(plugins), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        BUTD_NO_PROGRESS="1",
        OMP_NUM_THREADS="1",
        BUTD_THREADS="1",
    )


@pytest.fixture(scope="module")
def plugin_cli(cli):
    """``plugin_cli(*args, env=ENV)``: ``cli.py ARGS`` in a child forked from an interpreter that started ``cli.py``
    with ``ENV`` (the plugins its BUTD_PLUGINS names loaded at start-up), one such interpreter per environment."""
    servers: dict[tuple, ForkedCli] = {}

    def run(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
        full = cli.environment(env)
        key = tuple(sorted(full.items()))
        if key not in servers:
            servers[key] = ForkedCli(full)
        try:
            return servers[key](*args, env=full, timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`cli.py {' '.join(args[:2])}` still ran after {timeout} s")

    yield run
    for server in servers.values():
        server.close()


def test_toy_importer_imports_and_exports_through_the_cli(plugin_cli, tmp_path, plugin_env):
    help_text = plugin_cli("import-features", "--help", env=plugin_env).stdout
    assert "toy-npz" in help_text and "one KEY.npz per image" in help_text
    assert "toy-npz" in plugin_cli("export-features", "--help", env=plugin_env).stdout
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
    res = plugin_cli("import-features", str(src), "--format", "toy-npz", "--store", str(store), env=plugin_env)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0  # no release claims the format
    assert "no release claims the files of format 'toy-npz'" in res.stderr and "--release" in res.stderr
    res = plugin_cli(
        "import-features",
        str(src),
        "--format",
        "toy-npz",
        "--store",
        str(store),
        "--dtype",
        "float32",
        "--release",
        "hf",
        env=plugin_env,
    )
    assert res.returncode == 0, res.stderr
    assert "imported: 3" in res.stdout
    st = FeatureStore(store)
    assert sorted(st.keys()) == ["a", "b", "c"] and st.identity["name"] == "imported:toy-npz"
    assert st.identity["release"]["recipe"] == "hf" and "lxmert" in st.identity["release"]["source"]
    for key, (feats, boxes) in expected.items():
        np.testing.assert_array_equal(st.get(key)["features"], feats)
        np.testing.assert_array_equal(st.get(key)["boxes"], boxes)
        assert st.image_size(key) == (60, 40)
    out = tmp_path / "toy.txt"
    res = plugin_cli("export-features", str(store), "--format", "toy-npz", "--output", str(out), env=plugin_env)
    assert res.returncode == 0 and "rows written: 3" in res.stdout, res.stderr
    assert sorted(out.read_text().splitlines()) == ["a\t3", "b\t1", "c\t5"]
    (src / "bad.npz").write_bytes(b"not a zip")  # the reader's PipelineError: one line, exit 2 (a bad input file)
    res = plugin_cli(
        "import-features",
        str(src),
        "--format",
        "toy-npz",
        "--store",
        str(tmp_path / "s2"),
        "--release",
        "caffe",
        env=plugin_env,
    )
    assert res.returncode == 2 and res.stderr.count("error:") == 1 and "not a toy feature file" in res.stderr


def test_toy_captioner_is_built_trained_and_evaluated_through_the_cli(plugin_cli, tmp_path, plugin_env):
    res = plugin_cli("info", "--model", "toy", env=plugin_env)
    assert res.returncode == 0, res.stderr
    # image 2048*32+32, embedding 10000*32, GRU cell 2*(96*32)+2*96, output 32*10000+10000 (vocabulary 10,000)
    assert "parameters: 721904 " in res.stdout and "hidden: 32" in res.stdout
    assert "parameters: 364416 " in plugin_cli("info", "--model", "toy", "--set", "hidden=16", env=plugin_env).stdout

    run = make_world_run(tmp_path, num_images=40)
    res = plugin_cli(
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
    res = plugin_cli(
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


def test_the_toy_release_is_one_module():
    """The section "A new detector release" prints one file: the release touches one module (and its test)."""
    text = DOC.read_text()
    section = text[text.index("## A new detector release") :]
    section = section[: section.index("\n## ", 1)]
    assert re.findall(r"<!-- file: (\S+) -->", section) == ["toy_release.py"]


def _photo(path: Path, seed: int, size: tuple[int, int]) -> str:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path, quality=95)
    return str(path)


def test_toy_release_weights_extract_the_same_features_as_the_milvlg_file(plugin_cli, tmp_path, plugin_env):
    """Weights in the toy layout are recognised by the plugin's record alone: ``info`` describes them, ``info
    --releases`` lists the release, ``extract`` records the release's identity name and gives exactly the features
    of the same weights in the MILVLG layout; without the plugin the file is refused in one line and the release is
    not listed."""
    env = dict(plugin_env, BUTD_PLUGINS="toy_release")
    sd = random_detector(tiny_spec(flavor="caffe"), 5).state_dict()
    milvlg = save_layout(sd, "milvlg", tmp_path / "bua.pth")
    toy = tmp_path / "toy.pth"
    torch.save({"detector." + k: v for k, v in sd.items()}, toy)
    photos = [_photo(tmp_path / "a.jpg", 0, (320, 240)), _photo(tmp_path / "b.jpg", 1, (200, 300))]

    res = plugin_cli("info", str(toy), env=env)
    assert res.returncode == 0, res.stderr
    assert "layout: toy" in res.stdout and "semantics: caffe" in res.stdout and "recipe: caffe" in res.stdout
    res = plugin_cli("info", str(toy), env=plugin_env)  # the plugin not loaded: no release claims the layout
    assert res.returncode != 0 and res.stderr.strip().count("\n") == 0 and str(toy) in res.stderr
    toy_lines = {
        name: [line for line in plugin_cli("info", "--releases", env=e).stdout.splitlines() if "release toy:" in line]
        for name, e in (("with", env), ("without", plugin_env))
    }
    assert toy_lines["without"] == [] and toy_lines["with"] == [
        "release toy: layouts toy; recipe caffe; preset -; selectors per-class-nms, nms-ladder, given, grid; "
        "catalogue -; formats -; source a MILVLG bottom-up detector saved with a 'detector.' key prefix"
    ]

    stores = {}
    for name, weights in (("toy", toy), ("milvlg", milvlg)):
        stores[name] = tmp_path / f"store-{name}"
        res = plugin_cli(
            "extract",
            *photos,
            "--weights",
            str(weights),
            "--store",
            str(stores[name]),
            "--boxes",
            "36",
            "--workers",
            "0",
            "--device",
            "cpu",
            "--set",
            "extract.min_size=200",
            "--set",
            "extract.max_size=333",
            env=env,
        )
        assert res.returncode == 0, res.stderr
    got, want = FeatureStore(stores["toy"]), FeatureStore(stores["milvlg"])
    assert got.identity["name"] == "toy-detector" and got.identity["layout"] == "toy"
    assert got.identity["config"]["recipe"]["name"] == "caffe" == want.identity["config"]["recipe"]["name"]
    assert sorted(got.keys()) == sorted(want.keys()) == ["a.jpg", "b.jpg"]
    for key in got.keys():
        a, b = got.get(key), want.get(key)
        assert a["features"].shape[0] == 36 and a["features"].shape == b["features"].shape
        np.testing.assert_array_equal(a["features"], b["features"])
        np.testing.assert_array_equal(a["boxes"], b["boxes"])
