"""butd-caption pipeline: stages, their orchestration, and the shared plumbing (configs, manifests, logging).

Public entry points live in the submodules; nothing here holds global mutable state.
"""

__version__ = "0.1.0"
