"""The feature identity: what made a store's region features, and with which settings (docs/architecture.md#contracts).

Built once by the extractors (:func:`extractors.factory.load_for_inference`, then
:func:`extractors.factory.record_settings` adds the resolved recipe, box selection and precision), written into a
store's ``store.json`` and segment attributes by :meth:`FeatureIdentity.to_dict` (the store's one writer), and
compared by :meth:`FeatureIdentity.settings_diff` (``caption --cache`` accepts a store that agrees on what determines
the features). The serialised form is the JSON record stores have always held::

    {"name", "weights_sha256", "layout", "config": {"spec", "labelmap_sha256", "recipe", "boxes", "precision"}}

Other producers (importers, the synthetic world's oracle, an ``--identity`` file) record other keys beside
``name``; they are kept verbatim (``extra``, ``extra_config``) so that their stores read back byte for byte.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.errors import UsageError

#: the typed entries of ``config`` (serialised order does not matter: stores write JSON with sorted keys)
CONFIG_FIELDS = ("spec", "labelmap_sha256", "recipe", "boxes", "precision")
_TOP_FIELDS = ("name", "weights_sha256", "layout")
_NOT_RECORDED = object()


@dataclass(frozen=True)
class FeatureIdentity:
    """Which detector made the features (``name``, ``weights_sha256``, weights-file ``layout``, architecture and
    test-time input scale ``spec``, VinVL ``labelmap_sha256``) and with which test-time settings (``recipe``: its
    name and every value; ``boxes``: the box selection in short; compute ``precision``)."""

    name: str
    weights_sha256: str | None = None
    layout: str | None = None
    spec: dict[str, Any] | None = None
    labelmap_sha256: str | None = None
    recipe: dict[str, Any] | None = None
    boxes: dict[str, Any] | None = None
    precision: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other producers' top-level entries, kept verbatim
    extra_config: dict[str, Any] = field(default_factory=dict)  # and their other ``config`` entries

    # -- the one serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The store's record (``store.json`` ``identity`` and every segment's ``identity`` attribute)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in _TOP_FIELDS if getattr(self, k) is not None}
        out.update(self.extra)
        config = {k: getattr(self, k) for k in CONFIG_FIELDS if getattr(self, k) is not None}
        config.update(self.extra_config)
        if config:
            out["config"] = config
        return json.loads(json.dumps(out, sort_keys=True))  # plain JSON values, as the store writes them

    @classmethod
    def from_dict(cls, data: Any, source: str = "extractor identity") -> FeatureIdentity:
        """Parse a store's record (any producer's: the typed fields are those a detector records, everything else is
        kept in ``extra``/``extra_config``); one without a name is one
        :class:`UsageError` line naming ``source``. ``from_dict(d).to_dict() == d`` for every JSON record."""
        if isinstance(data, FeatureIdentity):
            return data
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
            raise UsageError(f"{source} must be a mapping with a 'name' string")
        config = data.get("config", {})
        extra = {k: v for k, v in data.items() if k not in _TOP_FIELDS[1:] + ("name", "config") or v is None}
        if not isinstance(config, dict) or not config:
            if "config" in data:
                extra["config"] = config  # an empty (or another producer's non-mapping) config is kept as recorded
            config = {}
        values = {key: data.get(key) for key in _TOP_FIELDS[1:]}
        values.update({key: config.get(key) for key in CONFIG_FIELDS})
        extra_config = {k: v for k, v in config.items() if k not in CONFIG_FIELDS or v is None}
        return cls(name=data["name"], **values, extra=extra, extra_config=extra_config)

    # -- the typed comparison -----------------------------------------------------------------------------
    def feature_settings(self) -> dict[str, Any]:
        """What determines the features a detector gives an image, by the field name messages use: the weights,
        the architecture and test-time resize (``config.spec``), the recipe (``recipe``: a top-level record some
        stores carry), the box selection limits and the compute precision (fp32 when not recorded). The name,
        the weights-file layout and anything else recorded do not."""
        none = _NOT_RECORDED
        return {
            "weights_sha256": self.weights_sha256 if self.weights_sha256 is not None else none,
            "config.spec": self.spec if self.spec is not None else none,
            "config.recipe": self.recipe if self.recipe is not None else none,
            "recipe": self.extra.get("recipe", none),
            "config.boxes": self.boxes if self.boxes is not None else none,
            "config.precision": self.precision if self.precision is not None else "fp32",
        }

    def settings_diff(self, given: FeatureIdentity | dict[str, Any]) -> list[str]:
        """The feature settings on which ``given`` disagrees with this (stored) identity, each as
        ``"field (stored X, given Y)"`` naming the innermost differing field. A setting recorded by only one side
        counts as agreeing (an older record that does not carry it), except the weights digest and the spec."""
        other = FeatureIdentity.from_dict(given).feature_settings()
        out = []
        for path, a in self.feature_settings().items():
            b = other[path]
            if (a is _NOT_RECORDED or b is _NOT_RECORDED) and path not in ("weights_sha256", "config.spec"):
                continue
            d = _first_difference(path, a, b)
            if d:
                out.append(d)
        return out


def _first_difference(path: str, a: Any, b: Any) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = _first_difference(f"{path}.{k}", a.get(k, _NOT_RECORDED), b.get(k, _NOT_RECORDED))
            if d:
                return d
        return None
    if a is b or (a is not _NOT_RECORDED and b is not _NOT_RECORDED and a == b):
        return None
    show = lambda v: "(not recorded)" if v is _NOT_RECORDED else json.dumps(v, sort_keys=True)  # noqa: E731
    return f"{path} (stored {show(a)}, given {show(b)})"
