"""The captioner trainer: cross-entropy then SCST, validation, best/last checkpoints, exact resume, DDP.

This module holds only what is special to captioners (batches, the XE/SCST losses, validation, the stage
sequence); the loop and its hooks (log, checkpoints, best-checkpoint selection, signals), device, precision,
seeding, the non-finite check, the optimizer step and the resume bookkeeping come from the training core
(:mod:`pipeline.core.training`).

Per step (both stages): batch -> loss *sum* and count -> loss = sum * world / global count (the global
token mean, :mod:`pipeline.core.distributed`) -> non-finite check on every rank (stop, last good checkpoint
kept) -> :func:`~pipeline.core.training.optimizer_step` (fp16 scaler, value/norm clipping) -> schedule step. The rate
of a step is written from the schedule's state just before it (never left over from an earlier epoch), so
continuing past an epoch end and resuming there are the same.

Exact resume: ``last.pt`` (atomic) is written every ``checkpoint_every`` steps, at every epoch end and
when a stage finishes; it holds weights, optimiser/schedule/scaler states, every RNG state, the stage, the
epoch and the number of batches done in it (``position``). The epoch's batch order is a pure function of
(seed, stage, epoch), so a resumed run recomputes it, skips ``position`` batches and continues
bit-identically (CPU, one process). A checkpoint marked ``stage_done`` moves on to the next stage.
SIGTERM/SIGINT: the :class:`~pipeline.core.training.loop.SignalStop` hook (save at the next step, then
:class:`~pipeline.core.training.TrainingInterrupted`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models import build_captioner, model_card, model_config
from models.checkpoints import CaptionerCheckpoint, Progress, TrainingState
from models.decoding import DecodeOptions, decoding_options
from pipeline.caption_data.prepared import PreparedCaptions
from pipeline.core.config import Config
from pipeline.core.console import get_logger
from pipeline.core.distributed import DistContext, all_sums, broadcast_object
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.fileio import atomic_write_bytes
from pipeline.core.training import (
    StopOnSignal,
    TrainingInterrupted,
    autocast,
    make_scaler,
    optimizer_step,
    resolve_precision,
    restore_rng_states,
    restore_training_state,
    seed_everything,
    training_state,
)
from pipeline.core.training.loop import (
    BestCheckpoint,
    DistributedSync,
    HookBase,
    JsonlLog,
    LogHook,
    PeriodicCheckpoint,
    SignalStop,
    TrainLoop,
    ValidationHook,
)
from pipeline.data import CaptionDataset
from pipeline.metrics.cider import CiderD
from pipeline.store import FeatureStore
from pipeline.training.batches import BatchSource, choose_preload, epoch_batches
from pipeline.training.recipe import StageRecipe, stage_recipe
from pipeline.training.schedules import apply_lr, build_schedule
from pipeline.training.scst_step import greedy_rewards, scst_loss
from pipeline.training.validation import decode_split, score_split
from pipeline.training.xe import xe_loss_sum

log = get_logger("train")

STAGES = ("xe", "scst")
STAGE_SEED_OFFSET = {"xe": 0, "scst": 7919}
__all__ = ["Progress", "Trainer", "TrainingInterrupted", "build_optimizer"]


def _plain(value: Any) -> dict[str, Any]:
    return value.to_dict() if hasattr(value, "to_dict") else dict(value)


class _Policy(nn.Module):
    """What DDP wraps: one forward computes a stage's loss sum (so DDP's hooks see every used parameter)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, kind: str, batch: dict[str, Any], kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
        if kind == "xe":
            loss, count = xe_loss_sum(self.model, batch, **kwargs)
            return loss, float(count)
        out = scst_loss(self.model, batch, **kwargs)
        return out.loss_sum, out


