"""Building a detector for ``cli extract``: from a weights file (strict) or ``random`` (smoke tests only)."""

from __future__ import annotations

from typing import Any

import torch

from extractors import EXTRACTORS, available_extractors
from extractors.weights import load_detector
from extractors.random_weights import random_detector
from pipeline.core.console import get_logger
from pipeline.core.distributed import resolve_device  # noqa: F401  (the one resolver; imported from here by older callers)
from pipeline.core.errors import UsageError

log = get_logger("extract")


def load_for_inference(weights: str, preset: str, spec_overrides: dict[str, Any], seed: int, device: torch.device):
    """-> (detector, store identity, loader info incl. class/attribute names when the file has them).

    The detector carries the weights' own test values; :func:`configure_recipe` then applies a recipe.
    """
    known = available_extractors()  # imports the preset modules so that the registry is filled
    if preset != "auto" and preset not in known:
        EXTRACTORS.get(preset)  # raises the UsageError listing the known presets
    if weights == "random":
        spec = EXTRACTORS.get("bottom-up-caffe-r101" if preset == "auto" else preset)()
        spec = spec.with_overrides(dict(spec_overrides), "extract.spec")
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
        name = f"bottom-up-{info['layout']}"
    model = model.to(device).fold_batchnorm()
    identity = {"name": name, "weights_sha256": info["weights_sha256"], "layout": info["layout"], "config": {"spec": model.spec.to_dict()}}
    return model, identity, info


def configure_recipe(model, identity: dict[str, Any], section: Any, where: str = "extract", shorthands: tuple[str, ...] | None = None):
    """The run's recipe from a config ``section`` (:func:`extractors.recipes.recipe_from_config`), applied to
    ``model`` (input scale, proposal settings) and recorded in ``identity`` next to the weights' SHA-256
    (``identity["config"]["recipe"]``: its name and every value). Returns (resolved recipe, selector)."""
    from extractors.recipes import SHORTHANDS, apply_recipe, describe_recipe, recipe_from_config
    from extractors.selector import make_selector

    recipe = apply_recipe(model, recipe_from_config(section, identity.get("layout", "random"), model.spec.flavor, where,
                                                    SHORTHANDS if shorthands is None else shorthands))
    identity["config"]["recipe"] = recipe.to_dict()
    identity["config"]["spec"] = model.spec.to_dict()
    log.info("recipe %s: %s", recipe.name, "; ".join(f"{k} {v}" for k, v in describe_recipe(recipe)[1:]))
    return recipe, make_selector(recipe, model.spec)
