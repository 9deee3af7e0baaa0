"""The CUDA table of ``python -m bench --device cuda``: throughput rows (no baseline, so no ratio).

* ``extract``: bottom-up extraction (ResNet-101 C4 preset, random weights: speed does not depend on the
  values) on synthetic 480x640 photos at the Caffe test scale 600/1000, 300 proposals, batch 8, fp32 and
  bf16; reported per image (``s/img``; images/s is its inverse).
* ``train``: one XE and one SCST optimisation step of each ``--models`` captioner at its paper batch size on
  synthetic COCO-shaped tensors (36 x 2048 regions, 5 captions of 8-16 words, 9,487 words), reported as the
  projected Karpathy-train epoch (113,287 images) in seconds (``bench.train.bench_stage`` does the step).
* ``decode``: beam search (beam 5, 20 words) over 5,000 images of synthetic features in batches of 500.

Run ``python -m bench --device cuda`` on a machine with a GPU; the test suite runs the same code on CPU at
``size="tiny"`` (no GPU there), so it is exercised, but its CUDA figures have not been measured here.
"""

from __future__ import annotations

import numpy as np
import torch

from bench.harness import Case

COCO_TRAIN_IMAGES = 113_287


def _syncer(dev: torch.device):
    return (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)


def cases(name: str, size: str, models: list[str], device: str = "cuda") -> list[Case]:
    """The rows of one CUDA bench (``extract``, ``train`` or ``decode``). ``size="tiny"`` shrinks every
    workload to seconds (what the test suite runs on CPU to keep this code working without a GPU)."""
    dev = torch.device(device)
    if name == "extract":
        return _extract_cases(size, dev)
    if name == "train":
        return [c for m in models for c in _train_cases(m, size, dev)]
    return [_decode_case(m, size, dev) for m in models]


def _extract_cases(size: str, dev: torch.device) -> list[Case]:
    from extractors.preprocess import recipe_blob
    from extractors.recipes import apply_recipe, recipe_from_config
    from extractors.photos import precision_context
    from extractors.selector import make_selector
    from extractors.spec import caffe_r101
    from extractors.random_weights import random_detector

    images, batch = (2, 2) if size == "tiny" else (64, 8)
    spec = caffe_r101()
    if size == "tiny":  # a shrunk network of the same architecture: the code path, not the figure
        spec = spec.with_(min_size=200, max_size=333, post_nms_topk=20, stage_blocks=(1, 1, 1), res5_blocks=1, res2_bottleneck=4,
                          stem_channels=8, num_classes=21, num_attributes=11, attr_embed_dim=8, attr_hidden=16, rpn_channels=16)
    model = random_detector(spec, seed=0).to(dev).fold_batchnorm()
    recipe = apply_recipe(model, recipe_from_config({"recipe": "caffe", "boxes": "adaptive"}, "milvlg"))
    rule = make_selector(recipe, model.spec)
    rng = np.random.default_rng(0)
    decoded = [recipe_blob(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8), recipe) for _ in range(4)]
    blobs = [torch.from_numpy(decoded[i % 4][0]) for i in range(images)]
    blobs = [b.pin_memory() for b in blobs] if dev.type == "cuda" else blobs
    scales = [decoded[i % 4][1] for i in range(images)]

    def run(precision: str):
        def go() -> None:
            with precision_context(precision, dev):
                for i in range(0, images, batch):
                    model.detect(blobs[i : i + batch], scales[i : i + batch], rule)
        return go

    work = f"{images} images, batch {batch}, {spec.min_size}/{spec.max_size}, {spec.post_nms_topk} proposals"
    precisions = ("fp32", "bf16") if dev.type == "cuda" else ("fp32",)  # bf16 convolutions crawl on most CPUs
    return [Case("extract", f"bottom-up R101 {p}", None, work, run(p), sync=_syncer(dev), per_call=images, unit="s/img")
            for p in precisions]


def _train_cases(name: str, size: str, dev: torch.device) -> list[Case]:
    from bench.train import COCO_TRAIN_IMAGES as images
    from bench.train import VOCAB_SIZE, bench_stage, reference_corpus
    from pipeline.core.vocab import Vocab
    from pipeline.core.training import resolve_precision

    amp = resolve_precision("auto", dev)
    words = ("<pad>", "<bos>", "<eos>", "<unk>")
    vocab = Vocab(words + tuple(f"w{i}" for i in range(VOCAB_SIZE - 4)))
    scorer = reference_corpus(Vocab(words), 200 if size == "tiny" else 2000)
    out = []
    for stage in ("xe", "scst"):
        def epoch(stage: str = stage) -> float:
            batch, sec = bench_stage(name, stage, 2 if size == "tiny" else None, 1 if size == "tiny" else 5, dev, amp, scorer, vocab)
            return images / batch * sec

        out.append(Case(f"train {stage}", f"{name} {stage} epoch (projected, {amp})", None,
                        f"{images} images at the paper batch size; timed steps x epoch length", epoch, unit="s",
                        reports="value"))
    return out


def _decode_case(name: str, size: str, dev: torch.device) -> Case:
    from bench.decode import make_inputs, run_once
    from bench.train import VOCAB_SIZE
    from models import build_captioner

    total, batch, max_len = (4, 2, 5) if size == "tiny" else (5000, 500, 20)
    model = build_captioner(name, VOCAB_SIZE).to(dev).eval()
    inputs = make_inputs(batch, 36, int(getattr(model, "feat_dim", 2048)), dev)

    def go() -> None:
        with torch.inference_mode():
            for _ in range(total // batch):
                run_once(model, inputs, 5, max_len)

    return Case("decode", f"{name} beam-5", None, f"{total} images, batch {batch}, max {max_len} words", go, sync=_syncer(dev), unit="s")
