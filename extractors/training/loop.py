"""The resumable detector trainer (single process, or DDP under ``torchrun``: gloo on CPU, NCCL on GPU).

Built on the training core (:mod:`pipeline.core.training`): the loop and its hooks, device and distributed
context, ``precision``, seeding, the stop-on-signal context, the non-finite check, the optimizer step (scaler,
clipping) and the exact-resume bookkeeping. This module keeps what is special to the detector: its batches
(:class:`~extractors.training.data.TrainBatches`), its losses (:class:`~extractors.training.model.DetectorForTraining`)
and the warm-up + step learning rate.

Exact resume: the checkpoint (``checkpoints/last.pt``, :class:`~extractors.training.checkpoint.DetectorCheckpoint`,
written atomically every ``checkpoint_every`` iterations, at the last and at the next iteration after
SIGTERM/SIGINT) holds the weights and frozen statistics, the optimizer state (SGD momentum or AdamW moments),
the gradient scaler, the iteration and every process's RNG states; batches are a pure function of the
iteration. A run killed at any moment (or stopped by a signal) and started again therefore ends with bitwise
the same weights on CPU as an uninterrupted one (same thread count).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from extractors import EXTRACTORS
from extractors.bottom_up import BottomUpDetector, parts_of
from extractors.spec import BottomUpSpec
from extractors.training.checkpoint import DetectorCheckpoint
from extractors.training.data import InstanceSet, TrainBatches, collate_one, load_instances, pad_blobs
from extractors.training.export import export_weights, reinit_heads, scale_bbox_pred
from extractors.training.model import DetectorForTraining, LossConfig
from extractors.training.optim import (
    apply_lr,
    calibrate_batchnorm,
    calibration_batch,
    lr_at,
    param_groups,
    set_trainable,
)
from extractors.training.targets import SamplingConfig
from extractors.weights import load_detector
from pipeline.core import distributed
from pipeline.core import threads as thread_policy
from pipeline.core.config import Config
from pipeline.core.console import get_logger, make_progress
from pipeline.core.errors import UsageError
from pipeline.core.training import (
    StopOnSignal,
    autocast,
    check_finite,
    make_scaler,
    optimizer_step,
    resolve_precision,
    seed_everything,
)
from pipeline.core.training.determinism import deterministic_mode
from pipeline.core.training.loop import DistributedSync, HookBase, LogHook, PeriodicCheckpoint, SignalStop, TrainLoop
from pipeline.core.training.resume import ResumeState

log = get_logger("train-detector")

CHECKPOINT = "checkpoints/last.pt"
WEIGHTS = "detector.pth"


def build_detector(cfg: Config, data: InstanceSet) -> BottomUpDetector:
    """The detector to train: from ``model.init_weights`` (bbox_pred normalised for training) or random."""
    mcfg = cfg.model
    sampling = SamplingConfig(**_sampling_kwargs(cfg))
    if mcfg.init_weights:
        det, info = load_detector(str(mcfg.init_weights))
        if mcfg.spec:
            det_spec = det.spec.with_overrides(dict(mcfg.spec), "model.spec")
            det.spec = det.proposal_generator.spec = det.roi_heads.spec = det_spec
        if not det.trainable or parts_of(det.spec) is not det.parts:  # model.spec may not change the semantics
            raise UsageError(
                f"{mcfg.init_weights}: detector training implements the caffe flavor only ({info['layout']} files have "
                "detectron2 semantics)"
            )
        if bool(mcfg.reinit_heads):
            det = reinit_heads(det, data.num_classes, data.num_attributes, int(cfg.detector_train.seed))
            log.info(
                "initialised from %s (%s layout): backbone, RPN and res5 kept; class and attribute heads "
                "re-initialised for "
                "%d classes / %d attributes",
                mcfg.init_weights,
                info["layout"],
                data.num_classes,
                data.num_attributes,
            )
            return det
        if det.spec.num_classes != data.num_classes or (
            det.spec.has_attributes and det.spec.num_attributes != data.num_attributes
        ):
            raise UsageError(
                f"{mcfg.init_weights} has {det.spec.num_classes} classes / {det.spec.num_attributes} attributes but "
                f"the annotations give {data.num_classes} / {data.num_attributes} (both counting background / "
                "'no attribute'); --reinit-heads (model.reinit_heads=true) starts the class and attribute heads afresh "
                "for the annotations' labels"
            )
        sd = det.state_dict()
        scale_bbox_pred(sd, sampling.box_weights)  # the file's raw deltas -> the normalised training targets
        det.load_state_dict(sd)
        log.info("initialised from %s (%s layout)", mcfg.init_weights, info["layout"])
    else:
        spec = EXTRACTORS.get(str(mcfg.preset))()
        spec = spec.with_overrides(
            {"num_classes": data.num_classes, "num_attributes": data.num_attributes, **dict(mcfg.spec)}, "model.spec"
        )
        if spec.num_classes != data.num_classes or (spec.has_attributes and spec.num_attributes != data.num_attributes):
            raise UsageError(
                f"model.spec sets {spec.num_classes} classes / {spec.num_attributes} attributes but the annotations "
                "give "
                f"{data.num_classes} / {data.num_attributes}"
            )
        parts = parts_of(spec)
        if parts is None or not parts.trainable:
            raise UsageError("detector training implements the caffe flavor only (model.preset bottom-up-caffe-r101)")
        seed_everything(int(cfg.detector_train.seed))
        det = BottomUpDetector(spec, parts)
    return det


def build_optimizer(model: torch.nn.Module, tc: Config) -> torch.optim.Optimizer:
    """SGD with momentum (the Faster R-CNN recipe) or AdamW (``detector_train.optimizer: adamw``; see the demo
    preset)."""
    groups = param_groups(
        model, float(tc.base_lr), float(tc.weight_decay), float(tc.weight_decay_bias), float(tc.bias_lr_factor)
    )
    if str(tc.optimizer) == "sgd":
        return torch.optim.SGD(groups, lr=float(tc.base_lr), momentum=float(tc.momentum))
    if str(tc.optimizer) == "adamw":
        return torch.optim.AdamW(groups, lr=float(tc.base_lr), betas=(float(tc.momentum), 0.999))
    raise UsageError(f"detector_train.optimizer must be sgd or adamw, not {tc.optimizer!r}")


def _sampling_kwargs(cfg: Config) -> dict[str, Any]:
    d = cfg.sampling.to_dict()
    d["bbox_normalize_stds"] = tuple(float(v) for v in d["bbox_normalize_stds"])
    return d


def sampling_config(cfg: Config) -> SamplingConfig:
    """The RPN / RoI sampling settings of a ``train_detector`` config (its ``sampling`` section)."""
    return SamplingConfig(**_sampling_kwargs(cfg))


def loss_config(cfg: Config) -> LossConfig:
    """The loss settings of a ``train_detector`` config (its ``loss`` section)."""
    return LossConfig(**cfg.loss.to_dict())


def _training_identity(cfg: Config) -> dict[str, Any]:
    """The config parts a checkpoint must agree with to be resumed (not logging/checkpoint cadence)."""
    d = cfg.to_dict()
    # kept under the name "train" (the section's old spelling), so a checkpoint that records it still resumes
    d["train"] = {
        k: v for k, v in d.pop("detector_train").items() if k not in ("checkpoint_every", "log_every", "device")
    }
    d["data"] = {k: v for k, v in d["data"].items() if k not in ("num_workers", "eval_annotations", "eval_images")}
    d.pop("eval", None)
    return d


@dataclass
class TrainResult:
    """What a detector training run did: iterations, time, speed, last losses, the exported weights."""

    iterations: int
    seconds: float
    images_per_second: float
    losses: dict[str, float]
    weights: Path
    resumed_from: int
    skipped_images: dict[str, int] = field(default_factory=dict)


def train(stage_dir: str | Path, cfg: Config) -> TrainResult:
    """Train per ``cfg`` (the ``train_detector`` stage config) in ``stage_dir``; resumes from its checkpoint."""
    ctx = distributed.setup(str(cfg.detector_train.device), "detector_train.device")
    threads = (
        torch.get_num_threads()
    )  # torch's threads follow the one policy (--threads / BUTD_THREADS); put back after
    try:
        with deterministic_mode(bool(cfg.detector_train.deterministic), "detector_train.deterministic"):
            return DetectorTrainer(Path(stage_dir), cfg, ctx).run()
    finally:
        torch.set_num_threads(threads)
        # Under torchrun, leave the process group before the interpreter exits (as captioner and encoder training
        # do): a gloo group still alive at finalization can abort a process whose run succeeded (SIGABRT;
        # pytorch/pytorch PR 179291).
        distributed.teardown(ctx)


def training_model(cfg: Config, data: InstanceSet) -> DetectorForTraining:
    """The detector of ``cfg`` (:func:`build_detector`) with ``detector_train.freeze_at`` applied, wrapped with its
    losses."""
    det = build_detector(cfg, data)
    set_trainable(det, int(cfg.detector_train.freeze_at))
    return DetectorForTraining(det, sampling_config(cfg), loss_config(cfg))


def train_scales(cfg: Config, spec: BottomUpSpec) -> tuple[int, int]:
    """Training scale (shortest side, longest-side cap): ``detector_train.min_size``/``max_size`` or the spec's test
    scale."""
    tc = cfg.detector_train
    return (
        spec.min_size if tc.min_size is None else int(tc.min_size),
        spec.max_size if tc.max_size is None else int(tc.max_size),
    )


class _ProgressBar(HookBase):
    """The console progress bar of the iterations (from the resumed iteration to ``max_iter``)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._bar: Any = None
        self._task: Any = None

    def before_train(self) -> None:
        self._bar = make_progress()
        progress = self._bar.__enter__()
        self._task = progress.add_task("train-detector", total=self.total, completed=self.trainer.start)

    def after_step(self) -> None:
        self._bar.advance(self._task)

    def after_train(self) -> None:
        self._bar.__exit__(None, None, None)


