"""Self-attentive visually grounded sentence encoder (Yoo, Shin & Lee 2017; docs/sentence_encoder.md).

A caption X (word ids, then ``<eos>``) is encoded by a bidirectional LSTM (§3.1)::

    h_S = max(h→_T, h←_1)                             element-wise max of the two final states (§3.1)
    A   = softmax_T( W_a2 tanh(W_a1 H) )               n_a attention rows over the T words (§3.3)
    C   = A Hᵀ,  h_A = max(c_1, ..., c_{n_a})          max-pooled over the n_a context rows
    h   = [h_A ; h_S]                                  the sentence representation (h = h_S without attention)

and ``h`` feeds two heads: an image-feature predictor (``image_head_layers`` layers, ReLU, dropout 0.3;
§3.2) whose output is compared with the image feature by cosine similarity (the ranking loss is
:mod:`pipeline.embedding.losses`), and an LSTM decoder that generates another caption of the same image
(§3.1, loss L_C). Which heads exist follows ``objective``: ``cap2img`` (L_VG), ``cap2cap`` (L_C) or
``cap2all`` (L_C + L_VG) (§3.4).

Project decisions where the paper is ambiguous (docs/sentence_encoder.md), both switches:

* ``state_merge``: the attention reads per-step states h_t. ``max`` (default) takes the element-wise max of
  the two directions, h_t ∈ R^{d_h} as the paper writes it, so that h_A (d_h) + h_S (d_h) = 2 d_h = 2048
  (footnote 1); ``concat`` uses [h→_t ; h←_t] ∈ R^{2 d_h} (the paper's wording), giving a 3 d_h representation.
* The decoder is conditioned on h through its initial hidden state, h_0 = tanh(W_0 h), c_0 = 0 (the paper
  only says the LSTM decoder predicts Y from the representation); it shares the word embedding table.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from pipeline.core.config import CONFIG_DIR, Config, load_yaml_with_bases
from pipeline.core.errors import ConfigError
from pipeline.core.vocab import BOS, EOS, PAD

OBJECTIVES = ("cap2img", "cap2cap", "cap2all")
STATE_MERGES = ("max", "concat")
CONFIG_PATH = CONFIG_DIR / "models" / "sentence_encoder.yaml"


def encoder_config(overrides: dict[str, Any] | list[str] | None = None) -> Config:
    """The ``model:`` section of configs/models/sentence_encoder.yaml with ``overrides`` (validated)."""
    data = load_yaml_with_bases(CONFIG_PATH)
    if not isinstance(data.get("model"), dict):
        raise ConfigError(f"{CONFIG_PATH} must have a 'model:' mapping")
    return Config(data["model"]).with_overrides(overrides, source="model sentence_encoder")


class StructuredSelfAttention(nn.Module):
    """A = softmax(W_a2 tanh(W_a1 H)) over the T steps for each of n_a rows; C = A Hᵀ; h_A = max over rows
    (Yoo et al. 2017 §3.3). Padding steps get exactly zero weight (their scores are -inf)."""

    def __init__(self, state_dim: int, attn_hidden: int, attn_rows: int) -> None:
        super().__init__()
        self.w_a1 = nn.Linear(state_dim, attn_hidden, bias=False)
        self.w_a2 = nn.Linear(attn_hidden, attn_rows, bias=False)

    def forward(self, states: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """``states`` (B, T, d), ``mask`` (B, T) True for words -> (h_A (B, d), A (B, n_a, T))."""
        scores = self.w_a2(torch.tanh(self.w_a1(states)))  # (B, T, n_a)
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
        attn = torch.softmax(scores.float(), dim=1).to(states.dtype).transpose(1, 2)  # (B, n_a, T)
        context = attn @ states  # C = A Hᵀ: (B, n_a, d)
        return context.max(dim=1).values, attn


class SentenceEncoder(nn.Module):
    """The grounded sentence encoder with its image and caption heads (see the module docstring).

    Args:
        vocab_size: ids of the prepared vocabulary (PAD=0 BOS=1 EOS=2 UNK=3).
        image_dim: size of the image feature predicted by the image head (the store's feature size).
        objective: ``cap2img`` | ``cap2cap`` | ``cap2all``: which heads are built and trained.
        self_attention: False is the paper's ablation (h = h_S).
        word_dim, hidden_size: word embedding size and per-direction LSTM size d_h (paper: GloVe 300, 1024).
        attn_hidden, attn_rows: d_a and n_a (paper: 350, 30).
        state_merge: ``max`` | ``concat`` (module docstring).
        image_head_layers, image_head_hidden, image_head_dropout: the image predictor (paper: 4 layers, 0.3).
        decoder_hidden: decoder LSTM size (paper: 1024).
    """

    def __init__(
        self,
        vocab_size: int,
        image_dim: int,
        objective: str = "cap2all",
        self_attention: bool = True,
        word_dim: int = 300,
        hidden_size: int = 1024,
        attn_hidden: int = 350,
        attn_rows: int = 30,
        state_merge: str = "max",
        image_head_layers: int = 4,
        image_head_hidden: int = 2048,
        image_head_dropout: float = 0.3,
        decoder_hidden: int = 1024,
    ) -> None:
        super().__init__()
        if objective not in OBJECTIVES:
            raise ConfigError(f"model.objective must be one of {', '.join(OBJECTIVES)}, not {objective!r}")
        if state_merge not in STATE_MERGES:
            raise ConfigError(f"model.state_merge must be max or concat, not {state_merge!r}")
        if image_head_layers < 1:
            raise ConfigError("model.image_head_layers must be >= 1")
        self.vocab_size, self.image_dim, self.objective = vocab_size, image_dim, objective
        self.self_attention, self.state_merge, self.hidden_size = self_attention, state_merge, hidden_size
        self.embed = nn.Embedding(vocab_size, word_dim, padding_idx=PAD)
        self.lstm = nn.LSTM(word_dim, hidden_size, batch_first=True, bidirectional=True)
        state_dim = hidden_size * (2 if state_merge == "concat" else 1)
        self.attention = StructuredSelfAttention(state_dim, attn_hidden, attn_rows) if self_attention else None
        self.rep_dim = hidden_size + (state_dim if self_attention else 0)
        self.image_head: nn.Sequential | None = None
        if objective in ("cap2img", "cap2all"):
            layers: list[nn.Module] = []
            width = self.rep_dim
            for _ in range(image_head_layers - 1):
                layers += [nn.Linear(width, image_head_hidden), nn.ReLU(), nn.Dropout(image_head_dropout)]
                width = image_head_hidden
            layers.append(nn.Linear(width, image_dim))
            self.image_head = nn.Sequential(*layers)
        self.decoder: nn.LSTM | None = None
        if objective in ("cap2cap", "cap2all"):
            self.decoder_init = nn.Linear(self.rep_dim, decoder_hidden)
            self.decoder = nn.LSTM(word_dim, decoder_hidden, batch_first=True)
            self.decoder_out = nn.Linear(decoder_hidden, vocab_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Orthogonal recurrent weights, Xavier for all other matrices, zero biases (Yoo et al. 2017 §4.1)."""
        for name, p in self.named_parameters():
            if "weight_hh" in name:
                for chunk in p.data.chunk(4, 0):  # one orthogonal block per gate
                    nn.init.orthogonal_(chunk)
            elif p.dim() >= 2:
                nn.init.xavier_uniform_(p)
            else:
                nn.init.zeros_(p)
        with torch.no_grad():
            self.embed.weight[PAD].zero_()

    # -- encoder --------------------------------------------------------------------------------------

    def encode(self, tokens: Tensor, lengths: Tensor) -> dict[str, Tensor]:
        """``tokens`` (B, T) word ids then EOS, PAD after; ``lengths`` (B,) >= 1 real tokens.

        Returns ``h`` (B, rep_dim), ``h_S`` (B, d_h), ``h_A`` (B, d) or absent, ``attention`` (B, n_a, T)
        or absent, and ``mask`` (B, T).
        """
        lengths = lengths.to(torch.int64).clamp(min=1)
        t = int(lengths.max())
        tokens = tokens[:, :t]
        mask = torch.arange(t, device=tokens.device)[None, :] < lengths.to(tokens.device)[:, None]
        packed = pack_padded_sequence(self.embed(tokens), lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, (h_n, _) = self.lstm(packed)
        h_s = torch.maximum(h_n[0], h_n[1])  # §3.1: element-wise max of the final forward/backward states
        result: dict[str, Tensor] = {"h_S": h_s, "mask": mask}
        if self.attention is None:
            result["h"] = h_s
            return result
        states, _ = pad_packed_sequence(out, batch_first=True, total_length=t)  # (B, T, 2 d_h)
        fwd, bwd = states.split(self.hidden_size, dim=-1)
        states = torch.maximum(fwd, bwd) if self.state_merge == "max" else states
        h_a, attn = self.attention(states, mask)
        result.update(h_A=h_a, attention=attn, h=torch.cat([h_a, h_s], dim=-1))  # h = [h_A ; h_S]
        return result

    # -- heads ----------------------------------------------------------------------------------------

    def predict_image(self, h: Tensor) -> Tensor:
        """h̃_I: the representation projected into the image-feature space (§3.2)."""
        if self.image_head is None:
            raise ConfigError(f"this encoder was trained with objective {self.objective} and has no image head")
        return self.image_head(h)

    def decode_teacher_forced(self, h: Tensor, targets: Tensor) -> Tensor:
        """Logits (B, T-1, V) of ``targets[:, 1:]`` given ``targets[:, :-1]`` (BOS w1 .. EOS PAD..), §3.1."""
        if self.decoder is None:
            raise ConfigError(f"this encoder was trained with objective {self.objective} and has no caption decoder")
        h0 = torch.tanh(self.decoder_init(h))[None]
        out, _ = self.decoder(self.embed(targets[:, :-1]), (h0, torch.zeros_like(h0)))
        return self.decoder_out(out)

    @torch.no_grad()
    def generate(self, h: Tensor, max_len: int = 20) -> Tensor:
        """Greedy decoding of a caption from h (for inspection): (B, ≤max_len) ids, EOS then PAD."""
        if self.decoder is None:
            raise ConfigError(f"this encoder was trained with objective {self.objective} and has no caption decoder")
        h0 = torch.tanh(self.decoder_init(h))[None]
        state = (h0, torch.zeros_like(h0))
        word = torch.full((h.shape[0], 1), BOS, dtype=torch.int64, device=h.device)
        done = torch.zeros(h.shape[0], dtype=torch.bool, device=h.device)
        out = []
        for _ in range(max_len):
            o, state = self.decoder(self.embed(word), state)
            word = self.decoder_out(o).argmax(-1)
            word = torch.where(done[:, None], torch.full_like(word, PAD), word)
            out.append(word)
            done |= word[:, 0] == EOS
            if bool(done.all()):
                break
        return torch.cat(out, 1)


def sentence_tensor(sentences: list[list[int]], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Word-id lists (no BOS/EOS) -> (tokens (B, T) = words, EOS, PAD..; lengths (B,) = words + 1)."""
    lengths = torch.tensor([len(s) + 1 for s in sentences], dtype=torch.int64)
    tokens = torch.full((len(sentences), int(lengths.max()) if len(sentences) else 1), PAD, dtype=torch.int64)
    for i, s in enumerate(sentences):
        tokens[i, : len(s)] = torch.tensor(s, dtype=torch.int64)
        tokens[i, len(s)] = EOS
    return tokens.to(device), lengths.to(device)


def build_sentence_encoder(vocab_size: int, image_dim: int, **overrides: Any) -> SentenceEncoder:
    """The encoder with configs/models/sentence_encoder.yaml's hyperparameters and ``overrides``."""
    cfg = encoder_config(overrides)
    return SentenceEncoder(vocab_size=vocab_size, image_dim=image_dim, **cfg.to_dict())
