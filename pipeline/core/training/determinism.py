"""``deterministic: true`` for ``train`` and ``train-detector``: repeatable runs on CUDA, on request.

On the CPU a run is repeatable bit for bit anyway (one process, the same thread count). On CUDA several
kernels sum in an order that changes from run to run (atomic adds in backward passes, cuBLAS split-K
reductions, cuDNN's autotuned algorithms), so two runs, or a resumed run and an uninterrupted one, agree on
the schedule but not on the numbers. :func:`deterministic_mode` asks torch for its deterministic kernels
(PyTorch "Reproducibility" notes):

* ``torch.use_deterministic_algorithms(True)``: deterministic kernels where torch has them; an operation
  without one raises, and :func:`deterministic_mode` turns that into one line naming the operation
  (:class:`UsageError`, exit 2) rather than falling back to ``warn_only`` (a run that says it is
  repeatable and is not would be worse than a refusal);
* ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (unless already set): cuBLAS's fixed-workspace, deterministic mode;
  it must be set before cuBLAS's first call in the process, which is why the trainers enter this context
  before they build a model;
* ``torch.backends.cudnn.benchmark = False`` and ``cudnn.deterministic = True``: no autotuning, the same
  convolution algorithm every run.

The previous settings come back when the context ends (the demo and tests train in one process).
The detector's RoI max pooling (torchvision ``roi_pool``) has no deterministic CUDA backward; its
deterministic replacement is :func:`extractors.roi_pool.roi_pool`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pipeline.core.console import get_logger
from pipeline.core.errors import UsageError

log = get_logger("train")

CUBLAS_SETTING = ":4096:8"
_NO_KERNEL = " does not have a deterministic implementation"


def nondeterministic_op(exc: BaseException) -> str | None:
    """The operation named by torch's "X does not have a deterministic implementation" error, else None."""
    text = str(exc)
    if _NO_KERNEL not in text:
        return None
    return text.split(_NO_KERNEL, 1)[0].strip().splitlines()[-1].strip() or "an operation"


@contextmanager
def deterministic_mode(enabled: bool, key: str = "deterministic") -> Iterator[None]:
    """With ``enabled``: deterministic algorithms, the cuBLAS workspace setting and no cuDNN autotuning for
    the body; an operation without a deterministic kernel fails in one line naming it. A no-op otherwise."""
    if not enabled:
        yield
        return
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
    )
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_SETTING
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    log.info(
        "%s=true: deterministic kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=%s, no cuDNN "
        "autotuning)",
        key,
        os.environ["CUBLAS_WORKSPACE_CONFIG"],
    )
    try:
        yield
    except RuntimeError as exc:
        op = nondeterministic_op(exc)
        if op is not None:
            raise UsageError(
                f"{key}=true: {op} has no deterministic implementation in torch {torch.__version__}; "
                f"set {key}=false to train without bitwise repeatability"
            ) from None
        if "CUBLAS_WORKSPACE_CONFIG" in str(exc):
            raise UsageError(
                f"{key}=true needs CUBLAS_WORKSPACE_CONFIG=:4096:8 or :16:8 in the environment, not "
                f"{os.environ.get('CUBLAS_WORKSPACE_CONFIG')!r}"
            ) from None
        raise
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[2], before[3]
