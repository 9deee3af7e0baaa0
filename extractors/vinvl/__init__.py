"""The VinVL release (Zhang et al. 2021, "VinVL"; microsoft/scene_graph_benchmark ``AttrRCNN``) as one package and
one record: the detector (:mod:`.detector`), its test-time selection (:mod:`.select`) and its weights layout
(:mod:`.layout`). docs/recipes.md#vinvl describes the recipe with the upstream lines each rule comes from.
"""

from __future__ import annotations

from extractors import EXTRACTORS
from extractors.layouts import normalise
from extractors.releases import Release, register_release
from extractors.spec import BottomUpSpec
from extractors.vinvl.detector import VinVLDetector, maskrcnn_anchor_table, vinvl_x152c4
from extractors.vinvl.layout import describe_vinvl, detect_vinvl, infer_vinvl_spec, load_vinvl
from extractors.vinvl.select import VinVLPostProcess


@EXTRACTORS.register("vinvl-x152c4")
def preset_vinvl_x152c4() -> BottomUpSpec:
    """VinVL ``vinvl_vg_x152c4`` (ResNeXt-152 32x8d C4, 1594 classes, 524 attributes)."""
    return vinvl_x152c4()


register_release(
    Release(
        name="vinvl",
        source="microsoft/scene_graph_benchmark AttrRCNN (VinVL vinvl_vg_x152c4)",
        layouts=("vinvl",),
        flavor="vinvl",
        preset="vinvl-x152c4",
        catalogue=("vinvl-x152c4",),
        identity="vinvl",
        import_formats=("vinvl-tsv",),
        detect=detect_vinvl,
        normalise=normalise,
        load=load_vinvl,
        describe=describe_vinvl,
        detector=VinVLDetector,
        random_identity="vinvl-random",
        selectors=("vinvl", "given", "grid"),
    )
)

__all__ = [
    "VinVLDetector",
    "VinVLPostProcess",
    "infer_vinvl_spec",
    "maskrcnn_anchor_table",
    "preset_vinvl_x152c4",
    "vinvl_x152c4",
]
