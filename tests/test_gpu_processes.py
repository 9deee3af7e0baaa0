"""torchrun with more processes than visible GPUs, on a CPU machine with a simulated GPU count: training
refuses in one line before any work (exit 2, NCCL cannot share a GPU between ranks); extraction shares the
GPUs (local rank r on cuda:(r mod GPUs)) and says so in the log. The real path is in tests/test_gpu_paths.py."""

from __future__ import annotations

import logging

import pytest
import torch
from typer.testing import CliRunner

from cli import app
from pipeline.core import distributed
from pipeline.core.config import load_config
from pipeline.core.errors import UsageError


def _simulate(monkeypatch, gpus: int, local_rank: int = 0, local_world: int = 1) -> None:
    """``gpus`` visible CUDA devices (nothing touches a real one before the refusal) and torchrun's environment."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for key, val in (
        ("WORLD_SIZE", local_world),
        ("RANK", local_rank),
        ("LOCAL_RANK", local_rank),
        ("LOCAL_WORLD_SIZE", local_world),
    ):
        monkeypatch.setenv(key, str(val))


@pytest.mark.parametrize("name", ["auto", "cuda"])
def test_training_refuses_more_processes_than_gpus(monkeypatch, name):
    _simulate(monkeypatch, gpus=1, local_rank=0, local_world=2)
    with pytest.raises(UsageError) as exc:
        distributed.check_gpu_per_process(name, "train.device")
    msg = str(exc.value)
    assert msg.startswith("2 processes but 1 visible GPU: training needs one GPU per process") and "\n" not in msg
    assert "--nproc_per_node 1" in msg and "train.device=cpu" in msg


def test_training_accepts_a_gpu_per_process_and_any_number_on_cpu(monkeypatch):
    _simulate(monkeypatch, gpus=2, local_rank=1, local_world=2)
    distributed.check_gpu_per_process("auto", "train.device")  # 2 processes, 2 GPUs
    assert distributed.resolve_device("cuda") == torch.device("cuda", 1)
    _simulate(monkeypatch, gpus=1, local_rank=3, local_world=4)
    distributed.check_gpu_per_process("cpu", "train.device")  # gloo: no GPU needed
    _simulate(monkeypatch, gpus=0, local_rank=3, local_world=4)
    distributed.check_gpu_per_process("auto", "train.device")  # auto on a machine without CUDA is the CPU


def test_training_refuses_every_rank_on_one_pinned_gpu(monkeypatch):
    _simulate(monkeypatch, gpus=2, local_rank=0, local_world=2)
    with pytest.raises(UsageError, match=r"^2 processes but train.device=cuda:0 puts them all on one GPU"):
        distributed.check_gpu_per_process("cuda:0", "train.device")


def test_resolve_device_names_the_missing_gpu_in_one_line(monkeypatch):
    _simulate(monkeypatch, gpus=1, local_rank=1, local_world=2)
    with pytest.raises(
        UsageError, match=r"^2 processes but 1 visible GPU: process 1 on this machine has no GPU of its own"
    ):
        distributed.resolve_device("cuda")  # was cuda:1, and "invalid device ordinal" at its first use
    with pytest.raises(UsageError, match=r"^device cuda:3 requested but there is 1 visible GPU \(cuda:0 to cuda:0\)"):
        distributed.resolve_device("cuda:3", 0)


@pytest.mark.parametrize("rank", [0, 1])
def test_train_detector_command_refuses_before_any_work(monkeypatch, tmp_path, rank):
    _simulate(monkeypatch, gpus=1, local_rank=rank, local_world=2)
    out = tmp_path / "det"
    res = CliRunner().invoke(app, ["train-detector", "--out", str(out), "--set", "data.train_annotations=missing.json"])
    assert res.exit_code == 2, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: 2 processes but 1 visible GPU: training needs one GPU per process"
    ), res.output
    assert "Traceback" not in res.output and not out.exists()


def test_train_command_refuses_before_any_work(monkeypatch, tmp_path):
    _simulate(monkeypatch, gpus=1, local_rank=1, local_world=2)
    (tmp_path / "store").mkdir()
    (tmp_path / "data").mkdir()
    out = tmp_path / "run"
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--out",
            str(out),
            "--set",
            f"train.store={tmp_path / 'store'}",
            "--set",
            f"train.data={tmp_path / 'data'}",
        ],
    )
    assert res.exit_code == 2, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert (
        len(errors) == 1
        and errors[0].startswith("error: 2 processes but 1 visible GPU")
        and "Traceback" not in res.output
    ), res.output
    assert not out.exists() or not any(out.iterdir())


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _logged_device(section, job) -> tuple[torch.device, str]:
    """``_device`` and what it logged (the project logger does not propagate to pytest's capture)."""
    from extractors.stage import _device
    from pipeline.core.console import get_logger

    log, handler = get_logger("extract"), _Lines()
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        return _device(section, job), "\n".join(handler.lines)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


@pytest.mark.parametrize("name", ["auto", "cuda"])
def test_extraction_shares_the_gpus_and_logs_it(monkeypatch, name):
    from extractors.stage import ExtractJob

    _simulate(monkeypatch, gpus=2, local_rank=3, local_world=4)
    section = load_config("extract", None, [f"extract.device={name}"]).extract
    job = ExtractJob("random", ("x.jpg",), None, None, None, (3, 4), None, store=".", shard_block=2)
    dev, text = _logged_device(section, job)
    assert dev == torch.device("cuda", 1)
    assert (
        "4 processes share 2 visible GPUs: local rank r extracts on cuda:(r mod 2) "
        "(this process: local rank 3 on cuda:1)" in text
    )
    _simulate(monkeypatch, gpus=2, local_rank=1, local_world=2)  # one process per GPU: nothing to say
    dev, text = _logged_device(section, ExtractJob("random", ("x.jpg",), None, None, None, (1, 2), None, store="."))
    assert dev == torch.device("cuda", 1) and "share" not in text
    cpu = load_config("extract", None, ["extract.device=cpu"]).extract
    assert _logged_device(cpu, job)[0] == torch.device("cpu")
