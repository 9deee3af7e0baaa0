"""Training the grounded sentence encoder: the ``encoder`` stage of a run directory (``cli train-encoder``).

Built on the training core (:mod:`pipeline.core.training`): the loop and its hooks, the device and DDP context
(:mod:`pipeline.core.distributed`), ``precision``, seeding, the stop-on-signal context, the non-finite check,
the optimizer step and the resume bookkeeping, the typed checkpoint (:mod:`pipeline.embedding.checkpoint`) and
the stage manifest (:func:`pipeline.core.stages.run_stage`). Only the batches, the loss and the validation are
encoder-specific: the objective's loss (Yoo et al. 2021, §3.4: L_VG, L_C or their sum), Adam and value
clipping to [-5, 5].

Exact resume: the batches of an epoch are a pure function of (seed, epoch) (:class:`SplitCaptions`), so
``last.pt`` (weights, Adam state, RNG states, epoch, batches done) resumes at the next batch. Under
``torchrun`` each rank takes the ``rank::world`` share of every global batch; the ranking negatives are
that rank's share (in-batch negatives per process), and DDP averages the gradients.
SIGTERM/SIGINT: ``last.pt`` is saved at the next step boundary and the run stops
(:class:`~pipeline.core.training.TrainingInterrupted`).
Validation: caption-to-image R@1 on ``validation.split`` (cap2cap: minus the caption loss); ``best.pt``
keeps the best epoch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pipeline.caption_data.prepared import PreparedCaptions
from pipeline.core import distributed
from pipeline.core.config import Config
from pipeline.core.console import get_logger
from pipeline.core.errors import UsageError
from pipeline.core.stages import StageResult, run_stage
from pipeline.core.training import (
    StopOnSignal,
    autocast,
    check_finite,
    make_scaler,
    optimizer_step,
    resolve_precision,
    seed_everything,
)
from pipeline.core.training.loop import (
    BestCheckpoint,
    DistributedSync,
    JsonlLog,
    LogHook,
    PeriodicCheckpoint,
    SignalStop,
    TrainLoop,
    ValidationHook,
)
from pipeline.core.training.resume import ResumeState
from pipeline.embedding.checkpoint import EncoderCheckpoint, EncoderProgress, read_encoder_checkpoint
from pipeline.embedding.data import SplitCaptions, image_table
from pipeline.embedding.losses import caption_loss, cosine_matrix, ranking_loss
from pipeline.embedding.retrieval import split_similarity
from pipeline.embedding.sentence_encoder import SentenceEncoder, build_sentence_encoder, encoder_config
from pipeline.metrics.retrieval import retrieval_metrics
from pipeline.store import FeatureStore

log = get_logger("encoder")
STAGE = "encoder"
BEST_METRIC = "c2i_R@1"  # caption-to-image Recall@1 on the validation split selects best.pt


class _Objective(nn.Module):
    """What DDP wraps: the batch loss of the chosen objective (§3.4) and its parts."""

    def __init__(self, model: SentenceEncoder, ranking_form: str) -> None:
        super().__init__()
        self.model, self.ranking_form = model, ranking_form

    def forward(self, batch: dict[str, torch.Tensor], images: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        enc = self.model.encode(batch["tokens"], batch["lengths"])
        parts: dict[str, torch.Tensor] = {}
        if self.model.image_head is not None:  # L_VG (Eq. 1): in-batch negatives
            sim = cosine_matrix(self.model.predict_image(enc["h"]), images)
            parts["vg"] = ranking_loss(sim, torch.arange(len(sim), device=sim.device), self.ranking_form)
        if self.model.decoder is not None:  # L_C
            parts["cap"] = caption_loss(self.model.decode_teacher_forced(enc["h"], batch["targets"]), batch["targets"])
        total = sum(parts.values())
        return total, {k: float(v.detach()) for k, v in parts.items()}


def evaluate_retrieval(
    model: SentenceEncoder,
    split: SplitCaptions,
    images: np.ndarray,
    device: torch.device,
    max_images: int | None = None,
) -> dict[str, float]:
    """Caption <-> image Recall@1/5/10 of the split's ground-truth captions (cap2img/cap2all models)."""
    if max_images:
        split = SplitCaptions(split.keys[:max_images], split.positions[:max_images], split.data)
        images = images[:max_images]
    tokens, lengths, caption_image = split.all_captions()
    sim = split_similarity(model, tokens, lengths, images, device)
    return retrieval_metrics(sim, caption_image.numpy())


