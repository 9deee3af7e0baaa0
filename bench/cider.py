"""Time one batch of SCST rewards: fast CIDEr-D (pipeline.metrics.cider) vs pycocoevalcap's Cider.

Run from the repository root with the project installed (``pip install -e .``) or ``PYTHONPATH=.``.

Workload (defaults): a reference corpus of 2,000 synthetic-world images x 5 captions (10k references;
document frequencies from it), and batches of 50 images x 5 sampled captions scored against their
image's references. pycocoevalcap has no way to take training-set document frequencies, so its batch is
``Cider().compute_score`` over the 250 samples (df from the batch's references): the same per-pair work
(vectorise candidate and each reference, clipped cosine) that index-based CiderD ports do per call.

    python bench/cider.py [--images 2000] [--batch-images 50] [--samples 5] [--repeats 20]
    python bench/cider.py --corpus zipf --images 113287   # COCO-sized reference table
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
from pycocoevalcap.cider.cider import Cider

from pipeline.metrics.cider import CiderD
from pipeline.world.captions import make_captions, tokenize
from pipeline.world.scene import SceneParams, sample_scene


def corpus(num_images: int, seed: int) -> dict[int, list[list[str]]]:
    rng = np.random.default_rng(seed)
    return {i: [tokenize(c) for c in make_captions(sample_scene(rng, SceneParams()), rng)] for i in range(num_images)}


def zipf_corpus(num_images: int, seed: int, vocab: int = 9487) -> dict[int, list[list[str]]]:
    """COCO-sized stress corpus: 5 references of 8-11 words per image drawn from a Zipf law over ``vocab`` words
    (more distinct n-grams than real captions, so a pessimistic case for memory and build time)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1)
    toks = rng.choice(vocab, size=(num_images * 5, 11), p=p / p.sum())
    lens = rng.integers(8, 12, num_images * 5)
    words = [f"w{k}" for k in range(vocab)]
    return {i: [[words[t] for t in toks[5 * i + k, : lens[5 * i + k]]] for k in range(5)] for i in range(num_images)}


def samples(refs: dict, image_ids: list[int], k: int, rng: np.random.Generator) -> list[list[str]]:
    """Sample-like candidates: a reference with a few words dropped or swapped with another image's words."""
    out = []
    ids = list(refs)
    for i in image_ids:
        for _ in range(k):
            base = list(refs[i][int(rng.integers(len(refs[i])))])
            other = refs[ids[int(rng.integers(len(ids)))]][0]
            cut = int(rng.integers(1, max(2, len(base))))
            out.append(base[:cut] + other[cut : cut + int(rng.integers(0, 4))])
    return out


def timeit(fn, repeats: int) -> float:
    fn()  # warm-up
    best = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t0)
    return float(np.median(best))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--batch-images", type=int, default=50)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--corpus", choices=("world", "zipf"), default="world", help="world captions or a Zipf stress corpus")
    args = ap.parse_args()

    t0 = time.perf_counter()
    refs = corpus(args.images, 0) if args.corpus == "world" else zipf_corpus(args.images, 0)
    t_gen = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    batch_ids = [int(i) for i in rng.choice(args.images, args.batch_images, replace=False)]
    flat_ids = [i for i in batch_ids for _ in range(args.samples)]
    cands = samples(refs, batch_ids, args.samples, rng)

    t0 = time.perf_counter()
    scorer = CiderD(refs, df_mode="corpus")
    t_build = time.perf_counter() - t0

    words = sorted({w for rs in refs.values() for r in rs for w in r} | {w for c in cands for w in c})
    wid = {w: k + 4 for k, w in enumerate(words)}
    id_scorer = CiderD({i: [[wid[w] for w in r] for r in rs] for i, rs in refs.items()})
    width = max(len(c) for c in cands) + 1
    arr = np.zeros((len(cands), width), dtype=np.int64)
    for row, c in enumerate(cands):
        arr[row, : len(c)] = [wid[w] for w in c]
        arr[row, len(c)] = 2

    gts = {j: [" ".join(r) for r in refs[i]] for j, i in enumerate(flat_ids)}
    res = {j: [" ".join(c)] for j, c in enumerate(cands)}
    coco = Cider()

    t_ours = timeit(lambda: scorer.scores(cands, flat_ids), args.repeats)
    t_ids = timeit(lambda: id_scorer.scores(arr, flat_ids), args.repeats)
    batch_scorer = CiderD(refs, df_mode="batch")
    t_batch = timeit(lambda: batch_scorer.scores(cands, flat_ids), args.repeats)
    t_coco = timeit(lambda: coco.compute_score(gts, res), max(3, args.repeats // 4))

    # same numbers: pycocoevalcap vs our batch-mode df on the same 250 pairs (one pair per key)
    ours_same = CiderD({j: [r.split() for r in g] for j, g in gts.items()}).scores(cands, list(gts))
    diff = float(np.abs(ours_same - coco.compute_score(gts, res)[1]).max())

    n_refs = sum(len(r) for r in refs.values())
    print(f"corpus ({args.corpus}): {args.images} images, {n_refs} references (generated in {t_gen:.2f}s); "
          f"batch: {args.batch_images} images x {args.samples} samples = {len(cands)} candidates")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"reference table build (once): {t_build * 1e3:.1f} ms; {scorer.row_key.shape[0]} (image, n-gram) rows; peak RSS {rss:.0f} MB")
    print(f"{'scorer':<44} {'ms/batch':>10} {'speed-up':>9}")
    print(f"{'pycocoevalcap Cider.compute_score':<44} {t_coco * 1e3:>10.2f} {1.0:>8.1f}x")
    print(f"{'CiderD corpus df, word tokens':<44} {t_ours * 1e3:>10.2f} {t_coco / t_ours:>8.1f}x")
    print(f"{'CiderD corpus df, token-id array':<44} {t_ids * 1e3:>10.2f} {t_coco / t_ids:>8.1f}x")
    print(f"{'CiderD batch df (df of the batch images)':<44} {t_batch * 1e3:>10.2f} {t_coco / t_batch:>8.1f}x")
    print(f"max |ours - pycocoevalcap| on the batch pairs: {diff:.2e}")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = scorer.save(Path(tmp) / "cider.npz")
        t_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        CiderD.load(path)
        t_load = time.perf_counter() - t0
        print(f"reference-table cache: save {t_save:.2f} s, load {t_load:.2f} s, {path.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
