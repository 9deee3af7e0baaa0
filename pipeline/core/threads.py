"""Thread policy: how many torch threads, DataLoader workers and pool processes a command uses.

One rule for every command, sized from the cores this process may run on (``os.sched_getaffinity``, so
``taskset``, cpusets of containers and Slurm allocations count, not the machine's total; and a cgroup CPU
quota such as ``docker run --cpus 2``):

* ``processes``: the processes of this job on this machine (torchrun's ``LOCAL_WORLD_SIZE``, else 1); each
  gets an equal share, ``budget = max(1, cores // processes)``;
* ``workers``: DataLoader workers per process (one thread each: torch sets that in its workers), at most
  ``budget - 1`` so that the compute threads keep at least one core;
* ``threads``: torch intra-op (OpenMP) threads per process, ``max(1, budget - workers)``;

so ``processes x (threads + workers) <= cores`` whenever ``cores >= processes`` (one thread per process is
the floor). An explicit thread count (``--threads N`` of the CLI, the ``BUTD_THREADS`` or ``OMP_NUM_THREADS``
environment variable, or a config's own ``threads`` key) is used as given, and the workers shrink to what is
left of the budget. It must be a whole number from 1 to :data:`MAX_THREADS`: ``--threads`` outside that is a
usage error; an environment variable outside it (``BUTD_THREADS=abc``, ``0``, ``10**30``) is ignored with one
warning (:mod:`pipeline.core.environment`), the policy's own count used instead.

Over-subscription is what makes a CPU run collapse on a shared machine: OpenMP threads that busy-wait at
every barrier while another process holds their core. :func:`prepare_process` therefore also asks OpenMP to
sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``, unless the user set it), before torch is imported.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.core.console import get_logger
from pipeline.core.environment import launcher_int, setting_int
from pipeline.core.errors import UsageError

#: the most torch threads one process may be given (more only exhausts memory: 100000 OpenMP threads crash it)
MAX_THREADS = 1024


@dataclass(frozen=True)
class ThreadPlan:
    """The resolved numbers: ``cores`` available, ``processes`` on this machine, per process ``threads``
    (torch intra-op) and ``workers`` (DataLoader), and whether ``threads`` was given explicitly."""

    cores: int
    processes: int
    threads: int
    workers: int
    explicit: bool = False

    @property
    def busy(self) -> int:
        """Threads that may compute at once on this machine: ``processes x (threads + workers)``."""
        return self.processes * (self.threads + self.workers)


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity mask (``os.cpu_count()`` where that is unknown),
    lowered to a cgroup CPU quota where one is set (``docker run --cpus``, Kubernetes CPU limits)."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS, Windows
        cores = max(1, os.cpu_count() or 1)
    quota = cgroup_cpu_limit()
    return cores if quota is None else max(1, min(cores, quota))


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The CPU quota of this process's cgroup in whole cores (rounded up), or None when unlimited or unknown.
    Reads cgroup v2 ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD") or v1 ``cpu/cpu.cfs_quota_us`` and
    ``cpu.cfs_period_us`` under ``root``."""
    try:
        v2 = root / "cpu.max"
        if v2.is_file():
            quota, period = (v2.read_text().split() + ["100000"])[:2]
        else:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        if quota in ("max", "-1"):
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):
        return None


def local_processes() -> int:
    """Processes of this job on this machine: torchrun's ``LOCAL_WORLD_SIZE`` (1 outside torchrun)."""
    return launcher_int("LOCAL_WORLD_SIZE", 1, low=1)


def explicit_threads() -> int | None:
    """The user's thread count: ``BUTD_THREADS`` (what ``--threads`` sets), else ``OMP_NUM_THREADS`` (its first
    entry: OpenMP's list form "4,2" is 4), else None. An odd value of either is warned about once and ignored."""
    mine = setting_int("BUTD_THREADS", None, 1, MAX_THREADS, "using the thread policy's own count")
    return mine if mine is not None else explicit_openmp()


def drop_odd_openmp_count() -> None:
    """Remove an odd ``OMP_NUM_THREADS`` from ``os.environ`` (warning once) before torch loads: OpenMP reads it then
    and would complain again, or try to start that many threads."""
    if "OMP_NUM_THREADS" in os.environ and explicit_openmp() is None:
        del os.environ["OMP_NUM_THREADS"]


def explicit_openmp() -> int | None:
    """``OMP_NUM_THREADS`` (its first entry: OpenMP's list form "4,2" is 4) when from 1 to :data:`MAX_THREADS`."""
    return setting_int("OMP_NUM_THREADS", None, 1, MAX_THREADS, "using the thread policy's own count", list_form=True)


