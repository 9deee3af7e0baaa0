"""Detector releases as records: one :class:`Release` per public release, registered by the module that defines it.

A release is everything the toolkit knows about one family of published detector weights and the code that ran
them: the weights layouts it wrote (and how to recognise and load a layout the bottom-up loader does not know),
the test-time recipe its features were made with (``extract.recipes.<recipe>``), the preset of its architecture,
the maker of seeded random weights of its kind, the line an imported store records as its source, the
``import-features`` formats of the public files it made, and the catalogue names of its files.
:mod:`extractors.bottom_up` registers ``caffe``, ``hf`` and ``airsplay``, the packages :mod:`extractors.vinvl` and
:mod:`extractors.clip` register ``vinvl`` and ``clip-vil``, and :mod:`extractors.grid` registers ``grid-feats``;
every table of the extractors, the importers and the commands reads this registry
(docs/extending.md#a-new-detector-release-one-module--one-release-record).

This module imports no torch; :func:`available_releases` imports the extractor modules (which register their
records, and load torchvision) the first time a record is needed. ``cli info --releases`` prints the registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from extractors import available_extractors
from pipeline.core.errors import UsageError
from pipeline.core.registry import Registry

#: (path, layout, state dict, spec or None) -> (detector, info)
Loader = Callable[[Any, str, Mapping[str, Any], Any], tuple[Any, dict[str, Any]]]
#: (layout, state dict, path) -> (``cli info`` facts, spec)
Describer = Callable[[str, Mapping[str, Any], Any], tuple[dict[str, Any], Any]]


@dataclass(frozen=True)
class OwnExtraction:
    """How ``cli extract`` and ``caption`` run a release whose weights are not a region detector's (CLIP image
    encoders, :mod:`extractors.clip.run`).

    ``claims`` (path) -> the weights layout of a file this release runs, or None: asked, by the file's layout only,
    before the detector loaders read it. ``check`` (config section, where, weights path) -> the box mode: refuses,
    in one :class:`UsageError` line and before any work, recipe, ``boxes`` and other settings these weights cannot
    run. ``load`` (path, device,
    section, where) -> (model, :class:`FeatureIdentity`, info), what :func:`extractors.factory.load_for_inference`
    returns; ``section`` is the command's config section (``where``: ``extract`` or ``caption``; None: no settings
    given), whose release settings shape what is built (CLIP's ``clip_encoder``); the model
    has the detector's ``spec.feature_stride`` and ``detect``, plus ``configure(section, where)`` -> (recipe,
    selector) and ``settings(identity, selector, precision)`` -> the identity with those recorded, which
    :func:`extractors.factory.configure_recipe` and :func:`extractors.factory.record_settings` hand over to.
    ``kind``: the ``pipeline.core.catalogue`` kind of this release's catalogue files; ``verify`` (path): their
    strict reader, run on each download before it takes its name (:func:`pipeline.hub.verify.verifier`).
    ``recipes``: the recipes these weights run (``--recipe`` / ``extract.recipe``), the default first; they are the
    release's own, not entries of ``extract.recipes``. ``layouts``: the weights layouts ``claims`` names; they stay
    apart from :attr:`Release.layouts`, the layouts the detector loaders read (a CLIP ``hf`` file is not the
    bottom-up ``hf`` layout)."""

    claims: Callable[[Any], str | None]
    check: Callable[[Any, str, Any], str]
    load: Callable[[Any, Any, Any, str], tuple[Any, Any, dict[str, Any]]]
    kind: str = ""
    verify: Callable[[Any], None] | None = None
    recipes: tuple[str, ...] = ()
    layouts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Release:
    """One detector release.

    ``name``: the ``--release`` value of ``cli import-features`` and the release an imported store records;
    ``source``: the repository and script the release's features came from (recorded in an imported store's
    identity); ``recipe``: the ``extract.recipes`` entry its weights run with by default (the name when empty);
    ``layouts``: the weights layouts this release wrote, whose default recipe is ``recipe``; ``flavor``: the
    :class:`~extractors.spec.BottomUpSpec` semantics of its detector (a random detector of that flavor follows
    this release); ``preset``: the :data:`extractors.EXTRACTORS` preset of its architecture; ``catalogue``:
    names of its weights files in ``pipeline.core.catalogue``; ``identity``: the feature-identity name of
    features extracted with its weights (``bottom-up-<layout>`` when empty); ``import_formats``: the
    ``import-features --format`` names of the public feature files this release made, whose imported stores
    record this release when no ``--release`` is given (at most one release claims a format,
    :func:`release_of_format`).

    The parts that make a layout loadable: ``detect`` names the layout from a torch state dict's keys (None: not
    this release's); ``normalise`` rewrites the keys once detected; ``load`` and ``describe`` are the strict loader
    and the ``cli info`` facts. Releases without them use the bottom-up layouts of :mod:`extractors.weights`.
    ``detector``: the class built from a spec (random weights, shape tables); ``parts``: the parts that detector
    is assembled from for this release (:class:`extractors.bottom_up.BottomUpParts`: backbone, proposal stage,
    box head, box coder, attribute probabilities; None: the detector class fixes its own); ``random_weights``:
    (spec, seed) -> a detector with seeded random weights; ``random_identity``: the identity name of such a
    detector; ``selectors``: the test-time selections its detector runs (names in
    :data:`extractors.selector.SELECTORS`, where the module of each selection registers it); ``grid_only``: the
    weights hold a backbone only, so only the ``grid`` selection runs; ``own``: how its weights run when they are
    not a region detector's
    (:class:`OwnExtraction`).
    """

    name: str
    source: str
    recipe: str = ""
    layouts: tuple[str, ...] = ()
    flavor: str | None = None
    preset: str | None = None
    catalogue: tuple[str, ...] = ()
    identity: str = ""
    import_formats: tuple[str, ...] = ()
    detect: Callable[[Mapping[str, Any]], str | None] | None = None
    normalise: Callable[[Any], Any] | None = None
    load: Loader | None = None
    describe: Describer | None = None
    detector: Callable[[Any], Any] | None = None
    parts: Any = None
    random_weights: Callable[[Any, int], Any] | None = None
    random_identity: str = ""
    selectors: tuple[str, ...] = ("per-class-nms", "nms-ladder", "given", "grid")
    grid_only: bool = False
    own: OwnExtraction | None = None

    def __post_init__(self) -> None:
        if (self.load is None) != (self.describe is None):
            raise ValueError(f"release {self.name}: a loader needs its describer and the other way round")

    @property
    def recipe_name(self) -> str:
        return self.recipe or self.name

    @property
    def recipes(self) -> tuple[str, ...]:
        """The recipes this release's weights run, the default first: its own extraction's, else
        :attr:`recipe_name`."""
        return self.own.recipes if self.own is not None and self.own.recipes else (self.recipe_name,)

    @property
    def weights_layouts(self) -> tuple[str, ...]:
        """The layouts of this release's weights files: the detector layouts, then those its own extraction
        claims."""
        return self.layouts + (self.own.layouts if self.own is not None else ())

    def identity_name(self, layout: str) -> str:
        """The feature-identity name of features extracted with this release's weights of ``layout``."""
        return self.identity or f"bottom-up-{layout}"


