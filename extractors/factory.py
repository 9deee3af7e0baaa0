"""Building a detector for ``cli extract``: from a weights file (strict) or ``random`` (smoke tests only)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from extractors import EXTRACTORS, available_extractors
from extractors.random_weights import random_detector
from extractors.recipes import SHORTHANDS, apply_recipe, describe_recipe, recipe_from_config
from extractors.releases import release_of_flavor, release_of_layout, release_of_weights
from extractors.selector import make_selector
from extractors.weights import load_detector, sha256_file
from pipeline.core.console import get_logger
from pipeline.core.errors import UsageError
from pipeline.core.fileio import read_json
from pipeline.core.identity import FeatureIdentity

log = get_logger("extract")


def read_labelmap(path: str) -> tuple[list[str], list[str]]:
    """(class names, attribute names) in 0-based vocabulary order from a VinVL labelmap json
    (``VG-SGG-dicts-vgoi6-clipped.json``: 1-based ``label_to_idx`` and ``attribute_to_idx``, docs/recipes.md#vinvl)."""
    data = read_json(path, "labelmap")

    def names(table_key: str) -> list[str]:
        table = data.get(table_key) if isinstance(data, dict) else None
        if table is None:
            return []
        if not isinstance(table, dict) or any(
            not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in table.values()
        ):
            raise UsageError(f"labelmap {path}: '{table_key}' must map names to 1-based integer ids")
        ids = sorted(table.values())
        if ids != list(range(1, len(ids) + 1)):
            raise UsageError(f"labelmap {path}: '{table_key}' ids are not 1..{len(ids)} without gaps")
        return [name for name, _ in sorted(table.items(), key=lambda kv: kv[1])]

    classes = names("label_to_idx")
    if not classes:
        raise UsageError(f"labelmap {path}: no 'label_to_idx' table")
    return classes, names("attribute_to_idx")


def load_for_inference(
    weights: str,
    preset: str,
    spec_overrides: dict[str, Any],
    seed: int,
    device: torch.device,
    labelmap: str | None = None,
    section: Any = None,
    where: str = "extract",
) -> tuple[Any, FeatureIdentity, dict[str, Any]]:
    """-> (detector, its :class:`FeatureIdentity`, loader info incl. class/attribute names when the file has them).

    The detector carries the weights' own test values; :func:`configure_recipe` then applies a recipe and
    :func:`record_settings` records it in the identity. ``labelmap``: a VinVL labelmap json naming the classes and
    attributes (its SHA-256 goes in the identity). ``section``: the command's config section (``where``:
    ``extract`` or ``caption``), handed to a release that loads its own weights
    (:attr:`extractors.releases.OwnExtraction.load`; None: no settings of its own given).
    """
    known = available_extractors()  # imports the preset modules so that the registry is filled
    claimed = release_of_weights(weights)
    if claimed is not None:  # weights that are not a region detector's (CLIP encoders): the release loads them
        if preset != "auto" or spec_overrides or labelmap:
            raise UsageError(f"{weights}: {claimed[0].name} weights take no extract.preset, extract.spec or labelmap")
        return claimed[0].own.load(weights, device, section, where)
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
        name = release_of_flavor(spec.flavor).random_identity or "bottom-up-random"
    else:
        spec = None if preset == "auto" else EXTRACTORS.get(preset)()
        if spec_overrides:
            raise UsageError(
                "extract.spec overrides apply to --weights random only; a weights file defines its architecture"
            )
        model, info = load_detector(weights, spec)
        release = release_of_layout(info["layout"])
        name = release.identity_name(info["layout"]) if release is not None else f"bottom-up-{info['layout']}"
    model = model.to(device).fold_batchnorm()
    labelmap_sha256 = None
    if labelmap:
        info["classes"], info["attributes"] = read_labelmap(labelmap)
        n_cls, n_att = model.spec.num_classes - 1, model.spec.num_attributes - 1
        if len(info["classes"]) != n_cls or (info["attributes"] and len(info["attributes"]) != n_att):
            raise UsageError(
                f"labelmap {labelmap} names {len(info['classes'])} classes / {len(info['attributes'])} attributes; "
                f"the detector has {n_cls} / {n_att}"
            )
        labelmap_sha256 = sha256_file(labelmap)
    identity = FeatureIdentity(
        name=name,
        weights_sha256=info["weights_sha256"],
        layout=info["layout"],
        spec=model.spec.to_dict(),
        labelmap_sha256=labelmap_sha256,
    )
    return model, identity, info


def configure_recipe(
    model, layout: str, section: Any, where: str = "extract", shorthands: tuple[str, ...] | None = None
):
    """The run's recipe from a config ``section`` (:func:`extractors.recipes.recipe_from_config`) for weights of
    ``layout``, applied to ``model`` (input scale, proposal settings). Returns (resolved recipe, selector);
    :func:`record_settings` records them in the feature identity."""
    if hasattr(model, "configure"):  # a release's own encoder (extractors.releases.OwnExtraction)
        return model.configure(section, where)
    recipe = apply_recipe(
        model,
        recipe_from_config(
            section, layout or "random", model.spec.flavor, where, SHORTHANDS if shorthands is None else shorthands
        ),
    )
    release = release_of_layout(layout)
    if release is not None and release.grid_only and recipe.selector != "grid":
        raise UsageError(
            f"{layout} weights hold a backbone for grid features only (recipe {recipe.name!r} selects regions): "
            "use --boxes grid"
        )
    log.info("recipe %s: %s", recipe.name, "; ".join(f"{k} {v}" for k, v in describe_recipe(recipe)[1:]))
    return recipe, make_selector(recipe, model.spec)


def record_settings(identity: FeatureIdentity, model, selector, precision: str) -> FeatureIdentity:
    """``identity`` with the settings that determine the features: the detector's spec after the recipe was applied
    (``config.spec``), the resolved test-time recipe (``config.recipe``: its name and every value), its box selection
    in short (``config.boxes``) and the precision. What ``extract`` and ``caption --cache`` store next to the
    weights' SHA-256, and what :meth:`FeatureIdentity.settings_diff` compares."""
    if hasattr(model, "settings"):  # a release's own encoder (extractors.releases.OwnExtraction)
        return model.settings(identity, selector, precision)
    r = selector.recipe
    return replace(
        identity,
        spec=model.spec.to_dict(),
        recipe=r.to_dict(),
        precision=str(precision),
        boxes={"mode": r.selector, "min": r.min_boxes, "max": r.max_boxes, "conf": r.conf_thresh, "nms": r.nms_thresh},
    )
