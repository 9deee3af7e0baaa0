"""The feature store: crash-safe, resumable HDF5 cache of region features (see :mod:`pipeline.store.format`).

Entry points::

    with open_writer("runs/x/features/store", {"name": "butd-r101", "weights_sha256": ..., "config": {...}}) as w:
        if not w.has(key):
            w.add(key, RegionRecord(features, boxes, image_w, image_h, class_ids=..., class_scores=...))
        w.commit()                      # durable from here on

    store = FeatureStore("runs/x/features/store")
    rec = store.get(key)                # {"features", "boxes", "image_w", "image_h", ...}
    rec.get("pooled")                   # (P,) float32 in a store with a per-image vector (CLIP's), else None
"""

from pipeline.store.format import SCHEMA_VERSION, is_store
from pipeline.store.merge import compact_store, merge_stores
from pipeline.store.reader import FeatureStore, load_identity_file
from pipeline.store.validate import validate_image
from pipeline.store.writer import FeatureStoreWriter, open_writer

__all__ = [
    "SCHEMA_VERSION",
    "FeatureStore",
    "FeatureStoreWriter",
    "compact_store",
    "is_store",
    "load_identity_file",
    "merge_stores",
    "open_writer",
    "validate_image",
]
