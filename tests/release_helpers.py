"""Random-weight files in the exact layouts of the released M2 and AoANet captioners (tests only).

The module trees below mirror the attribute names of the releases' classes (aimagelab/meshed-memory-transformer
``models/transformer/*.py`` and ``models/containers.py``; husthuaan/AoANet ``models/AoAModel.py``, ``AttModel.py``
and the ``TransformerModel.py`` LayerNorm / SublayerConnection / PositionwiseFeedForward), so ``state_dict()``
gives the released key names and shapes, including M2's empty decoding-state buffers. The pickles are written
with stand-in classes registered under the releases' module paths in a temporary ``sys.modules`` entry
(``data.vocab.Vocab`` with a ``defaultdict`` whose factory is ``data.vocab._default_unk_index``;
``argparse.Namespace`` needs no stand-in), so they name exactly the globals the real files name.
"""

from __future__ import annotations

import argparse
import collections
import pickle
import random
import sys
import types
from pathlib import Path

import numpy as np
import torch
from torch import nn

# ---------------------------------------------------------------------------------------------------- M2


class _SDPAttention(nn.Module):
    def __init__(self, d: int, m: int = 0) -> None:
        super().__init__()
        self.fc_q, self.fc_k, self.fc_v, self.fc_o = (nn.Linear(d, d) for _ in range(4))
        if m:
            self.m_k = nn.Parameter(torch.randn(1, m, d) * 0.1)
            self.m_v = nn.Parameter(torch.randn(1, m, d) * 0.1)


class _MHA(nn.Module):
    def __init__(self, d: int, m: int = 0, stateful: bool = False) -> None:
        super().__init__()
        self.attention = _SDPAttention(d, m)
        self.dropout = nn.Dropout(0.1)
        self.layer_norm = nn.LayerNorm(d)
        if stateful:
            self.register_buffer("running_keys", torch.zeros((0, d)))
            self.register_buffer("running_values", torch.zeros((0, d)))


class _PWFF(nn.Module):
    def __init__(self, d: int, d_ff: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d_ff), nn.Linear(d_ff, d)
        self.dropout, self.dropout_2 = nn.Dropout(0.1), nn.Dropout(0.1)
        self.layer_norm = nn.LayerNorm(d)


class _EncLayer(nn.Module):
    def __init__(self, d: int, d_ff: int, m: int) -> None:
        super().__init__()
        self.mhatt, self.pwff = _MHA(d, m), _PWFF(d, d_ff)


class _Encoder(nn.Module):
    def __init__(self, d: int, d_ff: int, m: int, d_in: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_EncLayer(d, d_ff, m) for _ in range(3))
        self.fc, self.dropout, self.layer_norm = nn.Linear(d_in, d), nn.Dropout(0.1), nn.LayerNorm(d)


class _DecLayer(nn.Module):
    def __init__(self, d: int, d_ff: int) -> None:
        super().__init__()
        self.self_att, self.enc_att = _MHA(d, stateful=True), _MHA(d)
        self.pwff = _PWFF(d, d_ff)
        self.fc_alpha1, self.fc_alpha2, self.fc_alpha3 = (nn.Linear(2 * d, d) for _ in range(3))


class _Decoder(nn.Module):
    def __init__(self, vocab: int, max_len: int, d: int, d_ff: int) -> None:
        super().__init__()
        self.word_emb = nn.Embedding(vocab, d, padding_idx=1)
        self.pos_emb = nn.Embedding.from_pretrained(torch.rand(max_len + 1, d) - 0.5, freeze=True)
        self.layers = nn.ModuleList(_DecLayer(d, d_ff) for _ in range(3))
        self.fc = nn.Linear(d, vocab, bias=False)
        self.register_buffer("running_mask_self_attention", torch.zeros((1, 1, 0)).byte())
        self.register_buffer("running_seq", torch.zeros((1,)).long())


