"""Training the grounded sentence encoder: the ``encoder`` stage of a run directory (``cli train-encoder``).

Built on the training core (:mod:`pipeline.core.training`): the device and DDP context
(:mod:`pipeline.core.distributed`), ``precision``, seeding, the stop-on-signal context, the non-finite check,
the optimizer step and the resume bookkeeping, atomic checkpoints (:mod:`pipeline.core.checkpoint`) and the
stage manifest (:func:`pipeline.core.stages.run_stage`). Only the batches, the loss and the validation are
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

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pipeline.embedding.sentence_encoder import SentenceEncoder, build_sentence_encoder, encoder_config
from pipeline.caption_data.prepared import PreparedCaptions
from pipeline.core.checkpoint import save_checkpoint
from pipeline.core.config import Config
from pipeline.core.console import get_logger
from pipeline.embedding.checkpoint import read_encoder_checkpoint
from pipeline.embedding.data import SplitCaptions, image_table
from pipeline.embedding.losses import caption_loss, cosine_matrix, ranking_loss
from pipeline.embedding.retrieval import split_similarity
from pipeline.core.errors import UsageError
from pipeline.core.fileio import open_own_file
from pipeline.metrics.retrieval import retrieval_metrics
from pipeline.core.stages import StageResult, run_stage
from pipeline.store import FeatureStore
from pipeline.core import distributed
from pipeline.core.training import (
    StopOnSignal,
    autocast,
    check_finite,
    make_scaler,
    optimizer_step,
    resolve_precision,
    restore_training_state,
    seed_everything,
    training_state,
)

log = get_logger("encoder")
STAGE = "encoder"


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


class EncoderTrainer:
    """Trains the encoder of ``cfg`` (an ``encoder:`` section) into ``stage_dir``."""

    def __init__(self, stage_dir: Path, cfg: Config, ctx: distributed.DistContext) -> None:
        self.dir, self.cfg, self.ctx = Path(stage_dir), cfg, ctx
        self.dir.mkdir(parents=True, exist_ok=True)
        seed_everything(int(cfg.seed) + 1000003 * ctx.rank)  # the initial weights depend on the seed only
        self.data = PreparedCaptions.load(cfg.data)
        store = FeatureStore(cfg.store)
        self.train = SplitCaptions.load(self.data, "train", store)
        workers = int(cfg.num_workers)  # the image vectors are read from the store in this many DataLoader processes
        self.train_images = torch.from_numpy(image_table(store, self.train.keys, cfg.max_boxes, workers)).to(ctx.device)
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
        self.stop = StopOnSignal()
        log.info(
            "sentence encoder (%s, self-attention %s, %.2fM parameters), %d train images, device %s, precision %s",
            self.model.objective,
            self.model.self_attention,
            sum(p.numel() for p in self.model.parameters()) / 1e6,
            len(self.train.keys),
            ctx.device,
            self.precision,
        )

    @property
    def stop_signal(self) -> int | None:
        """The signal that asked this run to stop (None: none yet); settable, e.g. to stop after the next step."""
        return self.stop.signum

    @stop_signal.setter
    def stop_signal(self, signum: int | None) -> None:
        self.stop.signum = signum

    def _payload(self, kind: str, prog: dict[str, Any]) -> dict[str, Any]:
        payload = {
            "kind": kind,
            "model": {
                "name": "sentence_encoder",
                "config": self.model_cfg,
                "vocab_size": len(self.data.vocab),
                "image_dim": self.model.image_dim,
            },
            "vocab": list(self.data.vocab.words),
            "weights": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            **prog,
            "train_config": self.cfg.to_dict(),
        }
        if kind == "train":  # every rank takes part (the RNG states are gathered)
            payload.update(training_state(self.optimizer, self.scaler, self.ctx))
        return payload

    def _save(self, name: str, kind: str, prog: dict[str, Any]) -> None:
        payload = self._payload(kind, prog)
        if self.ctx.main:
            save_checkpoint(self.dir / name, payload)

    def _log(self, record: dict[str, Any]) -> None:
        if self.ctx.main:
            log_fd = open_own_file(self.dir / "log.jsonl", "training log", append=True)
            with os.fdopen(log_fd, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")

    def _resume(self) -> dict[str, Any]:
        prog: dict[str, Any] = {"epoch": 0, "position": 0, "global_step": 0, "best": {}, "history": []}
        last = self.dir / "last.pt"
        if not last.exists():
            return prog
        ckpt = read_encoder_checkpoint(last, self.data.vocab)
        if dict(ckpt["model"]["config"]) != self.model_cfg:
            raise UsageError(
                f"checkpoint {last} was trained with another encoder configuration; use --force to start over"
            )
        self.model.load_state_dict(ckpt["weights"])
        prog.update({k: ckpt[k] for k in prog})
        restore_training_state(ckpt, self.optimizer, self.scaler, self.ctx, int(self.cfg.seed) + prog["global_step"])
        log.info("resuming from %s: epoch %d, batch %d", last, prog["epoch"], prog["position"])
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

    def run(self) -> dict[str, Any]:
        """Train (resuming ``last.pt``) until ``epochs``; returns the summary (best, recent history, global steps)."""
        with self.stop:
            return self._run()

    def _run(self) -> dict[str, Any]:
        seed_everything(int(self.cfg.seed) + 1000003 * self.ctx.rank)
        prog = self._resume()
        epochs, every = int(self.cfg.epochs), int(self.cfg.checkpoint_every)
        while prog["epoch"] < epochs:
            batches = list(self.train.batches(int(self.cfg.batch_size), int(self.cfg.seed), prog["epoch"]))
            t0, losses, parts = time.perf_counter(), [], {}
            for batch in batches[prog["position"] :]:
                batch = rank_slice(batch, self.ctx)
                if batch is not None:
                    stats = self._step(batch)
                    losses.append(stats["loss"])
                    for k in ("vg", "cap"):
                        if k in stats:
                            parts.setdefault(f"loss_{k}", []).append(stats[k])
                prog["position"] += 1
                prog["global_step"] += 1
                if every and prog["global_step"] % every == 0:
                    self._save("last.pt", "train", prog)
                self.stop.check(
                    self.ctx,
                    lambda: self._save("last.pt", "train", prog),
                    f"epoch {prog['epoch']}, batch {prog['position']}",
                    self.dir / "last.pt",
                )
            record: dict[str, Any] = {
                "event": "epoch",
                "epoch": prog["epoch"],
                "loss": float(np.mean(losses)) if losses else None,
                "seconds": round(time.perf_counter() - t0, 3),
                **{k: float(np.mean(v)) for k, v in parts.items()},
            }
            scores = self._validate()
            if scores is not None:
                record.update(scores)
                prog["history"].append({"epoch": prog["epoch"], **scores})
                if not prog["best"] or scores["c2i_R@1"] > prog["best"]["value"]:
                    prog["best"] = {"metric": "c2i_R@1", "value": scores["c2i_R@1"], "epoch": prog["epoch"]}
                    self._save("best.pt", "weights", prog)
            elif self.ctx.main:
                prog["best"] = {"metric": "last epoch", "value": float("nan"), "epoch": prog["epoch"]}
                self._save("best.pt", "weights", prog)
            self._log(record)
            log.info(
                "epoch %d: loss %.4f%s",
                prog["epoch"],
                record["loss"] or float("nan"),
                f", val c2i R@1 {scores['c2i_R@1']:.2f} (chance {scores['c2i_chance_R@1']:.2f})" if scores else "",
            )
            prog["epoch"] += 1
            prog["position"] = 0
            self._save("last.pt", "train", prog)
        return {"best": prog["best"], "history": prog["history"][-10:], "global_steps": prog["global_step"]}


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
                    f"sentence_encoder.{key} is not set and {default} does not exist; pass --set sentence_encoder.{key}=PATH"
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