RELEASES: Registry[Release] = Registry("release")


def register_release(release: Release) -> Release:
    """Add ``release`` to :data:`RELEASES` (a name or a layout registered twice is a programming error)."""
    taken = {layout: r.name for r in _records() for layout in r.layouts}
    for layout in release.layouts:
        if layout in taken:
            raise ValueError(f"release {release.name}: layout {layout!r} already belongs to release {taken[layout]}")
    return RELEASES.register(release.name)(release)


def _records() -> list[Release]:
    return [RELEASES.get(name) for name in RELEASES.names()]


def available_releases() -> list[Release]:
    """Every registered release (the extractor modules imported first, so that theirs are there); a release
    naming a selection no module registers (a plugin's misspelling), or claiming an import format another release
    claims, is one :class:`UsageError` line."""
    available_extractors()
    records = _records()
    from extractors.selector import SELECTORS  # noqa: PLC0415 -- loads torch: command help imports this module

    claimed: dict[str, str] = {}
    for release in records:
        missing = [name for name in release.selectors if name not in SELECTORS]
        if missing:
            raise UsageError(
                f"release {release.name}: selection {missing[0]!r} is registered by no module "
                f"(known: {', '.join(SELECTORS)})"
            )
        for fmt in release.import_formats:
            if fmt in claimed:
                raise UsageError(
                    f"releases {claimed[fmt]} and {release.name} both claim the public files of format {fmt!r}: "
                    "one release made them"
                )
            claimed[fmt] = release.name
    return records


def release_names() -> list[str]:
    return [r.name for r in available_releases()]


def get_release(name: str, what: str = "release") -> Release:
    """The release called ``name``; an unknown name is one :class:`UsageError` line listing the known ones."""
    for release in available_releases():
        if release.name == name:
            return release
    raise UsageError(f"unknown {what} {name!r} (known: {', '.join(release_names())})")


def release_of_layout(layout: str) -> Release | None:
    """The release that wrote weights of ``layout`` (None: no release claims it)."""
    for release in available_releases():
        if layout in release.layouts:
            return release
    return None


def release_of_format(fmt: str) -> Release | None:
    """The release whose public feature files ``fmt`` (an ``import-features --format`` name) reads: the one
    release listing it in :attr:`Release.import_formats` (None: no release claims it, the files name none)."""
    for release in available_releases():
        if fmt in release.import_formats:
            return release
    return None


def release_of_flavor(flavor: str) -> Release:
    """The release a detector of ``flavor`` semantics follows (the first registered with that flavor)."""
    for release in available_releases():
        if release.flavor == flavor:
            return release
    raise UsageError(f"no release runs {flavor!r} detectors (known: {', '.join(release_names())})")


def detect_layout(sd: Mapping[str, Any]) -> tuple[Release, str] | None:
    """(release, layout) of a torch state dict whose keys one release's ``detect`` recognises, else None."""
    for release in available_releases():
        if release.detect is not None:
            layout = release.detect(sd)
            if layout is not None:
                return release, layout
    return None


def release_of_weights(path: Any) -> tuple[Release, str] | None:
    """(release, layout) of a weights file a release with its own extraction claims (:class:`OwnExtraction`),
    else None (``random``, a missing file and the detectors' files)."""
    if path is None or str(path) == "random":
        return None
    for release in available_releases():
        layout = release.own.claims(path) if release.own is not None else None
        if layout is not None:
            return release, layout
    return None


def layout_recipes() -> dict[str, str]:
    """Weights layout -> the recipe it runs with by default (``--recipe`` / ``extract.recipe`` override it)."""
    return {layout: r.recipe_name for r in available_releases() for layout in r.layouts}


__all__ = [
    "RELEASES",
    "OwnExtraction",
    "Release",
    "available_releases",
    "detect_layout",
    "get_release",
    "layout_recipes",
    "register_release",
    "release_names",
    "release_of_flavor",
    "release_of_format",
    "release_of_layout",
    "release_of_weights",
]
