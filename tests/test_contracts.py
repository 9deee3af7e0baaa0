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
        "stage": "scst",
        "stage_done": False,
        "epoch": 2,
        "position": 5,
        "iteration": 41,
        "global_step": 97,
        "bad_epochs": 1,
        "best": {"metric": "CIDEr", "value": 0.5, "stage": "xe", "epoch": 3},
        "history": [{"stage": "xe", "epoch": 3, "global_step": 56, "CIDEr": 0.5}],
        "train_config": {"model": "san", "max_boxes": 36, "seed": 1},
        "store_identity": {"name": "bua-caffe", "weights_sha256": "ab" * 32, "recipe": {"min_size": 600}},
        "schedule": {"name": "step", "step": 41},
        "optimizer": opt.state_dict(),
        "scaler": {},
        "rng": [{"torch": torch.get_rng_state()}],
    }


def old_release_payload() -> dict[str, Any]:
    """A converted release exactly as models/released wrote it before the contract."""
    return {
        "kind": "weights",
        "model": {"name": "m2", "config": {"d_model": 16, "fixed_regions": 50}, "vocab_size": len(WORDS)},
        "vocab": list(WORDS),
        "weights": {"w": torch.arange(6.0)},
        "decoding": {"method": "beam", "beam_size": 5, "stop_rule": "official_m2"},
        "train_config": {"max_boxes": None},
        "release": {
            "kind": "m2",
            "title": "M2",
            "weights_file": "m2.pth",
            "vocab_file": "vocab.pkl",
            "features": {"recipe": "caffe", "boxes": "adaptive", "max_boxes": 50},
            "converter_version": 1,
        },
    }


@pytest.mark.parametrize("payload", [old_training_payload, old_release_payload], ids=["last.pt", "release"])
def test_a_checkpoint_written_by_the_old_code_loads_and_saves_back_the_same_keys(tmp_path: Path, payload) -> None:
    old = payload()
    save_checkpoint(tmp_path / "old.pt", old)
    ckpt = CaptionerCheckpoint.load(tmp_path / "old.pt")
    assert ckpt.kind == old["kind"] and ckpt.model_name == old["model"]["name"] and ckpt.vocab == tuple(WORDS)
    assert same(ckpt.to_dict(), old)  # the one writer writes back the very payload the file held
    ckpt.save(tmp_path / "new.pt")
    assert same(torch.load(tmp_path / "new.pt", weights_only=True), torch.load(tmp_path / "old.pt", weights_only=True))


def test_round_trip_equals(tmp_path: Path) -> None:
    ckpt = CaptionerCheckpoint(
        model_name="aoa",
        model_config={"d_model": 4},
        vocab=tuple(WORDS),
        weights={"x": torch.randn(2, 2)},
        decoding={"beam_size": 2},
        progress=Progress(stage="xe", epoch=1, best={"metric": "CIDEr", "value": 1.0}),
        state=TrainingState(optimizer={"state": {}, "param_groups": []}, schedule={"step": 3}, scaler={}, rng=[{}]),
        train_config={"max_boxes": 20},
        store_identity={"name": "x"},
        release=ReleaseInfo("aoanet", "AoANet", "model-best.pth", "infos.pkl", {"recipe": "caffe"}, 1),
    )
    back = CaptionerCheckpoint.load(ckpt.save(tmp_path / "c.pt"))
    assert same(back.to_dict(), ckpt.to_dict())
    assert (
        back.progress == ckpt.progress
        and back.release == ckpt.release
        and back.kind == "train"
        and back.max_boxes == 20
    )


@pytest.mark.parametrize(
    "plant,message",
    [
        (lambda d: d.update(surprise=1), "unknown field"),
        (lambda d: d.pop("weights"), "lacks weights"),
        (lambda d: d.pop("epoch"), "lacks epoch"),
        (lambda d: d.pop("optimizer"), "lacks optimizer"),
        (lambda d: d.update(kind="resume"), "kind 'resume'"),
        (lambda d: d["model"].update(vocab_size=99), "vocab_size"),
        (lambda d: d.update(vocab=["a", 3]), "vocabulary"),
        (lambda d: d.update(weights={"w": [1.0]}), "weights are not"),
        (lambda d: d.update(release={"kind": "m2"}), "malformed release"),
        (lambda d: d.update(release={**old_release_payload()["release"], "features": None}), "malformed release"),
        (lambda d: d.update(release={**old_release_payload()["release"], "title": ["M2"]}), "malformed release"),
        (lambda d: d.update(decoding=[1]), "decoding is not a mapping"),
        (lambda d: d.update(epoch="2"), "malformed progress"),
        (lambda d: d.update(stage_done=1), "malformed progress"),
        (lambda d: d.update(best=[0.5]), "malformed progress"),
    ],
)
def test_a_planted_bad_field_is_refused_naming_the_file(tmp_path: Path, plant, message: str) -> None:
    data = old_training_payload()
    plant(data)
    path = save_checkpoint(tmp_path / "planted.pt", data)
    with pytest.raises(PipelineError, match=message) as err:
        CaptionerCheckpoint.load(path)
    assert str(path) in str(err.value) and len(str(err.value).splitlines()) == 1


