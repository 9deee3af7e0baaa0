"""The resumable detector training loop (single process, or DDP under ``torchrun``: gloo on CPU, NCCL on GPU).

Exact resume: the checkpoint (``checkpoints/last.pt``, written atomically every ``checkpoint_every``
iterations) holds the weights and frozen statistics, the SGD momentum, the gradient scaler, the iteration and
every process's RNG states; batches are a pure function of the iteration (:class:`TrainBatches`). A run
killed at any moment and started again therefore ends with bitwise the same weights on CPU as an
uninterrupted one (same thread count).
"""

from __future__ import annotations

import os
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from extractors import EXTRACTORS
from extractors.bottom_up import BottomUpDetector
from extractors.factory import resolve_device
from extractors.spec import BottomUpSpec
from extractors.training.data import InstanceSet, TrainBatches, collate_one, load_instances, pad_blobs
from extractors.training.export import export_weights, scale_bbox_pred
from extractors.training.model import DetectorForTraining, LossConfig
from extractors.training.optim import apply_lr, calibrate_batchnorm, lr_at, param_groups, set_trainable
from extractors.training.targets import SamplingConfig
from extractors.weights import load_detector
from pipeline.core import threads as thread_policy
from pipeline.core.checkpoint import capture_rng_state, load_checkpoint, restore_rng_state, save_checkpoint
from pipeline.core.config import Config
from pipeline.core.console import get_logger, is_main_process, make_progress
from pipeline.core.errors import PipelineError, UsageError

log = get_logger("train-detector")

CHECKPOINT = "checkpoints/last.pt"
WEIGHTS = "detector.pth"


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def dist_info() -> DistInfo:
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return DistInfo(int(os.environ.get("RANK", "0") or 0), world, int(os.environ.get("LOCAL_RANK", "0") or 0))


def _spec_overrides(spec: BottomUpSpec, overrides: dict[str, Any]) -> BottomUpSpec:
    known = set(spec.to_dict())
    bad = sorted(set(overrides) - known)
    if bad:
        raise UsageError(f"unknown model.spec key {bad[0]!r} (known: {', '.join(sorted(known))})")
    try:
        return spec.with_(**{k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()})
    except (TypeError, ValueError) as exc:
        raise UsageError(f"invalid model.spec: {exc}") from None


def build_detector(cfg: Config, data: InstanceSet) -> BottomUpDetector:
    """The detector to train: from ``model.init_weights`` (bbox_pred normalised for training) or random."""
    mcfg = cfg.model
    sampling = SamplingConfig(**_sampling_kwargs(cfg))
    if mcfg.init_weights:
        det, info = load_detector(str(mcfg.init_weights))
        if mcfg.spec:
            det_spec = _spec_overrides(det.spec, dict(mcfg.spec))
            det.spec = det.proposal_generator.spec = det.roi_heads.spec = det_spec
        if det.spec.num_classes != data.num_classes or (det.spec.has_attributes and det.spec.num_attributes != data.num_attributes):
            raise UsageError(
                f"{mcfg.init_weights} has {det.spec.num_classes} classes / {det.spec.num_attributes} attributes but the "
                f"annotations give {data.num_classes} / {data.num_attributes} (both counting background / 'no attribute')")
        sd = det.state_dict()
        scale_bbox_pred(sd, sampling.box_weights)  # the file's raw deltas -> the normalised training targets
        det.load_state_dict(sd)
        log.info("initialised from %s (%s layout)", mcfg.init_weights, info["layout"])
    else:
        spec = EXTRACTORS.get(str(mcfg.preset))()
        spec = _spec_overrides(spec, {"num_classes": data.num_classes, "num_attributes": data.num_attributes, **dict(mcfg.spec)})
        if spec.num_classes != data.num_classes or (spec.has_attributes and spec.num_attributes != data.num_attributes):
            raise UsageError(f"model.spec sets {spec.num_classes} classes / {spec.num_attributes} attributes but the annotations give "
                             f"{data.num_classes} / {data.num_attributes}")
        if spec.flavor != "caffe":
            raise UsageError("detector training implements the caffe flavor only (model.preset bottom-up-caffe-r101)")
        torch.manual_seed(int(cfg.train.seed))
        det = BottomUpDetector(spec)
    return det


def build_optimizer(model: torch.nn.Module, tc: Config) -> torch.optim.Optimizer:
    """SGD with momentum (the Faster R-CNN recipe) or AdamW (``train.optimizer: adamw``; see the demo preset)."""
    groups = param_groups(model, float(tc.base_lr), float(tc.weight_decay), float(tc.weight_decay_bias), float(tc.bias_lr_factor))
    if str(tc.optimizer) == "sgd":
        return torch.optim.SGD(groups, lr=float(tc.base_lr), momentum=float(tc.momentum))
    if str(tc.optimizer) == "adamw":
        return torch.optim.AdamW(groups, lr=float(tc.base_lr), betas=(float(tc.momentum), 0.999))
    raise UsageError(f"train.optimizer must be sgd or adamw, not {tc.optimizer!r}")


