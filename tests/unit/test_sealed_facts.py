"""A sealed generation's recorded facts: written at build time under its manifest, reused by verify while the
generation and the host are unchanged, and read from the files again (cold) once anything under it changed."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
from helpers import needs_py312

from bwstack.probe import main as probe
from bwstack.probe import sealed, treecheck
from bwstack.probe.treecheck import sha256_file
from bwstack.store import manifest
from bwstack.store.generations import Store
from bwstack.store.layout import Layout

CAPABILITY = "12.0"  # the fixture target's


def _generation(stack) -> Path:
    return Store(Layout(stack.root, stack.ml_env, stack.cuda_link, None)).active().path


@pytest.fixture
def built(stack):
    stack.build("fixture-new", check=True)
    return stack


def _torch_version_py(gen: Path) -> Path:
    return next((gen / "env").glob("lib/python3.*/site-packages/torch/version.py"))


def _writable(path: Path) -> None:
    os.chmod(path, 0o644)


def _append(gen: Path) -> str:
    path = _torch_version_py(gen)
    _writable(path)
    with open(path, "a") as handle:
        handle.write("__version__ = '9.9.9'\n")
    return "9.9.9"


def _replace(gen: Path) -> str:
    """A new inode with different bytes (what an installer does), mode, mtime and size put back as they were."""
    path = _torch_version_py(gen)
    st = os.lstat(path)
    text = path.read_text().replace("2.9.1", "2.9.7")
    os.unlink(path)
    path.write_text(text)
    os.chmod(path, stat.S_IMODE(st.st_mode))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return "2.9.7+cu130"


def _add_file(gen: Path) -> None:
    site = _torch_version_py(gen).parents[1]
    os.chmod(site, 0o755)
    (site / "dropped.pth").write_text("import os\n")


def _chmod(gen: Path) -> None:
    os.chmod(_torch_version_py(gen), 0o666)


@needs_py312
def test_a_built_generation_records_its_static_facts_under_its_manifest(built):
    gen = _generation(built)
    facts = gen / sealed.FACTS_NAME
    assert facts.is_file() and not os.stat(facts).st_mode & 0o222, "facts.json is sealed read-only"
    rows = manifest.read(gen / manifest.MANIFEST_NAME).by_path()
    assert sealed.FACTS_NAME in rows and rows[sealed.FACTS_NAME].sha256 == sha256_file(facts)
    doc = json.loads(facts.read_text())
    assert doc["capability"] == CAPABILITY and set(doc["facts"]) == set(sealed.STATIC_KEYS)
    static, why = sealed.load_static(built.ml_env, CAPABILITY)
    assert static is not None, why
    assert "unchanged since it was sealed" in why
    assert static["torch_version_py"]["version"] == "2.9.1+cu130"
    # Paths recorded while the generation was being built are moved to the env being checked.
    assert ".building-" not in json.dumps(static)


@needs_py312
def test_an_unchanged_generation_is_verified_from_its_recorded_facts(built):
    facts = probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False)
    assert facts["facts_source"]["static"] == "recorded", facts["facts_source"]
    assert facts["env"]["torch_version_py"]["version"] == "2.9.1+cu130"
    cold = probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False, cached=False)
    assert cold["facts_source"]["static"] == "read"
    for key in ("elf", "fatbin", "features"):
        assert json.loads(json.dumps(cold[key])) == facts[key], f"recorded {key} differ from the files'"


@needs_py312
@pytest.mark.parametrize(
    ("tamper", "why"),
    [
        (_append, "changed since it was sealed"),
        (_replace, "changed since it was sealed"),
        (_add_file, "changed since it was sealed"),
        (_chmod, "changed since it was sealed"),
    ],
    ids=["bytes-appended", "file-replaced-same-mtime", "file-added", "mode-changed"],
)
def test_a_generation_changed_after_sealing_is_read_from_its_files(built, tamper, why):
    gen = _generation(built)
    new_version = tamper(gen)
    static, reason = sealed.load_static(built.ml_env, CAPABILITY)
    assert static is None and why in reason, reason
    assert sealed.unchanged_generation(built.ml_env) is not None
    facts = probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False)
    assert facts["facts_source"]["static"] == "read"
    assert why in facts["facts_source"]["why"]
    if new_version:  # the fallback read the changed file, not the record
        assert facts["env"]["torch_version_py"]["version"] == new_version


def _touch(gen: Path) -> None:
    """The bytes as sealed, the mtime moved (a `touch`, a reinstall that wrote the same file again)."""
    path = _torch_version_py(gen)
    st = os.lstat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


@needs_py312
def test_a_file_whose_mtime_moved_but_whose_bytes_are_as_sealed_keeps_the_recorded_facts(built):
    _touch(_generation(built))
    static, why = sealed.load_static(built.ml_env, CAPABILITY)
    assert static is not None, why
    assert sealed.unchanged_generation(built.ml_env) is None
    facts = probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False)
    assert facts["facts_source"]["static"] == "recorded", facts["facts_source"]


@needs_py312
def test_a_content_check_that_found_the_sealed_bytes_is_remembered_until_the_tree_moves_again(built, monkeypatch):
    gen = _generation(built)
    _touch(gen)
    assert sealed.unchanged_generation(built.ml_env) is None  # compared the bytes with the manifest once

    def compared_again(*args, **kwargs):
        raise AssertionError("the same tree was compared with its manifest again")

    monkeypatch.setattr(sealed.treecheck, "compared", compared_again)
    monkeypatch.setattr(sealed.treecheck, "compared_listing", compared_again)
    assert sealed.unchanged_generation(built.ml_env) is None
    _touch(gen)  # moved again: the remembered check no longer describes this tree
    with pytest.raises(AssertionError, match="compared with its manifest again"):
        sealed.unchanged_generation(built.ml_env)


def _rewrite_keeping_mtime(gen: Path) -> Path:
    """Other bytes written into the same inode, its size, mode and mtime put back: only the ctime moves (nobody
    can set it)."""
    path = _torch_version_py(gen)
    st = os.lstat(path)
    data = path.read_bytes()
    _writable(path)
    with open(path, "r+b") as handle:
        handle.write(data.replace(b"2.9.1", b"2.9.7"))
    os.chmod(path, stat.S_IMODE(st.st_mode))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.lstat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    return path


@needs_py312
def test_a_file_rewritten_in_place_with_its_mtime_put_back_is_found(built):
    """Its inode, size, mode and mtime are as sealed, so the tree stamp is too: the verify and the store's own
    check hash what changed after the generation's bytes were last compared."""
    gen = _generation(built)
    assert sealed.unchanged_generation(built.ml_env) is None
    path = _rewrite_keeping_mtime(gen)
    why = sealed.unchanged_generation(built.ml_env)
    assert why is not None and "torch/version.py: content changed" in why, why
    assert sealed.load_static(built.ml_env, CAPABILITY)[0] is None
    store = Store(Layout(built.root, built.ml_env, None, None))
    problems = store.get(gen.name).verify("quick")
    assert any(p.path.endswith("torch/version.py") and "content changed" in p.what for p in problems), problems
    assert path.read_bytes().count(b"2.9.7")