# -- FeatureIdentity ------------------------------------------------------------------------------------------

#: a store identity exactly as ``extract`` wrote it before the contract (extractors/factory.py built the dict,
#: configure_recipe changed it in place, extractors/run.py's record_settings extended it)
OLD_EXTRACT_IDENTITY = {
    "name": "bottom-up-caffe",
    "weights_sha256": "c" * 64,
    "layout": "caffe",
    "config": {
        "spec": {"min_size": 600, "max_size": 1000, "num_classes": 1601},
        "labelmap_sha256": "d" * 64,
        "recipe": {"name": "caffe", "rescale": "caffe", "conf_thresh": 0.2},
        "precision": "tf32",
        "boxes": {"mode": "adaptive", "min": 10, "max": 100, "conf": 0.2, "nms": 0.3},
    },
}
OTHER_PRODUCERS = [
    {"name": "imported:m2", "config": {"format": "m2"}, "release": {"recipe": "m2", "source": "x"}},
    {
        "name": "oracle",
        "source": "synthetic-world ground truth",
        "noise": 0.1,
        "extra_dims": 0,
        "seed": 3,
        "box_features": False,
    },
    {"name": "test-extractor", "weights_sha256": "0" * 64, "config": {"boxes": [10, 30]}},
    {"name": "odd", "config": {}, "layout": None, "recipe": {"rescale": "d2"}},
]


@pytest.mark.parametrize(
    "record", [OLD_EXTRACT_IDENTITY, *OTHER_PRODUCERS], ids=["extract", "import", "oracle", "helper", "odd"]
)
def test_every_stored_identity_reads_back_to_the_same_record(record: dict) -> None:
    from pipeline.core.identity import FeatureIdentity

    assert FeatureIdentity.from_dict(record).to_dict() == record


def test_the_builder_gives_the_record_the_old_code_wrote_and_the_same_store_bytes(tmp_path: Path) -> None:
    import h5py
    from store_helpers import add_image, synthetic_image

    from extractors.factory import record_settings
    from pipeline.core.identity import FeatureIdentity
    from pipeline.store import FeatureStore, open_writer

    class Spec:
        def to_dict(self):
            return dict(OLD_EXTRACT_IDENTITY["config"]["spec"])

    class Recipe:
        selector, min_boxes, max_boxes, conf_thresh, nms_thresh = "adaptive", 10, 100, 0.2, 0.3

        def to_dict(self):
            return dict(OLD_EXTRACT_IDENTITY["config"]["recipe"])

    model, selector = type("M", (), {"spec": Spec()})(), type("S", (), {"recipe": Recipe()})()
    base = FeatureIdentity(
        name="bottom-up-caffe", weights_sha256="c" * 64, layout="caffe", spec={"min_size": 1}, labelmap_sha256="d" * 64
    )
    built = record_settings(base, model, selector, "tf32")
    assert built.to_dict() == OLD_EXTRACT_IDENTITY
    for name, identity in (("old", OLD_EXTRACT_IDENTITY), ("new", built)):
        with open_writer(tmp_path / name, identity, "float32") as w:
            add_image(w, synthetic_image(0))
    assert (tmp_path / "old" / "store.json").read_bytes() == (tmp_path / "new" / "store.json").read_bytes()
    with (
        h5py.File(tmp_path / "old" / "seg-000000.h5", "r") as a,
        h5py.File(tmp_path / "new" / "seg-000000.h5", "r") as b,
    ):
        assert a.attrs["identity"] == b.attrs["identity"]
    assert FeatureIdentity.from_dict(FeatureStore(tmp_path / "old").identity) == built
    # a cache opened with the typed identity accepts the store written from the dict (match on feature settings)
    open_writer(tmp_path / "old", built, match="features").close()


def test_the_typed_comparison_names_the_differing_field(tmp_path: Path) -> None:
    from dataclasses import replace

    from pipeline.core.errors import UsageError
    from pipeline.core.identity import FeatureIdentity
    from pipeline.store import open_writer

    stored = FeatureIdentity.from_dict(OLD_EXTRACT_IDENTITY)
    assert stored.settings_diff(replace(stored, name="renamed", layout="other", labelmap_sha256=None)) == []
    assert stored.settings_diff(replace(stored, precision="bf16")) == ['config.precision (stored "tf32", given "bf16")']
    assert stored.settings_diff(replace(stored, boxes={**stored.boxes, "max": 36})) == [
        "config.boxes.max (stored 100, given 36)"
    ]
    assert stored.settings_diff(replace(stored, weights_sha256=None)) == [
        f'weights_sha256 (stored "{"c" * 64}", given (not recorded))'
    ]
    assert stored.settings_diff(replace(stored, recipe=None, boxes=None)) == []  # recorded by one side only: agree
    with open_writer(tmp_path / "s", OLD_EXTRACT_IDENTITY, "float32"):
        pass
    with pytest.raises(UsageError, match=r"other settings: config.spec.min_size \(stored 600, given 800\)"):
        open_writer(tmp_path / "s", replace(stored, spec={**stored.spec, "min_size": 800}), match="features")
