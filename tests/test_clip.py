"""CLIP encoders, weights layouts and recipes against a re-statement of the releases' own code.

The reference below re-states openai/CLIP ``clip/model.py`` (``ModifiedResNet``, ``AttentionPool2d`` through
``F.multi_head_attention_forward``, ``VisionTransformer`` with ``nn.MultiheadAttention``), timm's
``resize_pos_embed`` and CLIP-ViL's ``clip_prepro_feats.py`` (torchvision transforms, the RN ``(layer4,
attnpool)`` pair, the ViT token loop). Tiny random encoders are written in each public layout (a TorchScript
archive made by ``torch.jit.trace`` + ``torch.jit.save`` with fp16 weights as OpenAI ships them, an open_clip
training checkpoint, Hugging Face ``pytorch_model.bin`` and ``model.safetensors``), loaded by
:mod:`extractors.clip`, and their features compared on two real photos.
"""

from __future__ import annotations

import copy
import json
import math
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torchvision.transforms import CenterCrop, Compose, InterpolationMode, Normalize, Resize, ToTensor

from extractors.clip import ClipRecipe, ClipWeightsError, extract, extract_batch, load_clip, prepare, read_clip
from extractors.clip.model import PRESETS, ClipVisionConfig, expected_shapes, infer_config
from extractors.clip.recipe import cell_boxes
from extractors.weights import WeightsError, read_weights
from models.released.unpickle import load_weights_file
from pipeline.core.catalogue import CATALOGUE, KINDS
from pipeline.core.errors import PipelineError, UsageError
from pipeline.hub.verify import verifier
from pipeline.importers import import_features
from pipeline.store import FeatureStore

PHOTOS = ("000456.jpg", "COCO_train2014_000000084002.jpg")
REL_TOL = 1e-4


# ------------------------------------------------------------------ the release's code, re-stated
class RefBottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.avgpool = nn.AvgPool2d(stride) if stride > 1 else nn.Identity()
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride > 1 or inplanes != planes * 4:
            self.downsample = nn.Sequential(
                OrderedDict(
                    [
                        ("-1", nn.AvgPool2d(stride)),
                        ("0", nn.Conv2d(inplanes, planes * 4, 1, stride=1, bias=False)),
                        ("1", nn.BatchNorm2d(planes * 4)),
                    ]
                )
            )

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.avgpool(out)
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class RefAttentionPool2d(nn.Module):
    def __init__(self, spacial_dim, embed_dim, num_heads, output_dim):
        super().__init__()
        self.positional_embedding = nn.Parameter(torch.randn(spacial_dim**2 + 1, embed_dim) / embed_dim**0.5)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.c_proj = nn.Linear(embed_dim, output_dim)
        self.num_heads = num_heads

    def forward(self, x, pos=None):
        pos = self.positional_embedding if pos is None else pos
        x = x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3]).permute(2, 0, 1)
        x = torch.cat([x.mean(dim=0, keepdim=True), x], dim=0)
        x = x + pos[:, None, :].to(x.dtype)
        x, _ = F.multi_head_attention_forward(
            query=x,
            key=x,
            value=x,
            embed_dim_to_check=x.shape[-1],
            num_heads=self.num_heads,
            q_proj_weight=self.q_proj.weight,
            k_proj_weight=self.k_proj.weight,
            v_proj_weight=self.v_proj.weight,
            in_proj_weight=None,
            in_proj_bias=torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]),
            bias_k=None,
            bias_v=None,
            add_zero_attn=False,
            dropout_p=0,
            out_proj_weight=self.c_proj.weight,
            out_proj_bias=self.c_proj.bias,
            use_separate_proj_weight=True,
            training=self.training,
            need_weights=False,
        )
        return x[0]


