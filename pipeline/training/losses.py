"""Cross-entropy with label smoothing over padded caption batches.

Implements AoANet's label-smoothed loss (husthuaan/AoANet ``misc/utils.py``; docs/models.md#scst-and-cider-d):
the target distribution puts ``1 - eps`` on the ground-truth word and ``eps / (V - 1)`` on each of the other V - 1
classes; the per-token loss is KL(target || model) = sum_c q_c (log q_c - log p_c), averaged over the
non-padding target tokens. With ``eps = 0`` it is exactly the masked negative log-likelihood (M2, SAN).

The KL form differs from "cross-entropy against the smoothed target" only by the constant entropy of the
target (same gradients); we keep KL so that the value is >= 0 and equals the NLL at eps = 0.
"""

from __future__ import annotations

import math

import torch

from pipeline.core.vocab import PAD


def _xlogx(x: float) -> float:
    return x * math.log(x) if x > 0 else 0.0


def label_smoothed_nll(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    smoothing: float = 0.0,
    pad_id: int = PAD,
    reduction: str = "mean",
) -> torch.Tensor:
    """Label-smoothed NLL of ``targets`` under ``log_probs``, ignoring padding.

    Args:
        log_probs: (..., V) log-probabilities (log-softmax output), any float dtype (computed in float32).
        targets: (...) target ids; positions equal to ``pad_id`` are ignored.
        smoothing: eps in [0, 1); 0.2 for AoANet, 0.1 for X-Transformer, 0 for M2 / NG-SAN.
        pad_id: the padding id.
        reduction: ``"mean"`` (over non-padding tokens; 0 if there are none), ``"sum"`` or ``"none"``
            (per-token losses, 0 at padding).
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"label smoothing must be in [0, 1), got {smoothing}")
    if log_probs.shape[:-1] != targets.shape:
        raise ValueError(f"log_probs {tuple(log_probs.shape)} and targets {tuple(targets.shape)} do not match")
    vocab = log_probs.shape[-1]
    lp = log_probs.float()
    mask = targets != pad_id
    safe_targets = targets.masked_fill(~mask, 0).long()
    target_lp = lp.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)
    if smoothing > 0.0:
        if vocab < 2:
            raise ValueError("label smoothing needs at least two classes")
        other = smoothing / (vocab - 1)
        entropy_term = _xlogx(1.0 - smoothing) + (vocab - 1) * _xlogx(other)  # sum_c q_c log q_c
        loss = entropy_term - (1.0 - smoothing) * target_lp - other * (lp.sum(-1) - target_lp)
    else:
        loss = -target_lp
    loss = loss * mask
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / mask.sum().clamp(min=1)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
