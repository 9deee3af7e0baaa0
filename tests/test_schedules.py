"""Learning-rate schedules: the papers' numbers, torch's plateau semantics, exact resume, YAML building."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from pipeline.core.errors import ConfigError
from pipeline.training.schedules import apply_lr, build_schedule


def test_noam_matches_the_m2_formula() -> None:
    s = build_schedule({"type": "noam", "d_model": 512, "warmup": 10000})
    lrs = [s.lr()] + [s.step() for _ in range(20000)]
    for step in (1, 100, 9999, 10000, 10001, 20000):
        assert lrs[step - 1] == pytest.approx(512**-0.5 * min(step**-0.5, step * 10000**-1.5), rel=1e-12)
    assert max(lrs) == pytest.approx(lrs[9999])  # the peak is at the end of warm-up
    assert max(lrs) == pytest.approx(512**-0.5 * 10000**-0.5)


def test_noam_m2_epoch_step_quirk() -> None:
    """M2 steps LambdaLR once at construction and at the start of every XE epoch (its train_xe), then per
    iteration; its lambda adds 1: the first iteration uses s = 2, and epoch e's start adds one more."""
    s = build_schedule({"type": "noam", "warmup": 100, "extra_step_per_epoch": True})
    assert s.lr() == pytest.approx(512**-0.5 * 2 * 100**-1.5)
    for _ in range(10):
        s.step()
    s.epoch_end()
    s.epoch_end()
    assert s.lr() == pytest.approx(512**-0.5 * 14 * 100**-1.5)  # 10 iterations + 3 epoch-start steps + 1


def test_aoanet_step_decay() -> None:
    """lr = 2e-4 * 0.8^floor(e/3) (husthuaan/AoANet train.py)."""
    s = build_schedule({"type": "step", "lr": 2e-4, "decay_rate": 0.8, "decay_every": 3, "decay_start": 0})
    got = []
    for _ in range(10):
        got.append(s.lr())
        s.step()
        s.epoch_end()
    assert got == pytest.approx([2e-4 * 0.8 ** (e // 3) for e in range(10)], rel=1e-12)


def test_ngsan_warmup_then_halving_every_three_epochs_after_six() -> None:
    s = build_schedule(
        {"type": "step", "lr": 3e-4, "decay_rate": 0.5, "decay_every": 3, "decay_start": 3, "warmup_iters": 100}
    )
    assert s.lr() == pytest.approx(3e-4 / 100)  # first iteration of the linear warm-up
    for _ in range(49):
        s.step()
    assert s.lr() == pytest.approx(3e-4 * 50 / 100)
    per_epoch = []
    for _ in range(12):
        for _ in range(60):
            s.step()
        per_epoch.append(s.lr())
        s.epoch_end()
    # epochs 0..5 at the full rate (after warm-up), 6..8 halved, 9..11 quartered
    assert per_epoch == pytest.approx([3e-4] * 6 + [1.5e-4] * 3 + [7.5e-5] * 3, rel=1e-12)


def test_plateau_equals_torch_reduce_lr_on_plateau() -> None:
    metrics = [1.0, 1.1, 1.1, 1.09, 1.1, 1.1, 1.2, 1.2, 1.2, 1.19, 1.2, 1.0, 1.0, 1.0, 1.0, 1.0, 1.3]
    s = build_schedule({"type": "plateau", "lr": 2e-5, "factor": 0.5, "patience": 3})
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2e-5)
    ref = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=3, threshold=1e-4)
    for m in metrics:
        ref.step(m)
        assert s.epoch_end(m) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12)
    assert s.lr() < 2e-5  # it did reduce
    with pytest.raises(ValueError, match="finite"):
        s.epoch_end(float("nan"))


@pytest.mark.parametrize(
    "spec",
    [
        {"type": "noam", "d_model": 512, "warmup": 50},
        {"type": "step", "lr": 3e-4, "decay_rate": 0.5, "decay_every": 3, "decay_start": 3, "warmup_iters": 40},
        {"type": "plateau", "lr": 1e-3, "factor": 0.8, "patience": 1},
        {"type": "constant", "lr": 5e-6},
    ],
)
def test_resume_from_state_dict_is_exact(spec: dict) -> None:
    metrics = [0.5, 0.6, 0.55, 0.54, 0.53, 0.7, 0.69, 0.68, 0.67]

    def run(s, epochs):
        out = []
        for e in epochs:
            for _ in range(17):
                out.append(s.step())
            out.append(s.epoch_end(metrics[e]))
        return out

    full = run(build_schedule(spec), range(9))
    first = build_schedule(spec)
    head = run(first, range(4))
    state = json.loads(json.dumps(first.state_dict()))  # plain data: JSON / weights_only checkpoints
    resumed = build_schedule(spec)
    resumed.load_state_dict(state)
    assert head + run(resumed, range(4, 9)) == full


def test_load_refuses_another_schedule() -> None:
    a = build_schedule({"type": "step", "lr": 2e-4})
    b = build_schedule({"type": "step", "lr": 3e-4})
    with pytest.raises(ConfigError, match="does not match"):
        b.load_state_dict(a.state_dict())


def test_build_from_yaml_and_errors() -> None:
    spec = yaml.safe_load("schedule:\n  type: step\n  lr: 2.0e-4\n  decay_every: 3\n")["schedule"]
    s = build_schedule(spec, "aoa.yaml: train.schedule")
    assert s.lr() == pytest.approx(2e-4)
    with pytest.raises(ConfigError, match="unknown schedule type 'cosine'"):
        build_schedule({"type": "cosine"})
    with pytest.raises(ConfigError, match=r"aoa.yaml: train.schedule: unknown key\(s\) decay"):
        build_schedule({"type": "step", "decay": 0.8}, "aoa.yaml: train.schedule")
    with pytest.raises(ConfigError, match="needs a 'type'"):
        build_schedule({"lr": 1e-4})
    with pytest.raises(ConfigError, match="warmup: expected int"):
        build_schedule({"type": "noam", "warmup": "10k"})
    opt = torch.optim.Adam([torch.zeros(2, requires_grad=True)], lr=1.0)
    apply_lr(opt, s.lr())
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-4)
    assert math.isfinite(build_schedule({"type": "noam"}).lr())