def _sampling_kwargs(cfg: Config) -> dict[str, Any]:
    d = cfg.sampling.to_dict()
    d.pop("rpn_pre_nms_topk")
    d.pop("rpn_post_nms_topk")
    d["bbox_normalize_stds"] = tuple(float(v) for v in d["bbox_normalize_stds"])
    return d


def _loss_config(cfg: Config) -> LossConfig:
    return LossConfig(rpn_pre_nms_topk=int(cfg.sampling.rpn_pre_nms_topk), rpn_post_nms_topk=int(cfg.sampling.rpn_post_nms_topk), **cfg.loss.to_dict())


def _autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return nullcontext()
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "fp16":
        if device.type != "cuda":
            raise UsageError("train.precision fp16 needs a CUDA device (use bf16 on CPU)")
        return torch.autocast("cuda", dtype=torch.float16)
    raise UsageError(f"train.precision must be fp32, bf16 or fp16, not {precision!r}")


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _training_identity(cfg: Config) -> dict[str, Any]:
    """The config parts a checkpoint must agree with to be resumed (not logging/checkpoint cadence)."""
    d = cfg.to_dict()
    d["train"] = {k: v for k, v in d["train"].items() if k not in ("checkpoint_every", "log_every", "device", "threads")}
    d["data"] = {k: v for k, v in d["data"].items() if k not in ("workers", "eval_annotations", "eval_images")}
    d.pop("eval", None)
    return d


@dataclass
class TrainResult:
    iterations: int
    seconds: float
    images_per_second: float
    losses: dict[str, float]
    weights: Path
    resumed_from: int
    skipped_images: dict[str, int] = field(default_factory=dict)


def _calibration_batch(dataset: TrainBatches, n_iters: int, seed: int, device: torch.device):
    images = []
    for it in range(n_iters):
        images += dataset[it]["images"]
    if not images:
        raise PipelineError("BN calibration: no training image could be decoded")
    blob, _ = pad_blobs(images)
    g = torch.Generator().manual_seed(seed)
    rois = []
    for i, im in enumerate(images):
        b = im.boxes
        jitter = (torch.rand((b.shape[0] * 4, 4), generator=g) - 0.5) * 0.4
        wh = (b[:, 2:] - b[:, :2] + 1).repeat(4, 2)
        boxes = torch.cat([b, b.repeat(4, 1) + jitter * wh])
        rois.append(torch.cat([torch.full((boxes.shape[0], 1), float(i)), boxes], 1))
    return blob.to(device), torch.cat(rois).to(device)


def train(stage_dir: str | Path, cfg: Config) -> TrainResult:
    """Train per ``cfg`` (the ``train_detector`` stage config) in ``stage_dir``; resumes from its checkpoint."""
    threads = torch.get_num_threads()
    if int(cfg.train.threads) > 0:
        torch.set_num_threads(int(cfg.train.threads))
    try:
        return _train(Path(stage_dir), cfg)
    finally:
        torch.set_num_threads(threads)


