"""Low-rank bilinear building blocks of Bilinear Attention Networks (Kim, Jun & Zhang, NeurIPS 2018).

Official code: ``jnhwkim/ban-vqa`` (``fc.py``, ``bc.py``, ``attention.py``); docs/models.md#ban-bilinear-attention.

* :class:`WNLinear`: ``weight_norm(Linear, dim=None)``, i.e. ``W = g V / ||V||_F`` with **one scalar** ``g`` per
  matrix (``fc.py``); at init ``g = ||V||_F`` so ``W`` starts as PyTorch's default Linear.
* :class:`FCLayer`: BAN's one-layer ``FCNet``: ``act(WNLinear(Drop(x)))``.
* :class:`BilinearAttentionMap`: the bilinear attention map (Kim et al. 2018, "Bilinear attention map":
  ``A = softmax(((1 p^T) o X^T U) V^T Y)``; code ``BiAttention`` + ``BCNet`` with ``k = 3``):
  ``logits[g, i, j] = sum_k H[g, k] * X'[i, k] * Y'[j, k] + b_g`` with ``X' = Drop(ReLU(U^T x_i))`` (regions) and
  ``Y' = ReLU(V^T y_j)`` (the other modality), rank ``K' = k * d``.
  The softmax over the flattened ``(i, j)`` grid is done by the caller (it owns the masks).
* :class:`BilinearPooling`: a glimpse's joint representation (Kim et al. 2018, "Bilinear attention networks":
  ``f'_k = (X^T U')_k^T A (Y^T V')_k``; code ``BCNet`` with ``k = 1``):
  ``f[k] = sum_{i,j} X''[i, k] A[i, j] Y''[j, k]`` with ``X'' = ReLU(U'^T x)``, ``Y'' = ReLU(V'^T y)``; the caller
  supplies the contraction with ``A`` (see :mod:`models.captioners.ban` for the causal factorisation).
"""

from __future__ import annotations

import torch
from torch import nn

from models.layers.row_dropout import Dropout


class WNLinear(nn.Module):
    """``y = (g / ||V||_F) V x + b``: weight normalisation with a single scalar gain (``dim=None``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        base = nn.Linear(in_features, out_features, bias=bias)  # PyTorch default init, as in BAN
        self.weight_v = nn.Parameter(base.weight.detach().clone())
        self.weight_g = nn.Parameter(torch.linalg.norm(self.weight_v.detach()))
        self.bias = nn.Parameter(base.bias.detach().clone()) if bias else None

    @property
    def weight(self) -> torch.Tensor:
        """The effective weight ``g V / ||V||_F``."""
        return self.weight_g * self.weight_v / torch.linalg.norm(self.weight_v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the gain is a scalar, so scale the output instead of materialising g V / ||V|| at every call
        y = nn.functional.linear(x, self.weight_v) * (self.weight_g / torch.linalg.norm(self.weight_v))
        return y if self.bias is None else y + self.bias


class FCLayer(nn.Module):
    """BAN ``FCNet([in, out], act, dropout)``: ``act(WNLinear(Drop(x)))`` (docs/models.md#ban-bilinear-attention)."""

    def __init__(self, in_features: int, out_features: int, dropout: float = 0.0, relu: bool = True) -> None:
        super().__init__()
        self.dropout = Dropout(dropout)
        self.linear = WNLinear(in_features, out_features)
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(self.dropout(x))
        return torch.relu(y) if self.relu else y


class BilinearAttentionMap(nn.Module):
    """Logits of ``glimpses`` low-rank bilinear attention maps between regions and a second set (bilinear attention
    map).

    Rank ``K' = k * hidden``; ``H`` is weight-normalised with one scalar over the whole ``(G, K')`` matrix and
    initialised N(0, 1), the per-glimpse bias ``b_g`` N(0, 1) (``attention.py``).
    """

    def __init__(
        self,
        v_dim: int,
        q_dim: int,
        hidden: int,
        glimpses: int,
        k: int = 3,
        dropout: float = 0.2,
        dropout_v: float = 0.5,
    ) -> None:
        super().__init__()
        rank = hidden * k
        self.v_net = FCLayer(v_dim, rank, dropout)
        self.v_dropout = Dropout(dropout_v)  # visual side only
        self.q_net = FCLayer(q_dim, rank, dropout)
        self.h_mat_v = nn.Parameter(torch.randn(glimpses, rank))
        self.h_mat_g = nn.Parameter(torch.linalg.norm(self.h_mat_v.detach()))
        self.h_bias = nn.Parameter(torch.randn(glimpses))

    @property
    def h_mat(self) -> torch.Tensor:
        """``H = g V / ||V||_F`` ``(G, K')``."""
        return self.h_mat_g * self.h_mat_v / torch.linalg.norm(self.h_mat_v)

    def project_v(self, v: torch.Tensor) -> torch.Tensor:
        """``X' = Drop(ReLU(WN(Drop(v))))`` ``(B, N, K')``."""
        return self.v_dropout(self.v_net(v))

    def project_q(self, q: torch.Tensor) -> torch.Tensor:
        """``Y' = ReLU(WN(Drop(q)))`` ``(B, T, K')``."""
        return self.q_net(q)

    def logits(self, v_proj: torch.Tensor, q_proj: torch.Tensor) -> torch.Tensor:
        """``logits[b, g, i, j] = sum_k H[g, k] X'[b, i, k] Y'[b, j, k] + b_g`` ``(B, G, N, T)``."""
        glimpses, length = self.h_mat.shape[0], q_proj.shape[1]
        hq = q_proj.unsqueeze(1) * self.h_mat[None, :, None, :]  # (B, G, T, K'): T < N, the smaller side
        logits = v_proj @ hq.flatten(1, 2).transpose(1, 2)  # (B, N, G*T) without expanding X' per glimpse
        return logits.unflatten(-1, (glimpses, length)).permute(0, 2, 1, 3) + self.h_bias[None, :, None, None]


class BilinearPooling(nn.Module):
    """The two projections of one glimpse's bilinear pooling (``BCNet`` with ``k = 1``, no pooling layer)."""

    def __init__(self, v_dim: int, q_dim: int, hidden: int, dropout: float = 0.2) -> None:
        super().__init__()
        self.v_net = FCLayer(v_dim, hidden, dropout)
        self.q_net = FCLayer(q_dim, hidden, dropout)
