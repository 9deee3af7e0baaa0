"""A release's names stay in its own files: no table elsewhere in the product is keyed by them.

Each registered release's name and weights layouts (``Release.name``, ``Release.weights_layouts``) may appear as string
literals only in the files that define the release (the module or package of its detector or of its own
extraction, plus :mod:`extractors.weights` for the bottom-up layouts it loads), in the download catalogue, and in
the places listed in :data:`OTHER_MEANINGS` with the reason the same word stands there. A new table keyed by a
release name anywhere else fails here.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest

from extractors.recipes import Recipe
from extractors.releases import RELEASES, Release, available_releases, register_release
from extractors.selector import SELECTORS
from pipeline.core.errors import UsageError

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("pipeline", "extractors", "models")
CATALOGUE = "pipeline/core/catalogue.py"

#: path -> {word: why that word stands there}: the same strings naming something else than a release table
OTHER_MEANINGS: dict[str, dict[str, str]] = {
    "extractors/spec.py": {
        "caffe": "the spec semantics (`flavor`) of Caffe detectors, part of every feature identity",
        "vinvl": "the spec semantics of maskrcnn_benchmark detectors",
    },
    "extractors/recipes.py": {
        "caffe": "the `resize: caffe` rule and the semantics a config check resolves `recipe: auto` with",
        "milvlg": "the layout a config check resolves `recipe: auto` with",
    },
    "extractors/preprocess.py": {"caffe": "the `resize: caffe` rule"},
    "extractors/resnet_caffe.py": {"caffe": "the stem pooling `stem_pool: caffe`"},
    "extractors/weight_bounds.py": {"butd": "the layout this toolkit writes, named in refusals of its metadata"},
    "extractors/training/evaluate.py": {"butd": "the layout of the detectors this toolkit trains"},
    "extractors/clip/files.py": {"hf": "the Hugging Face layout of CLIP files"},
    "pipeline/core/console.py": {"butd": "the logger namespace"},
    "pipeline/hub/resolve.py": {"hf": "the Hugging Face hub's download folder"},
    "pipeline/importers/tsv.py": {"butd": "the TSV column set of the original bottom-up files"},
    "pipeline/importers/clipvil.py": {"clip-vil": "the `--format` name of the CLIP-ViL feature folders"},
    "models/released/__init__.py": {"caffe": "the recipe the released captioners' features were made with"},
    "models/released/m2.py": {"caffe": "the recipe M2's released features were made with"},
    "models/released/aoanet.py": {"caffe": "the recipe AoANet's released features were made with"},
    "pipeline/captioning/run.py": {"caffe": "the recipe of a released captioner's features"},
    "pipeline/demo.py": {
        "grid-feats": "the recipe of the demo's grid features",
        "clip-vil": "the recipe of the demo's CLIP features",
    },
}


def _source_path(module: str) -> str:
    return Path(sys.modules[module].__file__).resolve().relative_to(REPO).as_posix()


def own_files(release: Release) -> set[str]:
    """The files that define ``release``: its detector's or own extraction's module (the whole package when that
    module sits in a subpackage of ``extractors``), and :mod:`extractors.weights` when it loads the release's
    layouts (no ``load`` of its own)."""
    code = release.own.load if release.own is not None else release.detector
    path = _source_path(code.__module__)
    parts = path.split("/")
    out = {path if len(parts) == 2 else "/".join(parts[:2]) + "/"}
    if release.own is None and release.load is None:
        out.add("extractors/weights.py")
    return out


def literals(path: Path) -> set[str]:
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def product_files() -> list[str]:
    files = [p for top in PRODUCT for p in (REPO / top).rglob("*.py")] + [REPO / "cli.py"]
    return sorted(p.relative_to(REPO).as_posix() for p in files)


def test_release_names_stand_only_in_their_own_files():
    owners: dict[str, set[str]] = {}
    for release in available_releases():
        for word in (release.name, *release.weights_layouts):
            owners.setdefault(word, set()).update(own_files(release))
    stray = []
    for path in product_files():
        if path == CATALOGUE:
            continue
        for word in sorted(literals(REPO / path) & set(owners)):
            if any(path == own or (own.endswith("/") and path.startswith(own)) for own in owners[word]):
                continue
            if word not in OTHER_MEANINGS.get(path, {}):
                stray.append(f"{path}: {word!r}")
    assert not stray, "release names outside their release's files: " + "; ".join(stray)


def test_every_other_meaning_is_still_there():
    """The list of other meanings holds no stale entry: each word still stands in its file."""
    stale = [
        f"{path}: {word!r}"
        for path, words in OTHER_MEANINGS.items()
        for word in words
        if word not in literals(REPO / path)
    ]
    assert not stale


def test_each_release_owns_its_files():
    owned = {r.name: own_files(r) for r in available_releases()}
    assert owned["vinvl"] == {"extractors/vinvl/"}
    assert owned["clip-vil"] == {"extractors/clip/"}
    assert owned["grid-feats"] == {"extractors/grid.py"}
    assert owned["caffe"] == owned["hf"] == {"extractors/bottom_up.py", "extractors/weights.py"}


def test_every_selection_a_release_names_is_registered():
    assert {s for r in available_releases() for s in r.selectors} <= set(SELECTORS)


def test_a_release_naming_an_unregistered_selection_is_one_line():
    register_release(Release(name="misspelt", source="a plugin", selectors=("per-class-nms", "gird")))
    try:
        with pytest.raises(UsageError) as err:
            available_releases()
        assert str(err.value).startswith("release misspelt: selection 'gird' is registered by no module")
        assert "\n" not in str(err.value)
    finally:
        RELEASES._items.pop("misspelt")  # the registry is shared by the tests of this process
    assert "misspelt" not in [r.name for r in available_releases()]


def test_each_selection_reads_recipe_fields_only():
    """A selection's ``fields`` are fields of the recipe, and no two selections claim the same one."""
    names = {f.name for f in dataclasses.fields(Recipe)}
    claimed = [key for selection in SELECTORS.values() for key in selection.fields]
    assert set(claimed) <= names and len(claimed) == len(set(claimed))


#: a release's own file -> {product file outside the release that imports it: why}
IMPORTERS: dict[str, dict[str, str]] = {
    "extractors/clip/": {
        "pipeline/demo.py": "the demo writes a seeded random CLIP encoder for its `clip` feature kind"
    },
    "extractors/bottom_up.py": {
        f"extractors/training/{name}.py": "detector training trains the bottom-up network"
        for name in ("evaluate", "export", "loop", "model", "optim")
    },
}


def _imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)  # from extractors import grid
    return out


def test_no_other_product_module_imports_a_release():
    """Every other module reaches a release through the registry (``cli extract``, ``caption``, ``info``)."""
    stray = []
    owned = {o for release in available_releases() for o in own_files(release)} - {"extractors/weights.py"}
    for own in sorted(owned):  # extractors.weights: the bottom-up loader every release's files go through
        module = own.removesuffix(".py").removesuffix("/").replace("/", ".")
        for path in product_files():
            if path == own or (own.endswith("/") and path.startswith(own)):
                continue
            hits = [m for m in _imported_modules(REPO / path) if m == module or m.startswith(module + ".")]
            if hits and path not in IMPORTERS.get(own, {}):
                stray.append(f"{path} imports {hits[0]}")
    assert not stray, "; ".join(stray)
