"""Every `from fleetbox-module import name` in the tree names something that exists, lazy imports
inside functions included: a module split must not leave a benchmark or a rarely run path broken
until someone runs it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ("appliance", "tui", "runtimes", "benchmarks", "tests")


def _imports() -> list[tuple[str, int, str, str]]:
    found = []
    for folder in OURS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in OURS:
                    found += [(str(path.relative_to(ROOT)), node.lineno, node.module, a.name) for a in node.names]
    return found


def test_every_from_import_in_the_tree_resolves() -> None:
    missing = []
    for path, line, module, name in _imports():
        try:
            imported = importlib.import_module(module)
            if not hasattr(imported, name):
                importlib.import_module(f"{module}.{name}")  # a submodule, then
        except ImportError as exc:
            missing.append(f"{path}:{line}: from {module} import {name}: {exc}")
    assert not missing, "\n".join(missing)
