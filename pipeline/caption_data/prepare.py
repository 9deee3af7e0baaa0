"""`prepare` stage: read Karpathy or COCO caption files, build the vocabulary and the label arrays.

Follows ruotianluo's ``scripts/prepro_labels.py`` (the setup behind the published COCO numbers):

* tokens: Karpathy's ``tokens`` as given, or raw captions lowercased with punctuation deleted;
* vocabulary: words seen **more than** ``word_count_threshold`` times (default 5, which gives 9,487 words
  on COCO Karpathy, counting every split as prepro_labels does; ``vocab_splits`` narrows this); rarer words
  map to ``<unk>``;
* labels truncated to ``max_length`` (16) words; references for evaluation kept untruncated;
* ``restval`` images join ``train`` unless ``restval_to_train`` is false;

Output files (in the stage folder, each written atomically): see :mod:`pipeline.caption_data.prepared`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.caption_data.prepared import save_prepared
from pipeline.caption_data.text import normalise_tokens, tokenize
from pipeline.core.config import Config
from pipeline.core.console import get_logger
from pipeline.core.errors import ConfigError, PipelineError, UsageError
from pipeline.core.fileio import read_json
from pipeline.core.vocab import SPECIALS, UNK, Vocab

log = get_logger("prepare")

KNOWN_SPLITS = ("train", "val", "test", "restval")
KEY_MODES = ("cocoid", "filename", "filepath")


@dataclass
class ImageEntry:
    """One image with its captions (token lists) and where it belongs."""

    key: str
    cocoid: int | None
    file: str
    split: str
    width: int | None = None
    height: int | None = None
    captions: list[list[str]] = field(default_factory=list)


def _bad(path: Path, what: str) -> UsageError:
    return UsageError(f"{path}: {what}")


def _key(mode: str, cocoid: Any, filepath: str, filename: str, path: Path, where: str) -> str:
    if mode == "cocoid":
        if cocoid is None:
            raise _bad(path, f"{where} has no cocoid/id; use prepare.key=filename")
        return str(cocoid)
    if mode == "filename":
        return filename
    return f"{filepath}/{filename}" if filepath else filename


def _string_tokens(tokens: list[Any], where: str, dropped: list[str]) -> list[str]:
    """The string tokens of a caption; each non-string one (a number, null, a list) is noted in ``dropped``."""
    out = []
    for k, t in enumerate(tokens):
        if isinstance(t, str):
            out.append(t)
        else:
            dropped.append(f"{where}.tokens[{k}] = {json.dumps(t)[:20]}")
    return out


def warn_caption_problems(path: Path, empty: list[str], dropped: list[str]) -> None:
    """One warning each for empty captions and dropped non-string tokens: the count and the first few."""
    if dropped:
        log.warning("%s: dropped %d non-string tokens, e.g. %s", path, len(dropped), "; ".join(dropped[:3]))
    if empty:
        log.warning(
            "%s: %d captions are empty (no word once normalised), e.g. %s; they are kept as ruotianluo's "
            "prepro_labels keeps them (a label of <eos> only): remove them from the file to drop them",
            path,
            len(empty),
            ", ".join(empty[:3]),
        )


def read_karpathy(path: Path, key_mode: str, use_given_tokens: bool) -> list[ImageEntry]:
    """Parse ``dataset_coco.json`` (validated; errors name the file and the image index).

    Non-string tokens are dropped and empty captions kept, each with a warning (count and first few).
    """
    data = read_json(path, what="Karpathy split file")
    images = data.get("images")
    if not isinstance(images, list):
        raise _bad(path, "no 'images' list (expected Karpathy's dataset_coco.json)")
    out = []
    empty: list[str] = []
    dropped: list[str] = []
    for i, img in enumerate(images):
        where = f"images[{i}]"
        if (
            not isinstance(img, dict)
            or not isinstance(img.get("sentences"), list)
            or not isinstance(img.get("split"), str)
        ):
            raise _bad(path, f"{where} lacks 'sentences' or 'split'")
        if img["split"] not in KNOWN_SPLITS:
            raise _bad(path, f"{where} has unknown split {img['split']!r}")
        caps = []
        for j, sent in enumerate(img["sentences"]):
            if not isinstance(sent, dict):
                raise _bad(path, f"{where}.sentences[{j}] is not an object")
            if use_given_tokens and isinstance(sent.get("tokens"), list):
                caps.append(normalise_tokens(_string_tokens(sent["tokens"], f"{where}.sentences[{j}]", dropped)))
            elif isinstance(sent.get("raw"), str):
                caps.append(tokenize(sent["raw"]))
            else:
                raise _bad(path, f"{where}.sentences[{j}] has neither 'tokens' nor 'raw'")
            if not caps[-1]:
                empty.append(f"{where}.sentences[{j}]")
        filename = str(img.get("filename", ""))
        cocoid = img.get("cocoid", img.get("id"))
        out.append(
            ImageEntry(
                _key(key_mode, cocoid, str(img.get("filepath", "")), filename, path, where),
                int(cocoid) if isinstance(cocoid, int) else None,
                f"{img.get('filepath', '')}/{filename}".lstrip("/"),
                img["split"],
                captions=caps,
            )
        )
    warn_caption_problems(path, empty, dropped)
    return out


def _read_split_file(path: Path) -> dict[int, str]:
    """id -> split from a Karpathy json or a ``{"train": [ids], ...}`` mapping."""
    data = read_json(path, what="split file")
    if isinstance(data.get("images"), list):
        split = {}
        for i, img in enumerate(data["images"]):
            if not isinstance(img, dict) or "cocoid" not in img or "split" not in img:
                raise _bad(path, f"images[{i}] lacks 'cocoid' or 'split'")
            split[int(img["cocoid"])] = str(img["split"])
        return split
    split = {}
    for name, ids in data.items():
        if name not in KNOWN_SPLITS or not isinstance(ids, list):
            raise _bad(path, f"key {name!r} is not a split with a list of image ids")
        for x in ids:
            split[int(x)] = name
    return split


def read_coco_captions(files: dict[str, str], split_file: str | None, key_mode: str) -> list[ImageEntry]:
    """Parse COCO caption files given per split; ``split_file`` (if any) reassigns splits by image id."""
    by_id: dict[int, ImageEntry] = {}
    for split, name in files.items():
        if split not in KNOWN_SPLITS:
            raise ConfigError(f"prepare.coco_captions: unknown split {split!r} (use {', '.join(KNOWN_SPLITS)})")
        path = Path(name)
        data = read_json(path, what="COCO captions file")
        if not isinstance(data.get("images"), list) or not isinstance(data.get("annotations"), list):
            raise _bad(path, "needs 'images' and 'annotations' lists (COCO captions format)")
        for i, img in enumerate(data["images"]):
            if (
                not isinstance(img, dict)
                or not isinstance(img.get("id"), int)
                or not isinstance(img.get("file_name"), str)
            ):
                raise _bad(path, f"images[{i}] lacks an integer 'id' or 'file_name'")
            if img["id"] in by_id:
                raise _bad(path, f"image id {img['id']} appears in more than one captions file")
            by_id[img["id"]] = ImageEntry(
                _key(key_mode, img["id"], "", img["file_name"], path, f"images[{i}]"),
                img["id"],
                img["file_name"],
                split,
                img.get("width"),
                img.get("height"),
            )
        empty: list[str] = []
        for i, ann in enumerate(data["annotations"]):
            if not isinstance(ann, dict) or not isinstance(ann.get("caption"), str) or ann.get("image_id") not in by_id:
                raise _bad(path, f"annotations[{i}] lacks a 'caption' or refers to an unknown image_id")
            by_id[ann["image_id"]].captions.append(tokenize(ann["caption"]))
            if not by_id[ann["image_id"]].captions[-1]:
                empty.append(f"annotations[{i}]")
        warn_caption_problems(path, empty, [])
    entries = sorted(by_id.values(), key=lambda e: e.cocoid or 0)
    if split_file:
        split = _read_split_file(Path(split_file))
        entries = [e for e in entries if e.cocoid in split]
        for e in entries:
            e.split = split[e.cocoid]  # type: ignore[index]
        if not entries:
            raise UsageError(f"{split_file}: no image of the captions files is in the split file")
    return entries


def build_vocab(entries: Sequence[ImageEntry], threshold: int, splits: Sequence[str]) -> Vocab:
    """Words counted over ``splits``; kept when count > ``threshold`` (prepro_labels), most frequent first
    (ties alphabetical), after the four specials ``<pad> <bos> <eos> <unk>``."""
    counts: Counter[str] = Counter(w for e in entries if e.split in splits for c in e.captions for w in c)
    kept = sorted((w for w, c in counts.items() if c > threshold and w not in SPECIALS), key=lambda w: (-counts[w], w))
    return Vocab(SPECIALS + tuple(kept))


def prepare_captions(stage_dir: Path, cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    """The stage function for :func:`pipeline.core.stages.run_stage`: read, validate, build, save atomically."""
    if cfg.key not in KEY_MODES:
        raise ConfigError(f"prepare.key must be one of {', '.join(KEY_MODES)}, not {cfg.key!r}")
    if int(cfg.max_length) < 1 or int(cfg.word_count_threshold) < 0:
        raise ConfigError("prepare.max_length must be >= 1 and prepare.word_count_threshold >= 0")
    coco_files = {split: str(f) for split, f in dict(cfg.coco_captions).items() if f}
    if bool(cfg.karpathy_json) == bool(coco_files):
        raise UsageError(
            "give exactly one caption source: the Karpathy split file (`prepare dataset_coco.json`, "
            "prepare.karpathy_json) or --set prepare.coco_captions.SPLIT=FILE"
        )
    try:
        if cfg.karpathy_json:
            entries = read_karpathy(Path(cfg.karpathy_json), cfg.key, bool(cfg.use_given_tokens))
        else:
            entries = read_coco_captions(coco_files, cfg.split_file, cfg.key)
    except PipelineError as exc:  # a corrupt input file is the user's to fix: exit 2
        raise exc if isinstance(exc, UsageError) else UsageError(str(exc)) from None
    if not entries:
        source = cfg.karpathy_json or ", ".join(coco_files.values())
        raise UsageError(f"{source}: holds no image to prepare captions for (an empty 'images' list)")
    if cfg.restval_to_train:
        for e in entries:
            if e.split == "restval":
                e.split = "train"
    empty = [e.key for e in entries if not e.captions]
    if empty:
        raise PipelineError(f"{len(empty)} images have no caption, e.g. {empty[:3]}")
    keys = [e.key for e in entries]
    if len(set(keys)) != len(keys):
        dup = next(k for k, c in Counter(keys).items() if c > 1)
        raise PipelineError(f"image key {dup!r} occurs twice in the caption data (choose another prepare.key)")
    vocab = build_vocab(entries, int(cfg.word_count_threshold), list(cfg.vocab_splits))
    max_len = int(cfg.max_length)
    n_caps = sum(len(e.captions) for e in entries)
    labels = np.zeros((n_caps, max_len), dtype=np.int32)
    lengths = np.zeros(n_caps, dtype=np.int32)
    offsets = np.zeros(len(entries) + 1, dtype=np.int64)
    row = 0
    for i, e in enumerate(entries):
        for cap in e.captions:
            ids = vocab.encode(cap, max_len=max_len, add_eos=False)
            labels[row, : len(ids)] = ids
            lengths[row] = len(ids)
            row += 1
        offsets[i + 1] = row
    unk = sum(1 for e in entries for c in e.captions for w in c if vocab.id(w) == UNK)
    total_words = sum(len(c) for e in entries for c in e.captions)
    outputs = save_prepared(
        stage_dir,
        vocab=vocab,
        entries=entries,
        labels=labels,
        lengths=lengths,
        offsets=offsets,
        max_length=max_len,
    )
    splits = Counter(e.split for e in entries)
    summary = {
        "images": len(entries),
        **{f"{s}_images": splits.get(s, 0) for s in ("train", "val", "test", "restval") if splits.get(s)},
        "captions": n_caps,
        "vocab_words": len(vocab) - 4,
        "unk_rate": round(unk / max(total_words, 1), 5),
        "truncated_captions": int(sum(len(c) > max_len for e in entries for c in e.captions)),
    }
    log.info("prepared %d images, %d captions, %d words (+4 specials)", len(entries), n_caps, len(vocab) - 4)
    return outputs, summary
