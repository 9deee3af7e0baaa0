"""The NG-SAN family (Guo et al., CVPR 2020): ``san``, ``nsan``, ``gsan``, ``ngsan``.

All four share the SAN baseline (Guo et al. 2020 §3.2, §5.1; exact structure: docs/models.md#san):

* region features ``(B, N, feat_dim)`` -> ``Linear(feat_dim, d) + ReLU + Dropout`` (padded rows set to 0);
* ``L`` pre-norm encoder layers without positions ("regions have no natural order");
* ``L`` pre-norm decoder layers, word embedding * sqrt(d) + sinusoidal positions (decoder only);
* an untied output layer ``Linear(d, V)`` with bias, then log-softmax.

The variants change only the encoder self-attention (the decoder is never modified, §4.3):

* ``nsan``: NSA, the projected queries are instance-normalized over the regions of each image (Eq. 6;
  :mod:`models.layers.normalization`); switches: ``norm_kind`` (instance/batch/layer), ``norm_affine``,
  ``norm_queries``, ``norm_keys``.
* ``gsan``: GSA, a geometric bias from the relative box geometry added to the logits (Eqs. 8-13;
  :mod:`models.layers.geometry`); switches: ``geometry`` (any of content/query/key), ``geometry_dim``,
  ``geometry_head_proj``, ``geometry_scale``, ``geometry_signed`` (directions as two more inputs of Eq. 9; not
  in the paper, off by default), ``box_plus_one``, and ``absolute_position`` (Table 4's
  "absolute" ablation; use it with ``geometry: []``).
* ``ngsan``: both (Eq. 10 with Q replaced by IN(Q); the geometric query Q' is not normalized).

Choices where the paper is silent (documented in the YAMLs): the input-embedding dropout is 0.1 (the
paper's global dropout; ruotianluo uses 0.5), normalization statistics exclude padded regions, the
parameters are Xavier-initialized except the input embedding (as in the ruotianluo baseline).
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from models import register_captioner
from models.captioners.base import Captioner, State
from models.layers.attention import MultiHeadAttention
from models.layers.geometry import GEOMETRY_VARIANTS, GeometricBias, absolute_box_encoding, relative_geometry
from models.layers.normalization import NORM_KINDS, QueryNorm
from models.layers.row_dropout import Dropout
from models.layers.transformer import Decoder, Encoder, EncoderLayer
from pipeline.core.errors import ConfigError


def trim_padding(
    feats: torch.Tensor, mask: torch.Tensor, boxes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop region columns that are padding in every image (they cannot change any output)."""
    used = mask.any(0).nonzero()
    n = int(used.max()) + 1 if used.numel() else 1
    if n == mask.shape[1]:
        return feats, mask, boxes
    return feats[:, :n], mask[:, :n], boxes[:, :n]


