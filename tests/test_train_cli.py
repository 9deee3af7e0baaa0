"""`cli evaluate --model` and `cli train` on the synthetic world: outputs, agreement with the results-file
mode and pycocoevalcap, and bad input (another model or vocabulary, missing features, NaN loss, no Java)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from train_helpers import make_world_run, train_overrides
from typer.testing import CliRunner

from cli import app
from models.checkpoints import CaptionerCheckpoint
from pipeline.caption_data.prepare import prepare_captions
from pipeline.caption_data.prepared import PreparedCaptions
from pipeline.core.config import load_config
from pipeline.core.regions import RegionRecord
from pipeline.core.stages import run_stage
from pipeline.store import FeatureStore, open_writer
from pipeline.training.api import train_captioner

needs_java = pytest.mark.skipif(
    shutil.which("java") is None, reason="Java is not installed (the PTB tokenizer needs it)"
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("traincli")
    run = make_world_run(root, num_images=120)
    cfg = load_config(
        "train",
        None,
        train_overrides(
            run, "san", "train.stages=[xe]", "train.xe={epochs: 2, batch_size: 16, lr: 2.0e-3, warmup_iters: 0}"
        ),
    )
    result = train_captioner(run, cfg)
    return run, result.directory / "best.pt"


def invoke(*args: str):
    return CliRunner().invoke(app, [*args, "--quiet"])


def error_line(result) -> str:
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit), (
        result.output
    )
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def coco_references(run: Path, split: str, path: Path) -> Path:
    data = PreparedCaptions.load(run / "data")
    refs = data.references()
    images = [data.images[i] for i in data.split_indices(split)]
    anns = [
        {"id": len(images) * k + n, "image_id": img["cocoid"], "caption": c}
        for n, img in enumerate(images)
        for k, c in enumerate(refs[img["key"]])
    ]
    path.write_text(json.dumps({"images": [{"id": img["cocoid"]} for img in images], "annotations": anns}))
    return path


@needs_java
def test_evaluate_model_writes_predictions_and_metrics_equal_to_pycocoevalcap(trained, tmp_path) -> None:
    run, ckpt = trained
    out = tmp_path / "metrics.json"
    res = invoke(
        "evaluate",
        "--model",
        str(ckpt),
        "--store",
        str(run / "features/store"),
        "--data",
        str(run / "data"),
        "--split",
        "test",
        "--metrics",
        "bleu,rouge,cider",
        "--output",
        str(out),
    )
    assert res.exit_code == 0, res.output
    assert "CIDEr" in res.stdout and "Bleu_4" in res.stdout
    metrics = json.loads(out.read_text())
    preds = json.loads((tmp_path / "predictions_test.json").read_text())
    assert metrics["num_images"] == len(preds) == 12 and metrics["decoding"]["beam_size"] == 3
    # the same predictions scored as a results file give the same numbers
    refs = coco_references(run, "test", tmp_path / "captions_test.json")
    again = invoke(
        "evaluate",
        "-p",
        str(tmp_path / "predictions_test.json"),
        "-r",
        str(refs),
        "--metrics",
        "bleu,rouge,cider",
        "--output",
        str(tmp_path / "again.json"),
    )
    assert again.exit_code == 0, again.output
    assert json.loads((tmp_path / "again.json").read_text())["metrics"] == pytest.approx(metrics["metrics"], abs=1e-12)
    # and pycocoevalcap run directly
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    ref_json = json.loads(refs.read_text())
    gts = {
        img["id"]: [{"caption": a["caption"]} for a in ref_json["annotations"] if a["image_id"] == img["id"]]
        for img in ref_json["images"]
    }
    res_ = {p["image_id"]: [{"caption": p["caption"]}] for p in preds}
    tok = PTBTokenizer()
    gts, res_ = tok.tokenize(gts), tok.tokenize(res_)
    cider, _ = Cider().compute_score(gts, res_)
    bleu, _ = Bleu(4).compute_score(gts, res_, verbose=0)
    assert metrics["metrics"]["CIDEr"] == pytest.approx(cider, abs=1e-9)
    assert metrics["metrics"]["Bleu_4"] == pytest.approx(bleu[3], abs=1e-9)


def test_evaluate_without_java_is_one_line(trained) -> None:
    run, ckpt = trained
    res = invoke(
        "evaluate",
        "--model",
        str(ckpt),
        "--store",
        str(run / "features/store"),
        "--data",
        str(run / "data"),
        "--set",
        "evaluate.java=/nonexistent/java",
        "--set",
        "evaluate.java_missing=error",
    )
    assert res.exit_code in (1, 2) and "java" in error_line(res).lower()


def test_checkpoint_of_another_vocabulary_or_model_is_refused(trained, tmp_path) -> None:
    run, ckpt = trained
    cfg = load_config(
        "prepare",
        None,
        [
            f"prepare.karpathy_json={run.parent / 'world/annotations/dataset_coco.json'}",
            "prepare.word_count_threshold=20",
        ],
    )
    other = run_stage(tmp_path, "data", cfg.prepare, prepare_captions).directory
    res = invoke("evaluate", "--model", str(ckpt), "--store", str(run / "features/store"), "--data", str(other))
    assert res.exit_code == 2 and "another vocabulary" in error_line(res)
    sets = train_overrides(run, "ngsan", f"train.init_from={ckpt}", "train.stages=[xe]", "train.xe={epochs: 1}")
    res = invoke("train", "--out", str(tmp_path / "r"), *[a for s in sets for a in ("--set", s)])
    assert res.exit_code == 2 and "holds a 'san' model, not 'ngsan'" in error_line(res)
    sets = train_overrides(
        run, "san", f"train.init_from={ckpt}", "train.stages=[xe]", "train.model_overrides={d_model: 32}"
    )
    res = invoke("train", "--out", str(tmp_path / "r2"), *[a for s in sets for a in ("--set", s)])
    assert res.exit_code == 2 and "another 'san' configuration (differs in: d_model" in error_line(res)


def test_store_missing_images_of_the_split(trained, tmp_path) -> None:
    run, ckpt = trained
    data = PreparedCaptions.load(run / "data")
    full = FeatureStore(run / "features/store")
    with open_writer(tmp_path / "partial", full.identity, feature_dtype="float32") as w:
        for i in data.split_indices("train"):
            rec = full.get(data.images[i]["key"])
            w.add(data.images[i]["key"], RegionRecord(rec["features"], rec["boxes"], rec["image_w"], rec["image_h"]))
    res = invoke("evaluate", "--model", str(ckpt), "--store", str(tmp_path / "partial"), "--data", str(run / "data"))
    assert res.exit_code == 1 and "12 of 12 test images have no features in" in error_line(res)


def test_nan_loss_stops_with_a_message_and_keeps_the_last_good_checkpoint(trained, tmp_path) -> None:
    run, _ = trained
    sets = train_overrides(
        run,
        "san",
        "train.stages=[xe]",
        "train.checkpoint_every=1",
        "train.xe={epochs: 2, batch_size: 16, lr: 1.0e30, warmup_iters: 0}",
    )
    res = invoke("train", "--out", str(tmp_path), *[a for s in sets for a in ("--set", s)])
    line = error_line(res)
    assert res.exit_code == 1 and "loss became nan" in line and "last good checkpoint is kept" in line
    ck = CaptionerCheckpoint.load(tmp_path / "train-san" / "last.pt")
    failed_at = int(line.split("iteration ")[1].split(":")[0])
    assert ck.progress.iteration == failed_at - 1 and all(
        torch.isfinite(v).all() for v in ck.weights.values() if v.is_floating_point()
    )


def test_train_without_store_is_a_usage_error(tmp_path) -> None:
    res = invoke("train", "--out", str(tmp_path))
    assert res.exit_code == 2 and "train.store is not set" in error_line(res)


def test_bf16_autocast_trains_on_cpu(trained, tmp_path) -> None:
    """The AMP path (bf16 autocast, used by default on CUDA) runs and learns; on CPU it is opt-in. This run also
    reads the store through the DataLoader (no preloading)."""
    run, _ = trained
    cfg = load_config(
        "train",
        None,
        train_overrides(
            run,
            "san",
            "train.precision=bf16",
            "train.stages=[xe]",
            "train.preload=none",
            "train.num_workers=0",
            "train.xe={epochs: 2, batch_size: 16, lr: 2.0e-3, warmup_iters: 0}",
        ),
    )
    result = train_captioner(tmp_path, cfg)
    losses = [
        json.loads(x)["loss"]
        for x in (result.directory / "log.jsonl").read_text().splitlines()
        if '"event": "epoch"' in x
    ]
    assert len(losses) == 2 and losses[1] < losses[0] and all(np.isfinite(losses))
