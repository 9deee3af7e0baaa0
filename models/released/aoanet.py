"""The released AoANet (husthuaan/AoANet): ``model-best.pth`` (a state_dict) plus ``infos_*.pkl``, mapped onto this
project's ``aoa`` captioner (:mod:`models.captioners.aoa`).

``infos_*.pkl`` (written by the release's ``train.py``) is a dict whose ``opt`` is an ``argparse.Namespace`` of the
training options and whose ``vocab`` maps index strings ``'1'..'V'`` to words (index 0 is shared by BOS, EOS and
PAD; the last index is the ``UNK`` word). It is read through the restricted unpickler (Namespace rebuilt as a
dict; NumPy scalars such as ``best_val_score`` decoded from their bytes). The options choose the architecture:

* ``caption_model aoa``, ``use_multi_head 2``, ``multi_head_scale 1``, ``decoder_type AoA``, ``refine_aoa 1``,
  ``mean_feats 1``, ``use_bn 0``, ``logit_layers 1``, ``norm_att_feat 0``, ``use_box 0``, ``out_res 0`` and
  ``input_encoding_size == rnn_size`` are what :mod:`models.captioners.aoa` implements (anything else is refused);
* ``rnn_size`` -> ``d_model``, ``num_heads``, ``att_feat_size`` -> ``feat_dim``, ``refine`` -> 6 refiner layers or 0,
  ``use_ff`` (FFN width 2048), ``drop_prob_lm``, ``dropout_aoa``, ``ctx_drop``.

Parameters (``i`` refiner layer)::

    att_embed.0.*                                   -> att_embed.0.*
    refiner.layers.i.sublayer.0.norm.{a_2,b_2}      -> refiner.i.norm.{a,b}
    refiner.layers.i.self_attn.linears.{0,1,2}.*    -> refiner.i.{q,k,v}.*        (zip order query, key, value)
    refiner.layers.i.self_attn.aoa_layer.0.*        -> refiner.i.aoa.linear.*
    refiner.layers.i.sublayer.1.norm.{a_2,b_2}      -> refiner.i.ff_norm.{a,b}    (use_ff only)
    refiner.layers.i.feed_forward.{w_1,w_2}.*       -> refiner.i.ff.{w_1,w_2}.*   (use_ff only)
    refiner.norm.{a_2,b_2}                          -> refiner_norm.{a,b}
    ctx2att.*                                       -> ctx2att.*                  (first half values, second keys)
    core.att_lstm.*                                 -> lstm.*
    core.attention.norm.{a_2,b_2}                   -> query_norm.{a,b}
    core.attention.linears.0.*                      -> query_proj.*
    core.att2ctx.0.*                                -> att2ctx.linear.*
    embed.0.weight                                  -> embed.0.weight             rows mapped (below)
    logit.{weight,bias}                             -> logit.*                    rows mapped (below)

Vocabulary: the release has ``V + 1`` rows: 0 (BOS = EOS = PAD), words ``1 .. V-1``, ``V`` (UNK). This project's
rows are ``<pad> <bos> <eos> <unk>`` then the words, so embedding row ``j`` is the release's row
``[0, 0, 0, V, 1, 2, ..., V-1][j]``; output rows ``<eos>`` <- 0, ``<unk>`` <- V, words as the embedding, and
``<pad>`` / ``<bos>``, which the release cannot output, get a zero weight row and a -1e30 bias (probability 0,
so the log-softmax over the other rows equals the release's). Paper decoding: beam 2, 20 steps, the release's
search (``stop_rule: official_aoanet``, which lowers ``<unk>`` by 1000 as the release does with its last index).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from models.released.unpickle import COMMON, NUMPY, NamespaceStandIn, need_tensors, restricted_load
from pipeline.core.errors import UsageError

NAME = "aoa"
MARKERS = ("core.att_lstm.weight_ih", "att_embed.0.weight", "core.att2ctx.0.weight")
#: converted (renamed) tensors the conversion reads: each must be there, two-dimensional (biases one-dimensional)
REQUIRED_WEIGHTS = {"embed.0.weight": 2, "logit.weight": 2, "logit.bias": 1, "att_embed.0.weight": 2}
NEVER = -1e30  # bias of the rows the release cannot output

INFOS_GLOBALS = {("argparse", "Namespace"): NamespaceStandIn, **COMMON, **NUMPY}

#: options that must have these values (what models.captioners.aoa implements); the release's opts.py defaults when
#: absent
REQUIRED = {
    "caption_model": "aoa",
    "use_multi_head": 2,
    "multi_head_scale": 1,
    "decoder_type": "AoA",
    "refine_aoa": 1,
    "mean_feats": 1,
    "use_bn": 0,
    "logit_layers": 1,
    "norm_att_feat": 0,
    "use_box": 0,
    "out_res": 0,
}
DECODING = {
    "method": "beam",
    "beam_size": 2,
    "max_len": 20,
    "length_penalty": 0.0,
    "block_trigrams": False,
    "stop_rule": "official_aoanet",
    "suppress_unk": True,
}  # suppress_unk: for the other stop rules
FEATURES = {
    "recipe": "caffe",
    "boxes": "adaptive",
    "max_boxes": None,
    "note": "Caffe bottom-up features, adaptive 10-100 regions (cocobu)",
}

_RENAMES = [
    (r"^refiner\.layers\.(\d+)\.sublayer\.0\.norm\.a_2$", r"refiner.\1.norm.a"),
    (r"^refiner\.layers\.(\d+)\.sublayer\.0\.norm\.b_2$", r"refiner.\1.norm.b"),
    (r"^refiner\.layers\.(\d+)\.sublayer\.1\.norm\.a_2$", r"refiner.\1.ff_norm.a"),
    (r"^refiner\.layers\.(\d+)\.sublayer\.1\.norm\.b_2$", r"refiner.\1.ff_norm.b"),
    (r"^refiner\.layers\.(\d+)\.self_attn\.linears\.0\.", r"refiner.\1.q."),
    (r"^refiner\.layers\.(\d+)\.self_attn\.linears\.1\.", r"refiner.\1.k."),
    (r"^refiner\.layers\.(\d+)\.self_attn\.linears\.2\.", r"refiner.\1.v."),
    (r"^refiner\.layers\.(\d+)\.self_attn\.aoa_layer\.0\.", r"refiner.\1.aoa.linear."),
    (r"^refiner\.layers\.(\d+)\.feed_forward\.", r"refiner.\1.ff."),
    (r"^refiner\.norm\.a_2$", "refiner_norm.a"),
    (r"^refiner\.norm\.b_2$", "refiner_norm.b"),
    (r"^core\.att_lstm\.", "lstm."),
    (r"^core\.attention\.norm\.a_2$", "query_norm.a"),
    (r"^core\.attention\.norm\.b_2$", "query_norm.b"),
    (r"^core\.attention\.linears\.0\.", "query_proj."),
    (r"^core\.att2ctx\.0\.", "att2ctx.linear."),
    (r"^(att_embed\.0|ctx2att|embed\.0|logit)\.", r"\1."),
]


def unwrap(obj: Any) -> Any:
    """A state_dict saved from ``nn.DataParallel`` has every key prefixed ``module.``: drop the prefix."""
    if isinstance(obj, dict) and obj and all(isinstance(k, str) and k.startswith("module.") for k in obj):
        return {k[len("module.") :]: v for k, v in obj.items()}
    return obj


def is_release(obj: Any) -> bool:
    """A ``torch.load``-ed object is AoANet's ``model-best.pth``: a flat state_dict with its decoder core."""
    obj = unwrap(obj)
    return isinstance(obj, dict) and all(m in obj for m in MARKERS)


