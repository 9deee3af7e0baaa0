"""The one restricted unpickler (pipeline/core/unpickle.py) and its two callers' allowlists."""

from __future__ import annotations

import io
import os
import pickle
from collections import OrderedDict

import numpy as np
import pytest

import extractors.weights as W
from models.released import unpickle as released_unpickle
from pipeline.core.unpickle import IMPORT, Refused, RestrictedUnpickler


class _Marker:
    """A stand-in an allowlist maps a global to."""


def _load(data: bytes, allowed: dict) -> object:
    return RestrictedUnpickler(io.BytesIO(data), allowed).load()


def test_only_allowlisted_globals_resolve() -> None:
    data = pickle.dumps(OrderedDict(a=1), protocol=2)
    assert _load(data, {("collections", "OrderedDict"): IMPORT}) == OrderedDict(a=1)
    with pytest.raises(Refused) as err:
        _load(data, {})
    assert (
        err.value.qualified == "collections.OrderedDict" and str(err.value) == "refused global collections.OrderedDict"
    )
    with pytest.raises(Refused, match="refused global posix.system|refused global nt.system"):
        _load(pickle.dumps(os.system), {("collections", "OrderedDict"): IMPORT})


def test_a_stand_in_replaces_the_real_global_and_python2_names_are_mapped() -> None:
    assert _load(pickle.dumps(OrderedDict, protocol=2), {("collections", "OrderedDict"): _Marker}) is _Marker
    py2 = b"c__builtin__\nset\n."  # protocol 0, the Python 2 module name
    assert _load(py2, {("builtins", "set"): _Marker}) is _Marker
    with pytest.raises(Refused, match="__builtin__.set"):
        _load(py2, {("builtins", "list"): _Marker})


def test_persistent_ids_are_refused() -> None:
    with pytest.raises(pickle.UnpicklingError, match="refused persistent id"):
        _load(b"(S'x'\nP0\n.", {})


def test_both_callers_use_the_one_class(tmp_path) -> None:
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    with open(tmp_path / "a.pkl", "wb") as fh:
        pickle.dump({"model": arrays}, fh, protocol=2)
    with open(tmp_path / "a.pkl", "rb") as fh:
        unpickler = W.RestrictedUnpickler(fh, encoding="latin1")
        assert isinstance(unpickler, RestrictedUnpickler)
        np.testing.assert_array_equal(unpickler.load()["model"]["w"], arrays["w"])
    assert released_unpickle.RestrictedUnpickler is RestrictedUnpickler
    assert set(W.WEIGHT_GLOBALS) >= {("numpy", "ndarray"), ("collections", "OrderedDict")}
    assert ("builtins", "object") not in W.WEIGHT_GLOBALS and ("builtins", "object") in released_unpickle.COMMON
