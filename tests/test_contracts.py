"""Typed contracts between layers (docs/architecture.md#contracts): each has one writer and one reader; a file or
record written by the previous, untyped code still reads back; what does not fit is refused in one line naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from models.checkpoints import CaptionerCheckpoint, Progress, ReleaseInfo, TrainingState
from pipeline.core.checkpoint import save_checkpoint
from pipeline.core.errors import PipelineError

WORDS = ["<pad>", "<bos>", "<eos>", "<unk>", "a", "dog"]


def same(a: Any, b: Any) -> bool:
    """Deep equality over plain containers and tensors (bitwise, dtype included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def old_training_payload() -> dict[str, Any]:
    """``last.pt`` exactly as pipeline/training/engine.py wrote it before the contract (its ``_payload`` dict)."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return {
        "kind": "train",
        "model": {"name": "san", "config": {"d_model": 8, "num_layers": 1}, "vocab_size": len(WORDS)},
        "vocab": list(WORDS),
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "decoding": {"method": "beam", "beam_size": 3, "max_len": 16},
        "stage": "scst", "stage_done": False, "epoch": 2, "position": 5, "iteration": 41, "global_step": 97, "bad_epochs": 1,
        "best": {"metric": "CIDEr", "value": 0.5, "stage": "xe", "epoch": 3},
        "history": [{"stage": "xe", "epoch": 3, "global_step": 56, "CIDEr": 0.5}],
        "train_config": {"model": "san", "max_boxes": 36, "seed": 1},
        "store_identity": {"name": "bua-caffe", "weights_sha256": "ab" * 32, "recipe": {"min_size": 600}},
        "schedule": {"name": "step", "step": 41}, "optimizer": opt.state_dict(), "scaler": {},
        "rng": [{"torch": torch.get_rng_state()}],
    }


def old_release_payload() -> dict[str, Any]:
    """A converted release exactly as models/released wrote it before the contract."""
    return {
        "kind": "weights",
        "model": {"name": "m2", "config": {"d_model": 16, "fixed_regions": 50}, "vocab_size": len(WORDS)},
        "vocab": list(WORDS), "weights": {"w": torch.arange(6.0)},
        "decoding": {"method": "beam", "beam_size": 5, "stop_rule": "official_m2"},
        "train_config": {"max_boxes": None},
        "release": {"kind": "m2", "title": "M2", "weights_file": "m2.pth", "vocab_file": "vocab.pkl",
                    "features": {"recipe": "caffe", "boxes": "adaptive", "max_boxes": 50}, "converter_version": 1},
    }


@pytest.mark.parametrize("payload", [old_training_payload, old_release_payload], ids=["last.pt", "release"])
def test_a_checkpoint_written_by_the_old_code_loads_and_saves_back_the_same_keys(tmp_path: Path, payload) -> None:
    old = payload()
    save_checkpoint(tmp_path / "old.pt", old)
    ckpt = CaptionerCheckpoint.load(tmp_path / "old.pt")
    assert ckpt.kind == old["kind"] and ckpt.model_name == old["model"]["name"] and ckpt.vocab == tuple(WORDS)
    assert same(ckpt.to_dict(), old)  # the one writer writes the very payload the old code wrote
    ckpt.save(tmp_path / "new.pt")
    assert same(torch.load(tmp_path / "new.pt", weights_only=True), torch.load(tmp_path / "old.pt", weights_only=True))


def test_round_trip_equals(tmp_path: Path) -> None:
    ckpt = CaptionerCheckpoint(
        model_name="aoa", model_config={"d_model": 4}, vocab=tuple(WORDS), weights={"x": torch.randn(2, 2)},
        decoding={"beam_size": 2}, progress=Progress(stage="xe", epoch=1, best={"metric": "CIDEr", "value": 1.0}),
        state=TrainingState(optimizer={"state": {}, "param_groups": []}, schedule={"step": 3}, scaler={}, rng=[{}]),
        train_config={"max_boxes": 20}, store_identity={"name": "x"},
        release=ReleaseInfo("aoanet", "AoANet", "model-best.pth", "infos.pkl", {"recipe": "caffe"}, 1),
    )
    back = CaptionerCheckpoint.load(ckpt.save(tmp_path / "c.pt"))
    assert same(back.to_dict(), ckpt.to_dict())
    assert back.progress == ckpt.progress and back.release == ckpt.release and back.kind == "train" and back.max_boxes == 20


@pytest.mark.parametrize("plant,message", [
    (lambda d: d.update(surprise=1), "unknown field"),
    (lambda d: d.pop("weights"), "lacks weights"),
    (lambda d: d.pop("epoch"), "lacks epoch"),
    (lambda d: d.pop("optimizer"), "lacks optimizer"),
    (lambda d: d.update(kind="resume"), "kind 'resume'"),
    (lambda d: d["model"].update(vocab_size=99), "vocab_size"),
    (lambda d: d.update(vocab=["a", 3]), "vocabulary"),
    (lambda d: d.update(weights={"w": [1.0]}), "weights are not"),
    (lambda d: d.update(release={"kind": "m2"}), "malformed release"),
    (lambda d: d.update(decoding=[1]), "decoding is not a mapping"),
])
def test_a_planted_bad_field_is_refused_naming_the_file(tmp_path: Path, plant, message: str) -> None:
    data = old_training_payload()
    plant(data)
    path = save_checkpoint(tmp_path / "planted.pt", data)
    with pytest.raises(PipelineError, match=message) as err:
        CaptionerCheckpoint.load(path)
    assert str(path) in str(err.value) and len(str(err.value).splitlines()) == 1
