"""The training core shared by the three trainers (pipeline/core/training): precision, seeding, the stop-on-signal
context, the non-finite check, the optimizer step and the resume bookkeeping; the old ``amp`` key is refused."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import pytest
import torch

from pipeline.core.config import load_config
from pipeline.core.distributed import DistContext, resolve_device
from pipeline.core.errors import ConfigError, PipelineError, UsageError
from pipeline.core.training import (
    StopOnSignal,
    TrainingInterrupted,
    autocast,
    check_finite,
    make_scaler,
    optimizer_step,
    resolve_precision,
    restore_training_state,
    seed_everything,
    training_state,
)

CPU = torch.device("cpu")


def test_precision_is_one_setting_with_clear_errors():
    assert resolve_precision("auto", CPU) == "fp32" and resolve_precision("bf16", CPU) == "bf16"
    with pytest.raises(UsageError, match="train.precision=fp16 needs a CUDA device"):
        resolve_precision("fp16", CPU, "train.precision")
    with pytest.raises(UsageError, match="must be one of auto, fp32, tf32, bf16, fp16"):
        resolve_precision("none", CPU)
    with autocast(CPU, "bf16"):
        assert torch.ones(2, 2).matmul(torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast(CPU, "fp32"):
        assert torch.ones(2, 2).matmul(torch.ones(2, 2)).dtype == torch.float32
    assert make_scaler("fp32", CPU) is None and make_scaler("bf16", CPU) is None


@pytest.mark.parametrize("stage,key,today", [("train", "train", "train"), ("embed", "encoder", "sentence_encoder")])
def test_the_old_amp_key_is_refused_naming_precision(stage, key, today, tmp_path):
    """The message names today's key, also for a key renamed twice (``encoder.amp``: section and key)."""
    with pytest.raises(ConfigError, match=rf"'{key}.amp' was renamed: use '{today}.precision'"):
        load_config(stage, None, [f"{key}.amp=bf16"])
    old = tmp_path / "old.yaml"
    old.write_text(f"{key}:\n  amp: none\n")
    with pytest.raises(ConfigError, match=rf"{old}: '{key}.amp' was renamed: use '{today}.precision'"):
        load_config(stage, old)
    assert load_config(stage, None, [f"{today}.precision=bf16"])[today].precision == "bf16"


def test_cli_refuses_amp_with_one_line_and_exit_2(cli, tmp_path):
    res = cli("train", "--out", str(tmp_path), "--set", "train.amp=bf16", timeout=120)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert [line for line in lines if line.startswith("error:")] == [lines[-1]] and "train.precision" in lines[-1]


def test_seed_everything_seeds_python_numpy_and_torch():
    seed_everything(7)
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    seed_everything(7)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


def test_device_resolution():
    assert resolve_device("auto") == (torch.device("cuda", 0) if torch.cuda.is_available() else CPU)
    assert resolve_device("cpu") == CPU
    with pytest.raises(UsageError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="CUDA is not available"):
            resolve_device("cuda")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def test_optimizer_step_clips_by_value_then_norm():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    loss = (model(torch.full((4, 3), 100.0)) ** 2).sum()
    optimizer_step(loss, opt, clip_value=0.5)
    grads = [p.grad for p in model.parameters()]
    assert max(float(g.abs().max()) for g in grads) == pytest.approx(0.5)  # every element clipped into [-0.5, 0.5]
    assert all(torch.allclose(b - p, g) for b, p, g in zip(before, model.parameters(), grads))  # then SGD with lr 1
    loss = (model(torch.full((4, 3), 100.0)) ** 2).sum()
    optimizer_step(loss, opt, clip_norm=1.0)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    assert float(total) == pytest.approx(1.0, rel=1e-5)


def test_check_finite_raises_with_the_trainers_message():
    check_finite(1.5, DistContext(), "unused")
    with pytest.raises(PipelineError, match="loss became nan at step 3"):
        check_finite(float("nan"), DistContext(), "loss became nan at step 3")


def test_stop_on_signal_saves_then_raises_and_restores_the_handler():
    saved = []
    previous = signal.getsignal(signal.SIGTERM)
    with StopOnSignal() as stop:
        stop.check(DistContext(), lambda: saved.append("x"), "epoch 0, batch 1", "last.pt")  # nothing requested yet
        assert saved == []
        os.kill(os.getpid(), signal.SIGTERM)  # handled: sets the flag instead of killing the test
        assert stop.signum == signal.SIGTERM
        with pytest.raises(TrainingInterrupted, match="at epoch 0, batch 1; checkpoint saved to last.pt") as err:
            stop.check(DistContext(), lambda: saved.append("x"), "epoch 0, batch 1", "last.pt")
    assert saved == ["x"] and err.value.exit_code == 130
    assert signal.getsignal(signal.SIGTERM) is previous


def test_training_state_round_trip_resumes_the_random_streams_and_optimizer():
    ctx = DistContext()
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    optimizer_step(model(torch.ones(1, 3)).sum(), opt)
    seed_everything(3)
    state = training_state(opt, make_scaler("fp32", CPU), ctx)
    assert len(state["rng"]) == 1 and state["scaler"] == {}
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    seed_everything(99)
    fresh = torch.optim.Adam(_model().parameters(), lr=0.1)
    assert restore_training_state(state, fresh, None, ctx, fallback_seed=0)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    # a checkpoint from two processes restores rank 0's state in one process (and says it is not exact)
    assert not restore_training_state({**state, "rng": state["rng"] * 2}, fresh, None, ctx, fallback_seed=0)
