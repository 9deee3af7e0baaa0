"""``deterministic: true`` (train, train-detector) on the CPU: the settings it enters and restores, the one-line
refusal naming an operation without a deterministic kernel, the deterministic RoI-pool backward against
torchvision's, and a detector trained with it equal to one trained without (the CPU is deterministic anyway).
The CUDA claims (two runs and SIGKILL + resume bitwise equal) are in tests/test_gpu_determinism.py."""

from __future__ import annotations

import os

import pytest
import torch
from torchvision.ops import roi_pool as tv_roi_pool

from extractors.roi_pool import DeterministicRoIPool
from pipeline.core.config import load_config
from pipeline.core.errors import UsageError
from pipeline.core.training.determinism import CUBLAS_SETTING, deterministic_mode, nondeterministic_op


def _state() -> tuple:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
    )


def test_mode_sets_and_restores_the_settings(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = _state()
    assert before[0] is False
    with deterministic_mode(True, "train.deterministic"):
        assert _state() == (True, False, True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_SETTING == ":4096:8"
    assert _state() == before
    with deterministic_mode(False):
        assert _state() == before
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own valid choice is kept
    with deterministic_mode(True):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_an_op_without_a_deterministic_kernel_is_refused_in_one_line():
    # put_ without accumulation has no deterministic kernel on any device: a real refusal on the CPU
    with pytest.raises(UsageError) as exc:
        with deterministic_mode(True, "train.deterministic"):
            torch.zeros(3).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))
    msg = str(exc.value)
    assert (
        msg.startswith("train.deterministic=true: put_ has no deterministic implementation in torch")
        and "\n" not in msg
    )
    assert "set train.deterministic=false" in msg and not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(RuntimeError, match="unrelated"):  # other errors pass through unchanged
        with deterministic_mode(True):
            raise RuntimeError("unrelated")
    assert nondeterministic_op(RuntimeError("x")) is None


def test_deterministic_roi_pool_equals_torchvision_forward_and_backward():
    """Overlapping RoIs send several bins to one pixel; with small-integer gradients every sum is exact, so the
    index_add_ backward must equal torchvision's atomic-add backward exactly."""
    g = torch.Generator().manual_seed(0)
    feat = torch.randn(2, 3, 12, 16, generator=g)
    rois = torch.tensor(
        [
            [0, 0, 0, 100, 80],
            [0, 16, 16, 120, 100],
            [1, 30, 10, 200, 150],
            [1, 32, 12, 190, 140],
            [0, 250, 180, 255, 190],
        ],
        dtype=torch.float32,
    )  # the last one mostly outside: empty bins
    upstream = torch.randint(-3, 4, (5, 3, 7, 7), generator=g).float()
    a = feat.clone().requires_grad_(True)
    b = feat.clone().requires_grad_(True)
    out_tv = tv_roi_pool(a, rois, (7, 7), 1 / 16)
    out_det = DeterministicRoIPool.apply(b, rois, 7, 7, 1 / 16)
    assert torch.equal(out_tv, out_det)
    (out_tv * upstream).sum().backward()
    (out_det * upstream).sum().backward()
    assert torch.equal(a.grad, b.grad) and a.grad.abs().sum() > 0
    assert (b.grad != 0).sum() < b.grad.numel()  # only argmax pixels receive gradient


@pytest.mark.parametrize("stage,section", [("train", "train"), ("train_detector", "detector_train")])
def test_the_option_is_in_both_schemas(stage, section):
    assert load_config(stage, None, [])[section].deterministic is False
    assert load_config(stage, None, [f"{section}.deterministic=true"])[section].deterministic is True


def test_detector_trained_deterministic_equals_the_default_on_cpu(tmp_path, monkeypatch):
    from extractors.training.loop import train
    from extractors.training.stage import load_detector_config
    from pipeline.world.generate import generate_world

    world = tmp_path / "world"
    generate_world(
        world,
        load_config(
            "world",
            None,
            ["world.num_images=6", "world.image_size=[64, 96]", "world.max_objects=3", "world.num_workers=1"],
        ).world,
    )
    sets = [
        f"data.train_annotations={world / 'annotations' / 'instances_train.json'}",
        f"data.train_images={world / 'images'}",
        "detector_train.max_iter=3",
        "detector_train.steps=[2]",
        "detector_train.device=cpu",
    ]
    monkeypatch.setenv("BUTD_THREADS", "1")  # the one thread policy (--threads from the CLI)
    tiny = load_detector_config(os.path.join(os.path.dirname(__file__), "..", "configs", "detector", "tiny.yaml"), sets)
    plain = train(tmp_path / "a", tiny)
    det = train(tmp_path / "b", tiny.with_overrides(["detector_train.deterministic=true"]))
    wa = torch.load(plain.weights, map_location="cpu", weights_only=True)["model"]
    wb = torch.load(det.weights, map_location="cpu", weights_only=True)["model"]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the run