@needs_py312
def test_a_later_hard_link_to_a_sealed_file_is_compared_once_then_the_verify_is_quick_again(built, monkeypatch):
    """Another generation's build links the same files (uv's cache, the store's objects): their ctime moves, their
    bytes do not. The bytes are compared once, and that moment recorded."""
    gen = _generation(built)
    assert sealed.unchanged_generation(built.ml_env) is None
    os.link(_torch_version_py(gen), built.root / "a-later-link")  # the inode's ctime moves
    assert sealed.unchanged_generation(built.ml_env) is None  # the same bytes

    def compared_again(*args, **kwargs):
        raise AssertionError("the same tree was compared with its manifest again")

    monkeypatch.setattr(sealed.treecheck, "compared", compared_again)
    monkeypatch.setattr(sealed.treecheck, "compared_listing", compared_again)
    assert sealed.unchanged_generation(built.ml_env) is None


@needs_py312
def test_a_verify_that_compared_only_the_env_does_not_vouch_for_a_record_changed_beside_it(built):
    """The moment the bytes were last compared is the whole generation's: the store's check reads the record from
    it on. A record rewritten in place (mtime put back) and then any env ctime moved: the verify compares env/,
    and the store's check still finds the record."""
    gen = _generation(built)
    assert sealed.unchanged_generation(built.ml_env) is None
    record = gen / "record.json"
    st = os.lstat(record)
    data = record.read_bytes()
    _writable(record)
    at = data.index(b"sha256:", data.index(b'"lock_digest"')) + len(b"sha256:")
    other = b"0" if data[at : at + 1] != b"0" else b"1"  # another digest, the same size, still JSON
    with open(record, "r+b") as handle:
        handle.write(data[:at] + other + data[at + 1 :])
    os.chmod(record, stat.S_IMODE(st.st_mode))
    os.utime(record, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.link(_torch_version_py(gen), built.root / "a-later-link")
    sealed.unchanged_generation(built.ml_env)
    problems = Store(Layout(built.root, built.ml_env, None, None)).get(gen.name).verify("quick")
    assert any(p.path == "record.json" and "content changed" in p.what for p in problems), problems
    assert not sealed.record_as_sealed(gen)


@needs_py312
def test_a_record_of_when_the_bytes_were_compared_that_others_could_write_is_not_trusted(built):
    gen = _generation(built)
    assert sealed.unchanged_generation(built.ml_env) is None
    record = sealed._hashed_path(gen)
    record.write_text(f"{time.time_ns() + 10**15}\n")  # far ahead: would hide every later change
    os.chmod(record, 0o666)
    _rewrite_keeping_mtime(gen)
    assert "content changed" in (sealed.unchanged_generation(built.ml_env) or "")


@needs_py312
def test_the_reason_a_changed_generation_is_read_again_names_the_path_and_what_changed(built):
    _replace(_generation(built))  # same size and mtime, other bytes: only the hash tells
    static, why = sealed.load_static(built.ml_env, CAPABILITY)
    assert static is None
    assert "site-packages/torch/version.py: content changed" in why, why


def _retarget_link(gen: Path) -> None:
    link = next((gen / "env" / "bin").glob("python3*"))
    target = os.readlink(link)
    os.unlink(link)
    os.symlink(target + "-elsewhere", link)


def _remove(gen: Path) -> None:
    _torch_version_py(gen).unlink()


def _fifo(gen: Path) -> None:
    os.mkfifo(_torch_version_py(gen).with_name("dropped"))


def _chown(gen: Path) -> None:
    os.lchown(_torch_version_py(gen), 4242, 4242)


@needs_py312
@pytest.mark.parametrize(
    ("tamper", "what"),
    [
        (_retarget_link, "symlink now points to"),
        (_remove, "missing"),
        (_fifo, "not in the manifest"),
        (_chown, "owner 4242:4242"),
        (_replace, "content changed"),
    ],
    ids=["link-retargeted", "file-removed", "fifo-added", "owner-changed", "bytes-changed"],
)
def test_after_the_quick_digest_moved_every_kind_of_change_is_still_found(built, tamper, what):
    gen = _generation(built)
    _touch(gen)
    assert sealed.unchanged_generation(built.ml_env) is None  # the content check accepted the moved mtime
    tamper(gen)
    why = sealed.unchanged_generation(built.ml_env)
    assert why is not None and what in why, why


def _nothing(gen: Path) -> None:
    pass


@needs_py312
@pytest.mark.parametrize(
    "tamper",
    [_nothing, _touch, _append, _replace, _add_file, _chmod, _retarget_link, _remove, _fifo, _chown],
    ids=["unchanged", "touched", "bytes-appended", "file-replaced-same-mtime", "file-added", "mode-changed",
         "link-retargeted", "file-removed", "fifo-added", "owner-changed"],
)  # fmt: skip
def test_the_comparison_read_from_the_stamps_own_walk_finds_what_a_second_walk_finds(built, tamper):
    """verify compares a moved tree with its manifest from the listing the stamp's find walk printed, instead of
    walking it again with lstat: both must name the same paths for the same reasons."""
    gen = _generation(built)
    tamper(gen)
    env, rows, before = gen / "env", sealed._manifest_rows_under_env(gen), sealed.hashed_before(gen)
    listing = sealed.generation_stamp(env, keep=True).listing
    assert listing is not None
    from_listing = treecheck.compared_listing(env, rows, listing, changed_since=before)
    walked = treecheck.compared(env, rows, changed_since=before)
    assert from_listing == walked
    assert bool(walked.found) == (tamper not in (_nothing, _touch)), walked.found


def _spliced(listing: treecheck.Listing, earlier: treecheck.Listing, rel: str) -> treecheck.Listing:
    """`listing` with the entry of `rel` as `earlier` listed it: what one find walk prints when the file changed
    after the walk listed it."""
    outputs = [(o.records.split(b"\0"), o.changes.split(b"\n"), o.extras.split(b"\0")) for o in (listing, earlier)]
    name = os.fsencode(rel)
    (records, changes, extras), (old_records, old_changes, old_extras) = outputs
    i = next(n for n, r in enumerate(records) if r.split(b" ", 7)[-1] == name)
    j = next(n for n, r in enumerate(old_records) if r.split(b" ", 7)[-1] == name)
    records[i], changes[i], extras[i] = old_records[j], old_changes[j], old_extras[j]
    return treecheck.Listing(b"\0".join(records), b"\n".join(changes), b"\0".join(extras))


@needs_py312
def test_a_file_rewritten_in_place_while_the_stamps_walk_ran_is_still_hashed(built, monkeypatch):
    """The walk listed the file, then it was rewritten in place with its mtime put back, then a path listed later
    was touched: the walk's newest inode change time covers the rewrite, and its listing shows the file as sealed.
    That listing alone would find the tree whole and record it so: a second walk decides."""
    gen = _generation(built)
    env = gen / "env"
    first = sealed.generation_stamp(env, keep=True)
    rewritten = _rewrite_keeping_mtime(gen)
    later = next(p for p in sorted((env / "bin").iterdir()) if p.is_file() and not p.is_symlink())
    os.utime(later, ns=(os.lstat(later).st_atime_ns, os.lstat(later).st_mtime_ns))  # its ctime moves
    walked = sealed.generation_stamp(env, keep=True)
    assert first.listing is not None and walked.listing is not None
    spliced = _spliced(walked.listing, first.listing, str(rewritten.relative_to(env)))
    rows, before = sealed._manifest_rows_under_env(gen), sealed.hashed_before(gen)
    assert treecheck.compared_listing(env, rows, spliced, changed_since=before).found == []  # the danger
    real_walk, walks = sealed.generation_stamp, []

    def interleaved_then_real(*args, **kwargs):  # the first walk is the interleaved one, later walks are real
        walks.append(args)
        return dataclasses.replace(walked, listing=spliced) if len(walks) == 1 else real_walk(*args, **kwargs)

    monkeypatch.setattr(sealed, "generation_stamp", interleaved_then_real)
    why = sealed.unchanged_generation(built.ml_env)
    assert why is not None and "content changed" in why, why


@needs_py312
def test_a_comparison_never_records_a_moment_later_than_the_filesystems_now(built):
    """A newest inode change time that lies ahead (a clock stepped back since it was set) would vouch for changes
    not made yet."""
    gen = _generation(built)
    sealed.record_hashed(gen, time.time_ns() + 3600 * 10**9)
    assert sealed.hashed_before(gen) <= time.time_ns()


@pytest.mark.parametrize(
    "listing",
    [
        treecheck.Listing(b"f 1 2 3.0 644 0 0 a\0", b"", b""),
        treecheck.Listing(b"f 1 2 3.0 644 0 0\0", b"3.0\n", b"1 \0"),
        treecheck.Listing(b"f x 2 3.0 644 0 0 a\0", b"3.0\n", b"1 \0"),
        treecheck.Listing(b"f 1 2 3.0 644 0 0 a", b"3.0\n", b"1 \0"),
        treecheck.Listing(b"f 1 2 3.5 644 0 0 a\0", b"3.5000000000\n", b"1 \0"),
    ],
    ids=["outputs-of-other-lengths", "record-short-of-a-field", "not-a-number", "record-cut-off",
         "time-without-ten-decimals"],
)  # fmt: skip
def test_a_listing_that_does_not_parse_is_not_compared_the_tree_is_walked_instead(listing, tmp_path):
    assert treecheck.compared_listing(tmp_path, [], listing) is None


@needs_py312
def test_a_tree_whose_stamp_cannot_be_taken_is_compared_by_content_every_time(built, monkeypatch):
    """`find` failing (a path vanishing mid-walk, a filesystem it cannot read) gives no digest: nothing may be
    remembered under it, or a later change would be accepted unseen."""
    gen = _generation(built)
    monkeypatch.setattr(sealed, "tree_stamp", lambda env, method=None: ("find", sealed.UNREADABLE))
    assert sealed.unchanged_generation(built.ml_env) is None  # the bytes are the sealed ones
    _add_file(gen)
    why = sealed.unchanged_generation(built.ml_env)
    assert why is not None and "dropped.pth" in why, why


@needs_py312
@pytest.mark.parametrize(
    "row",
    [
        ["env/x", "f", 1, None, "", 0, 0, 0, 0],
        ["env/x", ["f"], 1, 420, "", 0, 0, 0, 0],
        ["env/x", "?", 1, 420, "", 0, 0, 0, 0],
        ["env/x", "f", -1, 420, "", 0, 0, 0, 0],
        "not a row",
    ],
    ids=["mode-null", "kind-a-list", "kind-special", "size-negative", "not-a-list"],
)
def test_a_malformed_manifest_row_makes_the_generation_changed_not_a_traceback(built, row):
    gen = _generation(built)
    _touch(gen)
    path = gen / manifest.MANIFEST_NAME
    doc = json.loads(path.read_text())
    doc["files"].append(row)
    os.chmod(path, 0o644)
    path.write_text(json.dumps(doc))
    why = sealed.unchanged_generation(built.ml_env)
    assert why is not None and "manifest" in why, why


@needs_py312
def test_recorded_facts_are_not_used_for_another_capability_or_when_the_host_changed(built, monkeypatch):
    static, why = sealed.load_static(built.ml_env, "9.0")
    assert static is None and "capability" in why
    sealed.host_fingerprint.cache_clear()
    monkeypatch.setenv("LD_LIBRARY_PATH", "/nonexistent-bwstack-test")
    try:
        static, why = sealed.load_static(built.ml_env, CAPABILITY)
        assert static is None and "host" in why
    finally:
        sealed.host_fingerprint.cache_clear()


@needs_py312
def test_after_the_host_changed_an_unchanged_generation_is_read_once_then_its_facts_are_reused(
    built, monkeypatch, tmp_path
):
    """facts.json is sealed with the host it was built on and cannot be rewritten: after an apt upgrade of any
    library (the library folders move), every verify read every file again (11 s against 1.2 s). The facts read
    again go to the store's verify cache, keyed by the host as it is now."""
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))  # the host as the probe sees it: changed
    sealed.host_fingerprint.cache_clear()
    try:
        first = probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False)
        assert first["facts_source"]["static"] == "read" and first["facts_source"]["why"] == sealed.HOST_CHANGED
        again = probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False)
        assert again["facts_source"]["static"] == "recorded", again["facts_source"]
        assert "read again on this host" in again["facts_source"]["why"]
        assert again["elf"] == first["elf"] and again["env"]["installed"] == first["env"]["installed"]
        _replace(_generation(built))  # and the generation changing still wins over anything remembered
        changed = probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False)
        assert changed["facts_source"]["static"] == "read" and "content changed" in changed["facts_source"]["why"]
    finally:
        sealed.host_fingerprint.cache_clear()


