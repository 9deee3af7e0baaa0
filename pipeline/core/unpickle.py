"""The one restricted unpickler for pickles from outside the project (detector weights, released captioners' files).

Python's ``pickle`` runs whatever a file names: ``find_class`` imports any module and returns any global, and
``REDUCE`` calls it. :class:`RestrictedUnpickler` resolves a global only through the caller's allowlist, a mapping
``(module, name) -> object``: the object is a stand-in the caller defines (a plain container, a checked rebuilder),
or :data:`IMPORT` where the real global is harmless (NumPy's scalar rebuilder, ``collections.OrderedDict``). Any
other global is refused with :class:`Refused` (naming it) before anything is imported, and so is every persistent
id (pickle's hook for objects stored outside the stream). Python 2 module names (``__builtin__``, ``copy_reg``)
are looked up under their Python 3 names. Each caller keeps its own allowlist and turns a refusal into its own
one-line error naming the file (:mod:`extractors.weights`, :mod:`models.released.unpickle`).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import IO, Any

#: allowlist value: resolve the global the ordinary way (only for globals that cannot run anything of the file's)
IMPORT = object()

#: Python 2 module names pickles may use, and the Python 3 name an allowlist is keyed by
PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}


class Refused(pickle.UnpicklingError):
    """A pickle named a global outside the allowlist (``qualified``: ``module.name`` as the file wrote it)."""

    def __init__(self, module: str, name: str) -> None:
        self.qualified = f"{module}.{name}"
        super().__init__(f"refused global {self.qualified}")


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` returns only what ``allowed`` maps ``(module, name)`` to.

    ``encoding`` decodes Python 2 ``str`` objects (``latin-1`` keeps their bytes, as NumPy arrays need)."""

    def __init__(self, file: IO[bytes], allowed: Mapping[tuple[str, str], Any], *, encoding: str = "latin-1") -> None:
        super().__init__(file, encoding=encoding)
        self.allowed = dict(allowed)

    def find_class(self, module: str, name: str) -> Any:
        key = (PY2_MODULES.get(module, module), name)
        if key not in self.allowed:
            raise Refused(module, name)
        value = self.allowed[key]
        return super().find_class(module, name) if value is IMPORT else value

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused persistent id")
