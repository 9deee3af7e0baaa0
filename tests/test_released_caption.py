"""`cli caption` / `cli evaluate` with released captioners: random-weight files in the M2 and AoANet layouts, a
public-layout (MILVLG) detector file at reduced widths, real photos, end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from detector_helpers import save_layout
from extract_helpers import tiny_spec
from release_helpers import write_aoanet, write_m2_checkpoint, write_m2_vocab
from typer.testing import CliRunner

from cli import app
from extractors.random_weights import random_detector

WORDS = ["a", "man", "dog", "on", "the", "grass", "with", "ball", "red", "sitting"]
FEAT = 128  # the tiny detector's region feature size


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BUTD_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(1)


@pytest.fixture
def bua(tmp_path: Path) -> Path:
    spec = tiny_spec(flavor="caffe")
    return save_layout(random_detector(spec, 0).state_dict(), "milvlg", tmp_path / "bua.pth")


@pytest.fixture
def photos(tmp_path: Path, shared_data: Path) -> Path:
    folder = tmp_path / "photos"
    folder.mkdir()
    for name in ("000456.jpg", "COCO_train2014_000000150367.jpg"):
        shutil.copy(shared_data / "photos" / name, folder / name)
    return folder


def caption(*args: str):
    return CliRunner().invoke(app, ["caption", *args, "--set", "caption.min_size=160", "--set", "caption.max_size=256"])


def test_caption_help_shows_the_released_model_path() -> None:
    res = CliRunner().invoke(app, ["caption", "--help"])
    assert res.exit_code == 0
    text = " ".join(res.output.split())
    assert "meshed_memory_transformer.pth --vocab vocab.pkl --weights bua.pth" in text
    for flag in (
        "--vocab",
        "--stop-rule",
        "--length-penalty",
        "--block-trigrams",
        "--max-len",
        "--n-best",
        "--beam-size",
    ):
        assert flag in text


def test_caption_photos_with_the_released_m2(tmp_path: Path, bua: Path, photos: Path) -> None:
    models = tmp_path / "m2"
    models.mkdir()
    write_m2_vocab(models / "vocab.pkl", WORDS)
    write_m2_checkpoint(models / "meshed_memory_transformer.pth", 4 + len(WORDS), d=16, d_ff=24, m=3, d_in=FEAT)
    out = tmp_path / "captions.jsonl"
    res = caption(
        str(photos),
        "--model",
        str(models / "meshed_memory_transformer.pth"),
        "--vocab",
        str(models / "vocab.pkl"),
        "--weights",
        str(bua),
        "--output",
        str(out),
    )
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all("caption" in r for r in rows)
    vocab = {"<unk>", "<pad>", "<bos>", *WORDS}
    for r in rows:
        assert set(r["caption"].split()) <= vocab and r["caption"]
        assert r["score"] < 0
    assert "caffe recipe" in " ".join(res.output.split()) or "caffe recipe" in (res.stderr if res.stderr_bytes else "")
    converted = list((tmp_path / "cache" / "released").glob("m2-*.pt"))
    assert len(converted) == 1  # converted once; the second run reads the native file
    again = caption(
        str(photos),
        "--model",
        str(models / "meshed_memory_transformer.pth"),
        "--weights",
        str(bua),
        "--output",
        str(tmp_path / "again.jsonl"),
        "--stop-rule",
        "exact",
        "--n-best",
        "2",
        "--cache",
        str(tmp_path / "feats"),
    )
    assert again.exit_code == 0, again.output  # vocab.pkl found next to the weights
    from pipeline.store import FeatureStore

    recipe = FeatureStore(tmp_path / "feats").identity["config"]["recipe"]  # what the detector ran with
    assert recipe["name"] == "caffe" and (recipe["min_boxes"], recipe["max_boxes"]) == (10, 100)
    rows2 = [json.loads(line) for line in (tmp_path / "again.jsonl").read_text().splitlines()]
    assert all(len(r["nbest"]) == 2 for r in rows2)


def test_caption_photos_with_the_released_aoanet(tmp_path: Path, bua: Path, photos: Path) -> None:
    models = tmp_path / "aoa"
    models.mkdir()
    write_aoanet(models, WORDS + ["UNK"], d=16, d_in=FEAT)
    out = tmp_path / "captions.jsonl"
    res = caption(
        str(photos),
        "--model",
        str(models / "model-best.pth"),
        "--vocab",
        str(models / "infos_aoanet-best.pkl"),
        "--weights",
        str(bua),
        "--output",
        str(out),
        "--max-len",
        "8",
    )
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        words = r["caption"].split()
        assert set(words) <= set(WORDS) and len(words) <= 8  # <unk> is lowered by 1000; PAD/BOS impossible


def test_released_model_with_a_tampered_vocab_is_one_line_exit_2(tmp_path: Path, bua: Path, photos: Path) -> None:
    models = tmp_path / "m2"
    models.mkdir()
    write_m2_vocab(models / "vocab.pkl", WORDS)
    raw = (models / "vocab.pkl").read_bytes()
    (models / "vocab.pkl").write_bytes(raw.replace(b"ccollections\ndefaultdict\n", b"csubprocess\nPopen\n"))
    write_m2_checkpoint(models / "meshed_memory_transformer.pth", 4 + len(WORDS), d=16, d_ff=24, m=3, d_in=FEAT)
    res = caption(str(photos), "--model", str(models / "meshed_memory_transformer.pth"), "--weights", str(bua))
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.startswith("error")]
    assert len(lines) == 1 and "vocab.pkl" in lines[0] and "subprocess.Popen" in lines[0]
    assert "Traceback" not in res.output


def test_evaluate_the_released_m2_on_a_prepared_split(tmp_path: Path) -> None:
    """`evaluate --model meshed_memory_transformer.pth --vocab vocab.pkl --store --data --split test`: the paper's
    decoding by default (beam 5, 20 steps, M2's search, repeats collapsed); flags override it."""
    from pipeline.caption_data.prepare import prepare_captions
    from pipeline.core.config import load_config
    from pipeline.core.stages import run_stage
    from pipeline.world.generate import generate_world
    from pipeline.world.oracle_features import oracle_dim, write_oracle_store

    world, run = tmp_path / "world", tmp_path / "run"
    generate_world(world, load_config("world", None, ["world.num_images=40", "world.num_workers=1"]).world)
    cfg = load_config(
        "prepare",
        None,
        [f"prepare.karpathy_json={world / 'annotations/dataset_coco.json'}", "prepare.word_count_threshold=0"],
    )
    run_stage(run, "data", cfg.prepare, prepare_captions)
    write_oracle_store(world, run / "features" / "store", extra_dims=64 - oracle_dim())
    models = tmp_path / "m2"
    models.mkdir()
    write_m2_vocab(models / "vocab.pkl", WORDS)
    write_m2_checkpoint(models / "meshed_memory_transformer.pth", 4 + len(WORDS), d=16, d_ff=24, m=3, d_in=64)
    base = [
        "evaluate",
        "--model",
        str(models / "meshed_memory_transformer.pth"),
        "--vocab",
        str(models / "vocab.pkl"),
        "--store",
        str(run / "features/store"),
        "--data",
        str(run / "data"),
        "--split",
        "test",
        "--metrics",
        "cider",
        "--set",
        "evaluate.tokenizer=simple",
    ]
    res = CliRunner().invoke(app, [*base, "--output", str(tmp_path / "out" / "metrics.json")])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "out" / "metrics.json").read_text())
    dec = report["decoding"]
    assert (dec["beam_size"], dec["max_len"], dec["stop_rule"], dec["collapse_repeats"]) == (5, 20, "official_m2", True)
    assert report["model"] == "m2" and report["num_images"] > 0 and "CIDEr" in report["metrics"]
    res = CliRunner().invoke(
        app, [*base, "--beam-size", "3", "--stop-rule", "exact", "--output", str(tmp_path / "o2" / "m.json")]
    )
    assert res.exit_code == 0, res.output
    dec = json.loads((tmp_path / "o2" / "m.json").read_text())["decoding"]
    assert (dec["beam_size"], dec["stop_rule"]) == (3, "exact")
    other = tmp_path / "m2-32"
    other.mkdir()
    write_m2_vocab(other / "vocab.pkl", WORDS)
    write_m2_checkpoint(other / "meshed_memory_transformer.pth", 4 + len(WORDS), d=16, d_ff=24, m=3, d_in=32)
    res = CliRunner().invoke(app, ["evaluate", "--model", str(other / "meshed_memory_transformer.pth"), *base[3:]])
    assert (
        res.exit_code == 2 and "64-d region features" in " ".join(res.output.split()) and "Traceback" not in res.output
    )
