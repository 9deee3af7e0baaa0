"""Reading the files released captioners ship, without running anything from them.

Pickles (M2's ``vocab.pkl``, AoANet's ``infos_*.pkl``) go through the project's restricted unpickler
(:class:`pipeline.core.unpickle.RestrictedUnpickler`): every global the file names must be in an explicit allowlist
of ``(module, name)`` pairs, and each admitted name is bound to a stand-in defined here (a plain container or a
recorder of state), never to the real class or function.
Nothing is imported and no constructor of the original code runs; a file naming any other global is refused
with one line that names the file. Rebuilding is bounded in time and memory: every value built is counted and a
file that would expand past :class:`Budget`'s limit (a few hundred bytes of shared references can stand for
terabytes) is refused, naming the file and the limit. The stand-ins are then rebuilt into plain Python values
(``argparse`` namespaces into dicts, NumPy scalars and arrays decoded from their bytes with a numeric dtype only).

The ``.pth`` weight files are read with ``torch.load(weights_only=True)``; the extra globals admitted there are
only NumPy's array/scalar rebuilders and numeric dtypes (M2's training checkpoint stores NumPy's RNG state and
NumPy scalars next to the weights).
"""

from __future__ import annotations

import contextvars
import io
import pickle
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.core.errors import UsageError
from pipeline.core.tensor_bounds import BoundsError, check_archive
from pipeline.core.unpickle import Refused, RestrictedUnpickler

_LOADING: contextvars.ContextVar[Any] = contextvars.ContextVar("restricted_unpickle_budget", default=None)


class StandIn:
    """Records the state pickle gives an object (``BUILD``); subclasses name what they stand for."""

    stands_for = "object"

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<stand-in for {self.stands_for}>"


class NamespaceStandIn(StandIn):
    stands_for = "argparse.Namespace"


class M2VocabStandIn(StandIn):
    stands_for = "data.vocab.Vocab"


class _ObjectBase:
    """Stands for ``builtins.object`` as the base argument of ``copyreg._reconstructor`` (protocol 0/1)."""


def _reconstructor(cls: Any, base: Any, state: Any) -> StandIn:
    """``copyreg._reconstructor(cls, object, None)`` for stand-in classes only."""
    if not (isinstance(cls, type) and issubclass(cls, StandIn)) or base is not _ObjectBase or state is not None:
        raise pickle.UnpicklingError("copyreg._reconstructor called with unexpected arguments")
    return cls.__new__(cls)


def _m2_unk_index() -> int:
    """Stands for ``data.vocab._default_unk_index`` (the default factory of ``stoi``; never called)."""
    return 0


def _charge(values: int, nbytes: int = 0) -> None:
    """Count what a stand-in copies while the file is read (a shared dict copied again and again is a bomb too)."""
    budget = _LOADING.get()
    if budget is not None:
        budget.take(values, nbytes)


def _counter(mapping: Any = None) -> dict[Any, Any]:
    """``collections.Counter`` pickles as ``Counter(dict)``: a plain dict here."""
    if mapping is not None and not isinstance(mapping, dict):
        raise pickle.UnpicklingError("Counter state is not a dict")
    _charge(1 + len(mapping or {}))
    return dict(mapping or {})


def _defaultdict(factory: Any = None, *rest: Any) -> dict[Any, Any]:
    """``collections.defaultdict(factory)``: a plain dict (items follow via SETITEMS); only M2's factory."""
    if rest or factory not in (None, _m2_unk_index):
        raise pickle.UnpicklingError("defaultdict with an unexpected default factory")
    return {}


class _DType(StandIn):
    stands_for = "numpy.dtype"

    def __init__(self, code: str) -> None:
        self.code = code

    def numpy(self) -> np.dtype:
        """The NumPy dtype, numeric kinds only (booleans, integers, floats, complex)."""
        order = "<"
        if (
            isinstance(getattr(self, "state", None), tuple)
            and len(self.state) > 1
            and self.state[1] in ("<", ">", "|", "=")
        ):
            order = self.state[1]
        dtype = np.dtype(self.code).newbyteorder(order) if order in "<>" else np.dtype(self.code)
        if dtype.kind not in "biufc":
            raise pickle.UnpicklingError(f"non-numeric dtype {self.code!r}")
        return dtype


def _np_dtype(code: Any, align: Any = False, copy: Any = True) -> _DType:
    if not isinstance(code, str) or len(code) > 4:
        raise pickle.UnpicklingError("unexpected dtype code")
    return _DType(code)


def _raw_bytes(data: Any) -> bytes:
    if isinstance(data, str):  # Python 2 pickles read with encoding='latin-1'
        return data.encode("latin-1")
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    raise pickle.UnpicklingError("array data is not bytes")