class _ExportWeights(HookBase):
    """After a completed run, rank 0 exports ``detector.pth`` (before the processes leave the loop together)."""

    def after_train(self) -> None:
        if self.trainer.completed and self.trainer.ctx.main:
            self.trainer.export()


class DetectorTrainer(TrainLoop):
    """Trains the detector of ``cfg`` (a ``train_detector`` config) in ``stage_dir``, resuming its checkpoint.

    Hooks (:mod:`pipeline.core.training.loop`), in order: the loss log every ``log_every`` iterations, the
    checkpoint every ``checkpoint_every`` iterations and at the last, the progress bar, the stop on a signal
    (saving unless this iteration just saved), the export of ``detector.pth`` and the distributed entry/exit."""

    def __init__(self, stage_dir: Path, cfg: Config, ctx: distributed.DistContext) -> None:
        """``ctx``: this process's place in the process group, joined and left by :func:`train`."""
        super().__init__()
        self.dir, self.cfg, tc = Path(stage_dir), cfg, cfg.detector_train
        self.ctx = ctx
        self.precision = resolve_precision(tc.precision, self.ctx.device, "detector_train.precision")
        if not cfg.data.train_annotations:
            raise UsageError("data.train_annotations is required (a COCO instances json)")
        data = load_instances(
            cfg.data.train_annotations, cfg.data.train_images, max_attributes=int(cfg.data.max_attributes)
        )
        if not data.records:
            raise UsageError(f"{cfg.data.train_annotations}: no usable training image ({dict(data.counts)})")
        log.info(
            "training on %d images, %d classes, %d attributes (skipped: %s)",
            len(data.records),
            data.num_classes - 1,
            data.num_attributes - 1,
            ", ".join(f"{k} {v}" for k, v in sorted(data.counts.items())) or "none",
        )
        self.data = data
        self.model = training_model(cfg, data).to(self.ctx.device)
        self.model.train()
        spec = self.model.detector.spec
        self.batches_of = TrainBatches(
            data.records,
            int(tc.images_per_batch),
            int(tc.seed),
            *train_scales(cfg, spec),
            spec.pixel_means,
            bool(cfg.data.flip),
            self.ctx.rank,
            self.ctx.world,
        )
        self.optimizer = build_optimizer(self.model, tc)
        self.scaler = make_scaler(self.precision, self.ctx.device)
        self.checkpoint = self.dir / CHECKPOINT
        self.identity = _training_identity(cfg)
        self.steps = [int(s) for s in tc.steps]
        self.lr = float(tc.base_lr)
        self.max_iter = int(tc.max_iter)
        self.start = self.done = 0
        self.failures = self.images_seen = 0
        self.running: dict[str, float] = {}
        self.recent: dict[str, list[float]] = {}
        self.net: torch.nn.Module = self.model
        self.checkpointer = PeriodicCheckpoint(
            lambda: self._save(self.done), int(tc.checkpoint_every), lambda: self.done, last=self.max_iter
        )
        self.signal_stop = SignalStop(
            ctx,
            lambda: None if self.checkpointer.saved_at == self.done else self._save(self.done),
            lambda: f"iteration {self.done} of {self.max_iter}",
            self.checkpoint,
            when=lambda: self.done < self.max_iter,
        )
        self.register_hooks(
            [
                LogHook(
                    self._log_losses, int(tc.log_every), lambda: self.done, self._average_losses, last=self.max_iter
                ),
                self.checkpointer,
                _ProgressBar(self.max_iter),
                self.signal_stop,
                _ExportWeights(),
                DistributedSync(ctx),
            ]
        )

    @property
    def stop(self) -> StopOnSignal:
        """The stop-on-signal state of this run's :class:`SignalStop` hook."""
        return self.signal_stop.stop

    def _resume(self) -> int:
        """Load the checkpoint (weights, optimizer, scaler, RNG states) -> the iteration to start at; or prepare a
        fresh run."""
        tc = self.cfg.detector_train
        if not self.checkpoint.exists():
            if bool(self.cfg.model.calibrate_bn) and not self.cfg.model.init_weights:
                blob, rois = calibration_batch(
                    self.batches_of, max(1, 8 // int(tc.images_per_batch)), int(tc.seed), self.ctx.device
                )
                n = calibrate_batchnorm(self.model.detector, blob, rois)
                log.info("calibrated %d frozen BatchNorms on %d training images", n, blob.shape[0])
            seed_everything(int(tc.seed) * 1009 + self.ctx.rank)
            return 0
        ck = DetectorCheckpoint.load(self.checkpoint)
        if ck.identity != self.identity:
            raise UsageError(
                f"checkpoint {self.checkpoint} was written under a different training config; use another --out or "
                "--force"
            )
        if ck.processes != self.ctx.world:  # each process's batches depend on the world size
            raise UsageError(
                f"checkpoint {self.checkpoint} comes from {ck.processes} processes, this run has {self.ctx.world}"
            )
        self.model.detector.load_state_dict(ck.weights)
        ck.state.restore(self.optimizer, self.scaler, self.ctx, int(tc.seed))
        log.info("resuming from %s at iteration %d", self.checkpoint, ck.iteration)
        return ck.iteration

    def _save(self, iteration: int) -> None:
        state = ResumeState.capture(self.optimizer, self.scaler, self.ctx)  # every rank: the RNG states are gathered
        if self.ctx.main:
            DetectorCheckpoint(self.model.detector.state_dict(), iteration, self.identity, state).save(self.checkpoint)

    def _step(self, net: torch.nn.Module, batch: dict[str, Any], it: int) -> dict[str, float]:
        """One iteration: learning rate, forward under autocast, non-finite check, optimizer step -> the losses."""
        tc = self.cfg.detector_train
        self.lr = lr_at(
            it, float(tc.base_lr), int(tc.warmup_iters), float(tc.warmup_factor), self.steps, float(tc.gamma)
        )
        apply_lr(self.optimizer, self.lr)
        # every rank skips together: one rank alone leaving would hang the others in DDP's gradient all-reduce
        # and check_finite
        if distributed.any_rank(not batch["images"], self.ctx):
            if batch["images"]:
                log.warning("iteration %d: another process has no decodable image; every process skips it", it)
            return {}
        images, sizes = pad_blobs(batch["images"])
        with autocast(self.ctx.device, self.precision):
            losses = net(images.to(self.ctx.device, non_blocking=True), sizes, batch["images"])
        total = sum(losses.values())
        values = {k: float(v.detach()) for k, v in losses.items()}
        check_finite(
            float(total.detach()),
            self.ctx,
            f"detector training diverged at iteration {it} ("
            + ", ".join(f"{k}={v:.4g}" for k, v in values.items())
            + "); lower detector_train.base_lr or set detector_train.clip_grad_norm",
        )
        optimizer_step(total, self.optimizer, self.scaler, clip_norm=float(tc.clip_grad_norm))
        return values

    def _average_losses(self) -> dict[str, Any] | None:
        """Rank 0: the mean of each loss since the last log line (None when there is none)."""
        if not self.ctx.main or not self.recent:
            return None
        self.running, self.recent = {k: sum(v) / len(v) for k, v in self.recent.items()}, {}
        return {"iteration": self.done, "lr": self.lr, "losses": self.running}

    def _log_losses(self, record: dict[str, Any]) -> None:
        losses = record["losses"]
        log.info(
            "iter %d/%d lr %.5g loss %.4f (%s)",
            record["iteration"],
            self.max_iter,
            record["lr"],
            sum(losses.values()),
            ", ".join(f"{k} {v:.4f}" for k, v in losses.items()),
        )

    # -- the loop -----------------------------------------------------------------------------------------
    def batches(self) -> Iterator[dict[str, Any]]:
        tc, ctx = self.cfg.detector_train, self.ctx
        # DDP broadcasts rank 0's parameters and buffers at construction: every process starts identical
        if ctx.distributed:
            self.net = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None
            )
        yield from DataLoader(
            self.batches_of,
            batch_size=1,
            sampler=range(self.start, self.max_iter),
            collate_fn=collate_one,
            num_workers=thread_policy.loader_workers(int(self.cfg.data.num_workers)),
            generator=torch.Generator().manual_seed(int(tc.seed)),
            persistent_workers=False,
        )

    def run_step(self, batch: dict[str, Any]) -> dict[str, float]:
        it = batch["iteration"]
        for f in batch["failures"]:
            self.failures += 1
            log.warning("iteration %d: skipped image %s", it, f)
        values = self._step(self.net, batch, it)
        for k, v in values.items():
            self.recent.setdefault(k, []).append(v)
        self.images_seen += len(batch["images"])
        self.done = it + 1
        return values

    def run(self) -> TrainResult:
        """Train from the checkpoint's iteration to ``detector_train.max_iter``; rank 0 exports ``detector.pth``."""
        self.start = self.done = self._resume()
        t0 = time.perf_counter()
        self.train()
        seconds = time.perf_counter() - t0
        if self.recent:
            self.running = {k: sum(v) / len(v) for k, v in self.recent.items()}
        if self.start >= self.max_iter:
            log.info("training already finished (%d iterations)", self.max_iter)
        data = self.data
        return TrainResult(
            self.max_iter,
            seconds,
            self.images_seen * self.ctx.world / seconds if seconds > 0 else 0.0,
            {k: round(v, 5) for k, v in self.running.items()},
            self.dir / WEIGHTS,
            self.start,
            {
                **{k: int(v) for k, v in data.counts.items()},
                **({"undecodable": self.failures} if self.failures else {}),
            },
        )

    def export(self) -> None:
        """Write ``detector.pth`` (the trained weights in the public layout, with its labels and provenance)."""
        data = self.data
        export_weights(
            self.model.detector,
            self.dir / WEIGHTS,
            self.model.sampling.bbox_normalize_stds,
            data.class_names,
            data.attribute_names,
            {
                "iterations": self.max_iter,
                "images": len(data.records),
                "annotations": str(self.cfg.data.train_annotations),
            },
        )
