"""The NG-SAN family (models/captioners/san.py): sizes from the paper, invariances, NSA statistics, GSA equations."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

import models
from models.layers.attention import MultiHeadAttention
from models.layers.geometry import GeometricBias, absolute_box_encoding, relative_geometry
from models.layers.normalization import LayerNorm, QueryNorm, masked_instance_norm
from pipeline.core.vocab import BOS

V = 23
FAMILY = ["san", "nsan", "gsan", "ngsan"]


def count(name: str, vocab: int = 9487, **overrides) -> int:
    with torch.device("meta"):  # no memory, no init cost: only the shapes
        model = models.build_captioner(name, vocab, **overrides)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("layers", "paper"), [(1, 18.1), (2, 25.5), (4, 40.2), (6, 54.9)])
def test_san_parameter_counts_match_table_1(layers: int, paper: float) -> None:
    n = count("san", num_layers=layers)
    print(f"san L={layers}: {n:,} parameters (paper {paper}M)")
    assert abs(n / 1e6 - paper) < 0.05
    assert count("nsan", num_layers=layers) == n  # NSA adds no parameters


def test_gsan_ngsan_parameter_counts_match_tables_4_and_6() -> None:
    for name in ("gsan", "ngsan"):
        n = count(name, num_layers=4)
        print(f"{name} L=4: {n:,} parameters (paper 41.5M)")
        assert abs(n / 1e6 - 41.5) < 0.05
    key = count("gsan", geometry=["key"])
    content = count("gsan", geometry=["content"])
    absolute = count("gsan", geometry=[], absolute_position=True)
    print(f"gsan key-dependent {key:,}, content-independent {content:,}, absolute {absolute:,}")
    assert abs(key / 1e6 - 41.5) < 0.05 and abs(content / 1e6 - 40.2) < 0.05 and abs(absolute / 1e6 - 40.2) < 0.05


def small(name: str, **extra) -> models.Captioner:
    torch.manual_seed(0)
    return models.build_captioner(name, V, d_model=64, num_heads=4, d_ff=128, num_layers=2, feat_dim=32, **extra).eval()


def batch(b: int = 3, n: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.rand(b, n, 32, generator=g)
    xy = torch.rand(b, n, 2, generator=g) * 150
    boxes = torch.cat([xy, xy + 5 + torch.rand(b, n, 2, generator=g) * 80], -1)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, 6:] = False
    mask[2, 3:] = False
    caps = torch.randint(4, V, (b, 7), generator=g)
    caps[:, 0] = BOS
    return feats, mask, boxes, torch.tensor([[300.0, 250.0]] * b), caps


@pytest.mark.parametrize("name", FAMILY)
def test_permuting_regions_changes_nothing(name: str) -> None:
    model = small(name)
    feats, mask, boxes, sizes, caps = batch()
    perm = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i)) for i in range(3)])

    def take(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            return torch.gather(x, 1, perm[..., None].expand(-1, -1, x.shape[-1]))
        return torch.gather(x, 1, perm)

    with torch.no_grad():
        a = model(feats, mask, boxes, sizes, caps)
        b = model(take(feats), take(mask), take(boxes), sizes, caps)
    assert not torch.equal(take(mask), mask)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_moving_a_box_changes_gsan_not_san() -> None:
    feats, mask, boxes, sizes, caps = batch()
    moved = boxes.clone()
    moved[0, 2] += torch.tensor([40.0, -20.0, 70.0, -5.0])
    for name, should_change in (("san", False), ("nsan", False), ("gsan", True), ("ngsan", True)):
        model = small(name)
        with torch.no_grad():
            a = model(feats, mask, boxes, sizes, caps)
            b = model(feats, mask, moved, sizes, caps)
        diff = float((a - b).abs().max())
        assert (diff > 1e-4) == should_change, f"{name}: max change {diff}"
        assert float((a[1:] - b[1:]).abs().max()) == 0.0  # other images untouched
    absolute = small("gsan", geometry=[], absolute_position=True)
    with torch.no_grad():
        assert (
            float((absolute(feats, mask, boxes, sizes, caps) - absolute(feats, mask, moved, sizes, caps)).abs().max())
            > 1e-4
        )


def test_mirroring_the_image_is_invisible_to_eq_8_but_not_to_signed_geometry() -> None:
    """Eq. 8 takes |dx|, |dy|: a left-right mirror of every box leaves G-SAN unchanged; geometry_signed sees it."""
    feats, mask, boxes, sizes, caps = batch()
    mirrored = boxes.clone()
    mirrored[..., 0], mirrored[..., 2] = 300.0 - boxes[..., 2], 300.0 - boxes[..., 0]
    for signed in (False, True):
        model = small("gsan", geometry_signed=signed)
        with torch.no_grad():
            diff = float(
                (model(feats, mask, boxes, sizes, caps) - model(feats, mask, mirrored, sizes, caps)).abs().max()
            )
        assert (diff > 1e-4) == signed, f"geometry_signed={signed}: max change {diff}"
    assert count("gsan", geometry_signed=True) - count("gsan") == 4 * 2 * 128  # two more inputs of Eq. 9's FC per layer


# --- NSA ------------------------------------------------------------------------------------------------


def test_masked_instance_norm_matches_direct_computation_and_ignores_padding() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, 5, generator=g) * 3 + 2
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    x = torch.where(mask[..., None], x, torch.randn(3, 6, 5, generator=g) * 100)  # loud padding
    y = masked_instance_norm(x, mask, eps=1e-5)
    for b in range(3):
        real = x[b, mask[b]]  # (n_b, C)
        mu = real.mean(0)
        var = ((real - mu) ** 2).mean(0)  # biased, per channel over the image's regions (Eq. 6)
        torch.testing.assert_close(y[b, mask[b]], (real - mu) / torch.sqrt(var + 1e-5), atol=1e-5, rtol=1e-5)
        ref = torch.nn.functional.instance_norm(real.T[None], eps=1e-5)[0].T  # PyTorch's IN on the real rows
        torch.testing.assert_close(y[b, mask[b]], ref, atol=1e-5, rtol=1e-5)
        assert torch.all(y[b, ~mask[b]] == 0)


def test_query_norm_variants() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    real = x[mask]  # (7, 4): all real regions of the batch
    bn = QueryNorm(4, "batch").train()
    out = bn(x, mask)
    mu, var = real.mean(0), real.var(0, unbiased=False)
    torch.testing.assert_close(out[mask], (real - mu) / torch.sqrt(var + 1e-5), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bn.running_mean, 0.1 * mu)
    ln = QueryNorm(4, "layer")
    torch.testing.assert_close(
        ln(x, mask)[mask], torch.nn.functional.layer_norm(real, (4,), eps=1e-5), atol=1e-5, rtol=1e-5
    )
    affine = QueryNorm(4, "instance", affine=True)
    with torch.no_grad():
        affine.weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        affine.bias.fill_(0.5)
    torch.testing.assert_close(affine(x, mask)[mask], (masked_instance_norm(x, mask) * affine.weight + 0.5)[mask])
    assert sum(p.numel() for p in QueryNorm(4).parameters()) == 0  # no gamma/beta by default


def test_nsan_normalizes_queries_only_with_padding_excluded() -> None:
    model = small("nsan")
    attn: MultiHeadAttention = model.encoder.layers[0].attn
    assert attn.query_norm is not None and attn.key_norm is None
    feats, mask, boxes, sizes, _ = batch()
    x = torch.randn(3, 8, 64)
    with torch.no_grad():
        q = attn.project_query(x, mask)  # (B, H, N, d_k)
        for b in range(3):
            raw = attn.q_proj(x[b, mask[b]])
            direct = (raw - raw.mean(0)) / torch.sqrt(raw.var(0, unbiased=False) + 1e-5)
            torch.testing.assert_close(q[b].transpose(0, 1).reshape(8, 64)[mask[b]], direct, atol=1e-5, rtol=1e-5)
    keys = small("nsan", norm_keys=True, norm_queries=False).encoder.layers[0].attn
    assert keys.query_norm is None and keys.key_norm is not None


# --- GSA ------------------------------------------------------------------------------------------------

BOXES = torch.tensor([[[0.0, 0.0, 9.0, 19.0], [10.0, 0.0, 29.0, 9.0], [4.0, 8.0, 5.0, 11.0]]])
# centres / sizes with the +1 pixel convention: A (4.5, 9.5, 10, 20), B (19.5, 4.5, 20, 10), C (4.5, 9.5, 2, 4)


def test_relative_geometry_hand_example() -> None:
    f = relative_geometry(BOXES)[0]
    log = math.log
    expect = {
        (0, 1): [log(15 / 10), log(5 / 20), log(10 / 20), log(20 / 10)],
        (1, 0): [log(15 / 20), log(5 / 10), log(20 / 10), log(10 / 20)],
        (0, 2): [log(1e-3), log(1e-3), log(10 / 2), log(20 / 4)],  # same centre: the clamp
        (0, 0): [log(1e-3), log(1e-3), 0.0, 0.0],
        (2, 1): [log(15 / 2), log(5 / 4), log(2 / 20), log(4 / 10)],
    }
    for (i, j), values in expect.items():
        torch.testing.assert_close(f[i, j], torch.tensor(values), atol=1e-6, rtol=1e-6)
    signed = relative_geometry(BOXES, signed=True)[0]
    torch.testing.assert_close(signed[..., :4], f)
    # box 1 lies right of and above box 0 (image y grows downwards); boxes 0 and 2 share their centre
    assert signed[0, 1, 4:].tolist() == [1.0, -1.0] and signed[1, 0, 4:].tolist() == [-1.0, 1.0]
    assert signed[0, 2, 4:].tolist() == [0.0, 0.0]
    masked = relative_geometry(BOXES, torch.tensor([[True, True, False]]))[0]
    assert torch.all(masked[2] == 0) and torch.all(masked[:, 2] == 0)


def _naive_phi(bias: GeometricBias, x: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
    """Eqs. 9, 11-13 pair by pair and head by head, straight from the equations."""
    _, n, _ = x.shape
    h, dk = bias.num_heads, bias.d_k
    phi = torch.zeros(1, h, n, n)
    scale = bias.scale
    for i in range(n):
        for j in range(n):
            g = torch.relu(bias.embed.weight @ rel[0, i, j] + bias.embed.bias)  # Eq. 9
            for hd in range(h):
                sl = slice(hd * dk, (hd + 1) * dk)
                total = 0.0
                if bias.content is not None:  # Eq. 11
                    total += torch.relu(bias.content.weight[hd] @ g + bias.content.bias[hd])
                for v in ("query", "key"):
                    if v not in bias.proj:
                        continue
                    src = x[0, i] if v == "query" else x[0, j]
                    qk = (bias.proj[v].weight @ src + bias.proj[v].bias)[sl]  # Q'_i (Eq. 12) or K'_j (Eq. 13)
                    if v in bias.head_maps:
                        gh = bias.head_maps[v].weight[sl] @ g + bias.head_maps[v].bias[sl]
                    else:
                        gh = g
                    total += (qk @ gh) * scale
                phi[0, hd, i, j] = total
    return phi


@pytest.mark.parametrize(
    ("variants", "head_proj", "dim"),
    [
        (("content",), True, 6),
        (("query",), True, 6),
        (("key",), True, 6),
        (("query",), False, 2),
        (("content", "query", "key"), True, 5),
    ],
)
def test_geometric_bias_matches_equations(variants, head_proj: bool, dim: int) -> None:
    torch.manual_seed(0)
    bias = GeometricBias(4, 2, variants, geometry_dim=dim, head_proj=head_proj)
    for p in bias.parameters():  # non-trivial biases so that every term matters
        torch.nn.init.normal_(p, std=0.7)
    x = torch.randn(1, 3, 4)
    rel = relative_geometry(BOXES)
    with torch.no_grad():
        phi = bias(x, rel)
        ref = _naive_phi(bias, x, rel)
    assert phi.shape == (1, 2, 3, 3)
    torch.testing.assert_close(phi, ref, atol=1e-5, rtol=1e-5)
    assert float(phi.abs().max()) > 1e-3


def test_ngsan_energy_is_normalized_content_plus_geometric_bias() -> None:
    """Eq. 10 with Q -> IN(Q): E = IN(Q) K^T / sqrt(d_k) + Q'.G, then key mask, softmax, values, output."""
    model = small("ngsan")
    layer = model.encoder.layers[0]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4, 64, generator=g)
    mask = torch.tensor([[True, True, True, False]])
    boxes = torch.cat([BOXES, torch.tensor([[[50.0, 50.0, 60.0, 70.0]]])], 1)
    rel = relative_geometry(boxes, mask)
    with torch.no_grad():
        out = layer.attn(x, x, mask, layer.geometry(x, rel))
        q = layer.attn.q_proj(x[0, :3])
        q = (q - q.mean(0)) / torch.sqrt(q.var(0, unbiased=False) + 1e-5)  # IN over the 3 real regions
        k, v = layer.attn.k_proj(x[0, :3]), layer.attn.v_proj(x[0, :3])
        phi = _naive_phi(layer.geometry, x, rel)[0]  # (H, 4, 4)
        heads = []
        for h in range(4):
            sl = slice(h * 16, (h + 1) * 16)
            e = q[:, sl] @ k[:, sl].T / 4.0 + phi[h, :3, :3]
            heads.append(torch.softmax(e, -1) @ v[:, sl])
        ref = layer.attn.out_proj(torch.cat(heads, -1))
    torch.testing.assert_close(out[0, :3], ref, atol=1e-5, rtol=1e-5)


