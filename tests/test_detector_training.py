"""Detector training: input validation, targets, schedule, freezing, a real tiny training run whose weights
`cli extract` loads, evaluation scoring, and bitwise resume after SIGKILL and after a SIGTERM stop (CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.models.detection._utils import BalancedPositiveNegativeSampler
from typer.testing import CliRunner

from cli import app
from extractors import box_coding
from extractors.bottom_up import BottomUpDetector
from extractors.training.data import convert_box, load_instances
from extractors.training.evaluate import match_objects
from extractors.training.optim import lr_at, set_trainable
from extractors.training.stage import load_detector_config, train_detector
from extractors.training.targets import SamplingConfig, anchor_targets, sample_rois
from extractors.weights import describe, load_detector
from pipeline.core.checkpoint import load_checkpoint
from pipeline.core.errors import UsageError
from pipeline.world.generate import generate_world

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "detector" / "tiny.yaml"


@pytest.fixture(scope="module")
def tiny_world(tmp_path_factory) -> Path:
    from pipeline.core.config import load_config

    out = tmp_path_factory.mktemp("world")
    cfg = load_config(
        "world",
        None,
        ["world.num_images=16", "world.image_size=[64, 96]", "world.max_objects=3", "world.num_workers=1"],
    ).world
    generate_world(out, cfg)
    return out


def _tiny_cfg(world: Path, *extra: str):
    return load_detector_config(
        TINY,
        [
            f"data.train_annotations={world / 'annotations' / 'instances_train.json'}",
            f"data.train_images={world / 'images'}",
            f"data.eval_annotations={world / 'annotations' / 'instances_test.json'}",
            f"data.eval_images={world / 'images'}",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def tiny_trained(tiny_world, tmp_path_factory):
    stage = tmp_path_factory.mktemp("det")
    outputs, summary = train_detector(
        stage, _tiny_cfg(tiny_world, "detector_train.max_iter=16", "detector_train.steps=[14]")
    )
    return stage, outputs, summary


# ---------------------------------------------------------------------------------------------------------
def _write_coco(tmp: Path) -> Path:
    img_dir = tmp / "imgs"
    img_dir.mkdir()
    for name in ("a.png", "b.png", "c.png"):
        Image.new("RGB", (100, 80), (120, 120, 120)).save(img_dir / name)
    data = {
        "images": [
            {"id": 1, "file_name": "a.png", "width": 100, "height": 80},
            {"id": 2, "file_name": "b.png", "width": 100, "height": 80},  # only bad boxes -> empty
            {"id": 3, "file_name": "c.png", "width": 100, "height": 80},  # no annotation at all -> empty
            {"id": 4, "file_name": "missing.png", "width": 100, "height": 80},
        ],
        "categories": [{"id": 5, "name": "cat"}, {"id": 9, "name": "dog"}],
        "attributes": [{"id": 1, "name": "red", "type": "colour"}, {"id": 2, "name": "big", "type": "size"}],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 9, "bbox": [10, 10, 20, 30], "attribute_ids": [1, 2]},
            {
                "id": 2,
                "image_id": 1,
                "category_id": 5,
                "bbox": [-5, 70, 20, 30],
                "attribute_ids": [7],
            },  # clipped, bad attr
            {"id": 3, "image_id": 2, "category_id": 5, "bbox": [200, 10, 20, 20]},  # outside the image
            {"id": 4, "image_id": 2, "category_id": 5, "bbox": [10, 10, 0, 20]},  # degenerate
            {"id": 5, "image_id": 2, "category_id": 42, "bbox": [10, 10, 20, 20]},  # unknown category
            {"id": 6, "image_id": 2, "category_id": 5, "bbox": [10, 10, 20, 20], "iscrowd": 1},
            {"id": 7, "image_id": 77, "category_id": 5, "bbox": [10, 10, 20, 20]},  # unknown image
            {"id": 8, "image_id": 4, "category_id": 5, "bbox": [10, 10, 20, 20]},
        ],
    }
    path = tmp / "inst.json"
    path.write_text(json.dumps(data))
    return path


def test_bad_annotations_are_skipped_with_counts(tmp_path):
    ds = load_instances(_write_coco(tmp_path), tmp_path / "imgs")
    assert [r.image_id for r in ds.records] == [1]
    assert dict(ds.counts) == {
        "box_clipped": 1,
        "unknown_attribute": 1,
        "box_outside_image": 1,
        "degenerate_box": 1,
        "unknown_category": 1,
        "crowd": 1,
        "unknown_image": 1,
        "empty_image": 2,
        "missing_file": 1,
    }
    rec = ds.records[0]
    assert ds.class_names == ["cat", "dog"] and ds.num_classes == 3 and ds.num_attributes == 3
    assert rec.labels.tolist() == [2, 1]  # category 9 = 'dog' = index 2 (sorted by id, background 0)
    np.testing.assert_allclose(rec.boxes, [[10, 10, 29, 39], [0, 70, 19, 79]])  # x2 = x1 + w - 1, clipped to H-1
    assert rec.attributes[0, :3].tolist() == [1, 2, -1] and rec.attributes[1, :1].tolist() == [-1]


def test_bad_files_fail_with_one_clear_message(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    with pytest.raises(Exception, match="x.json"):
        load_instances(bad)
    bad.write_text(json.dumps({"images": [], "annotations": []}))
    with pytest.raises(UsageError, match="categories"):
        load_instances(bad)
    res = CliRunner().invoke(
        app,
        [
            "train-detector",
            "-c",
            str(TINY),
            "--out",
            str(tmp_path / "o"),
            "--set",
            f"data.train_annotations={tmp_path / 'nope.json'}",
        ],
    )
    assert res.exit_code == 2 and "nope.json" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["train-detector", "-c", str(TINY), "--set", "detector_train.lr=1"])
    assert res.exit_code == 2 and "detector_train.lr" in res.output


def test_convert_box_follows_py_faster_rcnn():
    box, reason = convert_box([10.5, 0, 5, 4], 100, 80)
    np.testing.assert_allclose(box, [10.5, 0, 14.5, 3]) and reason is None
    assert convert_box([99, 0, 10, 10], 100, 80)[1] == "box_clipped"
    assert convert_box([0, 0, float("nan"), 3], 100, 80) == (None, "degenerate_box")


# ---------------------------------------------------------------------------------------------------------
def test_anchor_targets_thresholds_border_and_best_anchor():
    torch.manual_seed(0)
    anchors = torch.tensor(
        [[0, 0, 15, 15], [2, 2, 17, 17], [20, 20, 35, 35], [-5, 0, 10, 15], [40, 40, 55, 55], [0, 20, 15, 35]],
        dtype=torch.float32,
    )
    gt = torch.tensor([[0, 0, 15, 15], [21, 21, 30, 30]], dtype=torch.float32)
    cfg = SamplingConfig(rpn_batch_size=64)
    labels, deltas = anchor_targets(anchors, gt, (60, 60), cfg, BalancedPositiveNegativeSampler(64, 0.5))
    # anchor 0: IoU 1; anchor 1: IoU 0.62 -> ignored (between 0.3 and 0.7); anchor 2: best anchor of gt 1 (IoU 0.39);
    # anchor 3 leaves the image -> ignored; anchors 4, 5: IoU 0 -> negative
    assert labels.tolist() == [1, -1, 1, -1, 0, 0]
    dec = box_coding.decode(deltas[2:3], anchors[2:3], legacy=True)
    np.testing.assert_allclose(dec.numpy(), (gt[1:2] + torch.tensor([0, 0, 1, 1])).numpy(), atol=1e-4)  # Caffe +1 quirk


def test_rpn_sampling_keeps_the_batch_size_and_fraction():
    torch.manual_seed(0)
    xs = torch.arange(0, 200, 4, dtype=torch.float32)
    anchors = torch.stack([xs, xs * 0, xs + 15, xs * 0 + 15], 1).repeat(4, 1)
    gt = torch.tensor([[0, 0, 15, 15], [100, 0, 115, 15]], dtype=torch.float32)
    labels, _ = anchor_targets(
        anchors, gt, (20, 400), SamplingConfig(rpn_batch_size=16), BalancedPositiveNegativeSampler(16, 0.5)
    )
    assert int((labels >= 0).sum()) == 16 and int((labels == 1).sum()) <= 8


def test_roi_sampling_fg_first_with_normalised_targets():
    torch.manual_seed(0)
    gt = torch.tensor([[10, 10, 49, 49]], dtype=torch.float32)
    props = torch.tensor([[12, 11, 50, 47], [60, 60, 80, 80], [0, 0, 5, 5], [11, 10, 49, 52]], dtype=torch.float32)
    cfg = SamplingConfig(roi_batch_size=8)
    s = sample_rois(
        props, gt, torch.tensor([3]), torch.tensor([[4, 9, -1]]), cfg, BalancedPositiveNegativeSampler(8, 0.5)
    )
    assert s.num_fg == 3 and s.labels.tolist()[:3] == [3, 3, 3] and s.labels.tolist()[3:] == [0, 0]
    assert s.attributes[:3].tolist() == [[4, 9, -1]] * 3 and (s.attributes[3:] == -1).all()
    dec = box_coding.decode(s.deltas[:3], s.rois[:3], cfg.box_weights, legacy=True)
    np.testing.assert_allclose(dec.numpy(), (gt + torch.tensor([0, 0, 1, 1])).expand(3, 4).numpy(), atol=1e-3)


def test_warmup_and_steps():
    kw = dict(base_lr=0.02, warmup_iters=100, warmup_factor=0.001, steps=[300, 400], gamma=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.02 * 0.001)
    assert lr_at(50, **kw) == pytest.approx(0.02 * (0.001 * 0.5 + 0.5))
    assert lr_at(100, **kw) == pytest.approx(0.02)
    assert lr_at(300, **kw) == pytest.approx(0.002) and lr_at(450, **kw) == pytest.approx(0.0002)


def test_freeze_at_three_freezes_stem_res2_res3():
    from extractors.spec import BottomUpSpec

    det = BottomUpDetector(
        BottomUpSpec(
            stage_blocks=(1, 1, 1),
            res5_blocks=1,
            res2_bottleneck=4,
            stem_channels=8,
            num_classes=5,
            num_attributes=3,
            attr_embed_dim=4,
            attr_hidden=8,
            rpn_channels=8,
        )
    )
    set_trainable(det, 3)
    trainable = {n for n, p in det.named_parameters() if p.requires_grad}
    assert not any(n.startswith(("backbone.stem.", "backbone.res2.", "backbone.res3.")) for n in trainable)
    assert "backbone.res4.0.conv1.weight" in trainable and "roi_heads.box_predictor.cls_embed.weight" in trainable
    assert all(not isinstance(b, torch.nn.Parameter) for n, b in det.named_buffers() if ".norm." in n)  # BN frozen


def test_match_objects_is_best_iou_per_object():
    gt = torch.tensor([[0, 0, 9, 9], [20, 20, 39, 39], [100, 100, 110, 110]], dtype=torch.float32)
    det = torch.tensor([[21, 21, 40, 40], [0, 0, 9, 14], [0, 0, 9, 10]], dtype=torch.float32)
    hit, best = match_objects(gt, det, 0.5)
    assert hit.tolist() == [True, True, False] and best.tolist()[:2] == [2, 0]


# ---------------------------------------------------------------------------------------------------------
def test_tiny_training_learns_and_exports_an_extractable_detector(tiny_world, tiny_trained, tmp_path):
    stage, outputs, summary = tiny_trained
    weights = stage / outputs["weights"]
    info = describe(weights)
    assert (
        info["layout"] == "butd"
        and info["classes"] == 8
        and info["attributes"] == 11
        and info["input_scale"] == "80/128"
    )
    ck = load_checkpoint(stage / outputs["checkpoint"], required=("model", "iteration"))
    assert ck["iteration"] == 16
    # the file stores bbox_pred un-normalised (x stds), everything else as trained
    det, _ = load_detector(weights)
    w_file = det.state_dict()["roi_heads.box_predictor.bbox_pred.weight"].view(-1, 4, det.spec.feature_dim)
    w_ck = ck["model"]["roi_heads.box_predictor.bbox_pred.weight"].view(-1, 4, det.spec.feature_dim)
    torch.testing.assert_close(w_file, w_ck * torch.tensor([0.1, 0.1, 0.2, 0.2]).view(1, 4, 1))
    torch.testing.assert_close(
        det.state_dict()["backbone.res3.0.conv2.weight"], ck["model"]["backbone.res3.0.conv2.weight"]
    )
    assert summary["losses"]["cls"] < 2.0 and set(summary["losses"]) == {"rpn_cls", "rpn_box", "cls", "box", "attr"}
    ev = summary["eval"]
    assert (
        ev["images"] == 2
        and 0.0 <= ev["recall"] <= 1.0
        and ev["boxes_per_image"] >= 10
        and ev["attribute_group"] == "colour"
    )
    # cli extract loads it like a public checkpoint, at its own trained scale
    store = tmp_path / "store"
    res = CliRunner().invoke(
        app,
        [
            "extract",
            str(tiny_world / "images"),
            "--weights",
            str(weights),
            "--store",
            str(store),
            "--workers",
            "0",
            "--limit",
            "3",
        ],
    )
    assert res.exit_code == 0, res.output
    from pipeline.store import FeatureStore

    with FeatureStore(store) as fs:
        assert len(fs) == 3
        key = sorted(fs.keys())[0]
        rec = fs[key]
        assert rec["features"].shape[1] == det.spec.feature_dim and rec["features"].shape[0] >= 10
        assert int(rec["class_ids"].max()) < 7
    res = CliRunner().invoke(
        app,
        [
            "eval-detector",
            str(weights),
            "--annotations",
            str(tiny_world / "annotations" / "instances_test.json"),
            "--images",
            str(tiny_world / "images"),
            "--json",
        ],
    )
    assert res.exit_code == 0 and json.loads(res.stdout)["recall"] == ev["recall"]


def test_training_loss_decreases(tiny_world, tmp_path):
    cfg = _tiny_cfg(
        tiny_world,
        "detector_train.max_iter=30",
        "detector_train.steps=[100]",
        "detector_train.log_every=10",
        "data.eval_annotations=null",
    )
    from extractors.training.loop import train

    first = train(tmp_path / "a", cfg.with_overrides(["detector_train.max_iter=10"]))
    last = train(tmp_path / "b", cfg)
    assert sum(last.losses.values()) < 0.8 * sum(first.losses.values())


# ---------------------------------------------------------------------------------------------------------
def _cli(out: Path, world: Path, *extra: str) -> list[str]:
    """train-detector writing the stage ``out`` (RUN/detector: --out is the run directory)."""
    return [
        sys.executable,
        str(REPO / "cli.py"),
        "train-detector",
        "-c",
        str(TINY),
        "--world",
        str(world),
        "--out",
        str(out.parent),
        "-q",
        "--set",
        "detector_train.max_iter=24",
        "--set",
        "detector_train.steps=[20]",
        "--set",
        "detector_train.checkpoint_every=2",
        "--set",
        "data.eval_annotations=null",
        "--set",
        "detector_train.device=cpu",
        *extra,
    ]  # the CPU claim: bitwise on any machine


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def test_sigkill_resume_is_bitwise_identical(tiny_world, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BUTD_NO_PROGRESS": "1"}
    subprocess.run(
        _cli(tmp_path / "ref" / "detector", tiny_world), check=True, env=env, cwd=REPO, capture_output=True, timeout=300
    )
    killed = tmp_path / "killed" / "detector"
    ckpt = killed / "checkpoints" / "last.pt"
    proc = subprocess.Popen(
        _cli(killed, tiny_world), env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 120
    while not ckpt.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    alive = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert alive, "the run ended before it could be killed"
    at = int(load_checkpoint(ckpt)["iteration"])
    assert 0 < at < 24 and not (killed / "detector.pth").exists() and (killed / "running.json").exists()
    subprocess.run(_cli(killed, tiny_world), check=True, env=env, cwd=REPO, capture_output=True, timeout=300)
    a, b = _weights(tmp_path / "ref" / "detector" / "detector.pth"), _weights(killed / "detector.pth")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run"
    ca, cb = load_checkpoint(tmp_path / "ref" / "detector" / "checkpoints" / "last.pt"), load_checkpoint(ckpt)
    sa, sb = ca["optimizer"]["state"], cb["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(
        torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i]
    )  # AdamW moments too


def test_sigterm_saves_at_the_next_iteration_and_resumes_to_the_same_weights(tiny_world, tmp_path):
    """SIGTERM mid-run: the trainer saves at the next iteration boundary (the only save before the end here),
    exits 130 with one line, and the rerun ends with bitwise the same weights and optimizer state as an
    uninterrupted run (CPU, one thread)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BUTD_NO_PROGRESS": "1", "COLUMNS": "200"}
    extra = (
        "--set",
        "detector_train.max_iter=14",
        "--set",
        "detector_train.steps=[12]",
        "--set",
        "detector_train.checkpoint_every=1000",
        "--set",
        "detector_train.log_every=1",
    )
    subprocess.run(
        _cli(tmp_path / "ref" / "detector", tiny_world, *extra),
        check=True,
        env=env,
        cwd=REPO,
        capture_output=True,
        timeout=300,
    )
    stopped = tmp_path / "stopped" / "detector"
    ckpt = stopped / "checkpoints" / "last.pt"
    cmd = [c for c in _cli(stopped, tiny_world, *extra) if c != "-q"]  # INFO logs on stderr: "iter N/14 ..."
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # read until the third iteration is logged
        seen.append(line)
        if "iter 3/14" in line:
            break
    alive = proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=120)[1]
    stderr = "".join(seen) + rest
    assert alive, "the run ended before it could be stopped: " + stderr[-2000:]
    assert proc.returncode == 130, stderr[-2000:]
    assert (
        "Traceback" not in stderr and "received SIGTERM" in stderr and "run the same command again to resume" in stderr
    )
    at = int(load_checkpoint(ckpt)["iteration"])
    assert 3 <= at < 14 and f"iteration {at} of 14" in stderr  # checkpoint_every=1000: this save is the signal's
    assert not (stopped / "detector.pth").exists() and (stopped / "running.json").exists()
    subprocess.run(_cli(stopped, tiny_world, *extra), check=True, env=env, cwd=REPO, capture_output=True, timeout=300)
    assert json.loads((stopped / "manifest.json").read_text())["summary"]["resumed_from"] == at
    a, b = _weights(tmp_path / "ref" / "detector" / "detector.pth"), _weights(stopped / "detector.pth")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (
        "resumed weights differ from the uninterrupted run"
    )
    sa, sb = (
        load_checkpoint(p)["optimizer"]["state"]
        for p in (tmp_path / "ref" / "detector" / "checkpoints" / "last.pt", ckpt)
    )
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_ddp_two_processes_gloo(tiny_world, tmp_path):
    """torchrun with 2 CPU processes (gloo): trains, rank 0 writes the stage, the checkpoint holds both RNG states."""
    out = tmp_path / "ddp" / "detector"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(REPO / "cli.py"),
        "train-detector",
        "-c",
        str(TINY),
        "--world",
        str(tiny_world),
        "--out",
        str(out.parent),
        "-q",
        "--set",
        "detector_train.max_iter=6",
        "--set",
        "detector_train.steps=[5]",
        "--set",
        "detector_train.images_per_batch=1",
        "--set",
        "data.eval_annotations=null",
        "--set",
        "detector_train.device=cpu",
    ]  # gloo on CPU: two processes on any machine, whatever its GPUs
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BUTD_NO_PROGRESS": "1"}
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ck = load_checkpoint(out / "checkpoints" / "last.pt")
    assert ck["iteration"] == 6 and len(ck["rng"]) == 2
    assert not torch.equal(ck["rng"][0]["torch"], ck["rng"][1]["torch"])  # each process samples its own anchors/RoIs
    assert json.loads((out / "manifest.json").read_text())["summary"]["iterations"] == 6
    assert describe(out / "detector.pth")["layout"] == "butd"


