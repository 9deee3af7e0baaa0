"""Bounded waits on DataLoader workers: a dead, stuck or starved worker is noticed, never waited on forever.

Three ways a worker can leave the loop waiting, and what each loop does about it:

* **Shared memory is short** (``/dev/shm`` full, e.g. Docker's 64 MB default). Tensors leave a worker through
  shared memory; when it cannot be had, torch's queue thread prints a traceback and *drops the batch* while
  the worker lives on, so the main process would wait forever. Workers therefore move their tensors into
  shared memory themselves, inside the dataset (:func:`share_in_worker`), where the error can be caught and
  returned as a value; the photo loop then decodes those photos again in the main process and says once,
  in one line, what to do (:data:`SHM_HINT`: ``--ipc=host``, ``--shm-size``, ``--num-workers 0``).
* **A worker dies** (killed, out of memory, a bus error from a full ``/dev/shm``): torch raises at the next
  wait; the loops turn it into one line with the same advice (:func:`worker_failure_line`).
* **A worker hangs**: every loader is built with ``timeout=`` :func:`loader_timeout` (``WORKER_WAIT`` seconds
  per batch, ``$BUTD_WORKER_WAIT`` to change it), after which the wait ends with the same one line.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

from torch.utils.data import get_worker_info

from pipeline.core.environment import setting_float
from pipeline.core.errors import PipelineError

T = TypeVar("T")

#: seconds the main process waits for one batch from its workers before it gives up on them
WORKER_WAIT = 600.0

SHM_HINT = (
    "shared memory (/dev/shm) is too small or full for the DataLoader workers (Docker gives 64 MB): run the "
    "container with --ipc=host or a larger --shm-size (e.g. --shm-size=8g), or pass --num-workers 0 to load in "
    "this process"
)

_SHM_SIGNS = (
    "no space left",
    "unable to write to file",
    "/dev/shm",
    "torch_shm",
    "shared memory",
    "bus error",
    "sigbus",
    "unable to open shared memory",
    "unable to mmap",
    "cannot allocate memory",
)


def worker_wait() -> float:
    """:data:`WORKER_WAIT`, or ``$BUTD_WORKER_WAIT`` seconds when set to a positive number (an odd value is warned
    about once and the default used, :mod:`pipeline.core.environment`)."""
    return setting_float("BUTD_WORKER_WAIT", WORKER_WAIT)


def loader_timeout(num_workers: int) -> float:
    """The ``timeout=`` of a DataLoader with ``num_workers`` processes (0 in-process, where torch allows no timeout)."""
    return worker_wait() if int(num_workers) > 0 else 0


def looks_like_shm(text: str) -> bool:
    """Whether an error text is a shared-memory shortage (or its bus error)."""
    low = text.lower()
    return any(s in low for s in _SHM_SIGNS)


def worker_failure_line(exc: BaseException, what: str = "the DataLoader workers") -> str:
    """One line for a failed or stuck worker: what failed, torch's first line, and the advice when memory is short."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    if "timed out" in first.lower():
        return (
            f"{what} sent nothing for {worker_wait():.0f} s ({first}); a worker is stuck or lost its batch: "
            f"{SHM_HINT} (or raise BUTD_WORKER_WAIT)"
        )
    if looks_like_shm(first) or "exited unexpectedly" in first.lower() or "killed by signal" in first.lower():
        return f"{what} failed ({first}): {SHM_HINT}"
    return f"{what} failed ({first}); pass --num-workers 0 to load in this process"


def is_worker_failure(exc: BaseException) -> bool:
    """A RuntimeError raised by torch's DataLoader about its workers (dead, timed out), not by the dataset code."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("DataLoader" in text or "worker" in text.lower())


class UntilWorkerFailure(Generic[T]):
    """Iterates a DataLoader to its end or to the first failure of its workers (:func:`is_worker_failure`): that
    ends the iteration, drops the loader's iterator (which shuts the workers down) and is kept in :attr:`failure`.
    Any other error propagates."""

    def __init__(self, batches: Iterable[T]) -> None:
        self.batches = batches
        self.failure: RuntimeError | None = None

    def __iter__(self) -> Iterator[T]:
        it = iter(self.batches)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except RuntimeError as exc:
                if not is_worker_failure(exc):
                    raise
                del it  # shuts the workers down
                self.failure = exc
                return
            yield batch


def guarded(batches: Iterable[T], what: str = "the DataLoader workers") -> Iterator[T]:
    """Iterate a DataLoader; a dead or stuck worker becomes one :class:`PipelineError` line (see the module)."""
    until = UntilWorkerFailure(batches)
    yield from until
    if until.failure is not None:
        raise PipelineError(worker_failure_line(until.failure, what))


def share_in_worker(tensors: Iterable[Any]) -> str | None:
    """In a DataLoader worker: move ``tensors`` into shared memory now (so handing them over allocates nothing
    more); returns the error's first line when shared memory cannot be had, None when it worked or outside a worker."""
    if get_worker_info() is None:
        return None
    try:
        for t in tensors:
            if t is not None:
                t.share_memory_()
    except (RuntimeError, OSError) as exc:
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return None
