"""Manifests and the shared hash cache: a recycled inode never inherits another file's hash."""

from __future__ import annotations

import os

from bwstack.probe.treecheck import sha256_file
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