class M2Layout(nn.Module):
    """``Transformer(bos, MemoryAugmentedEncoder(3, 0, m), MeshedDecoder(V, max_len, 3, pad))`` attribute tree."""

    def __init__(
        self, vocab: int, d: int = 512, d_ff: int = 2048, m: int = 40, d_in: int = 2048, max_len: int = 54
    ) -> None:
        super().__init__()
        self.encoder = _Encoder(d, d_ff, m, d_in)
        self.decoder = _Decoder(vocab, max_len, d, d_ff)


def write_m2_checkpoint(path: Path, vocab: int, seed: int = 0, **sizes: int) -> dict[str, torch.Tensor]:
    """``meshed_memory_transformer.pth`` as M2's train.py saves it (legacy torch format, NumPy RNG state inside)."""
    torch.manual_seed(seed)
    model = M2Layout(vocab, **sizes)
    with torch.no_grad():  # trained LayerNorms: their biases keep the release's encoder mask empty, as in the real file
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.normal_(1.0, 0.1)
                module.bias.normal_(0.0, 0.1)
    state = model.state_dict()
    np_state = np.random.RandomState(seed).get_state()
    payload = {
        "torch_rng_state": torch.get_rng_state(),
        "numpy_rng_state": np_state,
        "random_rng_state": random.Random(seed).getstate(),
        "epoch": 27,
        "val_loss": 2.1,
        "val_cider": np.float64(1.3),
        "state_dict": state,
        "optimizer": {"state": {}, "param_groups": []},
        "scheduler": {"last_epoch": 10, "lr_lambdas": [None]},
        "patience": 0,
        "best_cider": np.float64(1.31),
        "use_rl": True,
    }
    torch.save(payload, path, _use_new_zipfile_serialization=False)
    return state


def _m2_vocab_module() -> types.ModuleType:
    """A stand-in ``data.vocab`` module: the class and the default factory under their real paths."""
    mod = types.ModuleType("data.vocab")

    def _default_unk_index() -> int:
        return 0

    class Vocab:
        pass

    for obj, name in ((Vocab, "Vocab"), (_default_unk_index, "_default_unk_index")):
        obj.__module__, obj.__qualname__ = "data.vocab", name
        setattr(mod, name, obj)
    return mod


def write_m2_vocab(path: Path, words: list[str], protocol: int = 3) -> None:
    """``vocab.pkl``: a ``data.vocab.Vocab`` with ``freqs`` (Counter), ``itos``, ``stoi`` (defaultdict), ``vectors``."""
    pkg, mod = types.ModuleType("data"), _m2_vocab_module()
    pkg.vocab = mod
    saved = {k: sys.modules.get(k) for k in ("data", "data.vocab")}
    sys.modules.update({"data": pkg, "data.vocab": mod})
    try:
        itos = ["<unk>", "<pad>", "<bos>", "<eos>", *words]
        vocab = mod.Vocab()
        vocab.freqs = collections.Counter({w: 100 - i for i, w in enumerate(words)})
        vocab.itos = itos
        vocab.stoi = collections.defaultdict(mod._default_unk_index, {w: i for i, w in enumerate(itos)})
        vocab.vectors = None
        path.write_bytes(pickle.dumps(vocab, protocol=protocol))
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


# ------------------------------------------------------------------------------------------------- AoANet


