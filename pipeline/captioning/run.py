"""The work behind ``cli caption``: resolve the model and detector, caption, print and write the results."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from pipeline.core.config import Config
from pipeline.core.console import get_logger, make_progress, stdout_console
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.fileio import atomic_write_bytes, atomic_write_text, read_json

log = get_logger("caption")


def find_checkpoint(model: Path) -> Path:
    """A checkpoint file, or the best checkpoint of a run directory's single trained captioner."""
    if model.is_file():
        return model
    if not model.exists():
        raise UsageError(
            f"no captioner at {model}: run `python cli.py demo` to train the demo model, "
            "or pass --model CHECKPOINT.pt (a checkpoint written by `train`)"
        )
    found = sorted(model.glob("train-*/best.pt")) or sorted(model.glob("best.pt"))
    if not found:
        raise UsageError(
            f"{model} holds no trained captioner (no train-*/best.pt): run `python cli.py demo --out {model}` "
            "or pass --model CHECKPOINT.pt"
        )
    if len(found) > 1:
        names = ", ".join(str(p) for p in found)
        raise UsageError(f"{model} holds several captioners ({names}); pass one with --model")
    return found[0]


def find_detector(model: Path, checkpoint: Path, weights: str | None) -> str:
    """``--weights`` if given, else the detector of the run directory the checkpoint belongs to."""
    if weights:
        if weights != "random" and not Path(weights).is_file():
            raise UsageError(f"detector weights not found: {weights}")
        return weights
    for run in ([model] if model.is_dir() else []) + [checkpoint.parent.parent]:
        manifest = run / "detector" / "manifest.json"
        if manifest.is_file():
            data = read_json(manifest, what="detector stage manifest")
            rel = data.get("outputs", {}).get("weights")
            if rel and (run / "detector" / rel).is_file():
                return str(run / "detector" / rel)
    raise UsageError(
        "no detector found for this captioner: pass --weights (a bottom-up checkpoint such as "
        "bua-caffe-frcn-r101_with_attributes.pth, or the demo's runs/demo/detector/... weights)"
    )


