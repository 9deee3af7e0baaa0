"""Training/evaluation data: the (store + captions) Dataset, padding collate, bucketed batching, preloading."""

from pipeline.data.batching import BucketBatchSampler, FeatureBank, PreloadedLoader, build_loader
from pipeline.data.dataset import CaptionDataset, collate_images

__all__ = ["BucketBatchSampler", "CaptionDataset", "FeatureBank", "PreloadedLoader", "build_loader", "collate_images"]
