"""The packages of ``models/`` import one way (docs/architecture.md): layers <- captioners <- decoding, checkpoints
<- released <- loading; no import cycle, no private name taken from another package, every captioner module found
by the registry."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import models

REPO = Path(__file__).resolve().parent.parent

#: what each part of models/ may import (besides pipeline.core and outside libraries)
MAY_IMPORT = {
    "layers": {"layers"},
    "registry": {"captioners"},
    "captioners": {"captioners", "layers", "registry"},
    "decoding": {"decoding", "captioners", "layers", "registry", "checkpoints"},
    "checkpoints": {"captioners", "registry"},
    "released": {"released", "checkpoints", "captioners", "registry"},
    "loading": {"loading", "released", "checkpoints", "captioners"},
}


def part_of(module: str) -> str:
    """``models.decoding.beam`` -> ``decoding``; ``models`` -> ``registry``."""
    parts = module.split(".")
    return "registry" if parts == ["models"] else parts[1]


def module_of(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def model_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import of a module under ``models`` (at module level or in a function:
    an import inside a function still ties the two modules)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "models"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "models":
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def model_files() -> list[Path]:
    return sorted(p for p in (REPO / "models").rglob("*.py") if "__pycache__" not in p.parts)


def imported_modules(module: str, names: list[str]) -> list[str]:
    """The modules an ``import`` or ``from module import names`` loads (a name may be a submodule)."""
    subs = [
        f"{module}.{n}"
        for n in names
        if (REPO / f"{module}.{n}".replace(".", "/")).exists()
        or (REPO / (f"{module}.{n}".replace(".", "/") + ".py")).exists()
    ]
    return [module, *subs]


def test_parts_import_one_way_without_private_names() -> None:
    bad = []
    for path in model_files():
        here = part_of(module_of(path))
        for line, module, names in model_imports(path):
            there = part_of(module)
            if there not in MAY_IMPORT[here]:
                bad.append(f"{path.relative_to(REPO)}:{line}: {here} imports {module} ({there})")
            if there != here and any(n.startswith("_") for n in names):
                bad.append(f"{path.relative_to(REPO)}:{line}: private name from {module}: {names}")
    assert bad == [], "\n".join(bad)


def test_no_product_module_takes_a_private_name_from_models() -> None:
    files = [REPO / "cli.py", *(p for root in ("pipeline", "extractors") for p in (REPO / root).rglob("*.py"))]
    bad = [
        f"{p.relative_to(REPO)}:{line}: {module} {names}"
        for p in files
        for line, module, names in model_imports(p)
        if any(n.startswith("_") for n in names)
    ]
    assert bad == []


def test_the_module_graph_of_models_has_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for path in model_files():
        graph[module_of(path)] = {
            m for _, module, names in model_imports(path) for m in imported_modules(module, names)
        } - {module_of(path)}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*trail, node, nxt]))
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert "models.decoding.beam" in graph and "models.decoding.options" in graph["models.decoding.beam"]
    assert "models.decoding" not in graph["models.decoding.beam"]


def test_the_checker_sees_a_cycle_and_a_wrong_direction(tmp_path: Path) -> None:
    assert part_of("models.layers.attention") == "layers" and part_of("models") == "registry"
    assert "decoding" not in MAY_IMPORT["captioners"] and "captioners" not in MAY_IMPORT["layers"]
    src = tmp_path / "x.py"
    src.write_text(
        "import torch\nfrom models.decoding.constraints import first_rows, _hidden\n"
        "\ndef f():\n    import models.loading\n"
    )
    assert sorted(model_imports(src)) == [
        (2, "models.decoding.constraints", ["first_rows", "_hidden"]),
        (5, "models.loading", []),
    ]


def test_the_registry_finds_every_captioner_module() -> None:
    names = models.available_captioners()
    assert set(names) == {"san", "nsan", "gsan", "ngsan", "m2", "aoa", "ban"}
    package = importlib.import_module("models.captioners")
    modules = {f"models.captioners.{i.name}" for i in pkgutil.iter_modules(package.__path__)} - {
        "models.captioners.base"
    }
    registered = {models.CAPTIONERS.get(n).__module__ for n in names}
    assert registered == modules, modules - registered
