"""Checkpoint layouts of the public bottom-up weights, strict loaders, a restricted unpickler, SHA-256.

Layouts (docs/extractor.md#weights-layouts; key paths are detectron2 module paths):

* ``milvlg`` - MILVLG ``bua-caffe-frcn-r101_with_attributes[_fix36].pth`` (= ``-k10-100`` / ``-k36``): torch
  file, a state dict (bare or under ``"model"``); caffe semantics (24-ch objectness, ``bbox_pred`` 6404,
  background first), attribute head ``cls_embed`` / ``attr_linear1`` / ``attr_linear2``; (expected) no
  ``num_batches_tracked``; ``cell_anchors.0`` optional (the Caffe table is used if absent).
* ``airsplay`` - airsplay ``faster_rcnn_from_caffe[_attr].pkl``: a pickle ``{"model": {key: ndarray}}``; d2
  semantics (12-ch objectness, ``bbox_pred`` 6400, background last), ``cls_embedding`` / ``fc_attr`` /
  ``attr_score``; no ``num_batches_tracked``; ``cell_anchors.0`` optional.
* ``hf`` - HF ``unc-nlp/frcnn-vg-finetuned`` ``pytorch_model.bin``: torch state dict with the airsplay names
  plus ``num_batches_tracked`` for all 104 norms and ``cell_anchors.0`` (640 keys for R-101).
* ``butd`` - detectors trained by this project (``cli train-detector``): a torch file
  ``{"format": "butd-caption-detector", "version": 1, "spec": {...}, "model": state dict, "classes": [...],
  "attributes": [...]}`` with the MILVLG key names and caffe semantics; the architecture and test-time recipe
  (anchors, input scale) come from its ``spec``, not from guessing, and ``cell_anchors.0`` is required.

Loading is strict: every key of the layout must be present with the expected shape and nothing else may be
there (only ``cell_anchors.0`` and the ``num_batches_tracked`` counters may be absent from MILVLG / airsplay
files, whose exact contents their authors do not document); the first mismatch (:func:`strict_mismatch`, which
the CLIP loader uses too) is reported in one line naming the file and the key. Pickles are read with
:class:`RestrictedUnpickler` (numpy arrays and plain containers only); torch files with
``torch.load(weights_only=True)``. What a file declares is bounded before it is allocated: the archive and its
tensors against the file's bytes (:mod:`pipeline.core.tensor_bounds`), the architecture against limits
(:mod:`extractors.weight_bounds`); docs/extractor.md#bounds-on-weights-files.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from extractors.releases import detect_layout, release_of_flavor, release_of_layout
from extractors.spec import BottomUpSpec
from extractors.weight_bounds import check_keys, check_meta, check_spec, dims
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.tensor_bounds import BoundsError, check_archive, check_tensors
from pipeline.core.unpickle import IMPORT
from pipeline.core.unpickle import RestrictedUnpickler as Unpickler

LAYOUTS = ("milvlg", "airsplay", "hf", "butd")  # the bottom-up layouts; the releases register others
BUTD_FORMAT = "butd-caption-detector"
BUTD_VERSION = 1
D2_RENAMES = (
    ("roi_heads.box_predictor.cls_embed.", "roi_heads.box_predictor.cls_embedding."),
    ("roi_heads.box_predictor.attr_linear1.", "roi_heads.box_predictor.fc_attr."),
    ("roi_heads.box_predictor.attr_linear2.", "roi_heads.box_predictor.attr_score."),
)
D2_RENAMES_BACK = tuple((new, old) for old, new in D2_RENAMES)
ANCHOR_KEY = "proposal_generator.anchor_generator.cell_anchors.0"
NBT = "num_batches_tracked"


class WeightsError(PipelineError):
    """A weights file that cannot be read or does not match the expected layout (exit 1)."""


# --------------------------------------------------------------------------------------------------------
# restricted unpickling
class _ArrayClass:
    """Stands for ``numpy.ndarray``: only the class argument of :func:`_reconstruct` (called, it would allocate
    an array of any shape)."""


def _reconstruct(cls: Any, shape: Any, typecode: Any) -> np.ndarray:
    """NumPy's ``_reconstruct(ndarray, (0,), b'b')``, the empty array pickle fills with its bytes (``__setstate__``
    checks that they match the shape); any other class or shape is refused before anything is allocated."""
    if cls is not _ArrayClass or tuple(shape) != (0,) or not isinstance(typecode, (bytes, str)) or len(typecode) > 2:
        raise pickle.UnpicklingError(
            "an array reconstructed with a declared shape (numpy pickles start from an empty one)"
        )
    return np.ndarray.__new__(np.ndarray, (0,), np.dtype("b"))


#: what a pickled dict of numpy arrays needs; any other global or persistent id is refused
WEIGHT_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.multiarray", "scalar"): IMPORT,
    ("numpy._core.multiarray", "scalar"): IMPORT,
    ("numpy", "ndarray"): _ArrayClass,
    ("numpy", "dtype"): IMPORT,
    ("collections", "OrderedDict"): IMPORT,
    ("_codecs", "encode"): IMPORT,  # how Python 3 pickles bytes under protocol 2
}
#: the project's restricted unpickler admitting :data:`WEIGHT_GLOBALS`: ``RestrictedUnpickler(file, encoding=...)``
RestrictedUnpickler = functools.partial(Unpickler, allowed=WEIGHT_GLOBALS)


def restricted_load(path: Path) -> Any:
    """Unpickle ``path`` with :class:`RestrictedUnpickler` (``encoding='latin1'`` for Python-2 pickles)."""
    try:
        with open(path, "rb") as fh:
            return RestrictedUnpickler(fh, encoding="latin1").load()
    except (
        pickle.UnpicklingError,
        EOFError,
        AttributeError,
        ValueError,
        TypeError,
        IndexError,
        KeyError,
        ImportError,
        RecursionError,
        OverflowError,
        MemoryError,
    ) as exc:
        raise WeightsError(f"weights file {path} refused: not a plain pickle of numpy arrays ({exc})") from None


# --------------------------------------------------------------------------------------------------------
def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def _renamed(key: str, layout: str, renames: tuple[tuple[str, str], ...]) -> str:
    """``key`` with the first matching ``(old prefix, new prefix)`` of ``renames`` applied in the detectron2
    layouts (airsplay, hf); unchanged in the others."""
    if layout in ("airsplay", "hf"):
        for old, new in renames:
            if key.startswith(old):
                return new + key[len(old) :]
    return key


def to_layout_key(key: str, layout: str) -> str:
    """Internal (MILVLG) key -> the key name in ``layout``."""
    return _renamed(key, layout, D2_RENAMES)


def from_layout_key(key: str, layout: str) -> str:
    """The key name in ``layout`` -> the internal (MILVLG) key."""
    return _renamed(key, layout, D2_RENAMES_BACK)


def internal_shapes(spec: BottomUpSpec) -> "OrderedDict[str, tuple[int, ...]]":
    """Key -> shape of the detector's state dict, built on the meta device (no memory for the tensors)."""
    with torch.device("meta"):
        model = release_of_flavor(spec.flavor).detector(spec)
    return OrderedDict((k, tuple(v.shape)) for k, v in model.state_dict().items())