def check_threads(threads: int, name: str = "--threads") -> int:
    """An explicit thread count given as an option: a whole number from 1 to :data:`MAX_THREADS`, else a usage error."""
    if threads < 1:
        raise UsageError(f"{name} must be at least 1, got {threads}")
    if threads > MAX_THREADS:
        raise UsageError(f"{name} must be at most {MAX_THREADS}, got {threads}")
    return threads


def plan(
    workers: int = 0, threads: int | None = None, processes: int | None = None, cores: int | None = None
) -> ThreadPlan:
    """Resolve the policy above. ``workers``: the DataLoader workers the command asks for (a ceiling);
    ``threads``: an explicit per-process thread count (default: :func:`explicit_threads`); ``processes`` and
    ``cores`` default to :func:`local_processes` and :func:`available_cores`."""
    if workers < 0:
        raise UsageError(f"workers must be >= 0, got {workers}")
    if threads is not None:
        check_threads(threads, "threads")
    cores = available_cores() if cores is None else max(1, int(cores))
    processes = local_processes() if processes is None else max(1, int(processes))
    budget = max(1, cores // processes)
    if threads is None:
        threads = explicit_threads()
    if threads is not None:
        return ThreadPlan(cores, processes, int(threads), min(workers, max(0, budget - threads)), explicit=True)
    used_workers = min(workers, budget - 1)
    return ThreadPlan(cores, processes, max(1, budget - used_workers), used_workers)


def _torch():
    """The torch module, imported when a plan is applied: this module is imported before torch, so that
    :func:`prepare_process` sets OpenMP's environment first."""
    import torch  # noqa: PLC0415 -- OpenMP's environment is set by this module before torch loads

    return torch


def prepare_process(threads: int | None = None) -> None:
    """Call before torch is imported (the CLI does, first thing): OpenMP threads sleep when idle
    (``OMP_WAIT_POLICY=PASSIVE`` unless set) and ``threads`` (``--threads``) becomes ``BUTD_THREADS``, which
    child processes (DataLoader workers, torchrun ranks) inherit, and torch's thread count."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads is None:
        explicit_threads()  # an odd BUTD_THREADS or OMP_NUM_THREADS is warned about here, once, before the work
        return
    check_threads(threads)
    os.environ["BUTD_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(int(threads))  # torch reads the latter at import
    if torch_loaded():
        sys.modules["torch"].set_num_threads(int(threads))


def apply(workers: int = 0, threads: int | None = None) -> ThreadPlan:
    """Resolve :func:`plan` and set torch's intra-op thread count to it; returns the plan.

    Without an explicit count the threads only ever go down: a lower count set earlier (a caller's
    ``torch.set_num_threads``, e.g. a bench script's ``--threads``) is kept, and the workers are still capped by
    the budget."""
    torch = _torch()
    resolved = plan(workers=workers, threads=threads)
    if not resolved.explicit and torch.get_num_threads() < resolved.threads:
        resolved = replace(resolved, threads=torch.get_num_threads())
    if torch.get_num_threads() != resolved.threads:
        torch.set_num_threads(resolved.threads)
    get_logger("threads").debug("thread policy: %s", describe(resolved))
    return resolved


def loader_workers(requested: int, threads: int | None = None) -> int:
    """DataLoader workers to start for ``requested`` (the config's value), with torch's threads set to match."""
    return apply(workers=max(0, int(requested)), threads=threads).workers


@contextmanager
def loader_threads(requested: int, threads: int | None = None) -> Iterator[int]:
    """:func:`loader_workers` for the span of a ``with`` block: yields the DataLoader workers to start and puts
    torch's thread count back at exit (the policy trades threads for workers only while the workers run)."""
    torch = _torch()
    before = torch.get_num_threads()
    try:
        yield loader_workers(requested, threads)
    finally:
        torch.set_num_threads(before)


def pool_size(requested: int) -> int:
    """Worker processes for a process pool doing single-threaded work: at most this process's core budget."""
    resolved = plan()
    return max(1, min(int(requested), max(1, resolved.cores // resolved.processes)))


def describe(resolved: ThreadPlan) -> str:
    """One line for logs: ``2 cores: 1 process x (1 torch thread + 1 DataLoader worker)``."""
    return (
        f"{resolved.cores} core(s): {resolved.processes} process(es) x ({resolved.threads} torch thread(s)"
        f"{' (explicit)' if resolved.explicit else ''} + {resolved.workers} DataLoader worker(s))"
    )


def torch_loaded() -> bool:
    """Whether torch is already imported (then ``OMP_WAIT_POLICY`` can no longer take effect)."""
    return "torch" in sys.modules
