"""One numeric-precision setting for every trainer: ``precision: auto | fp32 | bf16 | fp16``.

``fp32`` runs in full precision; ``bf16`` and ``fp16`` run the forward pass under :func:`torch.autocast`
with that dtype; ``fp16`` needs CUDA and a gradient scaler (:func:`make_scaler`); ``auto`` is ``bf16`` on a
CUDA device that supports it and ``fp32`` elsewhere. The key was called ``amp`` (``none | bf16 | fp16``) in
the captioner and encoder configs; :mod:`pipeline.core.config` refuses the old key with a message that names
``precision``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from pipeline.core.errors import UsageError

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def resolve_precision(precision: str, device: torch.device, key: str = "precision") -> str:
    """``auto`` -> ``bf16`` on a bf16-capable CUDA device, else ``fp32``; validates the value for ``device``.

    ``key`` is the config key named in the error (e.g. ``train.precision``).
    """
    precision = str(precision)
    if precision == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision not in PRECISIONS:
        raise UsageError(f"{key} must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if precision == "fp16" and device.type != "cuda":
        raise UsageError(f"{key}=fp16 needs a CUDA device; use bf16 or fp32 on {device.type}")
    return precision


def autocast(device: torch.device, precision: str) -> Any:
    """The autocast context of a resolved ``precision`` (a no-op context for ``fp32``)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in ("bf16", "fp16"):
        raise UsageError(f"precision must be fp32, bf16 or fp16, not {precision!r}")
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def make_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A gradient scaler for ``fp16`` (loss scaling against underflow), ``None`` otherwise."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
