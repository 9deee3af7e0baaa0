"""YAML configs with ``_base_`` inheritance, dotted ``--set`` overrides and schema validation.

Conventions (docs/architecture.md):

* Every stage has a default config ``configs/<stage>.yaml``; it is also the *schema*: a user config or an
  override may only set keys that exist there, with a value of the same type. ``int`` is accepted where a
  ``float`` is expected; a default of ``null`` accepts any value; a mapping written as ``{}`` in the
  defaults is *open* (any keys inside).
* A file may name ``_base_: other.yaml`` (or a list of them), resolved relative to the file itself. Bases
  are merged first, in order, then the file's own keys on top (mappings merge recursively, everything
  else replaces).
* A :class:`Config` is immutable. Derive a changed copy with :meth:`Config.with_overrides`; there is no
  global config object anywhere in the project.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from pipeline.core.bounds import check_bounds
from pipeline.core.errors import ConfigError, UsageError
from pipeline.core.renamed import renamed_key_line

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
BASE_KEY = "_base_"


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` / ``3E5`` as floats (plain YAML 1.1 reads them as strings)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def yaml_load(text_or_stream):  # type: ignore[no-untyped-def]
    """``yaml.safe_load`` with scientific-notation floats."""
    return yaml.load(text_or_stream, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


#: the most values a config may hold once its YAML aliases are expanded: a few hundred are real; an alias tree
#: such as "billion laughs" (ten aliases of ten aliases ...) loads as a small graph but expands to 10^9 values
MAX_CONFIG_VALUES = 1_000_000
#: the deepest nesting of lists / mappings a config may hold (the stage configs nest four levels)
MAX_CONFIG_DEPTH = 64


def check_structure(value: Any, source: str) -> None:
    """Refuse, naming ``source``, a YAML alias that refers to the node holding it (``a: &x [*x]`` loads as a list
    that contains itself, which no config value can be) and an alias tree that expands beyond
    :data:`MAX_CONFIG_VALUES` values (later steps, the config digest among them, expand it) or nests deeper than
    :data:`MAX_CONFIG_DEPTH`. One iterative pass over the loaded graph: every list or mapping is entered once,
    whatever its depth or number of aliases."""
    expanded: dict[int, int] = {}  # id of a finished list / mapping -> its value count with aliases expanded
    entered: set[int] = set()  # the lists / mappings on the path from the root to the current node
    stack: list[tuple[Any, bool, int]] = [(value, False, 0)]
    while stack:
        node, leaving, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        key = id(node)
        children = list(node.values()) if isinstance(node, dict) else node
        if leaving:
            entered.discard(key)
            expanded[key] = 1 + sum(expanded.get(id(child), 1) for child in children)
            if expanded[key] > MAX_CONFIG_VALUES:
                raise ConfigError(
                    f"{source} expands to more than {MAX_CONFIG_VALUES:,} values through its YAML aliases"
                )
        elif key in entered:
            raise ConfigError(f"{source} holds a YAML alias that refers to itself (a recursive anchor)")
        elif depth >= MAX_CONFIG_DEPTH:
            raise ConfigError(f"{source} nests lists or mappings more than {MAX_CONFIG_DEPTH} levels deep")
        elif key not in expanded:
            entered.add(key)
            stack.append((node, True, depth))
            stack.extend((child, False, depth + 1) for child in children)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with path.open("r", encoding="utf-8") as fh:
            data = yaml_load(fh)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text") from exc
    except RecursionError:  # PyYAML composes nested nodes recursively
        raise ConfigError(f"config file {path} nests lists or mappings too deeply to read") from None
    check_structure(data, f"config file {path}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level, not {type(data).__name__}")
    return data


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``base`` updated recursively by ``top`` (mappings merge, other values replace)."""
    out = copy.deepcopy(dict(base))
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_yaml_with_bases(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Load ``path`` and resolve its ``_base_`` chain (relative paths are relative to the file)."""
    path = Path(path).resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ConfigError(f"config _base_ cycle: {chain}")
    data = _read_yaml(path)
    bases = data.pop(BASE_KEY, None)
    if bases is None:
        return data
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: _base_ must be a file name or a list of file names")
    merged: dict[str, Any] = {}
    for base in bases:
        base_path = (path.parent / base) if not Path(base).is_absolute() else Path(base)
        merged = deep_merge(merged, load_yaml_with_bases(base_path, (*_seen, path)))
    return deep_merge(merged, data)


def open_paths_in_chain(path: str | Path, _seen: tuple[Path, ...] = ()) -> frozenset[str]:
    """Open mappings (``{}``) declared by ``path`` or any file in its ``_base_`` chain.

    A mapping that a base declares open stays open even when a later file fills it with defaults.
    """
    path = Path(path).resolve()
    if path in _seen:
        return frozenset()
    data = _read_yaml(path)
    bases = data.pop(BASE_KEY, None) or []
    if isinstance(bases, str):
        bases = [bases]
    out = set(open_paths_of(data))
    for base in bases if isinstance(bases, list) else []:
        base_path = (path.parent / base) if not Path(base).is_absolute() else Path(base)
        out |= open_paths_in_chain(base_path, (*_seen, path))
    return frozenset(out)


_TYPE_NAMES = ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"), (list, "list"), (Mapping, "mapping"))
"""The YAML name of a Python type, first match wins (``bool`` before ``int``: a bool is an int)."""


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return next((name for kind, name in _TYPE_NAMES if isinstance(value, kind)), type(value).__name__)


def _compatible(default: Any, value: Any) -> bool:
    if default is None or value is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, float) and isinstance(value, (int, float)):
        return True
    if isinstance(default, int):
        return isinstance(value, int)
    if isinstance(default, str):
        return isinstance(value, str)
    if isinstance(default, list):
        return isinstance(value, list)
    if isinstance(default, Mapping):
        return isinstance(value, Mapping)
    return type(default) is type(value)


def open_paths_of(schema: Mapping[str, Any], prefix: str = "") -> frozenset[str]:
    """Dotted paths of the open mappings (``{}`` defaults) in a schema."""
    out: set[str] = set()
    for key, value in schema.items():
        if isinstance(value, Mapping):
            if len(value) == 0:
                out.add(f"{prefix}{key}")
            else:
                out |= open_paths_of(value, f"{prefix}{key}.")
    return frozenset(out)


def _check_finite(value: Any, dotted: str, source: str) -> None:
    """No config value is NaN or infinite (``--set x=nan`` parses as a float): refused naming the key."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{source}: '{dotted}' must be a finite number, got {value!r}")
    if isinstance(value, Mapping):
        for k, v in value.items():
            _check_finite(v, f"{dotted}.{k}", source)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_finite(v, f"{dotted}[{i}]", source)