def _np_scalar(dtype: Any, data: Any = b"") -> Any:
    """``numpy.core.multiarray.scalar(dtype, bytes)`` -> the Python number."""
    if not isinstance(dtype, _DType):
        raise pickle.UnpicklingError("scalar without a dtype")
    _charge(1)
    return np.frombuffer(_raw_bytes(data), dtype=dtype.numpy(), count=1)[0].item()


class _Array(StandIn):
    stands_for = "numpy.ndarray"

    def numpy(self) -> np.ndarray:
        _, shape, dtype, fortran, raw = self.state
        if not isinstance(dtype, _DType) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise pickle.UnpicklingError("malformed array state")
        arr = np.frombuffer(_raw_bytes(raw), dtype=dtype.numpy(), count=int(np.prod(shape, dtype=np.int64)))
        return arr.reshape(shape, order="F" if fortran else "C").copy()


class _ArrayClass:
    """Stands for ``numpy.ndarray`` as the class argument of ``_reconstruct``."""


def _np_reconstruct(cls: Any, shape: Any = (0,), typecode: Any = b"b") -> _Array:
    if cls is not _ArrayClass:
        raise pickle.UnpicklingError("_reconstruct of something other than ndarray")
    return _Array()


def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    """Protocol-2 pickles written by Python 3 spell ``bytes`` as ``_codecs.encode(str, 'latin1')``."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode with unexpected arguments")
    _charge(1, len(text))
    return text.encode("latin-1")


#: the stand-ins every reader may use to rebuild the protocol-0/1 object form and NumPy values
COMMON: dict[tuple[str, str], Any] = {
    ("copyreg", "_reconstructor"): _reconstructor,
    ("builtins", "object"): _ObjectBase,
    ("_codecs", "encode"): _codecs_encode,
}
NUMPY: dict[tuple[str, str], Any] = {
    (mod, name): fn
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray")
    for name, fn in (("scalar", _np_scalar), ("_reconstruct", _np_reconstruct))
} | {("numpy", "dtype"): _np_dtype, ("numpy", "ndarray"): _ArrayClass}


def load_within(data: bytes, allowed: Mapping[tuple[str, str], Any], budget: "Budget") -> Any:
    """Unpickle ``data`` admitting only the stand-ins of ``allowed``, what they copy counted against ``budget``."""
    token = _LOADING.set(budget)
    try:
        return RestrictedUnpickler(io.BytesIO(data), allowed).load()
    finally:
        _LOADING.reset(token)


#: what rebuilding one file may expand to: values (containers, numbers, strings) and bytes (strings, arrays), each a
#: fixed allowance plus a multiple of the file's size. A pickle without shared references expands to about its own
#: size; one built from shared references (a list of a list of ... the same list) would expand exponentially,
#: so a file of a few hundred bytes could take the machine's memory: it is refused as soon as it passes the limit.
BASE_VALUES, VALUES_PER_BYTE = 1_000_000, 4
BASE_BYTES, BYTES_PER_BYTE = 64 << 20, 4


class Budget:
    """Counts the values and bytes :func:`plain` builds; past the limit it raises :class:`TooLarge`."""

    def __init__(self, file_size: int) -> None:
        self.max_values = BASE_VALUES + VALUES_PER_BYTE * file_size
        self.max_bytes = BASE_BYTES + BYTES_PER_BYTE * file_size
        self.values = self.bytes = 0

    def take(self, values: int = 1, nbytes: int = 0) -> None:
        self.values += values
        self.bytes += nbytes
        if self.values > self.max_values or self.bytes > self.max_bytes:
            raise TooLarge(
                f"it expands past {self.max_values:,} values or {self.max_bytes:,} bytes (shared references "
                f"repeated over and over); the limit is {BASE_VALUES:,} values + {VALUES_PER_BYTE} per byte of the file"
            )


class TooLarge(pickle.UnpicklingError):
    """A pickle that would expand past its :class:`Budget`."""


def plain(obj: Any, depth: int = 0, budget: Budget | None = None) -> Any:
    """Rebuild stand-ins into plain values: namespaces -> dicts, NumPy arrays decoded, containers walked.

    Every value built is counted against ``budget`` (a shared reference counts each time it is reached), so a
    reference bomb is refused in time and memory proportional to the limit, never to what it would expand to.
    """
    budget = budget or Budget(0)
    if depth > 50:
        raise pickle.UnpicklingError("nesting too deep")
    if isinstance(obj, _Array):
        arr = obj.numpy()
        budget.take(1, arr.nbytes)
        return arr
    if isinstance(obj, StandIn):
        budget.take()
        state = getattr(obj, "state", {})
        return {
            "__stand_in__": obj.stands_for,
            **(
                {str(k): plain(v, depth + 1, budget) for k, v in state.items()}
                if isinstance(state, dict)
                else {"state": plain(state, depth + 1, budget)}
            ),
        }
    if isinstance(obj, dict):
        budget.take(1 + len(obj))
        return {plain(k, depth + 1, budget): plain(v, depth + 1, budget) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        budget.take(1 + len(obj))
        items = [plain(v, depth + 1, budget) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, (set, frozenset)):
        budget.take(1 + len(obj))
        return obj
    if isinstance(obj, (str, bytes)):
        budget.take(1, len(obj))
        return obj
    if isinstance(obj, (int, float, bool, complex, type(None))):
        budget.take()
        return obj
    raise pickle.UnpicklingError(f"unexpected object of type {type(obj).__name__}")


def restricted_load(path: str | Path, allowed: Mapping[tuple[str, str], Any], what: str) -> Any:
    """Unpickle ``path`` admitting only ``allowed`` globals; return plain values. Errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{what} not found: {path}")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    try:
        budget = Budget(len(data))
        return plain(load_within(data, {**COMMON, **allowed}, budget), budget=budget)
    except TooLarge as exc:
        raise UsageError(f"{path}: refused to load the {what}: {exc} (nothing from the file was run)") from None
    except Refused as exc:
        raise UsageError(
            f"{path}: refused to load: it names the global '{exc.qualified}', which a {what} does not hold "
            "(nothing from the file was run)"
        ) from None
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        UnicodeDecodeError,
        RecursionError,
        OverflowError,
        MemoryError,
    ) as exc:
        raise UsageError(f"{path}: not a readable {what} ({type(exc).__name__}: {str(exc)[:120]})") from None


