"""Test-time recipes: how each public release turns a photo into regions with the same detector weights.

The bottom-up Faster R-CNN of Anderson et al. (2018) exists in three public test-time pipelines that share
the network but not the steps around it (docs/recipes.md states each in full and tabulates the differences):

* ``caffe``: peteanderson80/bottom-up-attention ``tools/generate_tsv.py`` and its line-for-line port in
  MILVLG/bottom-up-attention.pytorch (caffe mode): BGR, means subtracted *before* a cv2 linear resize by one
  factor (short side 600, long side <= 1000), per-class NMS 0.3 over the proposals, keep ``max_conf >= 0.2``
  clamped to [10, 100] (or [36, 36]), write the proposal boxes divided by the scale.
* ``hf``: huggingface/transformers ``examples/research_projects/lxmert`` (``processing_image.py`` +
  ``modeling_frcnn.py``, weights ``unc-nlp/frcnn-vg-finetuned``): detectron2 size rule (short 800, long
  <= 1333, ``int(x + 0.5)``), ``torch.nn.functional.interpolate`` bilinear on the float image, means
  subtracted after; the NMS ladder 0.5, 0.6, 0.7 over the regressed box of each proposal's best class until
  36 survive; boxes clipped in resized pixels, then scaled by separate x and y factors.
* ``airsplay``: airsplay/py-bottom-up-attention ``demo/detectron2_mscoco_proposal_maxnms.py`` (detectron2
  ``DefaultPredictor`` preprocessing): the same size rule at 600/1000, PIL bilinear on the uint8 image; the
  ladder 0.3, 0.4 ... 0.9 until at least 36 survive, first 36; detectron2 ``detector_postprocess`` (scale,
  clip to the original image, drop empty boxes).

The values live in ``configs/extract.yaml`` (``extract.recipes``); :func:`recipe_from_config` is the one
function that turns a config section into the recipe a run uses (every command that runs the detector calls
it). ``null`` numbers mean "the weights' own" (the test scale and proposal counts a weights file defines:
600/1000, 6000/300/0.7 for the public files, the trained scale for a detector trained here).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

from extractors import available_extractors
from extractors.releases import available_releases, layout_recipes, release_of_flavor
from pipeline.core.config import load_config
from pipeline.core.errors import UsageError

CHOICES: dict[str, tuple[str, ...]] = {
    "colour": ("bgr", "rgb"),
    "resize": ("caffe", "shortest-edge", "mrcnn"),
    "interpolation": ("cv2-linear", "torch-bilinear", "pil-bilinear"),
    "nms_variant": ("torchvision", "legacy-cuda", "legacy-cpu"),
    "rescale": ("im-scale", "per-axis"),
    "clip": ("none", "resized", "resized-and-original"),
}
BOX_MODES = ("adaptive", "36", "given", "grid")
SHORTHANDS = ("min_size", "max_size", "min_boxes", "max_boxes", "conf_thresh", "nms_thresh")


@dataclass(frozen=True)
class Recipe:
    """Every test-time value of one release (see the module docstring and docs/recipes.md).

    Preprocessing: ``colour`` (channel order fed to the network), ``pixel_mean``/``pixel_std`` (per channel
    in the fed order; ``None`` mean = the weights' own), ``resize`` (``caffe``: one factor ``min/short``
    unless ``round(factor * long) > max``; ``shortest-edge``: detectron2 ``ResizeShortestEdge`` with
    ``int(x + 0.5)`` sizes), ``interpolation`` (``cv2-linear`` on the mean-subtracted float image,
    ``torch-bilinear`` on the float image, ``pil-bilinear`` on the uint8 image), ``min_size``/``max_size``.
    Proposals: ``pre_nms_topk``, ``post_nms_topk``, ``rpn_nms_thresh`` (``None`` = the weights' own).
    Selection: ``selector`` with ``nms_thresh``/``conf_thresh`` (per-class NMS), ``ladder`` (NMS ladder),
    ``min_boxes``/``max_boxes``. Rescaling: ``rescale`` (divide by the one factor, or multiply by
    original/resized per axis), ``clip`` (where boxes are clipped), ``drop_empty`` (detectron2
    ``detector_postprocess`` drops boxes with no area after clipping).
    VinVL (maskrcnn_benchmark, docs/recipes.md#vinvl): ``resize: mrcnn`` (long side ``int()``-truncated),
    ``to_bgr255`` (``ToTensor`` then ``[2, 1, 0] * 255`` in float32), ``selector: vinvl`` with ``nms_filter``
    (0/1/2), ``ignore_box_regression``, ``roi_nms_thresh`` (``ROI_HEADS.NMS``), ``nms_variant`` (which NMS
    kernel), ``attr_thresh`` / ``max_attrs_per_image`` (attribute post-processing). Grid features
    (docs/recipes.md#grid): ``selector: grid``, ``grid`` (k x k average pooling, 0 = every cell),
    ``res5_dilation`` (1 = stride-2 res5, grid-feats-vqa's extraction geometry).
    """

    name: str
    colour: str = "bgr"
    pixel_mean: tuple[float, ...] | None = None
    pixel_std: tuple[float, ...] | None = (1.0, 1.0, 1.0)
    resize: str = "caffe"
    interpolation: str = "cv2-linear"
    min_size: int | None = None
    max_size: int | None = None
    pre_nms_topk: int | None = None
    post_nms_topk: int | None = None
    rpn_nms_thresh: float | None = None
    selector: str = "per-class-nms"
    nms_thresh: float = 0.3
    conf_thresh: float = 0.2
    ladder: tuple[float, ...] = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    min_boxes: int = 10
    max_boxes: int = 100
    rescale: str = "im-scale"
    clip: str = "none"
    drop_empty: bool = False
    to_bgr255: bool = False
    nms_filter: int = 1
    ignore_box_regression: bool = True
    roi_nms_thresh: float = 0.5
    nms_variant: str = "torchvision"
    attr_thresh: float = 0.05
    max_attrs_per_image: int = 100
    grid: int = 0
    res5_dilation: int = 1

    def to_dict(self) -> dict[str, Any]:
        """Plain values (tuples as lists) for JSON, the store identity and ``cli info``. The fields only one
        selection reads (its ``fields``: VinVL's post-processing, the grid's pooling) appear only for that selection
        (``to_bgr255`` when true), so the identity of a bottom-up recipe holds the bottom-up values alone."""
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        registered = selections()
        chosen = registered.get(self.selector)
        own = set(chosen.fields) if chosen is not None else set()
        for selection in registered.values():
            for key in set(selection.fields) - own:
                out.pop(key, None)
        if not self.to_bgr255:
            out.pop("to_bgr255")
        return out

    def with_(self, **changes: Any) -> "Recipe":
        return replace(self, **changes)

    @property
    def resolved(self) -> bool:
        """True once the weights' own values have filled every ``None``."""
        return all(getattr(self, k) is not None for k in _NULLABLE)


def selections() -> dict[str, Any]:
    """Selection name -> its :class:`extractors.selector.Selector` class (each release module imported first, so
    that the selections only its detector runs are registered)."""
    available_extractors()
    from extractors.selector import SELECTORS  # noqa: PLC0415 -- loads torch: command help imports this module

    return SELECTORS


_INT = (
    "min_size",
    "max_size",
    "pre_nms_topk",
    "post_nms_topk",
    "min_boxes",
    "max_boxes",
    "max_attrs_per_image",
    "grid",
)
_FLOAT = ("rpn_nms_thresh", "nms_thresh", "conf_thresh", "roi_nms_thresh", "attr_thresh")
_NULLABLE = ("pixel_mean", "pixel_std", "min_size", "max_size", "pre_nms_topk", "post_nms_topk", "rpn_nms_thresh")
_BOOL = ("drop_empty", "to_bgr255", "ignore_box_regression")
_SET = {"nms_filter": (0, 1, 2), "res5_dilation": (1, 2)}


def _number(where: str, key: str, value: Any, kind: type) -> Any:
    ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok:
        raise UsageError(f"{where}.{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


def _floats(where: str, key: str, value: Any, length: int | None = None) -> tuple[float, ...]:
    if not isinstance(value, (list, tuple)) or any(
        isinstance(v, bool) or not isinstance(v, (int, float)) for v in value
    ):
        raise UsageError(f"{where}.{key} must be a list of numbers, got {value!r}")
    if length is not None and len(value) != length:
        raise UsageError(f"{where}.{key} must have {length} values, got {len(value)}")
    if not value:
        raise UsageError(f"{where}.{key} must not be empty")
    return tuple(float(v) for v in value)


def check_value(where: str, key: str, value: Any) -> Any:
    """One recipe field, type-checked and normalised; a wrong type or value is a :class:`UsageError` naming it."""
    if value is None and key in _NULLABLE:
        return None
    if key == "selector":
        names = list(selections())
        if value not in names:
            raise UsageError(f"{where}.selector must be one of {', '.join(names)}, not {value!r}")
        return value
    if key in CHOICES:
        if value not in CHOICES[key]:
            raise UsageError(f"{where}.{key} must be one of {', '.join(CHOICES[key])}, not {value!r}")
        return value
    if key in _INT:
        v = _number(where, key, value, int)
        if v < (0 if key in ("min_boxes", "max_attrs_per_image", "grid") else 1):
            raise UsageError(f"{where}.{key} must be positive, got {v}")
        return v
    if key in _FLOAT:
        v = _number(where, key, value, float)
        if not 0.0 <= v <= 1.01:
            raise UsageError(f"{where}.{key} must lie in [0, 1], got {v}")
        return v
    if key in ("pixel_mean", "pixel_std"):
        v = _floats(where, key, value, 3)
        if key == "pixel_std" and any(s == 0 for s in v):
            raise UsageError(f"{where}.pixel_std must not contain 0")
        return v
    if key == "ladder":
        v = _floats(where, key, value)
        if any(not 0.0 <= t <= 1.0 for t in v):
            raise UsageError(f"{where}.ladder thresholds must lie in [0, 1], got {list(v)}")
        return v
    if key in _BOOL:
        if not isinstance(value, bool):
            raise UsageError(f"{where}.{key} must be true or false, got {value!r}")
        return value
    if key in _SET:
        if isinstance(value, bool) or value not in _SET[key]:
            raise UsageError(f"{where}.{key} must be one of {', '.join(map(str, _SET[key]))}, not {value!r}")
        return int(value)
    raise UsageError(
        f"unknown recipe field {where}.{key} (known: {', '.join(f.name for f in fields(Recipe) if f.name != 'name')})"
    )


def recipe_from_mapping(name: str, values: Mapping[str, Any], where: str) -> Recipe:
    """A :class:`Recipe` from a mapping of its fields (unknown names and wrong types refused)."""
    if not isinstance(values, Mapping):
        raise UsageError(f"{where} must be a mapping of recipe fields, got {values!r}")
    kw = {key: check_value(where, str(key), val) for key, val in values.items()}
    return check_recipe(Recipe(name=name, **kw), where)


def check_recipe(recipe: Recipe, where: str) -> Recipe:
    """Combinations the releases cannot run (one-line :class:`UsageError`)."""
    if recipe.min_boxes > recipe.max_boxes:
        raise UsageError(f"{where}: min_boxes {recipe.min_boxes} exceeds max_boxes {recipe.max_boxes}")
    selections()[recipe.selector].check(recipe, where)
    return recipe


def _section_get(section: Any, key: str, default: Any = None) -> Any:
    if section is None:
        return default
    try:
        return section[key] if key in section else default
    except TypeError:
        return getattr(section, key, default)


def _plain(value: Any) -> Any:
    return value.to_dict() if hasattr(value, "to_dict") else value


def default_recipes() -> dict[str, Any]:
    """The release recipes of ``configs/extract.yaml`` (``extract.recipes``): the one place they are written."""
    return _plain(load_config("extract").extract.recipes)


def recipe_names() -> list[str]:
    """Every recipe ``--recipe`` takes: the ``extract.recipes`` entries of ``configs/extract.yaml``, then the
    releases' own (:attr:`extractors.releases.OwnExtraction.recipes`: CLIP's); ``cli info --releases`` prints
    them. Imports the extractor modules."""
    own = [name for release in available_releases() for name in release.recipes if release.own is not None]
    return list(dict.fromkeys([*default_recipes(), *own]))


def recipe_name_for(layout: str, flavor: str = "caffe") -> str:
    """The default recipe of a weights layout: its release's (a random detector follows the release of its
    semantics: caffe, hf or vinvl)."""
    recipes = layout_recipes()
    if layout in recipes:
        return recipes[layout]
    return release_of_flavor(flavor).recipe_name


def grid_recipe() -> str:
    """The recipe ``--boxes grid`` runs with ``recipe: auto``: that of the release whose weights make grid
    features only (grid-feats-vqa)."""
    return next(r.recipe_name for r in available_releases() if r.grid_only)


def recipe_from_config(
    section: Any, layout: str, flavor: str = "caffe", where: str = "extract", shorthands: tuple[str, ...] = SHORTHANDS
) -> Recipe:
    """The recipe a run uses: ``section.recipe`` (``auto`` = the layout's), its values from ``section.recipes``
    (or ``configs/extract.yaml``), then the shorthands of the section (``boxes``, ``min_boxes``,
    ``max_boxes``, ``conf_thresh``, ``nms_thresh``, ``min_size``, ``max_size``; ``null`` = the recipe's own).

    This is the one place that builds a selection rule from a config: ``cli extract``, ``cli caption``, the
    demo's feature stage and the detector evaluation all call it.
    """
    name = str(_section_get(section, "recipe", "auto") or "auto")
    mode = _section_get(section, "boxes")
    if name == "auto":
        name = grid_recipe() if mode == "grid" else recipe_name_for(layout, flavor)
    table = _plain(_section_get(section, "recipes")) or default_recipes()
    if name not in table:
        raise UsageError(f"unknown recipe {name!r} for {where}.recipe (known: auto, {', '.join(sorted(table))})")
    recipe = recipe_from_mapping(name, table[name], f"{where}.recipes.{name}")
    changes: dict[str, Any] = {}
    if mode is not None:
        mode = str(mode)
        if mode not in BOX_MODES:
            raise UsageError(f"{where}.boxes must be one of {', '.join(BOX_MODES)}, not {mode!r}")
        if mode in ("given", "grid"):
            changes["selector"] = mode
        else:
            changes["min_boxes"], changes["max_boxes"] = (10, 100) if mode == "adaptive" else (36, 36)
    for key in shorthands:
        val = _section_get(section, key)
        if val is not None:
            changes[key] = check_value(where, key, val)
    return check_recipe(recipe.with_(**changes), where)


def validate_config(section: Any, where: str = "extract", shorthands: tuple[str, ...] = SHORTHANDS) -> None:
    """Check every recipe of the section's table and its shorthands before any work (one-line errors)."""
    table = _plain(_section_get(section, "recipes")) or default_recipes()
    name = str(_section_get(section, "recipe", "auto") or "auto")
    if name != "auto" and name not in table:
        raise UsageError(f"unknown recipe {name!r} for {where}.recipe (known: auto, {', '.join(sorted(table))})")
    for key in table:
        recipe_from_mapping(key, table[key], f"{where}.recipes.{key}")
    recipe_from_config(section, "milvlg", "caffe", where, shorthands)


def resolve_recipe(recipe: Recipe, spec: Any) -> Recipe:
    """Fill the ``None`` values with the weights' own (``spec``: the detector's :class:`BottomUpSpec`)."""
    own = {
        "pixel_mean": tuple(float(v) for v in spec.pixel_means),
        "pixel_std": tuple(float(v) for v in spec.pixel_std),
        "min_size": int(spec.min_size),
        "max_size": int(spec.max_size),
        "pre_nms_topk": int(spec.pre_nms_topk),
        "post_nms_topk": int(spec.post_nms_topk),
        "rpn_nms_thresh": float(spec.rpn_nms_thresh),
    }
    return recipe.with_(**{k: v for k, v in own.items() if getattr(recipe, k) is None})


def apply_recipe(model: Any, recipe: Recipe) -> Recipe:
    """Resolve ``recipe`` against the detector's own values and set its proposal settings and input scale on
    the model (:meth:`extractors.detector.Detector.set_test_recipe`); returns the resolved recipe."""
    full = resolve_recipe(recipe, model.spec)
    model.set_test_recipe(
        min_size=full.min_size,
        max_size=full.max_size,
        pre_nms_topk=full.pre_nms_topk,
        post_nms_topk=full.post_nms_topk,
        rpn_nms_thresh=full.rpn_nms_thresh,
        pixel_means=full.pixel_mean,
    )
    return full


def describe_recipe(recipe: Recipe) -> list[tuple[str, str]]:
    """(field, value) rows for ``cli info WEIGHTS`` and logs, grouped in pipeline order."""
    r = recipe
    mean = "the weights' own" if r.pixel_mean is None else ", ".join(f"{v:g}" for v in r.pixel_mean)
    std = "the weights' own" if r.pixel_std is None else ", ".join(f"{v:g}" for v in r.pixel_std)
    rows = [
        ("recipe", r.name),
        ("input", f"{r.colour.upper()}{' (ToTensor x 255)' if r.to_bgr255 else ''}, mean ({mean}), std ({std})"),
        (
            "resize",
            f"{r.resize} rule, short side {r.min_size or 'own'}, long side <= {r.max_size or 'own'}, {r.interpolation}",
        ),
        (
            "proposals",
            f"top {r.pre_nms_topk or 'own'} -> NMS {r.rpn_nms_thresh or 'own'} -> first {r.post_nms_topk or 'own'}",
        ),
    ]
    rows.append(("selection", selections()[r.selector].describe(r)))
    rows.append(("rescale", f"{r.rescale}, clip {r.clip}{', drop empty boxes' if r.drop_empty else ''}"))
    return rows