def build_optimizer(recipe: StageRecipe, params: Any) -> torch.optim.Optimizer:
    """The stage recipe's optimizer (Adam, AdamW, Adamax or SGD) at lr 0 (the schedule sets it).

    ``optimizer_impl: foreach`` (default): one multi-tensor operator per update term for all parameters, on CPU as
    on CUDA (where PyTorch picks it by default); the per-parameter loop PyTorch uses on CPU dispatches ~10 operators
    per parameter tensor, and even foreach Adam reads each parameter's step count on the host (two ``item`` per
    tensor). ``fused``: PyTorch's fused kernel, the whole update in one operator (the same formula, other float
    rounding: an opt-in, not the faithful default)."""
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "adamax": torch.optim.Adamax, "sgd": torch.optim.SGD}[
        recipe.optimizer
    ]
    impl = {"fused": {"fused": True}}.get(recipe.optimizer_impl, {"foreach": True})
    return cls(params, lr=0.0, **{**impl, **recipe.optimizer_kwargs})


class _TensorBoard(HookBase):
    """``train.tensorboard``: every number of the log records also goes to ``STAGE_DIR/tensorboard`` (rank 0)."""

    def __init__(self, out: Path, log_file: JsonlLog, enabled: bool) -> None:
        self.out, self.log_file, self.enabled = out, log_file, enabled

    def before_train(self) -> None:
        if not self.enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 -- optional dependency (tensorboard)
        except ImportError:
            log.warning("train.tensorboard is set but tensorboard is not installed; metrics go to log.jsonl only")
            return
        self.log_file.scalars = SummaryWriter(str(self.out))

    def after_train(self) -> None:
        if self.log_file.scalars is not None:
            self.log_file.scalars.close()
            self.log_file.scalars = None


class _EpochEnd(HookBase):
    """After validation and the best checkpoint: the patience count (``recipe.patience`` epochs without a gain
    stop the stage) and the schedule's epoch end (``plateau`` reads the validation metric)."""

    def after_epoch(self) -> None:
        t = self.trainer
        prog, recipe = t.progress, t.recipes[t.progress.stage]
        if t.best_checkpoint.improved is False:
            prog.bad_epochs += 1
            t.stop_early = recipe.patience is not None and prog.bad_epochs >= recipe.patience
        if t.schedule.name == "plateau":
            t.schedule.epoch_end(t.scores[t.metric] if t.scores is not None else None)
        else:
            t.schedule.epoch_end()


