"""Benchmark of the bottom-up extractor: images/s and peak memory per batch size and precision, bf16 vs fp32
feature agreement, and the per-class NMS row of ``python -m bench --only nms``.

Random weights with the full ResNet-101 preset (the speed does not depend on the values). Images are the real
photos of ``--photos DIR`` (``.jpg`` files), cycled; decoding is timed separately (it runs in DataLoader workers in
``cli extract``).

    python -m bench.extract --photos DIR --device cpu --min-size 300 --max-size 500 --proposals 20 --images 4 \
        --batches 1,4
    python -m bench.extract --photos DIR --device cuda --images 96 --batches 1,4,8 --precisions fp32,bf16 \
        --channels-last
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench import harness, nms
from extractors.preprocess import Frame, caffe_blob, load_rgb
from extractors.random_weights import random_detector
from extractors.recipes import recipe_from_config
from extractors.selector import make_selector
from extractors.spec import caffe_r101
from pipeline.core.precision import autocast


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _peak_mb(dev: torch.device) -> float:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # process peak RSS (monotone)


def _selector(model, boxes: str):
    """The Caffe recipe's selector (``scales`` below are the blobs' :class:`Frame`)."""
    recipe = recipe_from_config({"recipe": "caffe", "boxes": boxes}, "milvlg").with_(
        min_size=model.spec.min_size, max_size=model.spec.max_size, pixel_mean=tuple(model.spec.pixel_means)
    )
    return make_selector(recipe, model.spec)


def bench_throughput(model, blobs, scales, sizes, dev, batch: int, precision: str, rule) -> tuple[float, float]:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    with autocast(dev, precision):
        model.detect(blobs[:batch], scales[:batch], rule)  # warm-up
        _sync(dev)
        t0 = time.perf_counter()
        for i in range(0, len(blobs), batch):
            model.detect(blobs[i : i + batch], scales[i : i + batch], rule)
        _sync(dev)
        dt = time.perf_counter() - t0
    return len(blobs) / dt, _peak_mb(dev)


def bench_agreement(model, blobs, scales, sizes, dev, n: int) -> tuple[float, float, float]:
    """bf16 vs fp32 features on the same (fp32-selected) boxes: min and mean cosine, and the share of images
    whose adaptive selection is identical."""
    rule = _selector(model, "adaptive")
    with autocast(dev, "fp32"):
        ref = model.detect(blobs[:n], scales[:n], rule)
    with autocast(dev, "bf16"):
        low = model.detect(blobs[:n], scales[:n], _selector(model, "given"), [r.boxes for r in ref])
        sel = model.detect(blobs[:n], scales[:n], rule)
    cos = []
    for a, b in zip(ref, low):
        fa, fb = a.features.astype(np.float64), b.features.astype(np.float64)
        cos.append((fa * fb).sum(1) / (np.linalg.norm(fa, axis=1) * np.linalg.norm(fb, axis=1) + 1e-12))
    cos = np.concatenate(cos)
    same = np.mean(
        [a.boxes.shape == b.boxes.shape and np.allclose(a.boxes, b.boxes, atol=1.0) for a, b in zip(ref, sel)]
    )
    return float(cos.min()), float(cos.mean()), float(same)


def bench_nms(repeats: int = 3) -> str:
    """The per-class NMS row of :mod:`bench.nms` (300 x 1600, uniform boxes) through the harness: warm-up,
    interleaved repeats and the exact check on every timed round on both sides."""
    row = harness.measure(nms.cases("default")[0], repeats=repeats, warmup=1)
    return (
        f"per-class NMS ({row.work}, CPU): loop {row.baseline_min:.1f} ms, extractors.nms {row.project_min:.2f} ms "
        f"(min of {row.repeats}), speed-up x{row.speedup_min:.1f} (identical kept indices per class)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--photos", type=Path, default=None, help="folder of .jpg photos to cycle through (required)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--min-size", type=int, default=600)
    ap.add_argument("--max-size", type=int, default=1000)
    ap.add_argument("--boxes", default="adaptive", choices=["adaptive", "36"])
    ap.add_argument(
        "--proposals", type=int, default=300, help="RPN post-NMS proposals (Caffe: 300; fewer for a quick CPU run)"
    )
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--cudnn-benchmark", action="store_true")
    ap.add_argument("--skip-nms", action="store_true", help="skip the per-class NMS row (CPU, 300 x 1600)")
    ap.add_argument("--skip-agreement", action="store_true")
    args = ap.parse_args()
    files = sorted(args.photos.glob("*.jpg")) if args.photos is not None else []
    if not files:
        sys.stderr.write("error: --photos DIR must name a folder of .jpg photos\n")
        raise SystemExit(2)
    dev = torch.device(args.device)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    spec = caffe_r101().with_(min_size=args.min_size, max_size=args.max_size, post_nms_topk=args.proposals)
    t0 = time.perf_counter()
    model = random_detector(spec, seed=0).to(dev).fold_batchnorm()
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    decoded = [caffe_blob(load_rgb(f), args.min_size, args.max_size) for f in files]
    decode_ms = (time.perf_counter() - t0) / len(files) * 1e3
    sizes_all = [tuple(int(v) for v in load_rgb(f).shape[:2]) for f in files]
    blobs, scales, sizes = [], [], []
    for i in range(args.images):
        b, s = decoded[i % len(files)]
        t = torch.from_numpy(b)
        if dev.type == "cuda":
            t = t.pin_memory()
        blobs.append(t)
        h, w = sizes_all[i % len(files)]
        scales.append(Frame(h, w, int(b.shape[1]), int(b.shape[2]), s))
        sizes.append((h, w))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(
        f"device: {name}; torch {torch.__version__}; ResNet-101 C4 bottom-up (random weights); scale "
        f"{args.min_size}/{args.max_size}; "
        f"{args.images} images; {args.proposals} proposals; boxes {args.boxes}; channels_last {args.channels_last}; "
        f"build {build:.1f}s; decode+blob {decode_ms:.1f} ms/img (1 process)"
    )
    rule = _selector(model, args.boxes)
    print(f"{'precision':>9} {'batch':>5} {'images/s':>9} {'peak MB':>9}")
    for prec in args.precisions.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            ips, mb = bench_throughput(model, blobs, scales, sizes, dev, b, prec, rule)
            print(f"{prec:>9} {b:>5} {ips:>9.2f} {mb:>9.0f}", flush=True)
    if not args.skip_agreement and "bf16" in args.precisions:
        n = min(len(blobs), 8)
        cmin, cmean, same = bench_agreement(model, blobs, scales, sizes, dev, n)
        print(
            f"bf16 vs fp32 features on the same boxes ({n} images): cosine min {cmin:.5f}, mean {cmean:.5f}; "
            f"identical selections {same:.0%}"
        )
    if not args.skip_nms:
        print(bench_nms())


if __name__ == "__main__":
    main()
