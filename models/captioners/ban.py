"""``ban``: a captioner built from Bilinear Attention Networks (Kim, Jun & Zhang, NeurIPS 2018; docs/models.md#ban).

BAN is a VQA model: a GRU reads the question, ``G`` low-rank bilinear attention maps relate every region to
every question word at once (one softmax over the flattened region x word grid per glimpse), each glimpse's
bilinear pooling is added back to the question states (residual learning of attention), and a classifier reads
the sum over question positions. Here **the caption prefix plays the question** and the classifier predicts
the next word.

Design choice: an **Up-Down style recurrent decoder** (a GRU language model, BAN's own question encoder, fed
``[word embedding; mean region feature]`` as the first LSTM of Up-Down is) followed by **causal BAN glimpses**,
organised like the layers of a causal Transformer decoder:

* token ``t`` sees regions ``i`` and prefix positions ``j <= t`` only. For glimpse ``g`` (Kim et al. 2018, "Bilinear
  attention map"), ``L_g[i, j] = sum_k H[g, k] X'[i, k] Y'[j, k] + b_g`` with ``X' = Drop(ReLU(U^T x_i))``,
  ``Y' = ReLU(V^T q_j)`` from the GRU states ``q_j``; ``A^{(t)}_g = softmax`` over the flattened grid
  ``{(i, j): region i real, j <= t}``. Like BAN, all maps come from the initial (GRU) states.
* glimpse pooling ``f_g(t)[k] = sum_{i, j<=t} X''_g[i, k] A^{(t)}_g[i, j] Y''_g[j, k]`` with
  ``Y''_g[j] = ReLU(V_g'^T q^{g-1}_j)`` read from the *updated* states, and the residual update (Kim et al. 2018,
  "Residual learning of attention") ``q^g_t = q^{g-1}_t + P_g^T f_g(t)``.
* BAN broadcasts each glimpse's update to *all* question positions. Doing that per prefix would make every
  token revise all earlier tokens (``O(T^2 d)`` per glimpse and a full recomputation at every decoding step);
  instead, as in a causal Transformer decoder, position ``j``'s update is computed once from its own prefix and
  reused by later tokens. This keeps attention strictly causal and lets decoding cache per-position results.
* readout (``readout``): ``last`` (default) classifies ``q^G_t``; ``sum`` is BAN's sum over question positions
  ``sum_{j<=t} q^G_j`` (its scale grows with ``t``); ``mean`` divides that by ``t + 1``. Classifier as in BAN:
  ``WN(d_ff -> V)(Drop(ReLU(WN(d -> d_ff)(r))))``.
* the counting module of BAN (VQA "how many") is omitted.

Exact causal softmax without materialising one map per prefix: per token column ``j``, ``m_j = max_i L[i, j]``,
``E[i, j] = exp(L[i, j] - m_j)``, ``S_j = sum_i E[i, j]``; with the running max ``M_t = max_{j<=t} m_j``,
``A^{(t)}[i, j] = E[i, j] w_t[j]``, ``w_t[j] = exp(m_j - M_t) / sum_{j'<=t} S_{j'} exp(m_{j'} - M_t)``. Hence
``f_g(t) = sum_{j<=t} w_t[j] (P_g[j] * Y''_g[j])`` with ``P_g[j] = sum_i E_g[i, j] X''_g[i]``.
"""

from __future__ import annotations

import torch
from torch import nn

from models import register_captioner
from models.captioners.base import Captioner, State
from models.layers.bilinear import BilinearAttentionMap, BilinearPooling, FCLayer, WNLinear
from models.layers.row_dropout import Dropout
from pipeline.core.errors import ConfigError

READOUTS = ("last", "sum", "mean")


