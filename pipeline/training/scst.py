"""Self-critical sequence training (SCST): CIDEr-D rewards, baselines and the policy-gradient loss.

Rewards are CIDEr-D (:class:`pipeline.metrics.cider.CiderD`, normally with document frequencies from the
training references) of each sampled caption against its image's references. The gradient of the
expected reward is estimated with a baseline b (Rennie et al. 2017, Eq. 7-9):
``grad L = -(r(w^s) - b) * grad log p(w^s)``. Baselines (``baseline`` in the SCST config):

``greedy``
    b = reward of the greedy decode of the same image (Rennie et al., the original SCST; AoANet, X-LAN).
``mean_of_others``
    b_i = (sum_j r_j - r_i) / (k - 1) over the k samples of the same image ("new self-critical",
    ruotianluo ``StructureLosses``; needs k >= 2).
``mean``
    b = mean of the k rewards of the image, sample i included (M2: the k beams of beam search,
    aimagelab/meshed-memory-transformer ``train.py``).

Everything here is a pure function of arrays; the training loop draws the samples.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from pipeline.metrics.cider import CiderD

BASELINES = ("greedy", "mean_of_others", "mean")


def sample_rewards(scorer: CiderD, samples: Any, image_ids: Sequence[Hashable], per_image: int) -> np.ndarray:
    """CIDEr-D of ``len(image_ids) * per_image`` samples laid out image-major -> (images, per_image).

    ``samples`` are token lists or a 2-D token-id array/tensor (see :meth:`CiderD.scores`); sample
    ``i * per_image + j`` is the j-th sample of ``image_ids[i]``.
    """
    num = len(samples) if not hasattr(samples, "shape") else int(samples.shape[0])
    if num != len(image_ids) * per_image:
        raise ValueError(f"{num} samples for {len(image_ids)} images x {per_image} samples per image")
    flat_ids = [i for i in image_ids for _ in range(per_image)]
    return scorer.scores(samples, flat_ids).reshape(len(image_ids), per_image)


def greedy_advantages(rewards: np.ndarray, greedy_rewards: np.ndarray) -> np.ndarray:
    """r_ij - r_i(greedy): (images, k) advantages against the greedy decode of each image."""
    rewards = np.asarray(rewards, dtype=np.float64)
    greedy_rewards = np.asarray(greedy_rewards, dtype=np.float64)
    if rewards.ndim != 2 or greedy_rewards.shape != (rewards.shape[0],):
        raise ValueError(
            f"rewards {rewards.shape} must be (images, k) and greedy rewards (images,), got {greedy_rewards.shape}"
        )
    return rewards - greedy_rewards[:, None]


def mean_of_others_advantages(rewards: np.ndarray) -> np.ndarray:
    """r_ij - (sum_l r_il - r_ij) / (k - 1): the "new self-critical" baseline."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"the mean-of-others baseline needs (images, k >= 2) rewards, got {rewards.shape}")
    k = rewards.shape[1]
    baseline = (rewards.sum(axis=1, keepdims=True) - rewards) / (k - 1)
    return rewards - baseline


def mean_advantages(rewards: np.ndarray) -> np.ndarray:
    """r_ij - mean_l r_il: M2's mean-of-beams baseline."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be (images, k), got {rewards.shape}")
    return rewards - rewards.mean(axis=1, keepdims=True)


def advantages(rewards: np.ndarray, baseline: str, greedy_rewards: np.ndarray | None = None) -> np.ndarray:
    """Advantages for ``baseline`` in :data:`BASELINES` ("greedy" needs ``greedy_rewards``)."""
    if baseline == "greedy":
        if greedy_rewards is None:
            raise ValueError("the greedy baseline needs the rewards of the greedy decodes")
        return greedy_advantages(rewards, greedy_rewards)
    if baseline == "mean_of_others":
        return mean_of_others_advantages(rewards)
    if baseline == "mean":
        return mean_advantages(rewards)
    raise ValueError(f"unknown SCST baseline {baseline!r} (known: {', '.join(BASELINES)})")


def policy_gradient_loss(
    token_log_probs: torch.Tensor,
    mask: torch.Tensor,
    advantage: torch.Tensor | np.ndarray,
    normalize: str = "tokens",
) -> torch.Tensor:
    """SCST loss -(r - b) * log p(w^s), for N sampled sequences of T steps.

    Args:
        token_log_probs: (N, T) log-probability of each sampled token.
        mask: (N, T) 1 for the tokens of the sample (words and its EOS), 0 after.
        advantage: (N,) r - b per sample (no gradient flows through it).
        normalize: ``"tokens"``: sum over all tokens divided by the number of tokens (ruotianluo);
            ``"steps"``: per sample the sum over its tokens divided by T, then the mean over samples
            (M2's ``-mean_t(log p) * (r - b)`` over the fixed number of decoding steps,
            aimagelab/meshed-memory-transformer ``train.py``).
    """
    if token_log_probs.shape != mask.shape or token_log_probs.ndim != 2:
        raise ValueError(
            f"token_log_probs {tuple(token_log_probs.shape)} and mask {tuple(mask.shape)} must both be (N, T)"
        )
    adv = torch.as_tensor(advantage, dtype=token_log_probs.dtype, device=token_log_probs.device).reshape(-1).detach()
    if adv.shape[0] != token_log_probs.shape[0]:
        raise ValueError(f"{adv.shape[0]} advantages for {token_log_probs.shape[0]} samples")
    mask = mask.to(token_log_probs.dtype)
    weighted = -token_log_probs * mask * adv[:, None]
    if normalize == "tokens":
        return weighted.sum() / mask.sum().clamp(min=1)
    if normalize == "steps":
        return (weighted.sum(dim=1) / token_log_probs.shape[1]).mean()
    raise ValueError(f"normalize must be 'tokens' or 'steps', got {normalize!r}")
