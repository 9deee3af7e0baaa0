"""Losses of the grounded sentence encoder (Yoo, Shin & Lee 2017 §3.1-3.4; docs/sentence_encoder.md).

Visual grounding, Eq. 1, with cosine similarity s(c, j) = cos(h̃_I of caption c, h_I of image j)::

    L_VG = log( 1 + Σ_{(h̃_I, h_I)} Σ_{(h̃'_I, h'_I) ∈ 𝒩} exp( s(h̃'_I, h'_I) − s(h̃_I, h_I) ) )

Negatives 𝒩 come from the same mini-batch: every (caption, image) pair of the batch whose image is not the
caption's own image. Two readings (``form``):

* ``batch`` (default, Eq. 1 as written): one log over the double sum of all positives x all negatives of
  the batch. Since Σ_p Σ_n exp(s_n − s_p) = (Σ_n exp s_n)(Σ_p exp(−s_p)), it is computed exactly as
  softplus(logsumexp(s_n) + logsumexp(−s_p)) in O(B^2).
* ``sample``: the log-sum-exp pairwise ranking loss of Li, Song & Luo 2017 applied per positive, with the
  negatives that share its caption, averaged: mean_c softplus(logsumexp_{j ≠ img(c)} s(c, j) − s(c, img(c))).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.core.errors import ConfigError
from pipeline.core.vocab import PAD

RANKING_FORMS = ("batch", "sample")


def cosine_matrix(pred: Tensor, images: Tensor, eps: float = 1e-8) -> Tensor:
    """(C, D) x (B, D) -> (C, B) cosine similarities."""
    return F.normalize(pred.float(), dim=-1, eps=eps) @ F.normalize(images.float(), dim=-1, eps=eps).T


def ranking_loss(sim: Tensor, caption_image: Tensor, form: str = "batch") -> Tensor:
    """L_VG (Eq. 1) from a (C, B) similarity matrix; ``caption_image`` (C,) is each caption's image column.

    Columns other than a caption's own image are its negatives; a batch without any negative gives 0.
    """
    if form not in RANKING_FORMS:
        raise ConfigError(f"ranking form must be batch or sample, not {form!r}")
    c, b = sim.shape
    pos_mask = torch.zeros_like(sim, dtype=torch.bool)
    pos_mask[torch.arange(c, device=sim.device), caption_image] = True
    pos = sim[pos_mask.nonzero(as_tuple=True)]  # (C,) in caption order
    neg = sim.masked_fill(pos_mask, float("-inf"))
    if b < 2:
        return sim.sum() * 0.0
    if form == "batch":
        return F.softplus(torch.logsumexp(neg.flatten(), 0) + torch.logsumexp(-pos, 0))
    return F.softplus(torch.logsumexp(neg, dim=1) - pos).mean()


def caption_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """L_C: mean token negative log-likelihood of ``targets[:, 1:]`` (PAD ignored), §3.1."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets[:, 1:].reshape(-1), ignore_index=PAD)
