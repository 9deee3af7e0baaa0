"""SCST rewards and baselines against hand computation, with a real CiderD scorer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.metrics.cider import CiderD
from pipeline.training.scst import (
    advantages,
    greedy_advantages,
    mean_advantages,
    mean_of_others_advantages,
    policy_gradient_loss,
    sample_rewards,
)

REWARDS = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 6.0]])


def test_greedy_baseline_by_hand() -> None:
    adv = greedy_advantages(REWARDS, np.array([2.0, 1.0]))
    assert adv.tolist() == [[-1.0, 0.0, 1.0], [-1.0, -1.0, 5.0]]


def test_mean_of_others_by_hand() -> None:
    # image 0: baselines (2+3)/2, (1+3)/2, (1+2)/2 = 2.5, 2, 1.5 ; image 1: 3, 3, 0
    adv = mean_of_others_advantages(REWARDS)
    assert adv.tolist() == [[-1.5, 0.0, 1.5], [-3.0, -3.0, 6.0]]
    # it is k/(k-1) times the mean-baseline advantage
    assert np.allclose(adv, mean_advantages(REWARDS) * 3 / 2)
    with pytest.raises(ValueError, match="k >= 2"):
        mean_of_others_advantages(np.ones((2, 1)))


def test_mean_of_beams_by_hand() -> None:
    adv = mean_advantages(REWARDS)
    assert adv.tolist() == [[-1.0, 0.0, 1.0], [-2.0, -2.0, 4.0]]
    assert np.allclose(adv.sum(axis=1), 0.0)


def test_dispatch_and_errors() -> None:
    assert np.array_equal(advantages(REWARDS, "mean"), mean_advantages(REWARDS))
    assert np.array_equal(advantages(REWARDS, "mean_of_others"), mean_of_others_advantages(REWARDS))
    assert np.array_equal(advantages(REWARDS, "greedy", np.zeros(2)), REWARDS)
    with pytest.raises(ValueError, match="greedy decodes"):
        advantages(REWARDS, "greedy")
    with pytest.raises(ValueError, match="unknown SCST baseline"):
        advantages(REWARDS, "beam")


def test_rewards_from_cider_and_advantage_signs() -> None:
    refs = {
        10: [["a", "red", "circle", "on", "the", "left"], ["a", "red", "circle"], ["one", "red", "circle"]],
        20: [["two", "blue", "squares"], ["there", "are", "two", "blue", "squares"]],
        30: [["a", "green", "triangle"], ["one", "green", "triangle", "at", "the", "top"]],
    }
    scorer = CiderD(refs)
    samples = [
        ["a", "red", "circle"],
        ["a", "blue", "square"],
        ["a", "red", "circle", "on", "the", "left"],
        ["two", "blue", "squares"],
        ["a", "red", "circle"],
        ["blue", "squares"],
    ]
    rewards = sample_rewards(scorer, samples, [10, 20], per_image=3)
    assert rewards.shape == (2, 3)
    assert np.allclose(rewards.ravel(), scorer.scores(samples, [10, 10, 10, 20, 20, 20]))
    assert rewards[0, 1] < rewards[0, 0] and rewards[1, 1] < rewards[1, 0]  # wrong captions score lower
    greedy = scorer.scores([["a", "red", "circle"], ["two", "blue", "squares"]], [10, 20])
    adv = advantages(rewards, "greedy", greedy)
    assert adv[0, 0] == pytest.approx(0.0) and adv[1, 0] == pytest.approx(0.0)  # sample == greedy decode
    assert adv[0, 1] < 0 and adv[1, 1] < 0
    with pytest.raises(ValueError, match="3 samples per image"):
        sample_rewards(scorer, samples[:5], [10, 20], per_image=3)


def test_policy_gradient_loss_by_hand() -> None:
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = np.array([2.0, -1.0])
    # tokens: -(2*(-6) + (-1)*(-1)) / 5 = (12 - 1) / 5
    assert policy_gradient_loss(lp, mask, adv).item() == pytest.approx(11 / 5)
    # steps (M2): mean over samples of -(sum_t log p)/T * adv = ((12/3) + (-1/3)) / 2
    assert policy_gradient_loss(lp, mask, adv, "steps").item() == pytest.approx((4 - 1 / 3) / 2)
    loss = policy_gradient_loss(lp, mask, adv)
    loss.backward()
    # d/d logp = -adv * mask / 5: positive advantage pushes log-probs up (negative gradient)
    assert torch.allclose(lp.grad, torch.tensor([[-0.4, -0.4, -0.4], [0.2, 0.2, 0.0]]))
    with pytest.raises(ValueError, match="advantages for"):
        policy_gradient_loss(lp, mask, np.ones(3))
    with pytest.raises(ValueError, match="normalize"):
        policy_gradient_loss(lp, mask, adv, "batch")
