"""What the loaders of the releases' own weights layouts share (docs/extractor.md#weights-layouts).

A release whose files are not in a bottom-up layout (:mod:`extractors.weights`) registers its own ``detect`` /
``normalise`` / ``load`` / ``describe`` (:class:`extractors.releases.Release`); those read the file's keys with
the helpers here: the ``module.`` prefix of a DataParallel save, the number of blocks per stage, the state-dict
table of the detector a spec builds, and the strict check. Loading is strict: one error line names every missing
and every unexpected key (up to five each); shapes must match the architecture inferred from the file.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any, Callable, Mapping

import torch

from extractors.spec import BottomUpSpec
from extractors.weights import WeightsError


def layout_error(path: Any, layout: str, msg: str) -> WeightsError:
    """The one-line refusal of a weights file of ``layout``."""
    return WeightsError(f"weights file {path} ({layout}): {msg}")


def plain_keys(sd: Mapping[str, Any]) -> list[str]:
    """The keys with a ``module.`` prefix dropped."""
    return [k[7:] if k.startswith("module.") else k for k in sd]


def normalise(sd: "OrderedDict[str, torch.Tensor]") -> "OrderedDict[str, torch.Tensor]":
    """Strip the ``module.`` prefix when *every* key carries it (maskrcnn_benchmark ``strip_prefix_if_present``)."""
    if sd and all(k.startswith("module.") for k in sd):
        return OrderedDict((k[7:], v) for k, v in sd.items())
    return sd


def stage_blocks(sd: Mapping[str, Any], pattern: str) -> dict[int, int]:
    """Stage -> number of blocks, from the keys matching ``pattern`` (groups: stage, block index)."""
    rx = re.compile(pattern)
    out: dict[int, int] = {}
    for k in sd:
        m = rx.match(k)
        if m:
            s, i = int(m.group(1)), int(m.group(2))
            out[s] = max(out.get(s, 0), i + 1)
    return out


def state_table(detector: Callable[[BottomUpSpec], torch.nn.Module], spec: BottomUpSpec) -> "OrderedDict[str, tuple]":
    """Key -> shape of the state dict of ``detector(spec)``, built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        model = detector(spec)
    return OrderedDict((k, tuple(v.shape)) for k, v in model.state_dict().items())


def strict_check(
    path: Any,
    layout: str,
    sd: Mapping[str, torch.Tensor],
    table: Mapping[str, tuple[int, ...]],
    optional: set[str],
    allowed_prefixes: tuple[str, ...] = (),
) -> None:
    """One line naming every missing and unexpected key (five of each at most), then the first wrong shape."""
    missing = [k for k in table if k not in sd and k not in optional]
    extra = [k for k in sd if k not in table and not k.startswith(allowed_prefixes)]
    if missing or extra:
        parts = []
        for name, keys in (("missing", missing), ("unexpected", extra)):
            if keys:
                parts.append(
                    f"{len(keys)} {name} key{'s' if len(keys) > 1 else ''} "
                    f"({', '.join(repr(k) for k in keys[:5])}{', ...' if len(keys) > 5 else ''})"
                )
        raise layout_error(path, layout, "; ".join(parts))
    for k, shp in table.items():
        if k in sd and tuple(sd[k].shape) != tuple(shp):
            raise layout_error(path, layout, f"key '{k}' has shape {list(sd[k].shape)}, expected {list(shp)}")
    for k, v in sd.items():
        if not v.is_floating_point() or not bool(torch.isfinite(v).all()):
            raise layout_error(
                path, layout, f"key '{k}' holds {'non-float' if not v.is_floating_point() else 'non-finite'} values"
            )