class EncoderTrainer(TrainLoop):
    """Trains the encoder of ``cfg`` (an ``encoder:`` section) into ``stage_dir``.

    Hooks (:mod:`pipeline.core.training.loop`), in order: the distributed entry/exit, validation (caption-to-image
    R@1), the best checkpoint (``best.pt`` by ``c2i_R@1``), the epoch log, ``last.pt`` every ``checkpoint_every``
    steps and the stop on a signal."""

    def __init__(self, stage_dir: Path, cfg: Config, ctx: distributed.DistContext) -> None:
        super().__init__()
        self.dir, self.cfg, self.ctx = Path(stage_dir), cfg, ctx
        self.dir.mkdir(parents=True, exist_ok=True)
        seed_everything(int(cfg.seed) + 1000003 * ctx.rank)  # the initial weights depend on the seed only
        self.data = PreparedCaptions.load(cfg.data)
        store = FeatureStore(cfg.store)
        self.train_split = SplitCaptions.load(self.data, "train", store)
        workers = int(cfg.num_workers)  # the image vectors are read from the store in this many DataLoader processes
        self.train_images = torch.from_numpy(image_table(store, self.train_split.keys, cfg.max_boxes, workers)).to(
            ctx.device
        )
        val = cfg.validation.split
        self.val = SplitCaptions.load(self.data, val, store) if val else None
        self.val_images = image_table(store, self.val.keys, cfg.max_boxes, workers) if self.val else None
        self.model_cfg = encoder_config(dict(cfg.model_overrides)).to_dict()
        self.model = build_sentence_encoder(len(self.data.vocab), int(store.feature_dim), **self.model_cfg).to(
            ctx.device
        )
        self.precision = resolve_precision(cfg.precision, ctx.device, "sentence_encoder.precision")
        self.objective: nn.Module = _Objective(self.model, str(cfg.ranking_form))
        if ctx.distributed:
            self.objective = nn.parallel.DistributedDataParallel(
                self.objective, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None
            )
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=float(cfg.lr))
        self.scaler = make_scaler(self.precision, ctx.device)
        self.progress = EncoderProgress()
        self.log_file = JsonlLog(self.dir / "log.jsonl", ctx)
        self._epoch: dict[str, Any] = {}
        last = self.dir / "last.pt"
        self.signal_stop = SignalStop(
            ctx,
            lambda: self._save("last.pt", "train"),
            lambda: f"epoch {self.progress.epoch}, batch {self.progress.position}",
            last,
        )
        self.best_checkpoint = BestCheckpoint(
            BEST_METRIC,
            lambda: self.progress,
            lambda: self._save("best.pt", "weights"),
            fields=lambda: {"epoch": self.progress.epoch},
            unvalidated=self._keep_last_epoch,
        )
        self.register_hooks(
            [
                DistributedSync(ctx),
                ValidationHook(self._validate, report=self._report),
                self.best_checkpoint,
                LogHook(self.log_file.write, epoch_record=self._epoch_record),
                PeriodicCheckpoint(
                    lambda: self._save("last.pt", "train"),
                    int(cfg.checkpoint_every),
                    lambda: self.progress.global_step,
                ),
                self.signal_stop,
            ]
        )
        log.info(
            "sentence encoder (%s, self-attention %s, %.2fM parameters), %d train images, device %s, precision %s",
            self.model.objective,
            self.model.self_attention,
            sum(p.numel() for p in self.model.parameters()) / 1e6,
            len(self.train_split.keys),
            ctx.device,
            self.precision,
        )

    @property
    def stop(self) -> StopOnSignal:
        """The stop-on-signal state of this run's :class:`SignalStop` hook."""
        return self.signal_stop.stop

    @property
    def stop_signal(self) -> int | None:
        """The signal that asked this run to stop (None: none yet); settable, e.g. to stop after the next step."""
        return self.stop.signum

    @stop_signal.setter
    def stop_signal(self, signum: int | None) -> None:
        self.stop.signum = signum

    def _checkpoint(self, kind: str) -> EncoderCheckpoint:
        """The checkpoint of now; ``kind`` "train" adds the resume state (every rank takes part: RNG states)."""
        state = ResumeState.capture(self.optimizer, self.scaler, self.ctx) if kind == "train" else None
        return EncoderCheckpoint(
            model_config=self.model_cfg,
            image_dim=self.model.image_dim,
            vocab=tuple(self.data.vocab.words),
            weights={k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            progress=self.progress,
            train_config=self.cfg.to_dict(),
            state=state,
        )

    def _save(self, name: str, kind: str) -> None:
        ckpt = self._checkpoint(kind)
        if self.ctx.main:
            ckpt.save(self.dir / name)

    def _resume(self) -> EncoderProgress:
        last = self.dir / "last.pt"
        if not last.exists():
            return EncoderProgress()
        ckpt = read_encoder_checkpoint(last, self.data.vocab)
        if ckpt.model_config != self.model_cfg:
            raise UsageError(
                f"checkpoint {last} was trained with another encoder configuration; use --force to start over"
            )
        if ckpt.state is None or ckpt.progress is None:
            raise UsageError(f"checkpoint {last} is not a training checkpoint (kind {ckpt.kind!r})")
        self.model.load_state_dict(ckpt.weights)
        prog = ckpt.progress
        ckpt.state.restore(self.optimizer, self.scaler, self.ctx, int(self.cfg.seed) + prog.global_step)
        log.info("resuming from %s: epoch %d, batch %d", last, prog.epoch, prog.position)
        return prog

    def _step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        self.model.train()
        batch = {k: v.to(self.ctx.device) for k, v in batch.items()}
        with autocast(self.ctx.device, self.precision):
            loss, parts = self.objective(batch, self.train_images[batch["rows"]])
        check_finite(
            float(loss.detach()),
            self.ctx,
            f"the encoder loss became non-finite; the last good checkpoint is kept in {self.dir / 'last.pt'}",
        )
        clip = self.cfg.grad_clip_value
        optimizer_step(
            loss, self.optimizer, self.scaler, None if clip is None else float(clip), None, self.model.parameters()
        )
        return {"loss": float(loss.detach()), **parts}

    def _validate(self) -> dict[str, float] | None:
        if self.val is None or not self.ctx.main:
            return None
        if self.model.image_head is not None:
            return evaluate_retrieval(
                self.model, self.val, self.val_images, self.ctx.device, self.cfg.validation.max_images
            )
        return None

    def _report(self, scores: dict[str, float]) -> None:
        self.progress.history.append({"epoch": self.progress.epoch, **scores})

    def _keep_last_epoch(self) -> None:
        """Without validation scores (no split, the cap2cap objective): ``best.pt`` is the last epoch."""
        if self.ctx.main:
            self.progress.best = {"metric": "last epoch", "value": float("nan"), "epoch": self.progress.epoch}
            self._save("best.pt", "weights")

    def _epoch_record(self) -> dict[str, Any]:
        scores = self.scores
        record: dict[str, Any] = {**self._epoch, **(scores or {})}
        log.info(
            "epoch %d: loss %.4f%s",
            self.progress.epoch,
            record["loss"] or float("nan"),
            f", val c2i R@1 {scores['c2i_R@1']:.2f} (chance {scores['c2i_chance_R@1']:.2f})" if scores else "",
        )
        return record

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train (resuming ``last.pt``) until ``epochs``; returns the summary (best, recent history, global steps)."""
        self.train()
        prog = self.progress
        return {"best": prog.best, "history": prog.history[-10:], "global_steps": prog.global_step}

    def batches(self) -> Iterator[dict[str, torch.Tensor]]:
        seed_everything(int(self.cfg.seed) + 1000003 * self.ctx.rank)
        self.progress = prog = self._resume()
        while prog.epoch < int(self.cfg.epochs):
            batches = list(self.train_split.batches(int(self.cfg.batch_size), int(self.cfg.seed), prog.epoch))
            t0 = time.perf_counter()
            self._losses: list[float] = []
            self._parts: dict[str, list[float]] = {}
            yield from batches[prog.position :]
            self._epoch = {
                "event": "epoch",
                "epoch": prog.epoch,
                "loss": float(np.mean(self._losses)) if self._losses else None,
                "seconds": round(time.perf_counter() - t0, 3),
                **{k: float(np.mean(v)) for k, v in self._parts.items()},
            }
            self.end_epoch()
            prog.epoch += 1
            prog.position = 0
            self._save("last.pt", "train")

    def run_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """This rank's share of ``batch`` (none: every rank skips it) -> the step's losses; then the counters."""
        part = rank_slice(batch, self.ctx)
        stats: dict[str, float] = {}
        if part is not None:
            stats = self._step(part)
            self._losses.append(stats["loss"])
            for k in ("vg", "cap"):
                if k in stats:
                    self._parts.setdefault(f"loss_{k}", []).append(stats[k])
        self.progress.position += 1
        self.progress.global_step += 1
        return stats


def rank_slice(batch: dict[str, torch.Tensor], ctx: distributed.DistContext) -> dict[str, torch.Tensor] | None:
    """This rank's ``rank::world`` rows of a global batch, or None on EVERY rank when some rank would get none.

    Every rank sees the same global batch, so all of them skip a batch smaller than the world together (at most
    ``world - 1`` rows at an epoch's end) without a collective; one rank alone raising on an empty slice would
    leave the others waiting in the gradient all-reduce."""
    if not ctx.distributed:
        return batch
    rows = len(next(iter(batch.values())))
    if rows < ctx.world:
        log.info("skipping a last batch of %d rows: fewer than the %d processes", rows, ctx.world)
        return None
    return {k: v[ctx.rank :: ctx.world] for k, v in batch.items()}


def resolve_encoder_paths(run_dir: str | Path, section: Config) -> Config:
    """``sentence_encoder.store`` / ``sentence_encoder.data`` default to RUN/features/store and RUN/data."""
    sets = {}
    for key, default in (("store", Path(run_dir) / "features" / "store"), ("data", Path(run_dir) / "data")):
        if section[key] is None:
            if not default.exists():
                raise UsageError(
                    f"sentence_encoder.{key} is not set and {default} does not exist; pass --set "
                    f"sentence_encoder.{key}=PATH"
                )
            sets[key] = str(default)
    return section.with_overrides(sets) if sets else section


def train_encoder(run_dir: str | Path, cfg: Config, force: bool = False) -> StageResult:
    """Train the encoder of ``cfg.sentence_encoder`` into ``run_dir/encoder`` (best.pt, last.pt, log.jsonl)."""
    section = resolve_encoder_paths(run_dir, cfg.sentence_encoder if "sentence_encoder" in cfg else cfg)
    ctx = distributed.setup(str(section.device), "sentence_encoder.device")

    def work(stage_dir: Path, scfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
        summary = EncoderTrainer(stage_dir, scfg, ctx).run()
        return {"last": "last.pt", "best": "best.pt", "log": "log.jsonl"}, summary

    try:
        if ctx.main:
            result = run_stage(run_dir, STAGE, section, work, force=force)
        else:
            outputs, summary = work(Path(run_dir) / STAGE, section)
            result = StageResult(STAGE, Path(run_dir) / STAGE, outputs, 0.0, False, summary)
        distributed.barrier(ctx)
        return result
    finally:
        distributed.teardown(ctx)
