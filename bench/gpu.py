"""The CUDA table of ``python -m bench --device cuda``: throughput rows (no baseline, so no ratio).

* ``extract``: bottom-up extraction (ResNet-101 C4 preset, random weights: speed does not depend on the
  values) at the Caffe test scale 600/1000, 300 proposals, batch 8, tf32, fp32 (strict) and bf16; the photos
  have the sizes of real photos, not one repeated shape: :data:`PHOTO_SIZES`, twelve sizes common in COCO (long
  side 640 or 500, portrait and landscape), so a batch mixes resized shapes as a real folder does; reported per
  image (``s/img``; images/s is its inverse).
* ``train``: XE and SCST optimisation steps of each ``--models`` captioner at its paper batch size, the
  trainer's own step (``pipeline.training.engine.Trainer._step``: samples and greedy baseline under the
  precision's autocast, optimizer and clipping) on synthetic COCO-shaped tensors (36 x 2048 regions, 5 captions
  of 8-16 words, 9,487 words), after fitting the captioner for 25 XE steps to those captions so that samples end
  at trained-like lengths (random weights would run every sample to ``max_len``); reported as the projected
  Karpathy-train epoch (113,287 images) in seconds (``bench.train.bench_stage``).
* ``decode``: beam search (beam 5, 20 words) over 5,000 images in batches of 500 by the fitted captioner.

Every CUDA row's note gives the peak memory allocated (``torch.cuda.max_memory_allocated``) during the row, and the
train and decode rows the mean decoded length. Run ``python -m bench --device cuda`` on a machine with a GPU; the
test suite runs the same code on CPU at ``size="tiny"`` (no GPU there), so it is exercised.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from bench.decode import make_inputs
from bench.harness import Case
from bench.tiny import tiny_caffe_r101
from bench.train import COCO_TRAIN_IMAGES, VOCAB_SIZE, bench_stage, fitted_model, make_batch, reference_corpus
from extractors.bucketing import ShapeBuckets
from extractors.preprocess import recipe_blob
from extractors.random_weights import random_detector
from extractors.recipes import apply_recipe, recipe_from_config
from extractors.selector import make_selector
from extractors.spec import caffe_r101
from models import model_card
from models.decoding import DecodeOptions, beam_search
from pipeline.core.precision import autocast
from pipeline.core.training import resolve_precision
from pipeline.core.vocab import Vocab
from pipeline.training.recipe import FUSED_OPTIMIZERS, stage_recipe

#: (height, width) of the bench photos: sizes common among COCO photos (long side 640 or 500)
PHOTO_SIZES = (
    (480, 640),
    (640, 480),
    (427, 640),
    (640, 427),
    (425, 640),
    (360, 640),
    (640, 512),
    (512, 640),
    (375, 500),
    (500, 375),
    (333, 500),
    (640, 640),
)


def _peak(dev: torch.device):
    """``(reset, note)``: reset the CUDA peak-memory counter before a row; the note reads it after."""
    if dev.type != "cuda":
        return (lambda: None), (lambda: "")
    return (lambda: torch.cuda.reset_peak_memory_stats(dev)), (
        lambda: f"peak {torch.cuda.max_memory_allocated(dev) / 2**30:.2f} GiB allocated"
    )


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
    images, batch = (2, 2) if size == "tiny" else (64, 8)
    # tiny: a shrunk network of the same architecture (the code path, not the figure)
    spec = tiny_caffe_r101(min_size=200, max_size=333, post_nms_topk=20) if size == "tiny" else caffe_r101()
    model = random_detector(spec, seed=0).to(dev).fold_batchnorm()
    recipe = apply_recipe(model, recipe_from_config({"recipe": "caffe", "boxes": "adaptive"}, "milvlg"))
    rule = make_selector(recipe, model.spec)
    rng = np.random.default_rng(0)
    sizes = [PHOTO_SIZES[i % len(PHOTO_SIZES)] for i in range(images)]
    if size == "tiny":
        sizes = [(h // 2, w // 2) for h, w in sizes]
    decoded = [recipe_blob(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), recipe) for h, w in sizes]
    blobs = [torch.from_numpy(d[0]) for d in decoded]
    blobs = [b.pin_memory() for b in blobs] if dev.type == "cuda" else blobs
    scales = [d[1] for d in decoded]
    reset, note = _peak(dev)

    in_order = [list(range(i, min(i + batch, images))) for i in range(0, images, batch)]
    buckets = ShapeBuckets(batch, 4 * batch)  # what extract does with bucket_window 4 (its default on CUDA)
    bucketed = [
        [p.index for p in g] for i, b in enumerate(blobs) for g in buckets.add(SimpleNamespace(index=i, blob=b))
    ]
    bucketed += [[p.index for p in g] for g in buckets.flush()]

    work = (
        f"{images} images of {len(set(sizes))} sizes, batch {batch}, {spec.min_size}/{spec.max_size}, "
        f"{spec.post_nms_topk} proposals"
    )
    precisions = ("tf32", "fp32", "bf16") if dev.type == "cuda" else ("fp32",)  # bf16 convolutions crawl on most CPUs

    def row(label: str, precision: str, groups: list[list[int]]) -> Case:
        def go() -> None:
            reset()
            with autocast(dev, precision):
                for g in groups:
                    model.detect([blobs[i] for i in g], [scales[i] for i in g], rule)

        return Case("extract", label, None, work, go, sync=_syncer(dev), per_call=images, unit="s/img", after=note)

    return [row(f"bottom-up R101 {p}", p, in_order) for p in precisions] + [
        row(f"bottom-up R101 {p}, equal sizes batched across the folder", p, bucketed)
        for p in precisions
        if p != "fp32" or dev.type != "cuda"
    ]


def _train_cases(name: str, size: str, dev: torch.device) -> list[Case]:
    amp = resolve_precision("auto", dev)
    words = ("<pad>", "<bos>", "<eos>", "<unk>")
    vocab = Vocab(words + tuple(f"w{i}" for i in range(VOCAB_SIZE - 4)))
    scorer = reference_corpus(Vocab(words), 200 if size == "tiny" else 2000)
    out = []
    reset, note = _peak(dev)
    variants = [("xe", None, ""), ("scst", None, "")]
    if _greedy_sampled(name):  # the samples and the greedy baseline in one loop (default) or two: side by side
        variants.append(("scst", {"baseline_loop": "separate"}, ", baseline in its own loop"))
    if _fusable(name):  # the opt-in fused optimizer beside the default foreach one
        variants += [(stage, {"optimizer_impl": "fused"}, ", fused optimizer") for stage in ("xe", "scst")]
    for stage, overrides, label in variants:

        def epoch(stage: str = stage, overrides: dict | None = overrides) -> float:
            reset()
            batch, sec = bench_stage(
                name,
                stage,
                2 if size == "tiny" else None,
                1 if size == "tiny" else 5,
                dev,
                amp,
                scorer,
                vocab,
                fit_steps=2 if size == "tiny" else 25,
                overrides=overrides,
            )
            return COCO_TRAIN_IMAGES / batch * sec

        out.append(
            Case(
                f"train {stage}",
                f"{name} {stage} epoch (projected, {amp}){label}",
                None,
                f"{COCO_TRAIN_IMAGES} images at the paper batch size; the trainer's step timed x epoch length",
                epoch,
                unit="s",
                reports="value",
                after=note,
            )
        )
    return out


def _fusable(name: str) -> bool:
    """Whether both of ``name``'s stages use an optimizer PyTorch has a fused kernel for (``optimizer_impl: fused``)."""
    schedule = model_card(name).schedule.to_dict()
    return all(stage_recipe(st, schedule, None, 30, name).optimizer in FUSED_OPTIMIZERS for st in ("xe", "scst"))


