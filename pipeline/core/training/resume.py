"""Exact-resume bookkeeping: what a resumable checkpoint holds besides the weights and the data position.

:func:`training_state` returns the optimizer and scaler states and every rank's RNG states (a list in rank
order, gathered with one collective: call it on every rank); :func:`restore_training_state` puts them back.
With the data order a pure function of (seed, epoch or iteration) and the data position saved by the
trainer, a resumed run continues bit-identically on CPU (same thread count). A checkpoint written by
another number of processes restores rank 0's state on rank 0 and gives the other ranks fresh,
reproducible streams (not bitwise then).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipeline.core.checkpoint import capture_rng_state, restore_rng_state
from pipeline.core.console import get_logger
from pipeline.core.distributed import DistContext, gather_objects
from pipeline.core.errors import PipelineError
from pipeline.core.training.seeding import seed_everything

log = get_logger("train")


def gather_rng_states(ctx: DistContext) -> list[dict[str, Any]]:
    """Every rank's RNG states (Python, NumPy, torch CPU/CUDA), in rank order; a collective under torchrun."""
    return gather_objects(capture_rng_state(), ctx)


def restore_rng_states(states: list[dict[str, Any]] | dict[str, Any], ctx: DistContext, fallback_seed: int) -> bool:
    """Restore this rank's RNG states; returns False when the checkpoint had another number of processes.

    ``states`` is what :func:`gather_rng_states` saved (a single dict, from older checkpoints, counts as one
    process). Ranks without a saved state are seeded with ``fallback_seed + 1000003 * rank``.
    """
    states = [states] if isinstance(states, dict) else list(states)
    if len(states) == ctx.world:
        restore_rng_state(states[ctx.rank])
        return True
    log.warning(
        "the checkpoint was written by %d process(es), this run has %d: the random streams are not resumed exactly",
        len(states),
        ctx.world,
    )
    if ctx.rank == 0:
        restore_rng_state(states[0])
    else:
        seed_everything(int(fallback_seed) + 1000003 * ctx.rank)
    return False


def training_state(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, ctx: DistContext
) -> dict[str, Any]:
    """``{"optimizer", "scaler", "rng"}`` for a resumable checkpoint (call on every rank: it gathers the RNG states)."""
    return {
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else {},
        "rng": gather_rng_states(ctx),
    }


def restore_training_state(
    ckpt: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    ctx: DistContext,
    fallback_seed: int,
) -> bool:
    """Load what :func:`training_state` saved into ``optimizer``/``scaler`` and the RNGs (see
    :func:`restore_rng_states`)."""
    optimizer.load_state_dict(ckpt["optimizer"])
    if scaler is not None and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    return restore_rng_states(ckpt["rng"], ctx, fallback_seed)


@dataclass
class ResumeState:
    """What a resumable checkpoint holds besides the weights and the counters: optimizer, gradient scaler and
    every rank's RNG states (top-level keys ``optimizer``, ``scaler``, ``rng`` on disk)."""

    optimizer: dict[str, Any]
    scaler: dict[str, Any]
    rng: Any

    KEYS = ("optimizer", "scaler", "rng")

    @classmethod
    def capture(
        cls, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, ctx: DistContext
    ) -> ResumeState:
        """The state of now (call on every rank: it gathers the RNG states)."""
        return cls(**training_state(optimizer, scaler, ctx))

    def restore(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        ctx: DistContext,
        fallback_seed: int,
    ) -> bool:
        """Put the state back (see :func:`restore_training_state`)."""
        return restore_training_state(self.to_dict(), optimizer, scaler, ctx, fallback_seed)

    def to_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer, "scaler": self.scaler, "rng": self.rng}

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: Any) -> ResumeState:
        """The state in a loaded checkpoint ``data``; a missing or malformed part fails naming ``path``."""
        missing = [k for k in cls.KEYS if k not in data]
        if missing:
            raise PipelineError(f"checkpoint {path} lacks {', '.join(missing)}")
        if not isinstance(data["optimizer"], dict) or not isinstance(data["scaler"], dict):
            raise PipelineError(f"checkpoint {path}: the optimizer and scaler states are not mappings")
        if not isinstance(data["rng"], (dict, list)):
            raise PipelineError(f"checkpoint {path}: the RNG states are neither a mapping nor a list")
        return cls(optimizer=data["optimizer"], scaler=data["scaler"], rng=data["rng"])
