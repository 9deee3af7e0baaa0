"""``python -m bench --only clip`` (CPU or ``--device cuda``): CLIP grid extraction at the CLIP-ViL recipe (448 x 448,
docs/recipes.md), seconds per image, on the photos of ``bench.vinvl`` (synthetic 480x640, the same seed), so
``--only vinvl,clip`` puts the region detectors and the CLIP encoders in one table.

* ``clip RN50x4 batch vs per-image`` and ``clip ViT-B/16 batch vs per-image``: :func:`extractors.clip.extract_batch`
  over all the photos in one forward pass against :func:`extractors.clip.extract` photo by photo (both include the
  PIL resize to 448 and the normalisation); each round checks that the grids agree (largest difference relative
  to the largest value; 1e-4 on CPU, 1e-2 on CUDA, where TF32 kernels may differ with the batch size).
* ``clip RN50x4 grid vs R-101 regions``: the batched RN50x4 grid against the bottom-up R-101 C4 regions with the
  Caffe recipe (adaptive 10..100) at ``bench.vinvl``'s scale; the outputs differ by design, so each round checks
  one output per photo with finite features of each side's width (no ratio otherwise).

The encoders are the released architectures (:data:`extractors.clip.model.PRESETS`) with seeded random values
(:func:`extractors.clip.random_weights.random_encoder`): no weights are downloaded, and the time does not depend on
the values. CPU default: 2 photos (the R-101 at 300/500, 100 proposals, as in ``bench.vinvl``); ``--device cuda``:
16 photos, the R-101 at 600/1000, 300 proposals. ``size="tiny"``: narrow encoders, the code path only (the tests).
"""

from __future__ import annotations

import numpy as np

from bench.harness import Case
from bench.tiny import tiny_caffe_r101
from bench.vinvl import _runner, _setup, _shared, _sync, _workload
from extractors.clip import PRESETS, ClipRecipe, extract, extract_batch
from extractors.clip.random_weights import random_encoder
from extractors.spec import caffe_r101

TINY = {
    "RN50x4": PRESETS["RN50x4"].with_(width=8, layers=(1, 1, 1, 1), embed_dim=32),
    "ViT-B/16": PRESETS["ViT-B/16"].with_(width=64, layers=(1,), embed_dim=32),
}


def _grids_agree(ours, theirs) -> float:
    """Largest |difference| of the grid features relative to the largest |value| (inf when the photos differ)."""
    if len(ours) != len(theirs):
        return float("inf")
    worst = 0.0
    for a, b in zip(ours, theirs):
        fa, fb = a.regions.features, b.regions.features
        if fa.shape != fb.shape or not np.isfinite(fa).all():
            return float("inf")
        worst = max(worst, float(np.abs(fa - fb).max() / max(float(np.abs(fb).max()), 1e-12)))
    return worst


def cases(size: str, device: str = "cpu") -> list[Case]:
    dev, photos, short, long, props = _workload(size, device)  # bench.vinvl's photos and detector scale
    images, cuda = len(photos), dev.type == "cuda"
    recipe = ClipRecipe("clip-vil", 448)
    sync = _sync(dev)
    common = dict(sync=sync, per_call=float(images), unit="s/img")
    work = f"{images} photos 480x640 at 448x448 (clip-vil), batch {images}"
    found, batched = [], {}
    for name in ("RN50x4", "ViT-B/16"):
        cfg = TINY[name] if size == "tiny" else PRESETS[name]
        model = random_encoder(cfg, seed=0).to(dev)
        batched[name] = (model, cfg)
        found.append(
            Case(
                f"clip {name} batch vs per-image",
                f"CLIP {name} grid, one batch",
                f"CLIP {name} grid, photo by photo",
                work=work,
                run_project=lambda m=model: extract_batch(m, photos, recipe),
                run_baseline=lambda m=model: [extract(m, p, recipe) for p in photos],
                check=_grids_agree,
                tolerance=1e-2 if cuda else 1e-4,
                note=(
                    f"random weights in the {name} architecture{' (narrowed: tiny)' if size == 'tiny' else ''}, "
                    f"no released weights downloaded; grid {(448 // cfg.stride) ** 2} cells x {cfg.grid_dim}"
                ),
                **common,
            )
        )
    r101 = tiny_caffe_r101() if size == "tiny" else caffe_r101()
    det, selector, resolved = _setup(
        r101, "caffe", "adaptive", dev, {"min_size": short, "max_size": long, "post_nms_topk": props}
    )
    regions = _runner(det, selector, resolved, photos, dev)
    model, cfg = batched["RN50x4"]
    clip_grid = lambda: [f.regions for f in extract_batch(model, photos, recipe)]  # noqa: E731

    def shared(ours, theirs) -> float:
        return max(_shared(cfg.grid_dim, images)(ours, ours), _shared(r101.feature_dim, images)(theirs, theirs))

    found.append(
        Case(
            "clip RN50x4 grid vs R-101 regions",
            "CLIP RN50x4 grid (clip-vil 448, one batch)",
            f"bottom-up R-101 C4 regions (caffe {short}/{long}, {props} proposals, batch 1)",
            work=f"{images} photos 480x640",
            run_project=clip_grid,
            run_baseline=regions,
            check=shared,
            tolerance=0.0,
            note="ratio = R-101 / RN50x4 time; random weights on both sides (no released weights downloaded)",
            **common,
        )
    )
    return found
