"""The SCST step as the trainer runs it: the greedy baseline under the samples' autocast (a hook on the model
sees every forward under bf16 autocast)."""

from __future__ import annotations

import pytest
import torch

from pipeline.core.config import load_config
from pipeline.core.distributed import DistContext
from pipeline.training.engine import Progress, Trainer
from tests.train_helpers import make_world_run, train_overrides


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_world_run(tmp_path_factory.mktemp("scst_step"), num_images=40)


def trainer(run, tmp_path, model: str, *extra: str) -> Trainer:
    cfg = load_config("train", None, train_overrides(run, model, "train.stages=[scst]", *extra))
    return Trainer(tmp_path, cfg.train, DistContext())


def first_batch(t: Trainer, stage: str = "scst") -> dict:
    from pipeline.training.batches import epoch_batches

    batches = epoch_batches(t.train_set, t.recipes[stage].batch_size, 0, 0, t.ctx, str(t.cfg.batching))
    return next(iter(t.train_source.iterate(batches[:1], 0)))


def test_greedy_baseline_runs_under_the_samples_autocast(run, tmp_path) -> None:
    t = trainer(run, tmp_path, "ngsan", "train.precision=bf16", "train.scst={batch_size: 4, baseline: greedy, num_samples: 2}")
    seen: list[bool] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(torch.is_autocast_enabled("cpu")))
             for m in t.model.modules() if isinstance(m, torch.nn.Linear)]
    optimizer, _, scaler = t._new_stage("scst")
    t._step("scst", t.recipes["scst"], first_batch(t), Progress(stage="scst"), optimizer, scaler)
    for h in hooks:
        h.remove()
    assert seen and all(seen), f"{seen.count(False)} of {len(seen)} forwards ran outside autocast"
