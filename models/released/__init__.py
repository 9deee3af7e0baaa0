"""Released captioner checkpoints of other projects, read once and converted to this project's native format.

Supported releases (one module each, whose docstring states the parameter, special-token and vocabulary-row
mapping and the parity switches it sets):

* ``m2`` (:mod:`models.released.m2`): aimagelab/meshed-memory-transformer ``meshed_memory_transformer.pth`` +
  ``vocab.pkl``;
* ``aoanet`` (:mod:`models.released.aoanet`): husthuaan/AoANet ``model-best.pth`` + ``infos_*.pkl``.

A release is recognised from the content of its weights file (never from its name). :func:`convert_release`
builds the native checkpoint (:class:`models.checkpoints.CaptionerCheckpoint`: model name and constructor config, word
list, weights, the paper's decoding settings and the features the release expects); :func:`ensure_native` writes it
once into a cache keyed by the SHA-256 of both source files, so later runs read the safe native file only.
Pickles are read with the restricted unpickler of :mod:`models.released.unpickle`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from models import build_captioner
from models.checkpoints import CaptionerCheckpoint, ReleaseInfo
from models.released import aoanet, m2
from models.released.unpickle import load_weights_file
from pipeline.core.console import get_logger
from pipeline.core.download import cache_root
from pipeline.core.errors import PipelineError, UsageError, exception_line
from pipeline.core.locks import acquire_lock

log = get_logger("released")

CONVERTER_VERSION = 1
RELEASES = {
    "m2": {
        "title": "M2 Meshed-Memory Transformer (aimagelab/meshed-memory-transformer)",
        "companion": "vocab.pkl",
        "companion_glob": "vocab.pkl",
    },
    "aoanet": {"title": "AoANet (husthuaan/AoANet)", "companion": "infos_*.pkl", "companion_glob": "infos_*.pkl"},
}


def detect(obj: Any) -> str | None:
    """``m2``, ``aoanet`` or None for an object loaded from a weights file."""
    if m2.is_release(obj):
        return "m2"
    if aoanet.is_release(obj):
        return "aoanet"
    return None


def load_release(path: str | Path) -> tuple[str | None, Any]:
    """Load ``path`` safely (weights only) and say which release it is (None: not a known release)."""
    obj = load_weights_file(path, "captioner weights file")
    return detect(obj), obj


def find_companion(weights: Path, kind: str, companion: str | Path | None) -> Path:
    """The vocabulary file of a release: ``companion`` if given, else the only match next to the weights."""
    spec = RELEASES[kind]
    if companion is not None:
        path = Path(companion)
        if not path.is_file():
            raise UsageError(f"{spec['companion']} file not found: {path}")
        return path
    found = sorted(weights.parent.glob(spec["companion_glob"]))
    if len(found) == 1:
        return found[0]
    where = f"next to {weights}" if not found else f"several next to {weights} ({', '.join(p.name for p in found)})"
    raise UsageError(
        f"{weights} is a released {kind} model: pass its {spec['companion']} with --vocab (none found {where})"
    )


def convert_release(
    weights: str | Path, companion: str | Path | None = None, loaded: tuple[str | None, Any] | None = None
) -> CaptionerCheckpoint:
    """The native checkpoint of a released model (``kind: weights``, with its :class:`ReleaseInfo`)."""
    weights = Path(weights)
    kind, obj = loaded if loaded is not None else load_release(weights)
    if kind is None:
        raise UsageError(f"{weights} is neither a butd-caption checkpoint nor a released M2 / AoANet captioner")
    vocab_path = find_companion(weights, kind, companion)
    vocab = m2.read_vocab(vocab_path) if kind == "m2" else aoanet.read_infos(vocab_path)
    try:
        conv = m2.convert(obj, vocab, str(weights)) if kind == "m2" else aoanet.convert(obj, vocab, str(weights))
        _check_fits(conv, weights)
    except (
        KeyError,
        IndexError,
        ValueError,
        TypeError,
        AttributeError,
        RuntimeError,
    ) as exc:  # a malformed release, never a traceback
        raise UsageError(
            f"{weights} (with {vocab_path.name}): not a convertible {RELEASES[kind]['title']} release "
            f"({exception_line(exc)[:200]})"
        ) from None
    return CaptionerCheckpoint(
        model_name=conv["name"],
        model_config=conv["config"],
        vocab=tuple(conv["vocab"]),
        weights=conv["weights"],
        decoding=conv["decoding"],
        train_config={"max_boxes": None},  # M2 keeps its first 50 regions itself (fixed_regions)
        release=ReleaseInfo(
            kind=kind,
            title=RELEASES[kind]["title"],
            weights_file=weights.name,
            vocab_file=vocab_path.name,
            features=conv["features"],
            converter_version=CONVERTER_VERSION,
        ),
    )


def _check_fits(conv: dict[str, Any], source: Path) -> None:
    """Build the project's model and load the converted weights strictly (key names and shapes)."""
    with torch.device("meta"):
        model = build_captioner(conv["name"], len(conv["vocab"]), **conv["config"])
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in conv["weights"].items()}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    bad = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    if missing or extra or bad:
        detail = (
            f"missing {missing[:3]}"
            if missing
            else f"unexpected {extra[:3]}"
            if extra
            else f"{bad[0]} has shape {got[bad[0]]}, expected {want[bad[0]]}"
        )
        raise UsageError(f"{source}: the released weights do not fit a '{conv['name']}' model ({detail})")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cache_dir() -> Path:
    """Where converted releases are kept: ``$BUTD_CACHE/released`` or ``~/.cache/butd-caption/released``."""
    return cache_root() / "released"


