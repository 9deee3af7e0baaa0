"""CLIP settings the weights do not hold: the attention head count, the ViT MLP's activation and width.

open_clip's larger ViTs have heads wider than OpenAI's 64 channels (``vision_cfg.head_width``: ViT-H/14 1280 / 80,
ViT-g/14 1408 / 88, ViT-bigG/14 1664 / 104) and, for g and bigG, an MLP ratio other than 4; Hugging Face configs
name ``num_attention_heads``; open_clip's default activation is GELU while its OpenAI-pretrained files use QuickGELU.
Tiny seeded encoders are written in each layout with the helpers of ``test_clip`` and compared with its
re-statement of openai/CLIP's ``VisionTransformer`` (``nn.MultiheadAttention`` with the head count given), and the
refusals are checked to be one line naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import test_clip as ref
import torch
from PIL import Image
from torch import nn
from typer.testing import CliRunner

from cli import app
from extractors.clip import ClipRecipe, ClipWeightsError, load_clip, prepare
from extractors.clip.files import WIDE_HEAD_WIDTHS
from extractors.clip.model import PRESETS, ClipVisionConfig, build, infer_config
from extractors.clip.random_weights import write_random_clip
from extractors.clip.recipe import cell_boxes
from extractors.clip.run import ClipSpec, arch_name
from pipeline.core.config import Config, load_config
from pipeline.core.renamed import upgrade_recorded_config
from pipeline.store import FeatureStore

FLOAT32 = ["--set", "extract.feature_dtype=float32", "--set", "extract.precision=fp32"]
#: 320 channels in 80-wide heads: 4 heads, where OpenAI's rule (width // 64) gives 5
WIDE = dict(width=320, heads=4)


def vit_release(width: int, heads: int, seed: int, mlp: int = 0, gelu: bool = False) -> ref.RefCLIP:
    """A 2-block ViT (64 px input, 32 px patches) of the re-stated release code with ``heads`` attention heads, an
    MLP of ``mlp`` hidden channels (4 x width when 0) and GELU or QuickGELU."""
    visual = ref.RefVisionTransformer(64, 32, width, 2, heads, 24)
    for block in visual.transformer.resblocks:
        if mlp:
            block.mlp.c_fc, block.mlp.c_proj = nn.Linear(width, mlp), nn.Linear(mlp, width)
        if gelu:
            block.mlp.gelu = nn.GELU()
    model = ref.RefCLIP(visual)
    ref._randomise(model, seed)
    return model.eval()


def _encode_image(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.embed(model.tokens(x)[0])


def _same_as_reference(model: nn.Module, release: ref.RefCLIP) -> None:
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = release.visual(x)
    assert ref._rel(_encode_image(model, x), want) < ref.REL_TOL


def _one_line(err: pytest.ExceptionInfo, *words: str) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    for word in words:
        assert word in text, (word, text)
    return text


# ------------------------------------------------------------------ heads
def test_open_clip_head_width_gives_the_head_count(tmp_path):
    release = vit_release(**WIDE, seed=31)
    path = ref.save_open_clip(release, tmp_path / "open_clip_pytorch_model.bin")
    ref.save_open_clip_config(tmp_path, width=320, head_width=80)
    model, info = load_clip(path)
    assert model.config.heads == 4 and model.config.head_width == 80 and info["heads_from"] == "open_clip_config.json"
    assert model.transformer.resblocks[0].attn.heads == 4
    _same_as_reference(model, release)
    # OpenAI's rule (320 // 64 = 5 heads) runs another network on the same weights
    wrong = build(model.config.with_(head_width=0))
    wrong.load_state_dict(model.state_dict())
    x = torch.randn(1, 3, 64, 64)
    assert wrong.config.heads == 5 and ref._rel(_encode_image(wrong, x), _encode_image(model, x)) > 1e-3


def test_open_clip_head_width_of_a_resnet_attention_pool(tmp_path):
    """open_clip's ModifiedResNet: ``width * 32 // head_width`` heads in the attention pool."""
    visual = ref.RefModifiedResNet(**(ref.RN_TINY | {"heads": 8}))  # 256 channels in 32-wide heads
    release = ref.RefCLIP(visual)
    ref._randomise(release, 32)
    release.eval()
    path = ref.save_open_clip(release, tmp_path / "rn.pt")
    ref.save_open_clip_config(tmp_path, head_width=32)
    model, _ = load_clip(path)
    assert model.config.heads == 8 and model.attnpool.heads == 8
    x = torch.randn(1, 3, 96, 96, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert ref._rel(model.pool(model.grid(x)), release.visual(x)) < ref.REL_TOL


def test_hf_num_attention_heads_gives_the_head_count(tmp_path):
    release = vit_release(**WIDE, seed=33)
    torch.save(ref.hf_state_dict(release, with_projection=True), tmp_path / "pytorch_model.bin")
    for config in ({"vision_config": {"num_attention_heads": 4}}, {"num_attention_heads": 4, "hidden_size": 320}):
        (tmp_path / "config.json").write_text(json.dumps(config))
        model, info = load_clip(tmp_path / "pytorch_model.bin")
        assert model.config.heads == 4 and info["heads_from"] == "config.json"
        _same_as_reference(model, release)
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"num_attention_heads": 3}}))
    with pytest.raises(ClipWeightsError) as err:
        load_clip(tmp_path / "pytorch_model.bin")
    _one_line(err, str(tmp_path / "config.json"), "'vision_config.num_attention_heads' 3 does not divide the 320")
    for bad in (0, -4, 2.5, True, "4"):
        (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"num_attention_heads": bad}}))
        with pytest.raises(ClipWeightsError) as err:
            load_clip(tmp_path / "pytorch_model.bin")
        _one_line(err, str(tmp_path / "config.json"), "must be a positive integer")


