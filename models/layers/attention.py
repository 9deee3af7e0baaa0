"""Multi-head scaled dot-product attention (Vaswani et al. 2017, Eq. 1 and §3.2.2; docs/models.md#san-equations).

``softmax(Q K^T / sqrt(d_k) + bias) V`` per head, with four ``Linear(d, d)`` projections (q, k, v, output),
dropout on the attention probabilities, and:

* an optional normalization of the projected queries (and keys) over the regions, NG-SAN's NSA (Eq. 6),
  see :class:`models.layers.normalization.QueryNorm`;
* an optional additive logit bias ``(B, H, Nq, Nk)`` (G-SAN's geometric bias, Eq. 10), added **before**
  the key mask and the softmax;
* keys/values that can be projected once and reused (encoder memory in the decoder, the decoder's
  incremental key/value cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.normalization import QueryNorm
from models.layers.row_dropout import dropout as row_dropout
from models.layers.row_dropout import rows_limited


def _math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout: float
) -> torch.Tensor:
    """Plain ``softmax(q k^T / sqrt(d_k) + mask) v``: on CPU much faster than the fused kernel for one query
    per row (incremental decoding: 0.04 ms vs 1.7 ms per call at batch 1) and as fast elsewhere."""
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    probs = scores.softmax(-1)
    if dropout > 0:
        probs = row_dropout(probs, dropout)  # F.dropout, or on the leading rows only (models.layers.row_dropout)
    return probs @ v


class MultiHeadAttention(nn.Module):
    """Multi-head attention; inputs and outputs are ``(B, N, d_model)``."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dropout: float = 0.1,
        query_norm: QueryNorm | None = None,
        key_norm: QueryNorm | None = None,
    ) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.d_k = d_model // num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        self.query_norm = query_norm
        self.key_norm = key_norm

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.d_k).transpose(1, 2)

    def project_query(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, Nq, d)`` -> per-head queries ``(B, H, Nq, d_k)`` (normalized over the regions under NSA)."""
        q = self.q_proj(x)
        if self.query_norm is not None:
            q = self.query_norm(q, mask)
        return self._heads(q)

    def project_kv(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, Nk, d)`` -> per-head keys and values ``(B, H, Nk, d_k)`` each."""
        k = self.k_proj(x)
        if self.key_norm is not None:
            k = self.key_norm(k, mask)
        return self._heads(k), self._heads(self.v_proj(x))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        """Attention of per-head ``q`` over ``k, v``; ``key_mask`` ``(B, Nk)`` True = may be attended.

        Returns ``(B, Nq, d_model)`` after the output projection.
        """
        attn_mask = None
        if bias is not None:
            attn_mask = bias
            if key_mask is not None:
                attn_mask = attn_mask.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        elif key_mask is not None:
            attn_mask = key_mask[:, None, None, :]
        if causal and (attn_mask is not None or q.device.type != "cuda"):
            nq, nk = q.shape[-2], k.shape[-2]
            allowed = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
            if attn_mask is None or attn_mask.dtype == torch.bool:
                attn_mask = allowed if attn_mask is None else attn_mask & allowed
            else:
                attn_mask = attn_mask.masked_fill(~allowed, float("-inf"))
            causal = False
        p = self.dropout if self.training else 0.0
        if q.device.type == "cuda" and not (p > 0 and rows_limited()):  # the fused kernel would drop every row
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p, is_causal=causal)
        else:
            out = _math_attention(q, k, v, attn_mask, p)
        b, h, n, dk = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, n, h * dk))

    def forward(
        self,
        x_q: torch.Tensor,
        x_kv: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        """Full attention of ``x_q`` over ``x_kv`` (self-attention when they are the same tensor).

        Under NSA the query statistics use ``key_mask`` as the query's region mask (self-attention only).
        """
        q = self.project_query(x_q, key_mask)
        k, v = self.project_kv(x_kv, key_mask)
        return self.attend(q, k, v, key_mask, bias, causal)
