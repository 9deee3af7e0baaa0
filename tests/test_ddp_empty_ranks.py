"""Two gloo processes where one rank has nothing to train on: every rank must take the same collectives (before
the fixes, the empty rank returned early or raised alone and the other one waited in an all-reduce until gloo's
timeout)."""

from __future__ import annotations

import datetime
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.core.distributed import DistContext

TIMEOUT = datetime.timedelta(seconds=20)  # a rank left waiting raises after this instead of hanging the suite


def _join(rank: int, init: Path) -> DistContext:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2, timeout=TIMEOUT)
    return DistContext(rank, 2, rank, torch.device("cpu"))


class _TinyDetector(torch.nn.Module):
    """Stands in for DetectorForTraining: ``(images, sizes, records) -> {loss name: loss}``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 2, 3)

    def forward(self, images, sizes, records):
        return {"loss_a": self.conv(images).square().mean()}


def _detector_rank(rank: int, init: Path, out: Path) -> None:
    from extractors.training.loop import DetectorTrainer

    ctx = _join(rank, init)
    torch.manual_seed(0)
    net = torch.nn.parallel.DistributedDataParallel(_TinyDetector())
    cfg = types.SimpleNamespace(
        detector_train=types.SimpleNamespace(
            base_lr=0.1, warmup_iters=0, warmup_factor=1.0, gamma=0.1, clip_grad_norm=0.0
        )
    )
    me = types.SimpleNamespace(
        cfg=cfg, ctx=ctx, precision="fp32", scaler=None, steps=[], optimizer=torch.optim.SGD(net.parameters(), lr=0.1)
    )
    image = lambda: types.SimpleNamespace(blob=torch.randn(3, 8, 8))  # noqa: E731 (a TrainImage's blob)
    images = [] if rank == 1 else [image()]  # rank 1: every image of the batch failed to decode
    losses = []
    for it in range(2):
        batch = {"images": images if it == 0 else [image()], "iteration": it}
        losses.append(DetectorTrainer._step(me, net, batch, it))
    (out / f"det{rank}").write_text(repr([sorted(x) for x in losses]))
    dist.destroy_process_group()


def _encoder_rank(rank: int, init: Path, out: Path, run: Path, extra: list[str]) -> None:
    from pipeline.embedding.train import EncoderTrainer
    from tests.test_store_workers import _encoder_cfg

    ctx = _join(rank, init)
    summary = EncoderTrainer(out / "enc", _encoder_cfg(run, *extra).sentence_encoder, ctx).run()
    (out / f"enc{rank}").write_text(str(summary["global_steps"]))
    dist.destroy_process_group()


def _both(rank: int, tmp: Path, run: Path, extra: list[str]) -> None:
    """One pair of processes for both cases (process start-up is most of the time)."""
    _detector_rank(rank, tmp / "init_det", tmp)
    _encoder_rank(rank, tmp / "init_enc", tmp, run, extra)


def test_a_rank_with_nothing_to_train_on_takes_the_same_collectives(tmp_path) -> None:
    """Detector training: rank 1's images all failed to decode; encoder: the last global batch has one row."""
    from pipeline.embedding.train import EncoderTrainer
    from tests.test_store_workers import _encoder_cfg
    from tests.train_helpers import make_world_run

    run = make_world_run(tmp_path / "world", num_images=30)
    n = len(EncoderTrainer(tmp_path / "probe", _encoder_cfg(run).sentence_encoder, DistContext()).train_split.positions)
    extra = [
        f"sentence_encoder.batch_size={n - 1}",
        "sentence_encoder.validation.max_images=4",
    ]  # the last batch has 1 row
    mp.spawn(_both, args=(tmp_path, run, extra), nprocs=2, join=True)
    # detector iteration 0: every rank skipped (one had no image); iteration 1: both trained
    assert (tmp_path / "det0").read_text() == (tmp_path / "det1").read_text() == "[[], ['loss_a']]"
    # encoder: 2 batches, the second (1 row) skipped on both ranks together
    assert (tmp_path / "enc0").read_text() == (tmp_path / "enc1").read_text() == "2"
