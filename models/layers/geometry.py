"""Box geometry for the G-SAN encoder (Guo et al. 2020 §4.2; docs/models.md#gsan).

* :func:`relative_geometry`: the relative geometry feature ``f^g_ij`` of every (query i, key j) box pair
  (Eq. 8, in the Relation-Networks / ORT form the paper cites):
  ``( log max(|cx_i - cx_j| / w_i, c), log max(|cy_i - cy_j| / h_i, c), log(w_i / w_j), log(h_i / h_j) )``
  with centres ``cx = (x1 + x2) / 2`` and sizes ``w = x2 - x1 + 1`` (the ORT/VSUA pixel convention; switch
  ``plus_one``), and the clamp ``c = 1e-3`` that keeps ``i = j`` finite. Because the offsets enter as
  ``|cx_i - cx_j|``, the bias of Eq. 8 is mirror-symmetric: a region cannot tell whether another one lies to
  its left or right (above or below). ``signed=True`` (model switch ``geometry_signed``, off by default: not in
  the paper) appends ``sign(cx_j - cx_i)`` and ``sign(cy_j - cy_i)`` as two more inputs of Eq. 9's FC, for
  captions whose words depend on the direction ("to the left of").
* :class:`GeometricBias`: ``G_ij = ReLU(f_ij W_g + b_g)`` (Eq. 9) and the bias ``phi`` added to the attention
  logits (Eq. 10) in the three variants, which may be combined (their biases add):

  - ``content``: content-independent, ``phi^h_ij = ReLU(w_g^h . G_ij + b^h)`` (Eq. 11), one ``w_g`` per head;
  - ``query``: query-dependent, ``phi^h_ij = Q'^h_i . G^h_ij`` (Eq. 12, the paper's default);
  - ``key``: key-dependent, ``phi^h_ij = K'^h_j . G^h_ij`` (Eq. 13);

  where ``Q' = X W_Q' + b`` / ``K' = X W_K' + b`` are geometric queries / keys with their own weights, and
  ``G^h_ij = G_ij W^h + c^h`` maps the shared geometry embedding (size ``geometry_dim``) into head ``h``'s
  space "in the same way as Q, K". Choices (the paper does not state them, docs/models.md#gsan-choices):
  ``geometry_dim = 128`` with the per-head map reproduces the 41.5M of Tables 4/6 at L = 4 (the minimal
  reading, ``geometry_dim = d_k`` and no map, gives 41.25M); the dot-product biases are scaled by
  ``1/sqrt(d_k)`` like the content logits (switch ``scale``).
* :func:`absolute_box_encoding`: the "absolute" ablation of Table 4: a sinusoidal embedding of each box's
  centre and size normalised by the image size, added at the encoder input.
"""

from __future__ import annotations

import math

import torch
from torch import nn

GEOMETRY_VARIANTS = ("content", "query", "key")


def box_centres_sizes(boxes: torch.Tensor, plus_one: bool = True, min_size: float = 1e-3) -> torch.Tensor:
    """``(..., 4)`` pixel boxes ``x1, y1, x2, y2`` -> ``(..., 4)`` ``cx, cy, w, h`` (sizes clamped to ``min_size``)."""
    x1, y1, x2, y2 = boxes.unbind(-1)
    extra = 1.0 if plus_one else 0.0
    w = (x2 - x1 + extra).clamp_min(min_size)
    h = (y2 - y1 + extra).clamp_min(min_size)
    return torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, w, h], dim=-1)


def relative_geometry(
    boxes: torch.Tensor,
    mask: torch.Tensor | None = None,
    plus_one: bool = True,
    clamp: float = 1e-3,
    signed: bool = False,
) -> torch.Tensor:
    """Relative geometry ``f^g`` ``(B, N, N, 4)`` of every box pair, row = query box i, column = key box j (Eq. 8).

    ``signed``: ``(B, N, N, 6)``, the 4 terms of Eq. 8 then the directions ``sign(cx_j - cx_i)``,
    ``sign(cy_j - cy_i)`` (+1: the key box lies to the right of / below the query box).
    Pairs involving a padded region (``mask`` False) are set to 0 (they are masked out of the attention).
    """
    cx, cy, w, h = box_centres_sizes(boxes, plus_one).unbind(-1)
    dx = torch.log(((cx[:, :, None] - cx[:, None, :]).abs() / w[:, :, None]).clamp_min(clamp))
    dy = torch.log(((cy[:, :, None] - cy[:, None, :]).abs() / h[:, :, None]).clamp_min(clamp))
    dw = torch.log(w[:, :, None] / w[:, None, :])
    dh = torch.log(h[:, :, None] / h[:, None, :])
    terms = [dx, dy, dw, dh]
    if signed:
        terms += [torch.sign(cx[:, None, :] - cx[:, :, None]), torch.sign(cy[:, None, :] - cy[:, :, None])]
    f = torch.stack(terms, dim=-1)
    if mask is not None:
        pair = mask[:, :, None] & mask[:, None, :]
        f = f * pair[..., None].to(f.dtype)
    return f