def expected_table(layout: str, spec: BottomUpSpec) -> tuple["OrderedDict[str, tuple[int, ...]]", set[str]]:
    """(layout key -> shape, optional keys) for a spec; ``num_batches_tracked`` (hf) are scalars."""
    if layout not in LAYOUTS:
        raise UsageError(f"unknown weights layout {layout!r} (known: {', '.join(LAYOUTS)})")
    table: OrderedDict[str, tuple[int, ...]] = OrderedDict()
    optional: set[str] = set()
    for key, shape in internal_shapes(spec).items():
        table[to_layout_key(key, layout)] = shape
        if key.endswith(".norm.running_var"):
            nbt = key[: -len("running_var")] + NBT
            table[nbt] = ()
            if (
                layout != "hf"
            ):  # BatchNorm2d counters: absent from the public files (docs/extractor.md#weights-layouts), tolerated
                optional.add(nbt)
    if layout not in ("hf", "butd"):  # our own files always carry their anchors
        optional.add(ANCHOR_KEY)
    return table, optional


# --------------------------------------------------------------------------------------------------------
def read_weights(path: str | Path) -> tuple[str, "OrderedDict[str, torch.Tensor]", dict[str, Any]]:
    """Read a weights file -> (layout, flat state dict, metadata of a ``butd`` file or ``{}``)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"weights file not found: {path}")
    if path.suffix == ".pkl":
        obj = restricted_load(path)
        container = "pickle"
    else:
        try:
            check_archive(path)
        except BoundsError as exc:
            raise WeightsError(f"weights file {exc}") from None
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for a non-torch / unsafe file
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise WeightsError(
                f"weights file {path} cannot be read with torch.load(weights_only=True): {first}"
            ) from None
        container = "torch"
    meta: dict[str, Any] = {}
    if isinstance(obj, Mapping) and obj.get("format") == BUTD_FORMAT:
        if obj.get("version") != BUTD_VERSION or not isinstance(obj.get("spec"), Mapping):
            raise WeightsError(
                f"weights file {path}: butd detector file of unsupported version {obj.get('version')!r} "
                "or without 'spec'"
            )
        meta = {k: v for k, v in obj.items() if k != "model"}
        check_meta(path, meta)
        container = "butd"
    if isinstance(obj, Mapping) and "model" in obj and isinstance(obj["model"], Mapping):
        obj = obj["model"]
    if not isinstance(obj, Mapping) or not obj:
        raise WeightsError(f"weights file {path} holds no state dict (a mapping of names to arrays)")
    sd: OrderedDict[str, torch.Tensor] = OrderedDict()
    for k, v in obj.items():
        if not isinstance(k, str):
            raise WeightsError(f"weights file {path}: non-string key {k!r}")
        if isinstance(v, np.ndarray):
            if v.dtype.kind not in "fiub":
                raise WeightsError(f"weights file {path}: key '{k}' has non-numeric dtype {v.dtype}")
            v = torch.from_numpy(np.ascontiguousarray(v))
        elif isinstance(v, (np.generic, int, float)) and not isinstance(v, bool):
            v = torch.as_tensor(np.asarray(v))
        if not isinstance(v, torch.Tensor):
            raise WeightsError(f"weights file {path}: key '{k}' is a {type(v).__name__}, not an array")
        sd[k] = v
    try:
        check_tensors(path, sd.items())
    except BoundsError as exc:
        raise WeightsError(f"weights file {exc}") from None
    found = detect_layout(sd) if container == "torch" else None  # a release's own layout (vinvl, grid-feats, ...)
    if found is not None:
        release, layout = found
        if release.normalise is not None:
            sd = release.normalise(sd)
    else:
        layout = _detect_layout(path, sd, container)
    check_keys(path, layout, sd)
    return layout, sd, meta


def _detect_layout(path: Path, sd: Mapping[str, torch.Tensor], container: str) -> str:
    has_nbt = any(k.endswith(NBT) for k in sd)
    d2_names = any(k.startswith(b) for _, b in D2_RENAMES for k in sd)
    caffe_names = any(k.startswith(a) for a, _ in D2_RENAMES for k in sd)
    if container == "pickle":
        return "airsplay"
    if container == "butd":
        return "butd"
    if caffe_names and not d2_names:
        return "milvlg"
    if d2_names and not caffe_names:
        return "hf" if has_nbt else "airsplay"
    # no attribute head: decide by the objectness width (2 per anchor = caffe)
    key = "proposal_generator.rpn_head.objectness_logits.weight"
    dkey = "proposal_generator.rpn_head.anchor_deltas.weight"
    if key in sd and dkey in sd:
        if sd[key].shape[0] * 2 == sd[dkey].shape[0]:
            return "milvlg"
        return "hf" if has_nbt else "airsplay"
    raise WeightsError(f"weights file {path}: not a bottom-up Faster R-CNN layout (no '{key}')")


_STAGE = re.compile(r"^backbone\.res(\d+)\.(\d+)\.conv1\.weight$")
_RES5 = re.compile(r"^roi_heads\.res5\.(\d+)\.conv1\.weight$")


def infer_spec(layout: str, sd: Mapping[str, torch.Tensor], path: str | Path = "?") -> BottomUpSpec:
    """The architecture a state dict describes (depth, widths, classes, attributes, flavor)."""

    def shape(key: str, rank: int = 4) -> tuple[int, ...]:
        return dims(sd, to_layout_key(key, layout), rank, path, layout)

    stages: dict[int, int] = {}
    res5 = 0
    for k in sd:
        m = _STAGE.match(k)
        if m:
            s, i = int(m.group(1)), int(m.group(2))
            stages[s] = max(stages.get(s, 0), i + 1)
        m = _RES5.match(k)
        if m:
            res5 = max(res5, int(m.group(1)) + 1)
    if not stages or sorted(stages) != list(range(2, 2 + len(stages))) or res5 == 0:
        raise WeightsError(f"weights file {path} ({layout}): backbone stages res2.. and roi_heads.res5 not found")
    stem = shape("backbone.stem.conv1.weight")[0]
    bott = shape("backbone.res2.0.conv1.weight")[0]
    expansion = shape("backbone.res2.0.conv3.weight")[0] // bott
    num_classes = shape("roi_heads.box_predictor.cls_score.weight", 2)[0]
    rpn_ch = shape("proposal_generator.rpn_head.conv.weight")[0]
    num_anchors = shape("proposal_generator.rpn_head.anchor_deltas.weight")[0] // 4
    flavor = "caffe" if layout == "milvlg" else "d2"
    has_attr = to_layout_key("roi_heads.box_predictor.attr_linear2.weight", layout) in sd
    kw: dict[str, Any] = {}
    if has_attr:
        kw["num_attributes"] = shape("roi_heads.box_predictor.attr_linear2.weight", 2)[0]
        kw["attr_embed_dim"] = shape("roi_heads.box_predictor.cls_embed.weight", 2)[1]
        kw["attr_hidden"] = shape("roi_heads.box_predictor.attr_linear1.weight", 2)[0]
    ratios = (0.5, 1.0, 2.0)
    if num_anchors % len(ratios):
        raise WeightsError(
            f"weights file {path} ({layout}): {num_anchors} anchors per cell is not a multiple of 3 ratios"
        )
    per = num_anchors // len(ratios)
    if flavor == "caffe":
        kw["anchor_scales"] = tuple(float(4 * 2**i) for i in range(per))
    else:
        kw["anchor_sizes"] = tuple(float(64 * 2**i) for i in range(per))
        kw["rpn_min_size"] = 0.0
        kw["box_reg_weights"] = (10.0, 10.0, 5.0, 5.0)
    return check_spec(
        BottomUpSpec(
            flavor=flavor,
            stem_channels=stem,
            res2_bottleneck=bott,
            expansion=expansion,
            stage_blocks=tuple(stages[s] for s in sorted(stages)),
            res5_blocks=res5,
            rpn_channels=rpn_ch,
            num_classes=num_classes,
            has_attributes=has_attr,
            **kw,
        ),
        path,
        layout,
        "architecture",
    )


def spec_from_meta(meta: Mapping[str, Any], path: str | Path = "?") -> BottomUpSpec:
    """The :class:`BottomUpSpec` stored in a ``butd`` file (lists back to tuples; unknown keys refused)."""
    raw = dict(meta.get("spec", {}))
    known = BottomUpSpec.field_names()
    bad = sorted(set(raw) - known)
    if bad:
        raise WeightsError(f"weights file {path} (butd): unknown spec key '{bad[0]}'")
    try:
        spec = BottomUpSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    except (TypeError, ValueError) as exc:
        raise WeightsError(f"weights file {path} (butd): invalid spec ({exc})") from None
    return check_spec(spec, path, "butd")


def strict_mismatch(
    sd: Mapping[str, torch.Tensor],
    table: Mapping[str, tuple[int, ...]],
    optional: Callable[[str], bool],
    name: Callable[[str], str] = str,
) -> str | None:
    """The first difference between a state dict and ``table`` (key -> expected shape), as ``missing key 'K'``,
    ``key 'K' has shape [..], expected [..]`` or ``unexpected key 'K'`` (``name`` spells a key as the file does);
    None when they agree. A key of ``table`` for which ``optional`` holds may be absent."""
    for key, shape in table.items():
        if key not in sd:
            if optional(key):
                continue
            return f"missing key '{name(key)}'"
        got = tuple(sd[key].shape)
        if got != shape:
            return f"key '{name(key)}' has shape {list(got)}, expected {list(shape)}"
    extra = next((k for k in sd if k not in table), None)
    return None if extra is None else f"unexpected key '{name(extra)}'"


def check_strict(path: str | Path, layout: str, sd: Mapping[str, torch.Tensor], spec: BottomUpSpec) -> None:
    """Raise :class:`WeightsError` naming the first missing / unexpected / mis-shaped key."""
    table, optional = expected_table(layout, spec)
    mismatch = strict_mismatch(sd, table, optional.__contains__)
    if mismatch is not None:
        raise WeightsError(f"weights file {path} ({layout}): {mismatch}")


def to_internal(layout: str, sd: Mapping[str, torch.Tensor]) -> "OrderedDict[str, torch.Tensor]":
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for k, v in sd.items():
        if k.endswith(NBT):
            continue
        out[from_layout_key(k, layout)] = v.float() if v.is_floating_point() else v
    return out


def load_detector(path: str | Path, spec: BottomUpSpec | None = None, device: str | torch.device = "cpu"):
    """Read, check strictly and load a weights file -> (detector, info dict with layout/spec/sha256).

    ``spec`` fixes the expected architecture (a preset); ``None`` infers it from the file. The flavor always
    follows the layout: MILVLG files run with caffe semantics, airsplay/HF files with detectron2 semantics.
    """
    layout, sd, meta = read_weights(path)
    release = release_of_layout(layout)
    if release is not None and release.load is not None:
        model, info = release.load(path, layout, sd, spec)
        info.update(
            layout=layout, weights_sha256=sha256_file(path), weights_file=Path(path).name, spec=model.spec.to_dict()
        )
        return model.to(device), info
    inferred = spec_from_meta(meta, path) if layout == "butd" else infer_spec(layout, sd, path)
    if spec is None:
        spec = inferred
    elif spec.flavor != inferred.flavor:
        raise WeightsError(
            f"weights file {path} has the {layout} layout ({inferred.flavor} semantics) "
            f"but the preset expects {spec.flavor}"
        )
    check_strict(path, layout, sd, spec)
    model = release_of_flavor(spec.flavor).detector(spec)
    internal = to_internal(layout, sd)
    missing, unexpected = model.load_state_dict(internal, strict=False)
    bad = [k for k in missing if k != ANCHOR_KEY] + list(unexpected)
    if bad:  # cannot happen after check_strict; kept as a guard against table drift
        raise WeightsError(f"weights file {path} ({layout}): key '{bad[0]}' does not fit the model")
    info = {
        "layout": layout,
        "weights_sha256": sha256_file(path),
        "weights_file": Path(path).name,
        "spec": spec.to_dict(),
        "anchors_from_file": ANCHOR_KEY in sd,
    }
    if layout == "butd":
        info["classes"] = list(meta.get("classes", []))
        info["attributes"] = list(meta.get("attributes", []))
    return model.to(device), info


def describe(path: str | Path) -> dict[str, Any]:
    """Layout, architecture and digest of a weights file (for ``cli info``); strict-checks it too."""
    return describe_with_spec(path)[0]


def describe_with_spec(path: str | Path) -> tuple[dict[str, Any], BottomUpSpec]:
    """:func:`describe` and the :class:`BottomUpSpec` the file defines (its own test values included)."""
    layout, sd, meta = read_weights(path)
    release = release_of_layout(layout)
    if release is not None and release.describe is not None:
        facts, spec = release.describe(layout, sd, path)
        return {
            "file": str(path),
            **facts,
            "keys": len(sd),
            "elements": int(sum(v.numel() for v in sd.values())),
            "sha256": sha256_file(path),
        }, spec
    spec = spec_from_meta(meta, path) if layout == "butd" else infer_spec(layout, sd, path)
    check_strict(path, layout, sd, spec)
    n_params = int(sum(v.numel() for k, v in sd.items() if not k.endswith(NBT)))
    depth = 3 * (sum(spec.stage_blocks) + spec.res5_blocks) + 2
    return {
        "file": str(path),
        "layout": layout,
        "semantics": spec.flavor,
        "architecture": f"ResNet-{depth} C4 (blocks {list(spec.stage_blocks) + [spec.res5_blocks]}, "
        f"width {spec.res2_bottleneck}), feature {spec.feature_dim}-d",
        "classes": spec.num_classes,
        "attributes": spec.num_attributes if spec.has_attributes else 0,
        "keys": len(sd),
        "elements": n_params,
        "anchors_in_file": ANCHOR_KEY in sd,
        "sha256": sha256_file(path),
        **(
            {
                "input_scale": f"{spec.min_size}/{spec.max_size}",
                "class_names": ", ".join(map(str, meta.get("classes", []))),
                "attribute_names": ", ".join(map(str, meta.get("attributes", []))),
                "trained": meta.get("training", {}),
            }
            if layout == "butd"
            else {}
        ),
    }, spec
