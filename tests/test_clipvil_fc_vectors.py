"""CLIP-ViL ``_fc`` vectors whose entries are all equal (its first feature script's attention pool) import as
they are, with one warning that they are not the CLIP embedding ``extract`` stores."""

from __future__ import annotations

import logging

import numpy as np

from pipeline.importers import import_features
from pipeline.store import FeatureStore


def _folders(root, vectors):
    att, fc = root / "coco_clip_RN50_att", root / "coco_clip_RN50_fc"
    att.mkdir(parents=True)
    fc.mkdir()
    rng = np.random.default_rng(3)
    for key, vec in vectors.items():
        np.savez_compressed(att / f"{key}.npz", feat=rng.normal(0, 1, (2, 2, 5)).astype(np.float32))
        np.save(fc / f"{key}.npy", vec)
    return att


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "every entry" in r.getMessage()]


def test_constant_fc_vectors_are_imported_with_one_warning(tmp_path, caplog):
    vectors = {"1": np.full(8, 3.25, np.float32), "2": np.full(8, -1.5, np.float32)}
    att = _folders(tmp_path / "constant", vectors)
    with caplog.at_level(logging.WARNING):
        import_features("clip-vil", [att], tmp_path / "s", sizes={k: (64, 48) for k in vectors})
    found = _warnings(caplog)
    assert len(found) == 1 and "1.npy" in found[0] and "8 values" in found[0]
    store = FeatureStore(tmp_path / "s")
    for key, vec in vectors.items():
        np.testing.assert_array_equal(store.get(key)["pooled"], vec)


def test_clip_embeddings_import_without_the_warning(tmp_path, caplog):
    rng = np.random.default_rng(5)
    vectors = {"1": rng.normal(0, 1, 8).astype(np.float32), "2": rng.normal(0, 1, 8).astype(np.float32)}
    att = _folders(tmp_path / "embeddings", vectors)
    with caplog.at_level(logging.WARNING):
        import_features("clip-vil", [att], tmp_path / "s", sizes={k: (64, 48) for k in vectors})
    assert _warnings(caplog) == []
    assert FeatureStore(tmp_path / "s").pooled_dim == 8
