"""Bounds on the architecture a detector weights file declares, checked before any module is built
(docs/extractor.md#bounds-on-weights-files).

The layouts infer the architecture from the keys and shapes of the file (:func:`extractors.weights.infer_spec`,
:func:`extractors.vinvl.layout.infer_vinvl_spec`, :func:`extractors.grid.infer_grid_spec`) or read it from the file
(a ``butd`` file's ``spec``). Before that architecture is built, even on the meta device:

* every key's block index is below :data:`MAX_BLOCKS` (:func:`check_keys`; a stray ``res4.999999`` key would
  otherwise ask for a million blocks);
* every tensor the inference reads has the rank of its role (conv weights 4-d, linear weights 2-d) and no empty
  dimension (:func:`dims`); a grouped conv's inputs per group divide its channels (:func:`groups_of`);
* the resulting :class:`~extractors.spec.BottomUpSpec` has at most :data:`MAX_STAGES` stages of at most
  :data:`MAX_BLOCKS` blocks, widths from 1 to :data:`MAX_WIDTH`, groups dividing the bottleneck width, and class /
  attribute counts up to :data:`MAX_OUTPUTS` (:func:`check_spec`).

What a file's tensors may declare against the bytes they hold is bounded by :mod:`pipeline.core.tensor_bounds`.
Every refusal is one :class:`~extractors.weights.WeightsError` line naming the file and the key.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from extractors.spec import BottomUpSpec

MAX_BLOCKS = 128
"""Blocks of one ResNet stage (ResNet-152 / ResNeXt-152: 36 in res4)."""
MAX_STAGES = 5
"""Backbone stages before the RoI head (C4 backbones: res2..res4)."""
MAX_WIDTH = 1 << 16
"""Channels of any conv, and widths of the attribute head (the largest public detectors: 2048)."""
MAX_OUTPUTS = 1 << 20
"""Classes or attributes of a head (Visual Genome: 1,601 and 401)."""

_BLOCK = re.compile(r"(?:^|\.)(?:res|layer)\d+\.(\d+)\.")


def _err(path: Any, layout: str, msg: str):
    from extractors.weights import WeightsError  # noqa: PLC0415 -- cycle: extractors.weights imports this module

    return WeightsError(f"weights file {path} ({layout}): {msg}")


def check_keys(path: Any, layout: str, keys: Any) -> None:
    """Refuse a key whose block index is :data:`MAX_BLOCKS` or more (before block counts are inferred from keys)."""
    for key in keys:
        m = _BLOCK.search(key)
        if m and int(m.group(1)) >= MAX_BLOCKS:
            raise _err(
                path, layout, f"key '{key}': block {m.group(1)} of a stage; a stage holds at most {MAX_BLOCKS} blocks"
            )


def dims(sd: Mapping[str, torch.Tensor], key: str, rank: int, path: Any, layout: str) -> tuple[int, ...]:
    """The shape of ``sd[key]``: present, of ``rank`` dimensions (4: conv weight, 2: linear weight), each 1..MAX."""
    if key not in sd:
        raise _err(path, layout, f"missing key '{key}'")
    shape = tuple(int(s) for s in sd[key].shape)
    role = {4: "conv weight", 2: "linear weight", 1: "vector"}.get(rank, "tensor")
    if len(shape) != rank:
        raise _err(path, layout, f"key '{key}' has shape {list(shape)}; a {rank}-d {role} is expected")
    largest = max(MAX_WIDTH, MAX_OUTPUTS)
    for i, s in enumerate(shape):
        if s == 0:
            raise _err(path, layout, f"key '{key}' has shape {list(shape)}: width 0 in dimension {i}")
        if s > largest:
            raise _err(path, layout, f"key '{key}' has shape {list(shape)}: more than {largest:,} in dimension {i}")
    return shape


def groups_of(sd: Mapping[str, torch.Tensor], key: str, path: Any, layout: str) -> tuple[int, int]:
    """(channels, groups) of the grouped 3x3 conv ``key`` (weight: channels x inputs per group x 3 x 3)."""
    channels, per_group = dims(sd, key, 4, path, layout)[:2]
    if channels % per_group:
        raise _err(
            path,
            layout,
            f"key '{key}' has shape {list(sd[key].shape)}: {per_group} inputs per group "
            f"do not divide its {channels} channels into a whole number of groups",
        )
    return channels, channels // per_group


def check_spec(spec: BottomUpSpec, path: Any, layout: str, key: str = "spec") -> BottomUpSpec:
    """Refuse an architecture past the bounds above; ``key`` names where it came from (keys or a stored ``spec``)."""

    def refuse(field: str, why: str):
        return _err(path, layout, f"{key} '{field}' = {getattr(spec, field)!r}: {why}")

    if len(spec.stage_blocks) > MAX_STAGES:
        raise refuse("stage_blocks", f"at most {MAX_STAGES} stages")
    if any(not isinstance(b, int) or b > MAX_BLOCKS for b in (*spec.stage_blocks, spec.res5_blocks)):
        field = "stage_blocks" if spec.res5_blocks <= MAX_BLOCKS else "res5_blocks"
        raise refuse(field, f"at most {MAX_BLOCKS} blocks per stage")
    for field in (
        "stem_channels",
        "res2_bottleneck",
        "expansion",
        "rpn_channels",
        "attr_embed_dim",
        "attr_hidden",
        "groups",
    ):
        value = getattr(spec, field)
        if not isinstance(value, int) or not 1 <= value <= MAX_WIDTH:
            raise refuse(field, f"a width from 1 to {MAX_WIDTH:,} is expected")
    if spec.res2_bottleneck % spec.groups:
        raise refuse("groups", f"the groups do not divide the bottleneck width {spec.res2_bottleneck}")
    if spec.feature_dim > MAX_WIDTH:
        raise refuse("res2_bottleneck", f"its stages widen to {spec.feature_dim:,} channels, more than {MAX_WIDTH:,}")
    for field in ("num_classes", "num_attributes"):
        value = getattr(spec, field)
        if not isinstance(value, int) or not 2 <= value <= MAX_OUTPUTS:
            raise refuse(field, f"from 2 to {MAX_OUTPUTS:,} are expected")
    try:
        anchors = spec.num_anchors
    except TypeError:
        anchors = 0
    if not 1 <= anchors <= 64:
        raise refuse(spec.anchor_field, "from 1 to 64 anchors per cell are expected")
    return spec


MAX_META_VALUES = 1_000_000
"""Values (each visit counted, so shared references count every time) in a ``butd`` file's metadata."""


def check_meta(path: Any, meta: Mapping[str, Any]) -> None:
    """Refuse ``butd`` metadata (spec, class names, training record) past :data:`MAX_META_VALUES` values or 20 levels:
    ``cli info`` prints it, and a few hundred bytes of shared references can stand for terabytes of text."""
    count = 0

    def walk(value: Any, key: str, depth: int) -> None:
        nonlocal count
        count += 1
        if count > MAX_META_VALUES or depth > 20:
            raise _err(
                path, "butd", f"key '{key}': the metadata holds more than {MAX_META_VALUES:,} values or 20 levels"
            )
        if isinstance(value, Mapping):
            for v in value.values():
                walk(v, key, depth + 1)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, key, depth + 1)
        elif isinstance(value, torch.Tensor) and value.numel() > MAX_OUTPUTS:
            raise _err(path, "butd", f"key '{key}': a tensor of {value.numel():,} elements in the metadata")

    for key, value in meta.items():
        walk(value, str(key), 0)
