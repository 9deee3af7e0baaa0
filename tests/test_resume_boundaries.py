"""Exact resume at every boundary: with a schedule that changes the rate at every epoch (XE and SCST), a run
SIGKILLed just after an epoch end, mid-epoch, during validation and during SCST, resumed each time, ends with
bitwise the same weights, optimizer and schedule state as a run that was never interrupted (CPU, one process).

The kills happen at exact points inside the child process (tests/train_kill_child.py wraps the trainer there)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from forked_cli import ForkedCli
from train_helpers import make_world_run, train_overrides

from models.checkpoints import CaptionerCheckpoint

ROOT = Path(__file__).resolve().parent.parent
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "BUTD_NO_PROGRESS": "1",
    "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
}
#: 4 batches per XE epoch, 3 per SCST epoch, last.pt every 2 steps; the rate halves at every epoch of both stages
SETS = [
    "train.checkpoint_every=2",
    "train.validation.decoding={method: greedy}",
    "train.validation.batch_size=2",
    "train.validation.max_images=6",
    "train.batching=random",
    "train.model_overrides={d_model: 32, num_heads: 2, d_ff: 64, num_layers: 1, dropout: 0.1, embed_dropout: 0.1}",
    "train.xe={epochs: 3, batch_size: 8, lr: 1.0e-3, warmup_iters: 0, decay_start_epoch: 1, decay_every_epochs: 1, "
    "decay_rate: 0.5}",
    "train.scst={epochs: 2, batch_size: 12, lr: 1.0e-4, num_samples: 2, lr_schedule: step, lr_decay_every: 1, "
    "lr_decay_rate: 0.5}",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_world_run(tmp_path_factory.mktemp("boundaries"), num_images=40)


def train(forked_cli: ForkedCli, run: Path, out: Path, kill: str | None = None) -> subprocess.CompletedProcess:
    """`cli.py train` in a child process forked from an interpreter that has imported the CLI (tests/forked_cli.py);
    with ``kill``, tests/train_kill_child.py runs it and SIGKILLs the child at that point."""
    sets = train_overrides(run, "san", *SETS)
    args = [*(a for s in sets for a in ("--set", s)), "--threads", "1"]
    script, env = ROOT / "cli.py", ENV
    if kill is not None:
        script, env = ROOT / "tests" / "train_kill_child.py", {**ENV, "BUTD_TEST_KILL": kill}
    logs = out.with_name(f"{out.name}-{kill or 'whole'}".replace(":", "-"))
    cmd = [str(script), "train", "--out", str(out), *args]
    child = forked_cli.start(cmd, stdout=logs.with_suffix(".out"), stderr=logs.with_suffix(".err"), env=env)
    child.wait(timeout=600)
    return subprocess.CompletedProcess(cmd, child.returncode, *child.output())


def assert_bitwise_equal(a: dict, b: dict, what: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), what
    elif isinstance(a, dict):
        assert set(a) == set(b), what
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def test_kill_at_every_boundary_then_resume_is_bitwise_identical(
    run: Path, tmp_path: Path, forked_cli: ForkedCli
) -> None:
    ref = train(forked_cli, run, tmp_path / "a")
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "b"
    last = out / "train-san" / "last.pt"
    checks = [
        (
            "epoch_end:xe:0",
            lambda c: (c.progress.stage, c.progress.epoch, c.progress.position) == ("xe", 1, 0),
        ),  # the rate changes here
        (
            "step:xe:8",
            lambda c: (c.progress.stage, c.progress.epoch, c.progress.position) == ("xe", 1, 2),
        ),  # step 7 is lost and redone
        ("validation:xe:1", lambda c: (c.progress.stage, c.progress.epoch, c.progress.position) == ("xe", 1, 4)),
        ("epoch_end:scst:0", lambda c: (c.progress.stage, c.progress.epoch, c.progress.position) == ("scst", 1, 0)),
        ("step:scst:6", lambda c: (c.progress.stage, c.progress.epoch, c.progress.position) == ("scst", 1, 1)),
    ]
    for kill, where in checks:
        res = train(forked_cli, run, out, kill)
        assert res.returncode == -signal.SIGKILL, f"{kill}: {res.stderr[-3000:]}"
        ck = CaptionerCheckpoint.load(last)
        assert where(ck), (
            f"{kill}: last.pt at {ck.progress.stage} epoch {ck.progress.epoch} position {ck.progress.position}"
        )
    done = train(forked_cli, run, out)
    assert done.returncode == 0, done.stderr[-3000:]
    rates = [
        r["lr"]
        for r in map(json.loads, (tmp_path / "a" / "train-san" / "log.jsonl").read_text().splitlines())
        if r["event"] == "train" and r["stage"] == "xe"
    ]
    assert rates == [1e-3] * 4 + [5e-4] * 4 + [2.5e-4] * 4  # every step of an epoch at that epoch's rate
    a, b = (
        CaptionerCheckpoint.load(tmp_path / "a" / "train-san" / "last.pt").to_dict(),
        CaptionerCheckpoint.load(last).to_dict(),
    )
    assert a["stage"] == b["stage"] == "scst" and a["stage_done"] and b["stage_done"]
    for key in ("weights", "optimizer", "schedule", "global_step", "iteration", "epoch"):
        assert_bitwise_equal(a[key], b[key], key)
    assert_bitwise_equal(
        CaptionerCheckpoint.load(tmp_path / "a" / "train-san" / "xe.pt").weights,
        CaptionerCheckpoint.load(out / "train-san" / "xe.pt").weights,
        "xe.pt weights",
    )