@needs_py312
def test_results_computed_by_another_version_of_the_probe_are_computed_again(built, monkeypatch):
    """A new bwstack with the same lock keeps the generation: a check fixed or widened since must run, not be
    answered by what the old probe found (its static facts, its import outcomes, its plans)."""
    first = probe.collect(built.ml_env, CAPABILITY, runtime=False)
    assert probe.collect(built.ml_env, CAPABILITY, runtime=False)["facts_source"].get("imports") == "recorded"
    monkeypatch.setattr(sealed, "probe_digest", lambda: "another probe")
    other = probe.collect(built.ml_env, CAPABILITY, runtime=False)
    assert other["facts_source"]["static"] == "read" and other["facts_source"]["why"] == sealed.PROBE_CHANGED
    assert "imports" not in other["facts_source"], other["facts_source"]
    again = probe.collect(built.ml_env, CAPABILITY, runtime=False)
    assert again["facts_source"]["static"] == "recorded" and "by this bwstack's probe" in again["facts_source"]["why"]
    assert again["facts_source"].get("imports") == "recorded" and again["elf"] == first["elf"]


@needs_py312
@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not found")
def test_an_import_outcome_is_not_reused_after_a_library_it_loaded_was_copied_over_in_place(
    built, monkeypatch, tmp_path
):
    """The host fingerprint covers the library folders, and `cp new.so /usr/lib/.../lib.so` over an existing
    library leaves its folder as it was (same inode, same names). Every file the imports loaded from outside the
    env is checked before their outcome is reused. The library here is built by this test and preloaded into the
    import checks' interpreters (LD_PRELOAD, which they inherit), standing in for a system library."""
    source = tmp_path / "preload.c"
    source.write_text("int bwstack_test_preload(void) { return 1; }\n")
    lib = tmp_path / "libbwstacktestpreload.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    monkeypatch.setenv("LD_PRELOAD", str(lib))
    sealed.host_fingerprint.cache_clear()
    try:
        first = probe.collect(built.ml_env, CAPABILITY, runtime=False)
        assert first["imports"] and "imports" not in first["facts_source"], first["facts_source"]
        again = probe.collect(built.ml_env, CAPABILITY, runtime=False)
        assert again["facts_source"].get("imports") == "recorded", again["facts_source"]
        inode = os.stat(lib).st_ino
        shutil.copyfile(lib, tmp_path / "same-bytes.so")
        shutil.copyfile(tmp_path / "same-bytes.so", lib)  # in place: the same inode, written again
        assert os.stat(lib).st_ino == inode
        third = probe.collect(built.ml_env, CAPABILITY, runtime=False)
        assert "imports" not in third["facts_source"], third["facts_source"]
        assert third["facts_source"]["imports_again"] == f"{lib} changed since the imports ran"
        fourth = probe.collect(built.ml_env, CAPABILITY, runtime=False)
        assert fourth["facts_source"].get("imports") == "recorded", fourth["facts_source"]
    finally:
        sealed.host_fingerprint.cache_clear()


