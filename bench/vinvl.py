"""``python -m bench --only vinvl`` (CPU or ``--device cuda``): the newer Visual Genome extractors side by side on
the same photos, seconds per image and the ratio (docs/recipes.md#vinvl, docs/recipes.md#grid).

* ``regions X-152 vs R-101``: VinVL's ResNeXt-152 C4 with its recipe (``nms_filter`` 1, 300 proposals) against
  the bottom-up ResNet-101 with the Caffe recipe (adaptive 10..100, 300 proposals);
* ``grid vs regions (X-152)`` and ``grid vs regions (R-101)``: ``--boxes grid`` (res5 map of the whole image,
  pooled 7x7) against region extraction with the same weights (Jiang et al. 2020 report "more than an order of
  magnitude" for grid features).

Random weights at the releases' widths (the speed does not depend on the values); synthetic 480x640 photos, each
side with its own recipe's blobs built before timing (decoding runs in DataLoader workers in ``cli extract``).
The outputs differ by design, so each round checks what both sides must share instead: one output per photo, the
same feature size, finite features (a failed check reports no ratio). ``size="tiny"``: narrow networks, the code
path only (the test suite). The CPU default is reduced (300/500, 100 proposals, 2 photos: stated in the row);
``--device cuda`` runs the releases' 600/1000 and 300 proposals on 16 photos.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from bench.harness import Case
from bench.tiny import tiny_caffe_r101, tiny_vinvl_x152c4
from extractors.preprocess import recipe_blob
from extractors.random_weights import random_detector
from extractors.recipes import apply_recipe, recipe_from_config
from extractors.selector import make_selector
from extractors.spec import caffe_r101
from extractors.vinvl import vinvl_x152c4
from pipeline.core.precision import autocast


def _setup(spec, recipe_name: str, boxes: str | None, dev, overrides: dict):
    model = random_detector(spec, seed=0).to(dev).fold_batchnorm()
    section = {"recipe": recipe_name, "boxes": boxes}
    recipe = recipe_from_config(section, "random", spec.flavor).with_(**overrides)
    recipe = apply_recipe(model, recipe)
    return model, make_selector(recipe, model.spec), recipe


def _runner(model, selector, recipe, photos, dev):
    decoded = [recipe_blob(p, recipe) for p in photos]
    blobs = [torch.from_numpy(b) for b, _ in decoded]
    frames = [f for _, f in decoded]

    def go():
        with autocast(dev, "fp32"):
            return [model.detect([b], [f], selector)[0] for b, f in zip(blobs, frames)]

    return go


def _shared(dim: int, count: int):
    def check(ours, theirs) -> float:
        for out in (ours, theirs):
            if len(out) != count or any(
                o.features.shape[1] != dim or not np.isfinite(o.features).all() or o.features.shape[0] == 0 for o in out
            ):
                return float("inf")
        return 0.0

    return check


def _workload(size: str, device: str) -> tuple[torch.device, list[np.ndarray], int, int, int]:
    """The device, the photos (synthetic 480x640, seed 0) and the detectors' test scale (shortest side, longest
    side, proposals) of a run: ``size="tiny"`` 2 photos at 200/333, 20 proposals; on CUDA 16 photos at the
    releases' 600/1000, 300 proposals; on CPU 2 photos at 300/500, 100 proposals."""
    dev = torch.device(device)
    images, short, long, props = (
        (2, 200, 333, 20) if size == "tiny" else (16, 600, 1000, 300) if dev.type == "cuda" else (2, 300, 500, 100)
    )
    rng = np.random.default_rng(0)
    photos = [rng.integers(0, 256, (480, 640, 3), dtype=np.uint8) for _ in range(images)]
    return dev, photos, short, long, props


def _sync(dev: torch.device) -> Callable[[], None]:
    """What waits for the device's queued work before a time is read (nothing on CPU)."""
    return (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)


def cases(size: str, device: str = "cpu") -> list[Case]:
    dev, photos, short, long, props = _workload(size, device)
    images = len(photos)
    x152, r101 = (tiny_vinvl_x152c4(), tiny_caffe_r101()) if size == "tiny" else (vinvl_x152c4(), caffe_r101())
    scale = {"min_size": short, "max_size": long}
    region = {**scale, "post_nms_topk": props}
    grid = {**scale, "grid": 7}
    sync = _sync(dev)
    runs = {}
    for key, spec, recipe, boxes, over in (
        ("x152", x152, "vinvl", None, region),
        ("r101", r101, "caffe", "adaptive", region),
        ("x152-grid", x152, "grid-feats", "grid", grid),
        ("r101-grid", r101, "grid-feats", "grid", grid),
    ):
        model, selector, resolved = _setup(spec, recipe, boxes, dev, over)
        runs[key] = _runner(model, selector, resolved, photos, dev)
    work = f"{images} photos 480x640 at {short}/{long}, {props} proposals, batch 1"

    def versus(name: str, project: str, baseline: str, ours: str, theirs: str, dim: int, note: str = "") -> Case:
        """Run ``ours`` against ``theirs`` (keys of ``runs``); each round checks the outputs share ``dim``."""
        return Case(
            name,
            project,
            baseline,
            work,
            run_project=runs[ours],
            run_baseline=runs[theirs],
            check=_shared(dim, images),
            tolerance=0.0,
            note=note,
            sync=sync,
            per_call=float(images),
            unit="s/img",
        )

    return [
        versus(
            "regions X-152 vs R-101",
            "VinVL X-152 C4 (vinvl)",
            "bottom-up R-101 C4 (caffe)",
            "x152",
            "r101",
            x152.feature_dim,
            note="ratio = R-101 / X-152 time (the R-101 head runs res5 dilated at 14x14, X-152's at 7x7)",
        ),
        versus(
            "grid vs regions (X-152)", "X-152 grid 7x7", "X-152 regions (vinvl)", "x152-grid", "x152", x152.feature_dim
        ),
        versus(
            "grid vs regions (R-101)", "R-101 grid 7x7", "R-101 regions (caffe)", "r101-grid", "r101", r101.feature_dim
        ),
    ]
