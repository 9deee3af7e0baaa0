"""One photos -> regions path (extractors/photos.py) for every command: a photo fails for the same reason under
`extract` and `caption`, and the captioning engine applies caption.precision itself (also when called from
Python, not only from the command)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from caption_helpers import SMALL, small_photos, tiny_detector
from PIL import Image
from typer.testing import CliRunner

import models
from cli import app
from pipeline.core.checkpoint import save_checkpoint
from pipeline.core.config import load_config
from pipeline.core.errors import FAILURE_REASONS, Failure

WORDS = ("<pad>", "<bos>", "<eos>", "<unk>", "a", "red", "blue", "circle", "square", "left")


def random_captioner(path: Path, feat_dim: int) -> Path:
    """A native captioner checkpoint of a tiny SAN with seeded random weights."""
    torch.manual_seed(0)
    config = dict(feat_dim=feat_dim, d_model=32, num_heads=4, d_ff=64, num_layers=1)
    model = models.build_captioner("san", len(WORDS), **config)
    save_checkpoint(
        path,
        {
            "kind": "weights",
            "model": {"name": "san", "config": config, "vocab_size": len(WORDS)},
            "vocab": list(WORDS),
            "weights": model.state_dict(),
            "decoding": {"method": "beam", "beam_size": 2, "max_len": 6},
        },
    )
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("photo_path")
    weights = tiny_detector(root / "tiny.pth")
    photos = root / "photos"
    small_photos(photos, 2)
    Image.fromarray(np.full((2, 2000, 3), 90, np.uint8)).save(photos / "thin.png")
    return {"root": root, "weights": weights, "photos": photos, "ckpt": random_captioner(root / "san.pt", 128)}


def test_a_2000x2_photo_fails_alike_under_extract_and_caption(env, tmp_path):
    store, out = tmp_path / "store", tmp_path / "caps.jsonl"
    res = CliRunner().invoke(
        app,
        [
            "extract",
            str(env["photos"]),
            "--weights",
            str(env["weights"]),
            "--store",
            str(store),
            "--set",
            "extract.min_size=96",
            "--set",
            "extract.max_size=160",
            "--workers",
            "0",
        ],
    )
    assert res.exit_code == 0, res.output
    extracted = {Path(r["path"]).name: r for r in map(json.loads, (store / "failures.jsonl").read_text().splitlines())}
    res = CliRunner().invoke(
        app,
        [
            "caption",
            str(env["photos"]),
            "--model",
            str(env["ckpt"]),
            "--weights",
            str(env["weights"]),
            "--output",
            str(out),
            *SMALL,
        ],
    )
    assert res.exit_code == 0, res.output
    captioned = {
        Path(r["path"]).name: r for r in map(json.loads, (tmp_path / "caps.failures.jsonl").read_text().splitlines())
    }
    assert set(extracted) == set(captioned) == {"thin.png"}
    assert captioned["thin.png"]["reason"] == extracted["thin.png"]["reason"] == "too_thin"
    assert captioned["thin.png"]["detail"] == extracted["thin.png"]["detail"]
    assert extracted["thin.png"]["detail"].startswith("2000x2 image resizes to 160x")


def test_failure_reasons_are_one_list():
    assert Failure("too_thin", "x").line == "too_thin: x"
    with pytest.raises(ValueError, match="unknown failure reason 'model_error'"):
        Failure("model_error", "x")
    assert "detector_failed" in FAILURE_REASONS and "model_error" not in FAILURE_REASONS


def _dtypes_seen(run) -> dict[str, set]:
    """The output dtypes of every captioner (``models.*``) and detector (``extractors.*``) module while ``run()``."""
    seen: dict[str, set] = {"models": set(), "extractors": set()}

    def hook(module, args, output):
        top = type(module).__module__.split(".")[0]
        if top in seen and isinstance(output, torch.Tensor) and output.is_floating_point():
            seen[top].add(output.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        run()
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_caption_photos_from_python_honours_caption_precision(env, tmp_path, precision):
    """``caption_photos`` called from Python (as the demo does), no precision context around it: the captioner
    (and the detector) compute in bf16 under ``caption.precision=bf16`` and in float32 under fp32."""
    from pipeline.captioning.run import caption_photos

    cfg = load_config(
        "caption", None, ["caption.min_size=96", "caption.max_size=160", f"caption.precision={precision}"]
    ).caption
    out = tmp_path / "caps.jsonl"
    seen = _dtypes_seen(lambda: caption_photos([str(env["photos"])], env["ckpt"], str(env["weights"]), cfg, output=out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sum("caption" in r for r in rows) == 2
    want = torch.bfloat16 if precision == "bf16" else torch.float32
    assert want in seen["models"] and want in seen["extractors"]
    if precision == "fp32":
        assert seen["models"] == {torch.float32}