def read_infos(path: str | Path) -> dict[str, Any]:
    """``infos_*.pkl`` -> ``{"opt": {...}, "vocab": {"1": word, ...}, ...}`` through the restricted unpickler."""
    infos = restricted_load(path, INFOS_GLOBALS, "AoANet infos pickle")
    opt = infos.get("opt") if isinstance(infos, dict) else None
    if not isinstance(opt, dict) or opt.get("__stand_in__") != "argparse.Namespace":
        raise UsageError(f"{path}: not an AoANet infos pickle (no 'opt' namespace)")
    vocab = infos.get("vocab")
    if (
        not isinstance(vocab, dict)
        or not vocab
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in vocab.items())
    ):
        raise UsageError(f"{path}: not an AoANet infos pickle (no 'vocab' mapping of index strings to words)")
    # compared as text, never converted with int(): a key like '²' (isdigit, not int) or of 5,000 digits is just wrong
    if set(vocab) != {str(i) for i in range(1, len(vocab) + 1)}:
        odd = next(
            (
                k
                for k in vocab
                if not (k.isascii() and k.isdigit() and 1 <= len(k) <= 9 and str(int(k)) == k and int(k) <= len(vocab))
            ),
            None,
        )
        shown = f" (e.g. {odd[:20]!r}{'...' if odd and len(odd) > 20 else ''})" if odd is not None else ""
        raise UsageError(f"{path}: the vocab keys must be '1'..'{len(vocab)}' (index 0 is BOS/EOS/PAD){shown}")
    return {**infos, "opt": {k: v for k, v in opt.items() if k != "__stand_in__"}}


