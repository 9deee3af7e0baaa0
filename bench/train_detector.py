"""Detector training speed: iterations/s of forward + backward + SGD step (data preloaded, so the model alone).

    python bench/train_detector.py                       # CPU, the demo preset, on a small synthetic world
    python bench/train_detector.py --preset vg_r101 --device cuda --precision bf16   # full R-101, 1601 classes
    (from a checkout without the package installed: python -m bench.train_detector ...)

Measured 2026-11-22 on the shared 2-core CPU (load average ~8 from other jobs, so inflated): demo preset
0.437 it/s (4 images/it, 1.75 images/s); vg_r101 (1 image at 600/1000) 0.037 it/s. No GPU was lent.

The world is generated into a temporary folder; for ``vg_r101`` its instances file is widened to the Visual
Genome vocabulary (1600 categories, 400 attributes) so the heads have their real sizes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from extractors.training.data import TrainBatches, load_instances, pad_blobs
from extractors.training.loop import train_scales, training_model
from extractors.training.optim import param_groups
from extractors.training.stage import load_detector_config
from pipeline.core.config import CONFIG_DIR, load_config
from pipeline.core.training import autocast, resolve_precision
from pipeline.world.generate import generate_world


def widen_vocabulary(ann: Path, classes: int, attributes: int) -> None:
    data = json.loads(ann.read_text())
    top_c = max(c["id"] for c in data["categories"])
    data["categories"] += [
        {"id": top_c + i + 1, "name": f"class{top_c + i + 1}"} for i in range(classes - len(data["categories"]))
    ]
    top_a = max(a["id"] for a in data["attributes"])
    data["attributes"] += [
        {"id": top_a + i + 1, "name": f"attr{top_a + i + 1}", "type": "other"}
        for i in range(attributes - len(data["attributes"]))
    ]
    ann.write_text(json.dumps(data))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo", help="configs/detector/<preset>.yaml")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--images", type=int, default=48, help="world size")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    precision = resolve_precision(args.precision, device, "--precision")
    with tempfile.TemporaryDirectory() as tmp:
        world = Path(tmp) / "world"
        generate_world(
            world, load_config("world", None, [f"world.num_images={args.images}", "world.num_workers=1"]).world
        )
        ann = world / "annotations" / "instances_train.json"
        if args.preset == "vg_r101":
            widen_vocabulary(ann, 1600, 400)
        cfg = load_detector_config(
            CONFIG_DIR / "detector" / f"{args.preset}.yaml",
            [f"data.train_annotations={ann}", f"data.train_images={world / 'images'}"],
        )
        data = load_instances(ann, world / "images")
        model = training_model(cfg, data).to(device).train()
        spec = model.detector.spec
        tc = cfg.detector_train
        min_size, max_size = train_scales(cfg, spec)
        batches = TrainBatches(data.records, int(tc.images_per_batch), 0, min_size, max_size, spec.pixel_means)
        pre = [batches[i % batches.per_epoch] for i in range(args.warmup + args.iters)]
        opt = torch.optim.SGD(param_groups(model, 1e-4, 1e-4, 1e-4, 2.0), lr=1e-4, momentum=0.9)

        def step(b):
            images, sizes = pad_blobs(b["images"])
            with autocast(device, precision):
                losses = model(images.to(device), sizes, b["images"])
            opt.zero_grad(set_to_none=True)
            sum(losses.values()).backward()
            opt.step()

        for b in pre[: args.warmup]:
            step(b)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for b in pre[args.warmup :]:
            step(b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(
            f"preset {args.preset}: ResNet blocks {list(spec.stage_blocks) + [spec.res5_blocks]}, {spec.num_classes} "
            "classes, "
            f"{spec.num_attributes} attributes, {n_params / 1e6:.2f}M trainable parameters, scale {min_size}/{max_size}"
        )
        print(
            f"device {device} ({torch.get_num_threads()} threads), precision {precision}, {tc.images_per_batch} "
            "images/iteration"
        )
        print(
            f"{args.iters / dt:.3f} iterations/s, {args.iters * int(tc.images_per_batch) / dt:.2f} images/s "
            f"({dt / args.iters * 1000:.0f} ms/iteration)"
        )
        if device.type == "cuda":
            print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
