"""Restore treats every archive as hostile: whatever it holds, nothing is written outside the new generation.

Each case starts from a real archive of a fixture generation and bends it the way an attacker (or a broken
disk) would. After every case: the sentinel tree outside the store is byte-identical, the active env is the
same generation and still runs, no half generation is left behind, and the refusal is one line.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import stat
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard
from helpers import bwstack, needs_py312, vouched

from bwstack.errors import IntegrityError
from bwstack.store import archive as archive_module
from bwstack.store.generations import Store
from bwstack.store.layout import Layout
from fixtures import fakestack

pytestmark = needs_py312

ENV_FILE = "generation/env/pyvenv.cfg"


class Archive:
    """An archive's members in order, as (TarInfo, data) pairs that cases bend before writing it."""

    def __init__(self, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> None:
        self.members = members

    def names(self) -> list[str]:
        return [m.name for m, _ in self.members]

    def index(self, name: str) -> int:
        return self.names().index(name)

    def add(self, info: tarfile.TarInfo, data: bytes | None = None, after: str | None = None) -> None:
        position = self.index(after) + 1 if after else len(self.members)
        if data is not None:
            info.size = len(data)
        self.members.insert(position, (info, data))

    def data(self, name: str) -> bytes:
        return self.members[self.index(name)][1] or b""

    def replace_data(self, name: str, data: bytes) -> None:
        info, _ = self.members[self.index(name)]
        info.size = len(data)
        self.members[self.index(name)] = (info, data)

    def manifest(self) -> dict:
        return json.loads(self.data("generation/manifest.json"))

    def set_manifest(self, doc: dict) -> None:
        self.replace_data("generation/manifest.json", json.dumps(doc).encode())

    def write(self, path: Path) -> Path:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for info, data in self.members:
                tar.addfile(info, io.BytesIO(data) if data is not None else None)
        path.write_bytes(zstandard.ZstdCompressor().compress(buffer.getvalue()))
        return path


def _read(path: Path) -> Archive:
    raw = zstandard.ZstdDecompressor().stream_reader(path.read_bytes())
    members = []
    with tarfile.open(fileobj=io.BytesIO(raw.read()), mode="r") as tar:
        for info in tar.getmembers():
            data = tar.extractfile(info).read() if info.isreg() else None
            members.append((info, data))
    return Archive(members)


def _info(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o444, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname, info.mtime = kind, mode, linkname, 1_700_000_000
    return info


def _file(name: str, mode: int = 0o444) -> tarfile.TarInfo:
    return _info(name, tarfile.REGTYPE, mode)


def _symlink(name: str, target: str) -> tarfile.TarInfo:
    return _info(name, tarfile.SYMTYPE, 0o777, target)


def _hardlink(name: str, target: str) -> tarfile.TarInfo:
    return _info(name, tarfile.LNKTYPE, 0o444, target)


def _dir(name: str, mode: int = 0o755) -> tarfile.TarInfo:
    return _info(name, tarfile.DIRTYPE, mode)


# ------------------------------------------------------------------------------------------------ cases
# Each case bends the archive (it may use the sentinel's path) and names what the refusal must mention.

Case = tuple[str, Callable[[Archive, Path], None], str]


def _set_mode(name: str, mode: int):
    def bend(a: Archive, _s: Path) -> None:
        a.members[a.index(name)][0].mode = mode

    return bend


def _lie_about(name: str):
    """The manifest claims other bytes than the archive holds for `name`."""

    def bend(a: Archive, _s: Path) -> None:
        doc = a.manifest()
        rel = name.removeprefix("generation/")
        for row in doc["files"]:
            if row[0] == rel:
                row[4] = hashlib.sha256(b"what the manifest claims").hexdigest()
        a.set_manifest(doc)

    return bend


def _pre_parent(a: Archive, s: Path) -> None:
    a.add(_file("generation/env/newdir/f"), b"x", after="generation/env")
    a.add(_dir("generation/env/newdir"))


def _nothing_manifest(a: Archive, s: Path) -> None:
    doc = a.manifest()
    doc["files"] = [r for r in doc["files"] if r[0] != "env/pyvenv.cfg"]
    a.set_manifest(doc)


CASES: list[Case] = [
    ("absolute-name", lambda a, s: a.add(_file(str(s / "pwned")), b"x"), "outside `generation/`"),
    ("dotdot-name", lambda a, s: a.add(_file("generation/../pwned"), b"x"), "`..` component"),
    ("deep-dotdot", lambda a, s: a.add(_file("generation/env/../../../pwned"), b"x"), "`..` component"),
    ("dot-component", lambda a, s: a.add(_file("generation/./env/x"), b"x"), "`.` or `..` component"),
    ("outside-top", lambda a, s: a.add(_file("other/pwned"), b"x"), "outside `generation/`"),
    ("empty-component", lambda a, s: a.add(_file("generation//env/x"), b"x"), "empty"),
    ("backslash-name", lambda a, s: a.add(_file("generation/env/..\\..\\x"), b"x"), "not a plain path"),
    ("very-long-name", lambda a, s: a.add(_file("generation/env/" + "a" * 5000), b"x"), "not a plain path"),
    (
        "file-through-symlink-dir",
        lambda a, s: (a.add(_symlink("generation/env/evil", str(s))), a.add(_file("generation/env/evil/pwned"), b"x")),
        "not a directory",
    ),
    (
        "file-through-relative-symlink",
        lambda a, s: (
            a.add(_symlink("generation/env/up", "../../../..")),
            a.add(_file("generation/env/up/pwned"), b"x"),
        ),
        "points outside the generation",
    ),
    ("symlink-escaping-relative", lambda a, s: a.add(_symlink("generation/env/x", "../../../etc")), "points outside"),
    ("hardlink-absolute", lambda a, s: a.add(_hardlink("generation/env/h", str(s / "f"))), "is not to a file"),
    ("hardlink-dotdot", lambda a, s: a.add(_hardlink("generation/env/h", "generation/../f")), "`..` component"),
    (
        "hardlink-to-symlink",
        lambda a, s: (
            a.add(_symlink("generation/env/l", str(s / "f"))),
            a.add(_hardlink("generation/env/h", "generation/env/l")),
        ),
        "is not to a file",
    ),
    (
        "hardlink-forward",
        lambda a, s: a.add(_hardlink("generation/env/h", "generation/env/later"), after="generation/env"),
        "is not to a file",
    ),
    (
        "hardlink-to-record",
        lambda a, s: a.add(_hardlink("generation/env/h", "generation/record.json")),
        "is not to a file",
    ),
    ("hardlink-to-dir", lambda a, s: a.add(_hardlink("generation/env/h", "generation/env/bin")), "is not to a file"),
    ("char-device", lambda a, s: a.add(_info("generation/env/tty", tarfile.CHRTYPE, 0o444)), "device"),
    ("block-device", lambda a, s: a.add(_info("generation/env/sda", tarfile.BLKTYPE, 0o444)), "device"),
    ("fifo", lambda a, s: a.add(_info("generation/env/pipe", tarfile.FIFOTYPE, 0o444)), "FIFO"),
    ("setuid-file", lambda a, s: a.add(_file("generation/env/bin/su", 0o4555), b"x"), "setuid"),
    ("setgid-file", lambda a, s: a.add(_file("generation/env/bin/sg", 0o2555), b"x"), "setuid, setgid"),
    ("sticky-dir", lambda a, s: a.add(_dir("generation/env/tmp", 0o1755)), "sticky"),
    ("world-writable-file", lambda a, s: a.add(_file("generation/env/w", 0o446), b"x"), "writable by group or others"),
    ("group-writable-dir", _set_mode("generation/env/bin", 0o775), "writable by group or others"),
    ("duplicate-name", lambda a, s: a.add(_file(ENV_FILE), b"home = /tmp\n"), "appears twice"),
    ("dir-clashing-with-file", lambda a, s: a.add(_dir(ENV_FILE)), "appears twice"),
    ("member-under-file", lambda a, s: a.add(_file(ENV_FILE + "/x"), b"x"), "not a directory"),
    ("member-before-its-dir", _pre_parent, "comes before its directory"),
    ("cuda-relative", lambda a, s: _replace(a, _symlink("generation/cuda", "../../x")), "absolute toolkit path"),
    ("cuda-regular-file", lambda a, s: _replace(a, _file("generation/cuda"), b"x"), "not what a generation holds"),
    (
        "record-symlink",
        lambda a, s: _replace(a, _symlink("generation/record.json", "/etc/passwd")),
        "not what a generation holds",
    ),
    ("manifest-directory", lambda a, s: _replace(a, _dir("generation/manifest.json")), "not what a generation holds"),
    (
        "extra-top-level",
        lambda a, s: a.add(_file("generation/evil.sh", 0o555), b"#!/bin/sh\n"),
        "not part of a generation",
    ),
    ("lying-manifest-content", _lie_about(ENV_FILE), "do not match the archived manifest"),
    ("file-missing-from-manifest", _nothing_manifest, "not in its manifest"),
    ("record-not-json", lambda a, s: a.replace_data("generation/record.json", b"{not json"), "not valid JSON"),
    ("manifest-not-json", lambda a, s: a.replace_data("generation/manifest.json", b"[1, 2"), "not valid JSON"),
    (
        "manifest-legacy-format",
        lambda a, s: a.set_manifest({**a.manifest(), "format": 1}),
        "format 1 manifest",
    ),
    ("no-manifest", lambda a, s: a.members.pop(a.index("generation/manifest.json")), "has no generation/manifest.json"),
]


def _replace(a: Archive, info: tarfile.TarInfo, data: bytes | None = None) -> None:
    position = a.index(info.name)
    if data is not None:
        info.size = len(data)
    a.members[position] = (info, data)


# ------------------------------------------------------------------------------------------------ fixtures


def _tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        digest.update(f"{path.relative_to(root)}|{stat.S_IFMT(st.st_mode)}|{st.st_mode:o}".encode())
        if path.is_file() and not path.is_symlink():
            digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One store with an active fixture generation, a real archive of it, and a sentinel tree outside."""
    tmp = tmp_path_factory.mktemp("hostile")
    lock, wheelhouse = fakestack.make_stack(tmp)
    env = {
        "BWSTACK_ROOT": str(tmp / "root"),
        "BWSTACK_ML_ENV": str(tmp / "ml-env"),
        "BWSTACK_CUDA_LINK": str(tmp / "cuda-link"),
        "BWSTACK_CACHE": str(tmp / "root" / "cache"),
    }
    run = lambda *a, **k: bwstack("--lock", str(lock), *a, env=env, **k)  # noqa: E731
    run("build", "--profile", "fixture-old", "--wheelhouse", str(wheelhouse), check=True)
    base = tmp / "base.tar.zst"
    run("backup", "--archive", str(base), check=True)
    sentinel = tmp / "sentinel"
    (sentinel / "d").mkdir(parents=True)
    (sentinel / "f").write_text("sentinel\n")
    return {
        "tmp": tmp, "run": run, "base": base, "sentinel": sentinel, "env": env, "lock": lock, "wheelhouse": wheelhouse,
    }  # fmt: skip


def _active(world) -> str:
    return os.readlink(Path(world["env"]["BWSTACK_ROOT"]) / "current")


def _runs(world) -> str:
    python = Path(world["env"]["BWSTACK_ML_ENV"]) / "bin" / "python"
    out = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return out.stdout.strip()


@pytest.mark.parametrize(("case", "bend", "expected"), CASES, ids=[c[0] for c in CASES])
def test_a_hostile_archive_is_refused_in_one_line_and_writes_nothing_outside_the_store(world, case, bend, expected):
    before = (_tree_digest(world["sentinel"]), _active(world), _runs(world))
    archive = copy.deepcopy(_read(world["base"]))
    bend(archive, world["sentinel"])
    path = archive.write(world["tmp"] / f"{case}.tar.zst")
    result = world["run"]("restore", str(path), *vouched(path))  # vouched for: what follows must refuse it anyway
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, lines
    assert expected in lines[0], lines[0]
    assert (_tree_digest(world["sentinel"]), _active(world), _runs(world)) == before
    generations = Path(world["env"]["BWSTACK_ROOT"]) / "generations"
    assert not [p for p in generations.iterdir() if p.name.startswith(".")], "a half generation was left behind"


def test_the_hostile_archive_suite_covers_at_least_thirty_archives():
    assert len(CASES) >= 30


def test_a_truncated_archive_is_refused_in_one_line(world):
    data = world["base"].read_bytes()
    path = world["tmp"] / "truncated.tar.zst"
    path.write_bytes(data[: len(data) // 3])
    result = world["run"]("restore", str(path), *vouched(path))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "not a readable bwstack archive" in result.stderr


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev-zero", "proc-file"])
def test_an_archive_path_that_is_not_a_regular_file_is_refused_without_blocking(world, kind):
    path = {
        "fifo": world["tmp"] / "pipe",
        "directory": world["tmp"],
        "dev-zero": Path("/dev/zero"),
        "proc-file": Path("/proc/self/status"),  # claims to be regular; /proc/kmsg would be read away
    }[kind]
    if kind == "fifo" and not path.exists():
        os.mkfifo(path)
    result = world["run"]("restore", str(path), timeout=30)
    assert result.returncode == 2 and "not a regular file" in result.stderr


def test_restored_files_belong_to_the_store_owner_whatever_the_archive_says(world):
    archive = _read(world["base"])
    for info, _ in archive.members:
        info.uid, info.gid, info.uname, info.gname = 4242, 4242, "mallory", "mallory"
    path = archive.write(world["tmp"] / "owned.tar.zst")
    store = Store(Layout.default(world["env"]["BWSTACK_ROOT"], world["env"]["BWSTACK_ML_ENV"], "none"))
    before = {g.name for g in store.generations()}
    # into a store of its own: in the world's store the same content already exists (a no-op)
    other_root = world["tmp"] / "owner-root"
    env = {**world["env"], "BWSTACK_ROOT": str(other_root), "BWSTACK_ML_ENV": str(world["tmp"] / "owner-env")}
    result = bwstack(
        "restore", str(path), *vouched(path), "--no-switch", "--json", env={**env, "BWSTACK_CUDA_LINK": "none"}
    )
    assert result.returncode == 0, result.stderr
    restored = Path(other_root, "generations", json.loads(result.stdout)["generation"])
    owners = {(p.lstat().st_uid, p.lstat().st_gid) for p in restored.rglob("*")}
    assert owners == {(os.geteuid(), os.getegid())}
    assert {g.name for g in store.generations()} == before


def test_restoring_a_generation_already_in_the_store_changes_nothing_and_names_it(world):
    result = world["run"]("restore", str(world["base"]), "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["changed"] is False and payload["generation"] == Path(_active(world)).name


def test_the_verification_state_is_computed_on_restore_never_copied(world):
    archive = _read(world["base"])
    record = json.loads(archive.data("generation/record.json"))
    record["torch"] = {"version": "9.9.9", "cuda": "99.9"}  # a lie the archive's record tells
    record["verification"] = {"status": "passed", "at": "2026-01-01T00:00:00Z"}
    archive.replace_data("generation/record.json", json.dumps(record).encode())
    env = {**world["env"], "BWSTACK_ROOT": str(world["tmp"] / "verif-root"), "BWSTACK_CUDA_LINK": "none"}
    env["BWSTACK_ML_ENV"] = str(world["tmp"] / "verif-env")
    path = archive.write(world["tmp"] / "lying-record.tar.zst")
    result = bwstack("restore", str(path), *vouched(path), "--no-switch", "--json", env=env)
    assert result.returncode == 0, result.stderr
    verification = json.loads(result.stdout)["verification"]
    assert verification["status"] == "failed"
    assert "torch 2.9.1" in json.dumps(verification["checks"])


# ------------------------------------------------------------------------------------------------ vouching


def _elsewhere(world, name: str) -> dict:
    """Another node's store: it did not write the world's archives."""
    return {
        **world["env"],
        "BWSTACK_ROOT": str(world["tmp"] / f"{name}-root"),
        "BWSTACK_ML_ENV": str(world["tmp"] / f"{name}-env"),
        "BWSTACK_CUDA_LINK": "none",
    }


def test_an_archive_nothing_vouches_for_is_refused_before_anything_of_it_runs(world):
    """Restoring starts the archived interpreter and imports its torch as root: a .pth in it would run. The
    .sha256 beside it vouches for nothing, as whoever could change the archive could change that too."""
    env = _elsewhere(world, "unvouched")
    result = bwstack("restore", str(world["base"]), "--no-switch", env=env)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "nothing vouches for this archive" in result.stderr and "--sha256" in result.stderr
    generations = Path(env["BWSTACK_ROOT"]) / "generations"
    assert not generations.exists() or list(generations.iterdir()) == []


def test_a_sha256_given_that_is_not_the_archives_is_refused_in_one_line(world):
    env = _elsewhere(world, "mismatch")
    result = bwstack("restore", str(world["base"]), "--sha256", "0" * 64, "--no-switch", env=env)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "not the " + "0" * 64 in result.stderr


def test_an_archive_this_store_wrote_is_restored_without_being_told_its_hash(world):
    """The store keeps the sha256 of every archive it writes (archives.jsonl): a node restoring its own backup
    after the generation was removed needs nothing more."""
    env = _elsewhere(world, "own")
    own = lambda *a, **k: bwstack("--lock", str(world["lock"]), *a, env=env, **k)  # noqa: E731
    own("build", "--profile", "fixture-old", "--wheelhouse", str(world["wheelhouse"]), check=True)
    archive = world["tmp"] / "own.tar.zst"
    own("backup", "--archive", str(archive), check=True)
    own("build", "--profile", "fixture-new", "--wheelhouse", str(world["wheelhouse"]), check=True)
    assert json.loads(own("prune", "--keep", "1", "--json", check=True).stdout)["removed"]
    result = own("restore", str(archive), "--no-switch", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["changed"] is True


def test_bytes_other_than_the_vouched_ones_are_refused_however_the_file_came_to_hold_them(world, tmp_path):
    """Both passes hash what they read: an archive rewritten in place on a share after it was hashed (a race an
    attacker's read won on the first pass, switching a node to an older generation) is refused before anything
    of it is acted on."""
    (tmp_path / "other").mkdir()
    (tmp_path / "vouched").mkdir()
    fd = os.open(world["base"], os.O_RDONLY)
    try:
        with pytest.raises(IntegrityError, match="changed while it was being restored"):
            archive_module._scan(fd, "0" * 64)  # the first pass: it decides the record kept and where to switch
        scan = archive_module._scan(fd, hashlib.sha256(world["base"].read_bytes()).hexdigest())
        with pytest.raises(IntegrityError, match="changed while it was being restored"):
            archive_module._extract(fd, scan, tmp_path / "other", "0" * 64)
        digest = hashlib.sha256(world["base"].read_bytes()).hexdigest()
        archive_module._extract(fd, scan, tmp_path / "vouched", digest)  # the same pass, the vouched bytes: fine
    finally:
        os.close(fd)


def test_a_sidecar_that_disagrees_with_a_matching_sha256_is_a_warning_and_never_shown(world):
    """A run stopped between writing the archive and its sidecar, or a sidecar that is a link to another file:
    the --sha256 the operator gives outranks it, and what the sidecar holds is not printed."""
    secret = world["tmp"] / "secret"
    secret.write_text("root:secret-hash\n")
    path = world["tmp"] / "sidecar-link.tar.zst"
    path.write_bytes(world["base"].read_bytes())
    Path(f"{path}.sha256").symlink_to(secret)
    env = _elsewhere(world, "sidecar")
    result = bwstack("restore", str(path), *vouched(path), "--no-switch", "--json", env=env)
    assert result.returncode == 0, result.stderr
    assert "secret" not in result.stderr + result.stdout and "cannot be read" in result.stderr
    Path(f"{path}.sha256").unlink()
    Path(f"{path}.sha256").write_text("f" * 64 + "  sidecar-link.tar.zst\n")
    other = _elsewhere(world, "sidecar-stale")
    result = bwstack("restore", str(path), *vouched(path), "--no-switch", "--json", env=other)
    assert result.returncode == 0 and "what vouches for the archive does" in result.stderr, result.stderr


def test_an_archive_path_that_is_a_directory_is_refused_in_one_line(world, tmp_path):
    result = world["run"]("backup", "--archive", str(tmp_path))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "a directory" in result.stderr and list(tmp_path.iterdir()) == []


def test_an_archive_this_store_wrote_is_restored_past_a_stale_sidecar(world):
    """Anyone who can write the share could put a wrong .sha256 beside an archive: what vouches for it wins."""
    path = world["tmp"] / "stale-sidecar.tar.zst"
    path.write_bytes(world["base"].read_bytes())
    Path(f"{path}.sha256").write_text("f" * 64 + "  stale-sidecar.tar.zst\n")
    result = world["run"]("restore", str(path), "--json")  # the world's store wrote these bytes (base)
    assert result.returncode == 0 and "what vouches for the archive does" in result.stderr, result.stderr


def test_an_archive_path_whose_folder_does_not_exist_is_refused_in_one_line(world, tmp_path):
    result = world["run"]("backup", "--archive", str(tmp_path / "no-such-folder" / "gen.tar.zst"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "cannot be written there" in result.stderr


@pytest.mark.parametrize("where", [".", "generations", "cache"])
def test_an_archive_path_inside_the_store_is_refused_in_one_line(world, where):
    """The store's root holds only its own files (a store root holding others is refused), and an archive is the
    copy meant to outlive the store."""
    folder = world["tmp"] / "root" / where
    before = sorted(p.name for p in folder.iterdir())
    result = world["run"]("backup", "--archive", str(folder / "gen.tar.zst"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "inside the store" in result.stderr and sorted(p.name for p in folder.iterdir()) == before


@pytest.mark.parametrize("where", [".", "generations"])
def test_an_archive_path_inside_another_store_is_refused_in_one_line(world, tmp_path, where):
    """Another store's prune removes what it does not know: the archive written there would be lost."""
    from bwstack.store.layout import Layout
    from bwstack.store.session import open_store

    other = tmp_path / "other-store"
    with open_store(Layout(other, tmp_path / "other-env", None, None), lambda _line: None):
        pass
    folder = other / where
    before = sorted(p.name for p in folder.iterdir())
    result = world["run"]("backup", "--archive", str(folder / "gen.tar.zst"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"inside the store {other}" in result.stderr and sorted(p.name for p in folder.iterdir()) == before


def test_a_hostile_archive_without_a_sidecar_is_refused_in_exactly_one_line(world):
    """No .sha256 beside it and the operator's --sha256 given: the refusal is the only line."""
    archive = copy.deepcopy(_read(world["base"]))
    info, _ = archive.members[-1]
    info.name = "../evil"
    path = archive.write(world["tmp"] / "no-sidecar.tar.zst")
    assert not Path(f"{path}.sha256").exists()
    result = world["run"]("restore", str(path), *vouched(path))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "is outside `generation/`" in result.stderr
