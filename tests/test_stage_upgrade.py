"""A stage finished or interrupted under the renamed keys' old spelling is recognised under the current one (the
detector's train: -> detector_train:, the removed thread settings, extract's new keys at their defaults, caption's
beam_size/n_best -> decoding:) instead of being refused as "a different config" (which only --force, a full
retraining, got past); a config that really differs is still refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core.config import Config, load_config
from pipeline.core.errors import UsageError
from pipeline.core.stages import RUNNING, run_stage


def old_detector(cfg: Config) -> Config:
    """The stage config the pre-rename code recorded for this detector training config."""
    d = cfg.to_dict()
    d["train"] = {**d.pop("detector_train"), "threads": 1}
    return Config(d)


def old_spellings() -> list[tuple[str, Config, Config]]:
    det = load_config("train_detector", "configs/detector/tiny.yaml", [])
    train = load_config("train").train
    ex = load_config("extract").extract
    demo = load_config("demo")
    old_ex = {k: v for k, v in ex.to_dict().items() if k not in ("bucket_window", "channels_last")}
    pictures = Config({"count": 2, "caption": demo.caption.to_dict(), "decoding": demo.decoding.to_dict()})
    old_pictures = Config({"count": 2, "caption": {**demo.caption.to_dict(), "beam_size": None, "n_best": 1}})
    return [
        ("detector", det, old_detector(det)),
        ("train", Config({"train": train.to_dict()}), Config({"train": {**train.to_dict(), "num_threads": None}})),
        (
            "extract",
            Config({"extract": ex.to_dict(), "job": {"weights": "random"}}),
            Config({"extract": old_ex, "job": {"weights": "random"}}),
        ),
        ("features", ex, Config(old_ex)),
        ("pictures", pictures, old_pictures),
    ]


@pytest.mark.parametrize("name,new,old", old_spellings(), ids=[n for n, _, _ in old_spellings()])
def test_a_stage_recorded_under_the_old_spelling_is_the_same_config(
    tmp_path: Path, name: str, new: Config, old: Config
) -> None:
    assert new.digest() != old.digest()
    calls: list[str] = []

    def work(stage_dir: Path, cfg: Config) -> dict:
        calls.append(cfg.digest())
        (stage_dir / "out.txt").write_text("x")
        return {"out": "out.txt"}

    run_stage(tmp_path, name, old, work)  # a finished stage recorded under the old spelling
    done = run_stage(tmp_path, name, new, work)
    assert done.skipped
    assert calls == [old.digest()]  # skipped, not refused, not redone
    # interrupted under the old spelling (its marker and a partial file): resumed, not refused
    stage = tmp_path / f"{name}-2"
    stage.mkdir()
    (stage / RUNNING).write_text(
        json.dumps({"stage": f"{name}-2", "config_digest": old.digest(), "config": old.to_dict()})
    )
    (stage / "partial.bin").write_bytes(b"1")
    run_stage(tmp_path, f"{name}-2", new, work)
    assert calls[-1] == new.digest()


def test_a_really_different_config_is_still_refused(tmp_path: Path) -> None:
    det = load_config("train_detector", "configs/detector/tiny.yaml", [])
    run_stage(tmp_path, "detector", old_detector(det), lambda d, c: {})
    changed = det.with_overrides(["detector_train.max_iter=7"])
    with pytest.raises(UsageError, match="different config"):
        run_stage(tmp_path, "detector", changed, lambda d, c: {})
