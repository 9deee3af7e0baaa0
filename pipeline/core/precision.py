"""One numeric-precision vocabulary for every command: ``precision: auto | fp32 | tf32 | bf16 | fp16``.

Each value means the same in every command (extract, eval-detector, caption, serve, demo, train,
train-detector, evaluate, embed, train-encoder):

* ``fp32``  strict float32: TF32 off for CUDA matmuls *and* cuDNN convolutions (PyTorch's own default leaves
  cuDNN TF32 on);
* ``tf32``  float32 tensors with TF32 matmuls and convolutions allowed on CUDA (on CPU the same as ``fp32``);
* ``bf16``  the forward pass under :func:`torch.autocast` with bfloat16 (TF32 allowed for the float32 work left
  outside autocast);
* ``fp16``  autocast with float16, CUDA only; trainers add a gradient scaler (:func:`make_scaler`). The detector
  has no fp16 path (its scores and boxes are checked in fp32, tf32 and bf16 only): commands that run it
  refuse ``fp16`` in one line;
* ``auto``  ``bf16`` on a CUDA device with native bf16 arithmetic (compute capability 8.0 and later: A100,
  H100, ...), ``fp32`` elsewhere (a V100 or T4 only emulates bf16, slower than fp32). A released model
  (M2, AoANet) decodes in ``fp32`` under ``auto``, as published (``published=True``).

:func:`resolve_precision` is the one parser (a config value -> one of ``fp32 | tf32 | bf16 | fp16``, or a
one-line usage error naming the key); :func:`autocast` applies a resolved value. Each command's default is in
its config file (docs/architecture.md#precision). The key was called ``amp`` in the captioner and encoder
configs; :mod:`pipeline.core.config` refuses the old key with a message that names ``precision``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from pipeline.core.errors import UsageError

PRECISIONS = ("auto", "fp32", "tf32", "bf16", "fp16")
#: what :func:`resolve_precision` returns (``auto`` resolved for the device)
RESOLVED = ("fp32", "tf32", "bf16", "fp16")
#: why a command that runs the detector refuses fp16 (``resolve_precision(..., fp16=False)``)
NO_FP16_DETECTOR = "the detector has no fp16 path (checked in fp32, tf32 and bf16); use bf16"


def native_bf16(device: torch.device) -> bool:
    """True when the CUDA ``device`` computes in bf16 natively (not the emulation PyTorch allows on older GPUs)."""
    with torch.cuda.device(device):
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def check_precision(precision: str, key: str = "precision", *, fp16: bool = True) -> str:
    """``precision`` if it is a value of :data:`PRECISIONS` that can apply (``fp16=False``: the command runs the
    detector); a one-line usage error naming ``key`` otherwise. Device-free, so a command checks it first."""
    precision = str(precision)
    if precision not in PRECISIONS:
        raise UsageError(f"{key} must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if precision == "fp16" and not fp16:
        raise UsageError(f"{key}=fp16 cannot apply: {NO_FP16_DETECTOR}")
    return precision


def resolve_precision(
    precision: str, device: torch.device | str, key: str = "precision", *, fp16: bool = True, published: bool = False
) -> str:
    """A config value -> ``fp32 | tf32 | bf16 | fp16`` for ``device`` (see the module docstring).

    ``key`` is the config key named in an error (e.g. ``train.precision``). ``fp16=False``: the command runs
    the detector, which has no fp16 path. ``published``: the model is a released one that decodes in fp32 as
    published, so ``auto`` is ``fp32`` (an explicit value still wins).
    """
    device = torch.device(device)
    precision = check_precision(precision, key, fp16=fp16)
    if precision == "auto":
        return "bf16" if not published and device.type == "cuda" and native_bf16(device) else "fp32"
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
    """The numerics of a resolved ``precision``: strict float32 (TF32 off) for ``fp32``, TF32 allowed for ``tf32``,
    else autocast to bf16/fp16 with TF32 allowed for the rest."""
    if precision not in RESOLVED:
        raise UsageError(f"precision must be one of {', '.join(RESOLVED)} here (resolved), not {precision!r}")
    with tf32(precision != "fp32"):
        if precision in ("fp32", "tf32"):
            yield
        else:
            with torch.autocast(
                device_type=device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16
            ):
                yield


def make_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A gradient scaler for ``fp16`` (loss scaling against underflow), ``None`` otherwise."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
