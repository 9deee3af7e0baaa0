"""Dataset/DataLoader over (store, prepared captions): padding, masks, captions, workers under spawn/fork,
bucketed batching, box cap and preloading."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline.caption_data import PreparedCaptions
from pipeline.caption_data.prepare import prepare_captions
from pipeline.core.config import load_config
from pipeline.core.errors import PipelineError
from pipeline.core.regions import RegionRecord
from pipeline.core.stages import run_stage
from pipeline.core.vocab import BOS, EOS, PAD
from pipeline.data import BucketBatchSampler, CaptionDataset, build_loader, collate_images
from pipeline.store import FeatureStore, open_writer
from pipeline.world.generate import generate_world

DIM = 32


def image_features(key: str, w: int, h: int) -> dict:
    rng = np.random.default_rng(int(key))
    n = int(rng.integers(3, 25))
    x1, y1 = rng.uniform(0, w / 2, n), rng.uniform(0, h / 2, n)
    boxes = np.stack([x1, y1, x1 + rng.uniform(1, w / 2, n), y1 + rng.uniform(1, h / 2, n)], 1).astype(np.float32)
    return {
        "features": rng.uniform(0, 4, (n, DIM)).astype(np.float32),
        "boxes": boxes,
        "class_scores": rng.uniform(0, 1, n).astype(np.float32),
        "class_ids": rng.integers(0, 50, n),
    }


@pytest.fixture(scope="module")
def world_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    generate_world(root / "world", load_config("world", None, ["world.num_images=40", "world.num_workers=1"]).world)
    cfg = load_config("prepare", None, [f"prepare.karpathy_json={root / 'world/annotations/dataset_coco.json'}"])
    run_stage(root / "run", "data", cfg.prepare, prepare_captions)
    sizes = {}
    for split in ("train", "val", "test"):
        for img in json.loads((root / f"world/annotations/captions_{split}.json").read_text())["images"]:
            sizes[str(img["id"])] = (img["width"], img["height"])
    with open_writer(root / "store", {"name": "synthetic-test"}, commit_every=9) as w:
        for key, (wd, ht) in sizes.items():
            f = image_features(key, wd, ht)
            w.add(
                key,
                RegionRecord(
                    f["features"], f["boxes"], wd, ht, class_ids=f["class_ids"], class_scores=f["class_scores"]
                ),
            )
    return root / "store", root / "run" / "data"


def test_item_and_collate(world_data):
    store, data_dir = world_data
    ds = CaptionDataset(store, data_dir, "train")
    data = PreparedCaptions.load(data_dir)
    assert len(ds) == 32
    item = ds[3]
    rec = FeatureStore(store).get(item["key"])
    np.testing.assert_array_equal(item["features"], rec["features"])
    labels, lengths = data.captions(data.split_indices("train")[3])
    np.testing.assert_array_equal(item["labels"], labels)
    batch = collate_images([ds[i] for i in (0, 1, 2, 5)])
    counts = [len(ds[i]["boxes"]) for i in (0, 1, 2, 5)]
    assert batch["feats"].shape == (4, max(counts), DIM) and batch["feats"].dtype == torch.float16
    assert batch["mask"].sum(1).tolist() == counts and batch["num_boxes"].tolist() == counts
    for j, i in enumerate((0, 1, 2, 5)):
        k = counts[j]
        assert torch.equal(batch["feats"][j, :k], torch.from_numpy(np.array(ds[i]["features"])))
        assert (batch["feats"][j, k:] == 0).all() and (batch["boxes"][j, k:] == 0).all()
        assert batch["sizes"][j].tolist() == list(ds[i]["size"])
    # captions: BOS w1..wn EOS PAD, one row per caption, mapped to its image
    n_caps = [len(ds[i]["labels"]) for i in (0, 1, 2, 5)]
    assert batch["caption_image"].tolist() == sum(([j] * c for j, c in enumerate(n_caps)), [])
    caps, lens = batch["captions"], batch["caption_lengths"]
    assert (caps[:, 0] == BOS).all()
    row = 0
    for i in (0, 1, 2, 5):
        for lab, n in zip(ds[i]["labels"], ds[i]["lengths"]):
            assert caps[row, 1 : n + 1].tolist() == lab[:n].tolist() and caps[row, n + 1] == EOS
            assert (caps[row, n + 2 :] == PAD).all() and lens[row] == n + 1
            row += 1


def _all_batches(loader) -> dict[str, dict]:
    out = {}
    for batch in loader:
        for j, key in enumerate(batch["keys"]):
            k = int(batch["num_boxes"][j])
            caps = batch["captions"][batch["caption_image"] == j]
            out[key] = {
                "feats": batch["feats"][j, :k].cpu().clone(),
                "boxes": batch["boxes"][j, :k].cpu().clone(),
                "caps": caps.cpu().clone(),
                "pad_ok": bool((batch["feats"][j, k:] == 0).all()),
            }
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k]["feats"], b[k]["feats"]) and torch.equal(a[k]["boxes"], b[k]["boxes"])
        assert a[k]["pad_ok"] and b[k]["pad_ok"]
        ca, cb = a[k]["caps"], b[k]["caps"]
        t = min(ca.shape[1], cb.shape[1])
        assert torch.equal(ca[:, :t], cb[:, :t]) and (ca[:, t:] == PAD).all() and (cb[:, t:] == PAD).all()


@pytest.mark.parametrize("context", ["spawn", "fork"])
def test_workers_match_single_process(world_data, context):
    store, data_dir = world_data
    single = _all_batches(build_loader(store, data_dir, "train", 5, num_workers=0))
    # the parent has the store open already: fork children must reopen it, spawn children unpickle the path
    workers = 1 if context == "spawn" else 2  # a spawned worker re-imports torch (seconds on 2 cores)
    loader = build_loader(store, data_dir, "train", 5, num_workers=workers, multiprocessing_context=context)
    loader.dataset.store.get(loader.dataset.keys[0])
    multi = _all_batches(loader)
    assert len(single) == 32
    _assert_same(single, multi)


def test_bucketed_batches_cover_everything_with_less_padding():
    rng = np.random.default_rng(0)
    counts = rng.integers(10, 101, 2000)
    bucket = BucketBatchSampler(counts, 32, "bucket", seed=1)
    rand = BucketBatchSampler(counts, 32, "random", seed=1)
    for sampler in (bucket, rand):
        flat = [i for b in sampler for i in b]
        assert sorted(flat) == list(range(2000)) and len(list(sampler)) == len(sampler) == 63

    def padding(sampler):
        return sum(max(counts[b]) * len(b) - counts[b].sum() for b in sampler) / counts.sum()

    assert padding(bucket) < 0.1 < padding(rand)
    first = list(bucket)
    bucket.set_epoch(1)
    assert list(bucket) != first
    srt = [counts[b].max() for b in BucketBatchSampler(counts, 32, "sorted")]
    assert srt == sorted(srt)


def test_box_cap_keeps_highest_scores(world_data):
    store, data_dir = world_data
    ds = CaptionDataset(store, data_dir, "val", max_boxes=4)
    full = FeatureStore(store)
    for i in range(len(ds)):
        rec, item = full.get(ds.keys[i]), ds[i]
        n = min(4, len(rec["boxes"]))
        keep = np.sort(np.argsort(-rec["class_scores"], kind="stable")[:n])
        np.testing.assert_array_equal(item["boxes"], rec["boxes"][keep])
    assert ds.num_boxes().max() <= 4


def test_preloaded_memory_matches_streaming(world_data):
    store, data_dir = world_data
    streaming = _all_batches(build_loader(store, data_dir, "train", 6, batching="sorted", max_boxes=10))
    memory = _all_batches(build_loader(store, data_dir, "train", 6, batching="sorted", max_boxes=10, preload="memory"))
    _assert_same(streaming, memory)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="preload=cuda/pinned needs a CUDA device")
def test_preloaded_cuda_matches_streaming(world_data):
    store, data_dir = world_data
    streaming = _all_batches(build_loader(store, data_dir, "train", 6))
    for mode in ("pinned", "cuda"):
        _assert_same(streaming, _all_batches(build_loader(store, data_dir, "train", 6, preload=mode)))


def test_missing_features_are_an_error_not_random_features(world_data, tmp_path):
    store, data_dir = world_data
    src = FeatureStore(store)
    with open_writer(tmp_path / "partial", src.identity) as w:
        for key in src.keys()[:20]:
            rec = src.get(key)
            w.add(
                key,
                RegionRecord(
                    rec["features"],
                    rec["boxes"],
                    rec["image_w"],
                    rec["image_h"],
                    class_ids=rec["class_ids"],
                    class_scores=rec["class_scores"],
                ),
            )
    with pytest.raises(PipelineError, match=r"of 32 train images have no features in .*partial"):
        CaptionDataset(tmp_path / "partial", data_dir, "train")
    ds = CaptionDataset(tmp_path / "partial", data_dir, "train", allow_missing=True)
    assert 0 < len(ds) < 32 and all(k in src.keys()[:20] for k in ds.keys)


def test_ddp_ranks_split_batches():
    counts = np.random.default_rng(2).integers(10, 101, 1003)
    ranks = [BucketBatchSampler(counts, 16, "bucket", seed=5, rank=r, world_size=3) for r in range(3)]
    parts = [list(s) for s in ranks]
    assert len({len(p) for p in parts}) == 1 and len(parts[0]) == len(ranks[0]) == 21  # ceil(63 / 3)
    flat = [i for p in parts for b in p for i in b]
    assert set(flat) == set(range(1003))  # every image on some rank; padding repeats a few batches only
    assert len(flat) - 1003 < 16 * 3


def test_feature_bank_for_a_gpu_never_holds_the_table_in_host_memory(world_data, monkeypatch):
    """``preload: cuda`` fills the device table through a bounded staging buffer (no torchrun process
    builds the whole table in host RAM first); the staged fill gives the same table as the direct one."""
    from pipeline.data.batching import FeatureBank

    store, data_dir = world_data
    ds = CaptionDataset(store, data_dir, "train", max_boxes=10)
    direct = FeatureBank(ds, "cpu")
    table_bytes = direct.features.numel() * direct.features.element_size()
    stage = table_bytes // 8
    staged = FeatureBank(ds, "cpu", staged=True, stage_bytes=stage)
    for name in ("features", "boxes", "starts", "counts", "sizes"):
        assert torch.equal(getattr(direct, name), getattr(staged, name)), name
    host: list[int] = []  # bytes of every host array the bank allocates (torch or numpy)

    def spying(real):
        def spy(*args, **kwargs):
            t = real(*args, **kwargs)
            if not torch.is_tensor(t) or t.device.type == "cpu":
                host.append(t.nbytes)
            return t

        return spy

    monkeypatch.setattr(torch, "empty", spying(torch.empty))
    monkeypatch.setattr(np, "empty", spying(np.empty))
    bank = FeatureBank(ds, "meta", stage_bytes=stage)  # a device that is not the host
    assert bank.features.device.type == "meta" and tuple(bank.features.shape) == tuple(direct.features.shape)
    assert host and max(host) <= stage, (max(host), stage, table_bytes)
