"""The layering rule of docs/architecture.md#layering: imports only go down the stack.

Every ``import`` of the project's own modules (at module level or inside a function) is checked: a module may
import its own package and packages of a lower level, never one of its own level or above.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: level of each unit (a package folder, or a single module that is a stage living beside its library);
#: the longest matching prefix wins
LEVELS = {
    "pipeline": 0,  # the package itself holds only __version__
    "pipeline/core": 1,
    "models": 2,
    "extractors": 2,
    "pipeline/store": 2,
    "pipeline/metrics": 2,
    "pipeline/caption_data": 2,
    "pipeline/data": 3,
    "pipeline/importers": 3,
    "pipeline/world": 3,
    "pipeline/hub": 3,
    "extractors/training": 3,
    "pipeline/training": 4,
    "pipeline/captioning": 4,
    "pipeline/embedding": 4,
    "pipeline/relations_probe.py": 4,
    "extractors/stage.py": 4,
    "extractors/training/stage.py": 4,
    "pipeline/demo.py": 5,
    "pipeline/serving": 5,
    "pipeline/commands": 6,
    "cli.py": 7,
}
ROOTS = ("pipeline", "models", "extractors", "cli")


def unit_of(path: str) -> str:
    """The unit (key of :data:`LEVELS`) a repository path belongs to."""
    best = ""
    for unit in LEVELS:
        if (path == unit or path.startswith(unit + "/") or path == unit.removesuffix(".py") + ".py") and len(
            unit
        ) > len(best):
            best = unit
    if not best:
        raise AssertionError(f"{path} belongs to no layer of docs/architecture.md")
    return best


def module_path(module: str) -> str:
    """``pipeline.core.stages`` -> ``pipeline/core/stages.py`` (or the package folder when it is one)."""
    rel = module.replace(".", "/")
    return rel if (REPO / rel).is_dir() else rel + ".py"


def imports_of(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every absolute import of a project module in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        out += [(node.lineno, n) for n in names if n.split(".")[0] in ROOTS]
    return out


def upward_imports(path: str, source: str) -> list[str]:
    """The imports of ``source`` (the file at ``path``) that do not go down the stack."""
    unit = unit_of(path)
    bad = []
    for line, module in imports_of(source):
        target = unit_of(module_path(module))
        if target != unit and LEVELS[target] >= LEVELS[unit]:
            bad.append(
                f"{path}:{line}: {unit} (level {LEVELS[unit]}) imports {module} ({target}, level {LEVELS[target]})"
            )
    return bad


def test_the_checker_catches_upward_imports() -> None:
    assert (
        upward_imports(
            "models/captioners/m2.py",
            "import torch\nfrom pipeline.core.errors import ConfigError\n"
            "from models.captioners.base import Captioner\n",
        )
        == []
    )
    bad = upward_imports(
        "models/x.py", "def f():\n    from pipeline.store import open_writer\n    from pipeline.training.xe import y\n"
    )
    assert [b.split(": ", 1)[0] for b in bad] == ["models/x.py:2", "models/x.py:3"], bad
    assert upward_imports("extractors/stage.py", "from pipeline.store import open_writer\n") == []
    assert len(upward_imports("pipeline/embedding/train.py", "from pipeline.training.engine import x\n")) == 1
    assert len(upward_imports("pipeline/core/config.py", "from models import build_captioner\n")) == 1


def test_imports_only_go_down_the_stack() -> None:
    files = [
        REPO / "cli.py",
        *[p for root in ("pipeline", "models", "extractors") for p in (REPO / root).rglob("*.py")],
    ]
    bad = []
    for f in sorted(files):
        rel = f.relative_to(REPO).as_posix()
        if "__pycache__" in rel:
            continue
        bad += upward_imports(rel, f.read_text(encoding="utf-8"))
    assert bad == [], "imports against docs/architecture.md#layering:\n" + "\n".join(bad)