def validate_against(
    schema: Mapping[str, Any],
    data: Mapping[str, Any],
    source: str,
    prefix: str = "",
    open_paths: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Check ``data`` against ``schema`` (the stage defaults) and return the merged result.

    Keys under an open mapping (a ``{}`` default, or a path in ``open_paths``) are free; everything else
    must exist in ``schema`` with a compatible type. Raises :class:`ConfigError` naming the first unknown
    key or the first type mismatch.
    """
    out = copy.deepcopy(dict(schema))
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        _check_finite(value, dotted, source)
        renamed = renamed_key_line(key, value, schema, prefix) if key not in schema else None
        if renamed is not None:
            raise ConfigError(f"{source}: {renamed}")
        if key not in schema:
            known = ", ".join(sorted(str(k) for k in schema)) or "(none)"
            raise ConfigError(f"{source}: unknown config key '{dotted}' (known here: {known})")
        default = schema[key]
        if (isinstance(default, Mapping) and len(default) == 0) or dotted in open_paths:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{source}: '{dotted}' must be a mapping, got {_type_name(value)}")
            out[key] = deep_merge(default if isinstance(default, Mapping) else {}, value)
            continue
        if isinstance(default, Mapping) and isinstance(value, Mapping):
            out[key] = validate_against(default, value, source, prefix=f"{dotted}.", open_paths=open_paths)
            continue
        if not _compatible(default, value):
            raise ConfigError(
                f"{source}: '{dotted}' must be {_type_name(default)}, got {_type_name(value)} ({value!r})"
            )
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        out[key] = copy.deepcopy(value)
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse one ``key.sub=value`` override; the value is read as YAML (``1e-4``, ``true``, ``[1,2]``)."""
    if "=" not in text:
        raise ConfigError(f"--set expects KEY=VALUE, got '{text}'")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set has an empty key in '{text}'")
    try:
        value = yaml_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: value '{raw}' is not valid YAML") from exc
    except RecursionError:  # PyYAML composes nested nodes recursively
        raise ConfigError(f"--set {key}: the value nests lists or mappings too deeply to read") from None
    check_structure(value, f"--set {key}")
    return key.split("."), value


def _nest(path: list[str], value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(path):
        out = {part: out}
    return out


def _freeze(value: Any, open_paths: frozenset[str] = frozenset()) -> Any:
    if isinstance(value, Mapping):
        return Config(value, open_paths)
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Config):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_thaw(v) for v in value]
    return value


