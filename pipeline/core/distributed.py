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

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline.core.environment import launcher_int
from pipeline.core.errors import UsageError


@dataclass(frozen=True)
class DistContext:
    """Rank, world size, local rank and device of this process (``torchrun`` sets the first three)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        """True under ``torchrun`` with more than one process."""
        return self.world > 1

    @property
    def main(self) -> bool:
        """True on rank 0 (the process that writes manifests, logs and checkpoints)."""
        return self.rank == 0


def visible_gpus() -> int:
    """CUDA devices this process sees (``CUDA_VISIBLE_DEVICES`` applied); 0 without CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_processes(local_rank: int | None = None) -> int:
    """Processes of this job on this machine: torchrun's ``LOCAL_WORLD_SIZE`` (at least ``local_rank + 1``)."""
    if local_rank is None:
        local_rank = launcher_int("LOCAL_RANK", 0)
    return max(launcher_int("LOCAL_WORLD_SIZE", 0, low=1), local_rank + 1)


def _gpus(count: int) -> str:
    return f"{count} visible GPU{'' if count == 1 else 's'}"


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """The one device resolver: ``auto`` -> this process's CUDA device when available, else CPU;
    ``cuda`` -> ``cuda:LOCAL_RANK`` (``local_rank`` defaults to torchrun's ``LOCAL_RANK``, 0 outside it);
    ``cuda:N``, ``cpu`` (or any torch device name) as given.

    Raises :class:`UsageError` for an unknown name, a CUDA device on a machine without CUDA, or a GPU index
    that is not visible (``cuda:3`` on a one-GPU machine; a local rank past the last GPU, i.e. more torchrun
    processes than GPUs: see :func:`check_gpu_per_process` and :func:`shared_gpu`).
    """
    if local_rank is None:
        local_rank = launcher_int("LOCAL_RANK", 0)
    name = str(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device {name} requested but CUDA is not available; use cpu or auto")
        count = visible_gpus()
        if dev.index is not None and dev.index >= count:
            raise UsageError(
                f"device {name} requested but there {'is' if count == 1 else 'are'} {_gpus(count)} "
                f"(cuda:0 to cuda:{count - 1})"
            )
        if dev.index is None and local_rank >= count:
            raise UsageError(
                f"{local_processes(local_rank)} processes but {_gpus(count)}: process {local_rank} on this "
                f"machine has no GPU of its own; run torchrun --nproc_per_node {count} (or fewer)"
            )
        return torch.device("cuda", local_rank if dev.index is None else dev.index)
    return dev


def check_gpu_per_process(name: str, key: str = "device") -> None:
    """Training under torchrun needs one GPU per process: NCCL cannot share a GPU between ranks, so more
    local processes than visible GPUs (or every rank pinned to one ``cuda:N``) is refused here, in one line
    (:class:`UsageError`, exit 2), before any work. ``key`` is the config key named in the message. A CPU
    device (``gloo``) takes any number of processes; outside torchrun this checks nothing."""
    world = launcher_int("WORLD_SIZE", 1, low=1)
    name = str(name)
    if world <= 1 or not (name.startswith("cuda") or (name == "auto" and torch.cuda.is_available())):
        return
    count = visible_gpus()
    procs = local_processes()
    if ":" in name and procs > 1:
        raise UsageError(
            f"{procs} processes but {key}={name} puts them all on one GPU (NCCL cannot share a GPU between "
            f"ranks); use {key}=cuda (each process takes cuda:LOCAL_RANK)"
        )
    if count and procs > count:
        raise UsageError(
            f"{procs} processes but {_gpus(count)}: training needs one GPU per process (NCCL cannot share "
            f"a GPU between ranks); run torchrun --nproc_per_node {count} (or fewer), or set {key}=cpu"
        )


def shared_gpu(local_rank: int) -> torch.device:
    """Extraction under torchrun may run several processes per GPU (each process holds its own detector and
    they need no collective): local rank ``r`` takes ``cuda:(r mod visible GPUs)``."""
    count = visible_gpus()
    if count == 0:
        raise UsageError("CUDA requested but no GPU is visible; use cpu or auto")
    return torch.device("cuda", local_rank % count)


def env_context(device: torch.device | None = None) -> DistContext:
    """This process's rank, world size and local rank from the ``torchrun`` environment (no process group joined)."""
    world = launcher_int("WORLD_SIZE", 1, low=1)
    rank = launcher_int("RANK", 0)
    local_rank = launcher_int("LOCAL_RANK", 0)
    return DistContext(rank, world, local_rank, device if device is not None else torch.device("cpu"))


def setup(device_name: str = "auto", key: str = "device") -> DistContext:
    """Join the process group when launched by torchrun (``nccl`` on CUDA, ``gloo`` on CPU) and pin the local
    GPU; returns this process's :class:`DistContext`. More processes than GPUs is refused first
    (:func:`check_gpu_per_process`; ``key`` names the config key in that message)."""
    check_gpu_per_process(device_name, key)
    env = env_context()
    device = resolve_device(device_name, env.local_rank)
    if env.world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistContext(env.rank, env.world, env.local_rank, device)


def teardown(ctx: DistContext) -> None:
    """Leave the process group (no-op in one process)."""
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


def all_sums(values: list[float], ctx: DistContext) -> list[float]:
    """Element-wise sums over ranks of a few scalars, in ONE collective (the values themselves in one process)."""
    if not ctx.distributed:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.tolist()


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
    """Wait for every rank (no-op in one process)."""
    if ctx.distributed:
        dist.barrier()