def _train(stage_dir: Path, cfg: Config) -> TrainResult:
    tc = cfg.train
    dist = dist_info()
    device = resolve_device(str(tc.device))
    if device.type == "cuda" and dist.enabled:
        device = torch.device("cuda", dist.local_rank)
        torch.cuda.set_device(device)
    if dist.enabled and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if not cfg.data.train_annotations:
        raise UsageError("data.train_annotations is required (a COCO instances json)")
    data = load_instances(cfg.data.train_annotations, cfg.data.train_images, max_attributes=int(cfg.data.max_attributes))
    if not data.records:
        raise UsageError(f"{cfg.data.train_annotations}: no usable training image ({dict(data.counts)})")
    log.info("training on %d images, %d classes, %d attributes (skipped: %s)", len(data.records), data.num_classes - 1,
             data.num_attributes - 1, ", ".join(f"{k} {v}" for k, v in sorted(data.counts.items())) or "none")

    det = build_detector(cfg, data)
    spec = det.spec
    min_size = spec.min_size if tc.min_size is None else int(tc.min_size)
    max_size = spec.max_size if tc.max_size is None else int(tc.max_size)
    set_trainable(det, int(tc.freeze_at))
    model = DetectorForTraining(det, SamplingConfig(**_sampling_kwargs(cfg)), _loss_config(cfg)).to(device)
    model.train()
    batches = TrainBatches(data.records, int(tc.images_per_batch), int(tc.seed), min_size, max_size, spec.pixel_means,
                           bool(cfg.data.flip), dist.rank, dist.world)
    optimizer = build_optimizer(model, tc)
    scaler = torch.amp.GradScaler(device.type, enabled=str(tc.precision) == "fp16")
    ckpt_path = stage_dir / CHECKPOINT
    identity = _training_identity(cfg)
    start = 0
    if ckpt_path.exists():
        ck = load_checkpoint(ckpt_path, required=("model", "optimizer", "iteration", "rng", "identity"))
        if ck["identity"] != identity:
            raise UsageError(f"checkpoint {ckpt_path} was written under a different training config; use another --out or --force")
        if len(ck["rng"]) != dist.world:
            raise UsageError(f"checkpoint {ckpt_path} comes from {len(ck['rng'])} processes, this run has {dist.world}")
        model.detector.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        if "scaler" in ck:
            scaler.load_state_dict(ck["scaler"])
        start = int(ck["iteration"])
        restore_rng_state(ck["rng"][dist.rank])
        log.info("resuming from %s at iteration %d", ckpt_path, start)
    else:
        if bool(cfg.model.calibrate_bn) and not cfg.model.init_weights:
            blob, rois = _calibration_batch(batches, max(1, 8 // int(tc.images_per_batch)), int(tc.seed), device)
            n = calibrate_batchnorm(model.detector, blob, rois)
            log.info("calibrated %d frozen BatchNorms on %d training images", n, blob.shape[0])
        _seed_all(int(tc.seed) * 1009 + dist.rank)
    # DDP broadcasts rank 0's parameters and buffers at construction: every process starts identical
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None) if dist.enabled else model

    max_iter = int(tc.max_iter)
    loader = DataLoader(batches, batch_size=1, sampler=range(start, max_iter), collate_fn=collate_one, num_workers=thread_policy.loader_workers(int(cfg.data.workers), int(tc.threads) or None),
                        generator=torch.Generator().manual_seed(int(tc.seed)), persistent_workers=False)
    steps = [int(s) for s in tc.steps]
    running: dict[str, float] = {}
    recent: dict[str, list[float]] = {}
    failures = 0
    t0 = time.perf_counter()
    images_seen = 0
    it = start
    with make_progress() as progress:
        task = progress.add_task("train-detector", total=max_iter, completed=start)
        for batch in loader:
            it = batch["iteration"]
            for f in batch["failures"]:
                failures += 1
                log.warning("iteration %d: skipped image %s", it, f)
            lr = lr_at(it, float(tc.base_lr), int(tc.warmup_iters), float(tc.warmup_factor), steps, float(tc.gamma))
            apply_lr(optimizer, lr)
            if batch["images"]:
                images, sizes = pad_blobs(batch["images"])
                with _autocast(str(tc.precision), device):
                    losses = ddp(images.to(device, non_blocking=True), sizes, batch["images"])
                total = sum(losses.values())
                if not torch.isfinite(total):
                    vals = ", ".join(f"{k}={float(v):.4g}" for k, v in losses.items())
                    raise PipelineError(f"detector training diverged at iteration {it} ({vals}); lower train.base_lr or set train.clip_grad_norm")
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(total).backward()
                if float(tc.clip_grad_norm) > 0:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], float(tc.clip_grad_norm))
                scaler.step(optimizer)
                scaler.update()
                images_seen += len(batch["images"])
                for k, v in losses.items():
                    recent.setdefault(k, []).append(float(v.detach()))
            done = it + 1
            if is_main_process() and (done % int(tc.log_every) == 0 or done == max_iter) and recent:
                running = {k: sum(v) / len(v) for k, v in recent.items()}
                recent = {}
                log.info("iter %d/%d lr %.5g loss %.4f (%s)", done, max_iter, lr, sum(running.values()),
                         ", ".join(f"{k} {v:.4f}" for k, v in running.items()))
            if done % int(tc.checkpoint_every) == 0 or done == max_iter:
                _save(ckpt_path, model, optimizer, scaler, done, identity, dist)
            progress.advance(task)
    seconds = time.perf_counter() - t0
    if recent:
        running = {k: sum(v) / len(v) for k, v in recent.items()}
    if start >= max_iter:
        log.info("training already finished (%d iterations)", max_iter)
    weights = stage_dir / WEIGHTS
    if is_main_process():
        export_weights(model.detector, weights, model.sampling.bbox_normalize_stds, data.class_names, data.attribute_names,
                       {"iterations": max_iter, "images": len(data.records), "annotations": str(cfg.data.train_annotations)})
    if dist.enabled:
        torch.distributed.barrier()
    return TrainResult(max_iter, seconds, images_seen * dist.world / seconds if seconds > 0 else 0.0,
                       {k: round(v, 5) for k, v in running.items()}, weights, start,
                       {**{k: int(v) for k, v in data.counts.items()}, **({"undecodable": failures} if failures else {})})


def _save(path: Path, model: DetectorForTraining, optimizer, scaler, iteration: int, identity: dict[str, Any], dist: DistInfo) -> None:
    rng = capture_rng_state()
    if dist.enabled:
        gathered: list[Any] = [None] * dist.world
        torch.distributed.all_gather_object(gathered, rng)
        states = gathered
    else:
        states = [rng]
    if is_main_process():
        save_checkpoint(path, {"model": model.detector.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                               "iteration": iteration, "rng": states, "identity": identity})

