"""The code reads one way: ruff's lint rules and its formatter (pyproject.toml's settings) pass over the package
and the tests, so a change that drifts from them fails here, not in a reviewer's eye."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO


def _ruff() -> str:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not os.access(ruff, os.X_OK):
        pytest.skip("ruff is not installed (scripts/bootstrap.sh --dev installs it)")
    return ruff


@pytest.mark.parametrize(
    "command",
    [["check"], ["format", "--check"]],
    ids=["lint", "format"],
)
def test_ruff_passes_over_the_package_and_the_tests(command):
    result = subprocess.run(
        [_ruff(), *command, "--no-cache", "scripts", "tests"], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]
