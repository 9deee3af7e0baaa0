"""Catalogue names and hub ids -> checked files in the cache (docs/downloads.md).

:func:`pipeline.hub.resolve.resolve_file` is the one place an option's value (a path, a catalogue name of
``pipeline.core.catalogue``, or ``hf:REPO[/FILE][@REVISION]``) becomes a local file; downloads are checked by
the strict reader of their kind (:mod:`pipeline.hub.verify`: the layout readers of ``extractors/`` and
``models/``), which is why this package sits above both libraries.
"""

from pipeline.hub.resolve import resolve_file

__all__ = ["resolve_file"]
