"""The packaging config ships every data directory on purpose, so building bwstack prints no setuptools warnings."""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())
SETUPTOOLS = CONFIG["tool"]["setuptools"]


def _package_of(directory: Path) -> str | None:
    """The package name a directory has under the package-dir mapping (None: not shipped)."""
    for prefix, where in sorted(SETUPTOOLS["package-dir"].items(), key=lambda kv: -len(kv[1])):
        base = REPO / where
        if directory == base or base in directory.parents:
            rel = directory.relative_to(base).parts
            parts = ([prefix] if prefix else []) + list(rel)
            return ".".join(parts) if parts else None
    return None


@pytest.mark.parametrize("tree", ["ansible", "scripts/bwstack"])
def test_every_directory_holding_files_is_a_listed_package(tree):
    listed = set(SETUPTOOLS["packages"])
    missing = []
    for directory in sorted(p for p in (REPO / tree).rglob("*") if p.is_dir() and p.name != "__pycache__"):
        name = _package_of(directory)
        if name is None or not name.replace(".", "").replace("_", "").isalnum():
            continue  # not an importable name (model references like "gpt-oss-20b"): shipped by a parent's glob
        if not any(f.is_file() for f in directory.iterdir()) and not any(d.is_dir() for d in directory.iterdir()):
            continue
        if name not in listed:
            missing.append(name)
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_every_ansible_file_is_matched_by_package_data():
    data = SETUPTOOLS["package-data"]
    unshipped = []
    for path in sorted(p for p in (REPO / "ansible").rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        package = _package_of(path.parent)
        patterns = data.get(package, [])
        if not any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns):
            unshipped.append(str(path.relative_to(REPO)))
    assert not unshipped, f"not matched by [tool.setuptools.package-data]: {unshipped}"


def test_license_is_an_spdx_string():
    assert CONFIG["project"]["license"] == "Apache-2.0"