def _check_switches(
    model: str,
    d_model: int,
    num_heads: int,
    num_layers: int,
    norm_kind: str | None,
    geometry: Sequence[str],
    geometry_dim: int,
    geometry_head_proj: bool,
    absolute_position: bool,
) -> None:
    """Reject impossible settings with a :class:`ConfigError` naming the model key (CLI: one line, exit 2)."""
    problems = []
    if num_layers < 1:
        problems.append(f"num_layers must be >= 1, got {num_layers}")
    if num_heads < 1 or d_model % num_heads:
        problems.append(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
    if norm_kind is not None and norm_kind not in NORM_KINDS:
        problems.append(f"norm_kind must be one of {list(NORM_KINDS)}, got {norm_kind!r}")
    bad = [v for v in geometry if v not in GEOMETRY_VARIANTS]
    if bad or len(set(geometry)) != len(geometry):
        problems.append(f"geometry must list distinct values of {list(GEOMETRY_VARIANTS)}, got {list(geometry)}")
    elif (
        any(v in ("query", "key") for v in geometry)
        and not geometry_head_proj
        and num_heads
        and geometry_dim != d_model // num_heads
    ):
        problems.append(
            f"geometry_head_proj: false needs geometry_dim == d_model / num_heads = {d_model // max(num_heads, 1)}"
        )
    if absolute_position and d_model % 8:
        problems.append(f"absolute_position needs d_model divisible by 8, got {d_model}")
    if problems:
        raise ConfigError(f"model {model}: " + "; ".join(problems))


class SelfAttentionCaptioner(Captioner):
    """The shared implementation; the registered classes below fix which switches they expose."""

    def __init__(
        self,
        vocab_size: int,
        feat_dim: int = 2048,
        d_model: int = 512,
        num_heads: int = 8,
        d_ff: int = 2048,
        num_layers: int = 4,
        dropout: float = 0.1,
        embed_dropout: float = 0.1,
        max_positions: int = 512,
        norm_kind: str | None = None,
        norm_affine: bool = False,
        norm_queries: bool = True,
        norm_keys: bool = False,
        norm_eps: float = 1e-5,
        geometry: Sequence[str] = (),
        geometry_dim: int = 128,
        geometry_head_proj: bool = True,
        geometry_scale: bool = True,
        geometry_signed: bool = False,
        box_plus_one: bool = True,
        absolute_position: bool = False,
    ) -> None:
        super().__init__(vocab_size)
        _check_switches(
            self.name or "san",
            d_model,
            num_heads,
            num_layers,
            norm_kind,
            geometry,
            geometry_dim,
            geometry_head_proj,
            absolute_position,
        )
        self.feat_dim = feat_dim
        self.d_model = d_model
        self.geometry = tuple(geometry)
        self.geometry_signed = geometry_signed
        self.box_plus_one = box_plus_one
        self.absolute_position = absolute_position
        self.att_embed = nn.Sequential(nn.Linear(feat_dim, d_model), nn.ReLU(), Dropout(embed_dropout))

        def make_norm(enabled: bool) -> QueryNorm | None:
            if norm_kind is None or not enabled:
                return None
            return QueryNorm(d_model, norm_kind, norm_affine, norm_eps)

        def make_layer() -> EncoderLayer:
            attn = MultiHeadAttention(d_model, num_heads, dropout, make_norm(norm_queries), make_norm(norm_keys))
            geo = (
                GeometricBias(
                    d_model, num_heads, self.geometry, geometry_dim, geometry_head_proj, geometry_scale, geometry_signed
                )
                if self.geometry
                else None
            )
            return EncoderLayer(attn, d_model, d_ff, dropout, geo)

        self.encoder = Encoder(make_layer, num_layers, d_model)
        self.decoder = Decoder(vocab_size, d_model, num_heads, d_ff, num_layers, dropout, max_positions)
        self.generator = nn.Linear(d_model, vocab_size)
        for module in (self.encoder, self.decoder, self.generator):
            for p in module.parameters():
                if p.dim() > 1:
                    nn.init.xavier_uniform_(p)

    # --- Captioner interface -------------------------------------------------------------------------
    def encode(self, feats: torch.Tensor, mask: torch.Tensor, boxes: torch.Tensor, sizes: torch.Tensor) -> State:
        """Embed and encode the regions; returns the region mask and every decoder layer's memory keys/values."""
        mask = mask.bool()
        feats, mask, boxes = trim_padding(feats, mask, boxes)
        x, rel = self.encoder_input(feats, mask, boxes, sizes)
        memory = self.encoder(x, mask, rel)
        return {"mask": mask, "memory_kv": self.decoder.memory_kv(memory, mask)}

    def encoder_input(
        self, feats: torch.Tensor, mask: torch.Tensor, boxes: torch.Tensor, sizes: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The encoder's input: the embedded regions (plus Table 4's absolute box encoding when switched on),
        padding rows zeroed, and the relative geometry of Eq. 8 (None without geometry)."""
        keep = mask[..., None].to(feats.dtype)
        x = self.att_embed(feats) * keep
        if self.absolute_position:
            x = x + absolute_box_encoding(boxes.float(), sizes, self.d_model, self.box_plus_one).to(x.dtype) * keep
        rel = (
            relative_geometry(boxes.float(), mask, self.box_plus_one, signed=self.geometry_signed).to(x.dtype)
            if self.geometry
            else None
        )
        return x, rel

    def max_caption_len(self) -> int:
        """The decoder's sinusoidal table: one position per generated token."""
        return int(self.decoder.pe.shape[0])

    def init_state(self, enc: State) -> State:
        mask = enc["mask"]
        k0 = enc["memory_kv"][0][0]
        return {"cache": self.decoder.empty_cache(mask.shape[0], mask.device, k0.dtype)}

    def step(self, tokens: torch.Tensor, enc: State, state: State) -> tuple[torch.Tensor, State]:
        h, cache = self.decoder.step(tokens, enc["memory_kv"], enc["mask"], state["cache"])
        return F.log_softmax(self.generator(h), dim=-1), {"cache": cache}

    def decode_teacher_forced(self, enc: State, captions: torch.Tensor) -> torch.Tensor:
        h = self.decoder(captions, enc["memory_kv"], enc["mask"])
        return F.log_softmax(self.generator(h), dim=-1)


_BASELINE_ARGS = ("vocab_size", "feat_dim", "d_model", "num_heads", "d_ff", "num_layers", "dropout", "embed_dropout")
_NORM_SWITCHES = ("norm_kind", "norm_affine", "norm_queries", "norm_keys", "norm_eps")
_GEOMETRY_SWITCHES = (
    "geometry",
    "geometry_dim",
    "geometry_head_proj",
    "geometry_scale",
    "geometry_signed",
    "box_plus_one",
    "absolute_position",
)


class _FamilyMember(SelfAttentionCaptioner):
    """A registered member of the family: the SAN baseline's arguments plus its own ``switches``.

    ``defaults`` replaces the shared implementation's default of a switch (e.g. ``norm_kind="instance"``). The
    constructor's signature (``inspect.signature``) lists exactly the exposed arguments with these defaults, and it
    rejects any other argument with a ``TypeError`` as a hand-written signature would.
    """

    switches: tuple[str, ...] = ()
    defaults: dict[str, Any] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        shared = inspect.signature(SelfAttentionCaptioner).parameters
        cls.__signature__ = inspect.Signature(
            [
                shared[name].replace(default=cls.defaults.get(name, shared[name].default))
                for name in _BASELINE_ARGS + cls.switches
            ]
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            bound = self.__signature__.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{type(self).__name__}.__init__() {exc}") from None
        bound.apply_defaults()
        super().__init__(**bound.arguments)


@register_captioner("san")
class SAN(_FamilyMember):
    """SAN: the Transformer baseline of NG-SAN (Table 1: 18.1M/25.5M/40.2M/54.9M at L = 1/2/4/6, V = 9,487).

    Parameters: ``1,049,088 + 2 * 512 * V + V + 2,048 + 7,356,416 * L`` (docs/models.md#san-parameter-count). The
    ruotianluo model has ``V + 1`` outputs (its shared BOS/EOS/PAD index 0); ours has ``V`` because our vocabulary
    already holds its specials, i.e. 1,025 parameters fewer at the same V (40,200,975 at L = 4, V = 9,487).
    """


@register_captioner("nsan")
class NSAN(_FamilyMember):
    """N-SAN: SAN with normalized self-attention in the encoder (§4.1; no extra parameters without affine)."""

    switches = _NORM_SWITCHES
    defaults = {"norm_kind": "instance"}


@register_captioner("gsan")
class GSAN(_FamilyMember):
    """G-SAN: SAN with geometry-aware self-attention in the encoder (§4.2; 41.5M at L = 4, query-dependent)."""

    switches = _GEOMETRY_SWITCHES
    defaults = {"geometry": ("query",)}


@register_captioner("ngsan")
class NGSAN(_FamilyMember):
    """NG-SAN: GSA with the content query replaced by IN(Q) in every encoder self-attention (§4.3)."""

    switches = _NORM_SWITCHES + _GEOMETRY_SWITCHES
    defaults = {"norm_kind": "instance", "geometry": ("query",)}
