"""One self-critical step (Rennie et al. 2017) with CIDEr-D rewards: samples, baseline, policy-gradient loss.

Samplers (``sample_method``):

``sample``
    ``k`` multinomial samples per image from one encoder pass (:func:`models.decoding.sample`; the token
    log-probabilities keep their graph). Loss: :func:`~pipeline.training.scst.policy_gradient_loss`,
    ``-(r - b) log p`` summed over tokens (``pg_normalize: tokens`` divides by the token count).
``beam``
    M2's beam search as the sampler (Cornia et al. 2020, §3.3): the ``k`` final beams of a beam search of
    width ``k``; their summed log-probabilities keep their graph. Loss (M2 ``train.py``):
    ``-mean_t log p * (r - b)`` = summed log-prob / T_max (``pg_normalize: steps``).

Baselines: ``greedy`` (a greedy decode in eval mode, no gradient), ``mean_of_others``, ``mean`` (M2's
mean of the beams), see :mod:`pipeline.training.scst`. Rewards are CIDEr-D on *words* with document
frequencies of the training references (:class:`pipeline.metrics.cider.CiderD` in ``corpus`` mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from models.captioners.base import Captioner
from models.decoding import DecodeOptions, beam_search, greedy, sample, sample_with_greedy
from pipeline.metrics.cider import CiderD
from pipeline.training.scst import advantages, policy_gradient_loss, sample_rewards
from pipeline.core.vocab import Vocab


@dataclass
class ScstOutput:
    loss_sum: torch.Tensor  # to be multiplied by world / global count (see distributed.global_mean_factor)
    count: float
    reward: float  # mean sample reward of this rank's batch
    baseline_reward: float  # mean greedy reward (greedy baseline) or mean baseline value


def token_words(tokens: torch.Tensor, vocab: Vocab) -> list[list[str]]:
    """Rows of generated ids (EOS/PAD-terminated) -> word lists."""
    return [vocab.decode(row) for row in tokens.tolist()]


def _eval_encode(model: Captioner, batch: dict[str, Any]) -> Any:
    """The encoder state of the batch in eval mode, without gradient (the greedy baseline's)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        enc = model.encode(batch["feats"], batch["mask"], batch["boxes"], batch["sizes"])
    model.train(was_training)
    return enc


def greedy_rewards(model: Captioner, batch: dict[str, Any], scorer: CiderD, vocab: Vocab, max_len: int) -> np.ndarray:
    """CIDEr-D of the greedy decode of each image (eval mode, no gradient): the self-critical baseline, in a loop
    of its own (:func:`scst_loss` decodes it with the samples in one loop)."""
    was_training = model.training
    enc = _eval_encode(model, batch)
    model.eval()
    with torch.no_grad():
        g = greedy(model, enc, DecodeOptions(method="greedy", max_len=max_len))
    model.train(was_training)
    return scorer.scores(token_words(g.tokens[:, 0], vocab), batch["keys"])


def scst_loss(
    model: Captioner,
    batch: dict[str, Any],
    scorer: CiderD,
    vocab: Vocab,
    *,
    method: str,
    num_samples: int,
    max_len: int,
    baseline: str,
    normalize: str,
    baseline_rewards: np.ndarray | None = None,
) -> ScstOutput:
    """Policy-gradient loss of one batch (``baseline_rewards``: the greedy rewards, for ``greedy``; without them the
    greedy baseline is decoded here, with multinomial samples in the samples' loop: :func:`~models.decoding.sample_with_greedy`)."""
    keys = batch["keys"]
    k = num_samples
    if baseline == "greedy" and baseline_rewards is None and method == "beam":
        baseline_rewards = greedy_rewards(model, batch, scorer, vocab, max_len)
    greedy_enc = _eval_encode(model, batch) if baseline == "greedy" and baseline_rewards is None else None
    enc = model.encode(batch["feats"], batch["mask"], batch["boxes"], batch["sizes"])
    if method == "beam":
        g = beam_search(model, enc, DecodeOptions(method="beam", beam_size=k, n_best=k, max_len=max_len))
    elif greedy_enc is not None:
        g, base_g = sample_with_greedy(model, enc, greedy_enc, DecodeOptions(method="sample", max_len=max_len), n=k)
        baseline_rewards = scorer.scores(token_words(base_g.tokens[:, 0], vocab), keys)
    else:
        g = sample(model, enc, DecodeOptions(method="sample", max_len=max_len), n=k)
    b, _, t = g.tokens.shape
    rewards = sample_rewards(scorer, token_words(g.tokens.reshape(b * k, t), vocab), keys, k)
    adv = torch.as_tensor(
        advantages(rewards, baseline, baseline_rewards).reshape(-1), dtype=torch.float32, device=g.tokens.device
    )
    if method == "beam" or normalize == "steps":
        logp = g.logprob.reshape(-1).float()
        loss_sum, count = -(adv * logp).sum() / max(t, 1), float(b * k)
    else:
        lp = g.token_logprobs.reshape(b * k, -1).float()
        mask = (torch.arange(lp.shape[1], device=lp.device)[None] < g.lengths.reshape(-1, 1)).float()
        count = float(mask.sum())
        loss_sum = policy_gradient_loss(lp, mask, adv, "tokens") * max(count, 1.0)
    base = (
        float(np.mean(baseline_rewards))
        if baseline_rewards is not None
        else float(np.mean(rewards - advantages(rewards, baseline)))
    )
    return ScstOutput(loss_sum, count, float(rewards.mean()), base)
