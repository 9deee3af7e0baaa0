"""Cross-entropy (teacher forcing) for one batch: every caption of an image decoded from ONE encoder pass.

``Captioner.forward`` encodes the ``B`` images once and expands the encoder state to the ``C`` captions
with ``caption_image`` (no 5x re-encoding). Inputs are ``captions[:, :-1]`` (BOS w1 .. wn EOS ...), targets
``captions[:, 1:]``; padding targets are ignored. The loss is the label-smoothed NLL of
:mod:`pipeline.training.losses` (AoANet's KL form; plain NLL at eps = 0), returned as a *sum* with its
token count so that the caller can normalise over the global (multi-process) batch.

Scheduled sampling (Bengio et al. 2015, as in AoANet / ruotianluo ``ss_prob``): with probability ``p``
per caption and step t >= 1, the input word is drawn from the model's own (detached) distribution of the
previous step instead of the ground truth. It needs step-by-step decoding (``init_state``/``step``), so it
runs only when ``p > 0``.
"""

from __future__ import annotations

from typing import Any

import torch

from models.captioners.base import Captioner, index_state
from models.decoding import draw
from pipeline.training.losses import label_smoothed_nll
from pipeline.core.vocab import PAD


def scheduled_sampling_log_probs(
    model: Captioner, batch: dict[str, Any], inputs: torch.Tensor, prob: float
) -> torch.Tensor:
    """``(C, T, V)`` log-probs where each input word (t >= 1) is replaced by a model sample with prob ``prob``."""
    enc = model.encode(batch["feats"], batch["mask"], batch["boxes"], batch["sizes"])
    enc = index_state(enc, batch["caption_image"])
    state = model.init_state(enc)
    outs: list[torch.Tensor] = []
    for t in range(inputs.shape[1]):
        tokens = inputs[:, t]
        if t >= 1 and prob > 0:
            use = torch.rand(tokens.shape[0], device=tokens.device) < prob
            if bool(use.any()):
                with torch.no_grad():
                    sampled = draw(outs[-1].detach().float().exp())  # = multinomial(p, 1) without its read-back
                tokens = torch.where(use & (tokens != PAD), sampled, tokens)
        logp, state = model.step(tokens, enc, state)
        outs.append(logp)
    return torch.stack(outs, 1)


def xe_loss_sum(
    model: Captioner, batch: dict[str, Any], smoothing: float = 0.0, ss_prob: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed label-smoothed NLL over the batch's target tokens, number of target tokens)."""
    captions = batch["captions"]
    inputs, targets = captions[:, :-1], captions[:, 1:]
    if ss_prob > 0:
        logp = scheduled_sampling_log_probs(model, batch, inputs, ss_prob)
    else:
        logp = model(batch["feats"], batch["mask"], batch["boxes"], batch["sizes"], inputs, batch["caption_image"])
    loss = label_smoothed_nll(logp, targets, smoothing, reduction="sum")
    return loss, (targets != PAD).sum()
