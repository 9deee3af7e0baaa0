"""``m2``: the Meshed-Memory Transformer (Cornia, Stefanini, Baraldi & Cucchiara, CVPR 2020).

Equations, choices and switches: docs/models.md#m2 (official code: aimagelab/meshed-memory-transformer).

Encoder (§3.1 of the paper; docs/models.md#m2-encoder)
    ``X0 = LN(Drop(ReLU(X W_in + b_in)))``, then ``num_layers`` layers of memory-augmented self-attention
    (Eq. 2, ``m = num_memory`` learnable slots) and position-wise FF (Eq. 4), each wrapped in AddNorm (Eq. 5,
    post-norm). **Every** layer's output is kept: the multi-level encoding ``Y_1 .. Y_L`` ("full encoder").

Meshed decoder (§3.2; docs/models.md#m2-decoder), for any number of encoder levels ``L`` and decoder layers
    ``S = LN(E + Drop(SelfAttn(E)))`` (causal), ``C_i = LN(S + Drop(Attn(S, Y_i)))`` with **one** cross-attention
    module shared by all levels (Eq. 7), ``alpha_i = sigmoid(W_i [S; C_i] + b_i)`` element-wise gates, one per
    level (Eq. 8), ``M = sum_i alpha_i * C_i / sqrt(L)`` (Eq. 6, the official code hard-wires ``L = 3``), then
    position-wise FF; every sub-layer output is multiplied by the non-pad mask of the query token.
    Output: ``log_softmax(out W_out)``, no bias, untied.

Switches
    ``official_mask``: the official encoder derives its padding mask from the rows of ``X0`` that sum to 0
        *after* the input LayerNorm, which in practice masks nothing (docs/models.md#m2-choices): padded regions take
        part as keys in encoder self-attention and decoder cross-attention. ``false`` (default) masks them with the
        ``mask`` input; ``true`` reproduces the official computation for parity.
    ``fixed_regions``: the official data field hands the model exactly 50 rows per image: the first 50 detections
        of the features file, zero-padded (``data/field.py``, ``max_detections``); with ``official_mask`` the zero
        rows take part in attention, so the count matters. ``null`` (default) uses the regions as given; an
        integer keeps the first ``fixed_regions`` regions of each image and zero-pads to that count.
    ``official_init``: the official ``init_weights`` applies ``xavier_uniform_`` to every parameter with
        ``dim > 1`` (docs/models.md#m2-choices), which turns the frozen sinusoid position table into a frozen *random*
        table and overwrites the N(0, 1/d_k) / N(0, 1/m) memory init. ``false`` (default, the paper) applies the same
        override to every other matrix but keeps the sinusoids and the memory init; ``true`` reproduces the code.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from models import register_captioner
from models.captioners.base import Captioner, State
from models.layers.m2_attention import PositionWiseFF, PostNormAttention
from models.layers.row_dropout import Dropout
from pipeline.core.errors import ConfigError
from pipeline.core.vocab import PAD


def sinusoid_table(num_positions: int, d_model: int) -> torch.Tensor:
    """``PE[pos, 2i] = sin(pos / 10000^(2i/d))``, ``PE[pos, 2i+1] = cos(...)``, with row 0 (padding) zero."""
    pos = torch.arange(num_positions, dtype=torch.float64)[:, None]
    i = torch.arange(0, d_model, 2, dtype=torch.float64)
    angle = pos / torch.pow(10000.0, i / d_model)
    table = torch.zeros(num_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    table[0] = 0.0
    return table.float()


class MemoryAugmentedEncoder(nn.Module):
    """Input projection + ``num_layers`` memory-augmented layers; returns all levels ``(B, L, N, d)``."""

    def __init__(
        self,
        feat_dim: int,
        d_model: int,
        num_heads: int,
        d_ff: int,
        num_layers: int,
        num_memory: int,
        dropout: float,
        official_mask: bool,
    ) -> None:
        super().__init__()
        self.fc = nn.Linear(feat_dim, d_model)
        self.dropout = Dropout(dropout)
        self.norm = nn.LayerNorm(d_model)
        self.attn = nn.ModuleList(PostNormAttention(d_model, num_heads, dropout, num_memory) for _ in range(num_layers))
        self.ff = nn.ModuleList(PositionWiseFF(d_model, d_ff, dropout) for _ in range(num_layers))
        self.official_mask = official_mask

    def forward(self, feats: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the stacked levels and the key mask the decoder must use (True = attend)."""
        x = self.norm(self.dropout(torch.relu(self.fc(feats))))  # docs/models.md#m2-encoder: Linear-ReLU-Drop-LN
        if self.official_mask:
            allowed = x.sum(-1) != 0  # official: computed after the LayerNorm, masks (almost) nothing
        else:
            allowed = mask.bool()
        key_mask = allowed[:, None, None, :]  # (B, 1, 1, N) against (B, h, N, N + m)
        levels = []
        for attn, ff in zip(self.attn, self.ff):
            x = ff(attn(x, x, key_mask))
            levels.append(x)
        return torch.stack(levels, dim=1), allowed