def write_native(ckpt: CaptionerCheckpoint, out: str | Path) -> Path:
    """Write a converted release as a native checkpoint (atomic; :meth:`CaptionerCheckpoint.save`)."""
    return ckpt.save(out)


def _cache_target(kind: str, weights: Path, weights_sha: str, vocab_path: Path) -> Path:
    key = hashlib.sha256(f"{weights_sha}:{_sha256(vocab_path)}:{CONVERTER_VERSION}".encode()).hexdigest()[:20]
    return cache_dir() / f"{kind}-{weights.stem}-{key}.pt"


def cached_native(weights: str | Path, companion: str | Path | None = None) -> Path | None:
    """The converted copy of a release already in the cache (found by content hashes alone: the release file is
    not unpickled again), or None."""
    weights = Path(weights)
    if companion is not None:
        candidates = [Path(companion)] if Path(companion).is_file() else []
    else:
        candidates = sorted({p for spec in RELEASES.values() for p in weights.parent.glob(spec["companion_glob"])})
    if not candidates or not cache_dir().is_dir():
        return None
    weights_sha = _sha256(weights)
    for kind in RELEASES:
        for vocab_path in candidates:
            target = _cache_target(kind, weights, weights_sha, vocab_path)
            if target.is_file():
                log.info("released %s model %s: using the converted copy %s", kind, weights.name, target)
                return target
    return None


def ensure_native(
    weights: str | Path, companion: str | Path | None = None, loaded: tuple[str | None, Any] | None = None
) -> Path:
    """The cached native checkpoint of a released model, converting it on first use."""
    weights = Path(weights)
    found = cached_native(weights, companion)
    if found is not None:
        return found
    kind, obj = loaded if loaded is not None else load_release(weights)
    if kind is None:
        raise UsageError(f"{weights} is neither a butd-caption checkpoint nor a released M2 / AoANet captioner")
    vocab_path = find_companion(weights, kind, companion)
    target = _cache_target(kind, weights, _sha256(weights), vocab_path)
    try:
        lock = acquire_lock(
            target.with_name(target.name + ".lock"),
            f"the converted-checkpoint cache entry {target}",
            "it is converting the same release: rerun when it finishes",
        )
    except OSError as exc:
        raise UsageError(
            f"cannot write the converted model to {target} ({exc.strerror}): set BUTD_CACHE to a writable folder, "
            "or convert once with `cli convert-captioner`"
        ) from None
    with lock:
        if target.is_file():  # another process converted it while this one hashed and unpickled
            return target
        converted = convert_release(weights, vocab_path, (kind, obj))
        try:
            write_native(converted, target)
        except OSError as exc:
            raise UsageError(
                f"cannot write the converted model to {target} ({exc.strerror}): set BUTD_CACHE to a writable folder, "
                "or convert once with `cli convert-captioner`"
            ) from None
    log.info("released %s model %s converted once to %s", kind, weights.name, target)
    return target


