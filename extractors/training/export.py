"""Writing a trained detector as a ``butd`` weights file that ``cli extract --weights`` loads like a public one.

As the py-faster-rcnn snapshot does (``lib/fast_rcnn/train.py:56-84``), the box head trained on normalised
targets is stored *un-normalised*: ``bbox_pred`` rows are multiplied by the stds (0.1, 0.1, 0.2, 0.2), so the
file's deltas decode with weights (1, 1, 1, 1) like the public caffe-semantics checkpoints.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import torch

from extractors.bottom_up import BottomUpDetector
from extractors.weights import BUTD_FORMAT, BUTD_VERSION
from pipeline.core.fileio import atomic_write_bytes


def scale_bbox_pred(sd: "OrderedDict[str, torch.Tensor]", factors: Sequence[float]) -> None:
    """Multiply ``bbox_pred`` weight rows / biases ``4c + j`` by ``factors[j]`` in place."""
    f = torch.tensor(list(factors), dtype=torch.float32)
    w = sd["roi_heads.box_predictor.bbox_pred.weight"]
    b = sd["roi_heads.box_predictor.bbox_pred.bias"]
    sd["roi_heads.box_predictor.bbox_pred.weight"] = (w.view(-1, 4, w.shape[1]) * f.view(1, 4, 1).to(w)).reshape(
        w.shape
    )
    sd["roi_heads.box_predictor.bbox_pred.bias"] = (b.view(-1, 4) * f.view(1, 4).to(b)).reshape(b.shape)


def spec_dict(det: BottomUpDetector) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in det.spec.to_dict().items()}


def export_weights(
    det: BottomUpDetector,
    path: str | Path,
    bbox_stds: Sequence[float],
    classes: list[str],
    attributes: list[str],
    training: dict[str, Any] | None = None,
) -> Path:
    """Write ``det`` (trained with targets normalised by ``bbox_stds``) as a ``butd`` file, atomically."""
    sd = OrderedDict(
        (k, v.detach().cpu().float().clone() if v.is_floating_point() else v.detach().cpu().clone())
        for k, v in det.state_dict().items()
    )
    scale_bbox_pred(sd, bbox_stds)
    payload = {
        "format": BUTD_FORMAT,
        "version": BUTD_VERSION,
        "spec": spec_dict(det),
        "classes": list(classes),
        "attributes": list(attributes),
        "training": dict(training or {}),
        "model": dict(sd),
    }
    buf = io.BytesIO()
    torch.save(payload, buf)
    return atomic_write_bytes(path, buf.getvalue())


HEAD_KEYS = (
    "roi_heads.box_predictor.cls_score.",
    "roi_heads.box_predictor.bbox_pred.",
    "roi_heads.box_predictor.cls_embed.",
    "roi_heads.box_predictor.attr_linear1.",
    "roi_heads.box_predictor.attr_linear2.",
)
"""The class head (``cls_score``, ``bbox_pred``) and the attribute head (class embedding, two layers)."""


def reinit_heads(det: BottomUpDetector, num_classes: int, num_attributes: int, seed: int) -> BottomUpDetector:
    """A detector for a new label set: the class and attribute heads freshly initialised for ``num_classes`` /
    ``num_attributes`` (both counting background / "no attribute"), everything else (backbone, RPN, res5, anchors)
    copied from ``det``. The attribute head is re-initialised as a whole: its class embedding has one row per
    class, and the layers after it were trained on that embedding. The new ``bbox_pred`` starts in the
    normalised-target space of training (no un-normalising, unlike the file's own head)."""
    spec = det.spec.with_(num_classes=num_classes, num_attributes=num_attributes)
    torch.manual_seed(seed)
    new = BottomUpDetector(spec, det.parts)
    kept = {k: v for k, v in det.state_dict().items() if not k.startswith(HEAD_KEYS)}
    missing, unexpected = new.load_state_dict(kept, strict=False)
    assert not unexpected and all(k.startswith(HEAD_KEYS) for k in missing), (missing, unexpected)
    return new
