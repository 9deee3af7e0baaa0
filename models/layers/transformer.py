"""Pre-norm Transformer encoder and decoder of the SAN family (Guo et al. 2020 §3.2; docs/models.md#san-equations).

Every sub-layer is ``x + Dropout(sublayer(LN(x)))`` (pre-norm, the ruotianluo TransformerModel the SAN
parameter counts match), each stack ends with a final :class:`~models.layers.normalization.LayerNorm`.

* Encoder layer: self-attention over the regions (vanilla, NSA, GSA or both; the attention module and the
  geometric bias are injected), then the FFN ``W2 Dropout(ReLU(W1 x + b1)) + b2``.
* Decoder layer: causal self-attention over the words, attention over the encoder memory, FFN. The decoder
  input is ``lut(w) * sqrt(d) + PE[pos]`` with sinusoidal positions starting at 0 (the BOS position).
* Incremental decoding keeps, per decoder layer, the projected keys/values of the words seen so far, and
  the memory keys/values are projected once per image (:meth:`Decoder.memory_kv`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from models.layers.attention import MultiHeadAttention
from models.layers.geometry import GeometricBias
from models.layers.normalization import LayerNorm
from models.layers.row_dropout import Dropout

KV = tuple[torch.Tensor, torch.Tensor]


class FeedForward(nn.Module):
    """Position-wise FFN ``W2 Dropout(ReLU(W1 x + b1)) + b2``."""

    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(self.dropout(torch.relu(self.w_1(x))))


def sinusoidal_positions(length: int, d_model: int) -> torch.Tensor:
    """``PE[pos, 2i] = sin(pos / 10000^(2i/d))``, ``PE[pos, 2i+1] = cos(...)``, ``(length, d_model)``."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(length, d_model)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


class EncoderLayer(nn.Module):
    """Pre-norm self-attention (+ optional geometric bias) and FFN over the regions."""

    def __init__(
        self, attn: MultiHeadAttention, d_model: int, d_ff: int, dropout: float, geometry: GeometricBias | None = None
    ) -> None:
        super().__init__()
        self.attn = attn
        self.geometry = geometry
        self.ffn = FeedForward(d_model, d_ff, dropout)
        self.norm1 = LayerNorm(d_model)
        self.norm2 = LayerNorm(d_model)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rel: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm1(x)
        bias = self.geometry(h, rel) if self.geometry is not None else None
        x = x + self.dropout(self.attn(h, h, mask, bias))
        return x + self.dropout(self.ffn(self.norm2(x)))


class Encoder(nn.Module):
    """``num_layers`` encoder layers built by ``make_layer`` and a final LayerNorm."""

    def __init__(self, make_layer: Callable[[], EncoderLayer], num_layers: int, d_model: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(make_layer() for _ in range(num_layers))
        self.norm = LayerNorm(d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rel: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask, rel)
        return self.norm(x)


class DecoderLayer(nn.Module):
    """Pre-norm causal self-attention, attention over the memory, FFN."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.src_attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.ffn = FeedForward(d_model, d_ff, dropout)
        self.norm1 = LayerNorm(d_model)
        self.norm2 = LayerNorm(d_model)
        self.norm3 = LayerNorm(d_model)
        self.dropout = Dropout(dropout)

    def _rest(self, x: torch.Tensor, memory_kv: KV, memory_mask: torch.Tensor) -> torch.Tensor:
        q = self.src_attn.project_query(self.norm2(x))
        x = x + self.dropout(self.src_attn.attend(q, memory_kv[0], memory_kv[1], memory_mask))
        return x + self.dropout(self.ffn(self.norm3(x)))

    def forward(self, x: torch.Tensor, memory_kv: KV, memory_mask: torch.Tensor) -> torch.Tensor:
        """All positions at once (teacher forcing), causal."""
        h = self.norm1(x)
        x = x + self.dropout(self.self_attn(h, h, causal=True))
        return self._rest(x, memory_kv, memory_mask)

    def step(self, x: torch.Tensor, memory_kv: KV, memory_mask: torch.Tensor, cache: KV) -> tuple[torch.Tensor, KV]:
        """One new position ``x`` ``(C, 1, d)`` given the cached keys/values of the earlier positions."""
        h = self.norm1(x)
        k_new, v_new = self.self_attn.project_kv(h)
        k = torch.cat([cache[0], k_new], dim=2)
        v = torch.cat([cache[1], v_new], dim=2)
        x = x + self.dropout(self.self_attn.attend(self.self_attn.project_query(h), k, v))
        return self._rest(x, memory_kv, memory_mask), (k, v)


class Decoder(nn.Module):
    """Word embedding (scaled by sqrt(d)) + sinusoidal positions, ``num_layers`` layers, final LayerNorm."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        num_heads: int,
        d_ff: int,
        num_layers: int,
        dropout: float,
        max_positions: int = 512,
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.embed = nn.Embedding(vocab_size, d_model)
        self.register_buffer("pe", sinusoidal_positions(max_positions, d_model), persistent=False)
        self.dropout = Dropout(dropout)
        self.layers = nn.ModuleList(DecoderLayer(d_model, num_heads, d_ff, dropout) for _ in range(num_layers))
        self.norm = LayerNorm(d_model)

    def memory_kv(self, memory: torch.Tensor, mask: torch.Tensor) -> list[KV]:
        """Keys/values of the encoder memory for every layer's source attention (computed once per image)."""
        return [layer.src_attn.project_kv(memory) for layer in self.layers]

    def _embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        t = tokens.shape[1]
        if start + t > self.pe.shape[0]:
            raise ValueError(f"caption longer than the {self.pe.shape[0]} positions of the decoder")
        return self.dropout(self.embed(tokens) * math.sqrt(self.d_model) + self.pe[start : start + t])

    def forward(self, tokens: torch.Tensor, memory_kv: list[KV], memory_mask: torch.Tensor) -> torch.Tensor:
        """Hidden states ``(C, T, d)`` for ``tokens`` ``(C, T)`` (teacher forcing)."""
        x = self._embed(tokens, 0)
        for layer, kv in zip(self.layers, memory_kv):
            x = layer(x, kv, memory_mask)
        return self.norm(x)

    def empty_cache(self, rows: int, device: torch.device, dtype: torch.dtype) -> list[KV]:
        """Per-layer key/value caches holding no position yet."""
        shape = (rows, self.layers[0].self_attn.num_heads, 0, self.layers[0].self_attn.d_k)
        return [
            (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
            for _ in self.layers
        ]

    def step(
        self, tokens: torch.Tensor, memory_kv: list[KV], memory_mask: torch.Tensor, cache: list[KV]
    ) -> tuple[torch.Tensor, list[KV]]:
        """Hidden state ``(C, d)`` of one new token per row, and the extended caches.

        The token's position is the number of positions already in the cache.
        """
        x = self._embed(tokens[:, None], cache[0][0].shape[2])
        new_cache = []
        for layer, kv, c in zip(self.layers, memory_kv, cache):
            x, c = layer.step(x, kv, memory_mask, c)
            new_cache.append(c)
        return self.norm(x)[:, 0], new_cache