@needs_py312
@pytest.mark.parametrize("variable", ["TORCH_USE_RTLD_GLOBAL", "LD_AUDIT", "SGLANG_ENABLE_JIT_DEEPGEMM"])
def test_an_import_outcome_recorded_in_another_environment_is_not_reused(built, monkeypatch, variable):
    """What the import interpreters inherit changes what they do (torch reads TORCH_USE_RTLD_GLOBAL, the loader
    LD_AUDIT, SGLang its SGLANG_* switches): a result from another environment is computed again."""
    monkeypatch.delenv(variable, raising=False)
    first = probe.collect(built.ml_env, CAPABILITY, runtime=False)
    again = probe.collect(built.ml_env, CAPABILITY, runtime=False)
    assert again["facts_source"].get("imports") == "recorded", again["facts_source"]
    monkeypatch.setenv(variable, "/nonexistent/bwstack-test" if variable == "LD_AUDIT" else "1")
    other = probe.collect(built.ml_env, CAPABILITY, runtime=False)
    assert "imports" not in other["facts_source"], other["facts_source"]
    assert first["imports"]


def test_the_environment_key_holds_what_the_env_reads_not_what_changes_between_sessions(monkeypatch, tmp_path):
    monkeypatch.setenv("PWD", "/somewhere")
    before = sealed.environment_key()
    monkeypatch.setenv("PWD", "/elsewhere")
    monkeypatch.setenv("SSH_CONNECTION", "10.0.0.1 5 10.0.0.2 22")
    monkeypatch.setenv("ANSIBLE_LOCAL_TEMP", "/tmp/bwstack-ansible-x1/ansible-local")  # one per provision run
    monkeypatch.setenv("BWSTACK_EVENTS", "/tmp/bwstack-ansible-x1/events.jsonl")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "test_abi.py::test_x (setup)")
    monkeypatch.setenv("PYENV_DIR", "/somewhere")  # pyenv's shims name the folder they were started in
    monkeypatch.setenv("CUDA_HOME", "/usr/local/cuda-12.8")  # set by the generation's hook where unset
    # verify's own folder of Ansible's commands, first on PATH each run
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "ansible").write_text("")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert sealed.environment_key() == before
    compilers = tmp_path / "compilers"
    compilers.mkdir()
    (compilers / "cc").write_text("#!/bin/sh\n")
    (compilers / "cc").chmod(0o755)
    monkeypatch.setenv("PATH", f"{compilers}:{os.environ['PATH']}")
    assert sealed.environment_key() != before, "another cc first on PATH is another environment"
    monkeypatch.setenv("PATH", os.environ["PATH"].split(":", 1)[1])
    monkeypatch.setenv("TORCH_USE_RTLD_GLOBAL", "1")
    assert sealed.environment_key() != before


