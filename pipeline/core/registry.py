"""A tiny name -> factory registry: ``Registry(kind)`` with ``register(name)`` (a decorator), ``get``, ``names``.

Registries of captioners (``models.CAPTIONERS``, filled by the decorator ``models.register_captioner("name")``,
which also sets the class's ``name``), detector presets (``extractors.EXTRACTORS``, ``@EXTRACTORS.register("name")``
on a spec factory), detector releases (``extractors.releases.RELEASES``) and learning-rate schedules
(``pipeline.training.schedules.SCHEDULES``) use it; :func:`import_modules_of` imports the modules of a package
that register into one before its names are listed. Adding a captioner is one module in ``models/`` decorated with
``@register_captioner("name")`` plus ``configs/models/name.yaml`` (docs/extending.md).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from pipeline.core.errors import UsageError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects (usually classes or factory functions)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering ``obj`` under ``name``; a duplicate name is a programming error."""

        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        """The object registered as ``name``; unknown names raise :class:`UsageError` listing the known ones."""
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "(none)"
            raise UsageError(f"unknown {self.kind} '{name}' (known: {known})") from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        """True if ``name`` is registered."""
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))


@functools.cache
def import_modules_of(package: str, skip: tuple[str, ...] = ()) -> None:
    """Import every module and subpackage of ``package`` (but ``skip``) once, so that each registers what it
    defines; the registries' ``available_*`` functions call it before they answer."""
    root = importlib.import_module(package)
    for info in pkgutil.iter_modules(root.__path__):
        if info.name not in skip:
            importlib.import_module(f"{package}.{info.name}")
