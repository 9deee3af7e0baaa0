"""CLIP grid features through the region detectors' machinery: ``cli extract`` and ``caption`` with CLIP weights.

A CLIP weights file (an OpenAI TorchScript archive, an open_clip state dict, Hugging Face ``CLIPVisionModel`` /
``CLIPModel`` weights; :mod:`extractors.clip.files`) is recognised by its layout before the detector loaders read
it (:func:`claims`). The encoder then runs behind the interface :func:`extractors.run.run_extraction` and
:mod:`extractors.photos` drive a detector with, so decoding in workers, failures (``failures.jsonl``), resuming,
commits and signals are the detectors' own:

* :class:`ClipInputRule` is the photo loader's recipe: :func:`extractors.preprocess.recipe_blob` hands it the
  decoded photo and gets the encoder input of :func:`extractors.clip.recipe.prepare` and its geometry.
* :class:`ClipEncoder` is the detector: ``detect`` encodes a batch and returns one
  :class:`~pipeline.core.regions.RegionRecord` per photo, the grid cells row-major with their boxes in original
  pixels (:func:`extractors.clip.recipe.cell_boxes`) and the recipe's pooled vector as ``pooled`` (float32).
* The feature identity is ``clip-<architecture>`` (``clip-RN50``, ``clip-ViT-B-16``), the weights' SHA-256, the
  layout, the encoder config (``config.spec``), the recipe (name, input side, positional resize) and the precision.
* ``extract.clip_encoder`` gives the two settings the weights do not hold, the ViT MLP ``activation`` and the
  attention ``heads``, for files whose release config does not sit beside them (:func:`encoder_settings`).

The store keeps the pooled vector of each image beside its cells (the attention pool's output for the ResNets;
for the ViTs the class token under ``clip-vil``, ``encode_image`` under ``clip``): ``FeatureStore(S).get(key)
["pooled"]``, (P,) float32 (docs/extractor.md#clip). Captioners read the cells only.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from extractors.clip.files import (
    LAYOUTS,
    ClipWeightsError,
    check_strict,
    companion_config,
    is_torchscript,
    load_clip,
    read_clip,
    resolve_activation,
)
from extractors.clip.model import ACTIVATIONS, PRESETS, ClipVisionConfig, ConfigError, infer_config
from extractors.clip.recipe import RECIPES, ClipInput, ClipRecipe, cell_boxes, encode, prepare
from extractors.releases import OwnExtraction, Release, register_release
from extractors.weights import sha256_file
from pipeline.core.console import get_logger
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.identity import FeatureIdentity
from pipeline.core.regions import RegionRecord
from pipeline.core.tensor_bounds import BoundsError, check_archive

log = get_logger("extract")

#: the input side of each recipe (0: the encoder's own resolution)
RECIPE_SIZES = {"clip-vil": 448, "clip": 0}
#: the ``extract:`` / ``caption:`` shorthands a grid of cells has no use for
_BOX_SHORTHANDS = ("min_boxes", "max_boxes", "conf_thresh", "nms_thresh", "min_size", "max_size")
#: the ``extract:`` key of :func:`encoder_settings`
SETTINGS_KEY = "clip_encoder"


def _get(section: Any, key: str, default: Any = None) -> Any:
    return section[key] if key in section and section[key] is not None else default


# ------------------------------------------------------------------------------------------------ the file
def _keys(path: Path) -> list[str]:
    """The tensor names of a safetensors or ``torch.save`` file without reading its tensors ([] when unreadable)."""
    try:
        if path.suffix == ".safetensors":
            with open(path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > min(path.stat().st_size - 8, 100 << 20):
                    return []
                header = json.loads(fh.read(n))
            return [k for k in header if k != "__metadata__"] if isinstance(header, dict) else []
        check_archive(path)  # refuses TorchScript and oversized archives before torch reads the pickle
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (BoundsError, Exception):  # noqa: BLE001 - a file torch cannot read this way is not CLIP's to claim
        return []
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]
    return [k for k in obj if isinstance(k, str)] if isinstance(obj, Mapping) else []


@functools.lru_cache(maxsize=8)
def _names(path: Path) -> list[str]:
    """The tensor names of a weights file (:func:`_keys`) without a DataParallel ``module.`` prefix."""
    return [k[len("module.") :] if k.startswith("module.") else k for k in _keys(path)]


def _claims(path: str, _mtime_ns: int, _size: int) -> str | None:
    p = Path(path)
    if is_torchscript(p):
        return "openai"
    keys = _names(p)
    if any(k.startswith("vision_model.") for k in keys):
        return "hf"
    if any(k.startswith("visual.") for k in keys):
        return "open_clip"
    return None


def claims(path: Any) -> str | None:
    """The CLIP layout of the weights file ``path`` (``openai``: a TorchScript archive; ``hf``: ``vision_model.``
    keys; ``open_clip``: ``visual.`` keys), None for anything else; read by names only, never by running code."""
    p = Path(str(path))
    try:
        st = p.stat()
    except OSError:
        return None
    return _claims(str(p.resolve()), st.st_mtime_ns, st.st_size) if p.is_file() else None


def encoder_settings(section: Any, where: str = "extract") -> tuple[str | None, int | None]:
    """(activation, heads) of the section's ``clip_encoder`` mapping (None each: from the release's config beside
    the weights, else OpenAI's rules); a section without the key gives (None, None). One :class:`UsageError` line
    for an activation other than ``quick_gelu`` / ``gelu`` or a head count that is not a positive integer."""
    settings = _get(section, SETTINGS_KEY) if section is not None else None
    if settings is None:
        return None, None
    if not isinstance(settings, Mapping):
        raise UsageError(f"{where}.{SETTINGS_KEY} must be a mapping (activation, heads), not {settings!r}")
    unknown = sorted(set(settings) - {"activation", "heads"})
    if unknown:
        raise UsageError(f"{where}.{SETTINGS_KEY}.{unknown[0]}: unknown key (known here: activation, heads)")
    activation, heads = _get(settings, "activation"), _get(settings, "heads")
    if activation is not None and activation not in ACTIVATIONS:
        raise UsageError(
            f"{where}.{SETTINGS_KEY}.activation must be null, {' or '.join(ACTIVATIONS)}, not {activation!r}"
        )
    if heads is not None and (not isinstance(heads, int) or isinstance(heads, bool) or heads < 1):
        raise UsageError(f"{where}.{SETTINGS_KEY}.heads must be null or a positive integer, not {heads!r}")
    return activation, heads


def _refusal(exc: ClipWeightsError, section: Any, where: str) -> UsageError:
    """The loader's refusal as one usage line, naming the setting that would answer it."""
    setting = getattr(exc, "setting", None)
    hint = f" ({where}.{SETTINGS_KEY}.{setting})" if setting and section is not None else ""
    return UsageError(f"{exc}{hint}")


