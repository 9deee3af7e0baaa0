"""The one training loop (pipeline/core/training/loop.py): the captioner, sentence-encoder and detector trainers run
their steps under the same hooks in the same order; the best-checkpoint selection takes another metric; the typed
encoder and detector checkpoints read the dict layout their trainers write, and write it back unchanged."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from extractors.training.checkpoint import DetectorCheckpoint
from extractors.training.loop import DetectorTrainer
from extractors.training.stage import load_detector_config
from pipeline.core.checkpoint import load_checkpoint, save_checkpoint
from pipeline.core.config import load_config
from pipeline.core.distributed import DistContext
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.training.loop import BestCheckpoint, HookBase, TrainLoop
from pipeline.core.training.resume import training_state
from pipeline.embedding.checkpoint import read_encoder_checkpoint
from pipeline.embedding.train import EncoderTrainer
from pipeline.training.batches import epoch_batches
from pipeline.training.engine import Trainer
from pipeline.world.generate import generate_world
from tests.train_helpers import make_world_run, train_overrides

REPO = Path(__file__).resolve().parent.parent
ENC = "{objective: cap2img, word_dim: 16, hidden_size: 24, attn_hidden: 12, attn_rows: 3, image_head_hidden: 32}"


class Recorder(HookBase):
    """Records every hook event it sees, in order."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def before_train(self) -> None:
        self.events.append("before_train")

    def before_step(self) -> None:
        self.events.append("before_step")

    def after_step(self) -> None:
        self.events.append("after_step")

    def after_epoch(self) -> None:
        self.events.append("after_epoch")

    def after_train(self) -> None:
        self.events.append("after_train")