class MeshedDecoderLayer(nn.Module):
    """Causal self-attention, meshed cross-attention over all encoder levels (Eq. 6-8), FF."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, num_levels: int, dropout: float) -> None:
        super().__init__()
        self.self_attn = PostNormAttention(d_model, num_heads, dropout)
        self.cross_attn = PostNormAttention(d_model, num_heads, dropout)  # shared by all levels (Eq. 7)
        self.gates = nn.ModuleList(nn.Linear(2 * d_model, d_model) for _ in range(num_levels))
        self.ff = PositionWiseFF(d_model, d_ff, dropout)
        for gate in self.gates:
            nn.init.xavier_uniform_(gate.weight)
            nn.init.zeros_(gate.bias)

    def meshed(
        self,
        s: torch.Tensor,
        cross_k: torch.Tensor,
        cross_v: torch.Tensor,
        enc_allowed: torch.Tensor,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        """Eq. 6-8: ``sum_i sigmoid(W_i [S; C_i] + b_i) * C_i / sqrt(L)`` with ``C_i = LN(S + Drop(Attn(S, Y_i)))``.

        ``s`` ``(C, T, d)``, ``cross_k``/``cross_v`` ``(C, L, N, d)`` (levels projected once per image),
        ``enc_allowed`` ``(C, N)``, ``keep`` ``(C, T, 1)`` the non-pad query mask.
        """
        attended = self.cross_attn.attention.attend(s, cross_k, cross_v, enc_allowed[:, None, None, None, :])
        c = self.cross_attn.residual(s.unsqueeze(1), attended) * keep.unsqueeze(1)  # (C, L, T, d)
        total = torch.zeros_like(s)
        for i, gate in enumerate(self.gates):
            alpha = torch.sigmoid(gate(torch.cat([s, c[:, i]], dim=-1)))
            total = total + alpha * c[:, i]
        return total / math.sqrt(len(self.gates)) * keep

    def forward(
        self,
        x: torch.Tensor,
        self_allowed: torch.Tensor,
        cross_k: torch.Tensor,
        cross_v: torch.Tensor,
        enc_allowed: torch.Tensor,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        s = self.self_attn(x, x, self_allowed) * keep
        return self.ff(self.meshed(s, cross_k, cross_v, enc_allowed, keep)) * keep


@register_captioner("m2")
class M2Transformer(Captioner):
    """Meshed-Memory Transformer captioner (see the module docstring; docs/models.md#m2)."""

    def __init__(
        self,
        vocab_size: int,
        feat_dim: int = 2048,
        d_model: int = 512,
        num_heads: int = 8,
        d_ff: int = 2048,
        num_layers: int = 3,
        num_dec_layers: int | None = None,
        num_memory: int = 40,
        dropout: float = 0.1,
        max_len: int = 54,
        official_mask: bool = False,
        official_init: bool = False,
        fixed_regions: int | None = None,
    ) -> None:
        super().__init__(vocab_size)
        num_dec_layers = num_layers if num_dec_layers is None else num_dec_layers
        if num_layers < 1 or num_dec_layers < 1:
            raise ConfigError(
                f"model m2: needs num_layers >= 1 and num_dec_layers >= 1, got {num_layers}, {num_dec_layers}"
            )
        self.feat_dim, self.d_model, self.max_len = feat_dim, d_model, max_len
        if fixed_regions is not None and fixed_regions < 1:
            raise ConfigError(f"model m2: fixed_regions must be null or >= 1, got {fixed_regions}")
        self.fixed_regions = fixed_regions
        self.encoder = MemoryAugmentedEncoder(
            feat_dim, d_model, num_heads, d_ff, num_layers, num_memory, dropout, official_mask
        )
        self.word_emb = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        self.pos_emb = nn.Embedding.from_pretrained(sinusoid_table(max_len + 1, d_model), freeze=True)
        self.layers = nn.ModuleList(
            MeshedDecoderLayer(d_model, num_heads, d_ff, num_layers, dropout) for _ in range(num_dec_layers)
        )
        self.out = nn.Linear(d_model, vocab_size, bias=False)
        self._global_xavier(official_init)

    def _global_xavier(self, official: bool) -> None:
        """docs/models.md#m2-choices: xavier on every ``dim > 1`` parameter; ``official=False`` spares positions and
        memory."""
        spared = set()
        if not official:
            spared.add(id(self.pos_emb.weight))
            for layer in self.encoder.attn:
                spared.update((id(layer.attention.m_k), id(layer.attention.m_v)))
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1 and id(p) not in spared:
                    nn.init.xavier_uniform_(p)

    # ----------------------------------------------------------------------------------------- encoder
    def encode(self, feats: torch.Tensor, mask: torch.Tensor, boxes: torch.Tensor, sizes: torch.Tensor) -> State:
        """Multi-level encoding, projected once into every decoder layer's cross-attention keys/values."""
        if self.fixed_regions is not None:
            feats, mask = self._fixed_rows(feats, mask)
        levels, allowed = self.encoder(feats, mask)
        ks, vs = zip(*(layer.cross_attn.attention.project_kv(levels) for layer in self.layers))
        return {"cross_k": torch.stack(ks, 1), "cross_v": torch.stack(vs, 1), "allowed": allowed}

    def _fixed_rows(self, feats: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``fixed_regions`` regions of every image, zero rows up to that count (official data field)."""
        n = self.fixed_regions
        feats, mask = feats[:, :n], mask[:, :n].bool()
        feats = feats * mask[..., None].to(feats.dtype)
        if feats.shape[1] < n:
            feats = torch.nn.functional.pad(feats, (0, 0, 0, n - feats.shape[1]))
            mask = torch.nn.functional.pad(mask, (0, n - mask.shape[1]), value=False)
        return feats, mask

    # ----------------------------------------------------------------------------------------- decoder
    def _check_length(self, length: int) -> None:
        if length > self.max_len:
            raise ValueError(f"m2: caption position {length} exceeds max_len={self.max_len} (the position table size)")

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``WordEmb(w) + PosEmb(p)`` with ``p = t + 1`` for real tokens and 0 for PAD (no scaling, no dropout).

        Returns the embeddings and the non-pad mask of the tokens.
        """
        keep = tokens != PAD
        return self.word_emb(tokens) + self.pos_emb(positions * keep), keep

    def decode_teacher_forced(self, enc: State, captions: torch.Tensor) -> torch.Tensor:
        c, t = captions.shape
        self._check_length(t)
        positions = torch.arange(1, t + 1, device=captions.device).expand(c, t)
        x, keep = self._embed(captions, positions)
        causal = torch.ones(t, t, dtype=torch.bool, device=captions.device).tril()
        self_allowed = causal[None, None] & keep[:, None, None, :]  # (C, 1, T, T): no future, no PAD keys
        keep = keep.unsqueeze(-1).to(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, self_allowed, enc["cross_k"][:, i], enc["cross_v"][:, i], enc["allowed"], keep)
        return torch.log_softmax(self.out(x), dim=-1)

    def max_caption_len(self) -> int:
        """Positions 1..max_len of the (frozen) table; row 0 is the padding row."""
        return int(self.max_len)

    def init_state(self, enc: State) -> State:
        rows = enc["allowed"].shape[0]
        empty = enc["cross_k"].new_zeros(rows, 0, self.d_model)
        return {
            "keys": [empty for _ in self.layers],
            "values": [empty for _ in self.layers],
            "key_ok": torch.zeros(rows, 0, dtype=torch.bool, device=empty.device),
        }

    def step(self, tokens: torch.Tensor, enc: State, state: State) -> tuple[torch.Tensor, State]:
        t = state["key_ok"].shape[1]
        self._check_length(t + 1)
        tokens = tokens[:, None]
        x, keep = self._embed(tokens, torch.full_like(tokens, t + 1))
        key_ok = torch.cat([state["key_ok"], keep], dim=1)
        keep = keep.unsqueeze(-1).to(x.dtype)
        new_keys, new_values = [], []
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.attention.project_kv(x)
            keys = torch.cat([state["keys"][i], k], dim=1)
            values = torch.cat([state["values"][i], v], dim=1)
            new_keys.append(keys)
            new_values.append(values)
            attended = layer.self_attn.attention.attend(x, keys, values, key_ok[:, None, None, :])
            s = layer.self_attn.residual(x, attended) * keep
            x = layer.ff(layer.meshed(s, enc["cross_k"][:, i], enc["cross_v"][:, i], enc["allowed"], keep)) * keep
        logp = torch.log_softmax(self.out(x[:, 0]), dim=-1)
        return logp, {"keys": new_keys, "values": new_values, "key_ok": key_ok}
