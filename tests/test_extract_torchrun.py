"""torchrun extraction: two CPU processes write one shard each and rank 0 merges them into STORE at the end;
the merged store equals a one-process run bitwise (same threads per process, same batch per image)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from extract_helpers import TINY_SET

from pipeline.store import FeatureStore

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "BUTD_THREADS": "1", "BUTD_NO_PROGRESS": "1"}
PHOTOS = [
    "000456.jpg",
    "000542.jpg",
    "001150.jpg",
    "001763.jpg",
    "004545.jpg",
    "COCO_train2014_000000084002.jpg",
    "COCO_train2014_000000150367.jpg",
]  # five 500x375 (batched together) and two 640x480


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(shared_data: Path, store: Path) -> list[str]:
    return [
        "extract",
        *(str(shared_data / "photos" / p) for p in PHOTOS),
        "--weights",
        "random",
        "--store",
        str(store),
        "--workers",
        "0",
        "--batch-size",
        "2",
        "--set",
        TINY_SET,
        "--set",
        "extract.min_size=200",
        "--set",
        "extract.max_size=333",
        "--set",
        "extract.feature_dtype=float32",
        "--set",
        "extract.device=cpu",
    ]  # a CPU claim (bitwise), on any machine


def test_torchrun_merges_its_shards_and_equals_one_process(tmp_path, shared_data):
    one = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), *_args(shared_data, tmp_path / "one")],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            str(ROOT / "cli.py"),
            *_args(shared_data, tmp_path / "two"),
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "merged 2 shards (7 images)" in two.stdout
    shards = sorted(
        p.name for p in (tmp_path / "two.shards").iterdir() if p.is_dir()
    )  # beside them: each writer's .lock file
    assert shards == ["0-of-2", "1-of-2"]
    # batch-sized blocks: rank 0 got images 0-1 and 4-5, rank 1 images 2-3 and 6 (as the one-process batches)
    assert (
        len(FeatureStore(tmp_path / "two.shards" / "0-of-2")) == 4
        and len(FeatureStore(tmp_path / "two.shards" / "1-of-2")) == 3
    )
    a, b = FeatureStore(tmp_path / "one"), FeatureStore(tmp_path / "two")
    assert sorted(a.keys()) == sorted(b.keys()) and len(a) == 7
    for key in a.keys():
        ra, rb = a.get(key), b.get(key)
        for field in ("boxes", "features", "class_ids", "class_scores", "attr_ids", "attr_scores"):
            assert np.array_equal(ra[field], rb[field]), (key, field)
    # a second torchrun run does not overwrite the merged store
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            str(ROOT / "cli.py"),
            *_args(shared_data, tmp_path / "two"),
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0 and "is not overwritten" in again.stderr


@pytest.mark.parametrize("block,expected", [(1, [0, 2, 4, 6]), (2, [0, 1, 4, 5]), (3, [0, 1, 2, 6])])
def test_shard_items_in_blocks(block, expected):
    from extractors.inputs import ImageItem, shard_items

    items = [ImageItem(str(i), Path(f"{i}.jpg")) for i in range(7)]
    got = shard_items(items, 0, 2, block=block)
    assert [int(it.key) for it in got] == expected
    other = shard_items(items, 1, 2, block=block)
    assert sorted(int(it.key) for it in got + other) == list(range(7))
