"""Manifests and the shared hash cache: a recycled inode never inherits another file's hash."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bwstack.probe.treecheck import sha256_file, valid_row
from bwstack.store import manifest


def _entries(root):
    return manifest.build(root)


def test_a_hash_is_reused_while_its_anchor_still_holds_the_inode(tmp_path):
    env = tmp_path / "gen" / "env"
    env.mkdir(parents=True)
    (env / "a.py").write_text("A = 1\n")
    os.link(env / "a.py", tmp_path / "uv-cache-copy")  # shared with uv's cache, as installs are
    cache = manifest.HashCache(tmp_path / "hashes.json")
    cache.add(env, _entries(env))
    st = (env / "a.py").stat()
    known = cache.load(st.st_dev)
    assert known[(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)] == sha256_file(env / "a.py")


def test_an_entry_whose_anchor_is_gone_is_not_trusted_even_if_the_inode_number_comes_back(tmp_path):
    env = tmp_path / "gen" / "env"
    env.mkdir(parents=True)
    (env / "a.py").write_text("A = 1\n")
    os.link(env / "a.py", tmp_path / "other-link")
    cache = manifest.HashCache(tmp_path / "hashes.json")
    cache.add(env, _entries(env))
    old = (env / "a.py").stat()
    (env / "a.py").unlink()
    (tmp_path / "other-link").unlink()
    new = tmp_path / "new.py"
    new.write_text("B = 2\n")  # same size; the filesystem may hand out the freed inode again
    os.utime(new, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert cache.load(old.st_dev) == {}


def test_quick_verify_sees_a_normal_write_and_full_verify_sees_a_sneaky_one(tmp_path):
    root = tmp_path / "env"
    root.mkdir()
    (root / "f.py").write_text("X = 1\n")
    entries = manifest.build(root)
    st = (root / "f.py").stat()
    (root / "f.py").write_text("X = 2\n")
    assert [p.path for p in manifest.verify(root, entries, "quick")] == ["f.py"]
    os.utime(root / "f.py", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert [p.path for p in manifest.verify(root, entries, "full")] == ["f.py"]


def test_bytecode_is_part_of_a_manifest_and_bytecode_added_later_is_reported(tmp_path):
    root = tmp_path / "env"
    (root / "__pycache__").mkdir(parents=True)
    (root / "__pycache__" / "m.cpython-312.pyc").write_bytes(b"\0")
    (root / "m.py").write_text("")
    entries = manifest.build(root)
    assert [e.path for e in entries] == [".", "__pycache__", "m.py", "__pycache__/m.cpython-312.pyc"]
    (root / "__pycache__" / "n.cpython-312.pyc").write_bytes(b"\0")
    problems = manifest.verify(root, entries, "quick")
    assert [(p.path, "not in the manifest" in p.what) for p in problems] == [("__pycache__/n.cpython-312.pyc", True)]


GOOD_ROW = ["env/x", "f", 1, 0o644, "ab" * 32, 7, 1_700_000_000_000_000_000, 0, 0]


@pytest.mark.parametrize(
    ("row", "valid"),
    [
        (GOOD_ROW, True),
        (GOOD_ROW[:7], True),  # a legacy (format 1) row: no owners
        ([*GOOD_ROW[:7], None, None], True),
        (["env/x", "l", 5, 0o777, "../y", 7, 0, 0, 0], True),
        ([*GOOD_ROW, 0], False),
        (GOOD_ROW[:6], False),
        (tuple(GOOD_ROW), False),
        (["", *GOOD_ROW[1:]], False),
        (["env/\0x", *GOOD_ROW[1:]], False),
        ([7, *GOOD_ROW[1:]], False),
        (["env/x", "?", *GOOD_ROW[2:]], False),
        (["env/x", ["f"], *GOOD_ROW[2:]], False),
        (["env/x", "f", True, *GOOD_ROW[3:]], False),
        (["env/x", "f", 1.0, *GOOD_ROW[3:]], False),
        (["env/x", "f", -1, *GOOD_ROW[3:]], False),
        (["env/x", "f", 1, None, *GOOD_ROW[4:]], False),
        ([*GOOD_ROW[:4], None, *GOOD_ROW[5:]], False),
        ([*GOOD_ROW[:5], "7", *GOOD_ROW[6:]], False),
        ([*GOOD_ROW[:7], -1, 0], False),
        ([*GOOD_ROW[:7], False, 0], False),
        ([*GOOD_ROW[:7], 0, "0"], False),
    ],
    ids=[
        "a-file", "legacy", "legacy-owners-null", "a-link", "ten-fields", "six-fields", "a-tuple", "path-empty",
        "path-with-nul", "path-not-a-string", "kind-special", "kind-a-list", "size-a-bool", "size-a-float",
        "size-negative", "mode-null", "hash-null", "inode-a-string", "owner-negative", "owner-a-bool",
        "group-a-string",
    ],
)  # fmt: skip
def test_a_manifest_row_is_read_only_in_the_shape_the_store_writes(row, valid):
    assert valid_row(row) is valid


def _env_with_modules(base: Path) -> Path:
    """A venv of this interpreter holding a package with a test suite at two depths."""
    import venv

    from bwstack.probe import envinspect

    env = base / "env"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env)
    site = envinspect.site_packages(env)
    for rel in ("pkg/__init__.py", "pkg/mod.py", "pkg/tests/test_mod.py", "pkg/sub/tests/helper.py",
                "pkg/testsuite/mod.py"):  # fmt: skip
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("x = 1\n")
    return env


def _with_bytecode(env: Path) -> list[str]:
    from bwstack.probe import envinspect

    site = envinspect.site_packages(env)
    return sorted(str(p.parent.parent.relative_to(site) / p.name.split(".")[0]) for p in site.rglob("pkg/**/*.pyc"))


def test_an_envs_modules_get_bytecode_before_sealing_and_package_test_suites_do_not(tmp_path):
    """A serving process never imports a package's `tests`: compiling them was a seventh of the bytecode phase."""
    from bwstack.provision import envbuild

    env = _env_with_modules(tmp_path)
    envbuild.compile_bytecode(env)
    assert _with_bytecode(env) == ["pkg/__init__", "pkg/mod", "pkg/testsuite/mod"]


