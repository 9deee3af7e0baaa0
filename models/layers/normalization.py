"""Normalization layers of the SAN family.

* :class:`LayerNorm`: the LayerNorm of the SAN baseline (ruotianluo TransformerModel; docs/models.md#san-equations):
  ``a * (x - mean) / (std + eps) + b`` with the **unbiased** std and ``eps`` added to the std (not to the
  variance). It is not ``nn.LayerNorm``. AoANet's :class:`~models.layers.aoa_layers.BesselLayerNorm` is the same
  layer with other parameter names.
* :func:`masked_instance_norm`: NG-SAN Eq. 6, instance normalization of a ``(B, N, C)`` tensor per image and
  per channel over the N regions, where only regions with ``mask`` True enter the statistics.
* :class:`QueryNorm`: the normalization applied to the attention queries (and optionally keys) of the
  N-SAN encoder: ``instance`` (the paper's NSA, default), ``batch`` or ``layer`` (the ablation of Table 2),
  with or without the affine ``gamma, beta`` (off by default, "IN w/o gamma, beta").

Project decision (the paper leaves it open; docs/models.md#nsan-choices): padded regions are **excluded** from the IN
and BN statistics, so adding padding never changes an output.
"""

from __future__ import annotations

import torch
from torch import nn

NORM_KINDS = ("instance", "batch", "layer")


class LayerNorm(nn.Module):
    """Harvard/ruotianluo LayerNorm: unbiased std over the last dim, ``eps`` added to the std.

    The gain and bias are the parameters named :attr:`gain_name` and :attr:`bias_name` (their state-dict keys).
    """

    gain_name, bias_name = "a_2", "b_2"

    def __init__(self, features: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.register_parameter(self.gain_name, nn.Parameter(torch.ones(features)))
        self.register_parameter(self.bias_name, nn.Parameter(torch.zeros(features)))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)  # unbiased (Bessel's correction)
        return getattr(self, self.gain_name) * (x - mean) / (std + self.eps) + getattr(self, self.bias_name)


def masked_mean_var(x: torch.Tensor, mask: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Biased mean and variance of ``x`` over ``dims``, counting only elements where ``mask`` (broadcast) is True."""
    m = mask.to(x.dtype)
    count = m.sum(dim=dims, keepdim=True).clamp_min(1.0)
    mean = (x * m).sum(dim=dims, keepdim=True) / count
    var = (((x - mean) * m) ** 2).sum(dim=dims, keepdim=True) / count
    return mean, var


def masked_instance_norm(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """NG-SAN Eq. 6 (IN in the 1-D case) with padding excluded.

    ``x`` is ``(B, N, C)``, ``mask`` ``(B, N)`` True for real regions. For every image ``b`` and channel ``c``:
    ``mu = mean_t x[b,t,c]`` and ``sigma^2 = mean_t (x[b,t,c] - mu)^2`` over the real regions ``t``, and
    the result is ``(x - mu) / sqrt(sigma^2 + eps)``. Padded rows are returned as 0.
    """
    m = mask[..., None]
    mean, var = masked_mean_var(x, m, dims=(1,))
    return (x - mean) / torch.sqrt(var + eps) * m.to(x.dtype)


class QueryNorm(nn.Module):
    """Normalization of the attention queries (or keys) inside an encoder self-attention (NSA, §4.1).

    ``kind``: ``instance`` (per image and channel over the regions; NG-SAN default), ``batch`` (per channel
    over all real regions of the batch, running statistics at eval, as ``BatchNorm1d``) or ``layer`` (per
    region over the channels). ``affine`` adds a learnable per-channel ``gamma, beta`` (default off).
    """

    def __init__(
        self, channels: int, kind: str = "instance", affine: bool = False, eps: float = 1e-5, momentum: float = 0.1
    ) -> None:
        super().__init__()
        if kind not in NORM_KINDS:
            raise ValueError(f"query norm kind must be one of {NORM_KINDS}, got {kind!r}")
        self.kind = kind
        self.eps = eps
        self.momentum = momentum
        if affine:
            self.weight = nn.Parameter(torch.ones(channels))
            self.bias = nn.Parameter(torch.zeros(channels))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if kind == "batch":
            self.register_buffer("running_mean", torch.zeros(channels))
            self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Normalize ``x`` ``(B, N, C)`` given the region mask ``(B, N)``; padded rows come out as 0."""
        m = mask[..., None].to(x.dtype)
        if self.kind == "instance":
            y = masked_instance_norm(x, mask, self.eps)
        elif self.kind == "layer":
            mean = x.mean(-1, keepdim=True)
            var = x.var(-1, unbiased=False, keepdim=True)
            y = (x - mean) / torch.sqrt(var + self.eps) * m
        else:
            y = self._batch_norm(x, m)
        if self.weight is not None:
            y = (y * self.weight + self.bias) * m
        return y

    def _batch_norm(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        if self.training:
            mean, var = masked_mean_var(x, m, dims=(0, 1))
            with torch.no_grad():
                count = m.sum().clamp_min(2.0)
                unbiased = var.flatten() * count / (count - 1)
                self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean.flatten())
                self.running_var.mul_(1 - self.momentum).add_(self.momentum * unbiased)
        else:
            mean, var = self.running_mean, self.running_var
        return (x - mean) / torch.sqrt(var + self.eps) * m
