"""One config vocabulary: every config key the README and docs/ name exists in a schema (configs/*.yaml), old
keys are refused with one line naming the new one, and `num_workers` is the one name for loader processes."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cli import app
from pipeline.core.config import CONFIG_DIR, load_yaml_with_bases

REPO = Path(__file__).resolve().parents[1]
#: a backticked config key, with or without ``--set`` and ``=value``: ``extract.num_workers``,
#: ``--set train.xe.lr=1e-4``
KEY = re.compile(r"^(?:--set\s+)?([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)(?:=.*)?$")
FILE_SUFFIXES = (
    ".py",
    ".safetensors",
    ".bin",
    ".yaml",
    ".yml",
    ".json",
    ".jsonl",
    ".md",
    ".pt",
    ".pth",
    ".csv",
    ".html",
    ".png",
    ".txt",
    ".h5",
    ".tsv",
    ".npy",
    ".npz",
    ".pkl",
    ".hdf5",
    ".sh",
    ".toml",
    ".jpg",
    ".log",
    ".prototxt",
)


def schemas() -> list[dict[str, Any]]:
    """Every config file's resolved mapping (stage configs, captioner cards, detector presets, decoding)."""
    return [load_yaml_with_bases(p) for p in sorted(CONFIG_DIR.rglob("*.yaml"))]


def sections(trees: list[dict[str, Any]]) -> set[str]:
    return {name for tree in trees for name in tree}


def key_exists(dotted: str, trees: list[dict[str, Any]]) -> bool:
    """``dotted`` is a path of some config file, or lies under an open mapping (a ``{}`` default) of one."""
    parts = dotted.split(".")
    for tree in trees:
        node: Any = tree
        for i, part in enumerate(parts):
            if isinstance(node, Mapping) and part in node:
                node = node[part]
                if i == len(parts) - 1:
                    return True
                if isinstance(node, Mapping) and not node:  # an open mapping: what lies under it is free
                    return True
            else:
                break
    return False


def named_keys(text: str, known_sections: set[str]) -> set[str]:
    """The config keys a Markdown text names in backticks (the first part must be a config section)."""
    found = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        for piece in re.split(r"\s+(?=--set)|,\s*", span.strip()):
            m = KEY.match(piece.strip())
            if not m:
                continue
            key = m.group(1)
            if key.split(".")[0] in known_sections and not key.endswith(FILE_SUFFIXES):
                found.add(key)
    return found


def doc_texts() -> dict[str, str]:
    return {
        p.relative_to(REPO).as_posix(): p.read_text(encoding="utf-8")
        for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    }


def test_every_config_key_named_in_the_docs_exists():
    trees = schemas()
    known = sections(trees)
    missing = sorted(
        f"{doc}: {key}"
        for doc, text in doc_texts().items()
        for key in named_keys(text, known)
        if not key_exists(key, trees)
    )
    assert not missing, "config keys named in the docs but in no schema:\n" + "\n".join(missing)
    named = {key for text in doc_texts().values() for key in named_keys(text, known)}
    assert {"eval.num_workers", "caption.precision", "serve.max_batch"} <= named and len(
        named
    ) >= 40  # the scan does find them


def test_a_planted_unknown_key_is_found():
    trees = schemas()
    known = sections(trees)
    text = "Use `--set extract.num_workers=2` and `caption.precision`; old: `extract.workers`, `train.no_such_key=3`."
    keys = named_keys(text, known)
    assert keys == {"extract.num_workers", "caption.precision", "extract.workers", "train.no_such_key"}
    assert sorted(k for k in keys if not key_exists(k, trees)) == ["extract.workers", "train.no_such_key"]


@pytest.mark.parametrize(
    "old,new,where",
    [
        ("extract.workers", "extract.num_workers", "extract"),
        ("world.workers", "world.num_workers", "demo"),
        ("train.amp", "train.precision", "train"),
        ("train.num_threads", "--threads", "train"),
        ("train.threads", "--threads", "train-detector"),
        ("train.max_iter", "detector_train.max_iter", "train-detector"),
        ("demo.detector_overrides", "detector_train", "demo"),
        ("encoder.epochs", "sentence_encoder.epochs", "train-encoder"),
    ],
)
def test_an_old_key_is_refused_naming_the_new_one(old, new, where, tmp_path):
    command = {
        "extract": ["extract", str(tmp_path), "--weights", "random", "--store", str(tmp_path / "s")],
        "demo": ["demo", "--out", str(tmp_path / "run")],
        "train": ["train", "--out", str(tmp_path / "run")],
        "train-detector": ["train-detector", "--out", str(tmp_path / "det")],
        "train-encoder": ["train-encoder", "--out", str(tmp_path / "run")],
    }[where]
    res = CliRunner().invoke(app, [*command, "--set", f"{old}=1"])
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert f"'{old}' was renamed: use '{new}'" in lines[0]


def test_loader_processes_have_one_name_in_every_config():
    offenders = []

    def walk(node: Any, path: str, where: str) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                if k == "workers":
                    offenders.append(f"{where}: {path}{k}")
                walk(v, f"{path}{k}.", where)

    for p in sorted(CONFIG_DIR.rglob("*.yaml")):
        walk(load_yaml_with_bases(p), "", p.name)
    assert not offenders, offenders


def test_without_the_configs_folder_every_command_fails_in_one_line(monkeypatch, tmp_path, capsys):
    """A non-editable `pip install .` carries no configs/ (README: not supported): one line, exit 2."""
    import cli
    from pipeline.core import config

    monkeypatch.setattr(config, "CONFIG_DIR", tmp_path / "site-packages" / "configs")
    monkeypatch.setattr("sys.argv", ["butd-caption", "info", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "non-editable `pip install .` is not supported" in err[0]


def test_the_demo_checks_its_detector_train_keys_before_any_stage(tmp_path):
    res = CliRunner().invoke(app, ["demo", "--out", str(tmp_path / "run"), "--set", "detector_train.max_iters=5"])
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.exit_code == 2 and len(errors) == 1 and "unknown config key 'detector_train.max_iters'" in errors[0], (
        res.output
    )
    assert not (tmp_path / "run" / "world").exists()  # refused before the world stage
