"""Building a detector for ``cli extract``: from a weights file (strict) or ``random`` (smoke tests only)."""

from __future__ import annotations

from typing import Any

import torch

from extractors import EXTRACTORS, available_extractors
from extractors.weights import load_detector, random_detector
from pipeline.core.console import get_logger
from pipeline.core.distributed import resolve_device  # noqa: F401  (the one resolver; imported from here by older callers)
from pipeline.core.errors import UsageError

log = get_logger("extract")


def build_for_extract(weights: str, preset: str, spec_overrides: dict[str, Any], min_size: int, max_size: int, seed: int, device: torch.device):
    """-> (detector on ``device`` with folded BN, extractor identity dict for the store)."""
    model, identity, _info = load_for_inference(weights, preset, spec_overrides, min_size, max_size, seed, device)
    return model, identity


def load_for_inference(
    weights: str, preset: str, spec_overrides: dict[str, Any], min_size: int | None, max_size: int | None, seed: int, device: torch.device
):
    """-> (detector, store identity, loader info incl. class/attribute names when the file has them).

    ``min_size``/``max_size`` ``None`` keep the test scale the weights file defines (600/1000 for public files).
    """
    known = available_extractors()  # imports the preset modules so that the registry is filled
    if preset != "auto" and preset not in known:
        EXTRACTORS.get(preset)  # raises the UsageError listing the known presets
    if weights == "random":
        spec = EXTRACTORS.get("bottom-up-caffe-r101" if preset == "auto" else preset)()
        spec = spec.with_overrides(dict(spec_overrides), "extract.spec")
        spec = spec.with_(min_size=spec.min_size if min_size is None else min_size, max_size=spec.max_size if max_size is None else max_size)
        log.warning("=" * 60)
        log.warning("--weights random: RANDOM detector weights (seed %d). The features are meaningless;", seed)
        log.warning("use this for smoke tests and benchmarks only.")
        log.warning("=" * 60)
        model = random_detector(spec, seed)
        info = {"layout": "random", "weights_sha256": f"random-seed-{seed}", "weights_file": "random"}
        name = "bottom-up-random"
    else:
        spec = None if preset == "auto" else EXTRACTORS.get(preset)()
        if spec_overrides:
            raise UsageError("extract.spec overrides apply to --weights random only; a weights file defines its architecture")
        model, info = load_detector(weights, spec)
        spec = model.set_test_recipe(
            min_size=model.spec.min_size if min_size is None else min_size,
            max_size=model.spec.max_size if max_size is None else max_size,
        ).spec
        name = f"bottom-up-{info['layout']}"
    model = model.to(device).fold_batchnorm()
    identity = {"name": name, "weights_sha256": info["weights_sha256"], "layout": info["layout"], "config": {"spec": spec.to_dict()}}
    return model, identity, info