def project_words(vocab: dict[str, str]) -> list[str]:
    """``<pad> <bos> <eos> <unk>`` then the release's words ``1 .. V-1`` (its last word ``V`` is the UNK)."""
    words = [vocab[str(i)] for i in range(1, len(vocab))]
    return ["<pad>", "<bos>", "<eos>", "<unk>", *words]


def _check_options(opt: dict[str, Any], source: str) -> None:
    for key, want in REQUIRED.items():
        got = opt.get(key, want)
        if got != want:
            raise UsageError(
                f"{source}: AoANet option {key}={got!r} is not supported here "
                f"(models.captioners.aoa implements {key}={want!r})"
            )
    if opt.get("input_encoding_size", opt.get("rnn_size")) != opt.get("rnn_size"):
        raise UsageError(
            f"{source}: input_encoding_size must equal rnn_size "
            f"(got {opt.get('input_encoding_size')} and {opt.get('rnn_size')})"
        )


def _rename(key: str) -> str | None:
    for pattern, target in _RENAMES:
        if re.match(pattern, key):
            return re.sub(pattern, target, key)
    return None


def _map_rows(weights: dict[str, torch.Tensor], v: int) -> None:
    """Embedding rows ``[0, 0, 0, V, 1..V-1]``; output rows ``<eos>`` 0, ``<unk>`` V, words; PAD/BOS impossible."""
    rows = torch.tensor([0, 0, 0, v, *range(1, v)], dtype=torch.long)
    weights["embed.0.weight"] = weights["embed.0.weight"][rows].clone()
    w, b = weights["logit.weight"][rows].clone(), weights["logit.bias"][rows].clone()
    w[:2] = 0.0
    b[:2] = NEVER
    weights["logit.weight"], weights["logit.bias"] = w, b


def convert(state: dict[str, Any], infos: dict[str, Any], source: str) -> dict[str, Any]:
    """The native checkpoint payload of AoANet's state_dict ``state`` and infos ``infos``."""
    opt = infos["opt"]
    _check_options(opt, source)
    weights: dict[str, torch.Tensor] = {}
    for key, value in unwrap(state).items():
        new = _rename(key)
        if new is None or not torch.is_tensor(value):
            raise UsageError(f"{source}: unexpected entry '{key}' in AoANet's state_dict")
        weights[new] = value.detach().float().clone()
    need_tensors(weights, REQUIRED_WEIGHTS, source, "AoANet")
    v = len(infos["vocab"])
    if weights["embed.0.weight"].shape[0] != v + 1 or weights["logit.weight"].shape[0] != v + 1:
        raise UsageError(
            f"{source}: the embedding has {weights['embed.0.weight'].shape[0]} rows, "
            f"the infos vocabulary {v} words (+1)"
        )
    _map_rows(weights, v)
    layers = len({k.split(".")[1] for k in weights if re.match(r"^refiner\.\d+\.", k)})
    d_model, feat_dim = weights["att_embed.0.weight"].shape
    use_ff = any(".ff." in k for k in weights)
    config = {
        "feat_dim": int(feat_dim),
        "d_model": int(d_model),
        "num_heads": int(opt.get("num_heads", 8)),
        "num_layers": layers,
        "use_ff": use_ff,
        "d_ff": int(need_tensors(weights, {"refiner.0.ff.w_1.weight": 2}, source, "AoANet")[0].shape[0])
        if use_ff
        else 2048,
        "drop_prob_lm": float(opt.get("drop_prob_lm", 0.5)),
        "dropout_aoa": float(opt.get("dropout_aoa", 0.3)),
        "ctx_drop": bool(opt.get("ctx_drop", 0)),
    }
    if opt.get("rnn_size", d_model) != d_model or (layers not in (0, 6)) or bool(opt.get("refine", 1)) != (layers > 0):
        raise UsageError(
            f"{source}: the weights (d={d_model}, {layers} refiner layers) do not fit the infos options "
            f"(rnn_size={opt.get('rnn_size')}, refine={opt.get('refine')})"
        )
    decoding = dict(DECODING)  # eval.py: beam_size 2 and max_length 20 are eval options, not taken from infos
    return {
        "name": NAME,
        "config": config,
        "vocab": project_words(infos["vocab"]),
        "weights": weights,
        "decoding": decoding,
        "features": dict(FEATURES),
    }
