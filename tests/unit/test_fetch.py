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
from helpers import bwstack, needs_py312


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

# The mirror comes through BWSTACK_INDEX, which an offline run may have set around it: `--offline --index` on
# one command line is refused before anything runs (test_cli.py).
SOURCES = [
    ("lock-urls", {}),
    ("index-mirror", {"BWSTACK_INDEX": "pypi=https://127.0.0.1:{port}/simple"}),
]


@pytest.mark.parametrize("source", [c[1] for c in SOURCES], ids=[c[0] for c in SOURCES])
def test_fetch_offline_never_reaches_an_index_and_says_what_is_missing(stack, tmp_path, listener, source):
    env = {k: v.format(port=listener.port) for k, v in source.items()}
    result = _fetch(stack, tmp_path / "dest", "--offline", extra_env={**_network_env(listener), **env})
    assert result.returncode == 1, result.stderr
    assert "is in no wheelhouse and the run is offline" in result.stderr and result.stderr.count("\n") == 1
    assert listener.hits == 0


@pytest.mark.parametrize("source", [c[1] for c in SOURCES], ids=[c[0] for c in SOURCES])
def test_the_listener_sees_the_attempt_a_fetch_without_offline_makes(stack, tmp_path, listener, source):
    """The control of the test above: without --offline the same fetch does reach for the network."""
    env = {k: v.format(port=listener.port) for k, v in source.items()}
    result = _fetch(stack, tmp_path / "dest", extra_env={**_network_env(listener), **env})
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


# ------------------------------------------------------------------------------------------------ links in DEST


def _store_parts(stack) -> dict[str, tuple[str, ...]]:
    sha = next(s for f, s in _locked(stack).items() if f.startswith("fixture_dep-"))
    return {"store": (), "partial": (".partial",), "prefix": (sha[:2],), "entry": (sha[:2], sha)}


@pytest.mark.parametrize("where", ["store", "partial", "prefix", "entry"])
def test_a_link_planted_in_dest_store_is_refused_and_never_written_through(stack, tmp_path, where):
    """DEST is often shared: whoever can write it can plant a link where the store's folders go. Root's fetch
    refuses it in one line and leaves the folder the link names as it was."""
    dest, victim = tmp_path / "dest", tmp_path / "victim"
    victim.mkdir()
    (victim / "secret").write_text("root only")
    parts = _store_parts(stack)[where]
    planted = dest.joinpath(".store", *parts)
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.symlink_to(victim)
    result = _fetch(stack, dest, "--wheelhouse", str(stack.wheelhouse), "--offline")
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"bwstack: error: {planted} is a link or not a folder: bwstack does not follow links in a wheel store or "
        "destination it writes; remove it\n"
    )
    assert sorted(p.name for p in victim.iterdir()) == ["secret"] and (victim / "secret").read_text() == "root only"


def test_a_wheel_is_stored_read_only_under_its_hash_and_no_temporary_file_is_left(stack, tmp_path):
    dest = tmp_path / "dest"
    assert _fetch(stack, dest, "--wheelhouse", str(stack.wheelhouse), "--offline").returncode == 0
    for file, sha in _locked(stack).items():
        stored = dest / ".store" / sha[:2] / sha / file
        assert _sha(stored) == sha and (stored.stat().st_mode & 0o777) == 0o444
    assert not list((dest / ".store" / ".partial").iterdir())


def test_uv_lock_files_lose_world_write_but_a_link_among_them_is_not_followed(tmp_path):
    from bwstack.provision.envbuild import drop_world_write

    cache, victim = tmp_path / "uv", tmp_path / "victim"
    (cache / "sdists").mkdir(parents=True)
    victim.write_text("root only")
    victim.chmod(0o600)
    (cache / "sdists" / "x.lock").symlink_to(victim)
    own = cache / "sdists" / "y.lock"
    own.write_text("")
    own.chmod(0o666)
    drop_world_write(cache)
    assert (victim.stat().st_mode & 0o777) == 0o600
    assert (own.stat().st_mode & 0o777) == 0o644


# ------------------------------------------------------------------------------------------------ env install


