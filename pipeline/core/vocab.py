"""Caption vocabulary: word <-> id with fixed special tokens, saved as JSON (never pickled).

Special ids are the same for every model and checkpoint: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``<unk>``=3.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import PipelineError
from pipeline.core.fileio import atomic_write_json, read_json

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


@dataclass(frozen=True)
class Vocab:
    """An immutable vocabulary; ``words[i]`` is the word of id ``i`` (the first four are the specials)."""

    words: tuple[str, ...]

    def __post_init__(self) -> None:
        """Check the specials come first and no word repeats; build the word -> id index."""
        if tuple(self.words[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"vocabulary must start with {SPECIALS}")
        if len(set(self.words)) != len(self.words):
            raise ValueError("vocabulary has duplicate words")
        object.__setattr__(self, "_index", {w: i for i, w in enumerate(self.words)})

    def __len__(self) -> int:
        return len(self.words)

    @classmethod
    def build(cls, sentences: Iterable[Sequence[str]], min_count: int = 1) -> "Vocab":
        """Words seen at least ``min_count`` times, most frequent first (ties alphabetical)."""
        counts = Counter(w for s in sentences for w in s)
        kept = sorted(
            (w for w, c in counts.items() if c >= min_count and w not in SPECIALS), key=lambda w: (-counts[w], w)
        )
        return cls(SPECIALS + tuple(kept))

    def id(self, word: str) -> int:
        """The id of ``word`` (UNK when unknown)."""
        return self._index.get(word, UNK)  # type: ignore[attr-defined]

    def encode(
        self, tokens: Sequence[str], max_len: int | None = None, add_bos: bool = False, add_eos: bool = True
    ) -> list[int]:
        """Token ids, truncated to ``max_len`` words (before the optional BOS/EOS are added)."""
        ids = [self.id(t) for t in tokens]
        if max_len is not None:
            ids = ids[:max_len]
        return ([BOS] if add_bos else []) + ids + ([EOS] if add_eos else [])

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Words up to the first EOS, skipping PAD and BOS."""
        out: list[str] = []
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if i in (PAD, BOS):
                continue
            out.append(self.words[i] if 0 <= i < len(self.words) else SPECIALS[UNK])
        return out

    def to_json(self) -> dict[str, Any]:
        """The vocabulary as a self-describing JSON object (format, version, words)."""
        return {"format": "butd-caption-vocab", "version": 1, "words": list(self.words)}

    @classmethod
    def from_json(cls, data: Any, source: str = "vocabulary") -> "Vocab":
        """Read what :meth:`to_json` wrote; errors name ``source``."""
        if (
            not isinstance(data, dict)
            or data.get("format") != "butd-caption-vocab"
            or not isinstance(data.get("words"), list)
        ):
            raise PipelineError(f"{source} is not a butd-caption vocabulary")
        if not all(isinstance(w, str) for w in data["words"]):
            raise PipelineError(f"{source}: vocabulary words must be strings")
        try:
            return cls(tuple(data["words"]))
        except ValueError as exc:
            raise PipelineError(f"{source}: {exc}") from exc

    def save(self, path: str | Path) -> Path:
        """Write the vocabulary to ``path`` (JSON, atomically)."""
        return atomic_write_json(path, self.to_json(), indent=None)

    @classmethod
    def load(cls, path: str | Path) -> "Vocab":
        """Read a vocabulary file written by :meth:`save`."""
        return cls.from_json(read_json(path, what="vocabulary file"), source=str(path))