def _greedy_sampled(name: str) -> bool:
    """Whether ``name``'s SCST recipe samples with a greedy baseline (where ``baseline_loop`` matters)."""
    r = stage_recipe("scst", model_card(name).schedule.to_dict(), None, 30, name)
    return r.baseline == "greedy" and r.sample_method == "sample"


def _decode_case(name: str, size: str, dev: torch.device) -> Case:
    total, batch, max_len = (4, 2, 5) if size == "tiny" else (5000, 500, 20)
    fit = make_batch(2 if size == "tiny" else 50, VOCAB_SIZE, dev, torch.Generator().manual_seed(0))
    model = fitted_model(name, fit, 2 if size == "tiny" else 25, dev).eval()
    inputs = make_inputs(batch, 36, int(getattr(model, "feat_dim", 2048)), dev)
    options = DecodeOptions(method="beam", beam_size=5, max_len=max_len)
    lengths: list[float] = []
    reset, peak = _peak(dev)

    def go() -> None:
        reset()
        with torch.inference_mode():
            for _ in range(total // batch):
                enc = model.encode(*inputs)
                lengths.append(float(beam_search(model, enc, options).lengths.float().mean()))

    def note() -> str:
        return f"mean caption length {sum(lengths) / max(len(lengths), 1):.1f} tokens; {peak()}".rstrip("; ")

    return Case(
        "decode",
        f"{name} beam-5",
        None,
        f"{total} images, batch {batch}, max {max_len} words",
        go,
        sync=_syncer(dev),
        unit="s",
        after=note,
    )