def column_stats(logits: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token column of ``logits`` ``(C, G, N, T)``: max ``m`` ``(C, G, T)``, ``E = exp(L - m)``, ``S = sum_i E``.

    Padded regions (``allowed`` False) get weight exactly 0.
    """
    logits = logits.masked_fill(~allowed[:, None, :, None], torch.finfo(logits.dtype).min)
    m = logits.amax(dim=2)
    e = torch.exp(logits - m.unsqueeze(2))
    return m, e, e.sum(dim=2)


@register_captioner("ban")
class BANCaptioner(Captioner):
    """Bilinear-attention captioner (see the module docstring for the design and its equations)."""

    def __init__(
        self,
        vocab_size: int,
        feat_dim: int = 2048,
        d_model: int = 1280,
        glimpses: int = 8,
        k: int = 3,
        word_dim: int = 600,
        num_layers: int = 1,
        d_ff: int = 2560,
        use_mean_feat: bool = True,
        readout: str = "last",
        dropout: float = 0.2,
        dropout_v: float = 0.5,
        dropout_cls: float = 0.5,
        dropout_word: float = 0.0,
    ) -> None:
        super().__init__(vocab_size)
        if readout not in READOUTS:
            raise ConfigError(f"model ban: readout must be one of {READOUTS}, got '{readout}'")
        if glimpses < 1:
            raise ConfigError(f"model ban: glimpses must be >= 1, got {glimpses}")
        self.feat_dim, self.d_model, self.glimpses = feat_dim, d_model, glimpses
        self.use_mean_feat, self.readout = use_mean_feat, readout
        self.embed = nn.Embedding(vocab_size, word_dim)
        self.word_dropout = Dropout(dropout_word)
        self.gru = nn.GRU(word_dim + (feat_dim if use_mean_feat else 0), d_model, num_layers, batch_first=True)
        self.attention = BilinearAttentionMap(feat_dim, d_model, d_model, glimpses, k, dropout, dropout_v)
        self.pools = nn.ModuleList(BilinearPooling(feat_dim, d_model, d_model, dropout) for _ in range(glimpses))
        self.q_prj = nn.ModuleList(FCLayer(d_model, d_model, dropout, relu=False) for _ in range(glimpses))
        self.classifier = nn.Sequential(
            WNLinear(d_model, d_ff), nn.ReLU(), Dropout(dropout_cls), WNLinear(d_ff, vocab_size)
        )

    # ----------------------------------------------------------------------------------------- encoder
    def encode(self, feats: torch.Tensor, mask: torch.Tensor, boxes: torch.Tensor, sizes: torch.Tensor) -> State:
        """Region projections for the attention maps and for every glimpse's pooling, plus the mean feature."""
        allowed = mask.bool()
        keep = allowed.unsqueeze(-1).to(feats.dtype)
        feats = feats * keep
        mean = feats.sum(1) / keep.sum(1).clamp(min=1.0)
        v_pool = torch.stack([pool.v_net(feats) for pool in self.pools], dim=1)  # (B, G, N, d)
        return {"v_att": self.attention.project_v(feats), "v_pool": v_pool, "allowed": allowed, "mean": mean}

    # ----------------------------------------------------------------------------------------- decoder
    def _gru_input(self, tokens: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        words = self.word_dropout(self.embed(tokens))  # (C, T, word_dim)
        if not self.use_mean_feat:
            return words
        return torch.cat([words, mean[:, None].expand(-1, tokens.shape[1], -1)], dim=-1)

    def _classify(self, q: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.classifier(q), dim=-1)

    def decode_teacher_forced(self, enc: State, captions: torch.Tensor) -> torch.Tensor:
        c, t = captions.shape
        q, _ = self.gru(self._gru_input(captions, enc["mean"]))  # (C, T, d)
        logits = self.attention.logits(enc["v_att"], self.attention.project_q(q))  # (C, G, N, T)
        m, e, s = column_stats(logits, enc["allowed"])
        running_max = torch.cummax(m, dim=-1).values  # M_t
        future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        w = torch.exp((m.unsqueeze(-2) - running_max.unsqueeze(-1)).masked_fill(future, float("-inf")))
        w = w / (w * s.unsqueeze(-2)).sum(-1, keepdim=True)  # (C, G, T query, T key)
        pooled = e.transpose(-1, -2) @ enc["v_pool"]  # P_g[j] = sum_i E_g[i, j] X''_g[i]   (C, G, T, d)
        for g in range(self.glimpses):
            r = pooled[:, g] * self.pools[g].q_net(q)  # P_g[j] * Y''_g[j]
            q = q + self.q_prj[g](w[:, g] @ r)  # residual learning of attention
        if self.readout != "last":
            q = q.cumsum(dim=1)
            if self.readout == "mean":
                q = q / torch.arange(1, t + 1, device=q.device, dtype=q.dtype)[:, None]
        return self._classify(q)

    def init_state(self, enc: State) -> State:
        rows = enc["mean"].shape[0]
        ref = enc["v_pool"]
        return {
            "h": ref.new_zeros(rows, self.gru.num_layers, self.d_model),
            "m": ref.new_zeros(rows, self.glimpses, 0),
            "s": ref.new_zeros(rows, self.glimpses, 0),
            "r": ref.new_zeros(rows, self.glimpses, 0, self.d_model),
            "qsum": ref.new_zeros(rows, self.d_model),
        }

    def step(self, tokens: torch.Tensor, enc: State, state: State) -> tuple[torch.Tensor, State]:
        q, h = self.gru(self._gru_input(tokens[:, None], enc["mean"]), state["h"].transpose(0, 1).contiguous())
        logits = self.attention.logits(enc["v_att"], self.attention.project_q(q))  # (C, G, N, 1)
        m_t, e_t, s_t = column_stats(logits, enc["allowed"])
        pooled = (e_t.transpose(-1, -2) @ enc["v_pool"])[:, :, 0]  # (C, G, d)
        m = torch.cat([state["m"], m_t], dim=-1)
        s = torch.cat([state["s"], s_t], dim=-1)
        w = torch.exp(m - m.amax(dim=-1, keepdim=True))
        w = w / (w * s).sum(-1, keepdim=True)  # (C, G, t + 1)
        q = q[:, 0]
        new_r = []
        for g in range(self.glimpses):
            r_t = pooled[:, g] * self.pools[g].q_net(q)
            new_r.append(r_t)
            # f_g(t) = sum_{j<t} w_t[j] r_j + w_t[t] r_t  (cached r_j, no concatenation)
            f = (w[:, g, None, :-1] @ state["r"][:, g])[:, 0] + w[:, g, -1:] * r_t
            q = q + self.q_prj[g](f)
        t = m.shape[-1]
        qsum = state["qsum"] + q
        readout = {"last": q, "sum": qsum, "mean": qsum / t}[self.readout]
        new_state = {
            "h": h.transpose(0, 1),
            "m": m,
            "s": s,
            "r": torch.cat([state["r"], torch.stack(new_r, dim=1)[:, :, None]], dim=2),
            "qsum": qsum,
        }
        return self._classify(readout), new_state
