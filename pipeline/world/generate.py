"""The ``world`` stage: generate N images with annotations into a folder, deterministically and resumably.

Every image ``i`` draws from its own random streams (``SeedSequence([seed, i])``), so the output does not
depend on the number of worker processes or on where an interrupted run stopped: the same seed gives
byte-identical files. Images are written atomically; a re-run skips those already on disk and only
re-derives their annotations (cheap), then writes the annotation files atomically.
"""

from __future__ import annotations

import io
import multiprocessing as mp
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core import threads as thread_policy
from pipeline.core.config import Config
from pipeline.core.console import get_logger, make_progress
from pipeline.core.errors import ConfigError
from pipeline.core.fileio import atomic_write_bytes, atomic_write_json
from pipeline.world.captions import CAPTION_STYLES, make_captions, make_relation_captions, tokenize
from pipeline.world.export import SPLITS, write_annotations
from pipeline.world.render import render_scene
from pipeline.world.scene import SceneParams, sample_scene
from pipeline.world.vocab import BACKGROUNDS, COLOURS, SHAPES, SIZES, attribute_names

log = get_logger("world")

IMAGE_DIR = "images"
FORMAT_VERSION = 1


def scene_params(cfg: Config) -> SceneParams:
    """Validate the ``world`` section and turn it into :class:`SceneParams`."""
    lo, hi = cfg.image_size
    if not (16 <= lo <= hi <= 4096):
        raise ConfigError(
            f"world.image_size must be [min, max] with 16 <= min <= max <= 4096, got {list(cfg.image_size)}"
        )
    if not (1 <= cfg.min_objects <= cfg.max_objects <= 6):
        raise ConfigError("world.min_objects/max_objects must satisfy 1 <= min <= max <= 6")
    return SceneParams(
        min_size=int(lo),
        max_size=int(hi),
        min_objects=int(cfg.min_objects),
        max_objects=int(cfg.max_objects),
        max_overlap=float(cfg.max_overlap),
    )


def world_stage_config(cfg: Config) -> Config:
    """The ``world`` section as the world stage records it: ``captions`` only when it is not the default
    ``mixed``, so worlds generated before that key existed keep their config digest (and are not redone)."""
    if str(cfg.get("captions", "mixed")) != "mixed":
        return cfg
    return Config({k: v for k, v in cfg.to_dict().items() if k != "captions"}, cfg.open_paths)


def split_of(index: int, num_images: int, fractions: Config) -> str:
    """Split of image ``index``: the first images are train, then val, then test (by ``fractions``)."""
    n_val = int(round(num_images * float(fractions.val)))
    n_test = int(round(num_images * float(fractions.test)))
    n_train = num_images - n_val - n_test
    if index < n_train:
        return "train"
    if index < n_train + n_val:
        return "val"
    return "test"


def file_name(image_id: int, ext: str) -> str:
    return f"world_{image_id:06d}.{ext}"


def make_image(task: tuple[int, int, dict[str, Any], str, int, str, str]) -> dict[str, Any]:
    """Build (and, unless already on disk, write) image ``index``; returns its annotation record."""
    index, seed, params_d, image_format, quality, out_dir, style = task
    params = SceneParams(**params_d)
    scene_ss, render_ss, caption_ss = np.random.SeedSequence([seed, index]).spawn(3)
    scene = sample_scene(np.random.default_rng(scene_ss), params)
    image_id = index + 1
    name = file_name(image_id, image_format)
    path = Path(out_dir) / IMAGE_DIR / name
    if not path.exists():
        img = render_scene(scene, np.random.default_rng(render_ss))
        buf = io.BytesIO()
        if image_format == "jpg":
            img.save(buf, format="JPEG", quality=quality, subsampling=0, optimize=False)
        else:
            img.save(buf, format="PNG", optimize=False, compress_level=6)
        atomic_write_bytes(path, buf.getvalue())
    captioner = make_relation_captions if style == "relations" else make_captions
    captions = captioner(scene, np.random.default_rng(caption_ss))
    return {
        "id": image_id,
        "file_name": name,
        "width": scene.width,
        "height": scene.height,
        "background": scene.background,
        "objects": [
            {
                "shape": o.shape,
                "colour": o.colour,
                "size": o.size,
                "box": list(o.box),
                "polygon": [list(p) for p in o.polygon],
                "hole": [list(p) for p in o.hole],
            }
            for o in scene.objects
        ],
        "captions": captions,
        "tokens": [tokenize(c) for c in captions],
    }


def _records(tasks: list[tuple], workers: int) -> Iterator[dict[str, Any]]:
    if workers <= 1 or len(tasks) < 64:
        for t in tasks:
            yield make_image(t)
        return
    ctx = mp.get_context("spawn")
    with ctx.Pool(thread_policy.pool_size(workers)) as pool:
        yield from pool.imap(make_image, tasks, chunksize=32)


def generate_world(out_dir: str | Path, cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    """Generate the world described by ``cfg`` (the ``world`` section) into ``out_dir``.

    Returns ``(outputs, summary)`` for the stage manifest.
    """
    out = Path(out_dir)
    n = int(cfg.num_images)
    if n < 1:
        raise ConfigError(f"world.num_images must be >= 1, got {n}")
    fmt = str(cfg.image_format)
    if fmt not in ("jpg", "png"):
        raise ConfigError(f"world.image_format must be 'jpg' or 'png', got {fmt!r}")
    params = scene_params(cfg)
    style = str(cfg.get("captions", "mixed"))
    if style not in CAPTION_STYLES:
        raise ConfigError(f"world.captions must be one of {', '.join(CAPTION_STYLES)}, got {style!r}")
    (out / IMAGE_DIR).mkdir(parents=True, exist_ok=True)
    tasks = [(i, int(cfg.seed), params.__dict__, fmt, int(cfg.jpeg_quality), str(out), style) for i in range(n)]
    records: list[dict[str, Any]] = []
    with make_progress() as progress:
        bar = progress.add_task("generating world", total=n)
        for rec in _records(tasks, int(cfg.num_workers)):
            rec["split"] = split_of(rec["id"] - 1, n, cfg.splits)
            records.append(rec)
            progress.advance(bar)
    outputs: dict[str, Any] = {"images": IMAGE_DIR}
    outputs.update(write_annotations(records, out / "annotations", IMAGE_DIR))
    counts = {s: sum(r["split"] == s for r in records) for s in SPLITS}
    summary = {
        "images": n,
        "objects": sum(len(r["objects"]) for r in records),
        "captions": sum(len(r["captions"]) for r in records),
        "splits": counts,
    }
    atomic_write_json(
        out / "world.json",
        {
            "format": "butd-caption-world",
            "version": FORMAT_VERSION,
            "seed": int(cfg.seed),
            "num_images": n,
            "shapes": list(SHAPES),
            "colours": {k: list(v) for k, v in COLOURS.items()},
            "sizes": {k: list(v) for k, v in SIZES.items()},
            "attributes": attribute_names(),
            "backgrounds": list(BACKGROUNDS),
            "summary": summary,
        },
    )
    outputs["world"] = "world.json"
    log.info(
        "world: %d images (%s), %d objects, %d captions in %s", n, counts, summary["objects"], summary["captions"], out
    )
    return outputs, summary
