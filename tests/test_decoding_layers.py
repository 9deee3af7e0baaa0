"""One precision vocabulary and one decoding home: `caption` and `evaluate --model` decode the same checkpoint
in the same precision with the same options; `--beam-size` is the same `decoding.beam_size` override in both;
the settings are layered in one order (configs/decoding.yaml < checkpoint < command section < flag)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli import app
from models.checkpoints import CaptionerCheckpoint, ReleaseInfo
from models.decoding.captions import decoding_for, layered_decoding
from pipeline.commands.caption import CAPTION_EVERYDAY
from pipeline.commands.evaluate import EVALUATE_EVERYDAY
from pipeline.commands.options import CommandOptions
from pipeline.core import precision as precision_module
from pipeline.core.errors import ConfigError

TRAINED = {"decoding": {"method": "beam", "beam_size": 3, "max_len": 16, "n_best": 1, "length_penalty": 0.0}}
RELEASED = {
    "release": "m2",
    "decoding": {"method": "beam", "beam_size": 5, "max_len": 20, "stop_rule": "official_m2", "collapse_repeats": True},
}


def as_checkpoint(ckpt: dict) -> CaptionerCheckpoint:
    """The typed checkpoint (models/checkpoints.py) holding ``ckpt``'s decoding and, for a release, its record."""
    release = ReleaseInfo("m2", "M2", "m2.pth", "vocab.pkl", {}, 1) if "release" in ckpt else None
    return CaptionerCheckpoint(
        model_name="m2", model_config={}, vocab=(), weights={}, decoding=ckpt["decoding"], release=release
    )


def _roots(**given):
    """The resolved `caption` and `evaluate` configs for the same command-line options."""
    flags = given.pop("decoding", {})
    cap = CommandOptions(everyday=CAPTION_EVERYDAY, decoding=flags, **given).resolve("caption", show=False)
    ev = CommandOptions(everyday=EVALUATE_EVERYDAY, decoding=flags, **given).resolve("evaluate", show=False)
    return cap, ev


@pytest.mark.parametrize("device", ["cpu", "bf16-cuda"])
@pytest.mark.parametrize(
    "given",
    [
        {},
        {"precision": "auto"},
        {"precision": "bf16", "decoding": {"beam_size": 2}},
        {"decoding": {"n_best": 4, "max_len": 9}},
    ],
)
def test_caption_and_evaluate_resolve_the_same_precision_and_decoding(given, device, monkeypatch):
    if device == "bf16-cuda":  # an A100/H100 as resolve_precision sees it (no GPU needed to resolve)
        monkeypatch.setattr(precision_module, "native_bf16", lambda dev: True)
    dev = torch.device("cuda", 0) if device == "bf16-cuda" else torch.device("cpu")
    cap, ev = _roots(**dict(given))
    assert cap.caption.precision == ev.evaluate.precision
    for ckpt in (TRAINED, RELEASED):
        by_caption = decoding_for(
            as_checkpoint(ckpt), cap.decoding.to_dict(), cap.caption.precision, dev, "caption.precision", fp16=False
        )
        by_evaluate = decoding_for(
            as_checkpoint(ckpt), ev.decoding.to_dict(), ev.evaluate.precision, dev, "evaluate.precision"
        )
        assert by_caption == by_evaluate
        options, resolved = by_caption
        flags = given.get("decoding", {})
        assert options.beam_size == flags.get("beam_size", max(ckpt["decoding"]["beam_size"], flags.get("n_best", 1)))
        assert options.max_len == flags.get("max_len", ckpt["decoding"]["max_len"])
        want = given.get("precision", "tf32")
        if want == "auto":
            want = "bf16" if device == "bf16-cuda" and "release" not in ckpt else "fp32"
        assert resolved == want


