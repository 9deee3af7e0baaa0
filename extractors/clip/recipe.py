"""CLIP feature recipes: how an image becomes the encoder's input, and which outputs are kept.

``clip-vil`` (Shen et al. 2021, "How Much Can CLIP Benefit Vision-and-Language Tasks?"; clip-vil/CLIP-ViL
``CLIP-ViL-Direct/caption/scripts/clip_prepro_feats.py`` @ 8c3acc3 and ``caption/clip/model.py`` @ d806157):

1. ``Resize((448, 448), interpolation=Image.BICUBIC)``: PIL bicubic to 448 x 448 whatever the aspect ratio;
   ``CenterCrop((448, 448))`` then keeps the whole image; ``ToTensor`` (x / 255 in float32).
2. ``image -= mean; image /= std`` with CLIP's mean (0.48145466, 0.4578275, 0.40821073) and std
   (0.26862954, 0.26130258, 0.27577711).
3. ResNets: the grid is the ``layer4`` map (14 x 14 at 448, ``tmp_att = x[0].permute(1, 2, 0)``); the pooled
   vector is the attention pool's output (``c_proj``, the CLIP embedding) with ``attnpool.positional_embedding``
   resized to 1 + 196 rows by timm ``resize_pos_embed`` (:func:`extractors.clip.model.resize_positional`).
4. ViTs: ``visual.positional_embedding`` resized to the 448 grid the same way; the tokens after the last
   residual block, without ``ln_post``: the patch tokens are the grid, the class token the pooled vector.

``clip`` (openai/CLIP ``clip.py`` ``_transform(n_px)``, n_px the encoder's own resolution): ``Resize(n_px,
BICUBIC)`` (short side to n_px, the long side ``int(n_px * long / short)``), ``CenterCrop(n_px)`` (offsets
``int(round((side - n_px) / 2))``), ``ToTensor``, ``Normalize(mean, std)``. The grid is as above; the pooled
vector is ``encode_image`` (the attention pool, or ``ln_post(class token) @ proj``).

Both run in float32. ``clip-vil`` follows CLIP-ViL after its maintainers made the attention pool and the resized
positional embedding follow openai/CLIP (its pull request #14); its ViT rule is the evident intent of a block of
the script that does not run as written (an undefined ``model_type``), and ViTs other than B/32 extend it. The
feature folders CLIP-ViL released come from its first version: their ``layer4`` grids agree with these to fp16
precision (a GPU with the fp16 weights ``clip.load`` keeps there), their ResNet ``_fc`` vectors do not (a zero
positional embedding and an all-ones output projection, docs/recipes.md#clip). Each grid cell is a region whose box is
the cell's span in the encoder input (``stride`` pixels a side) mapped back to original pixels (per-axis scale,
plus the crop offset for ``clip``); cells are row-major (``reshape(h * w, C)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from extractors.clip.model import POS_RESIZE, ModifiedResNet
from pipeline.core.regions import RegionRecord

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RECIPES = ("clip-vil", "clip")


@dataclass(frozen=True)
class ClipRecipe:
    """``name`` (``clip-vil`` or ``clip``), ``size`` (the input side: 448 for CLIP-ViL, 0 = the encoder's own
    resolution) and ``pos_resize`` (``bicubic``, timm >= 0.4.12, or ``bilinear``, earlier timm)."""

    name: str = "clip-vil"
    size: int = 448
    pos_resize: str = "bicubic"

    def __post_init__(self) -> None:
        if self.name not in RECIPES:
            raise ValueError(f"CLIP recipe {self.name!r} is not one of {', '.join(RECIPES)}")
        if self.pos_resize not in POS_RESIZE:
            raise ValueError(f"pos_resize {self.pos_resize!r} is not one of {', '.join(POS_RESIZE)}")
        if self.size < 0 or self.size > 4096:
            raise ValueError(f"CLIP input size {self.size} is outside [0, 4096]")


@dataclass(frozen=True)
class ClipInput:
    """The encoder input (3, S, S) float32 and where it came from: the original ``height`` x ``width``, the
    resized ``resized_h`` x ``resized_w`` and the crop's ``top``/``left`` offsets in the resized image."""

    blob: np.ndarray
    height: int
    width: int
    resized_h: int
    resized_w: int
    top: int
    left: int


@dataclass(frozen=True)
class ClipFeatures:
    """One image's CLIP features: ``regions`` (grid cells as regions, boxes in original pixels), ``pooled`` (the
    pooled vector, float32) and the grid's ``(h, w)``."""

    regions: RegionRecord
    pooled: np.ndarray
    grid_hw: tuple[int, int]


