"""Attention blocks of the Meshed-Memory Transformer (Cornia et al., CVPR 2020; docs/models.md#m2).

* :class:`M2Attention`: multi-head scaled dot-product attention, optionally **memory-augmented**
  (paper Eq. 2): ``M_mem(X) = Attention(W_q X, [W_k X; M_k], [W_v X; M_v])`` with ``m`` learnable key
  and value slots. As in the official code (docs/models.md#m2-encoder) the slots are concatenated *after* the key
  and value projections, scaled by ``sqrt(d_k)`` and ``sqrt(m)`` at forward time, split across heads by
  channel, shared by the batch, and never masked.
* :class:`PostNormAttention`: ``LN(X + Drop(Attn(X, Y, Y)))`` (post-norm, Eq. 5).
* :class:`PositionWiseFF`: ``LN(X + Drop(W2 Drop(ReLU(W1 X + b1)) + b2))`` (paper Eq. 4, post-norm).

Keys and values are projected separately (:meth:`M2Attention.project_kv`) so that decoders can cache
them: the decoder's self-attention grows its key/value cache one token at a time, and the cross-attention
projects every encoder level once per image.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from models.layers.row_dropout import Dropout
from pipeline.core.errors import ConfigError


def masked_fill_min(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Set the logits of disallowed keys to the lowest finite value (softmax weight exactly 0, never NaN)."""
    return scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)


class M2Attention(nn.Module):
    """Multi-head attention with optional memory slots (M2 Eq. 2; ``ScaledDotProductAttentionMemory``).

    ``num_memory = 0`` gives the plain attention of the decoder. Projections are ``d_model -> d_model`` with
    bias; heads own contiguous channel blocks of ``d_k = d_model / num_heads``.
    """

    def __init__(self, d_model: int, num_heads: int, num_memory: int = 0) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ConfigError(f"model m2: d_model={d_model} must be divisible by num_heads={num_heads}")
        self.d_model, self.num_heads, self.d_k = d_model, num_heads, d_model // num_heads
        self.num_memory = num_memory
        self.fc_q = nn.Linear(d_model, d_model)
        self.fc_k = nn.Linear(d_model, d_model)
        self.fc_v = nn.Linear(d_model, d_model)
        self.fc_o = nn.Linear(d_model, d_model)
        if num_memory > 0:
            self.m_k = nn.Parameter(torch.empty(1, num_memory, d_model))
            self.m_v = nn.Parameter(torch.empty(1, num_memory, d_model))
        else:
            self.register_parameter("m_k", None)
            self.register_parameter("m_v", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Per-module init of the official code: xavier weights, zero biases, N(0, 1/d_k) / N(0, 1/m) slots."""
        for fc in (self.fc_q, self.fc_k, self.fc_v, self.fc_o):
            nn.init.xavier_uniform_(fc.weight)
            nn.init.zeros_(fc.bias)
        if self.m_k is not None:
            nn.init.normal_(self.m_k, 0.0, 1.0 / self.d_k)
            nn.init.normal_(self.m_v, 0.0, 1.0 / self.num_memory)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., n, d_model) -> (..., h, n, d_k)``."""
        return x.unflatten(-1, (self.num_heads, self.d_k)).transpose(-2, -3)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``X W_k + b_k`` and values ``X W_v + b_v`` (memory slots are added in :meth:`attend`)."""
        return self.fc_k(x), self.fc_v(x)

    def attend(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``concat_j softmax(Q_j K_j^T / sqrt(d_k)) V_j W_o + b_o`` for projected ``keys``/``values``.

        ``queries`` ``(B, nq, d)`` (raw, projected here), ``keys``/``values`` ``(B, [L,] nk, d)`` projected
        (an optional level axis ``L`` attends the same queries to several key sets, as the meshed decoder
        does), ``allowed`` a bool mask broadcastable to ``(B, [L,] 1|h, nq, nk)`` (True = may attend).
        Memory slots, if any, are appended to every key set and are always allowed.
        """
        q = self._heads(self.fc_q(queries))  # (B, h, nq, dk)
        if keys.dim() == 4:
            q = q.unsqueeze(1)  # (B, 1, h, nq, dk) against (B, L, h, nk, dk)
        k, v = self._heads(keys), self._heads(values)
        if self.m_k is not None:
            if keys.dim() != 3:
                raise ValueError("memory slots are only supported for 3-D keys")
            b = keys.shape[0]
            m_k = self._heads(math.sqrt(self.d_k) * self.m_k).expand(b, -1, -1, -1)
            m_v = self._heads(math.sqrt(self.num_memory) * self.m_v).expand(b, -1, -1, -1)
            k, v = torch.cat([k, m_k], dim=-2), torch.cat([v, m_v], dim=-2)
            if allowed is not None:
                pad = allowed.new_ones(*allowed.shape[:-1], self.num_memory)
                allowed = torch.cat([allowed, pad], dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d_k)
        if allowed is not None:
            scores = masked_fill_min(scores, allowed)
        out = torch.softmax(scores, dim=-1) @ v  # (..., h, nq, dk)
        return self.fc_o(out.transpose(-2, -3).flatten(-2))

    def forward(self, queries: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        k, v = self.project_kv(keys)
        return self.attend(queries, k, v, allowed)


class PostNormAttention(nn.Module):
    """``LN(X + Drop(Attn(X, ...)))``: M2's ``MultiHeadAttention`` wrapper (Eq. 5; docs/models.md#m2-encoder)."""

    def __init__(self, d_model: int, num_heads: int, dropout: float, num_memory: int = 0) -> None:
        super().__init__()
        self.attention = M2Attention(d_model, num_heads, num_memory)
        self.dropout = Dropout(dropout)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        return self.residual(x, self.attention(x, keys, allowed))

    def residual(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Add-and-norm for an attention output computed elsewhere (cached keys/values)."""
        return self.norm(x + self.dropout(attended))


class PositionWiseFF(nn.Module):
    """M2 Eq. 4 with post-norm: ``LN(X + Drop(W2 Drop(ReLU(W1 X + b1)) + b2))`` (two distinct dropouts)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.inner_dropout = Dropout(dropout)
        self.dropout = Dropout(dropout)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.inner_dropout(torch.relu(self.fc1(x)))
        return self.norm(x + self.dropout(self.fc2(hidden)))