def test_the_decoding_layers_in_one_order(monkeypatch):
    defaults = layered_decoding(None, None)
    assert (defaults.beam_size, defaults.max_len, defaults.method) == (3, 20, "beam")  # configs/decoding.yaml
    assert layered_decoding(TRAINED["decoding"], None).max_len == 16  # the checkpoint over the defaults
    assert layered_decoding(TRAINED["decoding"], {"max_len": 7}).max_len == 7  # the command over the checkpoint
    cap, _ = _roots(overrides=("decoding.beam_size=4", "decoding.max_len=12"), decoding={"beam_size": 2})
    options = layered_decoding(TRAINED["decoding"], cap.decoding.to_dict())
    assert (options.beam_size, options.max_len) == (2, 12)  # the flag over --set, --set over the checkpoint
    greedy = {"method": "greedy", "beam_size": 3}
    assert layered_decoding(greedy, {"beam_size": 2}).method == "beam"  # a beam size given implies beam search
    with pytest.raises(ConfigError, match="unknown key 'decoding.beam'"):
        layered_decoding(None, {"beam": 2})
    with pytest.raises(ConfigError, match="'decoding.beam_size' must be int"):
        layered_decoding(None, {"beam_size": "wide"})


@pytest.mark.parametrize(
    "old,new", [("caption.beam_size", "decoding.beam_size"), ("caption.n_best", "decoding.n_best")]
)
def test_a_moved_decoding_key_is_refused_naming_its_home(old, new):
    res = CliRunner().invoke(app, ["caption", "x.jpg", "--set", f"{old}=2"])
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.exit_code == 2 and len(errors) == 1 and f"'{old}' was renamed: use '{new}'" in errors[0], res.output
    assert "Traceback" not in res.output


def test_beam_size_flag_decodes_alike_under_caption_and_evaluate(tmp_path, tiny_captioners):
    """End to end: the same tiny checkpoint, `--beam-size 2 --max-len 7` given to `caption` and to
    `evaluate --model`: both record the same decoding (caption in its output's settings, evaluate in its metrics)."""
    from caption_helpers import SMALL, small_photos, tiny_detector

    run = tiny_captioners
    ckpt = run / "train-a" / "best.pt"
    flags = ["--beam-size", "2", "--max-len", "7", "--device", "cpu", "--quiet"]
    photos = small_photos(tmp_path / "photos", 2)
    out = tmp_path / "captions.jsonl"
    res = CliRunner().invoke(
        app,
        [
            "caption",
            *map(str, photos),
            "--model",
            str(ckpt),
            "--weights",
            str(tiny_detector(tmp_path / "d.pth")),
            "--output",
            str(out),
            "--num-workers",
            "0",
            *SMALL,
            *flags,
        ],
    )
    assert res.exit_code == 0, res.output
    caption_decoding = json.loads(Path(str(out) + ".committed").read_text())["settings"]["decoding"]
    metrics = tmp_path / "metrics.json"
    res = CliRunner().invoke(
        app,
        [
            "evaluate",
            "--model",
            str(ckpt),
            "--store",
            str(run / "features/store"),
            "--data",
            str(run / "data"),
            "--metrics",
            "cider",
            "--output",
            str(metrics),
            *flags,
        ],
    )
    assert res.exit_code == 0, res.output
    evaluate_decoding = json.loads(metrics.read_text())["decoding"]
    assert (
        caption_decoding == evaluate_decoding
        and caption_decoding["beam_size"] == 2
        and caption_decoding["max_len"] == 7
    )
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)["decoding"]
    assert asdict(layered_decoding(saved, {"beam_size": 2, "max_len": 7})) == caption_decoding


@pytest.mark.parametrize(
    "command",
    [["caption", "x.jpg", "--model", "none.pt"], ["evaluate", "--model", "none.pt", "--store", "s", "--data", "d"]],
)
def test_an_unknown_decoding_key_is_refused_before_any_work(command):
    res = CliRunner().invoke(app, [*command, "--set", "decoding.beam=2"])
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.exit_code == 2 and len(errors) == 1 and "unknown key 'decoding.beam'" in errors[0], res.output
    assert "none.pt" not in errors[0]