@pytest.mark.parametrize("cmd", ["train-detector", "eval-detector"])
def test_commands_have_help_with_examples(cmd):
    res = CliRunner().invoke(app, [cmd, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "Example" in res.output and "butd-caption" in res.output


def _train_one_rank(rank: int, world: str, out: str, port: int, report: str) -> None:
    """One torchrun-like process (spawned): join a 2-process gloo group through the environment, train, and
    write whether the process group is still alive once ``train`` has returned."""
    import torch.distributed as dist

    from extractors.training.loop import train

    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "BUTD_NO_PROGRESS": "1",
        }
    )
    torch.set_num_threads(1)
    cfg = _tiny_cfg(
        Path(world),
        "detector_train.max_iter=2",
        "detector_train.steps=[1]",
        "detector_train.images_per_batch=1",
        "data.eval_annotations=null",
        "detector_train.device=cpu",
    )
    result = train(Path(out), cfg)
    Path(report + f".{rank}").write_text(
        json.dumps({"iterations": result.iterations, "group_alive": dist.is_initialized()})
    )


def test_every_rank_leaves_the_process_group_when_training_returns(tiny_world, tmp_path):
    """The detector trainer destroys its gloo process group before returning, on every rank: a group left alive
    until interpreter exit can abort a process whose run succeeded (SIGABRT, seen once in CI as a torchrun failure)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = str(tmp_path / "report")
    mp.start_processes(
        _train_one_rank, args=(str(tiny_world), str(tmp_path / "ddp"), port, report), nprocs=2, start_method="spawn"
    )
    for rank in (0, 1):
        seen = json.loads(Path(f"{report}.{rank}").read_text())
        assert seen == {"iterations": 2, "group_alive": False}, (rank, seen)