def _requirements(stack, tmp_path: Path) -> Path:
    rendered = stack.run("render", "--profile", "fixture-new")
    assert rendered.returncode == 0, rendered.stderr
    path = tmp_path / "requirements.txt"
    path.write_text(rendered.stdout)
    return path


@pytest.mark.parametrize("option", ["--store", "--uv-cache"])
def test_env_install_refuses_a_wheel_store_or_uv_cache_others_can_write(stack, tmp_path, option):
    """What lies there becomes the env's files: a folder another user could fill is refused before anything
    is fetched or installed."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    env = tmp_path / "env"
    more = ["--store", str(tmp_path / "own-store")] if option == "--uv-cache" else []
    result = stack.run(
        "env", "install", "--requirements", str(_requirements(stack, tmp_path)), "--into", str(env),
        "--wheelhouse", str(stack.wheelhouse), "--offline", option, str(shared), *more,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "is not this user's alone" in result.stderr
    assert not env.exists() and list(shared.iterdir()) == []


@needs_py312
def test_env_install_without_uv_cache_unpacks_through_bwstacks_own_cache_not_the_environments(stack, tmp_path):
    """uv takes what its cache holds as a wheel's files: a UV_CACHE_DIR the caller's environment names (one another
    user could fill) is never where root's install comes from."""
    env = tmp_path / "env"
    result = stack.run(
        "env", "install", "--requirements", str(_requirements(stack, tmp_path)), "--into", str(env),
        "--wheelhouse", str(stack.wheelhouse), "--offline",
        extra_env={"UV_CACHE_DIR": str(tmp_path / "callers-uv-cache")},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert list(env.glob("lib/python3.12/site-packages/torch/version.py"))
    assert not (tmp_path / "callers-uv-cache").exists()
    assert list((stack.root / "cache" / "uv").glob("archive-v*/*/torch/version.py"))


def _callers_uv_setting(name: str, tmp_path: Path) -> str:
    """A value of the caller's environment that, reaching uv, would change what root installs or where from."""
    if name == "UV_OVERRIDE":  # another fixture-shared, hash and all: --require-hashes only asks for one
        other = next((tmp_path / "extra-wheels").glob("fixture_shared-2.0-*.whl"))
        path = tmp_path / "override.txt"
        path.write_text(
            f"fixture-shared @ {other.as_uri()} --hash=sha256:{hashlib.sha256(other.read_bytes()).hexdigest()}\n"
        )
        return str(path)
    if name == "UV_EXCLUDE":
        (tmp_path / "exclude.txt").write_text("torch\n")
        return str(tmp_path / "exclude.txt")
    if name == "UV_CONFIG_FILE":  # read even with UV_NO_CONFIG
        (tmp_path / "uv.toml").write_text("no-cache = true\n")
        return str(tmp_path / "uv.toml")
    return "1"  # UV_NO_CACHE: unpacked into a temporary folder, not the store's cache


@needs_py312
@pytest.mark.parametrize("name", ["UV_OVERRIDE", "UV_EXCLUDE", "UV_CONFIG_FILE", "UV_NO_CACHE"])
def test_the_callers_uv_settings_do_not_reach_the_uv_that_installs(stack, tmp_path, name):
    env = tmp_path / "env"
    result = stack.run(
        "env", "install", "--requirements", str(_requirements(stack, tmp_path)), "--into", str(env),
        "--wheelhouse", str(stack.wheelhouse), "--offline", extra_env={name: _callers_uv_setting(name, stack.tmp)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    site = env / "lib" / "python3.12" / "site-packages"
    assert (site / "fixture_shared" / "__init__.py").read_text() == "DATA = 'shared v1'\n"
    assert (site / "torch" / "version.py").is_file()
    assert list((stack.root / "cache" / "uv").glob("archive-v*/*/fixture_shared/__init__.py"))


def test_env_install_refuses_hard_links_into_bwstacks_own_uv_cache(stack, tmp_path):
    """Hard-linked, the env's files would be the same inodes as the sealed generations' (the store's uv cache)."""
    env = tmp_path / "env"
    result = stack.run(
        "env", "install", "--requirements", str(_requirements(stack, tmp_path)), "--into", str(env),
        "--wheelhouse", str(stack.wheelhouse), "--offline", "--link-mode", "hardlink",
    )  # fmt: skip
    assert result.returncode == 2
    assert (
        result.stderr.startswith("bwstack: error: --link-mode hardlink needs --uv-cache")
        and result.stderr.count("\n") == 1
    )
    assert not env.exists()


def test_index_mirrors_are_read_from_bwstack_index_as_well_as_the_command_line(stack, tmp_path):
    """BWSTACK_INDEX (one NAME=URL a line) keeps a mirror's token out of the process table; it is checked as
    --index is."""
    result = _fetch(
        stack, tmp_path / "dest", "--wheelhouse", str(stack.wheelhouse), "--offline",
        extra_env={"BWSTACK_INDEX": "\n  pypi=https://m.example/simple\nnot-a-mirror\n"},
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == "bwstack: error: --index 'not-a-mirror': expected NAME=https://mirror/simple\n"


def test_a_dest_the_operator_named_through_a_link_of_their_own_is_used(stack, tmp_path):
    real = tmp_path / "real-dest"
    real.mkdir()
    (tmp_path / "dest").symlink_to(real)
    result = _fetch(stack, tmp_path / "dest", "--wheelhouse", str(stack.wheelhouse), "--offline")
    assert result.returncode == 0, result.stderr
    assert {f: _sha(real / f) for f in _locked(stack)} == _locked(stack)


def test_dest_holds_hard_links_to_the_store_entries_it_hashed(stack, tmp_path):
    dest = tmp_path / "dest"
    assert _fetch(stack, dest, "--wheelhouse", str(stack.wheelhouse), "--offline").returncode == 0
    for file, sha in _locked(stack).items():
        assert (dest / file).stat().st_ino == (dest / ".store" / sha[:2] / sha / file).stat().st_ino


def test_a_wheel_without_a_hash_is_never_read_through_a_link_in_a_wheelhouse(tmp_path):
    """Its bytes are not checked against anything: a link there could lead to any file of root's."""
    from types import SimpleNamespace

    from bwstack.errors import BwstackError
    from bwstack.provision.wheelhouse import hash_local_wheel

    secret = tmp_path / "secret"
    secret.write_text("root only")
    house = tmp_path / "house"
    house.mkdir()
    (house / "x-1.0-py3-none-any.whl").symlink_to(secret)
    pkg = SimpleNamespace(name="x", version="1.0")
    wheel = SimpleNamespace(file="x-1.0-py3-none-any.whl", sha256=None)
    with pytest.raises(BwstackError, match="is a link; the lock has no hash for this wheel"):
        hash_local_wheel(pkg, wheel, house / wheel.file, str(house))


def test_fetch_takes_no_python_option_since_it_makes_no_env():
    """An accepted option is one that does something: fetch only downloads."""
    result = bwstack("fetch", "--dest", "/tmp/bwstack-fetch-never-made", "--python", "/usr/bin/python3")
    assert result.returncode == 2 and "unrecognized arguments: --python" in result.stderr


def test_the_nodes_refuse_a_mirror_without_an_index_name_as_the_controller_does():
    """One rule for NAME=URL (wheelhouse.parse_mirror): a mirror for no index would be taken and never used."""
    from bwstack.errors import UsageError
    from bwstack.provision.wheelhouse import Sources

    with pytest.raises(UsageError, match="expected NAME=https://mirror/simple"):
        Sources.parse(mirrors=["=https://mirror.example/simple"])


def test_an_allow_unhashed_name_of_the_profiles_other_part_is_no_error_but_one_of_neither_is(tmp_path):
    """The env build gets the toolkit's names as `elsewhere` and the toolkit install the env's: one list serves a
    whole provision run, and a misspelt name is still refused."""
    from bwstack.errors import UsageError
    from bwstack.provision.wheelhouse import Fetcher, Sources

    Fetcher(tmp_path / "store", Sources(), ["nvidia-cuda-nvcc"], elsewhere=["nvidia-cuda-nvcc"]).fetch_all({})
    with pytest.raises(UsageError, match="--allow-unhashed nvidia-cuda-nvc: not in this closure"):
        Fetcher(tmp_path / "store", Sources(), ["nvidia-cuda-nvc"], elsewhere=["nvidia-cuda-nvcc"]).fetch_all({})
