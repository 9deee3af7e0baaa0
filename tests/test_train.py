"""Acceptance of training on the synthetic world with oracle features (CPU, tiny models).

san and ngsan: XE (10 epochs) then SCST (4 epochs, 5 samples per image, mean-of-others baseline: on 400
training images the greedy baseline's gain is smaller and noisier); the test-split CIDEr-D (50 images, beam
search of the model YAML) of the XE checkpoint is far above a shuffled-captions baseline, and SCST raises it.
Measured numbers are printed (pytest -s) and asserted against margins.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from train_helpers import make_world_run, train_overrides

from models.checkpoints import CaptionerCheckpoint
from pipeline.caption_data.prepared import PreparedCaptions
from pipeline.core.config import load_config
from pipeline.training.api import evaluate_checkpoint, train_captioner
from pipeline.training.validation import fast_cider


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    torch.set_num_threads(1)
    return make_world_run(tmp_path_factory.mktemp("train"), num_images=500)


def shuffled_baseline(run) -> float:
    """CIDEr-D of captions of *other* test images (a random derangement): what no image understanding gives."""
    data = PreparedCaptions.load(run / "data")
    refs = data.references()
    keys = [data.images[i]["key"] for i in data.split_indices("test")]
    order = np.random.default_rng(0).permutation(len(keys))
    shuffled = {keys[order[i]]: refs[keys[order[(i + 1) % len(keys)]]][0] for i in range(len(keys))}
    return fast_cider(shuffled, refs)


SETTINGS = [
    "train.xe={epochs: 10, batch_size: 16, lr: 2.0e-3, warmup_iters: 0, decay_start_epoch: 100}",
    "train.scst={epochs: 4, batch_size: 24, lr: 5.0e-5, num_samples: 5, baseline: mean_of_others}",
    "train.validation.decoding={method: greedy}",
    "train.checkpoint_every=0",
]


@pytest.mark.parametrize("model", ["san", "ngsan"])
def test_xe_then_scst_beats_shuffled_captions(run, model) -> None:
    cfg = load_config(
        "train", None, train_overrides(run, model, *SETTINGS)
    )  # train.device=cpu; the margins below are CPU numbers
    result = train_captioner(run, cfg)
    d = result.directory
    assert {p.name for p in d.iterdir()} >= {"last.pt", "best.pt", "xe.pt", "log.jsonl", "manifest.json"}
    xe = evaluate_checkpoint(
        d / "xe.pt", run / "features/store", run / "data", "test", out_dir=d / "eval-xe", fast_only=True, device="cpu"
    )
    scst = evaluate_checkpoint(
        d / "last.pt",
        run / "features/store",
        run / "data",
        "test",
        out_dir=d / "eval-scst",
        fast_only=True,
        device="cpu",
    )
    base = shuffled_baseline(run)
    print(
        f"\n{model}: test CIDEr-D shuffled captions {base:.3f}, XE {xe['metrics']['CIDEr']:.3f}, "
        f"SCST {scst['metrics']['CIDEr']:.3f}"
    )
    assert base < 0.5
    assert xe["metrics"]["CIDEr"] > base + 0.5 and xe["metrics"]["CIDEr"] > 2.5 * base
    assert scst["metrics"]["CIDEr"] > xe["metrics"]["CIDEr"] + 0.05
    # the checkpoints describe themselves; the log has train, epoch and val records of both stages
    ck = CaptionerCheckpoint.load(d / "last.pt")
    assert (
        ck.model_name == model
        and ck.progress.stage == "scst"
        and ck.progress.stage_done
        and ck.model_config["d_model"] == 64
    )
    records = [json.loads(line) for line in (d / "log.jsonl").read_text().splitlines()]
    assert {(r["event"], r["stage"]) for r in records if "stage" in r} >= {
        ("train", "xe"),
        ("val", "xe"),
        ("train", "scst"),
        ("val", "scst"),
    }
    # predictions file is in COCO results format with one caption per test image
    preds = json.loads((d / "eval-xe" / "predictions_test.json").read_text())
    assert len(preds) == xe["num_images"] == 50 and all(isinstance(p["image_id"], int) and p["caption"] for p in preds)
    # done: the same config is skipped
    again = train_captioner(run, cfg)
    assert again.skipped and again.summary["best"] == result.summary["best"]
