"""Stage bookkeeping (pipeline/core/stages.py): a stage that failed or was killed never blocks a later run with
another config without naming the option that clears it, and ``--force`` clears it (issue: ``--force`` could
not restart an interrupted stage)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pipeline.core.config import Config
from pipeline.core.errors import ConfigError, UsageError
from pipeline.core.stages import MANIFEST, RUNNING, run_stage

REPO = Path(__file__).resolve().parent.parent


def _failing(stage_dir: Path, cfg: Config) -> dict:
    (stage_dir / "partial.bin").write_bytes(b"half")  # it got somewhere before failing
    raise ConfigError(f"model.lr must be a number, got {cfg.lr!r}")


def _working(stage_dir: Path, cfg: Config) -> dict:
    (stage_dir / "out.txt").write_text(str(cfg.lr))
    return {"out": "out.txt"}


def test_failed_stage_names_force_and_force_clears_it(tmp_path):
    with pytest.raises(ConfigError, match="must be a number"):
        run_stage(tmp_path, "train", Config({"lr": "fast"}), _failing)
    marker = json.loads((tmp_path / "train" / RUNNING).read_text())
    assert "must be a number" in marker["error"]  # the failure is recorded for the next run's message
    with pytest.raises(UsageError) as err:  # another config, no --force: refused, naming --force and the failure
        run_stage(tmp_path, "train", Config({"lr": 0.1}), _working)
    assert "--force" in str(err.value) and "must be a number" in str(err.value)
    result = run_stage(tmp_path, "train", Config({"lr": 0.1}), _working, force=True)
    assert not result.skipped and (result.directory / "out.txt").read_text() == "0.1"
    assert not (result.directory / "partial.bin").exists() and not (result.directory / RUNNING).exists()
    assert (result.directory / MANIFEST).exists()
    assert run_stage(tmp_path, "train", Config({"lr": 0.1}), _working).skipped


def test_stage_that_wrote_nothing_restarts_under_a_new_config(tmp_path):
    def fails_at_once(stage_dir: Path, cfg: Config) -> dict:
        raise ConfigError("bad key")

    with pytest.raises(ConfigError):
        run_stage(tmp_path, "train", Config({"lr": "x"}), fails_at_once)
    assert run_stage(tmp_path, "train", Config({"lr": 0.5}), _working).outputs == {"out": "out.txt"}


def test_same_config_resumes_the_interrupted_stage(tmp_path):
    with pytest.raises(ConfigError):
        run_stage(tmp_path, "train", Config({"lr": "fast"}), _failing)
    seen = []
    run_stage(
        tmp_path, "train", Config({"lr": "fast"}), lambda d, c: seen.append(sorted(p.name for p in d.iterdir())) or {}
    )
    # re-entered with its partial files (no --force: nothing cleared): the stage's lock (pipeline.core.locks) and its
    # partial files
    assert seen == [[".stage.lock", "partial.bin", RUNNING]]


def test_train_detector_failed_on_a_config_error_then_force_with_another_config_passes(cli, tmp_path):
    from pipeline.core.config import load_config
    from pipeline.world.generate import generate_world

    world = tmp_path / "world"
    generate_world(
        world,
        load_config(
            "world",
            None,
            ["world.num_images=8", "world.image_size=[64, 96]", "world.max_objects=3", "world.num_workers=1"],
        ).world,
    )
    out = tmp_path / "run" / "detector"  # --out is the run directory, the stage is RUN/detector

    def train_detector(*extra: str) -> subprocess.CompletedProcess:
        return cli(
            "train-detector",
            "-c",
            str(REPO / "configs" / "detector" / "tiny.yaml"),
            "--world",
            str(world),
            "--out",
            str(out.parent),
            "--set",
            "detector_train.max_iter=2",
            "--set",
            "detector_train.steps=[1]",
            "--set",
            "data.eval_annotations=null",
            *extra,
            env={"OMP_NUM_THREADS": "1"},
        )

    bad = train_detector(
        "--set", "detector_train.precision=fp8"
    )  # a config error inside the stage on every machine: no such precision
    assert bad.returncode == 2 and "detector_train.precision must be one of" in bad.stderr and "'fp8'" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert (out / RUNNING).exists() and not (out / MANIFEST).exists()
    (out / "checkpoints").mkdir()  # as if it had got further before failing: a new config alone is refused
    refused = train_detector()
    assert refused.returncode == 2 and "--force" in refused.stderr and "fp8" in refused.stderr
    ok = train_detector("--force")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "--force given, clearing the interrupted stage" in ok.stderr
    assert json.loads((out / MANIFEST).read_text())["summary"]["iterations"] == 2