def absolute_box_encoding(
    boxes: torch.Tensor,
    sizes: torch.Tensor,
    d_model: int,
    plus_one: bool = True,
    scale: float = 100.0,
    wave_len: float = 1000.0,
) -> torch.Tensor:
    """Sinusoidal embedding ``(B, N, d_model)`` of ``(cx/W, cy/H, w/W, h/H)`` (Table 4, "absolute").

    Each of the 4 normalised coordinates ``p`` (multiplied by ``scale``) gets ``d_model / 4`` channels
    ``sin(p / wave_len^(2i/(d/4))), cos(...)``, as the Transformer's positional encoding does for positions.
    """
    if d_model % 8:
        raise ValueError(f"absolute box encoding needs d_model divisible by 8, got {d_model}")
    geo = box_centres_sizes(boxes, plus_one)
    wh = sizes[:, None, :].to(geo.dtype).clamp_min(1.0)
    norm = geo / torch.cat([wh, wh], dim=-1) * scale  # (B, N, 4)
    per = d_model // 4
    freq = torch.exp(torch.arange(0, per, 2, device=boxes.device, dtype=geo.dtype) * (-math.log(wave_len) / per))
    angles = norm[..., None] * freq  # (B, N, 4, per/2)
    emb = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)  # interleaved sin/cos: (B, N, 4, per)
    return emb.flatten(-2)


class GeometricBias(nn.Module):
    """The geometric attention bias ``phi`` ``(B, H, N, N)`` of one G-SAN encoder layer (Eqs. 9-13).

    ``forward(x, rel)`` takes the layer's (pre-normed) input ``x`` ``(B, N, d)`` and the relative geometry
    ``rel`` ``(B, N, N, 4)`` (``(B, N, N, 6)`` with ``signed``); the result is added to the content logits before the
    key mask and softmax.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        variants: tuple[str, ...] | list[str] = ("query",),
        geometry_dim: int = 128,
        head_proj: bool = True,
        scale: bool = True,
        signed: bool = False,
    ) -> None:
        super().__init__()
        variants = tuple(variants)
        bad = [v for v in variants if v not in GEOMETRY_VARIANTS]
        if bad or not variants or len(set(variants)) != len(variants):
            raise ValueError(f"geometry variants must be distinct values of {GEOMETRY_VARIANTS}, got {list(variants)}")
        self.variants = variants
        self.num_heads = num_heads
        self.d_k = d_model // num_heads
        self.scale = 1.0 / math.sqrt(self.d_k) if scale else 1.0
        self.embed = nn.Linear(6 if signed else 4, geometry_dim)  # Eq. 9: G = ReLU(f W_g + b_g)
        if not head_proj and geometry_dim != self.d_k and any(v in ("query", "key") for v in variants):
            raise ValueError(f"without a per-head map the geometry_dim must equal d_k={self.d_k}, got {geometry_dim}")
        self.content = nn.Linear(geometry_dim, num_heads) if "content" in variants else None
        self.proj = nn.ModuleDict()  # geometric query / key projections Q' / K' (d -> d)
        self.head_maps = nn.ModuleDict()  # G -> G^h for each dot-product variant
        for v in ("query", "key"):
            if v in variants:
                self.proj[v] = nn.Linear(d_model, d_model)
                if head_proj:
                    self.head_maps[v] = nn.Linear(geometry_dim, d_model)

    def embed_geometry(self, rel: torch.Tensor) -> torch.Tensor:
        """``G = ReLU(f W_g + b_g)`` ``(B, N, N, geometry_dim)`` (Eq. 9)."""
        return torch.relu(self.embed(rel))

    def forward(self, x: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        g = self.embed_geometry(rel)
        phi = x.new_zeros(b, self.num_heads, n, n)
        if self.content is not None:  # Eq. 11
            phi = phi + torch.relu(self.content(g)).permute(0, 3, 1, 2)
        for v, proj in self.proj.items():
            heads = proj(x).view(b, n, self.num_heads, self.d_k)  # Q' or K' per head
            if v in self.head_maps:
                # Q'^h . (G W^h + c^h) = (Q'^h W^h^T) . G + Q'^h . c^h: never materialise G^h (B, N, N, H, d_k)
                lin = self.head_maps[v]
                w = lin.weight.view(self.num_heads, self.d_k, -1)
                c = lin.bias.view(self.num_heads, self.d_k)
                reduced = torch.einsum("bnhk,hkg->bhng", heads, w)
                const = torch.einsum("bnhk,hk->bhn", heads, c)
            else:
                reduced = heads.permute(0, 2, 1, 3)
                const = None
            if v == "query":  # Eq. 12: phi_ij = Q'_i . G_ij
                term = torch.einsum("bhig,bijg->bhij", reduced, g)
                if const is not None:
                    term = term + const[..., :, None]
            else:  # Eq. 13: phi_ij = K'_j . G_ij
                term = torch.einsum("bhjg,bijg->bhij", reduced, g)
                if const is not None:
                    term = term + const[..., None, :]
            phi = phi + term * self.scale
        return phi
