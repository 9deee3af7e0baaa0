"""``optimizer_impl``: the stage's optimizer as PyTorch's multi-tensor kernels (``foreach``, the default, today's
numbers) or its one fused kernel (``fused``, an opt-in: one operator per update instead of ~15 plus two host reads
of the step count per parameter tensor; the same formula in other float rounding)."""

from __future__ import annotations

import pytest
import torch

from bench.proxies import count
from pipeline.core.errors import ConfigError
from pipeline.training.engine import build_optimizer
from pipeline.training.recipe import stage_recipe


def _recipe(**over):
    return stage_recipe("xe", {"xe": {"lr": 1e-3, "lr_schedule": "constant", **over}}, None, 1, "test")


def test_the_key_is_validated_and_builds_the_named_kernel() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert _recipe().optimizer_impl == "foreach"
    assert build_optimizer(_recipe(), p).defaults["foreach"] is True
    fused = build_optimizer(_recipe(optimizer_impl="fused"), p)
    assert fused.defaults["fused"] is True and not fused.defaults.get("foreach")
    assert build_optimizer(_recipe(optimizer="sgd", optimizer_impl="fused"), p).defaults["fused"] is True
    with pytest.raises(ConfigError, match=r"xe\.optimizer_impl: fused: PyTorch has no fused adamax"):
        _recipe(optimizer="adamax", optimizer_impl="fused")
    with pytest.raises(ConfigError, match=r"optimizer_impl must be one of foreach, fused, got 'apex'"):
        _recipe(optimizer_impl="apex")


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_a_fused_update_is_the_foreach_update_to_rounding_in_one_operator(optimizer: str) -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (16, 16, 3), (7,)] * 10
    init = [torch.randn(s, generator=g) * 0.05 for s in shapes]
    grads = [
        [torch.randn(s, generator=g) * 10.0 ** float(torch.randint(-8, 0, (1,), generator=g)) for s in shapes]
        for _ in range(3)
    ]
    lr = 1e-3
    weights, ops = {}, {}
    for impl in ("foreach", "fused"):
        params = [torch.nn.Parameter(w.clone()) for w in init]
        opt = build_optimizer(_recipe(optimizer=optimizer, weight_decay=0.01, optimizer_impl=impl), params)
        for group in opt.param_groups:
            group["lr"] = lr
        for step_grads in grads:
            for p, gr in zip(params, step_grads):
                p.grad = gr.clone()
            ops[impl] = count(opt.step)["operators"]
        weights[impl] = params
    # Adam's update m / (sqrt(v) + eps) does not scale with the gradient: where a gradient is at rounding level the
    # other rounding can flip its sign, up to 2 lr per step (3 steps here): every weight within 6 lr of foreach's.
    for a, b, w0 in zip(weights["foreach"], weights["fused"], init):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=6 * lr)
        assert not torch.equal(a.detach(), w0)
    same = sum(int(torch.equal(a, b)) for a, b in zip(weights["foreach"], weights["fused"]))
    assert ops["fused"] <= 3 and ops["foreach"] >= 2 * len(shapes), ops  # foreach reads each tensor's step count twice
    assert same < len(shapes)  # it is another kernel: not bitwise, hence an opt-in
