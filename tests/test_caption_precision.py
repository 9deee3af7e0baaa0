"""caption --precision bf16: the engine runs the detector and the captioner under the autocast, word relevance
stays float32."""

from __future__ import annotations

import numpy as np
import torch
from extract_helpers import tiny_spec

import models
from extractors.factory import configure_recipe
from extractors.inputs import items_from_paths
from extractors.random_weights import random_detector
from models.decoding import DecodeOptions
from pipeline.captioning.engine import PhotoCaptioner
from pipeline.core.config import load_config
from pipeline.core.vocab import Vocab


def test_bf16_captions_with_float32_relevance(shared_data):
    torch.manual_seed(0)
    det = random_detector(tiny_spec(), 0).eval()
    section = load_config("caption", None, ["caption.min_size=160", "caption.max_size=256"]).caption
    _, selector = configure_recipe(det, "random", section, where="caption")
    vocab = Vocab(("<pad>", "<bos>", "<eos>", "<unk>", "a", "red", "blue", "circle", "square", "left"))
    cap = models.build_captioner(
        "san", len(vocab), feat_dim=det.spec.feature_dim, d_model=32, num_heads=4, d_ff=64, num_layers=1
    ).eval()
    items = items_from_paths([str(shared_data / "photos" / "000456.jpg")])
    engine = PhotoCaptioner(
        det,
        selector,
        cap,
        vocab,
        DecodeOptions.from_mapping({"method": "beam", "beam_size": 2, "max_len": 6}),
        torch.device("cpu"),
        precision="bf16",
    )
    res = list(engine.caption_paths(items, relevance=True))
    r = res[0]
    assert r.error is None and r.tokens and np.isfinite(r.score)
    assert r.relevance is not None and r.relevance.dtype == np.float32
    assert r.relevance.shape == (len(r.tokens), len(r.regions["boxes"]))
