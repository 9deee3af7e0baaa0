"""Config loading: _base_ inheritance, schema validation, dotted overrides, immutability."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.config import Config, load_config, load_yaml_with_bases, parse_override, validate_against
from pipeline.core.errors import ConfigError


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_base_chain_merges_recursively(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", "x: {p: 1, q: 2}\ny: [1, 2]\n")
    write(tmp_path / "b.yaml", "_base_: a.yaml\nx: {q: 3}\n")
    write(tmp_path / "c.yaml", "_base_: [b.yaml]\ny: [5]\nz: hi\n")
    assert load_yaml_with_bases(tmp_path / "c.yaml") == {"x": {"p": 1, "q": 3}, "y": [5], "z": "hi"}


def test_base_cycle_is_reported(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", "_base_: b.yaml\n")
    write(tmp_path / "b.yaml", "_base_: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_yaml_with_bases(tmp_path / "a.yaml")


def test_schema_rejects_unknown_keys_and_wrong_types() -> None:
    schema = {"train": {"lr": 0.1, "epochs": 3, "name": "x", "open": {}, "any": None}}
    assert validate_against(schema, {"train": {"lr": 1}}, "t")["train"]["lr"] == 1.0
    assert isinstance(validate_against(schema, {"train": {"lr": 1}}, "t")["train"]["lr"], float)
    assert validate_against(schema, {"train": {"open": {"k": 1}}}, "t")["train"]["open"] == {"k": 1}
    assert validate_against(schema, {"train": {"any": [1]}}, "t")["train"]["any"] == [1]
    with pytest.raises(ConfigError, match="unknown config key 'train.lrr'"):
        validate_against(schema, {"train": {"lrr": 1}}, "t")
    with pytest.raises(ConfigError, match="'train.epochs' must be int, got float"):
        validate_against(schema, {"train": {"epochs": 2.5}}, "t")
    with pytest.raises(ConfigError, match="must be int, got bool"):
        validate_against(schema, {"train": {"epochs": True}}, "t")
    with pytest.raises(ConfigError, match="must be str"):
        validate_against(schema, {"train": {"name": 3}}, "t")


def test_overrides_parse_yaml_values() -> None:
    assert parse_override("train.lr=1e-4") == (["train", "lr"], 1e-4)
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a=true") == (["a"], True)
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("novalue")


def test_load_config_applies_file_then_overrides(tmp_path: Path) -> None:
    user = write(tmp_path / "u.yaml", "world: {num_images: 50, seed: 4}\n")
    cfg = load_config("world", user, ["world.seed=9"])
    assert cfg.world.num_images == 50 and cfg.world.seed == 9
    assert cfg.get_path("world.image_size") == (160, 224)
    with pytest.raises(ConfigError, match="unknown config key 'world.nope'"):
        load_config("world", None, ["world.nope=1"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("world", tmp_path / "missing.yaml")
    bad = write(tmp_path / "bad.yaml", "world: {num_images: many}\n")
    with pytest.raises(ConfigError, match="bad.yaml: 'world.num_images' must be int"):
        load_config("world", bad)
    broken = write(tmp_path / "broken.yaml", "world: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config("world", broken)


def test_config_is_immutable_and_digest_is_order_free() -> None:
    a = Config({"x": {"y": 1, "z": [1, 2]}, "w": 2})
    b = Config({"w": 2, "x": {"z": [1, 2], "y": 1}})
    assert a == b and a.digest() == b.digest()
    with pytest.raises(AttributeError):
        a.w = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        a["w"] = 3  # type: ignore[index]
    c = a.with_overrides(["x.y=5"])
    assert a.x.y == 1 and c.x.y == 5 and c.digest() != a.digest()
    assert c.to_dict() == {"x": {"y": 5, "z": [1, 2]}, "w": 2}


def test_open_mapping_accepts_several_overrides_and_stays_open() -> None:
    cfg = Config({"prepare": {"files": {}, "n": 1}})
    cfg = cfg.with_overrides(["prepare.files.train=a.json"]).with_overrides(["prepare.files.val=b.json"])
    cfg = cfg.with_overrides({"prepare.files.test": "c.json", "prepare.n": 2})
    assert cfg.prepare.files.to_dict() == {"train": "a.json", "val": "b.json", "test": "c.json"}
    with pytest.raises(ConfigError, match="unknown config key 'prepare.m'"):
        cfg.with_overrides(["prepare.m=1"])
    sub = cfg.prepare.with_overrides(["files.more=d.json"])
    assert sub.files.more == "d.json"


def test_open_mapping_declared_in_a_base_stays_open(tmp_path: Path) -> None:
    write(tmp_path / "base.yaml", "train: {xe: {}, n: 1}\n")
    write(tmp_path / "child.yaml", "_base_: base.yaml\ntrain: {xe: {epochs: 3}}\n")
    import pipeline.core.config as pc

    assert pc.open_paths_in_chain(tmp_path / "child.yaml") == frozenset({"train.xe"})
    data = pc.load_yaml_with_bases(tmp_path / "child.yaml")
    cfg = Config(data, pc.open_paths_in_chain(tmp_path / "child.yaml")).with_overrides(["train.xe.lr=0.1"])
    assert cfg.train.xe.to_dict() == {"epochs": 3, "lr": 0.1}