def test_absolute_box_encoding_formula() -> None:
    sizes = torch.tensor([[40.0, 20.0]])
    enc = absolute_box_encoding(BOXES, sizes, 16)  # 4 coordinates x 4 channels
    assert enc.shape == (1, 3, 16)
    cx = 4.5 / 40 * 100  # box A, coordinate 0 (centre x / W, scaled by 100)
    expect = [math.sin(cx), math.cos(cx), math.sin(cx / 1000**0.5), math.cos(cx / 1000**0.5)]
    torch.testing.assert_close(enc[0, 0, :4], torch.tensor(expect), atol=1e-5, rtol=1e-5)


def test_layer_norm_is_the_baseline_one() -> None:
    x = torch.randn(3, 8)
    ln = LayerNorm(8)
    ref = (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-6)  # unbiased std, eps on the std
    torch.testing.assert_close(ln(x), ref)


def test_cli_info_prints_the_parameter_count() -> None:
    from cli import app

    result = CliRunner().invoke(app, ["info", "--model", "san", "--set", "num_layers=1"])
    assert result.exit_code == 0, result.output
    expected = count("san", vocab=10000, num_layers=1)
    assert f"parameters: {expected}" in result.output
    bad = CliRunner().invoke(app, ["info", "--model", "san", "--set", "num_layerz=1"])
    assert bad.exit_code == 2
    wrong = CliRunner().invoke(app, ["info", "--model", "gsan", "--set", "geometry=[bogus]"])
    assert wrong.exit_code == 2 and "geometry" in wrong.output
