"""Encoder checkpoints: validation and rebuilding the model (``weights_only`` loading, errors name the file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipeline.embedding.sentence_encoder import SentenceEncoder, encoder_config
from pipeline.core.checkpoint import load_checkpoint
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.vocab import Vocab

REQUIRED = ("kind", "model", "vocab", "weights")


def read_encoder_checkpoint(path: str | Path, vocab: Vocab | None = None) -> dict[str, Any]:
    """Load ``path`` and check that it holds a sentence encoder (and ``vocab``'s words when given)."""
    ckpt = load_checkpoint(path, REQUIRED)
    model = ckpt["model"]
    if not isinstance(model, dict) or model.get("name") != "sentence_encoder":
        name = model.get("name") if isinstance(model, dict) else None
        raise UsageError(
            f"checkpoint {path} holds a {name!r} model, not a sentence encoder (train one with `cli train-encoder`)"
        )
    if not isinstance(model.get("config"), dict) or not isinstance(model.get("image_dim"), int):
        raise PipelineError(f"checkpoint {path}: malformed sentence-encoder description")
    if vocab is not None and list(ckpt["vocab"]) != list(vocab.words):
        raise UsageError(
            f"checkpoint {path} was trained with another vocabulary ({len(ckpt['vocab'])} words) than the prepared data ({len(vocab)} words)"
        )
    return ckpt


def load_encoder(
    path: str | Path, device: torch.device | str = "cpu", vocab: Vocab | None = None
) -> tuple[SentenceEncoder, Vocab, dict[str, Any]]:
    """(encoder in eval mode on ``device``, its vocabulary, the checkpoint dict)."""
    ckpt = read_encoder_checkpoint(path, vocab)
    words = Vocab.from_json({"format": "butd-caption-vocab", "words": list(ckpt["vocab"])}, source=str(path))
    cfg = encoder_config(dict(ckpt["model"]["config"])).to_dict()
    model = SentenceEncoder(vocab_size=len(words), image_dim=int(ckpt["model"]["image_dim"]), **cfg)
    try:
        model.load_state_dict(ckpt["weights"])
    except RuntimeError as exc:
        raise PipelineError(
            f"checkpoint {path}: weights do not fit the sentence encoder: {str(exc).splitlines()[0][:200]}"
        ) from None
    return model.to(device).eval(), words, ckpt
