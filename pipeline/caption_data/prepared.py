"""The prepared caption data on disk, and its loader.

Files in the ``data`` stage folder (each written atomically; JSON and plain npz, never pickle)::

    vocab.json        pipeline.core.vocab.Vocab (<pad>=0 <bos>=1 <eos>=2 <unk>=3, then words by frequency)
    images.json       {"format", "version", "max_length", "images": [{key, cocoid, file, split, width, height}]}
    labels.npz        labels int32 (C, max_length) word ids padded with 0, no BOS/EOS;
                      lengths int32 (C,); offsets int64 (N + 1,): image i owns captions offsets[i]:offsets[i+1]
    references.json   {key: ["a man riding a horse", ...]}  untruncated tokenised references (evaluation)
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.core.errors import PipelineError
from pipeline.core.fileio import atomic_write, atomic_write_json, read_json
from pipeline.core.vocab import Vocab

if TYPE_CHECKING:
    from pipeline.caption_data.prepare import ImageEntry

FORMAT = "butd-caption-captions"
VERSION = 1
FILES = {
    "vocab": "vocab.json",
    "images": "images.json",
    "labels": "labels.npz",
    "references": "references.json",
}


def save_prepared(
    out: Path,
    *,
    vocab: Vocab,
    entries: Sequence["ImageEntry"],
    labels: np.ndarray,
    lengths: np.ndarray,
    offsets: np.ndarray,
    max_length: int,
) -> dict[str, str]:
    """Write the prepared files into ``out``; returns name -> file name (for the stage manifest)."""
    out.mkdir(parents=True, exist_ok=True)
    vocab.save(out / FILES["vocab"])

    def write_npz(fh: Any) -> None:
        np.savez(fh, labels=labels, lengths=lengths, offsets=offsets)

    atomic_write(out / FILES["labels"], write_npz)
    atomic_write_json(
        out / FILES["references"], {e.key: [" ".join(c) for c in e.captions] for e in entries}, indent=None
    )
    # images.json last: its presence with a matching version marks a complete set
    atomic_write_json(
        out / FILES["images"],
        {
            "format": FORMAT,
            "version": VERSION,
            "max_length": max_length,
            "images": [
                {
                    "key": e.key,
                    "cocoid": e.cocoid,
                    "file": e.file,
                    "split": e.split,
                    "width": e.width,
                    "height": e.height,
                }
                for e in entries
            ],
        },
        indent=None,
    )
    return dict(FILES)


@dataclass
class PreparedCaptions:
    """Prepared caption data loaded from a ``data`` stage folder (validated; errors name the file)."""

    directory: Path
    vocab: Vocab
    images: list[dict[str, Any]]
    labels: np.ndarray
    lengths: np.ndarray
    offsets: np.ndarray
    max_length: int

    @classmethod
    def load(cls, directory: str | Path) -> "PreparedCaptions":
        d = Path(directory)
        meta = read_json(d / FILES["images"], what="prepared captions index")
        if meta.get("format") != FORMAT:
            raise PipelineError(f"{d / FILES['images']} is not a butd-caption prepared-captions index")
        if meta.get("version") != VERSION:
            raise PipelineError(
                f"{d / FILES['images']} has version {meta.get('version')!r}; this butd-caption reads {VERSION}"
            )
        images = meta.get("images")
        if not isinstance(images, list) or not all(
            isinstance(i, dict) and isinstance(i.get("key"), str) for i in images
        ):
            raise PipelineError(f"{d / FILES['images']}: malformed 'images' list")
        vocab = Vocab.load(d / FILES["vocab"])
        path = d / FILES["labels"]
        try:
            with np.load(path, allow_pickle=False) as z:
                labels, lengths, offsets = z["labels"], z["lengths"], z["offsets"]
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as exc:
            raise PipelineError(f"{path}: not a valid labels file ({exc})") from None
        if offsets.shape != (len(images) + 1,) or int(offsets[-1]) != len(labels) or lengths.shape != (len(labels),):
            raise PipelineError(f"{path}: arrays do not match {len(images)} images in {d / FILES['images']}")
        if labels.size and (labels.min() < 0 or labels.max() >= len(vocab)):
            raise PipelineError(f"{path}: label ids outside the vocabulary of {len(vocab)} words")
        return cls(d, vocab, images, labels, lengths, offsets, int(meta.get("max_length", labels.shape[1])))

    def __len__(self) -> int:
        return len(self.images)

    def split_indices(self, split: str) -> list[int]:
        """Positions of the images of ``split`` (``train``/``val``/``test``/``restval``)."""
        return [i for i, img in enumerate(self.images) if img["split"] == split]

    def captions(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(labels (k, max_length), lengths (k,)) of image ``i``'s captions."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.labels[a:b], self.lengths[a:b]

    def references(self) -> dict[str, list[str]]:
        """Untruncated references by image key (for evaluation)."""
        return read_json(self.directory / FILES["references"], what="references file")
