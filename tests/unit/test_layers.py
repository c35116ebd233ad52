"""The package's layers, lowest first: a module imports its own layer and lower ones, never a higher one.

The probe is the bottom and stands alone: it is what ships to nodes as a zipapp, so it imports nothing of
bwstack outside itself and nothing outside the standard library. `lock` knows no store,
`store` knows no provisioning, and only `cli` sees everything.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import bwstack
from bwstack.probe import interp

PACKAGE = Path(bwstack.__file__).parent

# Lowest first. A name is a package (folder) or a top-level module of bwstack.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"probe"}),
    frozenset({"errors", "paths", "fsutil", "data", "terminal"}),
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
PROBE_THIRD_PARTY: set[str] = set()


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
    return sorted(p for p in PACKAGE.rglob("*.py") if ("__pycache__" not in p.parts and p.name != "__init__.py")
                  or (p.parent != PACKAGE and p.name == "__init__.py"))  # fmt: skip


def test_every_module_belongs_to_a_declared_layer():
    undeclared = {unit_of(p) for p in modules()} - set(RANK)
    assert not undeclared, f"add these to LAYERS: {sorted(undeclared)}"


def upward(unit: str, imported: list[tuple[int, str]]) -> list[str]:
    """The imports of a module in `unit` that reach a higher layer."""
    found = []
    for line, module in imported:
        parts = module.split(".")
        if parts[0] != "bwstack" or len(parts) < 2 or parts[1] == "__version__":
            continue
        target = parts[1]
        if target in RANK and RANK[target] > RANK[unit]:
            found.append(f"line {line}: {module} ({target} is above {unit})")
    return found


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_higher_layer(path):
    assert not (found := upward(unit_of(path), imports_of(path))), "\n".join(found)


SCRIPTS = PACKAGE / "probe" / "scripts"


def in_env_scripts() -> list[Path]:
    return sorted(p for p in SCRIPTS.glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize(
    "path",
    [p for p in modules() if unit_of(p) == "probe" and p not in in_env_scripts()],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_the_probe_imports_only_itself_and_the_standard_library(path):
    outside = []
    for line, module in imports_of(path):
        top = module.split(".")[0]
        if top == "bwstack":
            if module not in {"bwstack", "bwstack.probe"} and not module.startswith("bwstack.probe."):
                outside.append(f"line {line}: {module}")
        elif top not in sys.stdlib_module_names and top not in PROBE_THIRD_PARTY and top != "__future__":
            outside.append(f"line {line}: {module}")
    assert not outside, "\n".join(outside)


@pytest.mark.parametrize("path", in_env_scripts(), ids=lambda p: p.name)
def test_an_in_env_script_imports_no_bwstack_and_only_the_standard_library_at_module_level(path):
    """probe/scripts run in the env's own interpreter, where bwstack is not installed: what they need of the
    env (torch, sglang, ...) they import themselves; module-level imports are the standard library's, except
    for a script whose whole job is the env's package (one that cannot run without torch says so by failing)."""
    for _line, module in imports_of(path):
        assert module.split(".")[0] != "bwstack", f"{path.name} imports {module}"


def test_every_in_env_script_is_run_by_name_somewhere():
    """A script file nobody runs is dead code: each is named by a run_script/script_source call, or included by
    a script that is (interp.script_source puts its text there)."""
    sources = "\n".join(p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py") if SCRIPTS not in p.parents)
    run = {p.stem for p in in_env_scripts() if f'"{p.stem}"' in sources}
    included = {
        line.removeprefix(interp.INCLUDE).strip()
        for p in in_env_scripts()
        if p.stem in run
        for line in p.read_text(encoding="utf-8").splitlines()
        if line.startswith(interp.INCLUDE)
    }
    for path in in_env_scripts():
        assert path.stem in run | included, f"nothing runs probe/scripts/{path.name}"


def test_an_included_script_is_in_the_text_that_runs():
    """The import checks and SGLang's planner stamp what they loaded with the same code: loaded.py's text."""
    helper = (SCRIPTS / "loaded.py").read_text(encoding="utf-8")
    for name in ("imports", "serveplan"):
        text = interp.script_source(name)
        assert helper in text and not any(line.startswith(interp.INCLUDE) for line in text.splitlines()), name
        compile(text, f"{name}.py", "exec")


def test_an_upward_import_is_reported_even_inside_a_function():
    """The checker can fail: a lazy import of the CLI from the store is caught like a top-level one."""
    assert upward("store", [(2, "bwstack.cli.main")]) == ["line 2: bwstack.cli.main (cli is above store)"]
    assert upward("cli", [(2, "bwstack.store.generations")]) == []


def test_no_test_module_imports_another_test_module_or_conftest():
    """Shared test code lives in helpers.py (and fixtures/): a test module importing another runs its tests'
    module-level code twice and hides what is shared."""
    tests = Path(__file__).parent
    offenders = []
    for path in sorted(tests.glob("*.py")):
        for _line, module in ast_imports_of(path):
            if module == "conftest" or module.startswith("test_"):
                offenders.append(f"{path.name} imports {module}")
    assert not offenders, "\n".join(offenders)


def ast_imports_of(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and not node.level:
            found.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found
