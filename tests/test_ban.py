"""BAN captioner (docs/models.md#ban): exact parameter counts of the BAN blocks, weight normalisation, the bilinear
attention map, and the causal glimpses + residual learning against a per-prefix loop implementation."""

from __future__ import annotations

import pytest
import torch

import models
from models.captioners.ban import BANCaptioner
from models.layers.bilinear import BilinearAttentionMap, BilinearPooling, FCLayer, WNLinear
from pipeline.core.errors import ConfigError
from pipeline.core.vocab import BOS


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_block_parameter_counts_match_ban_exactly() -> None:
    """The VQA model of jnhwkim/ban-vqa at its defaults (num_hid 1280, v_dim 2048, k = 3, 8 glimpses, 3129 answers)."""
    with torch.device("meta"):
        assert count(BilinearAttentionMap(2048, 1280, 1280, glimpses=8, k=3)) == 12_817_931
        assert count(BilinearPooling(2048, 1280, 1280)) == 4_262_402
        assert count(FCLayer(1280, 1280, relu=False)) == 1_639_681
        classifier = torch.nn.Sequential(WNLinear(1280, 2560), WNLinear(2560, 3129))
        assert count(classifier) == 11_292_731
        model = models.build_captioner("ban", 3129, use_mean_feat=False)
        assert count(model.gru) == 7_226_880  # GRU 600 -> 1280
    # the whole captioner = BAN (90,618,566 at ntoken 19,901) without its two 300-d tables (11,941,200),
    # counter projections (8 x 15,361) and counter (272), plus one 600-d table for our vocabulary
    expected = 90_618_566 - 11_941_200 - 8 * 15_361 - 272 + 600 * 3129
    print(f"ban captioner at V=3129 without the mean feature: {count(model):,} parameters (expected {expected:,})")
    assert count(model) == expected == 80_431_606
    with torch.device("meta"):
        paper = models.build_captioner("ban", 10201)
    print(f"ban captioner (config) at V=10201: {count(paper):,} parameters")
    assert count(paper) == expected - 600 * 3129 + 600 * 10201 + 3 * 2048 * 1280 + (10201 - 3129) * 2561


def test_weight_norm_uses_one_scalar_gain() -> None:
    torch.manual_seed(0)
    lin = WNLinear(4, 3)
    assert lin.weight_g.numel() == 1  # dim=None
    torch.manual_seed(0)
    base = torch.nn.Linear(4, 3)  # same random stream as inside WNLinear
    torch.testing.assert_close(lin.weight, base.weight)  # at init W equals the default Linear init
    x = torch.randn(2, 4)
    with torch.no_grad():
        lin.weight_g.mul_(3.0)
        lin.weight_v.mul_(7.0)  # the direction's norm does not matter
    torch.testing.assert_close(lin(x) - lin.bias, 3.0 * (x @ base.weight.T), atol=1e-6, rtol=0)


def test_bilinear_attention_logits_equation() -> None:
    """logits[g, i, j] = sum_k H[g, k] X'[i, k] Y'[j, k] + b_g, H weight-normed with one scalar."""
    torch.manual_seed(1)
    att = BilinearAttentionMap(5, 4, 3, glimpses=2, k=2, dropout=0.0, dropout_v=0.0)
    v, q = torch.randn(1, 3, 5), torch.randn(1, 4, 4)
    vp, qp = att.project_v(v), att.project_q(q)
    torch.testing.assert_close(vp, torch.relu(v @ att.v_net.linear.weight.T + att.v_net.linear.bias))
    h = att.h_mat_g * att.h_mat_v / att.h_mat_v.norm()
    got = att.logits(vp, qp)
    assert got.shape == (1, 2, 3, 4)
    for g in range(2):
        for i in range(3):
            for j in range(4):
                want = (h[g] * vp[0, i] * qp[0, j]).sum() + att.h_bias[g]
                torch.testing.assert_close(got[0, g, i, j], want, atol=1e-6, rtol=0)


def tiny(**kw) -> BANCaptioner:
    torch.manual_seed(2)
    args = dict(vocab_size=9, feat_dim=5, d_model=6, glimpses=3, k=2, word_dim=4, d_ff=7)
    args.update(kw)
    return BANCaptioner(**args).eval()


