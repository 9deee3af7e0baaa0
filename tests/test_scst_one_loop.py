"""SCST's samples and greedy baseline in one decoding loop (models.decoding.sample_with_greedy,
models.layers.row_dropout) against the two loops the step ran before (``baseline_loop: separate``, kept as the
reference path): same seed, dropout on, CPU fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.core.vocab import EOS
from tests.test_scst_step import _batch, _scorer_and_vocab, _tiny


def _tiny_any(name: str):
    if name != "ban":
        return _tiny(name)
    import models

    torch.manual_seed(0)
    model = models.build_captioner("ban", 40, feat_dim=24, d_model=32, glimpses=2, word_dim=16, d_ff=48)
    step, bias = model.step, torch.zeros(40)
    bias[EOS] = 1.3

    def eos_biased_step(tokens, enc, state):
        logp, state = step(tokens, enc, state)
        return torch.log_softmax(logp + bias.to(logp.device), -1), state

    model.step = eos_biased_step
    return model


def _scst(model, joint: bool, monkeypatch) -> dict:
    from pipeline.training import scst_step

    scorer, vocab = _scorer_and_vocab()
    seen: dict = {"samples": [], "greedy": [], "steps": 0}
    real_rewards, real_scores, real_step = scst_step.sample_rewards, scorer.scores, model.step
    monkeypatch.setattr(
        scst_step, "sample_rewards", lambda sc, words, *a: seen["samples"].append(words) or real_rewards(sc, words, *a)
    )
    monkeypatch.setattr(scorer, "scores", lambda words, keys: seen["greedy"].append(words) or real_scores(words, keys))

    def counted(*a):
        seen["steps"] += 1
        return real_step(*a)

    model.step = counted
    model.zero_grad(set_to_none=True)
    model.train()
    torch.manual_seed(11)
    batch = _batch()
    base = None if joint else scst_step.greedy_rewards(model, batch, scorer, vocab, 9)
    out = scst_step.scst_loss(
        model,
        batch,
        scorer,
        vocab,
        method="sample",
        num_samples=3,
        max_len=9,
        baseline="greedy",
        normalize="tokens",
        baseline_rewards=base,
    )
    out.loss_sum.backward()
    model.step = real_step
    monkeypatch.undo()
    seen.update(
        loss=out.loss_sum.detach(),
        numbers=(out.count, out.reward, out.baseline_reward),
        after=torch.rand(4),
        grads=[p.grad.clone() for p in model.parameters() if p.grad is not None],
    )
    return seen


@pytest.mark.parametrize("name", ["ngsan", "aoa", "ban"])
def test_one_loop_equals_the_two_loops(name, monkeypatch) -> None:
    """Sampled and greedy captions, rewards, baseline and loss bitwise equal; the random stream left where the two
    loops leave it; gradients equal to float rounding (extra zero rows in the weight-gradient sums); fewer steps."""
    model = _tiny_any(name)
    joint, separate = _scst(model, True, monkeypatch), _scst(model, False, monkeypatch)
    assert joint["samples"] == separate["samples"] and len(joint["samples"][0]) == 6 * 3
    # every scorer call (greedy captions first, then the samples), in the same order
    assert joint["greedy"] == separate["greedy"] and len(joint["greedy"][0]) == 6
    lengths = {len(w) for w in joint["samples"][0] + joint["greedy"][0]}
    assert len(lengths) > 2, lengths  # captions of varied lengths: rows leave the joint batch at different steps
    assert torch.equal(joint["loss"], separate["loss"]) and joint["numbers"] == separate["numbers"]
    assert torch.equal(joint["after"], separate["after"])
    assert len(joint["grads"]) == len(separate["grads"]) > 0
    for a, b in zip(joint["grads"], separate["grads"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert joint["steps"] < separate["steps"], (joint["steps"], separate["steps"])


def test_row_dropout_drops_the_leading_rows_with_the_random_numbers_of_their_own_tensor() -> None:
    from models.layers.row_dropout import Dropout, dropout_rows

    x = torch.rand(7, 3, 5) + 1
    torch.manual_seed(4)
    alone = F.dropout(x[:4], 0.3)
    layer = Dropout(0.3).train()
    torch.manual_seed(4)
    with dropout_rows(4, 7):
        split = layer(x)
    assert torch.equal(split[:4], alone) and torch.equal(split[4:], x[4:]) and not torch.equal(alone, x[:4])
    with dropout_rows(0, 7):
        assert torch.equal(layer(x), x)
    with dropout_rows(4, 7), pytest.raises(RuntimeError, match="dim 0 must be the batch"):
        layer(x[:5])
    assert (layer(x)[4:] == 0).any() and (layer.eval()(x) == x).all()  # outside the block: every row, as nn.Dropout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_row_dropout_in_half_types_scales_in_float32_and_rounds_once(dtype) -> None:
    """Under autocast the kept activations are x / (1 - p) rounded once, as F.dropout's kernels give them (its
    float32 scale), not x times a scale already rounded to the half type (1.109375 for p = 0.1 in bf16)."""
    from models.layers.row_dropout import dropout, dropout_rows

    x = (torch.rand(6, 64) + 1).to(dtype)
    with dropout_rows(4, 6):
        y = dropout(x, 0.1)
    kept = y[:4] != 0
    want = (x.float() / 0.9).to(dtype)
    assert y.dtype == dtype and kept.any() and torch.equal(y[:4][kept], want[:4][kept])
    assert torch.equal(y[4:], x[4:])
    assert not torch.equal(
        (x * torch.tensor(1 / 0.9, dtype=dtype))[:4][kept], want[:4][kept]
    )  # the rounded scale differs


def test_baseline_loop_is_a_recipe_key_joint_by_default() -> None:
    from pipeline.core.errors import ConfigError
    from pipeline.training.recipe import stage_recipe

    base = {"lr": 1e-5, "lr_schedule": "constant"}
    assert stage_recipe("scst", {}, base, 1, "t").baseline_loop == "joint"
    assert stage_recipe("scst", {}, {**base, "baseline_loop": "separate"}, 1, "t").baseline_loop == "separate"
    with pytest.raises(ConfigError, match="baseline_loop"):
        stage_recipe("scst", {}, {**base, "baseline_loop": "both"}, 1, "t")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["ngsan", "aoa", "ban"])
def test_one_loop_on_cuda(name) -> None:
    """On CUDA (other random numbers than CPU): the joint step runs (attention dropout leaves the fused kernel inside a
    split), its greedy rows take no dropout, the loss and gradients are finite."""
    from models.layers.row_dropout import Dropout, dropout_rows
    from pipeline.training import scst_step

    x = torch.rand(7, 3, 5, device="cuda") + 1
    with dropout_rows(4, 7):
        y = Dropout(0.5).train()(x)
    assert torch.equal(y[4:], x[4:]) and not torch.equal(y[:4], x[:4])
    model = _tiny_any(name).cuda().train()
    scorer, vocab = _scorer_and_vocab()
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in _batch().items()}
    out = scst_step.scst_loss(
        model, batch, scorer, vocab, method="sample", num_samples=3, max_len=9, baseline="greedy", normalize="tokens"
    )
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and all(
        torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None
    )