def features_line(release: ReleaseInfo) -> str:
    """One line saying which features a released model expects (``caption`` logs it)."""
    feats = release.features
    boxes = feats.get("boxes", "adaptive")
    limits = " 10-100" if boxes == "adaptive" else ""
    cap = f", the first {feats['max_boxes']} regions given to the model" if feats.get("max_boxes") else ""
    return (
        f"{release.title} expects the Caffe bottom-up features it was trained on: "
        f"{feats.get('recipe', 'caffe')} recipe, {boxes}{limits} boxes{cap} "
        "(other settings: --set caption.recipe=... / caption.boxes=...)"
    )


def describe_captioner(path: str | Path) -> dict[str, Any] | None:
    """What a captioner file holds (a native checkpoint or a release), or None if it is neither (``cli info``)."""
    path = Path(path)
    if path.suffix == ".pkl":
        return _describe_vocabulary(path)
    try:
        ckpt = CaptionerCheckpoint.load(path)
    except PipelineError:
        ckpt = None
    if ckpt is not None:
        out = {
            "file": str(path),
            "format": f"butd-caption checkpoint ({ckpt.kind})",
            "model": ckpt.model_name,
            "vocabulary": f"{len(ckpt.vocab):,} words",
            "decoding": ckpt.decoding or "the model's defaults",
        }
        release = ckpt.release
        if release:
            out["converted from"] = f"{release.title}: {release.weights_file} + {release.vocab_file}"
            out["features"] = features_line(release)
        return out
    try:
        kind, obj = load_release(path)
    except UsageError:
        return None
    if kind is None:
        return None
    module = m2 if kind == "m2" else aoanet
    state = obj["state_dict"] if kind == "m2" else aoanet.unwrap(obj)
    params = sum(int(v.numel()) for k, v in state.items() if hasattr(v, "numel") and "running_" not in k)
    emb_key = "decoder.word_emb.weight" if kind == "m2" else "embed.0.weight"
    emb = state.get(emb_key) if isinstance(state, dict) else None
    if not hasattr(emb, "shape") or len(emb.shape) != 2:
        raise UsageError(
            f"{path}: not a complete {RELEASES[kind]['title']} release: the weights lack a 2-d '{emb_key}'"
        )
    rows = emb.shape[0]
    return {
        "file": str(path),
        "format": f"released captioner: {RELEASES[kind]['title']}",
        "layout": kind,
        "parameters": f"{params:,}",
        "vocabulary rows": f"{rows:,}",
        "needs": f"its {RELEASES[kind]['companion']} (--vocab)",
        "decoding": module.DECODING,
        "features": module.FEATURES["note"],
        "use": f"cli caption PHOTOS --model {path.name} --vocab {RELEASES[kind]['companion']} --weights DETECTOR.pth",
    }


def _describe_vocabulary(path: Path) -> dict[str, Any] | None:
    """M2's ``vocab.pkl`` or AoANet's ``infos_*.pkl`` (restricted unpickler), else None. A file one of them
    recognises but refuses (a forbidden global, a reference bomb, odd vocabulary keys) is that one-line error."""
    errors: list[UsageError] = []
    try:
        itos = m2.read_vocab(path)
        return {
            "file": str(path),
            "format": "M2 vocab.pkl (data.vocab.Vocab, read with a restricted unpickler)",
            "vocabulary": f"{len(itos):,} words: {' '.join(itos[:8])} ...",
            "use": "--vocab with meshed_memory_transformer.pth",
        }
    except UsageError as exc:
        errors.append(exc)
    try:
        infos = aoanet.read_infos(path)
    except UsageError as exc:
        specific = [e for e in (exc, *errors) if f"{path}: not " not in str(e) and "names the global" not in str(e)]
        if specific:
            raise specific[0] from None
        return None
    opt = infos["opt"]
    words = aoanet.project_words(infos["vocab"])
    return {
        "file": str(path),
        "format": "AoANet infos pickle (argparse options + vocab, read with a restricted unpickler)",
        "vocabulary": f"{len(infos['vocab']):,} words (+ index 0 = BOS/EOS/PAD): {' '.join(words[4:10])} ...",
        "options": ", ".join(
            f"{k}={opt.get(k)}" for k in ("caption_model", "rnn_size", "num_heads", "refine", "use_ff", "att_feat_size")
        ),
        "use": "--vocab with model-best.pth",
    }
