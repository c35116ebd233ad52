"""The package's layers, lowest first: a module imports its own layer and lower ones, never a higher one.

The probe is the bottom and stands alone: it is what ships to nodes as a zipapp, so it imports nothing of
bwstack outside itself and nothing outside the standard library but pyelftools. `lock` knows no store,
`store` knows no provisioning, and only `cli` sees everything.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import bwstack

PACKAGE = Path(bwstack.__file__).parent

# Lowest first. A name is a package (folder) or a top-level module of bwstack.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"probe"}),
    frozenset({"errors", "paths", "fsutil"}),
    frozenset({"lock"}),
    frozenset({"store"}),
    frozenset({"provision"}),
    frozenset({"checks", "accept", "serveplan"}),
    frozenset({"fleet", "image"}),
    frozenset({"bench"}),
    frozenset({"cli", "__main__"}),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
# What the probe may import besides the standard library (it runs on nodes without bwstack's dependencies).
PROBE_THIRD_PARTY = {"elftools"}


def unit_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def imports_of(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports (at any depth: lazy imports inside functions count too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ".".join(("bwstack", *path.relative_to(PACKAGE).with_suffix("").parts[:-1]))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            if module == "bwstack":  # from bwstack import lock, ... names packages
                found += [(node.lineno, f"bwstack.{alias.name}") for alias in node.names]
    return found


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts and p.name != "__init__.py"
                  or p.parent != PACKAGE and p.name == "__init__.py")  # fmt: skip


def test_every_module_belongs_to_a_declared_layer():
    undeclared = {unit_of(p) for p in modules()} - set(RANK)
    assert not undeclared, f"add these to LAYERS: {sorted(undeclared)}"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_higher_layer(path):
    unit = unit_of(path)
    upward = []
    for line, module in imports_of(path):
        parts = module.split(".")
        if parts[0] != "bwstack" or len(parts) < 2 or parts[1] == "__version__":
            continue
        target = parts[1]
        if target in RANK and RANK[target] > RANK[unit]:
            upward.append(f"line {line}: {module} ({target} is above {unit})")
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize(
    "path", [p for p in modules() if unit_of(p) == "probe"], ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_the_probe_imports_only_itself_the_standard_library_and_pyelftools(path):
    outside = []
    for line, module in imports_of(path):
        top = module.split(".")[0]
        if top == "bwstack":
            if module not in {"bwstack", "bwstack.probe"} and not module.startswith("bwstack.probe."):
                outside.append(f"line {line}: {module}")
        elif top not in sys.stdlib_module_names and top not in PROBE_THIRD_PARTY and top != "__future__":
            outside.append(f"line {line}: {module}")
    assert not outside, "\n".join(outside)


def test_the_in_env_observer_imports_nothing_but_the_standard_library_at_module_level():
    """inenv.py runs in the env's own interpreter, where bwstack is not installed; the env's packages are
    imported inside functions, after it has decided which to look at."""
    path = PACKAGE / "probe" / "serveplan" / "inenv.py"
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        for name in names:
            assert name.split(".")[0] in sys.stdlib_module_names or name == "__future__", name


def test_a_layer_violation_is_caught(tmp_path):
    """The checker itself can fail: a store module importing the CLI is reported."""
    fake = PACKAGE / "store" / "_layer_probe_example.py"
    source = "def f():\n    from bwstack.cli import main\n"
    tree_imports = [m for _, m in ast_imports(source, fake)]
    assert "bwstack.cli" in tree_imports
    assert RANK["cli"] > RANK["store"]


def ast_imports(source: str, path: Path) -> list[tuple[int, str]]:
    tmp = path.with_name("_tmp_check.py")
    return [(n.lineno, n.module or "") for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)]
