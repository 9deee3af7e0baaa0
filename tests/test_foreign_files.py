"""Lock, journal and temporary files never follow a link and never truncate a file that is not their own.

A symbolic link planted at a lock path (``OUT.lock``, a store's ``.lock``, a stage's ``.stage.lock``, a gallery's
``.lock``), at a journal file or at a segment's temporary name points at a user's file: the command exits non-zero
with one line naming the path and the user's file keeps every byte. The same holds for a fifo, a folder or a
regular file with someone else's content at a lock path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from detector_helpers import save_layout

from pipeline.core.errors import PipelineError, UsageError

#: the children's settings on top of the ``cli`` fixture's environment
ENV = {"OMP_NUM_THREADS": "1", "COLUMNS": "300"}
PRECIOUS = b"the user's thesis, chapter 1\n" * 50


def precious(tmp_path: Path) -> Path:
    path = tmp_path / "precious" / "thesis.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(PRECIOUS)
    return path


def plant_link(at: Path, target: Path) -> Path:
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(target)
    return at


def refused_in_one_line(res: subprocess.CompletedProcess, path: Path) -> str:
    lines = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert res.returncode != 0, res.stderr
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert str(path) in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def photo(tmp_path: Path) -> Path:
    from PIL import Image

    path = tmp_path / "a.jpg"
    Image.new("RGB", (48, 32), (200, 30, 30)).save(path)
    return path


def test_a_link_at_the_caption_output_lock(cli, tmp_path: Path, photo: Path) -> None:
    target = precious(tmp_path)
    out = tmp_path / "out.jsonl"
    link = plant_link(tmp_path / "out.jsonl.lock", target)
    res = cli("caption", str(photo), "--model", str(tmp_path / "no-model.pt"), "--output", str(out), env=ENV)
    line = refused_in_one_line(res, link)
    assert "symbolic link" in line
    assert target.read_bytes() == PRECIOUS and link.is_symlink() and not out.exists()


def test_a_link_at_the_gallery_lock(cli, tmp_path: Path, photo: Path) -> None:
    target = precious(tmp_path)
    link = plant_link(tmp_path / "gallery" / ".lock", target)
    res = cli(
        "caption", str(photo), "--model", str(tmp_path / "no-model.pt"), "--gallery", str(tmp_path / "gallery"), env=ENV
    )
    refused_in_one_line(res, link)
    assert target.read_bytes() == PRECIOUS and link.is_symlink()


def test_a_link_at_the_store_lock(cli, tmp_path: Path) -> None:
    target = precious(tmp_path)
    store = tmp_path / "store"
    link = plant_link(store / ".lock", target)
    source = tmp_path / "empty.tsv"
    source.write_text("")
    refused_in_one_line(
        cli("import-features", "--format", "butd-tsv", str(source), "--store", str(store), env=ENV), link
    )
    assert target.read_bytes() == PRECIOUS and link.is_symlink() and not (store / "store.json").exists()


def test_a_link_at_the_stage_lock(cli, tmp_path: Path) -> None:
    target = precious(tmp_path)
    run = tmp_path / "run"
    link = plant_link(run / "data" / ".stage.lock", target)
    res = cli("prepare", "--set", f"prepare.karpathy_json={tmp_path / 'missing.json'}", "--out", str(run), env=ENV)
    refused_in_one_line(res, link)
    assert target.read_bytes() == PRECIOUS and link.is_symlink() and not (run / "data" / "running.json").exists()


def test_a_link_to_a_folder_or_nowhere_at_a_lock_path_is_refused(tmp_path: Path) -> None:
    from pipeline.core.locks import acquire_lock

    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "keep.txt").write_bytes(b"keep")
    for name, target in (("to-folder.lock", folder), ("dangling.lock", tmp_path / "nowhere" / "x")):
        link = plant_link(tmp_path / name, target)
        with pytest.raises(UsageError, match="symbolic link") as info:
            acquire_lock(link, "x")
        assert str(link) in str(info.value) and "\n" not in str(info.value) and link.is_symlink()
    assert sorted(p.name for p in folder.iterdir()) == ["keep.txt"] and not (tmp_path / "nowhere").exists()


def test_a_fifo_a_folder_or_a_file_of_someone_else_at_a_lock_path_is_refused(tmp_path: Path) -> None:
    from pipeline.core.locks import acquire_lock

    fifo = tmp_path / "fifo.lock"
    os.mkfifo(fifo)
    folder = tmp_path / "dir.lock"
    folder.mkdir()
    notes = tmp_path / "notes.lock"
    notes.write_bytes(PRECIOUS)
    foreign_json = tmp_path / "json.lock"
    foreign_json.write_text(json.dumps({"pid": 1, "my": "settings"}))
    cases = (
        (fifo, "not a regular file"),
        (folder, "folder"),
        (notes, "not a lock file"),
        (foreign_json, "not a lock file"),
    )
    for path, says in cases:
        before = path.read_bytes() if path.is_file() else None
        with pytest.raises(UsageError, match=says) as info:
            acquire_lock(path, "x")
        assert str(path) in str(info.value) and "\n" not in str(info.value)
        assert (path.read_bytes() if path.is_file() else None) == before
    assert fifo.exists() and not fifo.is_file() and folder.is_dir()


def test_a_lock_file_of_ours_is_taken_again(tmp_path: Path) -> None:
    """An empty lock file and one holding a holder record (left by a killed process) are ours: taken, then empty."""
    from pipeline.core.locks import acquire_lock, read_holder

    empty, left = tmp_path / "empty.lock", tmp_path / "left.lock"
    empty.write_bytes(b"")
    record = {"pid": 999999, "host": "elsewhere", "since": "2026-01-01T00:00:00+00:00", "command": "cli.py caption"}
    left.write_text(json.dumps(record) + "\n")
    for path in (empty, left):
        with acquire_lock(path, "x"):
            assert read_holder(path)["pid"] == os.getpid()
        assert path.read_bytes() == b""


def test_a_hard_link_at_a_lock_path_is_refused(tmp_path: Path) -> None:
    from pipeline.core.locks import acquire_lock

    target = tmp_path / "mine.txt"
    target.write_bytes(b"")  # even an empty file of the user's: a second name for it is not a lock file of ours
    os.link(target, tmp_path / "x.lock")
    with pytest.raises(UsageError, match="hard link"):
        acquire_lock(tmp_path / "x.lock", "x")


@pytest.fixture
def m2_release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A random-weight M2 release (model file, vocabulary beside it) and a tiny public-layout detector."""
    import torch
    from extract_helpers import tiny_spec
    from release_helpers import write_m2_checkpoint, write_m2_vocab

    from extractors.random_weights import random_detector

    torch.set_num_threads(1)
    models = tmp_path / "m2"
    models.mkdir()
    words = ["a", "man", "dog", "on", "the", "grass"]
    write_m2_vocab(models / "vocab.pkl", words)
    write_m2_checkpoint(models / "meshed_memory_transformer.pth", 4 + len(words), d=16, d_ff=24, m=3, d_in=128)
    bua = save_layout(random_detector(tiny_spec(flavor="caffe"), 0).state_dict(), "milvlg", tmp_path / "bua.pth")
    ENV["BUTD_CACHE"] = str(tmp_path / "cache")
    yield models / "meshed_memory_transformer.pth", bua
    ENV.pop("BUTD_CACHE")