def need_tensors(weights: Mapping[str, Any], required: Mapping[str, int], source: Any, release: str) -> list[Any]:
    """The ``required`` tensors (name -> number of dimensions) of a release's converted weights; one line naming
    ``source`` and the first one missing or misshapen (instead of a KeyError far inside a conversion)."""
    out = []
    for name, dims in required.items():
        value = weights.get(name)
        if value is None:
            raise UsageError(f"{source}: not a complete {release} release: the weights lack '{name}'")
        if not torch.is_tensor(value) or value.dim() != dims or 0 in value.shape:
            shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise UsageError(
                f"{source}: {release} weight '{name}' has shape {shape}; a {dims}-dimensional tensor is expected"
            )
        out.append(value)
    return out


def _numpy_safe_globals() -> list[Any]:
    from numpy._core import multiarray as ma  # noqa: PLC0415 -- NumPy 2's module path; pyproject admits NumPy 1.24+

    dtypes = sorted({type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFD"}, key=str)
    return [
        ma._reconstruct,
        (ma._reconstruct, "numpy.core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        ma.scalar,
        (ma.scalar, "numpy.core.multiarray.scalar"),
        *dtypes,
    ]


def load_weights_file(path: str | Path, what: str) -> Any:
    """``torch.load(weights_only=True)`` of a released ``.pth`` (NumPy arrays/scalars admitted); errors name it."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{what} not found: {path}")
    try:
        check_archive(path)
    except BoundsError as exc:
        raise UsageError(f"{exc} (nothing read from the {what})") from None
    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()), warnings.catch_warnings():
            # torch warns (two lines on stderr) about a pickle protocol its weights-only reader may not support;
            # the file is then either read or refused below in one line
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for truncated, foreign or unsafe files
        raise UsageError(_weights_refusal(path, what, exc)) from None


#: torch's weights-only reader names a global outside its allowlist as ``GLOBAL module.name``
_TORCH_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
#: the lines of torch's weights-only refusal that are advice, not the reason (one suggests weights_only=False)
_TORCH_ADVICE = ("Weights only load failed", "Please file an issue", "Check the documentation", "Re-running")


def _weights_refusal(path: Path, what: str, exc: Exception) -> str:
    """One line for a ``.pth`` torch would not read: the global it names (refused before anything ran), else the
    reason torch gives, without its advice (which includes loading the file unrestricted)."""
    text = str(exc)
    named = _TORCH_GLOBAL.search(text)
    if isinstance(exc, pickle.UnpicklingError) and named:
        return (
            f"{path}: refused to load: it names the global '{named.group(1)}', which a {what} does not hold "
            "(nothing from the file was run)"
        )
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reasons = [line for line in lines if not line.startswith(_TORCH_ADVICE)]
    detail = reasons[0] if reasons else (lines[0] if lines else "")
    if isinstance(exc, pickle.UnpicklingError) and "WeightsUnpickler error:" in detail:
        detail = detail.split("WeightsUnpickler error:", 1)[1].strip() or detail
    return f"{path}: not a readable {what} ({type(exc).__name__}: {detail[:160]})"
