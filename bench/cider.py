"""CIDEr-D: the project's scorer (pipeline.metrics.cider) vs pycocoevalcap's ``Cider`` on the same batch.

Workload: batches of ``batch_images`` synthetic-world images x ``samples`` sampled captions (a reference with
words dropped or swapped in from another image), each scored against its image's 5 references, the way SCST
scores a batch. pycocoevalcap takes document frequencies from the references it is given (one entry per
candidate), so both sides get exactly that reference set, and the scores must agree to 1e-9:

* ``table per call``: ``CiderD(refs).scores(...)`` builds the reference table inside the timed call, as
  pycocoevalcap does;
* ``prebuilt table``: the table is built once (untimed; in training it is built once per run) and each
  timed call only scores, the SCST reward path.

    python -m bench --only cider [--size default|tiny]
"""

from __future__ import annotations

import numpy as np
from pycocoevalcap.cider.cider import Cider

from bench.harness import Case
from pipeline.metrics.cider import CiderD
from pipeline.world.captions import make_captions, tokenize
from pipeline.world.scene import SceneParams, sample_scene

SIZES = {
    "tiny": {"images": 30, "batch_images": 5, "samples": 5},
    "default": {"images": 2000, "batch_images": 50, "samples": 5},
}


def corpus(num_images: int, seed: int) -> dict[int, list[list[str]]]:
    """Five tokenised synthetic-world captions per image."""
    rng = np.random.default_rng(seed)
    return {i: [tokenize(c) for c in make_captions(sample_scene(rng, SceneParams()), rng)] for i in range(num_images)}


def samples(refs: dict, image_ids: list[int], k: int, rng: np.random.Generator) -> list[list[str]]:
    """Sample-like candidates: a reference cut short, with a few words of another image's reference."""
    out = []
    ids = list(refs)
    for i in image_ids:
        for _ in range(k):
            base = list(refs[i][int(rng.integers(len(refs[i])))])
            other = refs[ids[int(rng.integers(len(ids)))]][0]
            cut = int(rng.integers(1, max(2, len(base))))
            out.append(base[:cut] + other[cut : cut + int(rng.integers(0, 4))])
    return out


def _max_abs(ours: np.ndarray, theirs: np.ndarray) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    if ours.shape != theirs.shape:
        return float("inf")
    return float(np.abs(ours - theirs).max()) if ours.size else 0.0


def cases(size: str = "default") -> list[Case]:
    """The two CIDEr-D rows (see the module docstring)."""
    cfg = SIZES[size]
    refs = corpus(cfg["images"], 0)
    rng = np.random.default_rng(1)
    batch_ids = [int(i) for i in rng.choice(cfg["images"], cfg["batch_images"], replace=False)]
    flat_ids = [i for i in batch_ids for _ in range(cfg["samples"])]
    cands = [" ".join(c) for c in samples(refs, batch_ids, cfg["samples"], rng)]
    keys = list(range(len(cands)))
    gts = {j: [" ".join(r) for r in refs[i]] for j, i in enumerate(flat_ids)}
    res = {j: [c] for j, c in enumerate(cands)}
    coco = Cider()
    prebuilt = CiderD(gts, df_mode="corpus")
    work = f"{len(cands)} candidates ({cfg['batch_images']} images x {cfg['samples']}) vs 5 refs each"

    def baseline() -> np.ndarray:
        return np.asarray(coco.compute_score(gts, res)[1], np.float64)

    return [
        Case(
            "cider",
            "CiderD, table per call",
            "pycocoevalcap Cider",
            work,
            lambda: CiderD(gts, df_mode="corpus").scores(cands, keys),
            baseline,
            _max_abs,
            1e-9,
        ),
        Case(
            "cider",
            "CiderD, prebuilt table",
            "pycocoevalcap Cider",
            work,
            lambda: prebuilt.scores(cands, keys),
            baseline,
            _max_abs,
            1e-9,
            note="prebuilt: the reference table (same references, so the same df) is built once, untimed",
        ),
    ]


if __name__ == "__main__":
    from bench.__main__ import main

    raise SystemExit(main(["--only", "cider"]))