def check(section: Any, where: str = "extract", path: Any = None) -> str:
    """The recipe, box and encoder settings (:func:`encoder_settings`) of an ``extract:`` (or ``caption:``)
    section for CLIP weights -> ``grid``; one :class:`UsageError` line for a region detector's recipe, a box
    selection other than the grid or an encoder setting out of its range. With the weights ``path``, also what
    the file's names alone decide before any work: an open_clip ViT whose activation neither the config beside
    it nor the section gives (:func:`extractors.clip.files.resolve_activation`)."""
    activation, _heads = encoder_settings(section, where)
    if path is not None and activation is None and claims(path) == "open_clip":
        p = Path(str(path))
        vit = bool({"visual.proj", "visual.class_embedding"} & set(_names(p)))
        try:
            resolve_activation(p, "open_clip", vit, companion_config(p, "open_clip"), None)
        except ClipWeightsError as exc:
            raise _refusal(exc, section, where) from None
    name = str(_get(section, "recipe", "auto"))
    if name != "auto" and name not in RECIPES:
        raise UsageError(
            f"CLIP weights run the recipes {' | '.join(RECIPES)} ({where}.recipe / --recipe), not the region "
            f"detectors' {name!r}"
        )
    mode = _get(section, "boxes")
    if mode is not None and str(mode) != "grid":
        raise UsageError(f"--boxes {mode}: CLIP weights give grid features only (--boxes grid, or leave it out)")
    # caption.max_boxes is what the captioner gets, not a selection setting
    set_ = [k for k in _BOX_SHORTHANDS if _get(section, k) is not None and (k, where) != ("max_boxes", "caption")]
    if set_:
        log.warning("%s.%s: not used by CLIP grid features", where, f", {where}.".join(set_))
    return "grid"


