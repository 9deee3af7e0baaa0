"""Shared fixture data for the training tests: a synthetic world, its prepared captions and an oracle store."""

from __future__ import annotations

from pathlib import Path

from pipeline.caption_data.prepare import prepare_captions
from pipeline.core.config import load_config
from pipeline.core.stages import run_stage
from pipeline.world.generate import generate_world
from pipeline.world.oracle_features import write_oracle_store

#: tiny SAN-family sizes for CPU tests
TINY = ["train.model_overrides={d_model: 64, num_heads: 4, d_ff: 128, num_layers: 1, dropout: 0.0, embed_dropout: 0.0}"]


def make_world_run(root: Path, num_images: int = 300, seed: int = 0) -> Path:
    """``root/run`` with ``data/`` (prepared captions) and ``features/store`` (oracle features)."""
    world = root / "world"
    generate_world(
        world,
        load_config(
            "world", None, [f"world.num_images={num_images}", "world.num_workers=1", f"world.seed={seed}"]
        ).world,
    )
    run = root / "run"
    cfg = load_config(
        "prepare",
        None,
        [f"prepare.karpathy_json={world / 'annotations/dataset_coco.json'}", "prepare.word_count_threshold=0"],
    )
    run_stage(run, "data", cfg.prepare, prepare_captions)
    write_oracle_store(world, run / "features" / "store")
    return run


def train_overrides(run: Path, model: str, *extra: str) -> list[str]:
    return [
        f"train.model={model}",
        f"train.store={run / 'features/store'}",
        f"train.data={run / 'data'}",
        "train.device=cpu",
        "train.preload=memory",
        "train.log_every=1",
        *TINY,
        *extra,
    ]
