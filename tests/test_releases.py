"""The release registry (extractors/releases.py): one record per release, read by every table that used to key on
release names, and the Detector base every release's detector implements."""

from __future__ import annotations

import pytest
import torch
from extract_helpers import selector_for, tiny_spec

from extractors.bottom_up import BottomUpDetector
from extractors.detector import Detector
from extractors.grid import GridFeatsModel
from extractors.random_weights import random_detector
from extractors.recipes import default_recipes, recipe_name_for, recipe_names
from extractors.releases import (
    Release,
    available_releases,
    get_release,
    layout_recipes,
    register_release,
    release_names,
    release_of_layout,
)
from extractors.vinvl import VinVLDetector
from pipeline.core.catalogue import CATALOGUE
from pipeline.core.errors import UsageError
from pipeline.importers import default_identity
from pipeline.importers.formats import import_formats


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
    claimed = {f.name: f.release for f in import_formats() if f.release is not None}
    assert claimed == {
        "butd-tsv": "caffe",
        "obj36-tsv": "caffe",
        "cocobu": "caffe",
        "m2-hdf5": "caffe",
        "vinvl-tsv": "vinvl",
        "grid-hdf5": "grid-feats",
        "clip-vil": "clip-vil",
    }
    assert default_identity("vinvl-tsv")["release"] == {"recipe": "vinvl", "source": get_release("vinvl").source}
    assert default_identity("butd-tsv", "airsplay")["release"]["recipe"] == "airsplay"


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
