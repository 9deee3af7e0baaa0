"""The released Meshed-Memory Transformer (aimagelab/meshed-memory-transformer): ``meshed_memory_transformer.pth``
plus ``vocab.pkl``, mapped onto this project's ``m2`` captioner (:mod:`models.captioners.m2`).

The release (Cornia et al., CVPR 2020; ``test.py``) builds ``Transformer(<bos>, MemoryAugmentedEncoder(3, 0,
m=40), MeshedDecoder(len(vocab), 54, 3, <pad>))`` and loads ``torch.load(...)['state_dict']``. The mapping:

Parameters (``L`` encoder layers, ``i`` layer index; shapes at d = 512, m = 40, V = 10,201)::

    encoder.fc.{weight,bias}                           -> encoder.fc.*            (512, 2048)
    encoder.layer_norm.*                               -> encoder.norm.*
    encoder.layers.i.mhatt.attention.{fc_q,fc_k,fc_v,fc_o}.*, .m_k, .m_v  -> encoder.attn.i.attention.*
    encoder.layers.i.mhatt.layer_norm.*                -> encoder.attn.i.norm.*
    encoder.layers.i.pwff.{fc1,fc2,layer_norm}.*       -> encoder.ff.i.{fc1,fc2,norm}.*
    decoder.word_emb.weight                            -> word_emb.weight          rows permuted (below)
    decoder.pos_emb.weight                             -> pos_emb.weight           (55, 512): the release's frozen table
    decoder.layers.i.self_att.{attention.*,layer_norm.*} -> layers.i.self_attn.{attention.*,norm.*}
    decoder.layers.i.enc_att.{attention.*,layer_norm.*}  -> layers.i.cross_attn.{attention.*,norm.*}
    decoder.layers.i.fc_alpha{1,2,3}.*                 -> layers.i.gates.{0,1,2}.*
    decoder.layers.i.pwff.{fc1,fc2,layer_norm}.*       -> layers.i.ff.{fc1,fc2,norm}.*
    decoder.fc.weight                                  -> out.weight               rows permuted (below), no bias

The decoding-state buffers the release registers (``decoder.running_mask_self_attention``,
``decoder.running_seq``, ``decoder.layers.i.self_att.running_keys`` / ``running_values``) are empty and ignored.

Vocabulary: ``vocab.pkl``'s ``itos`` starts ``<unk> <pad> <bos> <eos>`` (ids 0-3); this project's order is
``<pad> <bos> <eos> <unk>``, so the word list is ``itos[1:4] + itos[0:1] + itos[4:]`` and embedding / output
row ``j`` is the release's row ``[1, 2, 3, 0, 4, 5, ...][j]``; every other word keeps its row.

Parity switches set here: ``official_mask: true`` (the release's encoder mask masks nothing) and
``fixed_regions: 50`` (its data field gives exactly the first 50 detections, zero-padded); heads = 8 (the release
ignores ``--head``); ``max_len`` = position-table rows - 1 (54). Paper decoding: beam 5, 20 steps, the release's
own search (``stop_rule: official_m2``) and its evaluation's collapse of repeated words (``test.py``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from models.released.unpickle import (
    M2VocabStandIn,
    _counter,
    _defaultdict,
    _m2_unk_index,
    need_tensors,
    restricted_load,
)
from pipeline.core.errors import UsageError
from pipeline.core.vocab import SPECIALS

NAME = "m2"
RELEASE_SPECIALS = ("<unk>", "<pad>", "<bos>", "<eos>")
ROW_ORDER = (1, 2, 3, 0)  # this project's special row j comes from the release's row ROW_ORDER[j]
MARKER = "decoder.layers.0.fc_alpha1.weight"

#: the only globals vocab.pkl may name, each bound to a stand-in (models.released.unpickle)
VOCAB_GLOBALS = {
    ("data.vocab", "Vocab"): M2VocabStandIn,
    ("data.vocab", "_default_unk_index"): _m2_unk_index,
    ("collections", "Counter"): _counter,
    ("collections", "defaultdict"): _defaultdict,
}

DECODING = {
    "method": "beam",
    "beam_size": 5,
    "max_len": 20,
    "length_penalty": 0.0,
    "block_trigrams": False,
    "stop_rule": "official_m2",
    "collapse_repeats": True,
}
FEATURES = {
    "recipe": "caffe",
    "boxes": "adaptive",
    "max_boxes": 50,
    "note": "Caffe bottom-up features, the first 50 detections (M2's data field)",
}

_RENAMES = [
    (r"^encoder\.layer_norm\.", "encoder.norm."),
    (r"^encoder\.layers\.(\d+)\.mhatt\.attention\.", r"encoder.attn.\1.attention."),
    (r"^encoder\.layers\.(\d+)\.mhatt\.layer_norm\.", r"encoder.attn.\1.norm."),
    (r"^encoder\.layers\.(\d+)\.pwff\.layer_norm\.", r"encoder.ff.\1.norm."),
    (r"^encoder\.layers\.(\d+)\.pwff\.", r"encoder.ff.\1."),
    (r"^decoder\.layers\.(\d+)\.self_att\.layer_norm\.", r"layers.\1.self_attn.norm."),
    (r"^decoder\.layers\.(\d+)\.self_att\.", r"layers.\1.self_attn."),
    (r"^decoder\.layers\.(\d+)\.enc_att\.layer_norm\.", r"layers.\1.cross_attn.norm."),
    (r"^decoder\.layers\.(\d+)\.enc_att\.", r"layers.\1.cross_attn."),
    (r"^decoder\.layers\.(\d+)\.pwff\.layer_norm\.", r"layers.\1.ff.norm."),
    (r"^decoder\.layers\.(\d+)\.pwff\.", r"layers.\1.ff."),
    (r"^decoder\.layers\.(\d+)\.fc_alpha(\d)\.", None),  # gates: index shifts by one (below)
    (r"^decoder\.word_emb\.", "word_emb."),
    (r"^decoder\.pos_emb\.", "pos_emb."),
    (r"^decoder\.fc\.", "out."),
]
_STATE_BUFFERS = re.compile(
    r"^decoder\.(running_mask_self_attention|running_seq|layers\.\d+\.self_att\.running_(keys|values))$"
)


#: converted (renamed) tensors the conversion reads, with their number of dimensions
REQUIRED_WEIGHTS = {
    "encoder.fc.weight": 2,
    "encoder.ff.0.fc1.weight": 2,
    "encoder.attn.0.attention.m_k": 3,
    "pos_emb.weight": 2,
}


def is_release(obj: Any) -> bool:
    """A ``torch.load``-ed object is M2's checkpoint: a dict whose ``state_dict`` has the meshed gates."""
    return isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict) and MARKER in obj["state_dict"]


