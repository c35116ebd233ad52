"""`bwstack fetch`: --offline never reaches the network, and what it reuses (DEST/<wheel>, DEST/.store) is
hashed again before it is used: a damaged file is replaced by a verified wheel, or refused, and said so.

The stack is the FIXTURE stack (small wheels built by the tests, URLs on fixture.invalid). Network attempts are
caught by a local TCP listener that every proxy variable and the index mirror point at: it counts connections,
so a test that expects none would see one.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml


class Listener:
    """A TCP port that records every connection made to it (and closes it at once)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.hits = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.hits += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


def _network_env(listener: Listener) -> dict[str, str]:
    url = f"http://127.0.0.1:{listener.port}"
    env = {name: url for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")}
    return {**env, "NO_PROXY": "", "no_proxy": ""}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _locked(stack) -> dict[str, str]:
    """wheel file -> sha256 for fixture-new's env, from the lock."""
    doc = yaml.safe_load(stack.lock.read_text())
    return {w["file"]: w["sha256"] for p in doc["closures"]["fixture-new"]["env"].values() for w in p["wheels"]}


def _fetch(stack, dest: Path, *more: str, extra_env: dict | None = None):
    return stack.run("fetch", "--profile", "fixture-new", "--dest", str(dest), *more, extra_env=extra_env)


# ------------------------------------------------------------------------------------------------ offline

SOURCES = [
    ("lock-urls", []),
    ("index-mirror", ["--index", "pypi=https://127.0.0.1:{port}/simple"]),
]


@pytest.mark.parametrize("source", [c[1] for c in SOURCES], ids=[c[0] for c in SOURCES])
def test_fetch_offline_never_reaches_an_index_and_says_what_is_missing(stack, tmp_path, listener, source):
    args = [a.format(port=listener.port) for a in source]
    result = _fetch(stack, tmp_path / "dest", *args, "--offline", extra_env=_network_env(listener))
    assert result.returncode == 1, result.stderr
    assert "is in no wheelhouse and the run is offline" in result.stderr and result.stderr.count("\n") == 1
    assert listener.hits == 0


@pytest.mark.parametrize("source", [c[1] for c in SOURCES], ids=[c[0] for c in SOURCES])
def test_the_listener_sees_the_attempt_a_fetch_without_offline_makes(stack, tmp_path, listener, source):
    """The control of the test above: without --offline the same fetch does reach for the network."""
    args = [a.format(port=listener.port) for a in source]
    result = _fetch(stack, tmp_path / "dest", *args, extra_env=_network_env(listener))
    assert result.returncode == 1 and listener.hits > 0, result.stderr


def test_fetch_offline_from_a_wheelhouse_fills_dest_without_the_network(stack, tmp_path, listener):
    dest = tmp_path / "dest"
    result = _fetch(stack, dest, "--wheelhouse", str(stack.wheelhouse), "--offline", extra_env=_network_env(listener))
    assert result.returncode == 0, result.stderr
    assert listener.hits == 0
    assert {f: _sha(dest / f) for f in _locked(stack)} == _locked(stack)


# ------------------------------------------------------------------------------------------------ reuse


def _replace_with_other_bytes(path: Path) -> None:
    path.unlink()
    path.write_bytes(b"not the wheel the lock names")


def _link_elsewhere(path: Path) -> None:
    elsewhere = path.parent.parent / "elsewhere.bin"
    elsewhere.write_bytes(b"someone else's file")
    path.unlink()
    path.symlink_to(elsewhere)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _truncate_in_place(path: Path) -> None:
    """Same inode: DEST/<wheel> is a hard link into DEST/.store, so the store's copy is damaged too."""
    with open(path, "r+b") as handle:
        handle.truncate(10)


# (case, damage done to DEST/<wheel> after a good fetch, whether the store's copy is damaged with it)
DAMAGE: list[tuple[str, Callable[[Path], None], bool]] = [
    ("other-bytes", _replace_with_other_bytes, False),
    ("symlink-elsewhere", _link_elsewhere, False),
    ("fifo", _fifo, False),
    ("truncated-in-place", _truncate_in_place, True),
]


@pytest.mark.parametrize(("damage", "store_too"), [c[1:] for c in DAMAGE], ids=[c[0] for c in DAMAGE])
def test_a_damaged_wheel_in_dest_is_replaced_with_the_verified_one_and_said_so(stack, tmp_path, damage, store_too):
    dest = tmp_path / "dest"
    assert _fetch(stack, dest, "--wheelhouse", str(stack.wheelhouse), "--offline").returncode == 0
    victim = next(f for f in _locked(stack) if f.startswith("fixture_dep-"))
    damage(dest / victim)
    elsewhere = tmp_path / "elsewhere.bin"
    before = elsewhere.read_bytes() if elsewhere.exists() else None
    result = _fetch(stack, dest, "--wheelhouse", str(stack.wheelhouse), "--offline")
    assert result.returncode == 0, result.stderr
    assert f"WARNING: {dest / victim} " in result.stdout and "replaced with the verified wheel" in result.stdout
    assert ("the store's" in result.stdout and "removed; fetching it again" in result.stdout) == store_too
    assert (dest / victim).is_file() and not (dest / victim).is_symlink()
    assert {f: _sha(dest / f) for f in _locked(stack)} == _locked(stack)
    assert not list(dest.glob(".*.tmp"))
    if before is not None:
        assert elsewhere.read_bytes() == before, "the link's target is not written through"


def test_a_damaged_store_entry_is_refused_offline_when_nothing_else_has_the_wheel(stack, tmp_path):
    dest = tmp_path / "dest"
    assert _fetch(stack, dest, "--wheelhouse", str(stack.wheelhouse), "--offline").returncode == 0
    victim = next(f for f in _locked(stack) if f.startswith("fixture_dep-"))
    _truncate_in_place(dest / victim)
    result = _fetch(stack, dest, "--offline")
    assert result.returncode == 1
    assert "the store's" in result.stdout and "removed; fetching it again" in result.stdout
    assert result.stderr.count("\n") == 1 and "is in no wheelhouse and the run is offline" in result.stderr


def test_a_directory_where_a_wheel_belongs_is_refused_in_one_line(stack, tmp_path):
    dest = tmp_path / "dest"
    victim = next(f for f in _locked(stack) if f.startswith("fixture_dep-"))
    (dest / victim).mkdir(parents=True)
    result = _fetch(stack, dest, "--wheelhouse", str(stack.wheelhouse), "--offline")
    assert result.returncode == 1
    assert result.stderr == f"bwstack: error: {dest / victim} is a directory where fixture-dep's wheel belongs: " + (
        "remove it\n"
    )


def test_an_intact_dest_is_kept_as_it_is(stack, tmp_path):
    dest = tmp_path / "dest"
    assert _fetch(stack, dest, "--wheelhouse", str(stack.wheelhouse), "--offline").returncode == 0
    inodes = {f: (dest / f).stat().st_ino for f in _locked(stack)}
    result = _fetch(stack, dest, "--offline")
    assert result.returncode == 0 and "WARNING" not in result.stdout, result.stdout
    assert {f: (dest / f).stat().st_ino for f in _locked(stack)} == inodes
