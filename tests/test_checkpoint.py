"""Checkpoints: round trip, exact RNG restore, refusal of foreign, unsafe and truncated files."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.core.checkpoint import capture_rng_state, load_checkpoint, restore_rng_state, save_checkpoint
from pipeline.core.errors import PipelineError, UsageError


def draws() -> tuple:
    return (
        random.random(),
        random.gauss(0, 1),
        float(np.random.rand()),
        float(np.random.randn()),
        torch.rand(3).tolist(),
    )


def test_rng_state_round_trip_through_a_file(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's generator
    np.random.randn()
    save_checkpoint(tmp_path / "c.pt", {"rng": capture_rng_state()})
    expected = draws()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert draws() != expected
    restore_rng_state(load_checkpoint(tmp_path / "c.pt")["rng"])
    assert draws() == expected


def test_weights_and_metadata_round_trip(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    payload = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "vocab": ["<pad>", "a"],
        "epoch": 3,
        "config": {"lr": 1e-4},
    }
    save_checkpoint(tmp_path / "c.pt", payload)
    back = load_checkpoint(tmp_path / "c.pt", required=("model", "optimizer"))
    assert back["epoch"] == 3 and back["vocab"] == ["<pad>", "a"] and back["config"] == {"lr": 1e-4}
    for k, v in model.state_dict().items():
        assert torch.equal(back["model"][k], v)
    with pytest.raises(PipelineError, match="lacks scaler"):
        load_checkpoint(tmp_path / "c.pt", required=("scaler",))


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_refuses_unsafe_foreign_truncated_and_missing_files(tmp_path: Path) -> None:
    evil = tmp_path / "evil.pt"
    torch.save({"format": "butd-caption-checkpoint", "version": 1, "x": Evil()}, evil)
    with pytest.raises(PipelineError, match="cannot read checkpoint .*evil.pt"):
        load_checkpoint(evil)
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(PipelineError, match="plain.pkl"):
        load_checkpoint(plain)
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(PipelineError, match="not a butd-caption checkpoint"):
        load_checkpoint(foreign)
    good = tmp_path / "good.pt"
    save_checkpoint(good, {"w": torch.zeros(1000)})
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:500])
    with pytest.raises(PipelineError, match="cut.pt"):
        load_checkpoint(cut)
    with pytest.raises(UsageError, match="not found"):
        load_checkpoint(tmp_path / "none.pt")


def test_atomic_writes_get_the_usual_file_mode(tmp_path: Path) -> None:
    import os

    from pipeline.core.fileio import atomic_write_text

    mask = os.umask(0o022)
    try:
        import importlib

        import pipeline.core.fileio as fio

        importlib.reload(fio)
        path = fio.atomic_write_text(tmp_path / "x.json", "{}")
        assert (path.stat().st_mode & 0o777) == 0o644
        assert not list(tmp_path.glob(".x.json.*"))  # no temporary left behind
    finally:
        os.umask(mask)
        importlib.reload(fio)
    assert atomic_write_text  # the public helper is the one the stages use
