"""CLIP's image encoders (Radford et al. 2021, "Learning Transferable Visual Models From Natural Language
Supervision", Sec. 2.4), in plain PyTorch, with the module and parameter names of openai/CLIP ``clip/model.py``
(the ``visual.`` subtree of its state dict), so a released state dict loads without renaming.

* :class:`ModifiedResNet` (RN50, RN101, RN50x4, RN50x16, RN50x64): a three-convolution stem (3x3 stride 2, 3x3,
  3x3, each BatchNorm + ReLU) closed by a 2x2 average pool; bottleneck stages whose strided blocks average-pool
  after the 3x3 convolution and before the 1x1 shortcut convolution ("anti-aliased" downsampling, both
  convolutions at stride 1); attention pooling (:class:`AttentionPool2d`) in place of the global average pool.
* :class:`VisionTransformer` (ViT-B/32, B/16, L/14, L/14@336px): patch embedding by a strided convolution
  without bias, a class token, learned positional embedding, ``ln_pre`` before the pre-norm residual blocks
  (multi-head self-attention, an MLP with QuickGELU ``x * sigmoid(1.702 x)``), ``ln_post`` on the class token
  and the projection ``proj``. open_clip's larger ViTs (H/14, g/14, bigG/14) are the same network with heads
  wider than 64 channels (``vision_cfg.head_width``) and, for g and bigG, an MLP ratio other than 4.

:class:`ClipVisionConfig` holds an architecture; :data:`PRESETS` the nine OpenAI releases; :func:`infer_config`
reads one from a state dict the way openai/CLIP ``build_model`` does (ViT when ``proj`` is present; stage depths
counted from the ``layerN.i`` block indices; resolution = 32 x the attention pool's grid, or patch x grid; the
MLP width from ``c_fc``). The head count is not in the weights: it is given to :func:`infer_config`.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = ("quick_gelu", "gelu")
POS_RESIZE = ("bicubic", "bilinear")
#: channels per attention head in OpenAI's encoders (openai/CLIP ``build_model``; open_clip's default ``head_width``)
DEFAULT_HEAD_WIDTH = 64


@dataclass(frozen=True)
class ClipVisionConfig:
    """One CLIP image encoder: ``kind`` ``resnet`` or ``vit``; ``width`` (the ResNet stem width, or the ViT
    token width); ``layers`` (four stage depths, or one block count); ``resolution`` (the training input side);
    ``embed_dim`` (the output of the attention pool's ``c_proj`` or of ``proj``; 0 for a ViT without ``proj``, as
    a Hugging Face ``CLIPVisionModel`` holds); ``patch`` (ViT patch side); ``activation`` of the ViT MLP
    (``quick_gelu`` for OpenAI's weights; open_clip's LAION ViTs use ``gelu``); ``head_width``: channels per
    attention head (open_clip ``vision_cfg.head_width``; 0 = OpenAI's 64); ``mlp_dim``: the ViT MLP's hidden
    width (0 = 4 x ``width``). A ``head_width`` of 64 and an ``mlp_dim`` of 4 x ``width`` are stored as 0, so
    one network has one record and :meth:`to_dict` leaves the two fields out at their defaults."""

    kind: str
    width: int
    layers: tuple[int, ...]
    resolution: int
    embed_dim: int
    patch: int = 0
    activation: str = "quick_gelu"
    head_width: int = 0
    mlp_dim: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("resnet", "vit"):
            raise ValueError(f"CLIP encoder kind {self.kind!r} is neither 'resnet' nor 'vit'")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"CLIP activation {self.activation!r} is not one of {', '.join(ACTIVATIONS)}")
        for name in ("head_width", "mlp_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"CLIP {name} must be an integer >= 0 (0: the default), not {value!r}")
        if self.head_width == DEFAULT_HEAD_WIDTH:
            object.__setattr__(self, "head_width", 0)
        if self.kind == "vit" and self.mlp_dim == 4 * self.width:
            object.__setattr__(self, "mlp_dim", 0)
        if self.kind == "resnet" and (len(self.layers) != 4 or self.width % 2):
            raise ValueError("a CLIP ResNet has four stages and an even stem width")
        if self.kind == "resnet" and self.mlp_dim:
            raise ValueError("a CLIP ResNet has no MLP width (mlp_dim 0)")
        if self.kind == "vit" and (len(self.layers) != 1 or self.patch < 1):
            raise ValueError("a CLIP ViT has one block count and a patch size")
        if self.kind == "vit" and not self.head_width and self.width % DEFAULT_HEAD_WIDTH:
            raise ValueError("a CLIP ViT with 64-wide heads has a width that is a multiple of 64")
        if self.head_width and self.grid_dim % self.head_width:
            raise ValueError(f"{self.grid_dim} attention channels do not split into heads of {self.head_width}")

    @property
    def heads(self) -> int:
        """Attention heads: ``grid_dim // head_width`` (open_clip); with 64-wide heads openai/CLIP
        ``CLIP.__init__``'s ``width * 32 // 64`` for the attention pool and ``width // 64`` for a ViT."""
        return self.grid_dim // (self.head_width or DEFAULT_HEAD_WIDTH)

    @property
    def mlp_width(self) -> int:
        """The ViT MLP's hidden width: ``mlp_dim``, else 4 x ``width`` (``mlp_ratio`` 4)."""
        return self.mlp_dim or 4 * self.width

    def to_dict(self) -> dict:
        """The record as plain values (what the feature identity stores as ``config.spec``): the dataclass fields,
        ``head_width`` and ``mlp_dim`` only where they differ from the defaults."""
        out = asdict(self)
        for name in ("head_width", "mlp_dim"):
            if not out[name]:
                del out[name]
        return out

    @property
    def stride(self) -> int:
        """Input pixels per grid cell: 32 for the ResNets, the patch side for a ViT."""
        return 32 if self.kind == "resnet" else self.patch

    @property
    def grid_dim(self) -> int:
        """Channels of a grid cell: ``width * 32`` (the last stage's output) or the ViT width."""
        return self.width * 32 if self.kind == "resnet" else self.width

    def with_(self, **changes) -> "ClipVisionConfig":
        return replace(self, **changes)


def _rn(layers, width, resolution, embed_dim) -> ClipVisionConfig:
    return ClipVisionConfig("resnet", width, tuple(layers), resolution, embed_dim)


def _vit(width, layers, patch, resolution, embed_dim) -> ClipVisionConfig:
    return ClipVisionConfig("vit", width, (layers,), resolution, embed_dim, patch=patch)


#: the nine OpenAI releases (openai/CLIP ``_MODELS``; the numbers are what ``build_model`` reads from each file)
PRESETS: dict[str, ClipVisionConfig] = {
    "RN50": _rn((3, 4, 6, 3), 64, 224, 1024),
    "RN101": _rn((3, 4, 23, 3), 64, 224, 512),
    "RN50x4": _rn((4, 6, 10, 6), 80, 288, 640),
    "RN50x16": _rn((6, 8, 18, 8), 96, 384, 768),
    "RN50x64": _rn((3, 15, 36, 10), 128, 448, 1024),
    "ViT-B/32": _vit(768, 12, 32, 224, 512),
    "ViT-B/16": _vit(768, 12, 16, 224, 512),
    "ViT-L/14": _vit(1024, 24, 14, 224, 768),
    "ViT-L/14@336px": _vit(1024, 24, 14, 336, 768),
}


class QuickGELU(nn.Module):
    """openai/CLIP ``QuickGELU``: ``x * sigmoid(1.702 x)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class Bottleneck(nn.Module):
    """openai/CLIP ``Bottleneck``: 1x1, 3x3, [avgpool(stride)], 1x1 (x4); shortcut ``AvgPool2d(stride)`` then a
    1x1 convolution and BatchNorm when the block strides or changes width (``downsample`` keys ``0`` and ``1``)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.avgpool = nn.AvgPool2d(stride) if stride > 1 else nn.Identity()
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride > 1 or inplanes != out:
            self.downsample = nn.Sequential(
                OrderedDict(
                    [
                        ("-1", nn.AvgPool2d(stride) if stride > 1 else nn.Identity()),
                        ("0", nn.Conv2d(inplanes, out, 1, bias=False)),
                        ("1", nn.BatchNorm2d(out)),
                    ]
                )
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.avgpool(F.relu(self.bn2(self.conv2(y))))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


def resize_positional(pos: torch.Tensor, grid: tuple[int, int], mode: str = "bicubic") -> torch.Tensor:
    """A (1 + g*g, C) positional embedding for an (h, w) grid: the first row kept, the g x g rows interpolated
    as a C-channel image (timm ``resize_pos_embed``, which CLIP-ViL's ``clip_prepro_feats.py`` calls: ``bicubic``
    with ``align_corners=False`` from timm 0.4.12, ``bilinear`` before it). Unchanged when the grid matches."""
    if mode not in POS_RESIZE:
        raise ValueError(f"positional resize {mode!r} is not one of {', '.join(POS_RESIZE)}")
    old = int(math.isqrt(pos.shape[0] - 1))
    if (old, old) == tuple(grid):
        return pos
    cells = pos[1:].reshape(1, old, old, -1).permute(0, 3, 1, 2)
    kw = {"align_corners": False} if mode == "bicubic" else {}
    cells = F.interpolate(cells, size=tuple(grid), mode=mode, **kw)
    return torch.cat([pos[:1], cells.permute(0, 2, 3, 1).reshape(grid[0] * grid[1], -1)], dim=0)


class AttentionPool2d(nn.Module):
    """openai/CLIP ``AttentionPool2d``: tokens = [mean of the cells; the cells] + ``positional_embedding``; one
    multi-head attention (``q_proj``/``k_proj``/``v_proj``, output ``c_proj``) whose first output token is the
    pooled vector. Only the mean token's query is computed (the release computes all and keeps ``x[0]``)."""

    def __init__(self, grid: int, dim: int, heads: int, out_dim: int) -> None:
        super().__init__()
        self.positional_embedding = nn.Parameter(torch.zeros(grid * grid + 1, dim))
        self.k_proj = nn.Linear(dim, dim)
        self.q_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.c_proj = nn.Linear(dim, out_dim or dim)
        self.heads = heads

    def forward(self, fmap: torch.Tensor, resize: str = "bicubic") -> torch.Tensor:
        n, c, h, w = fmap.shape
        pos = resize_positional(self.positional_embedding, (h, w), resize)
        x = fmap.reshape(n, c, h * w).permute(0, 2, 1)
        x = torch.cat([x.mean(dim=1, keepdim=True), x], dim=1) + pos[None].to(x.dtype)
        d = c // self.heads
        q = self.q_proj(x[:, :1]).reshape(n, 1, self.heads, d).transpose(1, 2)
        k = self.k_proj(x).reshape(n, -1, self.heads, d).transpose(1, 2)
        v = self.v_proj(x).reshape(n, -1, self.heads, d).transpose(1, 2)
        att = torch.softmax((q * d**-0.5) @ k.transpose(-2, -1), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(n, c))


class ModifiedResNet(nn.Module):
    """openai/CLIP ``ModifiedResNet``; :meth:`grid` is the ``layer4`` output, :meth:`pool` the attention pool."""

    def __init__(self, cfg: ClipVisionConfig) -> None:
        super().__init__()
        self.config = cfg
        w = cfg.width
        self.conv1 = nn.Conv2d(3, w // 2, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(w // 2)
        self.conv2 = nn.Conv2d(w // 2, w // 2, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(w // 2)
        self.conv3 = nn.Conv2d(w // 2, w, 3, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(w)
        self.avgpool = nn.AvgPool2d(2)
        inplanes = w
        for i, blocks in enumerate(cfg.layers):
            planes = w * 2**i
            stage = [Bottleneck(inplanes, planes, 1 if i == 0 else 2)]
            inplanes = planes * Bottleneck.expansion
            stage += [Bottleneck(inplanes, planes) for _ in range(1, blocks)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
        self.attnpool = AttentionPool2d(cfg.resolution // 32, w * 32, cfg.heads, cfg.embed_dim)

    def grid(self, x: torch.Tensor) -> torch.Tensor:
        for conv, bn in ((self.conv1, self.bn1), (self.conv2, self.bn2), (self.conv3, self.bn3)):
            x = F.relu(bn(conv(x)))
        x = self.avgpool(x)
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return x

    def pool(self, fmap: torch.Tensor, resize: str = "bicubic") -> torch.Tensor:
        return self.attnpool(fmap, resize)


class SelfAttention(nn.Module):
    """The parameters of ``torch.nn.MultiheadAttention`` as openai/CLIP stores them (``in_proj_weight`` = [Wq;
    Wk; Wv], ``in_proj_bias``, ``out_proj``); scaled dot-product attention over all tokens, no mask."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.in_proj_weight = nn.Parameter(torch.zeros(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * dim))
        self.out_proj = nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, c = x.shape
        d = c // self.heads
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).reshape(n, t, 3, self.heads, d).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = torch.softmax((q * d**-0.5) @ k.transpose(-2, -1), dim=-1)
        return self.out_proj((att @ v).transpose(1, 2).reshape(n, t, c))


class ResidualAttentionBlock(nn.Module):
    """openai/CLIP ``ResidualAttentionBlock``: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))`` (c_fc to ``mlp``
    channels, 4x unless given (open_clip ``mlp_ratio``), GELU variant, c_proj)."""

    def __init__(self, dim: int, heads: int, activation: str, mlp: int = 0) -> None:
        super().__init__()
        self.attn = SelfAttention(dim, heads)
        self.ln_1 = nn.LayerNorm(dim)
        act = QuickGELU() if activation == "quick_gelu" else nn.GELU()
        hidden = mlp or dim * 4
        self.mlp = nn.Sequential(
            OrderedDict([("c_fc", nn.Linear(dim, hidden)), ("gelu", act), ("c_proj", nn.Linear(hidden, dim))])
        )
        self.ln_2 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _Blocks(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, activation: str, mlp: int = 0) -> None:
        super().__init__()
        self.resblocks = nn.Sequential(*[ResidualAttentionBlock(dim, heads, activation, mlp) for _ in range(layers)])


class VisionTransformer(nn.Module):
    """openai/CLIP ``VisionTransformer``. :meth:`tokens` runs the blocks and returns the last layer's tokens
    (class token first, before ``ln_post``); :meth:`embed` is ``ln_post(class token) @ proj`` (``encode_image``)."""

    def __init__(self, cfg: ClipVisionConfig) -> None:
        super().__init__()
        self.config = cfg
        w, g = cfg.width, cfg.resolution // cfg.patch
        self.conv1 = nn.Conv2d(3, w, cfg.patch, stride=cfg.patch, bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(w))
        self.positional_embedding = nn.Parameter(torch.zeros(g * g + 1, w))
        self.ln_pre = nn.LayerNorm(w)
        self.transformer = _Blocks(w, cfg.layers[0], cfg.heads, cfg.activation, cfg.mlp_width)
        self.ln_post = nn.LayerNorm(w)
        self.proj = nn.Parameter(torch.zeros(w, cfg.embed_dim)) if cfg.embed_dim else None

    def tokens(self, x: torch.Tensor, resize: str = "bicubic") -> tuple[torch.Tensor, tuple[int, int]]:
        x = self.conv1(x)
        n, c, h, w = x.shape
        x = x.reshape(n, c, h * w).permute(0, 2, 1)
        cls = self.class_embedding.to(x.dtype).expand(n, 1, c)
        pos = resize_positional(self.positional_embedding, (h, w), resize)
        x = self.ln_pre(torch.cat([cls, x], dim=1) + pos.to(x.dtype))
        return self.transformer.resblocks(x), (h, w)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.ln_post(tokens[:, 0])
        return x @ self.proj if self.proj is not None else x


def build(cfg: ClipVisionConfig) -> nn.Module:
    """The encoder of ``cfg`` in eval mode, parameters frozen."""
    model = ModifiedResNet(cfg) if cfg.kind == "resnet" else VisionTransformer(cfg)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def expected_shapes(cfg: ClipVisionConfig) -> "OrderedDict[str, tuple[int, ...]]":
    """Key -> shape of the encoder's state dict (OpenAI's ``visual.`` names without the prefix), on the meta device."""
    with torch.device("meta"):
        model = ModifiedResNet(cfg) if cfg.kind == "resnet" else VisionTransformer(cfg)
    return OrderedDict((k, tuple(v.shape)) for k, v in model.state_dict().items())


_LAYER = re.compile(r"^layer([1-4])\.(\d+)\.")
_BLOCK = re.compile(r"^transformer\.resblocks\.(\d+)\.attn\.in_proj_weight$")


class ConfigError(ValueError):
    """A state dict that names no CLIP encoder; the message names the key that is missing or misshapen."""


def _shape(sd: Mapping[str, torch.Tensor], key: str, rank: int) -> tuple[int, ...]:
    value = sd.get(key)
    if value is None:
        raise ConfigError(f"no '{key}'")
    if value.dim() != rank:
        raise ConfigError(f"'{key}' has {value.dim()} dimensions, {rank} expected")
    return tuple(value.shape)


def _side(n_positions: int, key: str) -> int:
    side = math.isqrt(max(n_positions - 1, 0))
    if side < 1 or side * side + 1 != n_positions:
        raise ConfigError(f"'{key}' has {n_positions} rows, not 1 + a square")
    return side


def is_vit(sd: Mapping[str, torch.Tensor]) -> bool:
    """A ViT's state dict (``proj`` or ``class_embedding``), as openai/CLIP ``build_model`` tells them apart."""
    return "proj" in sd or "class_embedding" in sd


def _head_width(channels: int, heads: int) -> int:
    if not heads:
        return 0
    if channels % heads:
        raise ConfigError(f"{channels} attention channels do not split into {heads} heads")
    return channels // heads


def infer_config(
    sd: Mapping[str, torch.Tensor], activation: str = "quick_gelu", heads: int = 0, head_width: int = 0
) -> ClipVisionConfig:
    """The architecture of an encoder state dict (internal names), as openai/CLIP ``build_model`` reads it; the MLP
    width from ``transformer.resblocks.0.mlp.c_fc.weight`` (4 x width when that key is absent: the strict check
    then names it). The attention heads are not in the weights: ``heads`` (a count) or ``head_width`` (channels
    per head), 0 for OpenAI's 64-wide heads."""
    if is_vit(sd):
        width, _, patch, _ = _shape(sd, "conv1.weight", 4)
        layers = sum(1 for k in sd if _BLOCK.match(k))
        grid = _side(_shape(sd, "positional_embedding", 2)[0], "positional_embedding")
        embed = _shape(sd, "proj", 2)[1] if "proj" in sd else 0
        if layers < 1:
            raise ConfigError("no 'transformer.resblocks.0.attn.in_proj_weight'")
        fc = "transformer.resblocks.0.mlp.c_fc.weight"
        mlp = _shape(sd, fc, 2)[0] if fc in sd else 0
        return ClipVisionConfig(
            "vit",
            width,
            (layers,),
            patch * grid,
            embed,
            patch=patch,
            activation=activation,
            head_width=head_width or _head_width(width, heads),
            mlp_dim=mlp,
        )
    stages = [set() for _ in range(4)]
    for k in sd:
        m = _LAYER.match(k)
        if m:
            stages[int(m.group(1)) - 1].add(int(m.group(2)))
    if not all(stages):
        raise ConfigError("no 'layer1.0.conv1.weight' .. 'layer4.0.conv1.weight' (neither a CLIP ResNet nor a ViT)")
    width = _shape(sd, "layer1.0.conv1.weight", 4)[0]
    grid = _side(_shape(sd, "attnpool.positional_embedding", 2)[0], "attnpool.positional_embedding")
    embed = _shape(sd, "attnpool.c_proj.weight", 2)[0]
    head_width = head_width or _head_width(width * 32, heads)
    return ClipVisionConfig("resnet", width, tuple(len(s) for s in stages), grid * 32, embed, head_width=head_width)
