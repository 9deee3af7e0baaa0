"""One optimisation step: the non-finite loss check (on every rank) and backward + scaler + clipping + step."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from pipeline.core.distributed import DistContext, any_rank
from pipeline.core.errors import PipelineError


def check_finite(value: float, ctx: DistContext, message: str) -> None:
    """Raise :class:`PipelineError` (``message``) on every rank when ``value`` is NaN/inf on any rank.

    Every rank takes part (one collective), so a ``torchrun`` job stops as a whole rather than hanging.
    """
    if any_rank(not math.isfinite(float(value)), ctx):
        raise PipelineError(message)


def optimizer_step(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None = None,
    clip_value: float | None = None,
    clip_norm: float | None = None,
    params: Iterable[torch.Tensor] | None = None,
) -> None:
    """``zero_grad`` -> backward (scaled for fp16) -> unscale -> clip -> step (scaler update).

    Clipping (off when ``None`` or <= 0) acts on ``params`` (default: the optimizer's parameters), first by
    value (each gradient element into [-v, v]) then by the global L2 norm, on the unscaled gradients.
    """
    params = list(params) if params is not None else [p for g in optimizer.param_groups for p in g["params"]]
    optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    else:
        loss.backward()
    if clip_value is not None and clip_value > 0:
        nn.utils.clip_grad_value_(params, float(clip_value), foreach=True)
    if clip_norm is not None and clip_norm > 0:
        nn.utils.clip_grad_norm_(params, float(clip_norm), foreach=True)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
