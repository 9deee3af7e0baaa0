"""One numeric-precision setting for every trainer: ``precision: auto | fp32 | bf16 | fp16``.

``fp32`` runs in full precision; ``bf16`` and ``fp16`` run the forward pass under :func:`torch.autocast`
with that dtype; ``fp16`` needs CUDA and a gradient scaler (:func:`make_scaler`); ``auto`` is ``bf16`` on a
CUDA device with native bf16 arithmetic (compute capability 8.0 and later: A100, H100, ...) and ``fp32``
elsewhere: a V100 or T4 only emulates bf16, slower than fp32, so ``auto`` does not pick it there. The key was called ``amp`` (``none | bf16 | fp16``) in
the captioner and encoder configs; :mod:`pipeline.core.config` refuses the old key with a message that names
``precision``.

TF32 (CUDA only; no effect on CPU) follows one rule in every command (:func:`tf32`): ``fp32`` is strict float32,
TF32 off for matmuls *and* cuDNN convolutions (PyTorch's own default leaves cuDNN TF32 on); every other value
(``tf32`` of the extraction commands, ``bf16``, ``fp16``) allows TF32 for the float32 work left outside autocast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from pipeline.core.errors import UsageError

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def native_bf16(device: torch.device) -> bool:
    """True when the CUDA ``device`` computes in bf16 natively (not the emulation PyTorch allows on older GPUs)."""
    with torch.cuda.device(device):
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def resolve_precision(precision: str, device: torch.device, key: str = "precision") -> str:
    """``auto`` -> ``bf16`` on a bf16-capable CUDA device, else ``fp32``; validates the value for ``device``.

    ``key`` is the config key named in the error (e.g. ``train.precision``).
    """
    precision = str(precision)
    if precision == "auto":
        return "bf16" if device.type == "cuda" and native_bf16(device) else "fp32"
    if precision not in PRECISIONS:
        raise UsageError(f"{key} must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if precision == "fp16" and device.type != "cuda":
        raise UsageError(f"{key}=fp16 needs a CUDA device; use bf16 or fp32 on {device.type}")
    return precision


@contextlib.contextmanager
def tf32(allow: bool) -> Iterator[None]:
    """TF32 for CUDA matmuls and cuDNN convolutions both on or both off inside the block (restored after)."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(allow)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """The numerics of a resolved ``precision``: strict float32 (TF32 off) for ``fp32``, else autocast with TF32 allowed."""
    if precision not in ("fp32", "bf16", "fp16"):
        raise UsageError(f"precision must be fp32, bf16 or fp16, not {precision!r}")
    with tf32(precision != "fp32"):
        if precision == "fp32":
            yield
        else:
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16):
                yield


def make_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A gradient scaler for ``fp16`` (loss scaling against underflow), ``None`` otherwise."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
