"""The store preamble's one owner: open_store takes the run lock, prepares the store (cleaning what an
interrupted run left, saying so through the caller's log) and releases the lock when the block ends."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import bwstack

from bwstack.errors import BusyError
from bwstack.store.generations import BUILDING_PREFIX
from bwstack.store.layout import Layout
from bwstack.store.session import open_store


def test_open_store_locks_prepares_and_releases(tmp_path: Path):
    layout = Layout(tmp_path / "root", tmp_path / "ml-env", None, None)
    debris = layout.generations / f"{BUILDING_PREFIX}0007-killed"
    debris.mkdir(parents=True)
    said: list[str] = []
    with open_store(layout, said.append) as store:
        assert store.layout is layout and not debris.exists()
        with pytest.raises(BusyError, match="another bwstack run holds"), open_store(layout, said.append):
            pass
    assert said == [f"removing {debris.name} left by an interrupted run"]
    with open_store(layout, said.append):  # released: a second run may open it now
        pass


def _a_home(folder: Path) -> None:
    folder.mkdir(mode=0o700)
    (folder / ".netrc").write_text("machine example.org password secret\n")


def _sticky_shared(folder: Path) -> None:
    folder.mkdir()
    os.chmod(folder, 0o1777)
    (folder / "someone-elses-file").write_text("")


@pytest.mark.parametrize("prepare", [_a_home, _sticky_shared], ids=["a-home-folder", "a-shared-sticky-folder"])
@pytest.mark.parametrize("command", [["prune", "--keep", "1"], ["backup"]], ids=["prune", "backup"])
def test_a_root_of_other_files_is_refused_and_left_as_it_was(tmp_path, prepare, command, monkeypatch):
    """A mistyped --root (a home, /tmp): opening a store makes its root 0755 and leaves the run lock and
    generations/ in it. A folder that holds other files and nothing of a store is refused before any of that."""
    root = tmp_path / "not-a-store"
    prepare(root)
    before = {p.name: p.stat().st_mode for p in [root, *root.iterdir()]}
    monkeypatch.setenv("BWSTACK_CACHE", str(tmp_path / "cache"))
    result = bwstack(*command, "--root", str(root), "--ml-env", str(tmp_path / "ml-env"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"store root {root} holds other files" in result.stderr and "nothing of a bwstack store" in result.stderr
    assert {p.name: p.stat().st_mode for p in [root, *root.iterdir()]} == before


@pytest.mark.parametrize("kept", ["generations", "tool", "stack.lock.yaml"])
def test_a_root_holding_what_bwstack_puts_in_a_store_opens(tmp_path, kept):
    """The tool role installs bwstack and the lock under the root before the first generation is built."""
    layout = Layout(tmp_path / "root", tmp_path / "ml-env", None, None)
    layout.root.mkdir()
    (layout.root / kept).mkdir()
    with open_store(layout, lambda _line: None) as store:
        assert store.layout.generations.is_dir()
