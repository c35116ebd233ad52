"""One check session reads the lock once: the fixtures and the serve-plan check's parametrisation share it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bwstack.checks import session
from bwstack.lock.model import default_lock_path
from bwstack.lock.read import LockError


class _Config:
    """The two things session_lock reads of a pytest config: its options and its stash."""

    def __init__(self, lock: Path | None) -> None:
        self.stash = pytest.Stash()
        self._options = {"--stack-lock": str(lock) if lock else None}

    def getoption(self, name: str):
        return self._options[name]


def test_the_lock_is_read_once_per_session(tmp_path):
    path = tmp_path / "stack.lock.yaml"
    shutil.copy(default_lock_path(), path)
    config = _Config(path)
    first = session.session_lock(config)
    path.write_text("schema_version: [")  # read again, this would fail
    assert session.session_lock(config) is first


def test_another_session_reads_the_lock_again(tmp_path):
    path = tmp_path / "stack.lock.yaml"
    shutil.copy(default_lock_path(), path)
    assert session.session_lock(_Config(path)) is not session.session_lock(_Config(path))


def test_a_bad_lock_fails_each_time_it_is_asked_for(tmp_path):
    path = tmp_path / "stack.lock.yaml"
    path.write_text("schema_version: [")
    config = _Config(path)
    for _ in range(2):
        with pytest.raises(LockError):
            session.session_lock(config)


def test_no_lock_named_is_bwstacks_own():
    assert session.session_lock(_Config(None)).path == str(default_lock_path())
