"""Weights by catalogue name (docs/downloads.md): fetched on first use from a local server standing in for the
release hosts (BUTD_DOWNLOAD_MIRROR / HF_ENDPOINT), cached under BUTD_CACHE, reused offline, resumed after an
interruption, fetched once by two processes, and every failure one line with nothing left under the file's name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from detector_helpers import save_layout, save_vinvl
from download_server import FileServer
from extract_helpers import tiny_spec
from release_helpers import write_m2_checkpoint
from test_vinvl import narrow_spec
from typer.testing import CliRunner

from cli import app
from extractors.random_weights import random_detector
from pipeline.core.catalogue import CATALOGUE

REPO = Path(__file__).resolve().parent.parent
FEAT = 128  # the tiny MILVLG detector's region feature size


def url_of(name: str) -> str:
    return CATALOGUE[name].urls[0]


def one_error_line(res) -> str:
    lines = [line for line in res.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, res.output
    return " ".join(res.output[res.output.index("error:") :].split())


@pytest.fixture(scope="module")
def release_files(tmp_path_factory, shared_data) -> dict[str, bytes]:
    """Random weights in each release's exact layout, and M2's real vocab.pkl."""
    d = tmp_path_factory.mktemp("releases")
    save_vinvl(random_detector(narrow_spec(), seed=3), d / "vinvl.pth")
    labelmap = {
        "label_to_idx": {f"class{i}": i for i in range(1, 41)},
        "attribute_to_idx": {f"attr{i}": i for i in range(1, 31)},
    }
    save_layout(random_detector(tiny_spec(flavor="caffe"), 0).state_dict(), "milvlg", d / "bua.pth")
    save_layout(random_detector(tiny_spec(flavor="d2"), 1).state_dict(), "hf", d / "hf.bin")
    from models.released.m2 import read_vocab

    itos = read_vocab(shared_data / "m2" / "vocab.pkl")
    write_m2_checkpoint(d / "m2.pth", len(itos), d=16, d_ff=24, m=3, d_in=FEAT)
    return {
        "vinvl-x152c4": (d / "vinvl.pth").read_bytes(),
        "vinvl-labelmap": json.dumps(labelmap).encode(),
        "bua-r101": (d / "bua.pth").read_bytes(),
        "frcnn-vg-finetuned": (d / "hf.bin").read_bytes(),
        "frcnn-vg-finetuned-config": b"model:\n  max_detections: 36\n",
        "m2-coco": (d / "m2.pth").read_bytes(),
        "m2-vocab": (shared_data / "m2" / "vocab.pkl").read_bytes(),
    }


@pytest.fixture
def server(release_files, tmp_path, monkeypatch):
    srv = FileServer()
    for name, body in release_files.items():
        srv.publish(url_of(name), body)
    monkeypatch.setenv("BUTD_DOWNLOAD_MIRROR", srv.url)
    monkeypatch.setenv("HF_ENDPOINT", srv.url)
    monkeypatch.setenv("BUTD_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield srv
    srv.stop()


@pytest.fixture
def photos(tmp_path: Path, shared_data: Path) -> Path:
    folder = tmp_path / "photos"
    folder.mkdir()
    for name in ("000456.jpg", "000542.jpg"):
        shutil.copy(shared_data / "photos" / name, folder / name)
    return folder


def extract(photos: Path, weights: str, store: Path):
    return CliRunner().invoke(
        app,
        [
            "extract",
            "--device",
            "cpu",
            str(photos),
            "--weights",
            weights,
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


def cached_files(tmp_path: Path) -> list[str]:
    root = tmp_path / "cache" / "downloads"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_extract_by_catalogue_name_downloads_caches_and_runs_offline(tmp_path, server, photos, release_files):
    from pipeline.store import FeatureStore

    res = extract(photos, "vinvl-x152c4", tmp_path / "s1")
    assert res.exit_code == 0, res.output
    assert sorted(FeatureStore(tmp_path / "s1").keys()) == ["000456.jpg", "000542.jpg"]
    cached = tmp_path / "cache" / "downloads" / "vinvl" / "vinvl_vg_x152c4.pth"
    assert cached.read_bytes() == release_files["vinvl-x152c4"]
    record = json.loads((cached.parent / "vinvl_vg_x152c4.pth.sha256").read_text())
    import hashlib

    assert record["sha256"] == hashlib.sha256(release_files["vinvl-x152c4"]).hexdigest()
    assert cached_files(tmp_path) == [
        "vinvl/VG-SGG-dicts-vgoi6-clipped.json",
        "vinvl/VG-SGG-dicts-vgoi6-clipped.json.sha256",
        "vinvl/vinvl_vg_x152c4.pth",
        "vinvl/vinvl_vg_x152c4.pth.sha256",
    ]
    manifest = json.loads((tmp_path / "s1" / "manifest.json").read_text())
    assert manifest["config"]["job"]["weights"] == str(cached)
    server.stop()  # offline: the cache answers
    again = extract(photos, "vinvl-x152c4", tmp_path / "s2")
    assert again.exit_code == 0, again.output
    assert FeatureStore(tmp_path / "s2").identity["weights_sha256"] == record["sha256"]


def test_caption_with_the_released_m2_and_milvlg_by_name(tmp_path, server, photos):
    args = [
        "caption",
        str(photos),
        "--model",
        "m2-coco",
        "--weights",
        "bua-r101",
        "--set",
        "caption.min_size=160",
        "--set",
        "caption.max_size=256",
    ]
    res = CliRunner().invoke(app, [*args, "--output", str(tmp_path / "a.jsonl")])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["caption"] for r in rows)
    assert cached_files(tmp_path) == [
        "m2/meshed_memory_transformer.pth",
        "m2/meshed_memory_transformer.pth.sha256",
        "m2/vocab.pkl",
        "m2/vocab.pkl.sha256",
        "milvlg/bua-caffe-frcn-r101_with_attributes.pth",
        "milvlg/bua-caffe-frcn-r101_with_attributes.pth.sha256",
    ]
    n = len(server.requests)
    assert n == 3
    server.stop()
    again = CliRunner().invoke(app, [*args, "--output", str(tmp_path / "b.jsonl")])
    assert again.exit_code == 0, again.output
    assert (tmp_path / "b.jsonl").read_text() == (tmp_path / "a.jsonl").read_text()


def test_a_404_is_one_line_naming_the_url_and_the_path_by_hand(tmp_path, server, photos):
    del server.files[server.publish(url_of("vinvl-x152c4"), b"")]
    res = extract(photos, "vinvl-x152c4", tmp_path / "s")
    line = one_error_line(res)
    assert res.exit_code == 1
    assert "HTTP 404" in line and "/penzhanwu2.blob.core.windows.net/sgg/" in line
    assert f"put the file there by hand: {tmp_path / 'cache' / 'downloads' / 'vinvl' / 'vinvl_vg_x152c4.pth'}" in line
    assert cached_files(tmp_path) == [] and not (tmp_path / "s").exists()


@pytest.mark.parametrize("bad", ["truncated", "wrong layout"])
def test_a_truncated_or_wrong_file_is_refused_and_deleted(tmp_path, server, photos, release_files, bad):
    body = release_files["vinvl-x152c4"]
    server.publish(url_of("vinvl-x152c4"), body[: len(body) // 2] if bad == "truncated" else release_files["bua-r101"])
    res = extract(photos, "vinvl-x152c4", tmp_path / "s")
    line = one_error_line(res)
    assert res.exit_code == 1 and "vinvl-x152c4 from http://127.0.0.1" in line and "is refused and was deleted" in line
    if bad == "wrong layout":
        assert "milvlg layout, not vinvl" in line
    assert cached_files(tmp_path) == []


def test_offline_with_an_empty_cache_is_one_line(tmp_path, server, photos):
    server.stop()
    res = extract(photos, "bua-r101", tmp_path / "s")
    line = one_error_line(res)
    assert res.exit_code == 1 and "cannot reach" in line and "by hand:" in line
    assert cached_files(tmp_path) == []


def test_an_interrupted_download_resumes_with_range(tmp_path, server, release_files):
    from pipeline.hub import resolve_file

    body = release_files["bua-r101"]
    path = server.publish(url_of("bua-r101"), body)
    server.drop_after[path] = 1000
    got = Path(resolve_file("bua-r101", "weights file"))
    assert got.read_bytes() == body
    assert server.gets(path) == [None, "bytes=1000-"]
    # a .part file left by a killed process is continued, not started over
    vocab = server.publish(url_of("m2-vocab"), release_files["m2-vocab"])
    part = tmp_path / "cache" / "downloads" / "m2" / "vocab.part.pkl"
    part.parent.mkdir(parents=True)
    part.write_bytes(release_files["m2-vocab"][:4096])
    assert Path(resolve_file("m2-vocab", "vocabulary file")).read_bytes() == release_files["m2-vocab"]
    assert server.gets(vocab) == ["bytes=4096-"] and not part.exists()


def test_a_changed_cached_file_is_refused(tmp_path, server):
    res = CliRunner().invoke(app, ["fetch", "m2-vocab"])
    assert res.exit_code == 0, res.output
    cached = Path(res.stdout.strip())
    cached.chmod(0o644)
    with cached.open("r+b") as fh:
        fh.seek(100)
        fh.write(b"\0\0\0\0")
    res = CliRunner().invoke(app, ["fetch", "m2-vocab"])
    assert res.exit_code == 1 and "does not match the SHA-256 recorded" in one_error_line(res)


def test_two_processes_fetch_one_file_once(tmp_path, server, release_files):
    import threading

    path = server.publish(url_of("m2-vocab"), release_files["m2-vocab"])
    server.gate[path] = threading.Event()
    env = {**os.environ, "BUTD_NO_PROGRESS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(REPO / "cli.py"), "fetch", "m2-vocab"]
    first = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server.wait_for_request(path)
    second = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    waited = ""
    for line in second.stderr:  # the second process says it waits for the first
        waited += line
        if "waiting for another process downloading m2-vocab" in " ".join(waited.split()):
            break
    server.gate[path].set()
    out1, err1 = first.communicate(timeout=120)
    out2, err2 = second.communicate(timeout=120)
    assert first.returncode == 0 and second.returncode == 0, (err1, waited + err2)
    assert out1.strip() == out2.strip() == str(tmp_path / "cache" / "downloads" / "m2" / "vocab.pkl")
    assert server.gets(path) == [None]


def test_hub_ids_follow_hf_endpoint_and_hf_hub_offline(tmp_path, server, monkeypatch, release_files):
    res = CliRunner().invoke(app, ["fetch", "hf:unc-nlp/frcnn-vg-finetuned"])
    assert res.exit_code == 0, res.output
    assert Path(res.stdout.strip()).read_bytes() == release_files["frcnn-vg-finetuned"]
    assert server.gets("/unc-nlp/frcnn-vg-finetuned/resolve/main/pytorch_model.bin") == [None]
    assert server.gets("/unc-nlp/frcnn-vg-finetuned/resolve/main/config.yaml") == [None]  # its companion
    other = server.publish("https://huggingface.co/someone/detector/resolve/v2/weights.bin", release_files["bua-r101"])
    res = CliRunner().invoke(app, ["fetch", "hf:someone/detector/weights.bin@v2"])
    assert res.exit_code == 0, res.output
    assert server.gets(other) == [None]
    hub_file = tmp_path / "cache" / "downloads" / "hf" / "someone--detector" / "v2" / "weights.bin"
    assert Path(res.stdout.strip()) == hub_file
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert CliRunner().invoke(app, ["fetch", "hf:someone/detector/weights.bin@v2"]).exit_code == 0  # cached
    res = CliRunner().invoke(app, ["fetch", "hf:someone/other"])
    assert res.exit_code == 1 and "downloads are off (HF_HUB_OFFLINE)" in one_error_line(res)
    assert len(server.requests) == 3


def test_an_unknown_name_lists_close_catalogue_names(tmp_path, server, photos):
    res = extract(photos, "vinvl-x125c4", tmp_path / "s")
    line = one_error_line(res)
    assert res.exit_code == 2 and "weights file not found" in line and "vinvl-x152c4" in line
    res = CliRunner().invoke(app, ["fetch", "m2-cocoo"])
    assert res.exit_code == 2 and "close: m2-coco" in one_error_line(res)
    assert server.requests == []


def test_the_manual_step_is_one_line(tmp_path, server):
    res = CliRunner().invoke(app, ["fetch", "aoanet"])
    line = one_error_line(res)
    assert "drive.google.com/drive/folders/1ab0iPNyxdVm79ml-oozsIlH7H6t6dIVl" in line
    assert str(tmp_path / "cache" / "downloads" / "aoanet" / "model-best.pth") in line


def test_fetch_list_prints_every_catalogue_name(server):
    res = CliRunner().invoke(app, ["fetch", "--list"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    for name in CATALOGUE:
        assert name in res.output


def test_docs_downloads_table_is_the_catalogue():
    from pipeline.core.catalogue import catalogue_markdown

    text = (REPO / "docs" / "downloads.md").read_text(encoding="utf-8")
    assert catalogue_markdown() in text


def test_info_takes_a_catalogue_name_as_its_file(tmp_path, server):
    by_name = CliRunner().invoke(app, ["info", "bua-r101"])
    assert by_name.exit_code == 0, by_name.output
    cached = tmp_path / "cache" / "downloads" / "milvlg" / "bua-caffe-frcn-r101_with_attributes.pth"
    assert cached.is_file()
    by_path = CliRunner().invoke(app, ["info", str(cached)])
    report = by_name.output[by_name.output.index("file: ") :]  # after the download's log lines
    assert by_path.exit_code == 0 and by_path.output == report
    assert "layout: milvlg" in report
    server.stop()  # offline: the cached file answers
    again = CliRunner().invoke(app, ["info", "bua-r101"])
    assert again.exit_code == 0 and again.output == report