def _normalise(img: Image.Image) -> np.ndarray:
    t = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float().div(255)
    t = (t - torch.tensor(CLIP_MEAN).view(3, 1, 1)) / torch.tensor(CLIP_STD).view(3, 1, 1)
    return np.ascontiguousarray(t.numpy(), dtype=np.float32)


def prepare(rgb: np.ndarray, recipe: ClipRecipe, resolution: int) -> ClipInput:
    """The encoder input of an (H, W, 3) uint8 RGB image under ``recipe`` (``resolution``: the encoder's own)."""
    h, w = int(rgb.shape[0]), int(rgb.shape[1])
    img = Image.fromarray(np.ascontiguousarray(rgb, dtype=np.uint8), "RGB")
    side = recipe.size or resolution
    if recipe.name == "clip-vil":
        resized = img.resize((side, side), Image.BICUBIC)
        return ClipInput(_normalise(resized), h, w, side, side, 0, 0)
    short, long = min(w, h), max(w, h)
    new_short, new_long = side, int(side * long / short)
    nw, nh = (new_short, new_long) if w <= h else (new_long, new_short)
    resized = img.resize((nw, nh), Image.BICUBIC)
    top, left = int(round((nh - side) / 2.0)), int(round((nw - side) / 2.0))
    crop = resized.crop((left, top, left + side, top + side))
    return ClipInput(_normalise(crop), h, w, nh, nw, top, left)


def cell_boxes(inp: ClipInput, grid_hw: tuple[int, int], stride: int) -> np.ndarray:
    """(h * w, 4) float32 x1y1x2y2 of each cell in original pixels: the cell's span in the input, shifted by the
    crop offset, scaled by original / resized per axis, clipped to the image."""
    gh, gw = grid_hw
    ys, xs = np.meshgrid(np.arange(gh, dtype=np.float64), np.arange(gw, dtype=np.float64), indexing="ij")
    sx, sy = inp.width / inp.resized_w, inp.height / inp.resized_h
    x1 = (xs.ravel() * stride + inp.left) * sx
    y1 = (ys.ravel() * stride + inp.top) * sy
    x2 = ((xs.ravel() + 1) * stride + inp.left) * sx
    y2 = ((ys.ravel() + 1) * stride + inp.top) * sy
    boxes = np.stack([x1, y1, x2, y2], axis=1)
    boxes[:, 0::2] = boxes[:, 0::2].clip(0, inp.width)
    boxes[:, 1::2] = boxes[:, 1::2].clip(0, inp.height)
    return boxes.astype(np.float32)


@torch.no_grad()
def encode(model: torch.nn.Module, blob: torch.Tensor, recipe: ClipRecipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, 3, S, S) input -> (grid (1, C, h, w), pooled (1, D)) under ``recipe``."""
    if isinstance(model, ModifiedResNet):
        fmap = model.grid(blob)
        return fmap, model.pool(fmap, recipe.pos_resize)
    tokens, (h, w) = model.tokens(blob, recipe.pos_resize)
    fmap = tokens[:, 1:].transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], h, w)
    pooled = tokens[:, 0] if recipe.name == "clip-vil" else model.embed(tokens)
    return fmap, pooled


def extract_batch(model: torch.nn.Module, images: list[np.ndarray], recipe: ClipRecipe) -> list[ClipFeatures]:
    """Several images in one forward pass (both recipes give square inputs of one size) -> one
    :class:`ClipFeatures` each, in order; the batch reaches the host in one copy per output."""
    if not images:
        return []
    cfg = model.config
    inputs = [prepare(rgb, recipe, cfg.resolution) for rgb in images]
    device = next(model.parameters()).device
    blob = torch.from_numpy(np.stack([inp.blob for inp in inputs])).to(device)
    fmap, pooled = encode(model, blob, recipe)
    n, c, h, w = fmap.shape
    feats = fmap.permute(0, 2, 3, 1).reshape(n, h * w, c).float().cpu().numpy()
    vectors = pooled.float().cpu().numpy()
    out = []
    for i, inp in enumerate(inputs):
        regions = RegionRecord(
            features=np.ascontiguousarray(feats[i], dtype=np.float32),
            boxes=cell_boxes(inp, (h, w), cfg.stride),
            image_w=inp.width,
            image_h=inp.height,
        )
        out.append(ClipFeatures(regions, np.ascontiguousarray(vectors[i], dtype=np.float32), (h, w)))
    return out


def extract(model: torch.nn.Module, rgb: np.ndarray, recipe: ClipRecipe) -> ClipFeatures:
    """One image -> :class:`ClipFeatures` (grid cells with boxes in original pixels, the pooled vector)."""
    return extract_batch(model, [rgb], recipe)[0]
