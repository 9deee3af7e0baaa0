"""The common command options (pipeline/commands/options.py): declared once, mapped onto each command's config."""

from __future__ import annotations

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from cli import app
from pipeline.commands.options import CommandOptions, Everyday
from pipeline.core.errors import UsageError

EVERYDAY = {"--device", "--batch-size", "--precision", "--num-workers"}
#: the everyday options each model command offers (the rest have no meaning there: no data loader, no autocast)
OFFERED = {
    "extract": EVERYDAY,
    "train": EVERYDAY,
    "train-detector": EVERYDAY,
    "evaluate": EVERYDAY,
    "train-encoder": EVERYDAY,
    "caption": EVERYDAY,
    "embed": EVERYDAY,
    "eval-detector": EVERYDAY,
    "serve": EVERYDAY - {"--num-workers"},  # uploads are decoded by serve.decode_threads threads
}


def _options(name: str) -> set[str]:
    cmd = get_command(app).commands[name]
    return {opt for p in cmd.params for opt in p.opts}


@pytest.mark.parametrize("name", sorted(OFFERED))
def test_model_commands_offer_the_everyday_options(name):
    opts = _options(name)
    assert opts & EVERYDAY == OFFERED[name]
    assert {"--config", "--set", "--verbose", "--quiet"} <= opts


def test_every_command_has_verbose_and_quiet_and_no_everyday_options_where_no_model_runs():
    group = get_command(app)
    for name in group.commands:
        assert {"--verbose", "--quiet"} <= _options(name), name
    for name in ("prepare", "import-features", "export-features", "merge-features", "info", "demo"):
        assert not _options(name) & EVERYDAY, name


def test_train_options_map_onto_both_stages_and_the_precision_key():
    opts = CommandOptions(
        device="cpu",
        batch_size=7,
        precision="fp32",
        num_workers=0,
        overrides=("train.xe.lr=0.5",),
        everyday=Everyday(
            device="train.device",
            batch_size=("train.xe.batch_size", "train.scst.batch_size"),
            precision="train.precision",
            num_workers="train.num_workers",
        ),
    )
    cfg = opts.resolve("train", show=False).train
    assert cfg.device == "cpu" and cfg.num_workers == 0 and cfg.precision == "fp32"
    assert cfg.xe.batch_size == 7 and cfg.scst.batch_size == 7 and cfg.xe.lr == 0.5
    # the everyday options win over --set, --set over the defaults
    opts = CommandOptions(
        batch_size=3, overrides=("train.xe.batch_size=9",), everyday=Everyday(batch_size="train.xe.batch_size")
    )
    assert opts.resolve("train", show=False).train.xe.batch_size == 3


def test_precision_is_one_vocabulary_with_one_line_refusals():
    """Every command takes auto | fp32 | tf32 | bf16 | fp16 (pipeline/core/precision.py); a value that cannot apply
    is refused in one line naming the key: fp16 where the detector runs, fp16 on a CPU."""
    with pytest.raises(UsageError, match="--precision must be one of auto, fp32, tf32, bf16, fp16"):
        CommandOptions(precision="fp64", everyday=Everyday(precision="extract.precision")).everyday_overrides()
    res = CliRunner().invoke(app, ["extract", "x.jpg", "--weights", "random", "--store", "s", "--precision", "fp64"])
    assert res.exit_code == 2 and "--precision must be one of auto, fp32, tf32, bf16, fp16, not 'fp64'" in res.output
    assert "Traceback" not in res.output
    for command in (
        ["caption", "x.jpg"],
        ["extract", "x.jpg", "--weights", "random", "--store", "s"],
        ["eval-detector", "w.pth", "-a", "a.json"],
    ):
        res = CliRunner().invoke(app, [*command, "--precision", "fp16"])
        errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        assert (
            res.exit_code == 2
            and len(errors) == 1
            and "precision=fp16 cannot apply: the detector has no fp16 path" in errors[0]
        ), res.output
        assert "Traceback" not in res.output
    from pipeline.core.precision import resolve_precision

    with pytest.raises(UsageError, match="train.precision=fp16 needs a CUDA device"):
        resolve_precision("fp16", "cpu", "train.precision")
    assert [resolve_precision(p, "cpu") for p in ("auto", "fp32", "tf32", "bf16")] == ["fp32", "fp32", "tf32", "bf16"]


def test_command_flags_reach_the_config(tmp_path):
    """`evaluate` maps its everyday options onto evaluate.* (checked through a bad device value's error)."""
    res = CliRunner().invoke(
        app, ["extract", "x.jpg", "--weights", "random", "--store", str(tmp_path / "s"), "--batch-size", "0"]
    )
    assert res.exit_code == 2  # min=1 on the shared option
    opts = CommandOptions(
        device="cuda:3",
        batch_size=8,
        precision="bf16",
        everyday=Everyday(device="evaluate.device", batch_size="evaluate.batch_size", precision="evaluate.precision"),
    )
    section = opts.resolve("evaluate", show=False).evaluate
    assert (section.device, section.batch_size, section.precision) == ("cuda:3", 8, "bf16")


def test_a_common_option_cannot_be_declared_twice():
    from pipeline.commands.options import command

    with pytest.raises(TypeError, match="device is a common option"):

        @command(typer.Typer(), "x", help="x", everyday=Everyday(device="extract.device"))
        def x(opts: CommandOptions, device: str = "cpu") -> None:  # noqa: ARG001
            pass


def test_caption_and_evaluate_share_the_decoding_flags():
    flags = {"--beam-size", "--n-best", "--max-len", "--length-penalty", "--block-trigrams", "--stop-rule"}
    for name in ("caption", "evaluate"):
        assert flags <= _options(name), name
    for name in ("train", "extract", "embed"):
        assert not flags & _options(name), name