def test_a_preloaded_library_is_part_of_the_host_fingerprint(tmp_path, monkeypatch):
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    sealed.host_fingerprint.cache_clear()
    try:
        without = sealed.host_fingerprint(env)
        monkeypatch.setenv("LD_PRELOAD", "/opt/preload/libhook.so")
        sealed.host_fingerprint.cache_clear()
        assert sealed.host_fingerprint(env) != without
    finally:
        sealed.host_fingerprint.cache_clear()


@pytest.mark.parametrize(
    ("loaded", "why"),
    [
        (None, "were not recorded"),
        ([["/x"]], "replaced while the imports ran"),
        ([["/", None]], "appeared since the imports ran"),
        ([["/nonexistent/bwstack/lib.so", 1, 2, 3, 4, 5]], "is gone since the imports ran"),
        ([[3, 1, 2, 3, 4, 5]], "recorded malformed"),
        (["/x"], "recorded malformed"),
    ],
    ids=["unknown", "replaced-while-mapped", "absent-then-present", "gone", "path-not-text", "entry-not-a-list"],
)
def test_an_import_outcome_whose_loaded_files_cannot_be_checked_is_not_reused(loaded, why):
    assert why in sealed.loaded_changed(loaded)


@needs_py312
def test_results_of_running_the_env_are_reused_only_while_their_key_holds(built):
    key = sealed.derived_key(built.ml_env, "imports", ["gpu", None])
    assert key is not None
    sealed.save_derived(built.ml_env, key, {"torch": {"ok": True}})
    assert sealed.load_derived(built.ml_env, key) == {"torch": {"ok": True}}
    assert sealed.load_derived(built.ml_env, sealed.derived_key(built.ml_env, "imports", ["gpu", "580"])) is None
    cache = built.root / "cache" / "verify-facts" / f"{_generation(built).name}.json"
    assert cache.is_file()
    os.chmod(cache, 0o666)  # a cache others could write is not trusted
    assert sealed.load_derived(built.ml_env, key) is None


