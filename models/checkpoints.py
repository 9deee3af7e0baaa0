"""The captioner checkpoint: one typed record (:class:`CaptionerCheckpoint`), one writer, one reader.

Training (``pipeline/training/engine.py``: ``last.pt``, ``best.pt``, ``xe.pt``) and the released-weights converter
(``models/released``) build a :class:`CaptionerCheckpoint` and call :meth:`CaptionerCheckpoint.save`; evaluate,
caption, serve, demo, ``info`` and resuming training read it with :meth:`CaptionerCheckpoint.load` only.

On disk (plain containers and tensors only, written atomically by :func:`pipeline.core.checkpoint.save_checkpoint`,
read with ``torch.load(weights_only=True)``)::

    format, version   "butd-caption-checkpoint", 1
    kind        "train" (last.pt: everything to resume) | "weights" (best.pt, xe.pt, converted releases)
    model       {"name", "config" (resolved constructor kwargs), "vocab_size"}
    vocab       [words]                    weights  model state_dict
    decoding    the decoding options the model was trained / released with
    stage       "xe" | "scst"              stage_done  bool (the stage finished; resuming moves on)
    epoch       epochs finished in the stage   position  batches done in the current epoch
    iteration   optimiser steps in the stage   global_step  steps over all stages
    best        {"metric", "value", "stage", "epoch"}   history  [validation records]
    bad_epochs  epochs without improvement (patience)   (these nine: :class:`Progress`, absent in releases)
    optimizer, schedule, scaler, rng   (kind "train" only: :class:`TrainingState`)
    train_config    the resolved train section (a release: {"max_boxes": None})
    store_identity  the feature store's identity the model was trained on (which extractor made the features)
    release     {"kind", "title", "weights_file", "vocab_file", "features", "converter_version"} (:class:`ReleaseInfo`)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from models import build_captioner
from models.captioners.base import Captioner
from pipeline.core.checkpoint import load_checkpoint, save_checkpoint
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.vocab import Vocab

KINDS = ("train", "weights")
MAX_WORDS = 2_000_000  # a vocabulary larger than this is a malformed file, not a model
MAX_WORD_CHARS = 1000


@dataclass
class Progress:
    """Training counters saved in every trained checkpoint (top-level keys on disk)."""

    stage: str = "xe"
    stage_done: bool = False
    epoch: int = 0
    position: int = 0
    iteration: int = 0
    global_step: int = 0
    bad_epochs: int = 0
    best: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class TrainingState:
    """What ``last.pt`` adds to resume bit-identically: optimizer, LR schedule, grad scaler and RNG states."""

    optimizer: dict[str, Any]
    schedule: dict[str, Any]
    scaler: dict[str, Any]
    rng: Any


@dataclass(frozen=True)
class ReleaseInfo:
    """Where a converted released model came from (``models/released``) and the features it expects."""

    kind: str
    title: str
    weights_file: str
    vocab_file: str
    features: dict[str, Any]
    converter_version: int


PROGRESS_KEYS = tuple(f.name for f in fields(Progress))
STATE_KEYS = tuple(f.name for f in fields(TrainingState))
RELEASE_KEYS = tuple(f.name for f in fields(ReleaseInfo))
REQUIRED = ("kind", "model", "vocab", "weights")
OPTIONAL = ("decoding", "train_config", "store_identity", "release")
KNOWN = frozenset(("format", "version", *REQUIRED, *OPTIONAL, *PROGRESS_KEYS, *STATE_KEYS))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@dataclass
class CaptionerCheckpoint:
    """Everything a captioner checkpoint carries. ``kind`` is ``train`` exactly when ``state`` is set."""

    model_name: str
    model_config: dict[str, Any]
    vocab: tuple[str, ...]
    weights: dict[str, torch.Tensor]
    decoding: dict[str, Any] = field(default_factory=dict)
    progress: Progress | None = None
    state: TrainingState | None = None
    train_config: dict[str, Any] | None = None
    store_identity: dict[str, Any] | None = None
    release: ReleaseInfo | None = None

    @property
    def kind(self) -> str:
        return "train" if self.state is not None else "weights"

    @property
    def max_boxes(self) -> int | None:
        """Regions per image the model was trained with (``train.max_boxes``; None: all)."""
        return (self.train_config or {}).get("max_boxes")

    # -- the one writer ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The on-disk payload (without ``format``/``version``, which :func:`save_checkpoint` adds)."""
        if self.state is not None and self.progress is None:
            raise ValueError("a training checkpoint (with optimizer state) needs its progress counters")
        out: dict[str, Any] = {
            "kind": self.kind,
            "model": {"name": self.model_name, "config": dict(self.model_config), "vocab_size": len(self.vocab)},
            "vocab": list(self.vocab),
            "weights": self.weights,
            "decoding": dict(self.decoding),
        }
        if self.progress is not None:
            out.update(asdict(self.progress))
        if self.train_config is not None:
            out["train_config"] = dict(self.train_config)
        if self.store_identity is not None:
            out["store_identity"] = dict(self.store_identity)
        if self.release is not None:
            out["release"] = asdict(self.release)
        if self.state is not None:
            out.update(asdict(self.state))
        return out

    def save(self, path: str | Path) -> Path:
        """Write atomically (a kill never leaves a partial file)."""
        return save_checkpoint(path, self.to_dict())

    # -- the one reader ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str | Path) -> CaptionerCheckpoint:
        """Validate a loaded payload; every problem is one :class:`PipelineError` line naming ``path``."""

        def bad(what: str) -> PipelineError:
            return PipelineError(f"checkpoint {path}: {what}")

        unknown = sorted(str(k) for k in data if k not in KNOWN)
        if unknown:
            raise bad(f"unknown field(s) {', '.join(unknown[:5])} (not a captioner checkpoint of this version)")
        missing = [k for k in REQUIRED if k not in data]
        if missing:
            raise PipelineError(f"checkpoint {path} lacks {', '.join(missing)}")
        if data["kind"] not in KINDS:
            raise bad(f"kind {data['kind']!r} is not one of {', '.join(KINDS)}")
        model = data["model"]
        if (
            not isinstance(model, dict)
            or not isinstance(model.get("name"), str)
            or not isinstance(model.get("config"), dict)
        ):
            raise bad("malformed model description (needs a name and a config)")
        vocab = data["vocab"]
        if (
            not isinstance(vocab, (list, tuple))
            or len(vocab) > MAX_WORDS
            or not all(isinstance(w, str) and len(w) <= MAX_WORD_CHARS for w in vocab)
        ):
            raise bad(f"the vocabulary is not a list of at most {MAX_WORDS:,} words")
        if "vocab_size" in model and model["vocab_size"] != len(vocab):
            raise bad(f"model.vocab_size {model['vocab_size']!r} differs from the {len(vocab)} words of its vocabulary")
        weights = data["weights"]
        if not isinstance(weights, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()
        ):
            raise bad("weights are not a state dict of named tensors")
        for key in ("decoding", "train_config", "store_identity"):
            if key in data and not isinstance(data[key], dict):
                raise bad(f"{key} is not a mapping")
        progress = None
        present = [k for k in PROGRESS_KEYS if k in data]
        if present:
            if len(present) != len(PROGRESS_KEYS):
                raise PipelineError(f"checkpoint {path} lacks {', '.join(k for k in PROGRESS_KEYS if k not in data)}")
            counts = ("epoch", "position", "iteration", "global_step", "bad_epochs")
            if (
                not isinstance(data["stage"], str)
                or not isinstance(data["stage_done"], bool)
                or not all(isinstance(data[k], int) and not isinstance(data[k], bool) and data[k] >= 0 for k in counts)
                or not isinstance(data["best"], dict)
                or not isinstance(data["history"], list)
            ):
                raise bad(
                    "malformed progress counters (stage a string, stage_done a bool, counts integers >= 0, "
                    "best a mapping, history a list)"
                )
            progress = Progress(**{k: data[k] for k in PROGRESS_KEYS})
        state = None
        if data["kind"] == "train":
            lacking = [k for k in STATE_KEYS if k not in data]
            if lacking or progress is None:
                raise PipelineError(
                    f"checkpoint {path} lacks {', '.join(lacking or ['its progress counters'])} "
                    "(a kind 'train' checkpoint)"
                )
            state = TrainingState(**{k: data[k] for k in STATE_KEYS})
        release = None
        if data.get("release"):
            rel = data["release"]
            if not isinstance(rel, dict) or set(rel) != set(RELEASE_KEYS):
                raise bad(f"malformed release record (needs exactly {', '.join(RELEASE_KEYS)})")
            if (
                not all(isinstance(rel[k], str) for k in ("kind", "title", "weights_file", "vocab_file"))
                or not isinstance(rel["features"], dict)
                or not isinstance(rel["converter_version"], int)
            ):
                raise bad(
                    "malformed release record (kind, title and file names are strings, features a mapping, "
                    "converter_version an integer)"
                )
            release = ReleaseInfo(**rel)
        return cls(
            model_name=model["name"],
            model_config=dict(model["config"]),
            vocab=tuple(vocab),
            weights=weights,
            decoding=dict(data.get("decoding", {})),
            progress=progress,
            state=state,
            train_config=data.get("train_config"),
            store_identity=data.get("store_identity"),
            release=release,
        )

    @classmethod
    def load(cls, path: str | Path) -> CaptionerCheckpoint:
        """Read and validate ``path`` (``weights_only``): a foreign, truncated, unsafe or malformed file fails in
        one line naming it."""
        return cls.from_dict(load_checkpoint(path), path)

    # -- checks -----------------------------------------------------------------------------------------
    def check_compatible(
        self, path: str | Path, model_name: str | None, model_config: dict[str, Any] | None, vocab: Vocab | None
    ) -> None:
        """Refuse a checkpoint of another model, model config or vocabulary, with one line naming the file."""
        if model_name is not None and self.model_name != model_name:
            raise UsageError(f"checkpoint {path} holds a '{self.model_name}' model, not '{model_name}'")
        if model_config is not None and not _same(self.model_config, dict(model_config)):
            diff = sorted(
                k
                for k in set(self.model_config) | set(model_config)
                if not _same(self.model_config.get(k), model_config.get(k))
            )
            raise UsageError(
                f"checkpoint {path} was trained with another '{self.model_name}' configuration "
                f"(differs in: {', '.join(diff)})"
            )
        if vocab is not None and list(self.vocab) != list(vocab.words):
            raise UsageError(
                f"checkpoint {path} was trained with another vocabulary ({len(self.vocab)} words) "
                f"than the prepared data ({len(vocab)} words)"
            )

    def build(self, path: str | Path, device: torch.device | str = "cpu") -> Captioner:
        """The captioner with these weights (loaded strictly)."""
        model = build_captioner(self.model_name, len(self.vocab), **self.model_config)
        try:
            model.load_state_dict(self.weights)
        except RuntimeError as exc:
            raise PipelineError(
                f"checkpoint {path}: weights do not fit a '{self.model_name}' model: {str(exc).splitlines()[0][:200]}"
            ) from None
        return model.to(device)
