"""DDP: two CPU processes (gloo) launched with torchrun train one XE epoch and match the single-process run.

With dropout off, the per-rank loss normalisation makes the DDP gradient equal the single-process
gradient of the same global batch, so the weights and validation metrics agree up to float rounding.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import make_world_run, train_overrides

from models.checkpoints import CaptionerCheckpoint

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "BUTD_NO_PROGRESS": "1"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_world_run(tmp_path_factory.mktemp("ddp"), num_images=160)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def sets(run: Path) -> list[str]:
    values = train_overrides(
        run,
        "san",
        "train.stages=[xe]",
        "train.validation.decoding={method: greedy}",
        "train.xe={epochs: 1, batch_size: 8, lr: 3.0e-3, warmup_iters: 0}",
    )
    return ["--threads", "1", *(a for s in values for a in ("--set", s))]


def test_two_process_gloo_epoch_matches_single_process(run, tmp_path) -> None:
    single = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "train", "--out", str(tmp_path / "one"), *sets(run)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    ddp = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(ROOT / "cli.py"),
            "train",
            "--out",
            str(tmp_path / "two"),
            *sets(run),
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    logs = {}
    for name in ("one", "two"):
        recs = [json.loads(x) for x in (tmp_path / name / "train-san" / "log.jsonl").read_text().splitlines()]
        logs[name] = {r["event"]: r for r in recs if r["event"] in ("epoch", "val")}
        assert sum(r["event"] == "train" for r in recs) == 16  # 128 train images / 8: same number of steps
    one, two = logs["one"], logs["two"]
    print(
        f"\nsingle: loss {one['epoch']['loss']:.5f} CIDEr {one['val']['CIDEr']:.4f}; "
        f"DDP x2: loss {two['epoch']['loss']:.5f} CIDEr {two['val']['CIDEr']:.4f}"
    )
    assert abs(one["epoch"]["loss"] - two["epoch"]["loss"]) < 0.02
    assert abs(one["val"]["CIDEr"] - two["val"]["CIDEr"]) < 0.02
    wa = CaptionerCheckpoint.load(tmp_path / "one" / "train-san" / "last.pt").weights
    wb = CaptionerCheckpoint.load(tmp_path / "two" / "train-san" / "last.pt").weights
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst < 1e-3, f"weights differ by up to {worst}"
    # only rank 0 wrote: one manifest, one log, no duplicated records
    assert (tmp_path / "two" / "train-san" / "manifest.json").exists()