def test_a_plain_env_has_no_recorded_facts(tmp_path):
    env = tmp_path / "env"
    env.mkdir()
    static, why = sealed.load_static(env, CAPABILITY)
    assert static is None and "not a generation" in why
    assert sealed.derived_key(env, "imports") is None


def test_the_store_and_the_probe_name_the_facts_file_alike():
    from bwstack.store.generations import FACTS

    assert FACTS == sealed.FACTS_NAME


# nvcc's compile check on a node with a toolkit: half a second of every verify. A compile that succeeded is reused
# while the generation, the host, the toolkit's whole tree, nvcc's environment and the host compilers are
# unchanged. The toolkit here is a TEST FIXTURE: an ELF `nvcc` (built here with gcc) that runs the script beside
# it, which logs each compile and writes the cubin it is asked for (or fails when told to).

FAKE_NVCC_SCRIPT = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/../../compiles.log"
if [ "$1" = --version ]; then echo "Cuda compilation tools, release 13.0, V13.0.88"; exit 0; fi
if [ -e "$(dirname "$0")/../../fail" ]; then echo "nvcc fatal: Unsupported gpu architecture" >&2; exit 1; fi
while [ $# -gt 0 ]; do if [ "$1" = -o ]; then : > "$2"; fi; shift; done
"""
FAKE_NVCC_C = r"""
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
    char self[4096], script[4200];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n < 0) return 127;
    self[n] = 0;
    snprintf(script, sizeof script, "%s.sh", self);
    char *args[argc + 2];
    args[0] = "sh"; args[1] = script;
    for (int i = 1; i < argc; i++) args[i + 1] = argv[i];
    args[argc + 1] = 0;
    execv("/bin/sh", args);
    return 127;
}
"""


@pytest.fixture(scope="module")
def elf_launcher(tmp_path_factory) -> Path:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler to build the fixture nvcc")
    folder = tmp_path_factory.mktemp("fake-nvcc")
    (folder / "nvcc.c").write_text(FAKE_NVCC_C)
    subprocess.run([gcc, "-o", str(folder / "nvcc"), str(folder / "nvcc.c")], check=True)
    return folder / "nvcc"


@pytest.fixture
def toolkit(tmp_path, elf_launcher):
    home = tmp_path / "cuda-13.0"
    (home / "bin").mkdir(parents=True)
    (home / "include").mkdir()
    shutil.copy(elf_launcher, home / "bin" / "nvcc")
    (home / "bin" / "nvcc.sh").write_text(FAKE_NVCC_SCRIPT)
    # As CUDA 13.0's own: it adds to PATH too (which verify changes each run) and uses `=+` as well as `+=`.
    (home / "bin" / "nvcc.profile").write_text(
        'PATH += $(_HERE_):\nINCLUDES += "-I$(TOP)/include"\nLIBRARIES =+ "-L$(TOP)/lib"\nFIXTURE_FLAGS +=\n'
    )
    return home


def _compiles(home: Path) -> int:
    log = home.parent / "compiles.log"  # beside the toolkit: a log inside it would change its tree
    return sum("-cubin" in line for line in log.read_text().splitlines()) if log.exists() else 0


def _compile(built, home: Path, reuse: bool = True) -> tuple[dict, bool]:
    return probe.compile_facts(built.ml_env, str(home / "bin" / "nvcc"), str(home), "sm_120a", reuse=reuse)


@needs_py312
def test_a_compile_that_succeeded_is_reused_while_generation_host_and_toolkit_are_unchanged(built, toolkit):
    assert _compile(built, toolkit) == ({"arch": "sm_120a", "ok": True, "error": ""}, False)
    assert _compile(built, toolkit) == ({"arch": "sm_120a", "ok": True, "error": ""}, True)
    assert _compiles(toolkit) == 1


def _compiler_on_path(folder: Path, monkeypatch, name: str = "gcc") -> Path:
    """A host compiler nvcc would start, in `folder`, first on PATH."""
    folder.mkdir(exist_ok=True)
    program = folder / name
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    return program


def _rewrite_in_place(path: Path) -> None:
    """Other bytes of the same size, the mtime put back (`rsync --inplace`, `cp -p` over the file)."""
    st = os.lstat(path)
    path.write_text("/* two */\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _linked_toolkit(home: Path, monkeypatch) -> None:
    """The toolkit's include/ becomes a link to a folder elsewhere: what is there counts as the toolkit's."""
    elsewhere = home.parent / "include-elsewhere"
    elsewhere.mkdir()
    os.rmdir(home / "include")
    os.symlink(elsewhere, home / "include")


@needs_py312
@pytest.mark.parametrize(
    "change",
    [
        lambda home, mp: (home / "include" / "cuda.h").write_text("/* a header added */\n"),
        lambda home, mp: os.utime(home / "bin" / "nvcc", ns=(0, 10**9)),
        lambda home, mp: os.chmod(home / "bin" / "nvcc", 0o700),
        lambda home, mp: mp.setenv("NVCC_APPEND_FLAGS", "--bogus-flag"),
        lambda home, mp: mp.setenv("NVCC_CCBIN", "/bin/false"),
        lambda home, mp: mp.setenv("CPATH", str(home.parent)),
        lambda home, mp: os.utime(home.parent / "host-bin" / "gcc", ns=(0, 10**9)),
        lambda home, mp: mp.setenv("PATH", os.environ["PATH"].split(":", 1)[1]),
        lambda home, mp: mp.setenv("PTXAS_FLAGS", "--bogus-flag"),
        lambda home, mp: mp.setenv("INCLUDES", "-include /nonexistent.h"),
        lambda home, mp: mp.setenv("FIXTURE_FLAGS", "-x"),
        lambda home, mp: mp.setenv("LIBRARIES", "-L/elsewhere"),
        lambda home, mp: mp.setenv("TMPDIR", str(home.parent / "no-such-dir")),
        lambda home, mp: _rewrite_in_place(home / "include" / "kept.h"),
    ],
    ids=[
        "file-added", "nvcc-mtime-moved", "mode-changed", "nvcc-flags-set", "host-compiler-named",
        "include-path-set", "host-compiler-replaced", "another-host-compiler-first-on-path", "ptxas-flags-set",
        "includes-set", "a-variable-nvcc-profile-names-set", "libraries-set", "tmpdir-set",
        "rewritten-keeping-size-and-mtime",
    ],
)  # fmt: skip
def test_a_change_to_what_nvcc_runs_with_compiles_again(built, toolkit, change, monkeypatch):
    _compiler_on_path(toolkit.parent / "host-bin", monkeypatch)  # replaced by one case
    (toolkit / "include" / "kept.h").write_text("/* one */\n")
    _compile(built, toolkit)
    change(toolkit, monkeypatch)
    assert _compile(built, toolkit)[1] is False
    assert _compiles(toolkit) == 2


@needs_py312
def test_a_file_a_toolkit_link_leads_to_counts_as_the_toolkits(built, toolkit, monkeypatch):
    _linked_toolkit(toolkit, monkeypatch)
    _compile(built, toolkit)
    (toolkit.parent / "include-elsewhere" / "cuda.h").write_text("/* changed through the link */\n")
    assert _compile(built, toolkit)[1] is False


@needs_py312
def test_an_nvcc_that_is_not_an_elf_program_is_compiled_every_time(built, toolkit):
    """A wrapper script starts whatever it names, which the toolkit's stamp does not cover."""
    wrapper = toolkit / "bin" / "nvcc"
    wrapper.unlink()
    wrapper.write_text(f'#!/bin/sh\nexec sh "{toolkit}/bin/nvcc.sh" "$@"\n')
    wrapper.chmod(0o755)
    for _ in range(2):
        assert _compile(built, toolkit)[1] is False
    assert _compiles(toolkit) == 2