def expected(steps_per_epoch: list[int], epochs: bool = True) -> list[str]:
    body: list[str] = []
    for n in steps_per_epoch:
        body += ["before_step", "after_step"] * n + (["after_epoch"] if epochs else [])
    return ["before_train", *body, "after_train"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    torch.set_num_threads(1)
    return make_world_run(tmp_path_factory.mktemp("loop"), num_images=24)


def test_the_captioner_trainer_runs_its_steps_under_the_hooks(run, tmp_path) -> None:
    cfg = load_config(
        "train", None, train_overrides(run, "san", "train.stages=[xe]", "train.xe={epochs: 2, batch_size: 8}")
    )
    (tmp_path / "cap").mkdir()  # the stage directory (made by the stage runner)
    t = Trainer(tmp_path / "cap", cfg.train, DistContext())
    rec = Recorder()
    t.register_hooks([rec])
    summary = t.run()
    per_epoch = [
        len(epoch_batches(t.train_set, 8, int(cfg.train.seed), e, t.ctx, str(cfg.train.batching))) for e in range(2)
    ]
    assert rec.events == expected(per_epoch)
    assert summary["global_steps"] == sum(per_epoch) > 2
    assert (t.dir / "best.pt").is_file() and (t.dir / "last.pt").is_file()


def test_the_encoder_trainer_runs_its_steps_under_the_hooks(run, tmp_path) -> None:
    cfg = load_config(
        "embed",
        None,
        [
            f"sentence_encoder.model_overrides={ENC}",
            f"sentence_encoder.store={run / 'features/store'}",
            f"sentence_encoder.data={run / 'data'}",
            "sentence_encoder.device=cpu",
            "sentence_encoder.batch_size=8",
            "sentence_encoder.epochs=2",
        ],
    ).sentence_encoder
    t = EncoderTrainer(tmp_path / "enc", cfg, DistContext())
    rec = Recorder()
    t.register_hooks([rec])
    summary = t.run()
    per_epoch = [math.ceil(len(t.train_split.positions) / 8)] * 2
    assert rec.events == expected(per_epoch)
    assert summary["global_steps"] == sum(per_epoch) > 2
    best = read_encoder_checkpoint(t.dir / "best.pt")
    assert best.kind == "weights" and best.progress.best == summary["best"]


def test_the_detector_trainer_runs_its_steps_under_the_hooks(tmp_path_factory, tmp_path) -> None:
    world = tmp_path_factory.mktemp("detworld")
    generate_world(
        world,
        load_config(
            "world",
            None,
            ["world.num_images=8", "world.image_size=[64, 96]", "world.max_objects=3", "world.num_workers=1"],
        ).world,
    )
    cfg = load_detector_config(
        REPO / "configs" / "detector" / "tiny.yaml",
        [
            f"data.train_annotations={world / 'annotations' / 'instances_train.json'}",
            f"data.train_images={world / 'images'}",
            "data.eval_annotations=null",
            "detector_train.max_iter=3",
            "detector_train.steps=[2]",
            "detector_train.device=cpu",
        ],
    )
    t = DetectorTrainer(tmp_path / "det", cfg, DistContext())
    rec = Recorder()
    t.register_hooks([rec])
    result = t.run()
    assert rec.events == expected([3], epochs=False)
    assert result.iterations == 3 and result.weights.is_file()
    assert DetectorCheckpoint.load(t.checkpoint).iteration == 3


# -- the loop itself -----------------------------------------------------------------------------------------


class _Scores(TrainLoop):
    """Three one-step epochs whose validation scores are given; records where best.pt was saved."""

    def __init__(self, scores: list[dict[str, float]], metric: str, lower: bool = False) -> None:
        super().__init__()
        self.best: dict = {}
        self.saved: list[int] = []
        self.epoch = 0
        self._scores = scores
        self.selection = BestCheckpoint(
            metric, lambda: self, lambda: self.saved.append(self.epoch), lambda: {"epoch": self.epoch}, None, lower
        )
        self.register_hooks([self.selection])

    def batches(self):
        for self.epoch in range(len(self._scores)):
            yield self.epoch
            self.scores = self._scores[self.epoch]
            self.end_epoch()

    def run_step(self, batch):
        return {"loss": float(batch)}


def test_best_checkpoint_follows_the_metric_it_is_given() -> None:
    scores = [{"CIDEr": 0.5, "relations": 0.9}, {"CIDEr": 0.7, "relations": 0.4}, {"CIDEr": 0.6, "relations": 0.95}]
    by_cider = _Scores(scores, "CIDEr")
    by_cider.train()
    assert by_cider.saved == [0, 1] and by_cider.best == {"metric": "CIDEr", "value": 0.7, "epoch": 1}
    by_relations = _Scores(scores, "relations")
    by_relations.train()
    assert by_relations.saved == [0, 2] and by_relations.best["value"] == 0.95
    lowest = _Scores(scores, "relations", lower=True)
    lowest.train()
    assert lowest.saved == [0, 1] and lowest.best["value"] == 0.4
    with pytest.raises(UsageError, match="'SPICE' is not computed"):
        _Scores(scores, "SPICE").train()


def test_after_train_runs_when_a_step_raises() -> None:
    class Failing(TrainLoop):
        def batches(self):
            yield from range(3)

        def run_step(self, batch):
            if batch == 1:
                raise RuntimeError("step failed")
            return {}

    loop, rec = Failing(), Recorder()
    loop.register_hooks([rec])
    with pytest.raises(RuntimeError, match="step failed"):
        loop.train()
    assert rec.events == ["before_train", "before_step", "after_step", "before_step", "after_train"]
    assert loop.completed is False


# -- checkpoints written as dicts by the trainers load into the typed records ----------------------------------


def _adam_state() -> tuple[dict, dict]:
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([param], lr=0.1)
    param.grad = torch.full((3,), 0.5)
    opt.step()
    return opt.state_dict(), training_state(opt, None, DistContext())


def test_an_encoder_checkpoint_in_the_trainer_dict_layout_loads(tmp_path) -> None:
    _, state = _adam_state()
    layout = {  # the keys and order the encoder trainer writes for last.pt
        "kind": "train",
        "model": {"name": "sentence_encoder", "config": {"word_dim": 16}, "vocab_size": 3, "image_dim": 8},
        "vocab": ["<pad>", "a", "b"],
        "weights": {"w": torch.arange(4.0)},
        "epoch": 2,
        "position": 5,
        "global_step": 17,
        "best": {"metric": "c2i_R@1", "value": 12.5, "epoch": 1},
        "history": [{"epoch": 1, "c2i_R@1": 12.5}],
        "train_config": {"lr": 0.001},
        **state,
    }
    save_checkpoint(tmp_path / "last.pt", layout)
    ckpt = read_encoder_checkpoint(tmp_path / "last.pt")
    assert ckpt.kind == "train" and ckpt.image_dim == 8 and ckpt.vocab == ("<pad>", "a", "b")
    assert (ckpt.progress.epoch, ckpt.progress.position, ckpt.progress.global_step) == (2, 5, 17)
    assert ckpt.progress.best["value"] == 12.5 and ckpt.state.optimizer["param_groups"][0]["lr"] == 0.1
    rewritten = ckpt.to_dict()
    assert list(rewritten) == list(layout)
    assert torch.equal(rewritten["weights"]["w"], layout["weights"]["w"]) and rewritten["model"] == layout["model"]
    weights_only = {k: v for k, v in layout.items() if k not in ("optimizer", "scaler", "rng")} | {"kind": "weights"}
    save_checkpoint(tmp_path / "best.pt", weights_only)
    assert read_encoder_checkpoint(tmp_path / "best.pt").state is None
    save_checkpoint(tmp_path / "bad.pt", {**layout, "epoch": -1})
    with pytest.raises(PipelineError, match="bad.pt: malformed progress"):
        read_encoder_checkpoint(tmp_path / "bad.pt")


def test_a_detector_checkpoint_in_the_trainer_dict_layout_loads(tmp_path) -> None:
    _, state = _adam_state()
    layout = {"model": {"conv.weight": torch.ones(2, 3)}, **state, "iteration": 6, "identity": {"train": {"lr": 1}}}
    save_checkpoint(tmp_path / "last.pt", layout)
    ckpt = DetectorCheckpoint.load(tmp_path / "last.pt")
    assert ckpt.iteration == 6 and ckpt.processes == 1 and ckpt.identity == {"train": {"lr": 1}}
    assert list(ckpt.to_dict()) == list(layout)
    ckpt.save(tmp_path / "again.pt")
    again = load_checkpoint(tmp_path / "again.pt")
    assert again["iteration"] == 6 and torch.equal(again["model"]["conv.weight"], torch.ones(2, 3))
    save_checkpoint(tmp_path / "bad.pt", {**layout, "iteration": "6"})
    with pytest.raises(PipelineError, match="bad.pt: iteration '6'"):
        DetectorCheckpoint.load(tmp_path / "bad.pt")
    save_checkpoint(tmp_path / "short.pt", {k: v for k, v in layout.items() if k != "identity"})
    with pytest.raises(PipelineError, match="short.pt lacks identity"):
        DetectorCheckpoint.load(tmp_path / "short.pt")