class Trainer(TrainLoop):
    """Trains ``cfg.model`` on (``cfg.store``, ``cfg.data``) into ``stage_dir`` (see the module docstring).

    Hooks (:mod:`pipeline.core.training.loop`), in order: TensorBoard, the log (a train record every ``log_every``
    steps, an epoch record), validation, the best checkpoint (``best.pt`` by ``train.validation.metric``), the
    patience and schedule epoch end, ``last.pt`` every ``checkpoint_every`` steps, the stop on a signal and the
    distributed entry/exit."""

    def __init__(self, stage_dir: Path, cfg: Config, ctx: DistContext) -> None:
        super().__init__()
        self.dir, self.cfg, self.ctx = Path(stage_dir), cfg, ctx
        if cfg.store is None or cfg.data is None:
            raise UsageError("train.store (feature store) and train.data (prepared captions folder) are required")
        unknown = [s for s in cfg.stages if s not in STAGES]
        if unknown or not cfg.stages:
            raise UsageError(f"train.stages must be a non-empty list of xe, scst; got {list(cfg.stages)}")
        self.stages = [s for s in STAGES if s in cfg.stages]
        self.data = PreparedCaptions.load(cfg.data)
        self.vocab = self.data.vocab
        store = FeatureStore(cfg.store)
        self.train_set = CaptionDataset(store, self.data, "train", max_boxes=cfg.max_boxes)
        val = cfg.validation
        self.val_set = CaptionDataset(store, self.data, val.split, max_boxes=cfg.max_boxes) if val.split else None
        self.references = self.data.references()
        overrides = _plain(cfg.model_overrides)
        base_model_cfg = model_config(cfg.model)
        if "feat_dim" in base_model_cfg and "feat_dim" not in overrides:
            overrides["feat_dim"] = int(store.feature_dim)
        self.model_cfg = model_config(cfg.model, overrides).to_dict()
        seed_everything(int(cfg.seed))  # the initial weights depend on the seed only (same on every rank)
        self.model = build_captioner(cfg.model, len(self.vocab), **self.model_cfg).to(ctx.device)
        card = model_card(cfg.model)
        self.recipes = {
            s: stage_recipe(s, card.schedule.to_dict(), _plain(cfg[s]), cfg.default_epochs, f"{card.path}: schedule")
            for s in self.stages
        }
        for r in self.recipes.values():
            if r.max_caption_len is not None and r.max_caption_len != self.data.max_length:
                log.warning(
                    "schedule %s: max_caption_len %s differs from the prepared captions' max_length %d (set "
                    "prepare.max_length)",
                    r.stage,
                    r.max_caption_len,
                    self.data.max_length,
                )
        self.decoding = decoding_options(cfg.model, _plain(cfg.decoding))
        self.val_decoding = DecodeOptions.from_mapping({**asdict(self.decoding), **_plain(val.decoding)})
        self.precision = resolve_precision(cfg.precision, ctx.device, "train.precision")
        preload = choose_preload(
            cfg.preload, [d for d in (self.train_set, self.val_set) if d is not None], ctx.device, cfg.preload_fraction
        )
        log.info(
            "model %s (%.2fM parameters), %d train images, device %s, precision %s, features %s, %d process(es)",
            cfg.model,
            sum(p.numel() for p in self.model.parameters()) / 1e6,
            len(self.train_set),
            ctx.device,
            self.precision,
            preload,
            ctx.world,
        )
        self.train_source = BatchSource(self.train_set, preload, ctx.device, cfg.num_workers)
        self.val_source = BatchSource(self.val_set, preload, ctx.device, cfg.num_workers) if self.val_set else None
        self.policy: nn.Module = _Policy(self.model)
        if ctx.distributed:
            self.policy = nn.parallel.DistributedDataParallel(
                self.policy,
                device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                find_unused_parameters=bool(cfg.find_unused_parameters),
            )
        self._scorer: CiderD | None = None
        self.progress = Progress(stage=self.stages[0])
        self.optimizer: Any = None
        self.schedule: Any = None
        self.scaler: Any = None
        self.stop_early = False
        self._epoch_t0, self._images, self._losses, self._seconds = 0.0, 0, [], 0.0
        self.log_file = JsonlLog(self.dir / "log.jsonl", ctx)
        last = self.dir / "last.pt"
        self.signal_stop = SignalStop(
            ctx,
            lambda: self._save("last.pt", self._resumable()),
            lambda: f"{self.progress.stage} epoch {self.progress.epoch}, batch {self.progress.position}",
            last,
        )
        self.best_checkpoint = BestCheckpoint(
            self.metric,
            lambda: self.progress,
            self._save_best,
            fields=lambda: {"stage": self.progress.stage, "epoch": self.progress.epoch},
            unvalidated=self._unvalidated,
        )
        self.register_hooks(
            [
                _TensorBoard(self.dir / "tensorboard", self.log_file, bool(ctx.main and cfg.tensorboard)),
                LogHook(
                    self._log,
                    int(cfg.log_every),
                    lambda: self.progress.iteration,
                    self._train_record,
                    self._epoch_record,
                ),
                ValidationHook(lambda: self.validate(self.progress), self._validation_due, self._report),
                self.best_checkpoint,
                _EpochEnd(),
                PeriodicCheckpoint(
                    lambda: self._save("last.pt", self._resumable()),
                    int(cfg.checkpoint_every),
                    lambda: self.progress.iteration,
                ),
                self.signal_stop,
                DistributedSync(ctx),
            ]
        )

    # -- bookkeeping --------------------------------------------------------------------------------------
    @property
    def metric(self) -> str:
        """The validation metric that picks ``best.pt`` (``train.validation.metric``)."""
        return str(self.cfg.validation.metric)

    @property
    def stop(self) -> StopOnSignal:
        """The stop-on-signal state of this run's :class:`SignalStop` hook."""
        return self.signal_stop.stop

    def _log(self, record: dict[str, Any]) -> None:
        self.log_file.write(record)

    def _checkpoint(
        self, prog: Progress, optimizer: Any = None, schedule: Any = None, scaler: Any = None
    ) -> CaptionerCheckpoint:
        """The checkpoint of now: weights only, or (given the optimizer, schedule and scaler) everything to resume."""
        state = None
        if optimizer is not None:  # every rank takes part (the RNG states are gathered)
            state = TrainingState(schedule=schedule.state_dict(), **training_state(optimizer, scaler, self.ctx))
        return CaptionerCheckpoint(
            model_name=str(self.cfg.model),
            model_config=self.model_cfg,
            vocab=tuple(self.vocab.words),
            weights={k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            decoding=asdict(self.decoding),
            progress=prog,
            state=state,
            train_config=self.cfg.to_dict(),
            store_identity=dict(self.train_set.store.identity),  # which extractor made the features
        )

    def _save(self, name: str, ckpt: CaptionerCheckpoint) -> None:
        if self.ctx.main:
            ckpt.save(self.dir / name)

    def _resumable(self) -> CaptionerCheckpoint:
        return self._checkpoint(self.progress, self.optimizer, self.schedule, self.scaler)

    def _save_best(self) -> None:
        """``best.pt`` of a new best validation score (the patience count starts again, in the file too)."""
        self.progress.bad_epochs = 0
        self._save("best.pt", self._checkpoint(self.progress))

    def _unvalidated(self) -> None:
        """Without a validation split every epoch's weights are ``best.pt``."""
        if self.val_source is None:
            self._save("best.pt", self._checkpoint(self.progress))

    # -- setup --------------------------------------------------------------------------------------------
    def _new_stage(self, stage: str) -> tuple[Any, Any, Any]:
        recipe = self.recipes[stage]
        optimizer = build_optimizer(recipe, self.model.parameters())
        schedule = build_schedule(recipe.schedule, f"{self.cfg.model} schedule.{stage}")
        apply_lr(optimizer, schedule.lr())
        return optimizer, schedule, make_scaler(self.precision, self.ctx.device)

    def _load_weights(self, path: Path) -> CaptionerCheckpoint:
        ckpt = CaptionerCheckpoint.load(path)
        ckpt.check_compatible(path, self.cfg.model, self.model_cfg, self.vocab)
        self.model.load_state_dict(ckpt.weights)
        return ckpt

    def _resume(self) -> tuple[Progress, tuple[Any, Any, Any] | None]:
        last = self.dir / "last.pt"
        if not last.exists():
            if self.cfg.init_from:
                self._load_weights(Path(self.cfg.init_from))
                log.info("initialised the weights from %s", self.cfg.init_from)
            return Progress(stage=self.stages[0]), None
        ckpt = self._load_weights(last)
        if ckpt.state is None or ckpt.progress is None:
            raise PipelineError(f"{last} is not a training checkpoint (kind {ckpt.kind!r})")
        prog = ckpt.progress
        if prog.stage not in self.stages:
            raise UsageError(
                f"{last} is at stage {prog.stage!r}, which train.stages={list(self.cfg.stages)} does not include"
            )
        fallback_seed = int(self.cfg.seed) + prog.global_step
        if prog.stage_done:
            restore_rng_states(ckpt.state.rng, self.ctx, fallback_seed)
            log.info("resuming from %s: stage %s finished, moving on", last, prog.stage)
            self._log({"event": "resume", "stage": prog.stage, "stage_done": True, "global_step": prog.global_step})
            return prog, None
        state = self._new_stage(prog.stage)
        optimizer, schedule, scaler = state
        restore_training_state(vars(ckpt.state), optimizer, scaler, self.ctx, fallback_seed)
        schedule.load_state_dict(ckpt.state.schedule)
        apply_lr(optimizer, schedule.lr())
        log.info(
            "resuming from %s: stage %s, epoch %d, batch %d, iteration %d",
            last,
            prog.stage,
            prog.epoch,
            prog.position,
            prog.iteration,
        )
        self._log(
            {
                "event": "resume",
                "stage": prog.stage,
                "epoch": prog.epoch,
                "position": prog.position,
                "global_step": prog.global_step,
            }
        )
        return prog, state

    # -- validation ---------------------------------------------------------------------------------------
    def validate(self, prog: Progress) -> dict[str, Any] | None:
        """Decode the validation split and score it (every rank gets the scores); None without a split."""
        if self.val_source is None:
            return None
        v = self.cfg.validation
        preds = decode_split(
            self.model,
            self.val_source,
            self.vocab,
            self.val_decoding,
            self.ctx,
            int(v.batch_size),
            self.precision,
            v.max_images,
            f"validating {prog.stage} epoch {prog.epoch}",
        )
        full = bool(v.full_metrics) or self.metric != "CIDEr"
        scores = score_split(preds, self.references, full) if self.ctx.main or not full else {}
        scores = broadcast_object(scores, self.ctx)
        if self.metric not in scores:
            raise UsageError(
                f"train.validation.metric {self.metric!r} is not computed (available: "
                f"{', '.join(k for k in scores if k[0].isupper())})"
            )
        return {k: v for k, v in scores.items() if isinstance(v, float)}

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train every stage (resuming ``last.pt``); returns the summary (best, global steps, recent history)."""
        self.train()
        prog = self.progress
        return {
            "model": self.cfg.model,
            "stages": self.stages,
            "best": prog.best,
            "global_steps": prog.global_step,
            "history": prog.history[-10:],
        }

    def batches(self) -> Iterator[dict[str, Any]]:
        """Every stage from the resumed one on: its optimizer, schedule and scaler, then its epochs' batches."""
        seed_everything(int(self.cfg.seed) + 1000003 * self.ctx.rank)
        prog, state = self._resume()
        self.progress = prog
        for stage in self.stages[self.stages.index(prog.stage) :]:
            if prog.stage != stage:
                prog = Progress(stage=stage, global_step=prog.global_step, best=prog.best, history=prog.history)
                self.progress = prog
                state = None
            if prog.stage_done:
                continue
            if state is None:
                if stage == "scst" and self.cfg.scst_init == "best" and (self.dir / "xe.pt").exists():
                    self._load_weights(self.dir / "xe.pt")
                    log.info("SCST starts from the best XE weights (xe.pt)")
                state = self._new_stage(stage)
            self.optimizer, self.schedule, self.scaler = state
            yield from self._stage_batches()
            state = None

    def _scst_scorer(self) -> CiderD:
        if self._scorer is None:
            refs = {k: self.references[k] for k in self.train_set.keys}
            self._scorer = CiderD(refs, df_mode="corpus")
        return self._scorer

    def _step(
        self, stage: str, recipe: StageRecipe, batch: dict[str, Any], prog: Progress, optimizer: Any, scaler: Any
    ) -> dict[str, float]:
        self.model.train()
        with autocast(
            self.ctx.device, self.precision
        ):  # the greedy baseline too: samples and baseline in one precision
            if stage == "xe":
                kwargs: dict[str, Any] = {"smoothing": recipe.label_smoothing, "ss_prob": recipe.ss_prob(prog.epoch)}
            else:
                scorer = self._scst_scorer()
                separate = (
                    recipe.baseline == "greedy" and recipe.baseline_loop == "separate"
                )  # else scst_loss decodes it
                base = (
                    greedy_rewards(self.model, batch, scorer, self.vocab, recipe.sample_max_len) if separate else None
                )
                kwargs = {
                    "scorer": scorer,
                    "vocab": self.vocab,
                    "method": recipe.sample_method,
                    "num_samples": recipe.num_samples,
                    "max_len": recipe.sample_max_len,
                    "baseline": recipe.baseline,
                    "normalize": recipe.pg_normalize,
                    "baseline_rewards": base,
                }
            loss_sum, info = self.policy(stage, batch, kwargs)
        count = info if stage == "xe" else info.count
        local = float(loss_sum.detach()) / max(count, 1.0)
        # one collective for both: a non-finite loss on any rank (every rank stops) and the global token count
        bad, total = all_sums([0.0 if math.isfinite(local) else 1.0, count], self.ctx)
        if bad:
            raise PipelineError(
                f"the {stage} loss became {local} at epoch {prog.epoch}, iteration {prog.iteration + 1}: "
                f"training stopped; the last good checkpoint is kept in {self.dir / 'last.pt'} (lower the "
                "learning rate or check the features)"
            )
        optimizer_step(
            loss_sum * (self.ctx.world / max(total, 1.0)),
            optimizer,
            scaler,
            recipe.grad_clip_value,
            recipe.grad_clip_norm,
            self.model.parameters(),
        )
        out = {"loss": local}
        if stage == "scst":
            out.update(reward=info.reward, baseline=info.baseline_reward)
        return out

    def _validation_due(self) -> bool:
        prog, every = self.progress, int(self.cfg.validation.every_epochs)
        epochs = self.recipes[prog.stage].epochs
        return (prog.epoch + 1) % every == 0 or prog.epoch + 1 == epochs or self.schedule.name == "plateau"

    def _report(self, scores: dict[str, float]) -> None:
        prog = self.progress
        record = {"stage": prog.stage, "epoch": prog.epoch, "global_step": prog.global_step, **scores}
        prog.history.append(record)
        self._log({"event": "val", **record})
        log.info(
            "validation %s epoch %d: %s", prog.stage, prog.epoch, ", ".join(f"{k} {x:.4f}" for k, x in scores.items())
        )

    def _train_record(self) -> dict[str, Any]:
        prog = self.progress
        rate = self._images / max(time.perf_counter() - self._epoch_t0, 1e-9)
        return {
            "event": "train",
            "stage": prog.stage,
            "epoch": prog.epoch,
            "iteration": prog.iteration,
            "global_step": prog.global_step,
            "lr": self.optimizer.param_groups[0]["lr"],
            "images_per_s": rate * self.ctx.world,
            **self.step_stats,
        }

    def _epoch_record(self) -> dict[str, Any]:
        prog = self.progress
        return {
            "event": "epoch",
            "stage": prog.stage,
            "epoch": prog.epoch,
            "global_step": prog.global_step,
            "loss": sum(self._losses) / max(len(self._losses), 1),
            "seconds": round(self._seconds, 3),
            "images_per_s": self._images * self.ctx.world / max(self._seconds, 1e-9),
        }

    def run_step(self, batch: dict[str, Any]) -> dict[str, float]:
        """One step of the current stage, then the schedule and the counters."""
        prog = self.progress
        # the rate is a pure function of the schedule's saved state, written just before each step: a run that
        # goes on past an epoch end and one resumed there train every batch at the same rate
        apply_lr(self.optimizer, self.schedule.lr())
        stats = self._step(prog.stage, self.recipes[prog.stage], batch, prog, self.optimizer, self.scaler)
        self.schedule.step()
        prog.position += 1
        prog.iteration += 1
        prog.global_step += 1
        self._images += len(batch["keys"])
        self._losses.append(stats["loss"])
        return stats

    def _stage_batches(self) -> Iterator[dict[str, Any]]:
        """The batches of the current stage's remaining epochs; epoch ends (hooks, ``last.pt``) and the stage end."""
        prog = self.progress
        stage = prog.stage
        recipe = self.recipes[stage]
        seed = int(self.cfg.seed) + STAGE_SEED_OFFSET[stage]
        log.info(
            "stage %s: %d epochs of %d images per batch, schedule %s",
            stage,
            recipe.epochs,
            recipe.batch_size,
            recipe.schedule,
        )
        self.stop_early = False
        while prog.epoch < recipe.epochs and not self.stop_early:
            batches = epoch_batches(
                self.train_set, recipe.batch_size, seed, prog.epoch, self.ctx, str(self.cfg.batching)
            )
            self._epoch_t0, self._images, self._losses = time.perf_counter(), 0, []
            yield from self.train_source.iterate(
                batches[prog.position :], seed * 100003 + prog.epoch * 1009 + prog.position
            )
            self._seconds = time.perf_counter() - self._epoch_t0
            self.end_epoch()
            prog.epoch += 1
            prog.position = 0
            self._save("last.pt", self._resumable())
        if self.stop_early:
            log.info("stage %s: no %s gain for %d epochs, stopping it", stage, self.metric, recipe.patience)
        prog.stage_done = True
        if stage == "xe" and self.ctx.main:
            if (self.dir / "best.pt").exists():  # the best XE weights: SCST starts from them (scst_init: best)
                atomic_write_bytes(self.dir / "xe.pt", (self.dir / "best.pt").read_bytes())
            else:
                self._save("xe.pt", self._checkpoint(prog))
        self._save("last.pt", self._resumable())
