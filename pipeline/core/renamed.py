"""The config keys and command-line options that were renamed or moved, each refused with one line naming its new
home.

:func:`renamed_key_line` is called by :func:`pipeline.core.config.validate_against` for a key its schema does not
hold; an old key never silently maps to the new one (docs/architecture.md#configs). :func:`renamed_option_line` is
called by every command before its options are parsed (:class:`pipeline.commands.grammar.GrammarCommand`), so an
old spelling fails in one line instead of meaning something else (docs/cli.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# keys that were renamed: old name -> (new name, what it takes); an old key is refused with one line naming the new one
RENAMED_KEYS = {
    "amp": ("precision", "auto | fp32 | tf32 | bf16 | fp16, pipeline/core/precision.py"),
    "workers": ("num_workers", "DataLoader processes, as in every section"),
}
# keys that moved to another section: old dotted path -> (new dotted path, why); refused in one line like RENAMED_KEYS
MOVED_KEYS = {
    "caption.beam_size": ("decoding.beam_size", "one home for decoding settings, as in evaluate and serve"),
    "caption.n_best": ("decoding.n_best", "one home for decoding settings, as in evaluate and serve"),
    "train.num_threads": (
        "--threads",
        "the one thread setting of every command, also BUTD_THREADS: pipeline/core/threads.py",
    ),
    "train.threads": (
        "--threads",
        "the one thread setting of every command, also BUTD_THREADS: pipeline/core/threads.py",
    ),
    "demo.detector_overrides": ("detector_train", "the demo's detector training: --set detector_train.KEY=VALUE"),
}
# top-level sections that were renamed: old -> (new, why); 'train.max_iter' in train_detector.yaml ->
# 'detector_train.max_iter'
RENAMED_SECTIONS = {
    "train": ("detector_train", "detector training has its own section, apart from captioner training's train:"),
    "encoder": ("sentence_encoder", "one name for the sentence encoder's keys, apart from a captioner's encoder"),
}


# command-line spellings that were renamed, per command: old spelling -> the spelling to use
RENAMED_OPTIONS: dict[str, dict[str, str]] = {
    "caption": {"-o": "--output (-o is --out, a run directory)"},
    "evaluate": {"-o": "--output (-o is --out, a run directory)"},
    "embed": {"-o": "--output (-o is --out, a run directory)"},
    "serve": {"-p": "--port/-P (-p is --predictions)"},
    "convert-captioner": {
        "--out": "--output (the checkpoint file to write)",
        "-o": "--output (the checkpoint file to write)",
    },
    "export-features": {"--out": "--output (the feature file to write)"},
    "merge-features": {"--out": "--store (the destination feature store)"},
}


def renamed_option_line(command: str, args: list[str]) -> str | None:
    """``'-o' was renamed: use '--output' (...)`` for the first old spelling of ``command`` among ``args`` (up to a
    ``--``), ``None`` when there is none. ``--out=X`` and ``-oX`` count as the old spelling too."""
    renamed = RENAMED_OPTIONS.get(command, {})
    for arg in args:
        if arg == "--":
            break
        for old, new in renamed.items():
            if old.startswith("--"):
                attached = arg.startswith(old + "=")
            else:
                attached = arg.startswith(old) and not arg.startswith("--")
            if arg == old or attached:
                return f"{command} {old} was renamed: use {new}"
    return None


def renamed_key_line(key: str, value: Any, schema: Mapping[str, Any], prefix: str = "") -> str | None:
    """``'old' was renamed: use 'new' (why)`` when ``key`` (at ``prefix``, holding ``value``) is a former name
    whose new home this ``schema`` holds (or a command-line option); ``None`` for a plain unknown key."""
    dotted = f"{prefix}{key}"
    if not prefix and key in RENAMED_SECTIONS and RENAMED_SECTIONS[key][0] in schema:
        section, why = RENAMED_SECTIONS[key]
        inner = next(iter(value), None) if isinstance(value, Mapping) else None
        old = f"{key}.{inner}" if inner is not None else key
        if inner in RENAMED_KEYS:  # renamed twice ('encoder.amp'): name today's key, 'sentence_encoder.precision'
            inner = RENAMED_KEYS[inner][0]
        new, why = MOVED_KEYS.get(old) or (f"{section}.{inner}" if inner is not None else section, why)
        return f"'{old}' was renamed: use '{new}' ({why})"
    if dotted in MOVED_KEYS:
        new, why = MOVED_KEYS[dotted]
        return f"'{dotted}' was renamed: use '{new}' ({why})"
    if key in RENAMED_KEYS and RENAMED_KEYS[key][0] in schema:
        new, values = RENAMED_KEYS[key]
        return f"'{dotted}' was renamed: use '{prefix}{new}' ({values})"
    return None


#: keys added with a default that gives the numbers of before (a stage config recorded without them is the same config)
ADDED_DEFAULTS = {
    "extract": {"bucket_window": "auto", "channels_last": False, "clip_encoder": {"activation": None, "heads": None}},
    "caption": {"clip_encoder": {"activation": None, "heads": None}},
}


def upgrade_recorded_config(recorded: Mapping[str, Any]) -> dict[str, Any]:
    """A stage config recorded before the renames above, as the current schema reads it
    (:func:`pipeline.core.stages.run_stage` compares its digest, so a stage finished or interrupted then is not refused
    for a new spelling alone): the detector's ``train:`` -> ``detector_train:`` and the thread settings
    ``train.num_threads`` / ``train.threads`` dropped (``--threads`` sets them; they never changed what a stage
    produces), and an ``extract`` section (or a bare one, as the demo records it) without the keys of
    :data:`ADDED_DEFAULTS` given them; a ``caption`` section with the default ``beam_size``/``n_best`` (``decoding:``
    keys in the current schema) as an empty ``decoding:``."""
    out = dict(recorded)
    if "train" in out and "detector_train" not in out and "sampling" in out:  # a detector training config
        out["detector_train"] = out.pop("train")
    for name in ("train", "detector_train"):
        if isinstance(out.get(name), Mapping):
            out[name] = {k: v for k, v in out[name].items() if k not in ("num_threads", "threads")}
    if "num_threads" in out and "model" in out and "stages" in out:  # a bare captioner train section
        out.pop("num_threads")
    caption = out.get("caption")
    if (
        isinstance(caption, Mapping)
        and "decoding" not in out
        and caption.get("beam_size", None) is None
        and caption.get("n_best", 1) == 1
        and {"beam_size", "n_best"} & set(caption)
    ):
        # their defaults (the checkpoint's beam, one caption) are what an empty decoding: section gives
        out["caption"] = {k: v for k, v in caption.items() if k not in ("beam_size", "n_best")}
        out["decoding"] = {}
    for name, added in ADDED_DEFAULTS.items():
        if isinstance(out.get(name), Mapping):
            out[name] = {**added, **out[name]}
    if "feature_dtype" in out and "roi_chunk" in out:  # a bare extract section
        out = {**ADDED_DEFAULTS["extract"], **out}
    return out
