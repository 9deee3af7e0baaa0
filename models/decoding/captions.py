"""From decoder output to caption text, and the one layering of decoding settings (:func:`layered_decoding`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from models.checkpoints import CaptionerCheckpoint
from models.decoding.options import DecodeOptions
from pipeline.core.config import CONFIG_DIR, load_yaml_with_bases, validate_against
from pipeline.core.console import get_logger
from pipeline.core.errors import ConfigError
from pipeline.core.precision import resolve_precision
from pipeline.core.vocab import EOS

log = get_logger("decoding")


def merge_decoding(saved: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """A checkpoint's decoding settings with ``overrides``.

    An ``n_best`` larger than the checkpoint's own beam widens it, and says so in one log line; an ``n_best``
    larger than a beam size given alongside it is left for :class:`DecodeOptions` to refuse (never silently widened).
    """
    overrides = dict(overrides or {})
    out = {**dict(saved or {}), **overrides}
    if out.get("method", DecodeOptions.method) == "beam" and "n_best" in out and "beam_size" not in overrides:
        beam, n_best = int(out.get("beam_size", DecodeOptions.beam_size)), int(out["n_best"])
        if n_best > beam:
            log.info(
                "n_best %d: the checkpoint's beam of %d is widened to %d (give a beam size to choose another)",
                n_best,
                beam,
                n_best,
            )
            out["beam_size"] = n_best
    return out


def layered_decoding(saved: Mapping[str, Any] | None, command: Mapping[str, Any] | None) -> DecodeOptions:
    """The decoding a command runs, layered in one order (docs/architecture.md#decoding), later wins:

    1. ``configs/decoding.yaml`` (the defaults; also the schema of every layer);
    2. the checkpoint's ``decoding`` (its model card's paper setting and ``train.decoding``, or a release's);
    3. the command's ``decoding:`` section (its config file, then ``--set decoding.KEY=VALUE``);
    4. the command-line flags (``--beam-size``, ``--n-best``, ``--max-len``, ... are ``decoding.*`` overrides
       applied last, the same in ``caption``, ``serve`` and ``evaluate``).

    A beam size or ``n_best`` given in layers 3-4 implies ``method: beam``; an ``n_best`` over the checkpoint's
    own beam widens it (:func:`merge_decoding`). A key or type outside ``configs/decoding.yaml`` is a one-line
    :class:`ConfigError`.
    """
    over = command_decoding(command)
    if ("beam_size" in over or "n_best" in over) and "method" not in over:
        over["method"] = "beam"
    return DecodeOptions.from_mapping(merge_decoding({**_schema(), **dict(saved or {})}, over))


def _schema() -> dict[str, Any]:
    return load_yaml_with_bases(CONFIG_DIR / "decoding.yaml")["decoding"]


def command_decoding(command: Mapping[str, Any] | None) -> dict[str, Any]:
    """A command's ``decoding:`` section checked on its own (keys and types of ``configs/decoding.yaml``; ``null``
    = not set), so a command can refuse a bad value before it loads anything."""
    schema, over = _schema(), {}
    for key, value in dict(command or {}).items():
        if value is None:
            continue
        if key not in schema:
            raise ConfigError(f"decoding: unknown key 'decoding.{key}' (known: {', '.join(sorted(schema))})")
        over[key] = validate_against({key: schema[key]}, {key: value}, "decoding", prefix="decoding.")[key]
    return over


def decoding_for(
    ckpt: CaptionerCheckpoint,
    command: Mapping[str, Any] | None,
    precision: str,
    device: Any,
    key: str,
    *,
    fp16: bool = True,
) -> tuple[DecodeOptions, str]:
    """How a command decodes the captioner checkpoint ``ckpt``: :func:`layered_decoding` over the checkpoint's
    ``decoding`` and the resolved ``precision`` (:func:`pipeline.core.precision.resolve_precision`; a released
    model decodes in fp32 under ``auto``, as published). ``caption``, ``serve`` and ``evaluate --model`` all
    call this, so the same checkpoint under the same settings decodes the same way in each; ``fp16=False``
    where the detector runs under the same precision (``caption``, ``serve``)."""
    resolved = resolve_precision(precision, device, key, fp16=fp16, published=ckpt.release is not None)
    return layered_decoding(ckpt.decoding, command), resolved


def caption_words(vocab: Any, ids: list[int], options: DecodeOptions) -> list[str]:
    """The words of one generated caption (``vocab`` a :class:`~pipeline.core.vocab.Vocab`).

    Up to the first ``<eos>``, ``<pad>``/``<bos>`` skipped; under ``official_m2`` every generated token is a word,
    as M2's ``field.decode`` writes it (its search can emit ``<pad>``/``<bos>``). ``collapse_repeats`` then
    removes consecutive duplicates (M2's ``test.py``).
    """
    if options.stop_rule == "official_m2":
        end = ids.index(EOS) if EOS in ids else len(ids)
        words = [vocab.words[i] for i in ids[:end]]
    else:
        words = vocab.decode(ids)
    if options.collapse_repeats:
        words = [w for i, w in enumerate(words) if i == 0 or w != words[i - 1]]
    return words
