"""The release registry (extractors/releases.py): one record per release, read by every table that used to key on
release names, and the Detector base every release's detector implements."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from extract_helpers import selector_for, tiny_spec

from extractors.bottom_up import BottomUpDetector
from extractors.detector import Detector
from extractors.grid import GridFeatsModel
from extractors.random_weights import random_detector
from extractors.recipes import default_recipes, recipe_name_for, recipe_names
from extractors.releases import (
    RELEASES,
    Release,
    available_releases,
    get_release,
    layout_recipes,
    register_release,
    release_names,
    release_of_format,
    release_of_layout,
)
from extractors.vinvl import VinVLDetector
from pipeline.core.catalogue import CATALOGUE
from pipeline.core.errors import UsageError
from pipeline.importers import default_identity, import_features
from pipeline.importers.formats import FORMATS, Format, import_formats, register_format
from pipeline.store import FeatureStore

#: the release (its recipe name) a store imported from each built-in format records
IMPORTED_RELEASES = {
    "butd-tsv": "caffe",
    "obj36-tsv": "caffe",
    "cocobu": "caffe",
    "m2-hdf5": "caffe",
    "vinvl-tsv": "vinvl",
    "grid-hdf5": "grid-feats",
    "clip-vil": "clip-vil",
}


def test_the_registry_holds_every_builtin_release():
    assert release_names() == ["airsplay", "caffe", "clip-vil", "grid-feats", "hf", "vinvl"]


def test_each_layout_runs_its_release_recipe():
    assert layout_recipes() == {
        "milvlg": "caffe",
        "butd": "caffe",
        "hf": "hf",
        "airsplay": "airsplay",
        "vinvl": "vinvl",
        "grid-feats": "grid-feats",
    }
    assert [recipe_name_for("random", flavor) for flavor in ("caffe", "d2", "vinvl")] == ["caffe", "hf", "vinvl"]
    assert release_of_layout("no-such-layout") is None
    assert set(default_recipes()) >= set(layout_recipes().values())


def test_recipe_names_are_the_config_table_then_the_releases_own():
    """``--recipe`` takes the ``extract.recipes`` entries and the recipes of releases that run their own
    extraction (CLIP's, from its record), each once."""
    own = get_release("clip-vil")
    assert own.recipes == ("clip-vil", "clip") and own.weights_layouts == ("openai", "open_clip", "hf")
    assert get_release("caffe").recipes == ("caffe",) and get_release("caffe").weights_layouts == ("milvlg", "butd")
    assert recipe_names() == [*default_recipes(), "clip-vil", "clip"]
    assert list(default_recipes()) == ["caffe", "hf", "airsplay", "vinvl", "grid-feats"]


def test_catalogue_names_and_formats_point_at_their_release():
    for release in available_releases():
        for name in release.catalogue:
            assert CATALOGUE[name].kind in release.layouts, (release.name, name)
    claimed = {fmt: r.name for r in available_releases() for fmt in r.import_formats}
    assert claimed == IMPORTED_RELEASES
    assert set(claimed) <= {f.name for f in import_formats()}  # each claim names a registered format
    assert default_identity("vinvl-tsv")["release"] == {"recipe": "vinvl", "source": get_release("vinvl").source}
    assert default_identity("butd-tsv", "airsplay")["release"]["recipe"] == "airsplay"


@pytest.mark.parametrize("fmt", sorted(IMPORTED_RELEASES))
def test_each_builtin_format_records_the_release_that_made_its_files(fmt):
    recipe = IMPORTED_RELEASES[fmt]
    assert release_of_format(fmt) is get_release(recipe)
    assert default_identity(fmt) == {
        "name": f"imported:{fmt}",
        "config": {"format": fmt},
        "release": {"recipe": recipe, "source": get_release(recipe).source},
    }


def test_the_caffe_formats_record_the_bottom_up_script():
    source = (
        "peteanderson80/bottom-up-attention tools/generate_tsv.py (Caffe; = MILVLG bottom-up-attention.pytorch "
        "caffe mode)"
    )
    for fmt in ("butd-tsv", "obj36-tsv", "cocobu", "m2-hdf5"):
        assert default_identity(fmt)["release"] == {"recipe": "caffe", "source": source}


def read_one_image(sources, keys="raw", sizes=None, **_):
    """A plugin format's reader: one image of two 8-d regions per source."""
    for path in sources:
        rec = {
            "key": path.stem,
            "features": np.ones((2, 8), np.float32),
            "boxes": np.array([[0, 0, 4, 4], [2, 2, 8, 6]], np.float32),
            "image_w": 10,
            "image_h": 8,
        }
        yield str(path), (lambda rec=rec: rec)


@pytest.fixture
def plugin_registry():
    """``add(format=..., release=...)`` registers a plugin's format or release; both are removed afterwards (the
    registries are shared by the tests of this process)."""
    formats, releases = [], []

    def add(fmt: Format | None = None, release: Release | None = None) -> None:
        if fmt is not None:
            register_format(fmt)
            formats.append(fmt.name)
        if release is not None:
            register_release(release)
            releases.append(release.name)

    yield add
    for name in formats:
        FORMATS._items.pop(name)
    for name in releases:
        RELEASES._items.pop(name)


def test_a_plugin_release_claiming_a_new_format_is_recorded(plugin_registry, tmp_path):
    plugin_registry(fmt=Format("plugin-npz", read_one_image, help="one image per file"))
    assert release_of_format("plugin-npz") is None
    plugin_registry(release=Release(name="plugin-det", source="a plugin's extract.py", import_formats=("plugin-npz",)))
    assert release_of_format("plugin-npz").name == "plugin-det"
    expected = {"recipe": "plugin-det", "source": "a plugin's extract.py"}
    assert default_identity("plugin-npz")["release"] == expected
    (tmp_path / "img1.npz").write_bytes(b"")
    import_features("plugin-npz", [tmp_path / "img1.npz"], tmp_path / "store")
    store = FeatureStore(tmp_path / "store")
    assert store.keys() == ["img1"] and store.identity["release"] == expected
    assert default_identity("plugin-npz", "vinvl")["release"]["recipe"] == "vinvl"  # --release still wins


def test_two_releases_claiming_one_format_are_one_line(plugin_registry):
    plugin_registry(release=Release(name="plugin-det", source="a plugin", import_formats=("m2-hdf5",)))
    for call in (available_releases, lambda: release_of_format("m2-hdf5"), lambda: default_identity("butd-tsv")):
        with pytest.raises(UsageError) as err:
            call()
        message = str(err.value)
        assert "caffe" in message and "plugin-det" in message and "'m2-hdf5'" in message, message
        assert "\n" not in message


def test_a_format_no_release_claims_asks_for_release(plugin_registry):
    plugin_registry(fmt=Format("plugin-npz", read_one_image, help="one image per file"))
    assert release_of_format("plugin-npz") is None
    with pytest.raises(UsageError) as err:
        default_identity("plugin-npz")
    message = str(err.value)
    assert message.startswith("no release claims the files of format 'plugin-npz': pass --release (")
    assert "caffe" in message and "\n" not in message
    assert default_identity("plugin-npz", "hf")["release"] == {"recipe": "hf", "source": get_release("hf").source}


@pytest.mark.parametrize(
    "fmt,release,words",
    [("no-such-format", None, "no-such-format"), ("butd-tsv", "no-such-release", "no-such-release")],
)
def test_unknown_format_or_release_is_one_line(fmt, release, words):
    with pytest.raises(UsageError) as err:
        default_identity(fmt, release)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_layout_has_one_release():
    with pytest.raises(ValueError, match="layout 'vinvl' already belongs to release vinvl"):
        register_release(Release(name="other", source="x", layouts=("vinvl",)))
    assert "other" not in release_names()


def test_every_detector_is_a_detector_and_keeps_its_shape():
    assert all(issubclass(cls, Detector) for cls in (BottomUpDetector, VinVLDetector, GridFeatsModel))
    assert {r.name: r.detector for r in available_releases()}["vinvl"] is VinVLDetector
    model = random_detector(tiny_spec(flavor="caffe"), 0)
    model.set_test_recipe(min_size=321, post_nms_topk=17)
    assert model.spec.min_size == 321 and model.roi_heads.spec.post_nms_topk == 17
    assert model.proposal_generator.spec is model.spec
    with pytest.raises(ValueError, match="num_classes shapes the weights"):
        model.set_test_recipe(num_classes=5)
    x = torch.randn(1, 3, 64, 64)
    before = model.backbone(x)
    model.fold_batchnorm()
    torch.testing.assert_close(model.backbone(x), before, rtol=1e-4, atol=1e-4)


def test_a_selection_the_detector_does_not_run_is_refused():
    spec = tiny_spec(flavor="caffe")
    with pytest.raises(UsageError, match="does not run on caffe weights"):
        selector_for(spec, "vinvl")
