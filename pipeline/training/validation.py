"""Decoding a split and scoring it: validation during training and ``cli evaluate --model``.

:func:`decode_split` decodes every image of a dataset once (images sharded over DDP ranks, captions
gathered on every rank) with the model's decoding options. :func:`score_split` scores the captions with
the fast CIDEr-D (:class:`pipeline.metrics.cider.CiderD`, document frequencies from the evaluated split's
references, i.e. pycocoevalcap's ``Cider`` on that split) and, when asked, with the full COCO metrics
(:func:`pipeline.metrics.coco.score_captions`: PTB tokenizer, BLEU, METEOR, ROUGE-L, CIDEr-D, SPICE).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from models.captioners.base import Captioner
from models.decoding.captions import caption_words
from models.decoding import DecodeOptions, generate
from pipeline.core.console import track
from pipeline.metrics.cider import CiderD
from pipeline.training.batches import BatchSource, eval_batches
from pipeline.core.distributed import DistContext, gather_objects
from pipeline.core.training import autocast
from pipeline.core.vocab import Vocab


@torch.no_grad()
def decode_split(
    model: Captioner,
    source: BatchSource,
    vocab: Vocab,
    options: DecodeOptions,
    ctx: DistContext,
    batch_size: int = 50,
    precision: str = "fp32",
    max_images: int | None = None,
    description: str = "decoding",
) -> dict[str, str]:
    """``{image key: caption}`` for the dataset of ``source`` (every image once, gathered on all ranks)."""
    was_training = model.training
    model.eval()
    mine: dict[str, str] = {}
    batches = eval_batches(source.dataset, batch_size, ctx, max_images)
    for batch in track(source.iterate(batches), description, total=len(batches)):
        with autocast(ctx.device, precision):
            g = generate(model, batch["feats"], batch["mask"], batch["boxes"], batch["sizes"], options)
        for key, row, n in zip(batch["keys"], g.tokens[:, 0].tolist(), g.lengths[:, 0].tolist()):
            mine[key] = " ".join(caption_words(vocab, row[:n], options))
    model.train(was_training)
    merged: dict[str, str] = {}
    for part in gather_objects(mine, ctx):
        merged.update(part)
    return merged


def fast_cider(predictions: dict[str, str], references: dict[str, list[str]]) -> float:
    """Corpus CIDEr-D of ``predictions`` (df over the references of the predicted images)."""
    keys = sorted(predictions)
    scorer = CiderD({k: references[k] for k in keys}, df_mode="corpus")
    return float(np.mean(scorer.scores([predictions[k] for k in keys], keys)))


def score_split(
    predictions: dict[str, str], references: dict[str, list[str]], full: bool = False, options: Any = None
) -> dict[str, Any]:
    """``{"CIDEr": fast CIDEr-D on the words as they are}``; with ``full``, the COCO metrics after PTB
    tokenization (their ``CIDEr`` replaces it) plus ``skipped``/``notes``/``tokenizer``."""
    out: dict[str, Any] = {"CIDEr": fast_cider(predictions, references)}
    if full:
        from pipeline.metrics.coco import score_captions

        res = score_captions({k: references[k] for k in predictions}, predictions, options)
        out.update(res.metrics)
        out["skipped"], out["notes"], out["tokenizer"] = res.skipped, res.notes, res.tokenizer
    return out