@needs_py312
def test_a_failed_compile_is_tried_again_every_time(built, toolkit):
    (toolkit.parent / "fail").write_text("")
    for _ in range(2):
        result, reused = _compile(built, toolkit)
        assert not result["ok"] and "Unsupported gpu architecture" in result["error"] and not reused
    assert _compiles(toolkit) == 2


@needs_py312
def test_a_changed_generation_compiles_every_time(built, toolkit):
    for _ in range(2):
        assert _compile(built, toolkit, reuse=False)[1] is False
    assert _compiles(toolkit) == 2


@needs_py312
def test_the_cuda_facts_read_the_same_whether_the_compile_ran_now_or_was_reused(built, toolkit, monkeypatch):
    """They key the serve-plan results: a reused compile must not make the recorded plans unfindable."""
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    sources: list[dict] = [{}, {}]
    first = probe.cuda_facts(built.ml_env, CAPABILITY, reuse=True, sources=sources[0])
    again = probe.cuda_facts(built.ml_env, CAPABILITY, reuse=True, sources=sources[1])
    assert first["compile"]["ok"] and first == again
    assert [s["nvcc_compile"] for s in sources] == ["compiled now", "recorded"]


@needs_py312
def test_a_toolkit_tree_too_large_to_stamp_is_compiled_every_time(built, toolkit, monkeypatch):
    monkeypatch.setattr(probe, "TOOLKIT_MAX_PATHS", 5)  # the fixture toolkit has 6 paths
    for _ in range(2):
        assert _compile(built, toolkit)[1] is False
    assert _compiles(toolkit) == 2


