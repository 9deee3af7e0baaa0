"""Reading CLIP image-encoder weights in the three public layouts, without running anything from the file.

* ``openai`` - openai/CLIP's released ``<name>.pt``: a TorchScript archive (a zip holding ``<root>/data.pkl``,
  the pickled module tree, ``<root>/data/<key>``, one raw storage per tensor, ``<root>/code/`` and
  ``constants.pkl``). ``data.pkl`` is read with a restricted unpickler: each ``__torch__.*`` class becomes a
  stand-in that records its attribute dict, ``torch._utils._rebuild_tensor_v2`` a record of (storage, offset,
  shape, strides), a persistent id ``('storage', torch.<T>Storage, key, location, numel)`` a reference to
  ``data/<key>``; any other global is refused. The code in ``code/`` is never read. Tensors are then built from
  the storages' bytes after checking that each view lies inside its storage (no zero or overlapping strides).
  A plain ``torch.save`` of OpenAI's state dict (no ``code/``) has open_clip's names and reads as ``open_clip``.
* ``open_clip`` - open_clip checkpoints (``open_clip_pytorch_model.bin``, ``open_clip_model.safetensors``, training
  checkpoints): a state dict (bare, or under ``state_dict`` with a ``module.`` prefix
  from distributed training) with the OpenAI names (a ``CustomTextCLIP``'s text tower under ``text.``); read with
  ``torch.load(weights_only=True)`` after the archive bounds (:func:`pipeline.core.tensor_bounds.check_archive`,
  which refuses TorchScript archives there).
* ``hf`` - Hugging Face ``CLIPModel`` / ``CLIPVisionModel`` weights (``pytorch_model.bin`` or
  ``model.safetensors``): ``vision_model.embeddings.patch_embedding`` -> ``conv1``, ``position_embedding`` ->
  ``positional_embedding``, ``pre_layrnorm`` -> ``ln_pre``, ``encoder.layers.N.self_attn.{q,k,v}_proj``
  concatenated -> ``in_proj_*``, ``out_proj``, ``layer_norm1/2`` -> ``ln_1/2``, ``mlp.fc1/fc2`` ->
  ``mlp.c_fc/c_proj``, ``post_layernorm`` -> ``ln_post``, ``visual_projection.weight`` transposed -> ``proj``.
  A ``.safetensors`` file is parsed here (an 8-byte header length, a JSON header of dtype/shape/offsets, the
  raw bytes), every entry's extent checked against the file.

Loading is strict: the encoder's keys (:func:`extractors.clip.model.expected_shapes`) must all be there with
their shapes; the text tower's keys are recognised and skipped; any other key is refused. Every refusal is one
:class:`ClipWeightsError` line naming the file and the key. Half-precision tensors (OpenAI's archives hold
fp16 convolution, linear and projection weights) are widened to float32, as ``clip.load`` on a CPU does.

Two settings of the network are not in the weights: the ViT MLP's activation and the attention head count.
:func:`companion_config` reads them from the release's config beside the weights (:data:`COMPANION_FILES`);
:func:`load_clip` takes them from there, from the caller, or from OpenAI's rules where those are known to hold.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import re
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from extractors.clip.model import (
    ACTIVATIONS,
    DEFAULT_HEAD_WIDTH,
    ClipVisionConfig,
    ConfigError,
    build,
    expected_shapes,
    infer_config,
    is_vit,
)
from extractors.weights import strict_mismatch
from pipeline.core.errors import PipelineError
from pipeline.core.fileio import read_json
from pipeline.core.tensor_bounds import BoundsError, check_archive, check_tensors
from pipeline.core.unpickle import RestrictedUnpickler

LAYOUTS = ("openai", "open_clip", "hf")
#: attributes a TorchScript module tree may hold (OpenAI's ViT-L/14 archive holds a few thousand)
MAX_VISITS = 1_000_000
#: top-level names of the text tower in the OpenAI / open_clip state dict (recognised, not loaded); ``text.``:
#: open_clip ``CustomTextCLIP``'s text tower
TEXT_KEYS = re.compile(
    r"^(transformer\..+|text\..+|token_embedding\.weight|positional_embedding|ln_final\.(weight|bias)|"
    r"text_projection|logit_scale|input_resolution|context_length|vocab_size)$"
)
#: the release's config file beside weights of a layout (what :func:`companion_config` reads)
COMPANION_FILES = {"hf": "config.json", "open_clip": "open_clip_config.json"}
#: ViT widths whose released encoders have heads wider than 64 channels (open_clip ``vision_cfg.head_width``:
#: ViT-H/14 1280 / 80, ViT-g/14 1408 / 88, ViT-bigG/14 1664 / 104, 16 heads each): OpenAI's rule is known to be
#: wrong there, so without a config or a head count given these are refused
WIDE_HEAD_WIDTHS = (1280, 1408, 1664)
#: ``transformers.CLIPVisionConfig``'s default head count (what a ``config.json`` without the key runs with)
HF_DEFAULT_HEADS = 12
HF_TEXT_KEYS = re.compile(
    r"^(text_model\..+|text_projection\.weight|logit_scale|vision_model\.embeddings\.position_ids)$"
)
_DTYPES = {
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "DoubleStorage": torch.float64,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip


class ClipWeightsError(PipelineError):
    """A CLIP weights file that cannot be read or does not hold a CLIP image encoder (exit 1)."""


class MissingSettingError(ClipWeightsError):
    """A CLIP file whose ``setting`` (``activation`` or ``heads``) neither a config beside it nor the caller gives,
    where OpenAI's value is known not to hold."""

    def __init__(self, message: str, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


# ------------------------------------------------------------------------------------------------ TorchScript
class _ScriptObject:
    """A TorchScript module or object: ``state`` is its attribute dict (parameters, buffers, submodules), recorded
    by pickle's ``BUILD``; nothing of the class it stands for is imported or run."""

    state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _StorageType:
    def __init__(self, name: str) -> None:
        self.dtype = _DTYPES[name]


class _StorageRef:
    def __init__(self, dtype: torch.dtype, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel


class _TensorRef:
    def __init__(self, storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> None:
        ints = (offset, *size, *stride)
        if not isinstance(storage, _StorageRef) or not all(isinstance(v, int) and v >= 0 for v in ints):
            raise pickle.UnpicklingError("a tensor record without a storage or with negative sizes")
        if len(size) != len(stride):
            raise pickle.UnpicklingError("a tensor record whose shape and strides differ in length")
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)


def _ordered_dict(*args: Any) -> dict:
    if args:
        raise pickle.UnpicklingError("OrderedDict with arguments")
    return {}


def _passthrough(value: Any, *rest: Any) -> Any:
    """``torch.jit._pickle.restore_type_tag`` / ``build_*list``: the value itself."""
    return value


class _ScriptUnpickler(RestrictedUnpickler):
    """:class:`RestrictedUnpickler` for ``data.pkl`` of a TorchScript archive (stand-ins only; nothing imported)."""

    def __init__(self, data: bytes) -> None:
        allowed: dict[tuple[str, str], Any] = {
            ("torch._utils", "_rebuild_tensor_v2"): _TensorRef,
            ("collections", "OrderedDict"): _ordered_dict,
        }
        allowed |= {("torch", name): _StorageType(name) for name in _DTYPES}
        allowed |= {
            ("torch.jit._pickle", n): _passthrough
            for n in ("restore_type_tag", "build_intlist", "build_doublelist", "build_boollist", "build_tensorlist")
        }
        super().__init__(io.BytesIO(data), allowed, encoding="latin-1")
        self.classes: dict[str, type] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "__torch__" or module.startswith("__torch__."):
            if len(self.classes) > 10_000:
                raise pickle.UnpicklingError("too many TorchScript classes")
            return self.classes.setdefault(f"{module}.{name}", type("ScriptClass", (_ScriptObject,), {}))
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if (
            not isinstance(pid, tuple)
            or len(pid) != 5
            or pid[0] != "storage"
            or not isinstance(pid[1], _StorageType)
            or not isinstance(pid[2], str)
            or not isinstance(pid[4], int)
            or pid[4] < 0
        ):
            raise pickle.UnpicklingError(f"unexpected persistent id {str(pid)[:80]}")
        return _StorageRef(pid[1].dtype, pid[2], pid[4])


def _walk(obj: Any, prefix: str, out: dict[str, _TensorRef], seen: list[int], depth: int = 0) -> None:
    """Collect the tensors of the module tree by attribute path; every object visited counts against
    :data:`MAX_VISITS` (an object shared many times over nested levels would otherwise be walked exponentially)."""
    if depth > 64:
        raise pickle.UnpicklingError("module tree nested too deep")
    state = getattr(obj, "state", None) if isinstance(obj, _ScriptObject) else None
    if not isinstance(state, dict):
        return
    for name, value in state.items():
        seen[0] += 1
        if seen[0] > MAX_VISITS:
            raise pickle.UnpicklingError(f"the module tree has more than {MAX_VISITS:,} attributes")
        if isinstance(value, _TensorRef):
            out[prefix + str(name)] = value
        elif isinstance(value, _ScriptObject):
            _walk(value, f"{prefix}{name}.", out, seen, depth + 1)


def is_torchscript(path: Path) -> bool:
    """A zip holding ``<root>/data.pkl`` and ``<root>/code/`` (what ``torch.jit.save`` writes)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
    return any(n.count("/") == 1 and n.endswith("/data.pkl") for n in names) and any("/code/" in n for n in names)


def read_torchscript(path: Path) -> "OrderedDict[str, torch.Tensor]":
    """The tensors of a TorchScript archive by attribute path (``visual.conv1.weight`` ...), built from the
    storages without running the archive's code."""
    try:
        check_archive(path, code=True)
    except BoundsError as exc:
        raise ClipWeightsError(str(exc)) from None
    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
        root = next(n[: -len("data.pkl")] for n in sorted(names) if n.count("/") == 1 and n.endswith("/data.pkl"))
        order = zf.read(root + "byteorder").decode().strip() if root + "byteorder" in names else "little"
        if order != "little":
            raise ClipWeightsError(f"{path}: '{root}byteorder': a {order}-endian archive is not read")
        data = zf.read(root + "data.pkl")
        try:
            tree = _ScriptUnpickler(data).load()
        except Exception as exc:  # a refused global, a malformed record, a truncated pickle
            raise ClipWeightsError(
                f"{path}: '{root}data.pkl' refused (nothing from the file was run): {type(exc).__name__}: {exc}"
            ) from None
        refs: dict[str, _TensorRef] = {}
        try:
            _walk(tree, "", refs, [0])
        except pickle.UnpicklingError as exc:
            raise ClipWeightsError(f"{path}: '{root}data.pkl' refused: {exc}") from None
        storages: dict[str, torch.Tensor] = {}
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        for key, ref in refs.items():
            member = f"{root}data/{ref.storage.key}"
            if ref.storage.key not in storages:
                if member not in names:
                    raise ClipWeightsError(f"{path}: '{key}': its storage '{member}' is not in the archive")
                raw = zf.read(member)
                itemsize = torch.empty((), dtype=ref.storage.dtype).element_size()
                if len(raw) != ref.storage.numel * itemsize:
                    raise ClipWeightsError(
                        f"{path}: '{key}': storage '{member}' holds {len(raw):,} bytes, "
                        f"{ref.storage.numel * itemsize:,} declared"
                    )
                storages[ref.storage.key] = (
                    torch.frombuffer(bytearray(raw), dtype=ref.storage.dtype)
                    if raw
                    else (torch.empty(0, dtype=ref.storage.dtype))
                )
            flat = storages[ref.storage.key]
            extent = ref.offset + sum((s - 1) * st for s, st in zip(ref.size, ref.stride)) + 1
            if 0 not in ref.size and (extent > flat.numel() or math.prod(ref.size) > flat.numel()):
                raise ClipWeightsError(
                    f"{path}: '{key}': shape {list(ref.size)} declares more than its storage of "
                    f"{flat.numel():,} elements holds (zero, overlapping or out-of-range strides)"
                )
            out[key] = torch.as_strided(flat, ref.size, ref.stride, ref.offset).clone()
    return out


# ------------------------------------------------------------------------------------------------ safetensors
def read_safetensors(path: Path) -> "OrderedDict[str, torch.Tensor]":
    """A ``.safetensors`` file: its JSON header checked (dtypes, shapes, offsets inside the data) before reading."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ClipWeightsError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise ClipWeightsError(f"{path}: safetensors header of {n:,} bytes does not fit the file")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ClipWeightsError(f"{path}: safetensors header is not JSON ({exc})") from None
        data = fh.read()
    if not isinstance(header, dict):
        raise ClipWeightsError(f"{path}: safetensors header is not an object")
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[entry["dtype"]]
            shape = [int(s) for s in entry["shape"]]
            start, end = (int(v) for v in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ClipWeightsError(f"{path}: '{key}': malformed or unsupported safetensors entry") from None
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        itemsize = torch.empty((), dtype=dtype).element_size()
        if min(shape, default=0) < 0 or not 0 <= start <= end <= len(data) or end - start != numel * itemsize:
            raise ClipWeightsError(f"{path}: '{key}': its extent [{start}, {end}) does not match shape {shape}")
        raw = bytearray(data[start:end])
        out[key] = (torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)).reshape(shape)
    return out


# ------------------------------------------------------------------------------------------------ layouts
def _hf_to_internal(sd: Mapping[str, torch.Tensor], path: Path) -> "OrderedDict[str, torch.Tensor]":
    """Hugging Face CLIP names -> OpenAI ``visual.`` names (without the prefix); q/k/v concatenated in order."""
    simple = {
        "vision_model.embeddings.class_embedding": "class_embedding",
        "vision_model.embeddings.patch_embedding.weight": "conv1.weight",
        "vision_model.embeddings.position_embedding.weight": "positional_embedding",
        "vision_model.pre_layrnorm.weight": "ln_pre.weight",
        "vision_model.pre_layrnorm.bias": "ln_pre.bias",
        "vision_model.post_layernorm.weight": "ln_post.weight",
        "vision_model.post_layernorm.bias": "ln_post.bias",
    }
    parts = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
             "self_attn.out_proj": "attn.out_proj"}  # fmt: skip
    layer = re.compile(r"^vision_model\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        m = layer.match(key)
        if key in simple:
            out[simple[key]] = value
        elif key == "visual_projection.weight":
            out["proj"] = value.t().contiguous() if value.dim() == 2 else value
        elif m and m.group(2) in parts:
            out[f"transformer.resblocks.{m.group(1)}.{parts[m.group(2)]}.{m.group(3)}"] = value
        elif m and m.group(2) in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            qkv.setdefault((int(m.group(1)), m.group(3)), {})[m.group(2)[10]] = value
        elif not HF_TEXT_KEYS.match(key):
            raise ClipWeightsError(f"{path} (hf): unexpected key '{key}'")
    for (i, kind), group in sorted(qkv.items()):
        for p in "qkv":
            if p not in group:
                raise ClipWeightsError(
                    f"{path} (hf): missing key 'vision_model.encoder.layers.{i}.self_attn.{p}_proj.{kind}'"
                )
        if len({tuple(t.shape) for t in group.values()}) != 1:
            raise ClipWeightsError(f"{path} (hf): layer {i} q/k/v projections differ in shape")
        out[f"transformer.resblocks.{i}.attn.in_proj_{kind}"] = torch.cat([group[p] for p in "qkv"], dim=0)
    return out


def _hf_name(key: str) -> str:
    """The Hugging Face name of an internal key (for messages)."""
    reverse = {"class_embedding": "vision_model.embeddings.class_embedding", "conv1.weight":
               "vision_model.embeddings.patch_embedding.weight", "positional_embedding":
               "vision_model.embeddings.position_embedding.weight", "proj": "visual_projection.weight"}  # fmt: skip
    if key in reverse:
        return reverse[key]
    key = key.replace("ln_pre.", "vision_model.pre_layrnorm.").replace("ln_post.", "vision_model.post_layernorm.")
    key = key.replace("transformer.resblocks.", "vision_model.encoder.layers.").replace("ln_1", "layer_norm1")
    key = key.replace("ln_2", "layer_norm2").replace("mlp.c_fc", "mlp.fc1").replace("mlp.c_proj", "mlp.fc2")
    return key.replace("attn.in_proj_", "self_attn.q_proj.").replace("attn.out_proj", "self_attn.out_proj")


def _visual_subtree(sd: Mapping[str, torch.Tensor], path: Path, layout: str) -> "OrderedDict[str, torch.Tensor]":
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, value in sd.items():
        if key.startswith("visual."):
            out[key[len("visual.") :]] = value
        elif not TEXT_KEYS.match(key):
            raise ClipWeightsError(f"{path} ({layout}): unexpected key '{key}'")
    if not out:
        raise ClipWeightsError(f"{path} ({layout}): no 'visual.' keys (not a CLIP checkpoint)")
    return out


def _torch_load(path: Path) -> Any:
    """``torch.load(weights_only=True)`` after the archive bounds (which refuse TorchScript archives); one line
    naming the file for anything torch cannot read."""
    try:
        check_archive(path)
    except BoundsError as exc:
        raise ClipWeightsError(f"{exc} (nothing read from the CLIP weights file)") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for truncated, foreign or unsafe files
        lines = str(exc).strip().splitlines()
        raise ClipWeightsError(
            f"{path}: not a readable CLIP weights file ({type(exc).__name__}: {(lines[0] if lines else '')[:160]})"
        ) from None


def read_clip(path: str | Path) -> tuple[str, "OrderedDict[str, torch.Tensor]"]:
    """(layout, encoder state dict with OpenAI names, no ``visual.`` prefix, float32) of a CLIP weights file."""
    path = Path(path)
    if not path.is_file():
        raise ClipWeightsError(f"CLIP weights file not found: {path}")
    if is_torchscript(path):
        layout, raw = "openai", read_torchscript(path)
    elif path.suffix == ".safetensors":
        raw = read_safetensors(path)
        layout = "hf" if any(k.startswith("vision_model.") for k in raw) else "open_clip"
    else:
        obj = _torch_load(path)
        if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
            obj = obj["state_dict"]
        if not isinstance(obj, Mapping) or not obj or not all(isinstance(k, str) for k in obj):
            raise ClipWeightsError(f"{path}: holds no state dict (a mapping of names to tensors)")
        if all(k.startswith("module.") for k in obj):
            obj = {k[len("module.") :]: v for k, v in obj.items()}
        bad = next((k for k, v in obj.items() if not torch.is_tensor(v)), None)
        if bad is not None:
            raise ClipWeightsError(f"{path}: key '{bad}' is a {type(obj[bad]).__name__}, not a tensor")
        raw = OrderedDict(obj)
        layout = "hf" if any(k.startswith("vision_model.") for k in raw) else "open_clip"
    try:
        check_tensors(path, raw.items())
    except BoundsError as exc:
        raise ClipWeightsError(str(exc)) from None
    sd = _hf_to_internal(raw, path) if layout == "hf" else _visual_subtree(raw, path, layout)
    return layout, OrderedDict((k, v.float() if v.is_floating_point() else v) for k, v in sd.items())


def check_strict(path: Path, layout: str, sd: Mapping[str, torch.Tensor], cfg: ClipVisionConfig) -> None:
    """Every key of ``cfg``'s encoder present with its shape, nothing else (BatchNorm's ``num_batches_tracked``
    may be absent: it does not enter the forward pass)."""
    name = _hf_name if layout == "hf" else (lambda k: f"visual.{k}")
    mismatch = strict_mismatch(sd, expected_shapes(cfg), lambda k: k.endswith("num_batches_tracked"), name)
    if mismatch is not None:
        raise ClipWeightsError(f"{path} ({layout}): {mismatch}")


@dataclass(frozen=True)
class Companion:
    """What the release's config beside a weights file says of its image encoder: ``file`` (its name),
    ``activation`` of the ViT MLP, ``heads`` (a head count) or ``head_width`` (channels per head), 0 when the file
    does not say, and ``heads_key``: the config key the head count or width was read from."""

    file: str
    activation: str
    heads: int = 0
    head_width: int = 0
    heads_key: str = ""


def _positive(value: Any, key: str, cfg_path: Path) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ClipWeightsError(f"{cfg_path}: '{key}' must be a positive integer, not {value!r}")
    return value


def companion_config(path: Path, layout: str) -> Companion | None:
    """What the release's config beside the weights (:data:`COMPANION_FILES`) says, None when there is none
    (OpenAI's archives have none: they all use ``quick_gelu`` and 64-wide heads).

    * Hugging Face ``config.json`` (``vision_config``, or the top level of a ``CLIPVisionConfig``): ``hidden_act``
      (absent: transformers' default ``quick_gelu``) and ``num_attention_heads`` (absent: transformers' default 12,
      which ``save_pretrained`` leaves out of the file when it holds).
    * open_clip ``open_clip_config.json`` (``model_cfg``): ``quick_gelu`` (absent: ``gelu``, open_clip's default)
      and ``vision_cfg.head_width`` (absent: 64, open_clip's default).

    A value of the wrong kind is refused in one line naming the config file."""
    name = COMPANION_FILES.get(layout)
    cfg_path = path.with_name(name) if name else None
    if cfg_path is None or not cfg_path.is_file():
        return None
    try:
        data = read_json(cfg_path, what="CLIP config")
    except PipelineError as exc:
        raise ClipWeightsError(str(exc)) from None
    heads = head_width = 0
    key = ""
    if layout == "hf":
        prefix = "vision_config." if "vision_config" in data else ""
        vision = data.get("vision_config", data)
        if not isinstance(vision, dict):
            raise ClipWeightsError(f"{cfg_path}: 'vision_config' is not a mapping")
        act = vision.get("hidden_act", "quick_gelu")
        key = f"{prefix}num_attention_heads"
        heads = _positive(vision.get("num_attention_heads", HF_DEFAULT_HEADS), key, cfg_path)
    else:
        model_cfg = data.get("model_cfg")
        quick = model_cfg.get("quick_gelu", False) if isinstance(model_cfg, dict) else None
        act = {True: "quick_gelu", False: "gelu"}.get(quick) if isinstance(quick, bool) else None
        vision = model_cfg.get("vision_cfg", {}) if isinstance(model_cfg, dict) else {}
        if not isinstance(vision, dict):
            raise ClipWeightsError(f"{cfg_path}: 'model_cfg.vision_cfg' is not a mapping")
        key = "model_cfg.vision_cfg.head_width"
        head_width = _positive(vision.get("head_width", DEFAULT_HEAD_WIDTH), key, cfg_path)
    if act not in ACTIVATIONS:
        raise ClipWeightsError(
            f"{cfg_path}: the image encoder's activation {act!r} is not one of {', '.join(ACTIVATIONS)}"
        )
    return Companion(cfg_path.name, act, heads, head_width, key)


def resolve_activation(path: Path, layout: str, vit: bool, found: Companion | None, given: str | None):
    """(activation, where it came from): the one given (refused when the config beside the file says another),
    else the config's, else OpenAI's ``quick_gelu`` (OpenAI's archives; transformers' default). An open_clip ViT
    without its config is refused: open_clip's default is ``gelu`` while its OpenAI-pretrained files use
    ``quick_gelu``, and nothing in the weights tells them apart."""
    if given is not None and given not in ACTIVATIONS:
        raise ClipWeightsError(f"{path}: activation {given!r} is not one of {', '.join(ACTIVATIONS)}")
    if given is not None and found is not None and found.activation != given:
        raise ClipWeightsError(f"{path}: activation {given!r} was asked for but {found.file} says {found.activation!r}")
    if given is not None:
        return given, "given"
    if found is not None:
        return found.activation, found.file
    if layout == "open_clip" and vit:
        name = COMPANION_FILES[layout]
        raise MissingSettingError(
            f"{path} ({layout}): the ViT's MLP activation is not in the weights and no {name} sits beside them "
            f"(open_clip's default is gelu, its OpenAI-pretrained files use quick_gelu): put the release's {name} "
            f"there or give the activation: {' | '.join(ACTIVATIONS)}",
            "activation",
        )
    return "quick_gelu", "default (OpenAI's quick_gelu)"


def _resolve_heads(path: Path, layout: str, shape: ClipVisionConfig, found: Companion | None, given: int | None):
    """(channels per head, 0 for OpenAI's 64, and where the head count came from) for the encoder of ``shape``;
    every head count is checked to divide the attention channels, a count given against the config's is refused."""
    channels = shape.grid_dim
    if given is not None and (not isinstance(given, int) or isinstance(given, bool) or given < 1):
        raise ClipWeightsError(f"{path}: the head count must be a positive integer, not {given!r}")
    said = found is not None and bool(found.heads or found.head_width)
    if said:
        value = found.heads or found.head_width
        if channels % value:
            raise ClipWeightsError(
                f"{path.with_name(found.file)}: '{found.heads_key}' {value} does not divide the {channels} attention "
                f"channels of {path.name}"
            )
        width = channels // found.heads if found.heads else found.head_width
        if given is not None and channels // width != given:
            raise ClipWeightsError(
                f"{path}: {given} attention heads were asked for but {found.file} says {channels // width}"
            )
        return width, found.file
    if given is not None:
        if channels % given:
            raise ClipWeightsError(f"{path}: {given} attention heads do not divide its {channels} attention channels")
        return channels // given, "given"
    if shape.kind == "vit" and channels in WIDE_HEAD_WIDTHS:
        name = COMPANION_FILES.get(layout, " or ".join(COMPANION_FILES.values()))
        raise MissingSettingError(
            f"{path} ({layout}): the head count of a ViT {channels} wide cannot be known without the release's "
            f"{name} (the ViT-H/14, g/14 and bigG/14 releases have 16 heads, not {channels // DEFAULT_HEAD_WIDTH}): "
            "put it beside the weights or give the heads",
            "heads",
        )
    if channels % DEFAULT_HEAD_WIDTH:
        raise MissingSettingError(
            f"{path} ({layout}): its {channels} attention channels do not split into OpenAI's 64-wide heads and no "
            "config beside the weights names the head count: give the heads",
            "heads",
        )
    return 0, "default (OpenAI's 64-wide heads)"


def load_clip(
    path: str | Path, activation: str | None = None, device: str | torch.device = "cpu", heads: int | None = None
):
    """Read, check strictly and load a CLIP weights file -> (encoder module, info dict: layout, config, where the
    activation and the head count came from). ``activation`` and ``heads`` None take them from the release's config
    beside the file (:func:`companion_config`), else OpenAI's ``quick_gelu`` and 64-wide heads; a value given that
    contradicts that config is refused. Refused as well, before any encoder is built: an open_clip ViT without its
    config or an activation given, and a ViT of a width in :data:`WIDE_HEAD_WIDTHS` without a head count."""
    path = Path(path)
    layout, sd = read_clip(path)
    found = companion_config(path, layout)
    act, act_source = resolve_activation(path, layout, is_vit(sd), found, activation)
    try:
        shape = infer_config(sd, act, head_width=1)  # the shapes only; the heads are settled below
    except (ConfigError, ValueError) as exc:
        raise ClipWeightsError(f"{path} ({layout}): not a CLIP image encoder: {exc}") from None
    head_width, heads_source = _resolve_heads(path, layout, shape, found, heads)
    cfg = shape.with_(head_width=head_width)
    check_strict(path, layout, sd, cfg)
    model = build(cfg)
    model.load_state_dict(sd, strict=False)
    info = {"layout": layout, "config": cfg, "weights_file": path.name, "activation_from": act_source}
    return model.to(device), info | {"heads_from": heads_source}
