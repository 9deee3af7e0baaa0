"""Data-parallel plumbing for ``torchrun``: process group, device, batch sharding and collectives.

Launched by ``torchrun`` (``python -m torch.distributed.run --nproc_per_node N cli.py train ...``), the
environment has ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; :func:`setup` then joins the process group
(``nccl`` on CUDA, ``gloo`` on CPU) and pins the local GPU. Without those variables everything is a
single process and every collective here is a no-op.

Sharding: every rank derives the *same* global batch order (seed + epoch) and takes the ``rank::world``
slice of each global batch, so a global batch of ``B`` images is split across ranks. The loss of each
rank is ``sum / global_count * world`` (:func:`global_mean_factor`), so DDP's gradient averaging yields
exactly the gradient of the token-mean loss over the whole global batch, as in one process.
Evaluation shards the images ``rank::world`` (each image decoded once) and gathers the captions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline.core.errors import UsageError


@dataclass(frozen=True)
class DistContext:
    """Rank, world size and device of this process."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> the local CUDA device when available, else CPU; ``cuda`` -> ``cuda:LOCAL_RANK``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"train.device={name} but no CUDA device is available; use cpu or auto")
        return torch.device(f"cuda:{local_rank}") if name == "cuda" else torch.device(name)
    if name != "cpu":
        raise UsageError(f"train.device must be auto, cpu, cuda or cuda:N, got {name!r}")
    return torch.device("cpu")


def setup(device_name: str = "auto") -> DistContext:
    """Join the process group when launched by torchrun; returns this process's :class:`DistContext`."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, local_rank)
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistContext(rank, world, local_rank, device)


def teardown(ctx: DistContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


def shard(batch: list[int], ctx: DistContext) -> list[int]:
    """This rank's part of a global batch."""
    return batch[ctx.rank :: ctx.world]


def all_sum(value: float | int, ctx: DistContext) -> float:
    """Sum of a scalar over ranks (the value itself in one process)."""
    if not ctx.distributed:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return float(t.item())


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """True when ``flag`` is true on any rank (all ranks get the same answer)."""
    return all_sum(1.0 if flag else 0.0, ctx) > 0


def global_mean_factor(local_count: float, ctx: DistContext) -> float:
    """``world / global_count``: multiply a rank's loss *sum* by it to get a DDP-averaged global mean."""
    return ctx.world / max(all_sum(local_count, ctx), 1.0)


def gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's ``obj`` in rank order (``[obj]`` in one process)."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()