@pytest.mark.parametrize("method", ["find", "python"])
def test_a_tree_stamp_stops_at_its_path_limit(toolkit, method):
    assert sealed.tree_stamp(toolkit, method, max_paths=5) == (method, sealed.UNREADABLE)
    assert sealed.tree_stamp(toolkit, method, max_paths=6)[1] != sealed.UNREADABLE
    assert sealed.tree_stamp(toolkit, method, max_paths=6) == sealed.tree_stamp(toolkit, method)


def test_a_stamp_that_follows_links_refuses_a_loop_and_needs_find(toolkit, monkeypatch):
    os.symlink("..", toolkit / "bin" / "up")
    assert sealed.tree_stamp(toolkit, follow_links=True)[1] == sealed.UNREADABLE
    assert sealed.tree_stamp(toolkit)[1] != sealed.UNREADABLE  # a generation's own links are not followed
    monkeypatch.setattr(sealed.shutil, "which", lambda name: None)
    assert sealed.tree_stamp(toolkit, follow_links=True) == ("python", sealed.UNREADABLE)


def test_a_tree_that_changes_under_the_python_walk_is_unreadable_not_a_traceback(toolkit, monkeypatch):
    real_lstat = os.lstat

    def vanishing(path, *args, **kwargs):
        if str(path).endswith("nvcc.sh"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(sealed.treecheck.os, "lstat", vanishing)
    assert sealed.tree_stamp(toolkit, "python") == ("python", sealed.UNREADABLE)


@needs_py312
def test_a_directory_of_its_own_on_path_does_not_stop_the_reuse(built, toolkit, monkeypatch, tmp_path):
    """verify puts a new directory (links to Ansible's commands) on PATH each run: not a change nvcc sees."""
    for run in range(2):
        tools = tmp_path / f"verify-{run}" / "bin"
        tools.mkdir(parents=True)
        monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
        _compile(built, toolkit)
    assert _compiles(toolkit) == 1


@needs_py312
@pytest.mark.parametrize("given", ["name", "directory"])
def test_a_host_compiler_nvcc_is_pointed_at_by_name_or_directory_counts(built, toolkit, monkeypatch, tmp_path, given):
    program = _compiler_on_path(tmp_path / "compilers", monkeypatch, "mygcc" if given == "name" else "gcc")
    monkeypatch.setenv("NVCC_CCBIN", "mygcc" if given == "name" else str(program.parent))
    _compile(built, toolkit)
    os.utime(program, ns=(0, 10**9))  # replaced
    assert _compile(built, toolkit)[1] is False
    assert _compiles(toolkit) == 2


@needs_py312
@pytest.mark.parametrize("variable", ["NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"])
@pytest.mark.parametrize("flag", ["-ccbin /opt/gcc-13/bin", "--compiler-bindir=/opt/gcc-13/bin"])
def test_a_host_compiler_named_in_nvccs_flags_is_compiled_every_time(built, toolkit, monkeypatch, variable, flag):
    monkeypatch.setenv(variable, flag)
    for _ in range(2):
        assert _compile(built, toolkit)[1] is False
    assert _compiles(toolkit) == 2


@needs_py312
def test_odd_toolkits_give_cuda_facts_not_a_traceback(built, toolkit, monkeypatch, tmp_path):
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    monkeypatch.setenv("CUDA_HOME", str(loop))
    facts = probe.cuda_facts(built.ml_env, CAPABILITY, reuse=True)
    assert facts["cuda_home"] == str(loop) and facts["cuda_home_real"] is None and facts["nvcc"] is None
    (toolkit / "bwstack-toolkit.json").write_bytes(b"{not json \xff")
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    facts = probe.cuda_facts(built.ml_env, "", reuse=True)  # a job whose device names no capability
    assert "unreadable" in facts["toolkit_marker"]["note"] and facts["compile"]["arch"] == "sm_a"


@needs_py312
def test_a_toolkit_that_changes_often_keeps_one_compile_entry_not_crowding_the_cache_out(built, toolkit):
    """The store keeps 32 results per generation: one per toolkit stamp would push the import checks out."""
    for run in range(sealed.DERIVED_KEEP + 2):
        os.utime(toolkit / "bin" / "nvcc", ns=(0, (run + 1) * 10**9))
        _compile(built, toolkit)
    cache = json.loads(sealed.derived_cache(built.ml_env).read_text())
    compiles = [v for v in cache.values() if isinstance(v["value"], dict) and "inputs" in v["value"]]
    assert len(compiles) == 1 and _compiles(toolkit) == sealed.DERIVED_KEEP + 2


def test_a_change_right_after_the_store_records_a_comparison_is_later_than_the_record(built):
    """Inode times come from the filesystem's clock (a file server's, a coarse tick), which may lag this host's:
    a moment read from time.time_ns() could be later than the inode change time of a file written just after
    it. The record takes its moment from the filesystem's own stamp, less one, so a change in the same tick
    still counts as later. (This machine's clock does not lag; the test holds the rule, not the hazard.)"""
    gen = _generation(built)
    path = _torch_version_py(gen)
    _writable(path)
    for _ in range(20):
        sealed.record_hashed(gen, None)
        os.chmod(path, 0o644)  # moves the ctime at once
        assert os.lstat(path).st_ctime_ns > sealed.hashed_before(gen)
