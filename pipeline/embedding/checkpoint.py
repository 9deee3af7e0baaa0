"""The sentence-encoder checkpoint: one typed record (:class:`EncoderCheckpoint`), one writer, one reader.

Training (``pipeline/embedding/train.py``: ``last.pt``, ``best.pt``) builds an :class:`EncoderCheckpoint` and calls
:meth:`EncoderCheckpoint.save`; ``embed``, retrieval, ``info`` and resuming read it with :func:`read_encoder_checkpoint`
only (``weights_only`` loading, errors name the file).

On disk (plain containers and tensors, :func:`pipeline.core.checkpoint.save_checkpoint`)::

    format, version   "butd-caption-checkpoint", 1
    kind        "train" (last.pt: everything to resume) | "weights" (best.pt)
    model       {"name": "sentence_encoder", "config" (resolved constructor kwargs), "vocab_size", "image_dim"}
    vocab       [words]                    weights  model state_dict
    epoch, position, global_step, best, history   (:class:`EncoderProgress`)
    train_config    the resolved sentence_encoder section
    optimizer, scaler, rng   (kind "train" only: :class:`~pipeline.core.training.resume.ResumeState`)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from pipeline.core.checkpoint import load_checkpoint, save_checkpoint
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.training.resume import ResumeState
from pipeline.core.vocab import Vocab
from pipeline.embedding.sentence_encoder import SentenceEncoder, encoder_config

MODEL_NAME = "sentence_encoder"
KINDS = ("train", "weights")
REQUIRED = ("kind", "model", "vocab", "weights")


@dataclass
class EncoderProgress:
    """The encoder trainer's counters: epochs done, batches done in the current epoch, steps, best, history."""

    epoch: int = 0
    position: int = 0
    global_step: int = 0
    best: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)


PROGRESS_KEYS = tuple(f.name for f in fields(EncoderProgress))


@dataclass
class EncoderCheckpoint:
    """Everything an encoder checkpoint carries. ``kind`` is ``train`` exactly when ``state`` is set."""

    model_config: dict[str, Any]
    image_dim: int
    vocab: tuple[str, ...]
    weights: dict[str, torch.Tensor]
    progress: EncoderProgress | None = None
    train_config: dict[str, Any] | None = None
    state: ResumeState | None = None

    @property
    def kind(self) -> str:
        return "train" if self.state is not None else "weights"

    # -- the one writer ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The on-disk payload (without ``format``/``version``, which :func:`save_checkpoint` adds)."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "model": {
                "name": MODEL_NAME,
                "config": dict(self.model_config),
                "vocab_size": len(self.vocab),
                "image_dim": int(self.image_dim),
            },
            "vocab": list(self.vocab),
            "weights": self.weights,
        }
        if self.progress is not None:
            out.update(asdict(self.progress))
        if self.train_config is not None:
            out["train_config"] = dict(self.train_config)
        if self.state is not None:
            out.update(self.state.to_dict())
        return out

    def save(self, path: str | Path) -> Path:
        """Write atomically (a kill never leaves a partial file)."""
        return save_checkpoint(path, self.to_dict())

    # -- the one reader ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str | Path, vocab: Vocab | None = None) -> EncoderCheckpoint:
        """Validate a loaded payload (and ``vocab``'s words when given); every problem is one line naming ``path``."""
        missing = [k for k in REQUIRED if k not in data]
        if missing:
            raise PipelineError(f"checkpoint {path} lacks {', '.join(missing)}")
        model = data["model"]
        if not isinstance(model, dict) or model.get("name") != MODEL_NAME:
            name = model.get("name") if isinstance(model, dict) else None
            raise UsageError(
                f"checkpoint {path} holds a {name!r} model, not a sentence encoder (train one with `cli train-encoder`)"
            )
        if not isinstance(model.get("config"), dict) or not isinstance(model.get("image_dim"), int):
            raise PipelineError(f"checkpoint {path}: malformed sentence-encoder description")
        if data["kind"] not in KINDS:
            raise PipelineError(f"checkpoint {path}: kind {data['kind']!r} is not one of {', '.join(KINDS)}")
        words = data["vocab"]
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
            raise PipelineError(f"checkpoint {path}: the vocabulary is not a list of words")
        weights = data["weights"]
        if not isinstance(weights, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()
        ):
            raise PipelineError(f"checkpoint {path}: weights are not a state dict of named tensors")
        if vocab is not None and list(words) != list(vocab.words):
            raise UsageError(
                f"checkpoint {path} was trained with another vocabulary ({len(words)} words) than the prepared data "
                f"({len(vocab)} words)"
            )
        progress = None
        if all(k in data for k in PROGRESS_KEYS):
            counts = ("epoch", "position", "global_step")
            if (
                not all(isinstance(data[k], int) and not isinstance(data[k], bool) and data[k] >= 0 for k in counts)
                or not isinstance(data["best"], dict)
                or not isinstance(data["history"], list)
            ):
                raise PipelineError(
                    f"checkpoint {path}: malformed progress counters (counts integers >= 0, best a mapping, "
                    "history a list)"
                )
            progress = EncoderProgress(**{k: data[k] for k in PROGRESS_KEYS})
        state = None
        if data["kind"] == "train":
            if progress is None:
                raise PipelineError(f"checkpoint {path} lacks its progress counters (a kind 'train' checkpoint)")
            state = ResumeState.from_dict(data, path)
        train_config = data.get("train_config")
        if train_config is not None and not isinstance(train_config, dict):
            raise PipelineError(f"checkpoint {path}: train_config is not a mapping")
        return cls(
            model_config=dict(model["config"]),
            image_dim=int(model["image_dim"]),
            vocab=tuple(words),
            weights=weights,
            progress=progress,
            train_config=train_config,
            state=state,
        )

    def build(self, path: str | Path, device: torch.device | str = "cpu") -> SentenceEncoder:
        """The encoder with these weights (loaded strictly), in eval mode on ``device``."""
        cfg = encoder_config(dict(self.model_config)).to_dict()
        model = SentenceEncoder(vocab_size=len(self.vocab), image_dim=self.image_dim, **cfg)
        try:
            model.load_state_dict(self.weights)
        except RuntimeError as exc:
            raise PipelineError(
                f"checkpoint {path}: weights do not fit the sentence encoder: {str(exc).splitlines()[0][:200]}"
            ) from None
        return model.to(device).eval()


def read_encoder_checkpoint(path: str | Path, vocab: Vocab | None = None) -> EncoderCheckpoint:
    """Load ``path`` and check that it holds a sentence encoder (and ``vocab``'s words when given)."""
    return EncoderCheckpoint.from_dict(load_checkpoint(path, REQUIRED), path, vocab)


def load_encoder(
    path: str | Path, device: torch.device | str = "cpu", vocab: Vocab | None = None
) -> tuple[SentenceEncoder, Vocab, EncoderCheckpoint]:
    """(encoder in eval mode on ``device``, its vocabulary, the checkpoint record)."""
    ckpt = read_encoder_checkpoint(path, vocab)
    words = Vocab.from_json({"format": "butd-caption-vocab", "words": list(ckpt.vocab)}, source=str(path))
    return ckpt.build(path, device), words, ckpt