class Config(Mapping[str, Any]):
    """An immutable, nested configuration with attribute and dotted access.

    ``cfg.train.lr``, ``cfg["train"]["lr"]`` and ``cfg.get_path("train.lr")`` are equivalent.
    """

    __slots__ = ("_data", "_open")

    def __init__(
        self, data: Mapping[str, Any] | None = None, open_paths: frozenset[str] | set[str] = frozenset()
    ) -> None:
        data = data or {}
        open_paths = frozenset(open_paths) | open_paths_of(data)
        object.__setattr__(self, "_open", open_paths)
        frozen = {}
        for k, v in data.items():
            inner = frozenset(p[len(k) + 1 :] for p in open_paths if p.startswith(f"{k}."))
            frozen[str(k)] = _freeze(v, inner)
        object.__setattr__(self, "_data", frozen)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __getattr__(self, key: str) -> Any:
        try:
            return self._data[key]
        except KeyError:
            raise AttributeError(f"config has no key '{key}'") from None

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("Config is immutable; use with_overrides()")

    def __repr__(self) -> str:
        return f"Config({self.to_dict()!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Config):
            return self.to_dict() == other.to_dict()
        if isinstance(other, Mapping):
            return self.to_dict() == dict(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.digest())

    @property
    def open_paths(self) -> frozenset[str]:
        """Dotted paths of the open mappings (any keys allowed inside), relative to this config."""
        return self._open

    def get_path(self, dotted: str, default: Any = ...) -> Any:
        """Value at ``a.b.c``; raises :class:`ConfigError` if missing and no default is given."""
        node: Any = self
        for part in dotted.split("."):
            if isinstance(node, Config) and part in node:
                node = node[part]
            elif default is not ...:
                return default
            else:
                raise ConfigError(f"config has no key '{dotted}'")
        return node

    def to_dict(self) -> dict[str, Any]:
        """A deep, mutable copy as plain dicts and lists (for YAML/JSON)."""
        return {k: _thaw(v) for k, v in self._data.items()}

    def to_yaml(self) -> str:
        """The config as YAML text (key order kept)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)

    def digest(self) -> str:
        """A stable SHA-256 of the resolved config (key order does not matter)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def with_overrides(self, overrides: Mapping[str, Any] | list[str] | None, source: str = "--set") -> "Config":
        """Return a new config with ``overrides`` applied and validated against this one.

        ``overrides`` is either a list of ``key.sub=value`` strings or a mapping of dotted keys to values.
        """
        if not overrides:
            return self
        items: list[tuple[list[str], Any]]
        if isinstance(overrides, Mapping):
            items = [(str(k).split("."), v) for k, v in overrides.items()]
        else:
            items = [parse_override(o) for o in overrides]
        data = self.to_dict()
        for path, value in items:
            data = validate_against(data, _nest(path, value), f"{source} {'.'.join(path)}", open_paths=self._open)
        return Config(data, self._open)


def check_config_dir() -> Path:
    """:data:`CONFIG_DIR` (``configs/`` of the source checkout), or a usage error when it is missing.

    Packaging: the project runs from its source checkout (``pip install -e .``); a non-editable
    ``pip install .`` does not carry ``configs/`` and is not supported: every command then fails with this
    one line instead of a missing-file error deep inside."""
    if not CONFIG_DIR.is_dir():
        raise UsageError(
            f"the configs folder {CONFIG_DIR} is missing: butd-caption runs from its source checkout "
            "(git clone, then pip install -e .); a non-editable `pip install .` is not supported"
        )
    return CONFIG_DIR


def default_config_path(stage: str) -> Path:
    """``configs/<stage>.yaml`` inside the project."""
    return check_config_dir() / f"{stage}.yaml"


def load_config(
    stage: str,
    config_file: str | Path | None = None,
    overrides: list[str] | Mapping[str, Any] | None = None,
) -> Config:
    """Resolve a stage config: defaults, then the user's file (validated), then ``--set`` overrides.

    Args:
        stage: stage name; ``configs/<stage>.yaml`` holds its defaults and schema.
        config_file: optional user YAML (may use ``_base_``).
        overrides: ``key=value`` strings or a mapping of dotted keys.
    """
    defaults = load_yaml_with_bases(default_config_path(stage))
    open_paths = open_paths_in_chain(default_config_path(stage))
    data = defaults
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        data = validate_against(defaults, load_yaml_with_bases(path), str(path), open_paths=open_paths)
    cfg = Config(data, open_paths).with_overrides(overrides)

    check_bounds(cfg.to_dict())
    return cfg


def defaults_from(path: str | Path, section: str) -> Callable[[type], type]:
    """Class decorator (under ``@dataclass``): the field defaults of a settings record are the ``section:`` mapping
    of the YAML file ``path``, so each default is written once, in the file users read and override.

    Every key of the section must be a field of the class, and every field a key of the section or a default of
    the class itself (a field that is no config key, such as a secret taken from the environment); anything else
    is a :class:`ConfigError` naming the file, raised when the class is defined."""

    def apply(cls: type) -> type:
        where = f"{path} ({section}:)"
        data = load_yaml_with_bases(path).get(section)
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: the file has no '{section}:' mapping for {cls.__name__}")
        names = list(cls.__dict__.get("__annotations__", {}))
        unknown = sorted(set(data) - set(names))
        missing = [n for n in names if n not in data and n not in cls.__dict__]
        if unknown or missing:
            raise ConfigError(
                f"{where} does not match {cls.__name__}: "
                + "; ".join(
                    ([f"keys without a field {unknown}"] if unknown else [])
                    + ([f"fields without a default {missing}"] if missing else [])
                )
            )
        for name in names:
            if name in data:
                setattr(cls, name, data[name])
        return cls

    return apply