class _HarvardLN(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a_2 = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.b_2 = nn.Parameter(0.1 * torch.randn(d))


class _Sublayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.dropout = _HarvardLN(d), nn.Dropout(0.1)


class _DotAttention(nn.Module):
    """MultiHeadedDotAttention: ``linears`` (1 + 2 project_k_v), optional query ``norm``, ``aoa_layer``."""

    def __init__(self, d: int, project_k_v: bool, aoa: bool, norm_q: bool) -> None:
        super().__init__()
        if norm_q:
            self.norm = _HarvardLN(d)
        self.linears = nn.ModuleList(nn.Linear(d, d) for _ in range(3 if project_k_v else 1))
        if aoa:
            self.aoa_layer = nn.Sequential(nn.Linear(2 * d, 2 * d), nn.GLU())
        self.dropout = nn.Dropout(0.1)


class _FF(nn.Module):
    def __init__(self, d: int, d_ff: int) -> None:
        super().__init__()
        self.w_1, self.w_2, self.dropout = nn.Linear(d, d_ff), nn.Linear(d_ff, d), nn.Dropout(0.1)


class _RefinerLayer(nn.Module):
    def __init__(self, d: int, use_ff: bool) -> None:
        super().__init__()
        self.self_attn = _DotAttention(d, True, True, False)
        if use_ff:
            self.feed_forward = _FF(d, 2048)
        self.sublayer = nn.ModuleList(_Sublayer(d) for _ in range(2 if use_ff else 1))


class _Refiner(nn.Module):
    def __init__(self, d: int, use_ff: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_RefinerLayer(d, use_ff) for _ in range(6))
        self.norm = _HarvardLN(d)


class _Core(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.att_lstm = nn.LSTMCell(2 * d, d)
        self.out_drop = nn.Dropout(0.5)
        self.att2ctx = nn.Sequential(nn.Linear(2 * d, 2 * d), nn.GLU())
        self.attention = _DotAttention(d, False, False, True)


class AoALayout(nn.Module):
    """``AoAModel(opt)`` attribute tree (refine 1, use_multi_head 2, mean_feats 1: no fc_embed)."""

    def __init__(self, vocab: int, d: int = 1024, d_in: int = 2048, use_ff: bool = False, refine: bool = True) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Embedding(vocab + 1, d), nn.ReLU(), nn.Dropout(0.5))
        self.att_embed = nn.Sequential(nn.Linear(d_in, d), nn.ReLU(), nn.Dropout(0.5))
        self.logit = nn.Linear(d, vocab + 1)
        self.ctx2att = nn.Linear(d, 2 * d)
        if refine:
            self.refiner = _Refiner(d, use_ff)
        self.core = _Core(d)


def aoanet_options(
    vocab: int, d: int = 1024, d_in: int = 2048, use_ff: int = 0, refine: int = 1, **extra
) -> argparse.Namespace:
    """The train.sh options of the paper model (what ``infos['opt']`` holds)."""
    opt = dict(
        caption_model="aoa",
        refine=refine,
        refine_aoa=1,
        use_ff=use_ff,
        decoder_type="AoA",
        use_multi_head=2,
        num_heads=8,
        multi_head_scale=1,
        mean_feats=1,
        ctx_drop=1,
        dropout_aoa=0.3,
        label_smoothing=0.2,
        input_encoding_size=d,
        rnn_size=d,
        att_feat_size=d_in,
        fc_feat_size=2048,
        att_hid_size=512,
        num_layers=2,
        drop_prob_lm=0.5,
        use_bn=0,
        norm_att_feat=0,
        use_box=0,
        logit_layers=1,
        max_length=20,
        seq_length=16,
        vocab_size=vocab,
        batch_size=10,
        learning_rate=2e-5,
        id="aoanet",
        checkpoint_path="log/log_aoanet_rl",
        input_json="data/cocotalk.json",
        start_from=None,
    )
    opt.update(extra)
    return argparse.Namespace(**opt)


def write_aoanet(folder: Path, words: list[str], seed: int = 0, protocol: int = 2, **sizes) -> dict[str, torch.Tensor]:
    """``model-best.pth`` (``torch.save(model.state_dict())``) and ``infos_aoanet-best.pkl`` in ``folder``.

    ``words`` are the release's words 1 .. V (the last should be ``UNK``)."""
    torch.manual_seed(seed)
    model = AoALayout(len(words), **sizes)
    state = model.state_dict()
    torch.save(state, folder / "model-best.pth")
    infos = {
        "iter": 1234,
        "epoch": 40,
        "iterators": {"train": 5, "val": 0, "test": 0},
        "split_ix": {"train": [0, 1, 2], "val": [3], "test": [4]},
        "best_val_score": np.float64(1.2),
        "opt": aoanet_options(len(words), **sizes),
        "vocab": {str(i + 1): w for i, w in enumerate(words)},
    }
    (folder / "infos_aoanet-best.pkl").write_bytes(pickle.dumps(infos, protocol=protocol))
    return state
