"""The CLI: help for every command, exit codes, one-line errors, resumable stages."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from click.testing import Result

COMMANDS = [
    "extract",
    "import-features",
    "prepare",
    "train",
    "train-encoder",
    "evaluate",
    "embed",
    "caption",
    "demo",
    "info",
]


def test_help_lists_every_command(cli) -> None:
    res = cli("--help")
    assert res.returncode == 0
    for cmd in COMMANDS:
        assert cmd in res.stdout


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_command_has_help_with_examples(cli, cmd: str) -> None:
    res = cli.invoke(cmd, "--help", env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "Example" in res.stdout and "butd-caption" in res.stdout


def one_error_line(res: subprocess.CompletedProcess | Result) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, res.stderr
    assert "Traceback" not in res.stderr
    return errors[0]


def test_bad_override_key_is_a_usage_error(cli, tmp_path: Path) -> None:
    res = cli.invoke("demo", "--generate-only", "--out", str(tmp_path / "w"), "--set", "world.nope=3")
    assert res.exit_code == 2
    assert "unknown config key 'world.nope'" in one_error_line(res)


def test_wrong_type_is_a_usage_error(cli, tmp_path: Path) -> None:
    res = cli.invoke("demo", "--generate-only", "--out", str(tmp_path / "w"), "--set", "world.num_images=lots")
    assert res.exit_code == 2
    assert "must be int" in one_error_line(res)


def test_missing_config_file_is_a_usage_error(cli, tmp_path: Path) -> None:
    res = cli.invoke("demo", "--generate-only", "--out", str(tmp_path / "w"), "--config", str(tmp_path / "nope.yaml"))
    assert res.exit_code == 2
    assert "config file not found" in one_error_line(res)


def test_invalid_value_is_a_usage_error(cli, tmp_path: Path) -> None:
    res = cli.invoke("demo", "--generate-only", "--out", str(tmp_path / "w"), "--set", "world.image_format=gif")
    assert res.exit_code == 2
    assert "image_format" in one_error_line(res)


def test_demo_generate_only_is_resumable_and_skips_when_done(cli, tmp_path: Path) -> None:
    out = tmp_path / "world"
    res = cli("demo", "--generate-only", "--out", str(out), "--num-images", "12", "--seed", "5")
    assert res.returncode == 0, res.stderr
    assert "num_images: 12" not in res.stderr and "+ 2 override(s)" in res.stderr  # one config line at info level
    loud = cli("demo", "--generate-only", "--out", str(tmp_path / "loud"), "--num-images", "3", "--verbose")
    assert (
        "num_images: 3" in loud.stderr and "num_images: 3" not in loud.stdout
    )  # --verbose: the resolved config, on stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["summary"]["images"] == 12 and len(list((out / "images").iterdir())) == 12
    again = cli("demo", "--generate-only", "--out", str(out), "--num-images", "12", "--seed", "5")
    assert again.returncode == 0 and "already done" in again.stderr
    assert json.loads((out / "manifest.json").read_text())["finished"] == manifest["finished"]
    other = cli("demo", "--generate-only", "--out", str(out), "--num-images", "12", "--seed", "6")
    assert other.returncode == 2 and "different config" in one_error_line(other)


def test_interrupted_stage_resumes(cli, tmp_path: Path) -> None:
    out = tmp_path / "run" / "world"
    first = cli("demo", "--generate-only", "--out", str(out), "--num-images", "10")
    assert first.returncode == 0, first.stderr
    (out / "manifest.json").unlink()  # as if killed before the manifest was written
    (out / "running.json").write_text('{"stage": "world"}')
    victim = out / "images" / "world_000003.jpg"
    victim.unlink()
    res = cli("demo", "--generate-only", "--out", str(out), "--num-images", "10")
    assert res.returncode == 0, res.stderr
    assert "resuming" in res.stderr and victim.exists()
    assert (out / "manifest.json").exists() and not (out / "running.json").exists()


@pytest.mark.parametrize("cmd", ["extract", "import-features", "prepare", "caption", "evaluate"])
def test_commands_without_their_inputs_are_usage_errors(
    cli, cmd: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the default run directory is relative: an empty folder
    res = cli.invoke(cmd)
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr


def test_info_shows_environment_and_run_dirs(cli, tmp_path: Path) -> None:
    res = cli("info")
    assert res.returncode == 0, res.stderr
    assert "torch" in res.stdout and "torchvision ops" in res.stdout and "ok" in res.stdout
    run = tmp_path / "run"
    assert cli("demo", "--generate-only", "--out", str(run / "world"), "--num-images", "8").returncode == 0
    res = cli("info", str(run))
    assert res.returncode == 0 and "world" in res.stdout and "done" in res.stdout
    missing = cli("info", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "no such file" in one_error_line(missing)


def test_info_describes_a_sentence_encoder_checkpoint(cli, tmp_path: Path) -> None:
    """`cli info RUN/encoder/best.pt` names the sentence encoder (its checkpoint is not a captioner's: its progress
    counters are the encoder trainer's, which the captioner reader refuses)."""
    import torch

    from pipeline.core.checkpoint import save_checkpoint

    path = tmp_path / "best.pt"  # the layout of pipeline/embedding/train.py's _payload
    save_checkpoint(
        path,
        {
            "kind": "weights",
            "model": {"name": "sentence_encoder", "config": {}, "vocab_size": 3, "image_dim": 8},
            "vocab": ["<pad>", "a", "b"],
            "weights": {"w": torch.zeros(2)},
            "epoch": 1,
            "position": 0,
            "global_step": 5,
            "best": {},
            "history": [],
            "train_config": {},
        },
    )
    res = cli("info", str(path))
    assert res.returncode == 0, res.stderr
    assert "model: sentence_encoder" in res.stdout and "vocabulary: 3 words" in res.stdout