def test_hf_config_without_a_head_count_runs_transformers_default_twelve(tmp_path):
    """``save_pretrained`` leaves ``num_attention_heads`` out when it is transformers' default 12: a 192-wide
    encoder with such a config runs 12 heads of 16 channels, not OpenAI's 3 heads of 64."""
    release = vit_release(width=192, heads=12, seed=35)
    torch.save(ref.hf_state_dict(release, with_projection=True), tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"hidden_size": 192}}))
    model, info = load_clip(tmp_path / "pytorch_model.bin")
    assert model.config.heads == 12 and info["heads_from"] == "config.json"
    _same_as_reference(model, release)
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"hidden_size": 320}}))
    torch.save(ref.hf_state_dict(vit_release(**WIDE, seed=36), with_projection=True), tmp_path / "pytorch_model.bin")
    with pytest.raises(ClipWeightsError) as err:  # 12 heads do not divide 320 channels
        load_clip(tmp_path / "pytorch_model.bin")
    _one_line(err, str(tmp_path / "config.json"), "12 does not divide the 320")


def test_bad_head_width_in_open_clip_config_is_refused(tmp_path):
    path = ref.save_open_clip(vit_release(**WIDE, seed=34), tmp_path / "w.bin")
    for head_width, words in ((0, "must be a positive integer"), ("80", "must be a positive integer"),
                              (96, "'model_cfg.vision_cfg.head_width' 96 does not divide the 320")):  # fmt: skip
        ref.save_open_clip_config(tmp_path, head_width=head_width)
        with pytest.raises(ClipWeightsError) as err:
            load_clip(path)
        _one_line(err, str(tmp_path / "open_clip_config.json"), words)


def test_given_heads_and_their_contradiction(tmp_path):
    release = vit_release(**WIDE, seed=35)
    path = ref.save_open_clip(release, tmp_path / "w.bin")
    model, info = load_clip(path, activation="quick_gelu", heads=4)  # no config beside the file
    assert model.config.heads == 4 and info["heads_from"] == "given" and info["activation_from"] == "given"
    _same_as_reference(model, release)
    with pytest.raises(ClipWeightsError) as err:
        load_clip(path, activation="quick_gelu", heads=6)
    _one_line(err, str(path), "6 attention heads do not divide its 320 attention channels")
    ref.save_open_clip_config(tmp_path, head_width=80)
    assert load_clip(path, heads=4)[1]["heads_from"] == "open_clip_config.json"
    with pytest.raises(ClipWeightsError) as err:
        load_clip(path, heads=5)
    _one_line(err, str(path), "5 attention heads were asked for but open_clip_config.json says 4")


def _wide_state_dict(width: int, hf: bool) -> dict[str, torch.Tensor]:
    """The keys ``infer_config`` reads of a ViT ``width`` wide (1 x 1 patches, a 1-cell grid); the block's tensors are
    stand-ins: the head count is refused before the shapes are checked or anything is built."""
    if hf:
        layer = "vision_model.encoder.layers.0.self_attn."
        return {
            "vision_model.embeddings.class_embedding": torch.zeros(width),
            "vision_model.embeddings.patch_embedding.weight": torch.zeros(width, 3, 1, 1),
            "vision_model.embeddings.position_embedding.weight": torch.zeros(2, width),
            **{f"{layer}{p}_proj.weight": torch.zeros(1) for p in "qkv"},
        }
    return {
        "visual.class_embedding": torch.zeros(width),
        "visual.conv1.weight": torch.zeros(width, 3, 1, 1),
        "visual.positional_embedding": torch.zeros(2, width),
        "visual.transformer.resblocks.0.attn.in_proj_weight": torch.zeros(1),
    }


