"""Caption <-> image similarity with a trained encoder, for ground-truth or generated captions.

Captions are encoded, projected into the image-feature space by the image head (h̃_I, §3.2) and compared
with the images' mean region features by cosine similarity, the same score the ranking loss trains.
Self-retrieval (one generated caption per image) measures how distinctive a captioner's captions are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.caption_data.prepared import PreparedCaptions
from pipeline.core.distributed import resolve_device
from pipeline.core.errors import UsageError
from pipeline.core.fileio import read_json
from pipeline.core.training import autocast, resolve_precision
from pipeline.core.vocab import Vocab
from pipeline.embedding.checkpoint import load_encoder
from pipeline.embedding.data import SplitCaptions, image_table
from pipeline.embedding.losses import cosine_matrix
from pipeline.embedding.sentence_encoder import SentenceEncoder, sentence_tensor
from pipeline.metrics.retrieval import retrieval_metrics
from pipeline.store import FeatureStore


@torch.no_grad()
def encode_batches(
    model: SentenceEncoder,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    device: torch.device | str,
    output: str = "h",
    batch_size: int = 512,
    precision: str = "fp32",
) -> torch.Tensor:
    """(C, D) float32 on CPU: ``h`` or its image projection (``output="image"``) for every caption.

    ``precision``: a resolved precision (fp32 | bf16 | fp16, :func:`pipeline.core.training.resolve_precision`);
    the forward pass runs under its autocast, the vectors come back as float32."""
    was = model.training
    model.eval()
    out = []
    dev = torch.device(device)
    for s in range(0, len(tokens), batch_size):
        with autocast(dev, precision):
            h = model.encode(tokens[s : s + batch_size].to(dev), lengths[s : s + batch_size])["h"]
            vec = model.predict_image(h) if output == "image" else h
        out.append(vec.float().cpu())
    model.train(was)
    return torch.cat(out) if out else torch.zeros((0, model.rep_dim))


def split_similarity(
    model: SentenceEncoder,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    images: np.ndarray,
    device: torch.device | str,
    batch_size: int = 512,
    precision: str = "fp32",
) -> np.ndarray:
    """(C, N) cosine similarities between the captions' predicted image features and the image vectors
    (the captions encoded under ``precision``'s autocast, the cosines in float32)."""
    pred = encode_batches(model, tokens, lengths, device, "image", batch_size, precision)
    return cosine_matrix(pred, torch.from_numpy(np.asarray(images, dtype=np.float32))).numpy()


def words_to_inputs(
    sentences: Sequence[str], vocab: Vocab, max_words: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whitespace-tokenised, lowercased sentences -> encoder inputs (unknown words -> <unk>)."""
    ids = [[vocab.id(w) for w in s.lower().split()][:max_words] for s in sentences]
    return sentence_tensor(ids)


def retrieval_report(
    model: SentenceEncoder,
    store: FeatureStore,
    split: SplitCaptions,
    device: torch.device | str,
    generated: Mapping[str, str] | None = None,
    max_boxes: int | None = None,
    num_workers: int = 0,
    precision: str = "fp32",
) -> dict[str, Any]:
    """R@1/5/10 both ways for the split's ground-truth captions and, when given, for generated captions
    (``{image key: caption}``; self-retrieval: each generated caption against the split's images). The image
    vectors are read in ``num_workers`` DataLoader processes (:func:`~pipeline.embedding.data.image_table`); the
    captions are encoded under ``precision`` (resolved: fp32 | bf16 | fp16)."""
    if model.image_head is None:
        raise UsageError(
            f"the encoder was trained with objective {model.objective} and has no image head: "
            "retrieval needs cap2img or cap2all"
        )
    images = image_table(store, split.keys, max_boxes, num_workers)
    tokens, lengths, caption_image = split.all_captions()
    out: dict[str, Any] = {"split_images": len(split.keys), "gt_captions": int(len(tokens))}
    out["ground_truth"] = retrieval_metrics(
        split_similarity(model, tokens, lengths, images, device, precision=precision), caption_image.numpy()
    )
    if generated is not None:
        rows = {k: i for i, k in enumerate(split.keys)}
        keys = [k for k in generated if k in rows]
        if not keys:
            raise UsageError("none of the generated captions belongs to an image of the evaluated split")
        gen_tokens, gen_lengths = words_to_inputs([generated[k] for k in keys], split.data.vocab)
        sim = split_similarity(model, gen_tokens, gen_lengths, images, device, precision=precision)
        out["generated_captions"] = len(keys)
        out["generated"] = retrieval_metrics(sim, np.array([rows[k] for k in keys]))
    return out


def results_to_keys(results: Any, data: Any, source: str) -> dict[str, str]:
    """A COCO results list ``[{image_id, caption}]`` -> ``{prepared image key: caption}`` (ids matched to the
    prepared images' key or cocoid); entries of unknown images are left out."""
    if not isinstance(results, list):
        raise UsageError(f"{source}: a results file must be a JSON list of {{image_id, caption}}")
    by_id: dict[str, str] = {}
    for img in data.images:
        by_id[str(img["key"])] = img["key"]
        if img.get("cocoid") is not None:
            by_id.setdefault(str(img["cocoid"]), img["key"])
    out: dict[str, str] = {}
    for n, rec in enumerate(results):
        if not isinstance(rec, dict) or "image_id" not in rec or not isinstance(rec.get("caption"), str):
            raise UsageError(f"{source}: entry {n} is not {{image_id, caption}}")
        key = by_id.get(str(rec["image_id"]))
        if key is not None and key not in out:
            out[key] = rec["caption"]
    return out


def evaluate_retrieval_files(
    checkpoint: Any,
    store_path: Any,
    data_path: Any,
    split: str,
    device: str = "auto",
    predictions: Any = None,
    max_boxes: int | None = None,
    num_workers: int = 0,
    precision: str = "fp32",
) -> dict[str, Any]:
    """``cli evaluate --retrieval``: R@K of ``split``'s ground-truth captions and, with ``predictions`` (a COCO
    results file), of the generated captions (self-retrieval); the store is read in ``num_workers`` processes,
    the captions encoded under ``precision`` (auto | fp32 | bf16 | fp16, checked for the device as
    ``evaluate.precision``)."""
    if store_path is None or data_path is None:
        raise UsageError(
            "--retrieval needs --store FEATURES (the image vectors) and --data PREPARED (the split's captions)"
        )
    if not Path(store_path).exists():
        raise UsageError(f"feature store not found: {store_path}")
    dev = resolve_device(device)
    precision = resolve_precision(precision, dev, "evaluate.precision")
    data = PreparedCaptions.load(data_path)
    model, _, _ = load_encoder(checkpoint, dev, data.vocab)
    store = FeatureStore(store_path)
    split_caps = SplitCaptions.load(data, split, store)
    generated = None
    if predictions is not None:
        generated = results_to_keys(read_json(predictions, what="results file", expect=list), data, str(predictions))
        generated = {k: v for k, v in generated.items() if k in set(split_caps.keys)}
        if not generated:
            raise UsageError(f"{predictions}: no caption of a {split} image (give --split for the predictions' split)")
    report = retrieval_report(model, store, split_caps, dev, generated, max_boxes, num_workers, precision)
    return {"checkpoint": str(checkpoint), "split": split, **report}
