"""Exact-resume bookkeeping: what a resumable checkpoint holds besides the weights and the data position.

:func:`training_state` returns the optimizer and scaler states and every rank's RNG states (a list in rank
order, gathered with one collective: call it on every rank); :func:`restore_training_state` puts them back.
With the data order a pure function of (seed, epoch or iteration) and the data position saved by the
trainer, a resumed run continues bit-identically on CPU (same thread count). A checkpoint written by
another number of processes restores rank 0's state on rank 0 and gives the other ranks fresh,
reproducible streams (not bitwise then).
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.core.checkpoint import capture_rng_state, restore_rng_state
from pipeline.core.console import get_logger
from pipeline.core.distributed import DistContext, gather_objects

log = get_logger("train")


def gather_rng_states(ctx: DistContext) -> list[dict[str, Any]]:
    """Every rank's RNG states (Python, NumPy, torch CPU/CUDA), in rank order; a collective under torchrun."""
    return gather_objects(capture_rng_state(), ctx)


def restore_rng_states(states: list[dict[str, Any]] | dict[str, Any], ctx: DistContext, fallback_seed: int) -> bool:
    """Restore this rank's RNG states; returns False when the checkpoint had another number of processes.

    ``states`` is what :func:`gather_rng_states` saved (a single dict, from older checkpoints, counts as one
    process). Ranks without a saved state are seeded with ``fallback_seed + 1000003 * rank``.
    """
    from pipeline.core.training.seeding import seed_everything

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
    """Load what :func:`training_state` saved into ``optimizer``/``scaler`` and the RNGs (see :func:`restore_rng_states`)."""
    optimizer.load_state_dict(ckpt["optimizer"])
    if scaler is not None and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    return restore_rng_states(ckpt["rng"], ctx, fallback_seed)
