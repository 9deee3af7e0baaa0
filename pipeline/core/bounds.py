"""Range checks of numeric settings, applied to every resolved stage config (:func:`pipeline.core.config.load_config`).

Options such as ``--batch-size`` and ``--workers`` become config overrides, so checking the resolved config
once serves every command alike: ``--workers -1``, ``--set extract.batch_size=0`` and a YAML file with
``conf_thresh: 1.5`` are each one ``error:`` line naming the key, exit 2.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.core.errors import ConfigError

# Lower bounds of integer settings wherever they appear in a stage config (key name -> smallest value).
# They are checked once the config is resolved, so an option (`--workers -1`), a `--set` override and a
# user YAML are refused alike: one line naming the key, exit 2.
INT_MIN = {
    "batch_size": 1,
    "num_workers": 0,
    "commit_every": 0,
    "max_pixels": 1,
    "min_size": 1,
    "max_size": 1,
    "beam_size": 1,
    "n_best": 1,
    "epochs": 0,
    "default_epochs": 0,
    "roi_chunk": 0,
    "min_boxes": 1,
    "max_boxes": 1,
    "rpn_batch_size": 1,
    "roi_batch_size": 1,
    "every_epochs": 1,
    "num_images": 1,
    "max_len": 1,
    "max_length": 1,
    "grad_accum": 1,
    "accumulate": 1,
    "log_every": 1,
}
# Settings that are probabilities or IoU thresholds: a number in [0, 1].
UNIT_INTERVAL = frozenset({"conf_thresh", "nms_thresh"})


def check_bounds(data: Mapping[str, Any], prefix: str = "") -> None:
    """Refuse out-of-range numeric settings (see :data:`INT_MIN`, :data:`UNIT_INTERVAL`) with a ConfigError."""
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            check_bounds(value, f"{name}.")
        elif value is None or isinstance(value, bool):
            continue
        elif key in INT_MIN:
            if not isinstance(value, int) or value < INT_MIN[key]:
                raise ConfigError(
                    f"{name} must be an integer >= {INT_MIN[key]}, not {value!r} (set by an option, --set or a config "
                    "file)"
                )
        elif key in UNIT_INTERVAL:
            if not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
                raise ConfigError(f"{name} must be a number between 0 and 1, not {value!r}")
