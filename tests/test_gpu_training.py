"""GPU training paths (``pytest -m gpu``; skipped, with the reason, without CUDA).

* one XE and one SCST step of every registered captioner at its paper size on CUDA, under fp32 and bf16:
  finite losses and gradients, the XE step moves the weights; before it, the eval-mode NLL of the batch equals
  the CPU's under fp32 and stays near fp32's under bf16 (tolerances below, each with its reason);
* ``deterministic: true``: two detector runs and two captioner runs on CUDA give bitwise the same weights,
  and a SIGKILL + resume gives bitwise the weights of the uninterrupted run (docs/gpu.md).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import models
from bench.train import bench_vocab, prepare_stage, reference_corpus
from pipeline.core.vocab import Vocab

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.device("cuda")
#: fp32 CUDA vs CPU, the same weights and batch: the same arithmetic summed in another order (blocked GEMMs,
#: tree reductions in softmax over 9,487 words); fp32 rounding is ~1e-7 relative per operation, 1e-4 leaves
#: a wide margin over a few hundred chained operations while a wrong kernel or dtype is far outside it
CPU_RTOL = 1e-4
#: bf16 autocast rounds every matmul input to 8 significant bits (2^-9 ~ 0.2% relative); the token-mean NLL of
#: a freshly initialised model (about ln 9487 = 9.2) averages those errors, 2% bounds them without hiding a
#: broken autocast path (which gives NaN/inf or a loss off by far more)
BF16_RTOL = 2e-2


@pytest.fixture(scope="module")
def scoring() -> tuple:
    return reference_corpus(Vocab(("<pad>", "<bos>", "<eos>", "<unk>")), 200), bench_vocab()


def _finite_grads(model: torch.nn.Module) -> tuple[int, int]:
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    return len(grads), sum(int(not torch.isfinite(g).all()) for g in grads)


def _eval_xe(model: torch.nn.Module, batch: dict, device: torch.device, precision: str) -> float:
    """The token-mean NLL of ``batch`` in eval mode (no dropout, no scheduled sampling, no smoothing): the
    same number on any device up to rounding, since the training-mode losses draw from each device's RNG."""
    from pipeline.core.training import autocast
    from pipeline.training.xe import xe_loss_sum

    model.eval()
    with torch.no_grad(), autocast(device, precision):
        loss, count = xe_loss_sum(model, batch, 0.0, 0.0)
    model.train()
    return float(loss) / float(count)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", models.available_captioners())
def test_one_xe_and_one_scst_step_on_cuda(name, precision, scoring):
    scorer, vocab = scoring
    model, step, batches, _ = prepare_stage(name, "xe", 2, CUDA, precision, scorer, vocab, 1)
    nll = _eval_xe(model, batches[0], CUDA, precision)
    # the same weights and batch elsewhere: fp32 on the CPU (exact math, other order) and, for bf16, fp32 on CUDA
    ref_device, rtol = (torch.device("cpu"), CPU_RTOL) if precision == "fp32" else (CUDA, BF16_RTOL)
    ref_model, _, ref_batches, _ = prepare_stage(name, "xe", 2, ref_device, "fp32", scorer, vocab, 1)
    ref = _eval_xe(ref_model, ref_batches[0], ref_device, "fp32")
    del ref_model
    assert math.isfinite(nll) and abs(nll - ref) <= rtol * abs(ref), (
        f"{name} {precision} on CUDA: NLL {nll} vs fp32 on {ref_device}: {ref}"
    )
    before = [p.detach().clone() for p in model.parameters()]
    loss = float(step(batches[0]))
    assert math.isfinite(loss) and loss > 0
    with_grad, bad = _finite_grads(model)
    assert with_grad > 0 and bad == 0, f"{bad} of {with_grad} gradients not finite"
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters())), (
        "the XE step left the weights unchanged"
    )
    model, step, batches, _ = prepare_stage(name, "scst", 2, CUDA, precision, scorer, vocab, 1)
    loss = float(step(batches[0]))
    with_grad, bad = _finite_grads(model)
    assert math.isfinite(loss) and with_grad > 0 and bad == 0, (loss, with_grad, bad)


# ------------------------------------------------------------------------------------------ deterministic: true
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "BUTD_NO_PROGRESS": "1"}


def _equal_tensors(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if torch.is_tensor(a[k]) and not torch.equal(a[k], b[k])]


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not ready() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    alive = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert alive, "the run ended before it could be killed"


@pytest.fixture(scope="module")
def det_world(tmp_path_factory) -> Path:
    from pipeline.core.config import load_config
    from pipeline.world.generate import generate_world

    out = tmp_path_factory.mktemp("world")
    generate_world(
        out,
        load_config(
            "world",
            None,
            ["world.num_images=16", "world.image_size=[64, 96]", "world.max_objects=3", "world.num_workers=1"],
        ).world,
    )
    return out