@pytest.mark.parametrize("planted,force", [("out.failures.jsonl", False), ("out.jsonl", True)])
def test_a_link_at_a_journal_file(
    cli, tmp_path: Path, shared_data: Path, m2_release: tuple[Path, Path], planted: str, force: bool
) -> None:
    """The results journal and the failures manifest of ``caption --output``: a link there is refused, ``--force``
    included, before any photo is captioned."""
    model, bua = m2_release
    photos = tmp_path / "photos"
    photos.mkdir()
    shutil.copy(shared_data / "photos" / "000456.jpg", photos / "000456.jpg")
    target = precious(tmp_path)
    link = plant_link(tmp_path / planted, target)
    res = cli(
        "caption",
        str(photos),
        "--model",
        str(model),
        "--weights",
        str(bua),
        "--output",
        str(tmp_path / "out.jsonl"),
        "--set",
        "caption.min_size=96",
        "--set",
        "caption.max_size=160",
        *(["--force"] if force else []),
        env=ENV,
    )
    line = refused_in_one_line(res, link)
    assert "symbolic link" in line
    assert target.read_bytes() == PRECIOUS and link.is_symlink()


def test_a_link_at_a_segment_temporary_name_is_not_followed(tmp_path: Path) -> None:
    """A link planted at the name the next segment is written under (``seg-NNNNNN.h5.tmp``) while a writer holds
    the store: the commit fails naming it and the link's target keeps every byte."""
    from store_helpers import IDENTITY, add_image, synthetic_image

    from pipeline.store import open_writer

    target = precious(tmp_path)
    store = tmp_path / "store"
    writer = open_writer(store, IDENTITY, "float32")
    link = plant_link(store / "seg-000000.h5.tmp", target)
    add_image(writer, synthetic_image(0))
    with pytest.raises(PipelineError) as info:
        writer.commit()
    writer.close()
    assert str(link) in str(info.value) and "\n" not in str(info.value)
    assert target.read_bytes() == PRECIOUS


def test_a_link_at_the_merge_temporary_name_is_not_followed(tmp_path: Path) -> None:
    from store_helpers import IDENTITY, add_image, synthetic_image

    from pipeline.store import merge_stores, open_writer

    with open_writer(tmp_path / "shard", IDENTITY, "float32") as writer:
        add_image(writer, synthetic_image(0))
    target = precious(tmp_path)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "keep.txt").write_bytes(b"keep")
    for dst, to in ((tmp_path / "one.h5", target), (tmp_path / "merged", folder)):
        link = plant_link(dst.parent / f".{dst.name}.merge.tmp", to)
        assert merge_stores([tmp_path / "shard"], dst) == 1  # a leftover name: the link is removed, never followed
        assert not link.exists() and not link.is_symlink()
    assert target.read_bytes() == PRECIOUS and sorted(p.name for p in folder.iterdir()) == ["keep.txt"]


def test_the_own_file_opener(tmp_path: Path) -> None:
    """``open_own_file``: creates, appends, truncates only after its checks; refuses links and non-files."""
    from pipeline.core.fileio import open_own_file

    log = tmp_path / "log.jsonl"
    for text in ("a\n", "b\n"):
        with os.fdopen(open_own_file(log, "training log", append=True), "a") as fh:
            fh.write(text)
    assert log.read_text() == "a\nb\n"
    os.close(open_own_file(log, "failures list", truncate=True))
    assert log.read_bytes() == b""
    target = precious(tmp_path)
    link = plant_link(tmp_path / "linked.jsonl", target)
    with pytest.raises(UsageError, match=r"linked.jsonl is a symbolic link; the training log is never written through"):
        open_own_file(link, "training log", truncate=True)
    assert target.read_bytes() == PRECIOUS
