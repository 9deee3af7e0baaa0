"""Label-smoothed NLL against an explicit target distribution and torch's KL / NLL losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.training.losses import label_smoothed_nll


def _batch(seed: int = 0, n: int = 3, t: int = 5, v: int = 7):
    g = torch.Generator().manual_seed(seed)
    log_probs = torch.log_softmax(torch.randn(n, t, v, generator=g), dim=-1)
    targets = torch.randint(1, v, (n, t), generator=g)
    targets[0, 3:] = 0  # padding
    targets[2, 1:] = 0
    return log_probs, targets


def test_no_smoothing_equals_masked_nll() -> None:
    lp, y = _batch()
    expected = F.nll_loss(lp.reshape(-1, lp.shape[-1]), y.reshape(-1), ignore_index=0)
    assert label_smoothed_nll(lp, y, 0.0).item() == pytest.approx(expected.item(), rel=1e-6)


def test_smoothing_equals_kl_to_explicit_target_distribution() -> None:
    lp, y = _batch(1)
    eps, v = 0.2, lp.shape[-1]
    q = torch.full(lp.shape, eps / (v - 1))
    q.scatter_(-1, y.unsqueeze(-1), 1 - eps)
    kl = F.kl_div(lp, q, reduction="none").sum(-1)  # sum_c q (log q - log p)
    mask = y != 0
    expected = (kl * mask).sum() / mask.sum()
    got = label_smoothed_nll(lp, y, eps)
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    per_token = label_smoothed_nll(lp, y, eps, reduction="none")
    assert torch.allclose(per_token, kl * mask, atol=1e-6)
    assert label_smoothed_nll(lp, y, eps, reduction="sum").item() == pytest.approx((kl * mask).sum().item(), rel=1e-5)


def test_hand_computed_two_class_case() -> None:
    """V=2, eps=0.2: q = (0.8, 0.2); p = (0.5, 0.5): KL = 0.8 ln 1.6 + 0.2 ln 0.4."""
    lp = torch.log(torch.tensor([[[0.5, 0.5]]]))
    y = torch.tensor([[0]])
    got = label_smoothed_nll(lp, y, 0.2, pad_id=-1)
    assert got.item() == pytest.approx(0.8 * math.log(1.6) + 0.2 * math.log(0.4), abs=1e-6)


def test_padding_is_ignored_in_value_and_gradient() -> None:
    lp, y = _batch(2)
    logits = torch.randn(lp.shape, requires_grad=True)
    loss = label_smoothed_nll(torch.log_softmax(logits, -1), y, 0.1)
    loss.backward()
    assert torch.all(logits.grad[y == 0] == 0)
    assert logits.grad[y != 0].abs().sum() > 0
    # changing the predictions at padded positions does not change the loss
    lp2 = lp.clone()
    lp2[y == 0] = torch.log_softmax(torch.randn(int((y == 0).sum()), lp.shape[-1]), -1)
    assert label_smoothed_nll(lp2, y, 0.1).item() == pytest.approx(label_smoothed_nll(lp, y, 0.1).item(), rel=1e-6)


def test_all_padding_gives_zero_and_bad_args_raise() -> None:
    lp, y = _batch()
    assert label_smoothed_nll(lp, torch.zeros_like(y), 0.1).item() == 0.0
    with pytest.raises(ValueError, match="smoothing"):
        label_smoothed_nll(lp, y, 1.0)
    with pytest.raises(ValueError, match="do not match"):
        label_smoothed_nll(lp, y[:, :2], 0.1)
    with pytest.raises(ValueError, match="reduction"):
        label_smoothed_nll(lp, y, 0.1, reduction="avg")