def recipe_of(section: Any) -> ClipRecipe:
    """The section's CLIP recipe: ``recipe`` ``clip-vil`` (the default) or ``clip``."""
    name = str(_get(section, "recipe", "auto"))
    name = "clip-vil" if name == "auto" else name
    return ClipRecipe(name, RECIPE_SIZES[name])


# ------------------------------------------------------------------------------------------------ identity
def arch_name(cfg: ClipVisionConfig) -> str:
    """``RN50``, ``ViT-B-16``, ``ViT-L-14-336px`` for OpenAI's architectures (whatever the layout, projection or
    activation); ``RN-w<width>-<depths>`` or ``ViT-w<width>-d<blocks>-p<patch>`` for others (the head and MLP
    widths, where they are not OpenAI's, stand in the identity's ``config.spec``)."""
    for name, preset in PRESETS.items():
        same = (preset.kind, preset.width, preset.layers, preset.resolution, preset.patch, 0, 0)
        if same == (cfg.kind, cfg.width, cfg.layers, cfg.resolution, cfg.patch, cfg.head_width, cfg.mlp_dim):
            return name.replace("/", "-").replace("@", "-")
    if cfg.kind == "resnet":
        return f"RN-w{cfg.width}-{'.'.join(str(n) for n in cfg.layers)}"
    return f"ViT-w{cfg.width}-d{cfg.layers[0]}-p{cfg.patch}"


# ------------------------------------------------------------------------------------------------ the run
@dataclass(frozen=True)
class ClipSpec:
    """What the photo loader and the caption engine read of a detector's spec: ``feature_stride`` (input pixels
    per cell: the thin-image check) and no classes or attributes."""

    config: ClipVisionConfig
    num_classes: int = 1
    num_attributes: int = 1

    @property
    def feature_stride(self) -> int:
        return self.config.stride

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.config.to_dict()))


@dataclass(frozen=True)
class ClipInputRule:
    """The photo loader's recipe: ``recipe`` at the encoder's ``resolution``; ``selector`` ``grid`` (every cell)."""

    recipe: ClipRecipe
    resolution: int
    selector: str = "grid"

    @property
    def name(self) -> str:
        return self.recipe.name

    def input_blob(self, rgb: np.ndarray) -> tuple[np.ndarray, ClipInput]:
        """(3, S, S) float32 encoder input and its geometry (the input without its pixels)."""
        inp = prepare(rgb, self.recipe, self.resolution)
        return inp.blob, replace(inp, blob=np.empty(0, np.float32))

    def to_dict(self) -> dict[str, Any]:
        """The recipe as the identity records it: name, input side (resolved), positional resize."""
        return {
            "name": self.recipe.name,
            "size": self.recipe.size or self.resolution,
            "pos_resize": self.recipe.pos_resize,
        }


@dataclass(frozen=True)
class ClipSelector:
    """The selector :func:`extractors.run.run_extraction` and :func:`extractors.photos.detect_guarded` read."""

    recipe: ClipInputRule
    given: bool = False


