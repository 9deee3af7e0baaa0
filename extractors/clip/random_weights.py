"""Seeded random CLIP image encoders: an architecture's network with random values, for measuring speed (the
released architectures of :data:`extractors.clip.model.PRESETS`) and for running the pipeline end to end where no
weights can be downloaded (the demo's ``clip`` features). The features of such an encoder carry the image's pixels
through random filters; they are not CLIP's features.

:func:`random_encoder` builds the encoder of a config with values drawn from a seeded generator (the same seed and
config give the same values on every machine); :func:`write_random_clip` saves one as an open_clip state dict
(``visual.<name>`` keys) with the ``open_clip_config.json`` that names its activation and head width, which ``cli
extract --weights`` and :func:`extractors.clip.files.load_clip` read like any released CLIP file.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from extractors.clip.files import COMPANION_FILES
from extractors.clip.model import DEFAULT_HEAD_WIDTH, ClipVisionConfig, build
from pipeline.core.fileio import atomic_write, atomic_write_json


def random_encoder(cfg: ClipVisionConfig, seed: int = 0) -> nn.Module:
    """The encoder of ``cfg`` (eval mode, frozen) with seeded random values: matrices and convolutions
    ``N(0, 1 / fan_in)``, normalisation weights ``1 + N(0, 0.1^2)``, other vectors ``N(0, 0.1^2)``; BatchNorm
    statistics ``mean 0, var 1`` (so activations keep their scale through the depth)."""
    model = build(cfg)
    g = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(max(p[0].numel(), 1)))
            elif name.endswith(".weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def open_clip_config(cfg: ClipVisionConfig) -> dict:
    """open_clip's ``open_clip_config.json`` of the encoder ``cfg`` (``model_cfg``: ``embed_dim``, ``quick_gelu``,
    ``vision_cfg`` with the image size, layers, width, patch size, head width and MLP ratio)."""
    vision = {
        "image_size": cfg.resolution,
        "layers": list(cfg.layers) if cfg.kind == "resnet" else cfg.layers[0],
        "width": cfg.width,
        "patch_size": cfg.patch or None,
        "head_width": cfg.head_width or DEFAULT_HEAD_WIDTH,
    }
    if cfg.kind == "vit":
        vision["mlp_ratio"] = cfg.mlp_width / cfg.width
    quick = cfg.activation == "quick_gelu"
    return {"model_cfg": {"embed_dim": cfg.embed_dim, "quick_gelu": quick, "vision_cfg": vision}}


def write_random_clip(cfg: ClipVisionConfig, path: str | Path, seed: int = 0) -> Path:
    """Save :func:`random_encoder` ``(cfg, seed)`` to ``path`` as an open_clip state dict, and its
    :func:`open_clip_config` as ``open_clip_config.json`` in the same folder (each atomically)."""
    state = {f"visual.{k}": v.detach().clone() for k, v in random_encoder(cfg, seed).state_dict().items()}
    path = Path(path)
    atomic_write_json(path.with_name(COMPANION_FILES["open_clip"]), open_clip_config(cfg))
    atomic_write(path, lambda fh: torch.save(state, fh))
    return path


__all__ = ["open_clip_config", "random_encoder", "write_random_clip"]