def test_an_env_kept_under_a_folder_named_tests_still_gets_its_bytecode(tmp_path):
    """Only folders below site-packages count: a store's own path may hold the name."""
    from bwstack.provision import envbuild

    env = _env_with_modules(tmp_path / "tests" / "store")
    envbuild.compile_bytecode(env)
    assert _with_bytecode(env) == ["pkg/__init__", "pkg/mod", "pkg/testsuite/mod"]


def _seal_with_early_hash(tmp_path: Path, change, monkeypatch=None) -> tuple[dict[str, str], list[str]]:
    """A generation hashed early as the build does it (its files sealed, the moment read from the filesystem's
    clock, every file hashed), changed by `change`, then sealed: its manifest's hashes by path, and the files the
    seal itself hashed."""
    from bwstack.provision.build import _filesystem_now
    from bwstack.store.generations import Store
    from bwstack.store.layout import Layout
    from bwstack.store.tree import seal

    layout = Layout(tmp_path / "root", tmp_path / "ml-env", None, None)
    layout.generations.mkdir(parents=True)
    store = Store(layout, log=lambda *_: None)
    building = store.begin("0000-early-hash")
    env = building / "env"
    env.mkdir()
    (env / "kept.py").write_text("a = 1\n")
    (env / "rewritten.py").write_text("b = 1\n")
    seal(env, folders=False)
    # The filesystem stamps inodes from a coarse tick: a file sealed in the tick the moment is read from counts as
    # changed after it (hashed again, which costs only time). Here the moment waits for the next tick.
    sealed_at = max(p.lstat().st_ctime_ns for p in env.iterdir())
    until, deadline = _filesystem_now(building), time.monotonic() + 5
    while until < sealed_at and time.monotonic() < deadline:
        time.sleep(0.001)
        until = _filesystem_now(building)
    hashed = manifest.known_hashes(manifest.build(building), os.stat(building).st_dev)
    change(env)
    seen: list[str] = []
    if monkeypatch is not None:
        monkeypatch.setattr(manifest, "sha256_file", lambda path: seen.append(Path(path).name) or sha256_file(path))
    entries = store.seal_and_hash(building, hashed=hashed, hashed_until=until)
    return {e.path: e.sha256 for e in entries if e.kind == "f"}, seen


def _on_disk(tmp_path: Path, name: str) -> Path:
    return tmp_path / "root/generations/.building-0000-early-hash/env" / name


def test_the_seal_hashes_again_only_what_changed_since_the_builds_early_hash(tmp_path, monkeypatch):
    sealed, seen = _seal_with_early_hash(tmp_path, lambda env: (env / "added.pyc").write_bytes(b"\0" * 16), monkeypatch)
    assert seen == ["added.pyc"]
    assert sealed["env/kept.py"] == sha256_file(_on_disk(tmp_path, "kept.py"))
    assert sealed["env/added.pyc"] == sha256_file(_on_disk(tmp_path, "added.pyc"))


def test_the_seal_hashes_again_a_file_rewritten_in_place_after_the_early_hash_with_its_mtime_put_back(tmp_path):
    def rewrite(env: Path) -> None:
        victim = env / "rewritten.py"
        before = victim.stat()
        victim.chmod(0o644)
        victim.write_text("b = 2\n")  # same size, same inode
        victim.chmod(0o444)
        os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))

    sealed, _ = _seal_with_early_hash(tmp_path, rewrite)
    assert _on_disk(tmp_path, "rewritten.py").read_text() == "b = 2\n"
    assert sealed["env/rewritten.py"] == sha256_file(_on_disk(tmp_path, "rewritten.py"))


def test_the_early_hash_of_a_file_removed_since_is_not_lent_to_a_new_file(tmp_path):
    def replace(env: Path) -> None:
        victim = env / "rewritten.py"
        before = victim.stat()
        victim.unlink()
        victim.write_text("b = 3\n")  # may get the freed inode back; its mtime set as before
        os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))

    sealed, _ = _seal_with_early_hash(tmp_path, replace)
    assert sealed["env/rewritten.py"] == sha256_file(_on_disk(tmp_path, "rewritten.py"))
