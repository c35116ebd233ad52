"""What one check session (one pytest run of tests/infra against one host) reads once and shares."""

from __future__ import annotations

import pytest

from bwstack.lock.model import Lock, default_lock_path, load_lock

_LOCK = pytest.StashKey[Lock]()


def session_lock(config: pytest.Config) -> Lock:
    """The lock named by --stack-lock (default: bwstack's own), read and validated once per session: the fixtures
    and the serve-plan check's parametrisation share it (parsing the lock takes a sixth of a second, and the
    unchanged-generation verify is a 2 s command)."""
    if _LOCK not in config.stash:
        config.stash[_LOCK] = load_lock(config.getoption("--stack-lock") or default_lock_path())
    return config.stash[_LOCK]
