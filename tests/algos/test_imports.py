"""engine/algos is pure tensor math: it imports torch, the standard library and itself only."""

import ast
import importlib
import pkgutil
import sys
from pathlib import Path

import engine.algos

ALGOS_DIR = Path(engine.algos.__file__).parent
ALLOWED_TOP_LEVEL = {"torch", "__future__"} | set(sys.stdlib_module_names)


def imported_modules(source: str) -> list[tuple[str, int]]:
    """(module name, relative level) for every import statement, at any depth in the file."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((alias.name, 0) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", node.level))
    return found


def test_algos_imports_only_torch_stdlib_and_itself():
    files = sorted(ALGOS_DIR.rglob("*.py"))
    assert {p.name for p in files} >= {"__init__.py", "masked.py", "advantages.py", "policy_loss.py", "kl.py"}
    bad = []
    for path in files:
        for module, level in imported_modules(path.read_text()):
            ok = (
                level > 0  # relative import stays inside engine.algos
                or module.split(".")[0] in ALLOWED_TOP_LEVEL
                or module == "engine.algos"
                or module.startswith("engine.algos.")
            )
            if not ok:
                bad.append(f"{path.name}: {module}")
    assert not bad, bad


def test_every_algos_module_imports():
    names = [m.name for m in pkgutil.walk_packages([str(ALGOS_DIR)], prefix="engine.algos.")]
    assert "engine.algos.advantages" in names
    for name in names:
        importlib.import_module(name)
