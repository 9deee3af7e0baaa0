"""Bounds on tensor files read from disk, checked before their contents are allocated
(docs/extractor.md#bounds-on-weights-files).

A small file can declare far more than it holds. A torch file is a zip archive whose members ``torch.load``
inflates whole, so a deflated member of zeros a few megabytes long can stand for gigabytes, and central-directory
entries can point at the same bytes again and again; a tensor is a view (shape, strides, offset) over a storage,
so zero strides let a one-element storage stand for a tensor of any size. The checks here compare what a file
declares with the bytes it actually holds:

* :func:`check_archive` (before ``torch.load``): no TorchScript archive (``<root>/code/`` members: ``torch.load``
  hands such a file to ``torch.jit.load``, which compiles the code it carries, even with ``weights_only=True``;
  :mod:`extractors.clip.files` reads OpenAI's CLIP archives without it); at most :data:`MAX_MEMBERS` members; a
  stored member declares exactly the bytes it stores; all members together expand to at most the archive's own size plus
  :data:`INFLATE_ALLOWANCE` bytes (torch writes its members stored, so an honest file expands to its own size).
* :func:`check_tensor` / :func:`check_tensors` (after loading, before anything is built from the tensors): a
  tensor declares no more elements than its storage holds, and all tensors together declare at most
  :data:`VIEW_FACTOR` times the file's size plus :data:`INFLATE_ALLOWANCE` bytes and at most :data:`MAX_ELEMENTS`
  elements (views may share a storage: a module saved twice, as VinVL's attribute head shares the box head's res5).

Every refusal is one :class:`BoundsError` line ``FILE: 'KEY': reason``.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterable
from pathlib import Path

import torch

from pipeline.core.errors import PipelineError

MAX_MEMBERS = 100_000
"""Members of one archive (a state dict of a ResNeXt-152 detector holds about 1,600 tensors, one member each)."""
INFLATE_ALLOWANCE = 64 << 20
"""Bytes an archive may expand to beyond its own size, and tensors may declare beyond :data:`VIEW_FACTOR` x the file."""
VIEW_FACTOR = 2
"""How many times its own size the tensors of a file may declare (shared storages: one module saved twice)."""
MAX_ELEMENTS = 2_000_000_000
"""Elements all the tensors of one file may declare (8 GB as float32; the largest public detectors hold ~0.1e9)."""


class BoundsError(PipelineError):
    """A file that declares more than it holds or more than the bounds admit (exit 1)."""


def check_archive(path: str | Path, code: bool = False) -> None:
    """Refuse a zip archive whose members would expand past the bounds, reading only its central directory; and a
    TorchScript archive unless ``code`` (its reader then reads the tensors without the code).

    Files that are not zip archives (pickles, the legacy torch format) are left to their reader: their unpickler
    reads them as a stream, so what they build is bounded by their own bytes.
    """
    path = Path(path)
    if not zipfile.is_zipfile(path):
        return
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as zf:
            members = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as exc:
        raise BoundsError(f"{path}: not a readable zip archive ({exc})") from None
    if len(members) > MAX_MEMBERS:
        raise BoundsError(
            f"{path}: '{members[MAX_MEMBERS].filename}': the archive holds {len(members):,} members, "
            f"more than {MAX_MEMBERS:,}"
        )
    script = next((m.filename for m in members if m.filename.split("/")[1:2] == ["code"]), None)
    if script is not None and not code:
        raise BoundsError(
            f"{path}: '{script}': a TorchScript archive (it carries code, which torch.load would compile through "
            "torch.jit.load); not read as a weights file"
        )
    limit, total = size + INFLATE_ALLOWANCE, 0
    for info in members:
        if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
            raise BoundsError(
                f"{path}: '{info.filename}': a stored member declares {info.file_size:,} bytes "
                f"but stores {info.compress_size:,}"
            )
        total += info.file_size
        if total > limit:
            stored = info.compress_type == zipfile.ZIP_STORED
            how = (
                f"declares {info.file_size:,} bytes"
                if stored
                else f"inflates to {info.file_size:,} bytes from {info.compress_size:,}"
            )
            raise BoundsError(
                f"{path}: '{info.filename}': {how}; the members may expand to the archive's own "
                f"{size:,} bytes + {INFLATE_ALLOWANCE >> 20} MiB at most"
            )


def check_tensor(path: str | Path, key: str, tensor: torch.Tensor) -> int:
    """Refuse a view that declares more elements than its storage holds (zero or overlapping strides); -> its bytes."""
    nbytes = tensor.numel() * tensor.element_size()
    held = tensor.untyped_storage().nbytes()
    if nbytes > held:
        raise BoundsError(
            f"{path}: '{key}': declares shape {list(tensor.shape)} ({tensor.numel():,} elements) "
            f"over a storage of {held:,} bytes (zero or overlapping strides)"
        )
    return nbytes


def check_tensors(path: str | Path, items: Iterable[tuple[str, torch.Tensor]]) -> None:
    """:func:`check_tensor` for each ``(key, tensor)``; their total against the file's size and :data:`MAX_ELEMENTS`."""
    path = Path(path)
    limit = VIEW_FACTOR * path.stat().st_size + INFLATE_ALLOWANCE
    nbytes = elements = 0
    for key, tensor in items:
        nbytes += check_tensor(path, key, tensor)
        elements += tensor.numel()
        if nbytes > limit or elements > MAX_ELEMENTS:
            raise BoundsError(
                f"{path}: '{key}': the tensors up to this one declare {elements:,} elements "
                f"({nbytes:,} bytes), more than {MAX_ELEMENTS:,} elements or {VIEW_FACTOR} x the "
                f"file's size + {INFLATE_ALLOWANCE >> 20} MiB"
            )
