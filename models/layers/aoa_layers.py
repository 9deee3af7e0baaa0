"""Building blocks of AoANet (Huang et al., ICCV 2019; docs/models.md#aoa).

* :class:`BesselLayerNorm`: the Harvard-style LayerNorm of the official code,
  ``a * (x - mean) / (std_unbiased + eps) + b`` (eps added to the *std*, Bessel-corrected std).
* :func:`multi_head_attend`: ``concat_j Drop(softmax(Q_j K_j^T / sqrt(d_k), mask -1e9)) V_j`` with no output
  projection (AoA replaces it).
* :class:`AttentionOnAttention`: the AoA module of the paper (section "Attention on Attention"): information vector
  ``i = W_i [v; q] + b_i``, attention gate ``g = sigmoid(W_g [v; q] + b_g)``, attended information ``i_hat = g * i``;
  implemented as one linear ``2d -> 2d`` followed by ``GLU`` (first half = information, second half = gate), the
  input order being ``[attended; query]``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from models.layers.normalization import LayerNorm

#: the official code masks with -1e9 (husthuaan/AoANet ``AoAModel.py``), not -inf; in float16 (whose range ends at
#: -65504) the dtype's minimum stands in for it (:func:`mask_value`), as M2 masks with the minimum
MASK_VALUE = -1e9


def mask_value(dtype: torch.dtype) -> float:
    """-1e9, or the dtype's most negative finite value where -1e9 does not fit (float16 under ``precision: fp16``)."""
    return max(MASK_VALUE, float(torch.finfo(dtype).min))


class BesselLayerNorm(LayerNorm):
    """``a * (x - mean(x)) / (std_unbiased(x) + eps) + b`` (docs/models.md#aoa-attention-on-attention,
    ``TransformerModel.LayerNorm``): :class:`~models.layers.normalization.LayerNorm` with the parameters named
    ``a`` and ``b``, the keys of the native AoANet checkpoints."""

    gain_name, bias_name = "a", "b"


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(B, n, d) -> (B, h, n, d / h)``: head ``j`` owns channels ``[j d_k, (j + 1) d_k)``."""
    return x.unflatten(-1, (num_heads, x.shape[-1] // num_heads)).transpose(1, 2)


def multi_head_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    num_heads: int,
    dropout: nn.Module,
) -> torch.Tensor:
    """``concat_j Drop(softmax(Q_j K_j^T / sqrt(d_k))) V_j`` for ``(B, nq, d)`` queries and ``(B, nk, d)`` keys/values.

    ``allowed`` ``(B, nk)`` bool (True = real region); masked logits are set to -1e9 as in the official code
    (float16: the dtype's minimum, :func:`mask_value`).
    There is deliberately no output projection (docs/models.md#aoa-attention-on-attention).
    """
    qh, kh, vh = split_heads(q, num_heads), split_heads(k, num_heads), split_heads(v, num_heads)
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(qh.shape[-1])
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, None, None, :], mask_value(scores.dtype))
    out = dropout(torch.softmax(scores, dim=-1)) @ vh
    return out.transpose(1, 2).flatten(-2)


class AttentionOnAttention(nn.Module):
    """AoA (paper section "Attention on Attention": ``i_hat = sigmoid(W_g [v; q] + b_g) * (W_i [v; q] + b_i)``):
    ``GLU(W [attended; query] + b)``, the first half information, the second the gate.

    ``dropout`` acts on the concatenated input (0.3 in the refiner, none in the decoder; docs/models.md#aoa-refiner).
    """

    def __init__(self, d_model: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * d_model, 2 * d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, attended: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        info_gate = self.linear(self.dropout(torch.cat([attended, query], dim=-1)))
        info, gate = info_gate.chunk(2, dim=-1)
        return info * torch.sigmoid(gate)
