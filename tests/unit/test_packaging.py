"""What the wheel ships: every package folder of bwstack is declared, so an installed bwstack (a node's tool venv,
the image's tool bundle) has every module the checkout has."""

from __future__ import annotations

from pathlib import Path

import tomllib

import bwstack

REPO = Path(__file__).resolve().parents[2]


def test_every_bwstack_package_folder_is_shipped():
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    package = Path(bwstack.__file__).parent
    folders = {
        ".".join(("bwstack", *p.parent.relative_to(package).parts)) for p in package.rglob("__init__.py")
    }
    declared = config.get("packages")
    if isinstance(declared, list):
        assert folders <= set(declared), f"add to [tool.setuptools] packages: {sorted(folders - set(declared))}"
    else:  # discovery (packages.find) ships every folder with an __init__.py under `where`
        assert "scripts" in declared["find"]["where"]