def read_vocab(path: str | Path) -> list[str]:
    """``vocab.pkl`` (a pickled ``data.vocab.Vocab``) -> its ``itos`` word list, through the restricted unpickler."""
    obj = restricted_load(path, VOCAB_GLOBALS, "M2 vocab.pkl")
    itos = obj.get("itos") if isinstance(obj, dict) and obj.get("__stand_in__") == "data.vocab.Vocab" else None
    if not isinstance(itos, list) or not all(isinstance(w, str) for w in itos):
        raise UsageError(f"{path}: not M2's vocab.pkl (no Vocab object with an 'itos' word list)")
    if tuple(itos[:4]) != RELEASE_SPECIALS or len(set(itos)) != len(itos):
        raise UsageError(f"{path}: M2's vocabulary must start with {' '.join(RELEASE_SPECIALS)} and have no duplicates")
    return itos


def project_words(itos: list[str]) -> list[str]:
    """The release's word list in this project's order (``<pad> <bos> <eos> <unk>`` first)."""
    return [itos[i] for i in ROW_ORDER] + itos[4:]


def row_order(vocab_size: int) -> torch.Tensor:
    """Release row of every project row: ``[1, 2, 3, 0, 4, 5, ...]``."""
    return torch.tensor(list(ROW_ORDER) + list(range(4, vocab_size)), dtype=torch.long)


def _rename(key: str) -> str | None:
    for pattern, target in _RENAMES:
        m = re.match(pattern, key)
        if not m:
            continue
        if target is None:  # fc_alphaN -> gates.(N-1)
            return f"layers.{m.group(1)}.gates.{int(m.group(2)) - 1}." + key[m.end() :]
        return re.sub(pattern, target, key)
    return key if key.startswith("encoder.fc.") else None


def convert(ckpt: dict[str, Any], itos: list[str], source: str) -> dict[str, Any]:
    """The native checkpoint payload (``models.checkpoints``) of M2's checkpoint ``ckpt`` and vocabulary ``itos``."""
    release = ckpt["state_dict"]
    weights: dict[str, torch.Tensor] = {}
    for key, value in release.items():
        if _STATE_BUFFERS.match(key):
            continue
        new = _rename(key)
        if new is None or not torch.is_tensor(value):
            raise UsageError(f"{source}: unexpected entry '{key}' in M2's state_dict")
        weights[new] = value.detach().float().clone()
    vocab_size = len(itos)
    rows = row_order(vocab_size)
    for name in ("word_emb.weight", "out.weight"):
        if name not in weights or weights[name].shape[0] != vocab_size:
            got = tuple(weights[name].shape) if name in weights else "missing"
            raise UsageError(f"{source}: {name} has shape {got}, but vocab.pkl has {vocab_size} words")
        weights[name] = weights[name][rows].clone()
    need_tensors(weights, REQUIRED_WEIGHTS, source, "M2")
    enc_layers = len({k.split(".")[2] for k in weights if k.startswith("encoder.attn.")})
    dec_layers = len({k.split(".")[1] for k in weights if k.startswith("layers.")})
    if enc_layers != 3:
        raise UsageError(
            f"{source}: M2's decoder reads exactly 3 encoder levels; this checkpoint has {enc_layers} encoder layers"
        )
    d_model, feat_dim = weights["encoder.fc.weight"].shape
    config = {
        "feat_dim": int(feat_dim),
        "d_model": int(d_model),
        "num_heads": 8,
        "d_ff": int(weights["encoder.ff.0.fc1.weight"].shape[0]),
        "num_layers": enc_layers,
        "num_dec_layers": dec_layers,
        "num_memory": int(weights["encoder.attn.0.attention.m_k"].shape[1]),
        "dropout": 0.1,
        "max_len": int(weights["pos_emb.weight"].shape[0]) - 1,
        "official_mask": True,
        "official_init": True,
        "fixed_regions": FEATURES["max_boxes"],
    }
    if tuple(project_words(itos)[:4]) != SPECIALS:
        raise UsageError(f"{source}: vocabulary specials do not map onto {SPECIALS}")
    return {
        "name": NAME,
        "config": config,
        "vocab": project_words(itos),
        "weights": weights,
        "decoding": dict(DECODING),
        "features": dict(FEATURES),
    }
