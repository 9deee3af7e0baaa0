"""The demo's --models: registered captioners, named variants (ablations) and the train config of each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_helpers import make_world_run, train_overrides
from typer.testing import CliRunner

from cli import app
from pipeline.core.config import load_config
from pipeline.core.errors import UsageError
from pipeline.demo import demo_captioners, demo_train_config
from pipeline.training.api import train_captioner


def test_variants_resolve_to_their_captioner_and_layer_their_keys_over_its_cpu_sizes() -> None:
    cfg = load_config("demo")
    assert demo_captioners(cfg, ["san", "ngsan-signed", "m2"]) == {"san": "san", "ngsan-signed": "ngsan", "m2": "m2"}
    plain = demo_train_config(cfg, "ngsan", "ngsan", Path("s"), Path("d")).train
    signed = demo_train_config(cfg, "ngsan-signed", "ngsan", Path("s"), Path("d")).train
    assert signed.model == "ngsan" and signed.store == "s" and signed.data == "d"
    assert signed.model_overrides.to_dict() == {**plain.model_overrides.to_dict(), "geometry_signed": True}
    assert "geometry_signed" not in plain.model_overrides
    m2 = demo_train_config(cfg, "m2", "m2", Path("s"), Path("d")).train
    assert (
        m2.xe.lr == pytest.approx(3e-4) and m2.xe.lr_schedule == "step" and m2.xe.epochs == cfg.train.xe.epochs
    )  # merged, not replaced


def test_user_variants_are_accepted_and_bad_names_are_usage_errors() -> None:
    cfg = load_config(
        "demo", None, ["demo.variants.san-deep={model: san, model_overrides: {num_layers: 3}, xe: {epochs: 1}}"]
    )
    assert demo_captioners(cfg, ["san-deep"]) == {"san-deep": "san"}
    train = demo_train_config(cfg, "san-deep", "san", Path("s"), Path("d")).train
    assert train.model_overrides.num_layers == 3 and train.model_overrides.d_model == 256 and train.xe.epochs == 1
    with pytest.raises(UsageError, match="unknown captioner 'resnet'.*ngsan-signed"):
        demo_captioners(cfg, ["resnet"])
    bad = load_config("demo", None, ["demo.variants.oops={model: lstm}"])
    with pytest.raises(UsageError, match="demo.variants.oops: 'model' must name a registered captioner"):
        demo_captioners(bad, ["oops"])


def test_cli_refuses_an_unknown_model_before_running_any_stage(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["demo", "--out", str(tmp_path / "d"), "--models", "san,nope", "--quiet"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert [line for line in res.stderr.splitlines() if line.startswith("error:")] == [
        res.stderr.strip().splitlines()[0]
    ]
    assert "unknown captioner 'nope'" in res.stderr
    assert not (tmp_path / "d" / "world").exists()


def test_a_variant_trains_into_its_own_stage_folder(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    run = make_world_run(tmp_path, num_images=60)
    sets = train_overrides(
        run, "gsan", "train.stages=[xe]", "train.xe={epochs: 1, batch_size: 16, lr: 2.0e-3, warmup_iters: 0}"
    )
    plain = train_captioner(run, load_config("train", None, sets))
    signed = train_captioner(
        run,
        load_config("train", None, [*sets, "train.model_overrides.geometry_signed=true"]),
        stage_name="train-gsan-signed",
    )
    assert plain.directory.name == "train-gsan" and signed.directory.name == "train-gsan-signed"

    def geometry_inputs(result) -> list[int]:
        ckpt = torch.load(result.directory / "best.pt", weights_only=True)
        return [v.shape[1] for k, v in ckpt["weights"].items() if k.endswith("geometry.embed.weight")]

    assert geometry_inputs(signed) == [6] and geometry_inputs(plain) == [4]  # Eq. 9's FC sees the two directions
    assert torch.load(signed.directory / "best.pt", weights_only=True)["model"]["config"]["geometry_signed"] is True


def test_the_eval_stage_decodes_under_the_demos_decoding_section(tmp_path: Path) -> None:
    """The demo's ``decoding:`` section reaches its test-split evaluation (as it reaches its pictures stage)."""
    import json

    from pipeline.demo import _eval_work

    torch.set_num_threads(1)
    run = make_world_run(tmp_path, num_images=60)
    sets = train_overrides(
        run, "san", "train.stages=[xe]", "train.xe={epochs: 1, batch_size: 16, lr: 2.0e-3, warmup_iters: 0}"
    )
    best = train_captioner(run, load_config("train", None, sets)).directory / "best.pt"
    cfg = load_config("evaluate").evaluate.with_overrides({"split": "test"}, source="test")

    def words(decoding: dict, name: str) -> list[int]:
        out = tmp_path / name
        out.mkdir()
        files, _ = _eval_work(best, run / "features/store", run / "data", True, decoding)(out, cfg)
        return [len(p["caption"].split()) for p in json.loads((out / files["predictions"]).read_text())]

    assert max(words({}, "own")) > 1  # the checkpoint's own decoding writes longer captions than the cap below
    assert max(words({"max_len": 1}, "capped")) <= 1