def reference_logprobs(model: BANCaptioner, feats, mask, caps) -> torch.Tensor:
    """BAN glimpses written out per prefix: one softmax over the flattened (real region, j <= t) grid per glimpse,
    bilinear pooling with the residually updated states, update of position t."""
    feats = feats * mask[..., None]
    mean = feats.sum(1) / mask.sum(1, keepdim=True)
    words = model.embed(caps)
    gru_in = torch.cat([words, mean[:, None].expand(-1, caps.shape[1], -1)], -1) if model.use_mean_feat else words
    q0, _ = model.gru(gru_in)
    h = model.attention.h_mat
    out = torch.zeros(caps.shape[0], caps.shape[1], model.vocab_size)
    for b in range(caps.shape[0]):
        real = mask[b].nonzero()[:, 0]
        xp = model.attention.project_v(feats[b, real])  # X'  (n, K')
        yp = model.attention.project_q(q0[b])  # Y'  (T, K')
        states = [q0[b]]  # states[g][j] = q^g_j
        for g in range(model.glimpses):
            states.append(torch.zeros_like(q0[b]))
        for t in range(caps.shape[1]):
            for g in range(model.glimpses):
                logits = (
                    torch.stack(
                        [torch.stack([(h[g] * xp[i] * yp[j]).sum() for j in range(t + 1)]) for i in range(len(real))]
                    )
                    + model.attention.h_bias[g]
                )
                a = torch.softmax(logits.flatten(), 0).view_as(logits)  # joint over regions x prefix
                x2 = model.pools[g].v_net(feats[b, real])  # X''
                y2 = model.pools[g].q_net(states[g][: t + 1])  # Y'' from the updated states
                f = torch.einsum("ik,ij,jk->k", x2, a, y2)
                states[g + 1][t] = states[g][t] + model.q_prj[g](f)
            final = states[-1][: t + 1]
            r = {"last": final[t], "sum": final.sum(0), "mean": final.mean(0)}[model.readout]
            out[b, t] = torch.log_softmax(model.classifier(r), -1)
    return out


@pytest.mark.parametrize("readout", ["last", "sum", "mean"])
@pytest.mark.parametrize("use_mean_feat", [True, False])
def test_causal_glimpses_match_per_prefix_computation(readout: str, use_mean_feat: bool) -> None:
    model = tiny(readout=readout, use_mean_feat=use_mean_feat)
    g = torch.Generator().manual_seed(3)
    feats = torch.rand(2, 4, 5, generator=g) * 3
    mask = torch.tensor([[True, True, True, True], [True, False, True, False]])
    caps = torch.randint(4, 9, (2, 5), generator=g)
    caps[:, 0] = BOS
    with torch.no_grad():
        got = model(feats, mask, torch.zeros(2, 4, 4), torch.ones(2, 2), caps)
        want = reference_logprobs(model, feats, mask, caps)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_glimpses_are_residual_and_all_used() -> None:
    """Each glimpse adds to the states; removing the last glimpse's contribution changes the output."""
    model = tiny()
    g = torch.Generator().manual_seed(4)
    feats, mask = torch.rand(1, 4, 5, generator=g), torch.ones(1, 4, dtype=torch.bool)
    caps = torch.tensor([[BOS, 5, 6, 7]])
    with torch.no_grad():
        a = model(feats, mask, torch.zeros(1, 4, 4), torch.ones(1, 2), caps)
        model.q_prj[-1].linear.weight_g.zero_()
        model.q_prj[-1].linear.bias.zero_()
        b = model(feats, mask, torch.zeros(1, 4, 4), torch.ones(1, 2), caps)
    assert (a - b).abs().max() > 1e-4


def test_bad_readout_is_rejected() -> None:
    with pytest.raises(ConfigError, match="readout"):
        tiny(readout="first")


def test_docstring_documents_design_and_equations() -> None:
    import models.captioners.ban as ban
    import models.layers.bilinear as bilinear

    assert "Design choice" in ban.__doc__ and "causal" in ban.__doc__
    assert "Residual" in ban.__doc__ and "Bilinear attention map" in bilinear.__doc__