def caption_photos(
    photos: list[str], model: Path, weights: str | None, cfg: Config, output: Path | None = None,
    visualize: Path | None = None, cache: Path | None = None, decoding: dict[str, Any] | None = None, vocab: Path | None = None,
) -> list[Any]:
    """Caption ``photos`` and report; returns the :class:`CaptionResult` list.

    ``decoding`` overrides the checkpoint's decoding options; ``vocab`` is a released model's vocabulary file.
    """
    import torch

    from extractors.factory import configure_recipe, load_for_inference, resolve_device
    from extractors.names import detector_names
    from extractors.run import items_from_paths
    from models.captions import merge_decoding
    from models.decoding import DecodeOptions
    from pipeline.captioning.engine import PhotoCaptioner
    from models.checkpoints import load_captioner
    from pipeline.core.vocab import Vocab

    if output is not None and output.suffix.lower() not in (".jsonl", ".json", ".csv"):
        raise UsageError(f"--output must end in .jsonl, .json or .csv, not {output.name}")
    items = items_from_paths(photos)
    if not items:
        raise UsageError(f"no image files found in {', '.join(photos)}")
    if all(it.problem is not None for it in items):
        from pipeline.core.keys import key_to_text

        shown = "; ".join(f"{key_to_text(str(it.path))} ({it.problem[1]})" for it in items[:5])  # type: ignore[index]
        raise UsageError(f"no usable images in the given inputs: {shown}{' ...' if len(items) > 5 else ''}")
    ckpt_path = find_checkpoint(model)
    det_weights = find_detector(model, ckpt_path, weights)
    device = resolve_device(str(cfg.device))
    captioner, ckpt = load_captioner(ckpt_path, device, companion=vocab)
    cfg = _release_features(cfg, ckpt.get("release"))
    overrides = dict(decoding or {})
    vocab = Vocab(tuple(ckpt["vocab"]))
    decoding = dict(ckpt.get("decoding") or {})
    if cfg.beam_size is not None:
        decoding.update(method="beam", beam_size=int(cfg.beam_size))
    decoding["n_best"] = int(cfg.n_best) if decoding.get("method", "beam") == "beam" else 1
    if decoding.get("method", "beam") == "beam":
        decoding["beam_size"] = max(int(decoding.get("beam_size", 3)), decoding["n_best"])
    options = DecodeOptions.from_mapping(merge_decoding(decoding, overrides))

    detector, identity, info = load_for_inference(det_weights, "auto", {}, 0, device)
    # caption.max_boxes is what the captioner gets, not a recipe field
    recipe, rule = configure_recipe(detector, identity, cfg, "caption", ("min_size", "max_size", "conf_thresh", "nms_thresh"))
    if recipe.selector == "given":
        raise UsageError("caption.boxes given: photos have no boxes to give; use adaptive, 36 or null (the recipe's own)")
    trained_with = ckpt.get("store_identity") or {}
    if trained_with.get("weights_sha256") and trained_with["weights_sha256"] != identity["weights_sha256"]:
        log.warning("the captioner was trained on features of another detector (%s); captions may be poor",
                    trained_with.get("name", "unknown"))
    classes, attributes = detector_names(info, detector.spec.num_classes - 1, detector.spec.num_attributes - 1)
    max_boxes = cfg.max_boxes if cfg.max_boxes is not None else (ckpt.get("train_config") or {}).get("max_boxes")
    engine = PhotoCaptioner(detector, rule, captioner, vocab, options, device, max_boxes=max_boxes, max_pixels=int(cfg.max_pixels))
    expected = getattr(captioner, "feat_dim", None)

    writer = None
    if cache is not None:
        from pipeline.captioning.engine import FeatureCache

        from extractors.run import record_settings

        writer = FeatureCache(cache, record_settings(identity, rule, "fp32"))
    results = []
    try:
        with make_progress() as progress, torch.inference_mode(False):
            task = progress.add_task("caption", total=len(items))
            for res in engine.caption_paths(items, int(cfg.batch_size), cache=writer, keep_images=visualize is not None,
                                            relevance=visualize is not None):
                if res.error is None and expected is not None and res.regions is not None:
                    dim = res.regions["features"].shape[1]
                    if dim != expected:
                        raise PipelineError(f"the captioner expects {expected}-d region features, the detector gives {dim}-d: use the detector it was trained with")
                results.append(res)
                progress.advance(task)
    finally:
        if writer is not None:
            writer.close()
    bad = [r for r in results if r.error]
    _print_table(results, int(cfg.n_best))
    if output is not None:
        _write_output(results, output, int(cfg.n_best) > 1)
        log.info("wrote %d results to %s", len(results), output)
    if visualize is not None:
        from pipeline.captioning.pictures import write_pictures

        written = write_pictures(results, visualize, classes, attributes)
        log.info("wrote %d pictures to %s", len(written), visualize)
    if bad:
        log.warning("%d of %d photos could not be captioned (listed above)", len(bad), len(results))
    if len(bad) == len(results):
        raise PipelineError(f"none of the {len(results)} photos could be captioned")
    return results


def _release_features(cfg: Config, release: dict[str, Any] | None) -> Config:
    """A released model expects the Caffe bottom-up features it was trained on: its recipe and box limits
    unless the config names others (models.released); says so in one line."""
    if not release:
        return cfg
    from models.released import features_line

    feats = release.get("features") or {}
    changes: dict[str, Any] = {}
    if "recipe" in cfg and cfg.recipe in (None, "auto"):
        changes["recipe"] = feats.get("recipe", "caffe")
    if "boxes" in cfg and cfg.boxes is None:
        changes["boxes"] = feats.get("boxes", "adaptive")
    log.info("%s", features_line(release))
    return cfg.with_overrides(changes, source="released model") if changes else cfg


def _print_table(results: list[Any], n_best: int) -> None:
    from rich.table import Table

    table = Table(show_edge=False)
    table.add_column("image")
    table.add_column("caption")
    table.add_column("score", justify="right")
    for r in results:
        if r.error:
            table.add_row(str(r.path), f"[red]skipped: {r.error}[/red]", "")
            continue
        table.add_row(str(r.path), r.caption, f"{r.score:.3f}")
        for c, s in r.nbest[1:n_best]:
            table.add_row("", f"[dim]{c}[/dim]", f"[dim]{s:.3f}[/dim]")
    stdout_console().print(table)


def _write_output(results: list[Any], path: Path, with_nbest: bool) -> None:
    rows = [r.to_json(with_nbest) for r in results]
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        atomic_write_text(path, json.dumps(rows, indent=1) + "\n")
    else:
        buf = io.StringIO()
        fields = ["image", "key", "caption", "score", "error"] + (["nbest"] if with_nbest else [])
        w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            if "nbest" in r:
                r = dict(r, nbest=" | ".join(f"{h['caption']} ({h['score']})" for h in r["nbest"]))
            w.writerow(r)
        atomic_write_bytes(path, buf.getvalue().encode("utf-8"))