@pytest.mark.parametrize("width", WIDE_HEAD_WIDTHS)
def test_wide_vits_without_a_head_count_are_refused(tmp_path, width):
    oc = tmp_path / "oc" / "open_clip_pytorch_model.bin"
    hf = tmp_path / "hf" / "pytorch_model.bin"
    for path, is_hf in ((oc, False), (hf, True)):
        path.parent.mkdir()
        torch.save(_wide_state_dict(width, is_hf), path)
    with pytest.raises(ClipWeightsError) as err:
        load_clip(oc, activation="gelu")
    text = _one_line(err, str(oc), f"head count of a ViT {width} wide cannot be known without", "open_clip_config.json")
    assert f"not {width // 64}" in text
    with pytest.raises(ClipWeightsError) as err:
        load_clip(hf)
    _one_line(err, str(hf), "cannot be known without the release's config.json")
    (hf.parent / "config.json").write_text(json.dumps({"vision_config": {"hidden_act": "gelu"}}))
    with pytest.raises(ClipWeightsError) as err:  # a config that does not name the heads: transformers' 12
        load_clip(hf)
    _one_line(err, str(hf.parent / "config.json"), f"12 does not divide the {width}")
    (hf.parent / "config.json").unlink()
    for path, kw in ((oc, {"activation": "gelu", "heads": 16}), (hf, {"heads": 16})):
        with pytest.raises(ClipWeightsError) as err:  # with a head count the strict check comes next
            load_clip(path, **kw)
        _one_line(err, str(path), "missing key")
    ref.save_open_clip_config(oc.parent, quick_gelu=False, width=width, head_width=width // 16)
    with pytest.raises(ClipWeightsError) as err:
        load_clip(oc)
    _one_line(err, str(oc), "missing key")


# ------------------------------------------------------------------ activation
def test_open_clip_vit_without_config_needs_the_activation(tmp_path):
    release = vit_release(128, 2, seed=36, gelu=True)
    path = ref.save_open_clip(release, tmp_path / "open_clip_pytorch_model.bin")
    with pytest.raises(ClipWeightsError) as err:
        load_clip(path)
    _one_line(err, str(path), "open_clip_config.json", "give the activation")
    model, info = load_clip(path, activation="gelu")
    assert model.config.activation == "gelu" and info["activation_from"] == "given"
    _same_as_reference(model, release)
    rn = ref.save_open_clip(ref.make_release("rn", seed=37), tmp_path / "rn.pt")  # no MLP: loads as it is
    assert load_clip(rn)[0].config.kind == "resnet"
    openai = ref.save_openai(ref.make_release("vit", seed=38), tmp_path / "ViT.pt")  # OpenAI's: QuickGELU
    assert load_clip(openai)[1]["activation_from"].startswith("default")


# ------------------------------------------------------------------ MLP width, text towers
def test_mlp_ratio_other_than_four(tmp_path):
    """ViT-g/14 (mlp_ratio 4.3637) and ViT-bigG/14 (4.9231): the MLP width comes from ``c_fc``."""
    release = vit_release(128, 2, seed=39, mlp=630)  # int(128 * 4.9231)
    path = ref.save_open_clip(release, tmp_path / "w.bin")
    ref.save_open_clip_config(tmp_path, width=128, mlp_ratio=4.9231)
    model, _ = load_clip(path)
    assert model.config.mlp_dim == 630 and model.config.mlp_width == 630
    assert model.config.to_dict()["mlp_dim"] == 630
    _same_as_reference(model, release)
    assert infer_config(release.visual.state_dict()).mlp_dim == 630


def test_custom_text_clip_keys_are_skipped(tmp_path):
    """open_clip ``CustomTextCLIP``: the text tower under ``text.``."""
    release = vit_release(128, 2, seed=40)
    text = {"text.transformer.resblocks.0.ln_1.weight": torch.ones(64), "text.token_embedding.weight":
            torch.zeros(10, 64), "text.ln_final.bias": torch.zeros(64), "text.text_projection": torch.zeros(64, 24),
            "logit_scale": torch.tensor(4.6)}  # fmt: skip
    state = {f"visual.{k}": v for k, v in release.visual.state_dict().items()} | text
    torch.save(state, tmp_path / "open_clip_pytorch_model.bin")
    ref.save_open_clip_config(tmp_path)
    model, info = load_clip(tmp_path / "open_clip_pytorch_model.bin")
    assert info["layout"] == "open_clip"
    _same_as_reference(model, release)
    torch.save(state | {"textual.weight": torch.zeros(1)}, tmp_path / "bad.bin")
    with pytest.raises(ClipWeightsError) as err:
        load_clip(tmp_path / "bad.bin")
    _one_line(err, "unexpected key 'textual.weight'")


# ------------------------------------------------------------------ records and identities
def test_default_settings_leave_records_and_identities_without_the_fields():
    fields = ["kind", "width", "layers", "resolution", "embed_dim", "patch", "activation"]
    for name, cfg in PRESETS.items():
        assert list(ClipSpec(cfg).to_dict()) == fields, name
        assert cfg.with_(head_width=64) == cfg and cfg.with_(head_width=64).to_dict() == cfg.to_dict()
    vit = PRESETS["ViT-B/16"]
    assert vit.with_(mlp_dim=4 * 768) == vit and arch_name(vit) == "ViT-B-16"
    wide = vit.with_(head_width=96, mlp_dim=2048)
    assert wide.heads == 8 and ClipSpec(wide).to_dict() == ClipSpec(vit).to_dict() | {"head_width": 96, "mlp_dim": 2048}
    assert arch_name(wide) == "ViT-w768-d12-p16"
    with pytest.raises(ValueError):
        vit.with_(head_width=100)  # 768 channels in heads of 100
    with pytest.raises(ValueError):
        PRESETS["RN50"].with_(mlp_dim=10)
    assert ClipVisionConfig("vit", 96, (1,), 64, 0, patch=32, head_width=32).heads == 3  # not a multiple of 64


def test_a_recorded_extract_config_without_the_setting_is_the_same_config():
    ex = load_config("extract").extract.to_dict()
    assert ex["clip_encoder"] == {"activation": None, "heads": None}
    recorded = {k: v for k, v in ex.items() if k != "clip_encoder"}
    current = {"extract": ex, "job": {"weights": "random"}}
    upgraded = upgrade_recorded_config({"extract": recorded, "job": {"weights": "random"}})
    assert Config(upgraded).digest() == Config(current).digest()
    assert Config(upgrade_recorded_config(recorded)).digest() == Config(ex).digest()


def test_random_encoders_are_written_with_their_config(tmp_path):
    cfg = ClipVisionConfig("vit", 160, (1,), 64, 16, patch=32, activation="gelu", head_width=80, mlp_dim=300)
    path = write_random_clip(cfg, tmp_path / "clip-random.pt", seed=3)
    assert json.loads((tmp_path / "open_clip_config.json").read_text())["model_cfg"]["vision_cfg"]["head_width"] == 80
    model, info = load_clip(path)
    assert model.config == cfg and info["activation_from"] == info["heads_from"] == "open_clip_config.json"


# ------------------------------------------------------------------ cli extract
@pytest.fixture()
def pictures(tmp_path) -> Path:
    folder = tmp_path / "pictures"
    folder.mkdir()
    rng = np.random.default_rng(5)
    for i, size in enumerate(((90, 70), (64, 100))):
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(folder / f"p{i}.png")
    return folder


def test_extract_takes_the_encoder_settings(cli, pictures, tmp_path):
    release = vit_release(**WIDE, seed=41, gelu=True)
    (tmp_path / "w").mkdir()
    weights = ref.save_open_clip(release, tmp_path / "w" / "open_clip_pytorch_model.bin")
    base = ["extract", str(pictures), "--weights", str(weights), "--workers", "0", *FLOAT32]

    res = cli.invoke(*base, "--store", str(tmp_path / "refused"))
    assert res.exit_code == 2 and "Traceback" not in res.output
    text = " ".join(res.output.split())
    assert str(weights) in text and "open_clip_config.json" in text and "extract.clip_encoder.activation" in text
    assert not (tmp_path / "refused").exists()  # refused from the file's names, before the stage takes its folder

    sets = ["--set", "extract.clip_encoder.activation=gelu", "--set", "extract.clip_encoder.heads=4"]
    res = cli.invoke(*base, *sets, "--store", str(tmp_path / "run"))
    assert res.exit_code == 0, res.output
    store = FeatureStore(tmp_path / "run")
    spec = store.identity["config"]["spec"]
    assert spec["activation"] == "gelu" and spec["head_width"] == 80 and "mlp_dim" not in spec
    assert len(store) == 2
    for key in store.keys():
        img = Image.open(pictures / Path(key).name).convert("RGB")
        grid, fc = ref.clip_vil_reference(release.visual, ref.clip_vil_preprocess(img))
        row = store.get(key)
        assert ref._rel(torch.from_numpy(row["features"]), grid) < ref.REL_TOL
        assert ref._rel(torch.from_numpy(row["pooled"]), fc) < ref.REL_TOL
        inp = prepare(np.asarray(img), ClipRecipe("clip-vil"), 64)
        np.testing.assert_array_equal(row["boxes"], cell_boxes(inp, (14, 14), 32))

    ref.save_open_clip_config(weights.parent, quick_gelu=False, head_width=80)
    for i, (setting, words) in enumerate(
        [
            ("extract.clip_encoder.heads=5", "5 attention heads were asked for but open_clip_config.json says 4"),
            ("extract.clip_encoder.activation=quick_gelu", "open_clip_config.json says 'gelu'"),
            ("extract.clip_encoder.heads=0", "extract.clip_encoder.heads must be null or a positive integer"),
            (
                "extract.clip_encoder.activation=relu",
                "extract.clip_encoder.activation must be null, quick_gelu or gelu",
            ),
        ]
    ):
        res = cli.invoke(*base, "--set", setting, "--store", str(tmp_path / f"refused{i}"))
        assert res.exit_code != 0 and "Traceback" not in res.output, res.output
        assert words in " ".join(res.output.split()), res.output
        assert i < 2 or not (tmp_path / f"refused{i}").exists()  # out-of-range values: refused before any work
    res = cli.invoke(*base, "--store", str(tmp_path / "from-config"))  # the config beside the weights alone
    assert res.exit_code == 0, res.output
    again = FeatureStore(tmp_path / "from-config")
    assert again.identity["config"]["spec"] == spec
    for key in store.keys():
        np.testing.assert_array_equal(again.get(key)["features"], store.get(key)["features"])


# ------------------------------------------------------------------ caption
def test_caption_takes_the_encoder_settings_from_its_own_section(tiny_captioners, shared_data, tmp_path):
    """``caption --weights`` with an open_clip ViT and no config beside it: refused in one line naming
    ``caption.clip_encoder.activation``; with that setting the photos are captioned (a captioner of 128-d features,
    the ViT's width)."""
    photo = shared_data / "photos" / ref.PHOTOS[0]
    if not photo.is_file():
        pytest.skip(f"photo {photo} not found")
    path = ref.save_open_clip(vit_release(128, 2, seed=41, gelu=True), tmp_path / "open_clip_pytorch_model.bin")
    ckpt = tiny_captioners / "train-b" / "best.pt"
    args = ["caption", "--device", "cpu", str(photo), "--model", str(ckpt), "--weights", str(path)]
    res = CliRunner().invoke(app, [*args, "--output", str(tmp_path / "refused.jsonl")])
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.exit_code == 2 and len(errors) == 1, res.output
    assert "caption.clip_encoder.activation" in errors[0] and str(path) in errors[0]
    out = tmp_path / "caps.jsonl"
    res = CliRunner().invoke(app, [*args, "--output", str(out), "--set", "caption.clip_encoder.activation=gelu"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1 and isinstance(rows[0].get("caption"), str)
    res = CliRunner().invoke(app, [*args, "--output", str(out), "--set", "caption.clip_encoder.heads=0"])
    assert res.exit_code == 2 and "caption.clip_encoder.heads must be null or a positive integer" in res.output


def test_a_recorded_caption_section_without_the_setting_is_the_same_config():
    """The demo's pictures stage records the ``caption:`` section: a recorded section without ``clip_encoder`` reads
    as one with its default (null, null), and a set value still counts."""
    cap = load_config("caption").caption.to_dict()
    assert cap["clip_encoder"] == {"activation": None, "heads": None}
    recorded = {"count": 3, "caption": {k: v for k, v in cap.items() if k != "clip_encoder"}, "decoding": {}}
    current = {"count": 3, "caption": cap, "decoding": {}}
    assert Config(upgrade_recorded_config(recorded)).digest() == Config(current).digest()
    changed = {**current, "caption": {**cap, "clip_encoder": {"activation": "gelu", "heads": None}}}
    assert Config(upgrade_recorded_config(changed)).digest() != Config(current).digest()
