"""Bugs of the CUDA paths that CPU tests can show (issue "GPU speed ... plus the CUDA bugs found by reading"):
half-precision masks, the precision/TF32 policy, and the autocast placement of the SCST baseline."""

from __future__ import annotations

import torch

import models
from models.decoding import DecodeOptions, greedy


def test_aoanet_runs_in_float16_with_padded_regions() -> None:
    """-1e9 does not fit float16 (min -65504): masking padded regions must use the dtype's minimum instead."""
    torch.manual_seed(0)
    model = models.build_captioner("aoa", 30, feat_dim=16, d_model=32, num_heads=4, num_layers=1).eval().half()
    feats = torch.randn(2, 5, 16).half()
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    boxes = torch.rand(2, 5, 4).half()
    sizes = torch.ones(2, 2).half()
    with torch.no_grad():
        enc = model.encode(feats, mask, boxes, sizes)
        out = greedy(model, enc, DecodeOptions(method="greedy", max_len=4))
    assert out.tokens.shape[0] == 2 and torch.isfinite(out.logprob).all()
    # float32 keeps the official -1e9 exactly
    from models.layers.aoa_layers import mask_value

    assert mask_value(torch.float32) == -1e9 and mask_value(torch.float16) == float(torch.finfo(torch.float16).min)


def test_auto_precision_does_not_pick_emulated_bf16(monkeypatch) -> None:
    """A V100/T4 reports bf16 'supported' only through emulation: ``auto`` must resolve to fp32 there."""
    import contextlib

    from pipeline.core import precision

    def emulated_only(including_emulation: bool = True) -> bool:
        return including_emulation  # what torch says on a GPU without native bf16

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", emulated_only)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    cuda = torch.device("cuda", 0)
    assert precision.resolve_precision("auto", cuda) == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # A100, H100
    assert precision.resolve_precision("auto", cuda) == "bf16"
    assert precision.resolve_precision("auto", torch.device("cpu")) == "fp32"


def test_one_tf32_rule_fp32_is_strict_everywhere() -> None:
    """``fp32`` turns TF32 off for matmuls AND cuDNN in the trainers as in extraction (PyTorch's default leaves
    cuDNN TF32 on); ``tf32``/``bf16`` allow it; the flags come back after the block; extraction defaults to tf32."""

    from pipeline.core.config import load_config
    from pipeline.core.precision import autocast

    flags = lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)  # noqa: E731
    cpu = torch.device("cpu")
    before = flags()
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default
    try:
        with autocast(cpu, "fp32"):
            assert flags() == (False, False)
        with autocast(cpu, "fp32"):
            assert flags() == (False, False)
        for name in ("tf32", "bf16"):
            with autocast(cpu, name):
                assert flags() == (True, True)
        with autocast(cpu, "bf16"):
            assert flags() == (True, True) and torch.is_autocast_enabled("cpu")
        assert flags()[1] is True
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    assert load_config("extract").extract.precision == "tf32"
    assert load_config("caption").caption.precision == "tf32"