class RefModifiedResNet(nn.Module):
    def __init__(self, layers, output_dim, heads, input_resolution, width):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width // 2, kernel_size=3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width // 2)
        self.conv2 = nn.Conv2d(width // 2, width // 2, kernel_size=3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width // 2)
        self.conv3 = nn.Conv2d(width // 2, width, kernel_size=3, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(width)
        self.avgpool = nn.AvgPool2d(2)
        self.relu = nn.ReLU(inplace=True)
        self._inplanes = width
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(width * 8, layers[3], stride=2)
        self.attnpool = RefAttentionPool2d(input_resolution // 32, width * 32, heads, output_dim)

    def _make_layer(self, planes, blocks, stride=1):
        layers = [RefBottleneck(self._inplanes, planes, stride)]
        self._inplanes = planes * 4
        layers += [RefBottleneck(self._inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def trunk(self, x):
        for conv, bn in [(self.conv1, self.bn1), (self.conv2, self.bn2), (self.conv3, self.bn3)]:
            x = self.relu(bn(conv(x)))
        x = self.avgpool(x)
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))

    def forward(self, x):
        return self.attnpool(self.trunk(x))


class RefQuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class RefResidualAttentionBlock(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, n_head)
        self.ln_1 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            OrderedDict(
                [
                    ("c_fc", nn.Linear(d_model, d_model * 4)),
                    ("gelu", RefQuickGELU()),
                    ("c_proj", nn.Linear(d_model * 4, d_model)),
                ]
            )
        )
        self.ln_2 = nn.LayerNorm(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x), self.ln_1(x), self.ln_1(x), need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class RefTransformer(nn.Module):
    def __init__(self, width, layers, heads):
        super().__init__()
        self.resblocks = nn.Sequential(*[RefResidualAttentionBlock(width, heads) for _ in range(layers)])

    def forward(self, x):
        return self.resblocks(x)


class RefVisionTransformer(nn.Module):
    def __init__(self, input_resolution, patch_size, width, layers, heads, output_dim):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, bias=False)
        scale = width**-0.5
        self.class_embedding = nn.Parameter(scale * torch.randn(width))
        self.positional_embedding = nn.Parameter(scale * torch.randn((input_resolution // patch_size) ** 2 + 1, width))
        self.ln_pre = nn.LayerNorm(width)
        self.transformer = RefTransformer(width, layers, heads)
        self.ln_post = nn.LayerNorm(width)
        self.proj = nn.Parameter(scale * torch.randn(width, output_dim))

    def forward(self, x):
        x = self.conv1(x)
        x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
        zeros = torch.zeros(x.shape[0], 1, x.shape[-1], dtype=x.dtype, device=x.device)
        x = torch.cat([self.class_embedding.to(x.dtype) + zeros, x], dim=1)
        x = self.ln_pre(x + self.positional_embedding.to(x.dtype))
        x = self.transformer(x.permute(1, 0, 2)).permute(1, 0, 2)
        return self.ln_post(x[:, 0, :]) @ self.proj


class RefCLIP(nn.Module):
    """The state-dict tree of openai/CLIP ``CLIP``: ``visual`` plus a small text tower."""

    def __init__(self, visual):
        super().__init__()
        self.visual = visual
        self.transformer = RefTransformer(64, 1, 1)
        self.token_embedding = nn.Embedding(10, 64)
        self.positional_embedding = nn.Parameter(torch.randn(5, 64))
        self.ln_final = nn.LayerNorm(64)
        self.text_projection = nn.Parameter(torch.randn(64, 16))
        self.logit_scale = nn.Parameter(torch.ones([]) * np.log(1 / 0.07))

    def forward(self, image):
        return self.visual(image)


def timm_resize_pos_embed(posemb, posemb_new):
    """timm ``resize_pos_embed`` (0.4.12): token row kept, grid resized bicubic, align_corners=False."""
    ntok_new = posemb_new.shape[1] - 1
    posemb_tok, posemb_grid = posemb[:, :1], posemb[0, 1:]
    gs_old = int(math.sqrt(len(posemb_grid)))
    gs_new = [int(math.sqrt(ntok_new))] * 2
    posemb_grid = posemb_grid.reshape(1, gs_old, gs_old, -1).permute(0, 3, 1, 2)
    posemb_grid = F.interpolate(posemb_grid, size=gs_new, mode="bicubic", align_corners=False)
    posemb_grid = posemb_grid.permute(0, 2, 3, 1).reshape(1, gs_new[0] * gs_new[1], -1)
    return torch.cat([posemb_tok, posemb_grid], dim=1)


def clip_vil_preprocess(img):
    """clip_prepro_feats.py: Resize((448, 448), BICUBIC), CenterCrop((448, 448)), ToTensor; -= mean; /= std."""
    pre = Compose([Resize((448, 448), interpolation=InterpolationMode.BICUBIC), CenterCrop((448, 448)), ToTensor()])
    image = torch.tensor(np.stack([pre(img)]))
    image -= torch.Tensor(CLIP_MEAN_REF).reshape(3, 1, 1)
    image /= torch.Tensor(CLIP_STD_REF).reshape(3, 1, 1)
    return image


def clip_preprocess(img, n_px):
    """openai/CLIP ``_transform(n_px)``."""
    return Compose(
        [
            Resize(n_px, interpolation=InterpolationMode.BICUBIC),
            CenterCrop(n_px),
            lambda im: im.convert("RGB"),
            ToTensor(),
            Normalize(CLIP_MEAN_REF, CLIP_STD_REF),
        ]
    )(img)[None]


CLIP_MEAN_REF = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD_REF = [0.26862954, 0.26130258, 0.27577711]


@torch.no_grad()
def clip_vil_reference(visual, image):
    """CLIP-ViL's features: RN -> (layer4 grid as (h*w, C), attnpool with the resized positional embedding);
    ViT -> the token loop (resized positional embedding, no ln_post): (patch tokens, class token)."""
    if isinstance(visual, RefModifiedResNet):
        fmap = visual.trunk(image)
        n = fmap.shape[2] * fmap.shape[3]
        pe = visual.attnpool.positional_embedding
        pos = timm_resize_pos_embed(pe.unsqueeze(0), torch.zeros(1, n + 1, pe.shape[-1])).squeeze(0)
        fc = visual.attnpool(fmap, pos)[0]
        return fmap[0].permute(1, 2, 0).reshape(n, -1), fc
    x = visual.conv1(image)
    n = x.shape[2] * x.shape[3]
    pe = visual.positional_embedding
    pos = timm_resize_pos_embed(pe.unsqueeze(0), torch.zeros(1, n + 1, pe.shape[-1])).squeeze(0)
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
    zeros = torch.zeros(x.shape[0], 1, x.shape[-1], dtype=x.dtype)
    x = torch.cat([visual.class_embedding.to(x.dtype) + zeros, x], dim=1)
    x = visual.ln_pre(x + pos.to(x.dtype)[: x.shape[1], :]).permute(1, 0, 2)
    for layer in visual.transformer.resblocks:
        x = layer(x)
    x = x.permute(1, 0, 2)
    return x[0, 1:, :], x[0, 0, :]


# ------------------------------------------------------------------ tiny random releases
RN_TINY = dict(layers=(1, 2, 1, 1), output_dim=32, heads=4, input_resolution=96, width=8)
VIT_TINY = dict(input_resolution=96, patch_size=32, width=128, layers=2, heads=2, output_dim=48)


def _randomise(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            fan = p[0].numel() if p.dim() > 1 else p.numel()
            if name.endswith(("bn1.weight", "bn2.weight", "bn3.weight", "1.weight")) and p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(max(fan, 1)))
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
            elif name.endswith("running_var"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))


def _half_round(model: nn.Module) -> list[str]:
    """openai/CLIP ``convert_weights``: conv / linear / attention / proj weights to fp16 (rounded in place, kept
    float32 so the reference runs on the CPU); returns the names stored as fp16."""
    names = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            module = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            if isinstance(module, (nn.Conv2d, nn.Linear, nn.MultiheadAttention)) or leaf in ("proj", "text_projection"):
                if leaf in ("weight", "bias", "in_proj_weight", "in_proj_bias", "proj", "text_projection"):
                    p.copy_(p.half().float())
                    names.append(name)
    return names


def make_release(kind: str, seed: int = 0) -> RefCLIP:
    visual = RefModifiedResNet(**RN_TINY) if kind == "rn" else RefVisionTransformer(**VIT_TINY)
    model = RefCLIP(visual)
    _randomise(model, seed)
    return model.eval()


def save_openai(model: RefCLIP, path: Path) -> Path:
    """A TorchScript archive (traced, fp16 weights where OpenAI's are fp16)."""
    half = _half_round(model)
    traced = torch.jit.trace(copy.deepcopy(model), torch.zeros(1, 3, 96, 96), check_trace=False)
    params = dict(traced.named_parameters())
    with torch.no_grad():
        for name in half:
            params[name].data = params[name].data.half()
    torch.jit.save(traced, str(path))
    return path


def save_open_clip(model: RefCLIP, path: Path) -> Path:
    sd = {f"module.{k}": v.clone() for k, v in model.state_dict().items()}
    torch.save({"epoch": 3, "name": "tiny", "state_dict": sd}, path)
    return path


def save_open_clip_config(folder: Path, quick_gelu: bool = True, **vision_cfg) -> Path:
    """open_clip's ``open_clip_config.json`` beside the weights in ``folder`` (``model_cfg.quick_gelu``: the
    references here run QuickGELU, as OpenAI-pretrained open_clip models do; ``vision_cfg`` as given)."""
    path = folder / "open_clip_config.json"
    path.write_text(json.dumps({"model_cfg": {"quick_gelu": quick_gelu, "vision_cfg": vision_cfg}}))
    return path


def hf_state_dict(model: RefCLIP, with_projection: bool) -> dict[str, torch.Tensor]:
    """transformers ``CLIPVisionModel`` names (``CLIPModel`` with ``visual_projection``)."""
    v = model.visual.state_dict()
    out = {
        "vision_model.embeddings.class_embedding": v["class_embedding"],
        "vision_model.embeddings.patch_embedding.weight": v["conv1.weight"],
        "vision_model.embeddings.position_embedding.weight": v["positional_embedding"],
        "vision_model.embeddings.position_ids": torch.arange(v["positional_embedding"].shape[0])[None],
        "vision_model.pre_layrnorm.weight": v["ln_pre.weight"],
        "vision_model.pre_layrnorm.bias": v["ln_pre.bias"],
        "vision_model.post_layernorm.weight": v["ln_post.weight"],
        "vision_model.post_layernorm.bias": v["ln_post.bias"],
    }
    for i in range(VIT_TINY["layers"]):
        a, h = f"transformer.resblocks.{i}.", f"vision_model.encoder.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, val = v[f"{a}attn.in_proj_{kind}"].chunk(3)
            out |= {f"{h}self_attn.q_proj.{kind}": q, f"{h}self_attn.k_proj.{kind}": k}
            out |= {f"{h}self_attn.v_proj.{kind}": val}
            out[f"{h}self_attn.out_proj.{kind}"] = v[f"{a}attn.out_proj.{kind}"]
            out[f"{h}layer_norm1.{kind}"] = v[f"{a}ln_1.{kind}"]
            out[f"{h}layer_norm2.{kind}"] = v[f"{a}ln_2.{kind}"]
            out[f"{h}mlp.fc1.{kind}"] = v[f"{a}mlp.c_fc.{kind}"]
            out[f"{h}mlp.fc2.{kind}"] = v[f"{a}mlp.c_proj.{kind}"]
    if with_projection:
        out["visual_projection.weight"] = v["proj"].t()
        out["text_model.embeddings.token_embedding.weight"] = torch.randn(10, 64)
        out["text_projection.weight"] = torch.randn(48, 64)
        out["logit_scale"] = torch.tensor(2.6592)
    return {k: t.clone().contiguous() for k, t in out.items()}


def save_safetensors(sd: dict[str, torch.Tensor], path: Path) -> Path:
    """The safetensors format: u64 header length, JSON header (dtype, shape, data_offsets), raw little-endian data."""
    codes = {torch.float32: "F32", torch.int64: "I64"}
    header, blobs, at = {"__metadata__": {"format": "pt"}}, [], 0
    for k, t in sd.items():
        raw = t.contiguous().numpy().tobytes()
        header[k] = {"dtype": codes[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    return path


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def photos(shared_data):
    imgs = []
    for name in PHOTOS:
        path = shared_data / "photos" / name
        if not path.is_file():
            pytest.skip(f"photo {path} not found")
        imgs.append(Image.open(path).convert("RGB"))
    return imgs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _compare_clip_vil(model_path: Path, reference: RefCLIP, photos, layout: str) -> None:
    model, info = load_clip(model_path)
    assert info["layout"] == layout
    recipe = ClipRecipe("clip-vil")
    for img in photos:
        feats = extract(model, np.asarray(img), recipe)
        grid_ref, fc_ref = clip_vil_reference(reference.visual, clip_vil_preprocess(img))
        grid = torch.from_numpy(feats.regions.features)
        assert grid.shape == grid_ref.shape == (196, grid_ref.shape[1])
        assert _rel(grid, grid_ref) < REL_TOL, _rel(grid, grid_ref)
        assert _rel(torch.from_numpy(feats.pooled), fc_ref) < REL_TOL
        assert feats.grid_hw == (14, 14)


# ------------------------------------------------------------------ tests
def test_preprocessing_is_the_releases_exactly(photos):
    for img in photos + [photos[0].transpose(Image.Transpose.TRANSPOSE)]:
        rgb = np.asarray(img)
        vil = prepare(rgb, ClipRecipe("clip-vil"), 224)
        assert torch.equal(torch.from_numpy(vil.blob)[None], clip_vil_preprocess(img))
        for n_px in (224, 96):
            own = prepare(rgb, ClipRecipe("clip", size=0), n_px)
            assert torch.equal(torch.from_numpy(own.blob)[None], clip_preprocess(img, n_px))


def test_openai_archive_rn_matches_clip_vil(tmp_path, photos):
    ref = make_release("rn", seed=1)
    path = save_openai(ref, tmp_path / "RN-tiny.pt")
    with zipfile.ZipFile(path) as zf:
        assert any("/code/" in n for n in zf.namelist())
    _compare_clip_vil(path, ref, photos, "openai")


def test_openai_archive_vit_matches_clip_vil(tmp_path, photos):
    ref = make_release("vit", seed=2)
    _compare_clip_vil(save_openai(ref, tmp_path / "ViT-tiny.pt"), ref, photos, "openai")


def test_archive_reader_agrees_with_torch_jit_load(tmp_path):
    """The restricted reader rebuilds exactly the state dict ``torch.jit.load`` gives (safe here: the test wrote it)."""
    path = save_openai(make_release("rn", seed=12), tmp_path / "rn.pt")
    layout, sd = read_clip(path)
    want = {
        k[len("visual.") :]: v for k, v in torch.jit.load(str(path)).state_dict().items() if k.startswith("visual.")
    }
    assert layout == "openai" and sd.keys() == want.keys()
    assert any(v.dtype == torch.float16 for v in want.values())
    for k, v in want.items():
        assert torch.equal(sd[k], v.float() if v.is_floating_point() else v), k


def test_open_clip_checkpoints_match(tmp_path, photos):
    save_open_clip_config(tmp_path)
    for kind in ("rn", "vit"):
        ref = make_release(kind, seed=3)
        _compare_clip_vil(save_open_clip(ref, tmp_path / f"{kind}.pt"), ref, photos, "open_clip")


def test_hf_weights_match(tmp_path, photos):
    ref = make_release("vit", seed=4)
    bin_path = tmp_path / "pytorch_model.bin"
    torch.save(hf_state_dict(ref, with_projection=False), bin_path)
    _compare_clip_vil(bin_path, ref, photos, "hf")
    st = save_safetensors(hf_state_dict(ref, with_projection=True), tmp_path / "model.safetensors")
    _compare_clip_vil(st, ref, photos, "hf")
    model, _ = load_clip(st)
    assert model.config.embed_dim == VIT_TINY["output_dim"]


def test_clip_recipe_is_encode_image(tmp_path, photos):
    save_open_clip_config(tmp_path)
    for kind, seed in (("rn", 5), ("vit", 6)):
        ref = make_release(kind, seed)
        model, _ = load_clip(save_open_clip(ref, tmp_path / f"{kind}.pt"))
        for img in photos:
            feats = extract(model, np.asarray(img), ClipRecipe("clip", size=0))
            with torch.no_grad():
                want = ref.visual(clip_preprocess(img, 96))[0]
            assert _rel(torch.from_numpy(feats.pooled), want) < REL_TOL
            assert feats.grid_hw == (3, 3)
            if kind == "rn":
                with torch.no_grad():
                    grid = ref.visual.trunk(clip_preprocess(img, 96))[0].permute(1, 2, 0).reshape(9, -1)
                assert _rel(torch.from_numpy(feats.regions.features), grid) < REL_TOL


def test_a_batch_gives_each_image_its_own_features(tmp_path, photos):
    ref = make_release("vit", seed=16)
    save_open_clip_config(tmp_path)
    model, _ = load_clip(save_open_clip(ref, tmp_path / "vit.pt"))
    images = [np.asarray(p) for p in photos] + [np.asarray(photos[0].transpose(Image.Transpose.TRANSPOSE))]
    for recipe in (ClipRecipe("clip-vil"), ClipRecipe("clip", size=0)):
        batch = extract_batch(model, images, recipe)
        for rgb, got in zip(images, batch):
            one = extract(model, rgb, recipe)
            np.testing.assert_allclose(got.regions.features, one.regions.features, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(got.pooled, one.pooled, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(got.regions.boxes, one.regions.boxes)
            assert (got.regions.image_w, got.regions.image_h) == (rgb.shape[1], rgb.shape[0])
    assert extract_batch(model, [], ClipRecipe()) == []


def test_cell_boxes_cover_the_image(photos):
    img = photos[0]
    w, h = img.size
    vil = prepare(np.asarray(img), ClipRecipe("clip-vil"), 224)
    boxes = cell_boxes(vil, (14, 14), 32)
    assert boxes.shape == (196, 4)
    np.testing.assert_allclose(boxes[0], [0, 0, 32 * w / 448, 32 * h / 448], rtol=1e-6)
    np.testing.assert_allclose(boxes[-1, 2:], [w, h], rtol=1e-6)
    own = prepare(np.asarray(img), ClipRecipe("clip", size=0), 224)  # 500x375 -> 298x224, crop left 37
    assert (own.resized_w, own.resized_h, own.left, own.top) == (int(224 * w / h), 224, 37, 0)
    boxes = cell_boxes(own, (7, 7), 32)
    np.testing.assert_allclose(boxes[0], [37 * w / 298, 0, 69 * w / 298, 32 * h / 224], rtol=1e-6)


def test_presets_are_what_build_model_reads():
    for name, cfg in PRESETS.items():
        sd = {k: torch.empty(s, device="meta") for k, s in expected_shapes(cfg).items()}
        assert infer_config(sd) == cfg, name
    assert PRESETS["RN50"].heads == 32 and PRESETS["ViT-L/14"].heads == 16
    assert PRESETS["RN50x4"].resolution // 32 == 9 and PRESETS["ViT-L/14@336px"].resolution // 14 == 24


def test_refusals_name_the_file_and_key(tmp_path):
    ref = make_release("rn", seed=7)
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    cases = {
        "missing key 'visual.layer2.0.bn1.running_var'": {
            k: v for k, v in sd.items() if k != "visual.layer2.0.bn1.running_var"
        },
        "unexpected key 'visual.extra.weight'": sd | {"visual.extra.weight": torch.zeros(2)},
        "unexpected key 'head.weight'": sd | {"head.weight": torch.zeros(2)},
        "key 'visual.layer1.0.conv2.weight' has shape [8, 8, 1, 1]": sd
        | {"visual.layer1.0.conv2.weight": torch.zeros(8, 8, 1, 1)},
    }
    for i, (message, bad) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.pt"
        torch.save(bad, path)
        with pytest.raises(ClipWeightsError) as err:
            load_clip(path)
        assert str(path) in str(err.value) and message in str(err.value), str(err.value)
        assert "\n" not in str(err.value)


def test_archive_with_a_foreign_global_is_refused_without_running_it(tmp_path):
    good = save_openai(make_release("vit", seed=8), tmp_path / "good.pt")
    marker = tmp_path / "ran"
    evil = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    bad = tmp_path / "evil.pt"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = evil if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info, data)
    with pytest.raises(ClipWeightsError) as err:
        load_clip(bad)
    assert str(bad) in str(err.value) and "os.system" in str(err.value)
    assert not marker.exists()


def test_truncated_storage_is_refused(tmp_path):
    good = save_openai(make_release("rn", seed=9), tmp_path / "good.pt")
    bad = tmp_path / "short.pt"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, data[:-4] if info.filename.endswith("/data/0") else data)
    with pytest.raises(ClipWeightsError, match=r"storage '.*data/0' holds"):
        load_clip(bad)


def test_zero_stride_views_are_refused_before_allocation(tmp_path):
    model = make_release("rn", seed=11)
    model.visual.register_buffer("wide", torch.zeros(1).expand(10**9))
    path = save_openai(model, tmp_path / "wide.pt")
    assert path.stat().st_size < 10**7
    with pytest.raises(ClipWeightsError, match=r"'visual\.wide': shape \[1000000000\] declares more"):
        load_clip(path)


def test_config_records_refuse_nonsense():
    with pytest.raises(ValueError):
        ClipVisionConfig("vit", 100, (2,), 96, 48, patch=32)
    with pytest.raises(ValueError):
        ClipRecipe("clip-vil", pos_resize="nearest")


def test_catalogue_entries_carry_the_url_digest_and_verify(tmp_path):
    clip = [e for e in CATALOGUE.values() if e.kind == "clip"]
    assert len(clip) == len(PRESETS) == 9
    for e in clip:
        assert e.urls[0].split("/")[-2] == e.sha256 and len(e.sha256) == 64 and e.urls[0].endswith(e.filename)
    verifier("clip")(save_openai(make_release("vit", seed=10), tmp_path / "ok.pt"))
    torch.save({"visual.nothing": torch.zeros(3)}, tmp_path / "no.pt")
    with pytest.raises(PipelineError, match="no.pt"):
        verifier("clip")(tmp_path / "no.pt")
    assert all(callable(verifier(kind)) for kind in KINDS)  # every catalogue kind is checked after a download
    with pytest.raises(KeyError):
        verifier("no-such-kind")


def test_clip_vil_feature_folders_import_as_the_extractor_writes_them(tmp_path, photos):
    ref = make_release("rn", seed=13)
    model, _ = load_clip(save_open_clip(ref, tmp_path / "rn.pt"))
    att, fc = tmp_path / "data_clip_RN50_att", tmp_path / "data_clip_RN50_fc"
    att.mkdir()
    fc.mkdir()
    images = {"391895": photos[0], "522418": photos[1]}
    want, pooled = {}, {}
    for key, img in images.items():
        feats = extract(model, np.asarray(img), ClipRecipe("clip-vil"))
        grid = feats.regions.features.reshape(14, 14, -1)
        np.savez_compressed(att / f"{key}.npz", feat=grid)  # clip_prepro_feats.py's att file
        np.save(fc / key, feats.pooled)
        want[key] = feats.regions
        pooled[key] = feats.pooled
    sizes = {k: img.size for k, img in images.items()}
    with pytest.raises(UsageError, match="--sizes"):
        import_features("clip-vil", [att], tmp_path / "s")
    report = import_features("clip-vil", [att], tmp_path / "s", sizes=sizes, feature_dtype="float32")
    assert report.imported == 2
    store = FeatureStore(tmp_path / "s")
    assert store.identity["release"]["recipe"] == "clip-vil"
    assert store.pooled_dim == RN_TINY["output_dim"]  # the sibling *_fc folder: the attention pool's output
    for key, regions in want.items():
        rec = store.get(key)
        np.testing.assert_array_equal(rec["features"], regions.features)
        np.testing.assert_array_equal(rec["pooled"], pooled[key])
        np.testing.assert_allclose(rec["boxes"], regions.boxes, rtol=1e-6, atol=1e-4)
        assert store.image_size(key) == (regions.image_w, regions.image_h)
    np.savez_compressed(att / "7.npz", z=np.zeros((2, 2, 3), np.float32))
    with pytest.raises(PipelineError, match=r"7\.npz: npz has no 'feat' array"):
        import_features("clip-vil", [att], tmp_path / "s", sizes=sizes | {"7": (10, 10)}, feature_dtype="float32")


def _clip_vil_folders(root: Path, n: int = 3, dim: int = 6) -> tuple[Path, dict[str, np.ndarray]]:
    """An ``*_att`` folder of random 2 x 2 grids and, per image, the pooled vector its ``*_fc`` file would hold."""
    att = root / "coco_clip_RN50_att"
    att.mkdir(parents=True)
    rng = np.random.default_rng(7)
    vectors = {}
    for i in range(n):
        np.savez_compressed(att / f"{i + 1}.npz", feat=rng.normal(0, 1, (2, 2, 5)).astype(np.float32))
        vectors[str(i + 1)] = rng.normal(0, 1, dim).astype(np.float32)
    return att, vectors


def _write_fc(folder: Path, vectors: dict[str, np.ndarray]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for key, vec in vectors.items():
        np.save(folder / f"{key}.npy", vec)
    return folder


def test_clip_vil_fc_vectors_import_from_a_given_folder_or_none(cli, tmp_path):
    att, vectors = _clip_vil_folders(tmp_path / "rel")
    sizes = {k: (64, 48) for k in vectors}
    import_features("clip-vil", [att], tmp_path / "none", sizes=sizes, limit=2)  # no *_fc folder beside it: cells
    plain = FeatureStore(tmp_path / "none")
    assert plain.pooled_dim == 0 and len(plain) == 2 and "pooled" not in plain.get("2")
    fc = _write_fc(tmp_path / "elsewhere" / "vectors", vectors)
    sizes_json = tmp_path / "sizes.json"
    sizes_json.write_text(json.dumps({"images": [{"id": int(k), "width": 64, "height": 48} for k in vectors]}))
    args = ["import-features", "--format", "clip-vil", str(att), "--sizes", str(sizes_json), "--fc", str(fc)]
    res = cli.invoke(*args, "--store", str(tmp_path / "given"))
    assert res.exit_code == 0, res.output
    store = FeatureStore(tmp_path / "given")
    assert store.pooled_dim == 6
    for key, vec in vectors.items():
        np.testing.assert_array_equal(store.get(key)["pooled"], vec)
    res = cli.invoke(*args, "--store", str(tmp_path / "none"))  # the cells-only store takes no vectors for image 3
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "image 3 has a pooled vector of 6 values, the store's images have no pooled vector" in " ".join(
        res.output.split()
    )
    (fc / "2.npy").unlink()
    res = cli.invoke(*args, "--store", str(tmp_path / "missing"))
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert f"{fc / '2.npy'}: no pooled vector (_fc file) for image 2" in " ".join(res.output.split())
    report = import_features("clip-vil", [att], tmp_path / "skip", sizes=sizes, fc=fc, skip_bad=True)
    assert report.imported == 2 and len(report.bad) == 1 and "2.npy" in report.bad[0][1]
    np.save(fc / "2.npy", np.zeros((2, 3), np.float32))
    with pytest.raises(PipelineError, match=r"2\.npy: pooled vector has shape \(2, 3\)"):
        import_features("clip-vil", [att], tmp_path / "bad", sizes=sizes, fc=fc)
    with pytest.raises(UsageError, match="--fc"):
        import_features("cocobu", [att], tmp_path / "x", sizes=sizes, fc=fc)


def test_clip_vil_fc_sibling_folder_is_found(tmp_path):
    att, vectors = _clip_vil_folders(tmp_path)
    _write_fc(tmp_path / "coco_clip_RN50_fc", vectors)
    import_features("clip-vil", [att], tmp_path / "s", sizes={k: (64, 48) for k in vectors})
    store = FeatureStore(tmp_path / "s")
    for key, vec in vectors.items():
        np.testing.assert_array_equal(store.get(key)["pooled"], vec)


def test_activation_comes_from_the_release_config_beside_the_weights(tmp_path):
    ref = make_release("vit", seed=14)
    hf_dir, oc_dir = tmp_path / "hf", tmp_path / "oc"
    hf_dir.mkdir()
    oc_dir.mkdir()
    torch.save(hf_state_dict(ref, with_projection=True), hf_dir / "pytorch_model.bin")
    model, info = load_clip(hf_dir / "pytorch_model.bin")
    assert model.config.activation == "quick_gelu" and info["activation_from"].startswith("default")
    hf_config = {"vision_config": {"hidden_act": "gelu", "hidden_size": 128, "num_attention_heads": 2}}
    (hf_dir / "config.json").write_text(json.dumps(hf_config))
    model, info = load_clip(hf_dir / "pytorch_model.bin")
    assert model.config.activation == "gelu" and info["activation_from"] == "config.json"
    assert isinstance(model.transformer.resblocks[0].mlp.gelu, nn.GELU)
    with pytest.raises(ClipWeightsError, match="config.json says 'gelu'"):
        load_clip(hf_dir / "pytorch_model.bin", activation="quick_gelu")
    (hf_dir / "config.json").write_text(json.dumps({"vision_config": {"hidden_act": "relu"}}))
    with pytest.raises(ClipWeightsError, match="activation 'relu'"):
        load_clip(hf_dir / "pytorch_model.bin")
    save_open_clip(ref, oc_dir / "open_clip_pytorch_model.bin")
    (oc_dir / "open_clip_config.json").write_text(json.dumps({"model_cfg": {"embed_dim": 48}}))
    assert load_clip(oc_dir / "open_clip_pytorch_model.bin")[0].config.activation == "gelu"
    (oc_dir / "open_clip_config.json").write_text(json.dumps({"model_cfg": {"quick_gelu": True}}))
    assert load_clip(oc_dir / "open_clip_pytorch_model.bin")[0].config.activation == "quick_gelu"
    st = save_safetensors(
        {k: v.contiguous() for k, v in ref.state_dict().items()}, oc_dir / "open_clip_model.safetensors"
    )
    model, info = load_clip(st)
    assert info["layout"] == "open_clip" and model.config.activation == "quick_gelu"


def test_torch_load_readers_refuse_torchscript_archives_unrun(tmp_path):
    """torch.load(weights_only=True) hands a TorchScript zip to torch.jit.load; the bounds check refuses it first."""
    path = save_openai(make_release("vit", seed=15), tmp_path / "ViT.pt")
    with pytest.raises(UsageError, match=r"ViT\.pt: '.*code/.*': a TorchScript archive"):
        load_weights_file(path, "weights file")
    with pytest.raises(WeightsError, match="a TorchScript archive"):
        read_weights(path)
    assert load_clip(path)[1]["layout"] == "openai"
