"""`prepare`: Karpathy and COCO-captions inputs on the synthetic world, vocabulary, labels, df, bad input."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from forked_cli import ForkedCli

from pipeline.caption_data import PreparedCaptions
from pipeline.caption_data.prepare import prepare_captions
from pipeline.caption_data.text import tokenize
from pipeline.core.config import load_config
from pipeline.core.errors import UsageError
from pipeline.core.stages import run_stage
from pipeline.world.generate import generate_world


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("world")
    cfg = load_config("world", None, ["world.num_images=100", "world.num_workers=1"])
    generate_world(out, cfg.world)
    return out


def prep(tmp_path: Path, *overrides: str, name: str = "run"):
    cfg = load_config("prepare", None, list(overrides))
    return run_stage(tmp_path / name, "data", cfg.prepare, prepare_captions)


def test_tokenize_like_prepro():
    assert tokenize("A Man, riding a horse.  On the beach!") == [
        "a",
        "man",
        "riding",
        "a",
        "horse",
        "on",
        "the",
        "beach",
    ]


def test_karpathy_prepare_on_world(world, tmp_path):
    src = world / "annotations/dataset_coco.json"
    result = prep(tmp_path, f"prepare.karpathy_json={src}", "prepare.max_length=8")
    data = PreparedCaptions.load(result.directory)
    raw = json.loads(src.read_text())["images"]
    assert len(data) == 100 and [im["key"] for im in data.images] == [str(im["cocoid"]) for im in raw]
    assert (len(data.split_indices("train")), len(data.split_indices("val")), len(data.split_indices("test"))) == (
        80,
        10,
        10,
    )
    # vocabulary: words seen more than 5 times over all splits, by frequency
    counts = Counter(w for im in raw for s in im["sentences"] for w in s["tokens"])
    assert set(data.vocab.words[4:]) == {w for w, c in counts.items() if c > 5}
    assert data.vocab.words[:4] == ("<pad>", "<bos>", "<eos>", "<unk>")
    freqs = [counts[w] for w in data.vocab.words[4:]]
    assert freqs == sorted(freqs, reverse=True)
    # labels: truncated to 8 words, rare words -> <unk>, padded with 0; references untruncated
    refs = data.references()
    for i in (0, 37, 99):
        labels, lengths = data.captions(i)
        sents = raw[i]["sentences"]
        assert labels.shape == (len(sents), 8)
        for row, n, s in zip(labels, lengths, sents):
            assert n == min(len(s["tokens"]), 8) and (row[n:] == 0).all()
            assert [data.vocab.words[t] for t in row[:n]] == [w if counts[w] > 5 else "<unk>" for w in s["tokens"][:8]]
        assert refs[data.images[i]["key"]] == [" ".join(s["tokens"]) for s in sents]
    assert result.summary["truncated_captions"] == sum(len(s["tokens"]) > 8 for im in raw for s in im["sentences"])
    assert not (result.directory / "cider_df.json").exists()  # SCST and validation compute their document frequencies


def test_restval_threshold_and_coco_route(world, tmp_path):
    src = json.loads((world / "annotations/dataset_coco.json").read_text())
    for im in src["images"][:20]:
        im["split"] = "restval"
    path = tmp_path / "karpathy.json"
    path.write_text(json.dumps(src))
    merged = PreparedCaptions.load(prep(tmp_path, f"prepare.karpathy_json={path}", name="a").directory)
    kept = PreparedCaptions.load(
        prep(tmp_path, f"prepare.karpathy_json={path}", "prepare.restval_to_train=false", name="b").directory
    )
    assert len(merged.split_indices("train")) == 80 and len(merged.split_indices("restval")) == 0
    assert len(kept.split_indices("restval")) == 20 and len(kept.split_indices("train")) == 60
    every = PreparedCaptions.load(
        prep(tmp_path, f"prepare.karpathy_json={path}", "prepare.word_count_threshold=0", name="c").directory
    )
    assert len(every.vocab) == 4 + len({w for im in src["images"] for s in im["sentences"] for w in s["tokens"]})
    # the same world through its COCO caption files gives the same images, vocabulary and labels
    ann = world / "annotations"
    coco = PreparedCaptions.load(
        prep(
            tmp_path,
            *(f"prepare.coco_captions.{s}={ann / f'captions_{s}.json'}" for s in ("train", "val", "test")),
            name="d",
        ).directory
    )
    karp = PreparedCaptions.load(
        prep(tmp_path, f"prepare.karpathy_json={ann / 'dataset_coco.json'}", name="e").directory
    )
    # COCO files + a split file: every image listed as train in the files, splits taken from the split file
    resplit = PreparedCaptions.load(
        prep(
            tmp_path,
            *(f"prepare.coco_captions.{s}={ann / f'captions_{s}.json'}" for s in ("train", "val", "test")),
            f"prepare.split_file={path}",
            name="f",
        ).directory
    )
    assert len(resplit.split_indices("train")) == 80 and {im["key"] for im in resplit.images} == {
        im["key"] for im in karp.images
    }
    assert coco.vocab.words == karp.vocab.words
    assert {im["key"]: im["split"] for im in coco.images} == {im["key"]: im["split"] for im in karp.images}
    assert coco.images[0]["width"] > 0
    ci = {im["key"]: i for i, im in enumerate(coco.images)}
    for i in (0, 50):
        k = karp.images[i]["key"]
        assert sorted(map(tuple, karp.captions(i)[0].tolist())) == sorted(map(tuple, coco.captions(ci[k])[0].tolist()))


def test_stage_skips_and_refuses_changed_config(world, tmp_path):
    src = world / "annotations/dataset_coco.json"
    first = prep(tmp_path, f"prepare.karpathy_json={src}")
    again = prep(tmp_path, f"prepare.karpathy_json={src}")
    assert not first.skipped and again.skipped and again.summary == first.summary
    with pytest.raises(UsageError, match="different config"):
        prep(tmp_path, f"prepare.karpathy_json={src}", "prepare.max_length=10")


@pytest.fixture(scope="module")
def forked_cli(cli):
    """``forked_cli(*args)``: ``cli.py ARGS`` in a child forked from one interpreter that has started ``cli.py`` with
    the environment the ``cli`` fixture gives a child (tests/forked_cli.py)."""
    with ForkedCli(cli.environment()) as server:

        def run(*args: str) -> subprocess.CompletedProcess:
            try:
                return server(*args, env=cli.environment(), timeout=300)
            except subprocess.TimeoutExpired:
                pytest.fail(f"`cli.py {' '.join(args[:2])}` still ran after 300 s")

        yield run


def test_bad_inputs_via_cli(forked_cli, world, tmp_path):
    missing = tmp_path / "nope.json"
    proc = forked_cli("prepare", "--set", f"prepare.karpathy_json={missing}", "--out", str(tmp_path / "r1"), "-q")
    assert proc.returncode == 2 and "nope.json" in proc.stderr and "Traceback" not in proc.stderr
    broken = tmp_path / "broken.json"
    broken.write_text('{"images": [')
    proc = forked_cli("prepare", "--set", f"prepare.karpathy_json={broken}", "--out", str(tmp_path / "r2"), "-q")
    assert proc.returncode == 2 and "broken.json is not valid JSON" in " ".join(proc.stderr.split())
    bad = json.loads((world / "annotations/dataset_coco.json").read_text())
    del bad["images"][3]["sentences"]
    badfile = tmp_path / "bad.json"
    badfile.write_text(json.dumps(bad))
    proc = forked_cli("prepare", "--set", f"prepare.karpathy_json={badfile}", "--out", str(tmp_path / "r3"), "-q")
    assert proc.returncode == 2 and "bad.json: images[3] lacks 'sentences' or 'split'" in " ".join(proc.stderr.split())
    proc = forked_cli("prepare", "--out", str(tmp_path / "r4"), "-q")
    assert proc.returncode == 2 and "exactly one caption source" in proc.stderr
    proc = forked_cli("prepare", "--set", "prepare.max_lenght=3", "--out", str(tmp_path / "r5"), "-q")
    assert proc.returncode == 2 and "max_lenght" in proc.stderr
    assert not (tmp_path / "r3" / "data" / "manifest.json").exists()
