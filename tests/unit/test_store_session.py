"""The store preamble's one owner: open_store takes the run lock, prepares the store (cleaning what an
interrupted run left, saying so through the caller's log) and releases the lock when the block ends."""

from __future__ import annotations

from pathlib import Path

import pytest

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
