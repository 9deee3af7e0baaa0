"""`cli extract` with CLIP weights: grid features in a normal feature store, compared with the release's code.

Tiny random CLIP encoders are written in each public layout by the helpers of ``test_clip`` (an OpenAI TorchScript
archive, an open_clip training checkpoint, Hugging Face ``model.safetensors`` and ``pytorch_model.bin``); ``cli
extract`` runs them on two real photos and a corrupt file, and the stored cells are compared with ``test_clip``'s
re-statement of CLIP-ViL ``clip_prepro_feats.py`` and openai/CLIP ``clip.py`` (features, and each image's pooled
vector: the attention pool's output for the ResNet, the class token for the ViT under ``clip-vil``, ``encode_image``
under ``clip``) and with :func:`extractors.clip.recipe.cell_boxes` (boxes). Then a captioner trains on a CLIP
store of the synthetic world, is evaluated, and captions photos through the CLI from the CLIP weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import test_clip as ref
import torch
from PIL import Image
from train_helpers import TINY

from extractors.clip import ClipRecipe, prepare
from extractors.clip.recipe import cell_boxes
from extractors.releases import get_release, release_of_weights
from extractors.weights import sha256_file
from pipeline.caption_data.prepare import prepare_captions
from pipeline.core.config import load_config
from pipeline.core.stages import run_stage
from pipeline.store import FeatureStore
from pipeline.world.generate import generate_world

FLOAT32 = ["--set", "extract.feature_dtype=float32", "--set", "extract.precision=fp32"]


def _weights(layout: str, folder: Path) -> tuple[Path, ref.RefCLIP]:
    """A tiny random encoder written in ``layout`` (the RN as OpenAI's archive, the ViT in the other layouts)."""
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "openai":
        model = ref.make_release("rn", seed=21)
        return ref.save_openai(model, folder / "RN-tiny.pt"), model
    model = ref.make_release("vit", seed=22)
    if layout == "open_clip":
        ref.save_open_clip_config(folder)
        return ref.save_open_clip(model, folder / "open_clip_pytorch_model.bin"), model
    if layout == "hf-safetensors":
        return ref.save_safetensors(ref.hf_state_dict(model, True), folder / "model.safetensors"), model
    torch.save(ref.hf_state_dict(model, False), folder / "pytorch_model.bin")
    return folder / "pytorch_model.bin", model


@pytest.fixture(scope="module")
def photo_folder(shared_data, tmp_path_factory) -> Path:
    """Two real photos and a corrupt ``.jpg``."""
    folder = tmp_path_factory.mktemp("clip-photos")
    for name in ref.PHOTOS:
        src = shared_data / "photos" / name
        if not src.is_file():
            pytest.skip(f"photo {src} not found")
        shutil.copy(src, folder / name)
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return folder


def _ok(res):
    assert res.exit_code == 0, res.output
    return res


def _stored(store: Path) -> dict[str, dict]:
    st = FeatureStore(store)
    return {Path(k).name: st.get(k) for k in st.keys()}


def _photo_of(key: str, folder: Path) -> Image.Image:
    name = next(n for n in ref.PHOTOS if n == key or Path(n).stem.endswith(key))
    return Image.open(folder / name).convert("RGB")


@pytest.mark.parametrize("layout", ["openai", "open_clip", "hf-safetensors", "hf-bin"])
def test_extract_stores_the_releases_grid(cli, photo_folder, tmp_path, layout):
    weights, model = _weights(layout, tmp_path / "w")
    assert release_of_weights(weights)[0] is get_release("clip-vil")
    out = tmp_path / "run"
    args = ["extract", str(photo_folder), "--weights", str(weights), "--store", str(out), "--workers", "0", *FLOAT32]
    if layout == "openai":  # the user's way once: a child process, its own interpreter and exit code
        res = cli(*args)
        assert res.returncode == 0, res.stderr
    else:
        _ok(cli.invoke(*args))
    store = out
    rows = _stored(store)
    assert len(rows) == 2
    for key, row in rows.items():
        img = _photo_of(key, photo_folder)
        grid, fc = ref.clip_vil_reference(model.visual, ref.clip_vil_preprocess(img))
        assert row["features"].dtype == np.float32 and row["features"].shape == tuple(grid.shape)
        assert ref._rel(torch.from_numpy(row["features"]), grid) < ref.REL_TOL
        # RN: attnpool with the resized positional embedding (32-d); ViT: the class token, no ln_post (128-d)
        assert row["pooled"].dtype == np.float32 and row["pooled"].shape == tuple(fc.shape)
        assert fc.shape == ((32,) if layout == "openai" else (128,))
        assert ref._rel(torch.from_numpy(row["pooled"]), fc) < ref.REL_TOL
        inp = prepare(np.asarray(img), ClipRecipe("clip-vil"), 96)
        np.testing.assert_array_equal(row["boxes"], cell_boxes(inp, (14, 14), 32))  # 448 / 32 (RN stride, ViT patch)
        assert (row["image_w"], row["image_h"]) == img.size
    assert FeatureStore(store).pooled_dim == (32 if layout == "openai" else 128)
    identity = FeatureStore(store).identity
    assert identity["name"] == ("clip-RN-w8-1.2.1.1" if layout == "openai" else "clip-ViT-w128-d2-p32")
    assert identity["layout"] == {"hf-safetensors": "hf", "hf-bin": "hf"}.get(layout, layout)
    assert identity["weights_sha256"] == sha256_file(weights)
    assert identity["config"]["recipe"] == {"name": "clip-vil", "size": 448, "pos_resize": "bicubic"}
    assert identity["config"]["precision"] == "fp32" and identity["config"]["boxes"] == {"mode": "grid"}
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    assert [(f["key"], f["reason"]) for f in failures] == [("broken.jpg", "decode_error")]

    # resumed: nothing extracted again, the same rows
    res = _ok(cli.invoke(*args))
    assert "extracted 0" in res.output
    again = _stored(store)
    assert again.keys() == rows.keys()
    for key in rows:
        np.testing.assert_array_equal(again[key]["features"], rows[key]["features"])
        np.testing.assert_array_equal(again[key]["pooled"], rows[key]["pooled"])


def test_the_clip_recipe_and_a_store_of_another_recipe(cli, photo_folder, tmp_path):
    weights, model = _weights("open_clip", tmp_path / "w")
    out = tmp_path / "run"
    base = ["extract", str(photo_folder), "--weights", str(weights), "--store", str(out), "--workers", "0", *FLOAT32]
    _ok(cli.invoke(*base, "--recipe", "clip"))
    rows = _stored(out)
    for key, row in rows.items():
        img = _photo_of(key, photo_folder)
        with torch.no_grad():
            tokens = _vit_tokens(model.visual, ref.clip_preprocess(img, 96))
            embedding = model.visual(ref.clip_preprocess(img, 96))[0]  # encode_image: ln_post(class token) @ proj
        assert ref._rel(torch.from_numpy(row["features"]), tokens) < ref.REL_TOL
        assert row["pooled"].shape == (48,) and ref._rel(torch.from_numpy(row["pooled"]), embedding) < ref.REL_TOL
        np.testing.assert_array_equal(
            row["boxes"], cell_boxes(prepare(np.asarray(img), ClipRecipe("clip", 0), 96), (3, 3), 32)
        )
    assert FeatureStore(out).identity["config"]["recipe"]["size"] == 96
    res = cli.invoke(*base)  # clip-vil into the clip store: another identity, refused by the store
    assert res.exit_code != 0 and "recipe" in res.output and "Traceback" not in res.output


def _vit_tokens(visual, image):
    """The ViT's patch tokens after the last block (no ln_post) at its own resolution: the reference's token loop."""
    x = visual.conv1(image)
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
    x = torch.cat([visual.class_embedding + torch.zeros(1, 1, x.shape[-1]), x], dim=1)
    x = visual.ln_pre(x + visual.positional_embedding).permute(1, 0, 2)
    for layer in visual.transformer.resblocks:
        x = layer(x)
    return x.permute(1, 0, 2)[0, 1:]


@pytest.mark.parametrize(
    "extra, word",
    [
        (["--boxes", "36"], "--boxes 36"),
        (["--boxes", "given"], "--boxes given"),
        (["--recipe", "caffe"], "'caffe'"),
    ],
)
def test_region_settings_are_refused_in_one_line(cli, photo_folder, tmp_path, extra, word):
    weights, _ = _weights("open_clip", tmp_path / "w")
    res = cli.invoke("extract", str(photo_folder), "--weights", str(weights), "--store", str(tmp_path / "r"), *extra)
    assert res.exit_code != 0
    assert "Traceback" not in res.output and word in res.output and "CLIP" in res.output
    assert not (tmp_path / "r").exists()


def test_detector_files_are_not_claimed(tmp_path):
    torch.save({"backbone.conv1.weight": torch.zeros(1)}, tmp_path / "det.pth")
    assert release_of_weights(tmp_path / "det.pth") is None
    assert release_of_weights("random") is None and release_of_weights(tmp_path / "missing.pt") is None


@pytest.mark.slow
def test_captioner_trains_evaluates_and_captions_on_clip_features(cli, tmp_path):
    """The synthetic world through CLIP grid features: extract, train one epoch, evaluate, caption from photos."""
    torch.set_num_threads(1)
    root = tmp_path
    generate_world(root / "world", load_config("world", None, ["world.num_images=40", "world.num_workers=1"]).world)
    cfg = load_config(
        "prepare",
        None,
        [
            f"prepare.karpathy_json={root / 'world/annotations/dataset_coco.json'}",
            "prepare.word_count_threshold=0",
            "prepare.key=filename",
        ],
    )
    run_stage(root / "run", "data", cfg.prepare, prepare_captions)
    weights, _ = _weights("openai", root / "w")
    store = root / "store"
    images = root / "world" / "images"
    _ok(cli.invoke("extract", "--device", "cpu", str(images), "--weights", str(weights), "--store", str(store)))
    st = FeatureStore(store)
    assert len(st) == 40 and st.feature_dim == 256 and st.get(st.keys()[0])["boxes"].shape == (196, 4)
    out = root / "run-clip"
    sets = [
        "train.model=san",
        f"train.store={store}",
        f"train.data={root / 'run/data'}",
        "train.device=cpu",
        "train.preload=memory",
        "train.stages=[xe]",
        "train.xe={epochs: 1, batch_size: 16, lr: 1.0e-3, warmup_iters: 0}",
        *TINY,
    ]
    _ok(cli.invoke("train", "--out", str(out), *[a for s in sets for a in ("--set", s)]))
    ckpt = out / "train-san" / "best.pt"
    metrics_path = root / "metrics.json"
    _ok(
        cli.invoke(
            "evaluate",
            "--model",
            str(ckpt),
            "--store",
            str(store),
            "--data",
            str(root / "run/data"),
            "--set",
            "evaluate.metrics=[cider]",
            "--output",
            str(metrics_path),
        )
    )
    assert "CIDEr" in metrics_path.read_text()
    photos = sorted(images.iterdir())[:3]
    caps_path = root / "caps.json"
    _ok(
        cli.invoke(
            "caption",
            "--device",
            "cpu",
            *map(str, photos),
            "--model",
            str(ckpt),
            "--weights",
            str(weights),
            "--output",
            str(caps_path),
        )
    )
    caps = json.loads(caps_path.read_text())
    assert len(caps) == 3 and all(isinstance(c.get("caption"), str) for c in caps)
