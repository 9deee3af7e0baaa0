"""``aoa``: AoANet (Huang, Wang, Chen & Wei, "Attention on Attention for Image Captioning", ICCV 2019).

Equations, choices and switches: docs/models.md#aoa (official code husthuaan/AoANet, configuration of ``train.sh``).

Feature embedding (docs/models.md#aoa-refiner)
    ``A = Drop(ReLU(X W_e + b_e))`` on real regions only; padded rows are exactly 0.
Refiner (paper section "Encoder with AoA"; docs/models.md#aoa-refiner), ``num_layers`` (6) layers
    ``A~ = LN(A)``; ``V^ = concat_j Drop(softmax(Q_j K_j^T / sqrt(d_k))) V_j`` with ``Q, K, V = A~ W_{q,k,v}`` and
    no output projection; ``A <- A + Drop(AoA(V^, A~))`` (pre-norm residual), an optional FF sub-layer
    (``use_ff``, off in the paper), and a final LN. ``a_bar`` = masked mean of the refined regions.
Decoder (paper section "Decoder with AoA"; docs/models.md#aoa-decoder), one step
    ``x_t = [Drop(ReLU(E w_{t-1})); a_bar + Drop(c_{t-1})]``, ``h_t, m_t = LSTM(x_t, h_{t-1}, m_{t-1})``,
    ``a^_t = MHA(W_q LN(h_t), K, V)`` with keys/values the two halves of ``A W_c + b_c`` (first half VALUES,
    second half KEYS; not projected again), ``c_t = AoA(a^_t, h_t)``, ``p(w_t) = softmax(W_p Drop(c_t) + b_p)``.

Vocabulary: the official model shares index 0 for BOS/EOS/PAD and has ``V + 1`` outputs; here the pipeline's
vocabulary (specials PAD/BOS/EOS/UNK included) is both the embedding and the output size, so the official
``V_words = 10,369`` corresponds to ``vocab_size = 10,370`` (87,369,858 parameters, docs/models.md#aoa-parameter-count).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from models import register_captioner
from models.captioners.base import Captioner, State
from models.layers.aoa_layers import AttentionOnAttention, BesselLayerNorm, multi_head_attend
from models.layers.row_dropout import Dropout
from models.layers.transformer import FeedForward
from pipeline.core.errors import ConfigError


class AoARefinerLayer(nn.Module):
    """One refiner layer: ``A + Drop(AoA(MHA(LN(A)), LN(A)))`` [+ ``A + Drop(FF(LN(A)))``]
    (docs/models.md#aoa-refiner)."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        use_ff: bool,
        dropout: float,
        attn_dropout: float,
        dropout_aoa: float,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm = BesselLayerNorm(d_model)
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.attn_dropout = Dropout(attn_dropout)
        self.aoa = AttentionOnAttention(d_model, dropout_aoa)
        self.dropout = Dropout(dropout)
        if use_ff:
            self.ff_norm = BesselLayerNorm(d_model)
            self.ff = FeedForward(d_model, d_ff, dropout)  # only with use_ff (the paper's refiner has none)
        else:
            self.ff_norm = self.ff = None

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        xn = self.norm(x)
        attended = multi_head_attend(self.q(xn), self.k(xn), self.v(xn), allowed, self.num_heads, self.attn_dropout)
        x = x + self.dropout(self.aoa(attended, xn))
        if self.ff is not None:
            x = x + self.dropout(self.ff(self.ff_norm(x)))
        return x


@register_captioner("aoa")
class AoANet(Captioner):
    """AoANet captioner (see the module docstring; docs/models.md#aoa)."""

    def __init__(
        self,
        vocab_size: int,
        feat_dim: int = 2048,
        d_model: int = 1024,
        num_heads: int = 8,
        num_layers: int = 6,
        use_ff: bool = False,
        d_ff: int = 2048,
        drop_prob_lm: float = 0.5,
        dropout: float = 0.1,
        attn_dropout: float = 0.1,
        dropout_aoa: float = 0.3,
        ctx_drop: bool = True,
        identical_refiner_init: bool = True,
    ) -> None:
        super().__init__(vocab_size)
        if d_model % num_heads:
            raise ConfigError(f"model aoa: d_model={d_model} must be divisible by num_heads={num_heads}")
        self.feat_dim, self.d_model, self.num_heads = feat_dim, d_model, num_heads
        self.att_embed = nn.Sequential(nn.Linear(feat_dim, d_model), nn.ReLU(), Dropout(drop_prob_lm))
        layers = [
            AoARefinerLayer(d_model, num_heads, d_ff, use_ff, dropout, attn_dropout, dropout_aoa)
            for _ in range(1 if identical_refiner_init else num_layers)
        ][:num_layers]
        if identical_refiner_init:  # the official layers are deep copies of one layer (docs/models.md#aoa-choices)
            layers += [copy.deepcopy(layers[0]) for _ in range(num_layers - 1)]
        self.refiner = nn.ModuleList(layers)
        # num_layers = 0 is the official "without refining" variant (no final LN either; docs/models.md#aoa-choices)
        self.refiner_norm = BesselLayerNorm(d_model) if num_layers > 0 else nn.Identity()
        self.ctx2att = nn.Linear(d_model, 2 * d_model)
        self.embed = nn.Sequential(nn.Embedding(vocab_size, d_model), nn.ReLU(), Dropout(drop_prob_lm))
        self.lstm = nn.LSTMCell(2 * d_model, d_model)
        self.query_norm = BesselLayerNorm(d_model)
        self.query_proj = nn.Linear(d_model, d_model)
        self.decoder_attn_dropout = Dropout(attn_dropout)
        self.att2ctx = AttentionOnAttention(d_model)  # decoder AoA: no dropout on its input
        self.ctx_dropout = Dropout(drop_prob_lm) if ctx_drop else nn.Identity()
        self.output_dropout = Dropout(drop_prob_lm)
        self.logit = nn.Linear(d_model, vocab_size)

    # ----------------------------------------------------------------------------------------- encoder
    def encode(self, feats: torch.Tensor, mask: torch.Tensor, boxes: torch.Tensor, sizes: torch.Tensor) -> State:
        """Embed, refine (6 AoA layers), mean-pool; project once into the decoder's values and keys."""
        allowed = mask.bool()
        keep = allowed.unsqueeze(-1).to(feats.dtype)
        x = self.att_embed(feats) * keep  # padded rows exactly 0 (official pack_wrapper)
        for layer in self.refiner:
            x = layer(x, allowed)
        x = self.refiner_norm(x)
        mean = (x * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        values, keys = self.ctx2att(x).chunk(
            2, dim=-1
        )  # first half VALUES, second half KEYS (docs/models.md#aoa-refiner)
        return {"values": values, "keys": keys, "mean": mean, "allowed": allowed}

    # ----------------------------------------------------------------------------------------- decoder
    def init_state(self, enc: State) -> State:
        zeros = enc["mean"].new_zeros(enc["mean"].shape)
        return {"h": zeros, "c": zeros, "ctx": zeros}

    def _core(self, word: torch.Tensor, enc: State, state: State) -> State:
        """One decoder step from the embedded word ``x_t``: LSTM, multi-head attention, AoA -> new state."""
        x = torch.cat([word, enc["mean"] + self.ctx_dropout(state["ctx"])], dim=-1)
        h, c = self.lstm(x, (state["h"], state["c"]))
        query = self.query_proj(self.query_norm(h)).unsqueeze(1)
        attended = multi_head_attend(
            query, enc["keys"], enc["values"], enc["allowed"], self.num_heads, self.decoder_attn_dropout
        )[:, 0]
        ctx = self.att2ctx(attended, h)  # AoA query = the raw LSTM output
        return {"h": h, "c": c, "ctx": ctx}

    def _logprobs(self, ctx: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.logit(self.output_dropout(ctx)), dim=-1)

    def step(self, tokens: torch.Tensor, enc: State, state: State) -> tuple[torch.Tensor, State]:
        state = self._core(self.embed(tokens), enc, state)
        return self._logprobs(state["ctx"]), state

    def decode_teacher_forced(self, enc: State, captions: torch.Tensor) -> torch.Tensor:
        """The recurrence step by step; word embeddings and output layer batched over time (same result)."""
        words = self.embed(captions)
        state = self.init_state(enc)
        contexts = []
        for t in range(captions.shape[1]):
            state = self._core(words[:, t], enc, state)
            contexts.append(state["ctx"])
        return self._logprobs(torch.stack(contexts, dim=1))