class ClipEncoder(nn.Module):
    """A CLIP image encoder behind the detectors' interface (``spec``, ``detect``, ``configure``, ``settings``)."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.spec = ClipSpec(encoder.config)
        self.roi_chunk = 0  # the detectors' ROI batching setting; a grid has no ROIs
        self.clip_recipe = ClipRecipe()

    def configure(self, section: Any, where: str = "extract") -> tuple[ClipInputRule, ClipSelector]:
        check(section, where)
        self.clip_recipe = recipe_of(section)
        rule = ClipInputRule(self.clip_recipe, self.spec.config.resolution)
        log.info(
            "recipe %s: input %d px, positional resize %s", rule.name, rule.to_dict()["size"], rule.recipe.pos_resize
        )
        return rule, ClipSelector(rule)

    def settings(self, identity: FeatureIdentity, selector: ClipSelector, precision: str) -> FeatureIdentity:
        return replace(
            identity,
            spec=self.spec.to_dict(),
            recipe=selector.recipe.to_dict(),
            precision=str(precision),
            boxes={"mode": "grid"},
        )

    @torch.no_grad()
    def detect(self, blobs: list[Any], frames: list[ClipInput], selector: Any, given: Any = None) -> list[RegionRecord]:
        """One :class:`RegionRecord` per input: the cells of the encoder's grid, row-major, boxes in original pixels,
        and the recipe's pooled vector (:func:`extractors.clip.recipe.encode`)."""
        dev = next(self.parameters()).device
        x = torch.stack([torch.as_tensor(b) for b in blobs]).to(dev, non_blocking=True)
        fmap, pooled = encode(self.encoder, x, self.clip_recipe)
        n, c, h, w = fmap.shape
        feats = fmap.permute(0, 2, 3, 1).reshape(n, h * w, c).float().cpu().numpy()
        vectors = pooled.float().cpu().numpy()
        stride = self.spec.config.stride
        return [
            RegionRecord(
                features=np.ascontiguousarray(feats[i]),
                boxes=cell_boxes(frame, (h, w), stride),
                image_w=frame.width,
                image_h=frame.height,
                pooled=np.ascontiguousarray(vectors[i], dtype=np.float32),
            )
            for i, frame in enumerate(frames)
        ]


def load(
    path: Any, device: Any, section: Any = None, where: str = "extract"
) -> tuple[ClipEncoder, FeatureIdentity, dict[str, Any]]:
    """A CLIP weights file -> (encoder behind the detectors' interface, identity, info), as
    :func:`extractors.factory.load_for_inference` returns for a detector. ``section``: the ``extract:`` (or, with
    ``where`` ``caption``, the ``caption:``) section whose ``clip_encoder`` gives the activation and head count
    (:func:`encoder_settings`; None: none given)."""
    activation, heads = encoder_settings(section, where)
    try:
        encoder, info = load_clip(path, activation=activation, device="cpu", heads=heads)
    except ClipWeightsError as exc:
        raise _refusal(exc, section, where) from None
    cfg = info["config"]
    model = ClipEncoder(encoder).to(device).eval()
    info = {**info, "weights_sha256": sha256_file(path), "config": cfg.to_dict()}
    identity = FeatureIdentity(
        name=f"clip-{arch_name(cfg)}",
        weights_sha256=info["weights_sha256"],
        layout=info["layout"],
        spec=model.spec.to_dict(),
    )
    log.info(
        "CLIP %s encoder (%s weights, activation %s from %s, %d heads from %s) from %s",
        arch_name(cfg),
        info["layout"],
        cfg.activation,
        info["activation_from"],
        cfg.heads,
        info["heads_from"],
        path,
    )
    return model, identity, info


def verify(path: Path) -> None:
    """The strict reader of a downloaded CLIP file (catalogue kind ``clip``): a CLIP image encoder in any of its
    layouts (docs/extractor.md#clip), every key and shape checked; one :class:`PipelineError` line otherwise."""
    layout, sd = read_clip(path)
    try:
        cfg = infer_config(sd, head_width=1)  # the head count changes no shape
    except (ConfigError, ValueError) as exc:
        raise PipelineError(f"{path} ({layout}): not a CLIP image encoder: {exc}") from None
    check_strict(path, layout, sd, cfg)


# The CLIP-ViL grid features: the release the importers name, whose encoders ``cli extract`` and ``caption`` run
# through the records above (not through the region detectors' layouts and selections).
register_release(
    Release(
        name="clip-vil",
        source="clip-vil/CLIP-ViL CLIP-ViL-Direct/caption/scripts/clip_prepro_feats.py (CLIP grid at 448x448)",
        selectors=(),
        import_formats=("clip-vil",),  # the *_clip_<model>_att / *_fc folders of clip_prepro_feats.py
        own=OwnExtraction(
            claims=claims, check=check, load=load, kind="clip", verify=verify, recipes=RECIPES, layouts=LAYOUTS
        ),
    )
)

__all__ = ["ClipEncoder", "ClipInputRule", "ClipSelector", "ClipSpec", "arch_name", "check", "claims", "load", "verify"]