def _detector_cli(out: Path, world: Path) -> list[str]:
    """train-detector writing the stage ``out`` (RUN/detector: --out is the run directory)."""
    return [
        sys.executable,
        str(ROOT / "cli.py"),
        "train-detector",
        "-c",
        str(ROOT / "configs" / "detector" / "tiny.yaml"),
        "--world",
        str(world),
        "--out",
        str(out.parent),
        "-q",
        "--set",
        "detector_train.max_iter=40",
        "--set",
        "detector_train.steps=[30]",
        "--set",
        "detector_train.checkpoint_every=2",
        "--set",
        "data.eval_annotations=null",
        "--set",
        "detector_train.device=cuda",
        "--set",
        "detector_train.deterministic=true",
    ]


def test_detector_deterministic_on_cuda_two_runs_and_sigkill_resume_bitwise(det_world, tmp_path):
    from pipeline.core.checkpoint import load_checkpoint

    for name in ("a", "b"):
        done = subprocess.run(
            _detector_cli(tmp_path / name / "detector", det_world),
            env=ENV,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    weights = {
        n: torch.load(tmp_path / n / "detector" / "detector.pth", map_location="cpu", weights_only=True)["model"]
        for n in ("a", "b")
    }
    assert _equal_tensors(weights["a"], weights["b"]) == [], "two deterministic CUDA runs differ"
    killed = tmp_path / "killed" / "detector"
    ckpt = killed / "checkpoints" / "last.pt"
    proc = subprocess.Popen(
        _detector_cli(killed, det_world), env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    _kill_when(proc, ckpt.exists)
    at = int(load_checkpoint(ckpt)["iteration"])
    assert 0 < at < 40 and not (killed / "detector.pth").exists()
    done = subprocess.run(
        _detector_cli(killed, det_world), env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = torch.load(killed / "detector.pth", map_location="cpu", weights_only=True)["model"]
    assert _equal_tensors(weights["a"], resumed) == [], (
        f"resumed at iteration {at}: weights differ from the uninterrupted run"
    )


@pytest.fixture(scope="module")
def caption_run(tmp_path_factory) -> Path:
    from train_helpers import make_world_run

    return make_world_run(tmp_path_factory.mktemp("detcap"), num_images=160)


def _train_cli(run: Path, out: Path) -> list[str]:
    from train_helpers import train_overrides

    sets = [
        s
        for s in train_overrides(
            run,
            "san",
            "train.checkpoint_every=3",
            "train.validation.decoding={method: greedy}",
            "train.model_overrides={d_model: 64, num_heads: 4, d_ff: 128, num_layers: 1, dropout: 0.1, "
            "embed_dropout: 0.1}",
            "train.xe={epochs: 2, batch_size: 8, lr: 1.0e-3, warmup_iters: 0}",
            "train.scst={epochs: 1, batch_size: 16, lr: 1.0e-4, num_samples: 3}",
        )
        if s != "train.device=cpu"
    ] + ["train.device=cuda", "train.deterministic=true", "train.preload=cuda"]
    return [sys.executable, str(ROOT / "cli.py"), "train", "--out", str(out), *[a for s in sets for a in ("--set", s)]]


def _steps(stage_dir: Path) -> int:
    log = stage_dir / "log.jsonl"
    if not log.exists():
        return 0
    recs = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    return max((r["iteration"] for r in recs if r.get("event") == "train" and r.get("stage") == "xe"), default=0)


def test_captioner_deterministic_on_cuda_two_runs_and_sigkill_resume_bitwise(caption_run, tmp_path):
    from models.checkpoints import CaptionerCheckpoint

    for name in ("a", "b"):
        done = subprocess.run(
            _train_cli(caption_run, tmp_path / name), env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
    wa = CaptionerCheckpoint.load(tmp_path / "a" / "train-san" / "last.pt").weights
    wb = CaptionerCheckpoint.load(tmp_path / "b" / "train-san" / "last.pt").weights
    assert _equal_tensors(wa, wb) == [], "two deterministic CUDA runs differ"
    stage_dir = tmp_path / "k" / "train-san"
    proc = subprocess.Popen(
        _train_cli(caption_run, tmp_path / "k"), env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    _kill_when(
        proc, lambda: _steps(stage_dir) >= 26
    )  # mid XE epoch 1 (20 batches per epoch, a checkpoint every 3 steps)
    ck = CaptionerCheckpoint.load(stage_dir / "last.pt")
    assert ck.progress.stage == "xe" and not (stage_dir / "manifest.json").exists()
    done = subprocess.run(
        _train_cli(caption_run, tmp_path / "k"), env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("last.pt", "best.pt", "xe.pt"):
        a = CaptionerCheckpoint.load(tmp_path / "a" / "train-san" / name).weights
        b = CaptionerCheckpoint.load(stage_dir / name).weights
        assert _equal_tensors(a, b) == [], f"{name}: the resumed run differs from the uninterrupted one"
