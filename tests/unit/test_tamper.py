"""Who may change a generation, and what happens when someone did anyway.

Verification covers modes, owners, bytecode and every path in the generation; damaged metadata damages one
generation and not the store; a backup after drift leaves every earlier generation switchable; a switch is
whole or undone and touches only links this store owns.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import needs_py312

from bwstack.store.generations import Store
from bwstack.store.layout import Layout

pytestmark = needs_py312


def _store(stack) -> Store:
    return Store(Layout(stack.root, stack.ml_env, stack.cuda_link, None))


def _site(gen) -> Path:
    return next(gen.env.glob("lib/python3.*/site-packages"))


def _imports(ml_env: Path) -> str:
    out = subprocess.run(
        [str(ml_env / "bin" / "python"), "-c", "import torch, fixture_dep; print(torch.__version__)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.strip()


@pytest.fixture
def two(stack):
    """Generation 0 (fixture-old) and generation 1 (fixture-new, active)."""
    stack.build("fixture-old", check=True)
    stack.build("fixture-new", check=True)
    gens = _store(stack).generations()
    return stack, gens[0], gens[1]


# ------------------------------------------------------------------------------------------------ tamper


def _chmod_file(gen) -> str:
    path = _site(gen) / "fixture_dep" / "__init__.py"
    os.chmod(path, 0o644)
    return str(path.relative_to(gen.path))


def _group_writable_dir(gen) -> str:
    path = _site(gen) / "fixture_dep"
    os.chmod(path, 0o775)
    return str(path.relative_to(gen.path))


def _chown_file(gen) -> str:
    path = _site(gen) / "fixture_dep" / "__init__.py"
    os.chown(path, 4242, 4242)
    return str(path.relative_to(gen.path))


def _add_bytecode(gen) -> str:
    cache = _site(gen) / "fixture_dep" / "__pycache__"
    cache.mkdir(exist_ok=True)
    path = cache / "evil.cpython-312.pyc"
    path.write_bytes(b"\0" * 16)
    return str(path.relative_to(gen.path))


def _replace_bytecode(gen) -> str:
    path = next((_site(gen) / "fixture_dep" / "__pycache__").glob("__init__.*.pyc"))
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    os.chmod(path, 0o444)  # same mode and size as sealed: only the bytes tell
    return str(path.relative_to(gen.path))


def _add_pth(gen) -> str:
    path = _site(gen) / "zz_evil.pth"
    path.write_text("import os\n")
    return str(path.relative_to(gen.path))


def _beside_env(gen) -> str:
    (gen.path / "notes.txt").write_text("hello\n")
    return "notes.txt"


def _record_edit(gen) -> str:
    path = gen.path / "record.json"
    record = json.loads(path.read_text())
    record["profile"] = "fixture-new"
    os.chmod(path, 0o644)
    path.write_text(json.dumps(record))
    return "record.json"


TAMPERS = {
    "file-mode": (_chmod_file, "mode 0644"),
    "group-writable-dir": (_group_writable_dir, "mode 0775 (group-writable)"),
    "owner": (_chown_file, "owner 4242:4242"),
    "bytecode-added": (_add_bytecode, "not in the manifest"),
    "bytecode-replaced": (_replace_bytecode, "content changed"),
    "pth-added": (_add_pth, "not in the manifest"),
    "file-next-to-env": (_beside_env, "not in the manifest"),
    "record-edited": (_record_edit, ""),
}


@pytest.mark.parametrize("depth", ["quick", "full"])
@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_a_tampered_generation_is_refused_naming_the_path(two, tamper, depth):
    stack, old, _new = two
    change, what = TAMPERS[tamper]
    rel = change(old)
    result = stack.run("rollback", "--to", "0", "--verify", depth)
    assert result.returncode == 5, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert f"{rel}: {what}" in result.stderr
    assert _imports(stack.ml_env) == "2.9.1+cu130", "the active generation is untouched"


def test_running_the_sealed_env_as_root_writes_no_bytecode(two):
    stack, _old, new = two
    code = "import json, email.mime.text, fixture_dep, torch"
    subprocess.run([str(stack.ml_env / "bin" / "python"), "-c", code], check=True)
    assert new.verify("full") == []


def test_current_pointing_outside_the_store_is_named_and_a_rollback_repairs_it(two, tmp_path):
    stack, _old, new = two
    fake = tmp_path / "elsewhere" / "generations" / new.name
    fake.mkdir(parents=True)
    current = stack.root / "current"
    current.unlink()
    current.symlink_to(fake)
    listed = stack.run("generations", "--check")
    assert listed.returncode == 1 and f"{current} points to" in listed.stderr
    backup = stack.run("backup")
    assert backup.returncode == 5 and "not to a generation inside" in backup.stderr
    assert stack.run("rollback", "--to", "1").returncode == 0
    assert os.readlink(current) == f"generations/{new.name}"


# ------------------------------------------------------------------------------------------------ damaged


def _break_record(gen) -> None:
    os.chmod(gen.path / "record.json", 0o644)
    (gen.path / "record.json").write_text("{not json")


def _break_manifest(gen) -> None:
    os.chmod(gen.path / "manifest.json", 0o644)
    (gen.path / "manifest.json").write_text('{"format": 2, "files": [["x"]]}')


def _record_lies_about_id(gen) -> None:
    record = json.loads((gen.path / "record.json").read_text())
    record["id"] = 99
    os.chmod(gen.path / "record.json", 0o644)
    (gen.path / "record.json").write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("damage", "why"),
    [(_break_record, "record.json is not valid JSON"), (_break_manifest, "manifest.json: a file row is not a list"),
     (_record_lies_about_id, "does not match the directory name")],
    ids=["record-not-json", "manifest-malformed", "record-id-lies"],
)  # fmt: skip
def test_damaged_metadata_damages_one_generation_not_the_store(two, damage, why):
    stack, old, _new = two
    damage(old)
    rows = json.loads(stack.run("generations", "--json", check=True).stdout)
    row = next(r for r in rows if r["name"] == old.name)
    assert row["state"] == "damaged" and why in row["why"] and row["path"] == str(old.path)
    refused = stack.run("rollback", "--to", old.name)
    assert refused.returncode == 5 and "damaged" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert stack.run("backup", check=True).returncode == 0
    assert stack.build("fixture-new", check=True).returncode == 0
    pruned = json.loads(stack.run("prune", "--keep", "5", "--json", check=True).stdout)
    assert pruned["removed"] == [old.name]
    assert _imports(stack.ml_env) == "2.9.1+cu130"


def test_a_damaged_history_line_is_ignored_with_a_warning(two):
    stack, _old, _new = two
    with open(stack.root / "history.jsonl", "a") as handle:
        handle.write('{"at": "cut short by a ki\n')
    listed = stack.run("generations")
    assert listed.returncode == 0 and "history.jsonl line 3 is damaged" in listed.stderr
    assert stack.run("rollback", check=True).returncode == 0
    assert _imports(stack.ml_env) == "2.9.1"


# ------------------------------------------------------------------------------------------------ drift


def test_a_backup_after_drift_leaves_the_sealed_generation_restorable(stack):
    """Issue 17's reproduction: build, add a module to site-packages, backup, roll back to the generation
    before the install."""
    stack.build("fixture-old", check=True)
    gen0 = _store(stack).active()
    (_site(gen0) / "added_by_pip.py").write_text("X = 1\n")
    result = json.loads(stack.run("backup", "--json", check=True).stdout)
    assert result["action"] == "snapshot" and result["restored"] == gen0.name
    assert (_site(_store(stack).active()) / "added_by_pip.py").is_file(), "the drift lives on in the snapshot"
    assert stack.run("rollback", "--to", "0").returncode == 0
    assert not (_site(gen0) / "added_by_pip.py").exists() and gen0.verify("full") == []
    rows = json.loads(stack.run("generations", "--json", check=True).stdout)
    assert [(r["id"], r["state"]) for r in rows] == [(0, "passed"), (1, "not-run")]


def test_drift_that_replaced_and_removed_files_is_repaired_from_the_objects(stack):
    stack.build("fixture-old", check=True)
    gen0 = _store(stack).active()
    package = _site(gen0) / "fixture_dep"
    init = package / "__init__.py"
    original = init.read_bytes()
    init.unlink()
    init.write_text("VALUE = 'changed by an installer'\n")  # a new inode, as pip writes it
    (package / "__pycache__").rename(package / "moved-away")
    stack.run("backup", check=True)
    assert init.read_bytes() == original and gen0.verify("full") == []
    assert stack.run("rollback", "--to", "0").returncode == 0
    assert _imports(stack.ml_env) == "2.9.1"


def test_drift_whose_original_bytes_are_gone_is_listed_as_changed_never_passed(stack):
    stack.build("fixture-old", check=True)
    gen0 = _store(stack).active()
    init = _site(gen0) / "fixture_dep" / "__init__.py"
    sha = next(e.sha256 for e in gen0.manifest_entries() if e.path.endswith("fixture_dep/__init__.py"))
    layout = _store(stack).layout
    layout.objects.path(sha).unlink()
    for cached in (stack.root / "cache" / "uv").rglob("fixture_dep/__init__.py"):
        cached.unlink()
    init.unlink()
    init.write_text("VALUE = 'changed'\n")
    result = stack.run("backup", "--json")
    assert result.returncode == 0 and "could not be brought back" in result.stderr
    rows = json.loads(stack.run("generations", "--json", check=True).stdout)
    assert rows[0]["state"] == "changed" and "fixture_dep/__init__.py" in rows[0]["why"]
    refused = stack.run("rollback", "--to", "0")
    assert refused.returncode == 5 and "fixture_dep/__init__.py" in refused.stderr


# ------------------------------------------------------------------------------------------------ links


def test_a_store_never_re_points_an_ml_env_link_of_another_store(two, tmp_path):
    stack, _old, _new = two
    trial = {"BWSTACK_ROOT": str(tmp_path / "trial")}
    result = stack.run("build", "--profile", "fixture-old", "--wheelhouse", str(stack.wheelhouse), extra_env=trial)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert f"{stack.ml_env} -> {stack.root}/current/env" in result.stderr and "another store" in result.stderr
    assert os.readlink(stack.ml_env) == f"{stack.root}/current/env"
    assert _imports(stack.ml_env) == "2.9.1+cu130"


def test_a_link_bwstack_did_not_make_is_refused_unless_taken_over(stack, tmp_path):
    elsewhere = tmp_path / "toolkit"
    elsewhere.mkdir()
    stack.cuda_link.symlink_to(elsewhere)
    refused = stack.build("fixture-old")
    assert refused.returncode == 2 and "not made by bwstack" in refused.stderr
    assert os.readlink(stack.cuda_link) == str(elsewhere) and not (stack.root / "current").exists()
    taken = stack.build("fixture-old", "--take-over-links")
    assert taken.returncode == 0, taken.stderr
    assert os.readlink(stack.cuda_link) == f"{stack.root}/current/cuda"
    assert f"taking over {stack.cuda_link} (was -> {elsewhere})" in taken.stdout


@pytest.fixture
def read_only_dir(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    mount = tmp_path / "ro"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_switch_whose_link_cannot_be_updated_is_undone_and_recorded(two, read_only_dir):
    stack, _old, new = two
    result = stack.run("rollback", "--to", "0", extra_env={"BWSTACK_CUDA_LINK": str(read_only_dir / "cuda")})
    assert result.returncode == 1 and "undone" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert os.readlink(stack.root / "current") == f"generations/{new.name}"
    last = [json.loads(line) for line in (stack.root / "history.jsonl").read_text().splitlines()][-1]
    assert last["to"] == new.name and last["why"].startswith("undone")
    assert _store(stack).history()[-1]["to"] == new.name
    assert _imports(stack.ml_env) == "2.9.1+cu130"


def test_adopt_takes_the_env_over(stack):
    from bwstack.provision.envbuild import find_python

    subprocess.run([find_python("3.12"), "-m", "venv", "--without-pip", str(stack.ml_env)], check=True)
    module = next(stack.ml_env.glob("lib/python3.*/site-packages")) / "handmade.py"
    module.write_text("X = 1\n")
    os.chmod(module, 0o666)
    os.chown(module, 4242, 4242)
    stack.run("adopt", check=True)
    st = os.lstat(stack.ml_env.resolve() / module.relative_to(stack.ml_env))
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (os.geteuid(), os.getegid(), 0o444)
    assert _store(stack).active().verify("full") == []


@pytest.mark.parametrize("name", ["zzzz_bwstack_generation.pth", "_bwstack_generation.py"])
def test_adopt_replaces_a_link_planted_at_the_hooks_name_instead_of_writing_through_it(stack, tmp_path, name):
    """The owner of a hand-made env puts a link where the generation hook goes, to a file only root may write:
    adopt (root) replaces the link with the hook and leaves that file as it was."""
    from bwstack.provision.envbuild import find_python

    subprocess.run([find_python("3.12"), "-m", "venv", "--without-pip", str(stack.ml_env)], check=True)
    victim = tmp_path / "root-only.conf"
    victim.write_text("precious\n")
    planted = next(stack.ml_env.glob("lib/python3.*/site-packages")) / name
    os.symlink(victim, planted)
    stack.run("adopt", check=True)
    assert victim.read_text() == "precious\n"
    hook = stack.ml_env.resolve() / planted.relative_to(stack.ml_env)
    assert hook.is_file() and not hook.is_symlink()
    assert _store(stack).active().verify("full") == []


def test_adopt_refuses_an_env_whose_site_packages_leads_out_of_it(stack, tmp_path):
    from bwstack.provision.envbuild import find_python

    subprocess.run([find_python("3.12"), "-m", "venv", "--without-pip", str(stack.ml_env)], check=True)
    site = next(stack.ml_env.glob("lib/python3.*/site-packages"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.rmdir(site)
    os.symlink(elsewhere, site)
    result = stack.run("adopt")
    assert result.returncode == 2 and not list(elsewhere.iterdir()) and (stack.ml_env / "pyvenv.cfg").is_file()
    assert "leads out of the env" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@contextlib.contextmanager
def _mounted(folder: Path):
    """A tmpfs mounted at `folder` (as a FUSE server its user mounted would be: a filesystem of its own)."""
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "bwstack-test", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_adopt_refuses_an_env_with_a_filesystem_mounted_inside_it(stack):
    """Whoever serves a mounted filesystem answers every stat and read: what adopt hashed need not be what runs."""
    from bwstack.provision.envbuild import find_python

    subprocess.run([find_python("3.12"), "-m", "venv", "--without-pip", str(stack.ml_env)], check=True)
    with _mounted(next(stack.ml_env.glob("lib/python3.*/site-packages")) / "served") as mount:
        (mount / "module.py").write_text("X = 1\n")
        result = stack.run("adopt")
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert f"{mount}: another filesystem is mounted there" in result.stderr
        assert not stack.ml_env.is_symlink() and not list((stack.root / "generations").glob("0*"))


def test_a_filesystem_mounted_inside_a_sealed_generation_is_a_difference(two):
    _stack, old, _new = two
    with _mounted(_site(old) / "served"):
        problems = old.verify("quick")
    assert any(p.path.endswith("site-packages/served") and "another filesystem is mounted" in p.what for p in problems)


# ------------------------------------------------------------------------------------------------ objects


def test_prune_never_removes_files_through_a_link_planted_at_the_objects_folder(two, tmp_path):
    stack, old, _new = two
    objects = _store(stack).layout.objects.root
    victim = tmp_path / "victim"
    (victim / "ab").mkdir(parents=True)
    kept = [victim / "ab" / ("ab" + "0" * 62), victim / "ab" / "important.conf"]
    for path in kept:
        path.write_text("precious\n")  # one link each: what collect removes in its own folder
    os.rename(objects, tmp_path / "objects-moved")
    os.symlink(victim, objects)
    pruned = json.loads(stack.run("prune", "--keep", "1", "--json", check=True).stdout)
    assert pruned["removed"] == [old.name]  # a generation went: the objects nothing links to are collected
    assert all(path.read_text() == "precious\n" for path in kept)


def _object(folder: Path, data: bytes) -> tuple[str, Path]:
    import hashlib

    sha = hashlib.sha256(data).hexdigest()
    path = folder / sha[:2] / sha
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, 0o444)
    return sha, path


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize(
    "open_it",
    [
        lambda path: os.chown(path, 65534, -1),
        lambda path: os.chmod(path, 0o666),
        lambda path: os.chmod(path.parent, 0o777),
        lambda path: os.chown(path.parent.parent, 65534, -1),
    ],
    ids=[
        "object-of-another-user",
        "object-writable-by-others",
        "subfolder-writable-by-others",
        "folder-of-another-user",
    ],
)
def test_repair_takes_no_bytes_from_an_object_others_could_write(tmp_path, open_it):
    """An object is linked back into a generation (root's): one another user owns, or could write through, would
    put their inode into it."""
    from bwstack.store.objects import ObjectStore

    store = ObjectStore(tmp_path / "cache" / "objects")
    sha, path = _object(store.root, b"sealed bytes\n")
    assert store.find(sha) == path
    open_it(path)
    assert store.find(sha) is None


@pytest.mark.parametrize("kind", ["file", "link-to-a-folder", "dangling-link"])
def test_a_stray_entry_in_generations_is_listed_as_damaged_and_pruned_without_following_it(two, tmp_path, kind):
    stack, _old, _new = two
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("kept\n")
    stray = stack.root / "generations" / "stray"
    if kind == "file":
        stray.write_text("dropped here\n")
    else:
        os.symlink(elsewhere if kind == "link-to-a-folder" else tmp_path / "absent", stray)
    rows = json.loads(stack.run("generations", "--json", check=True).stdout)
    row = next(r for r in rows if r["name"] == "stray")
    assert row["state"] == "damaged" and "not a directory" in row["why"]
    pruned = json.loads(stack.run("prune", "--keep", "5", "--json", check=True).stdout)
    assert pruned["removed"] == ["stray"] and not os.path.lexists(stray)
    assert (elsewhere / "keep.txt").read_text() == "kept\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
@pytest.mark.parametrize(
    "open_it",
    [lambda c: os.chown(c, 65534, 65534), lambda c: os.chmod(c, 0o777), lambda c: os.chmod(c, 0o1777)],
    ids=["another-users", "writable-by-everyone", "sticky-but-writable-by-everyone"],
)
def test_a_cache_folder_others_could_write_is_refused_before_anything_is_built(stack, tmp_path, open_it):
    """Wheels, uv's unpacked files and the hashes of sealed files live in the cache: a shared BWSTACK_CACHE
    another user can write would put their files into root's generations (a repair raced that way)."""
    shared = tmp_path / "shared-cache"
    shared.mkdir()
    open_it(shared)
    result = stack.build("fixture-old", extra_env={"BWSTACK_CACHE": str(shared)})
    assert result.returncode == 2 and "is not this user's alone" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not list(shared.iterdir())
    assert not (stack.root / "generations").exists() or not list((stack.root / "generations").iterdir())


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_cache_folder_to_be_made_inside_a_folder_others_could_write_is_refused(stack, tmp_path):
    """Made by the run itself, it could still be renamed away and replaced while the run uses it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 65534, 65534)
    result = stack.build("fixture-old", extra_env={"BWSTACK_CACHE": str(shared / "cache")})
    assert result.returncode == 2 and "would be made where others can write" in result.stderr, result.stderr
    assert not (shared / "cache").exists()


def test_removing_a_tree_with_a_filesystem_mounted_inside_it_is_refused_and_removes_nothing(tmp_path):
    """A bind mount of the same filesystem shows no other st_dev; the mount table names it. rmtree would have
    emptied the mounted folder before failing at its mount point."""
    from bwstack.errors import BwstackError
    from bwstack.store.tree import mounts_under, remove_tree

    data = tmp_path / "data"
    data.mkdir()
    (data / "keep.txt").write_text("precious\n")
    tree = tmp_path / "generation" / "env"
    (tree / "served").mkdir(parents=True)
    done = subprocess.run(["mount", "--bind", str(data), str(tree / "served")], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {done.stderr.decode().strip()}")
    try:
        assert mounts_under(tmp_path / "generation") == [str(tree / "served")]
        with pytest.raises(BwstackError, match=r"not removing .*: a filesystem is mounted at .*served inside it"):
            remove_tree(tmp_path / "generation")
        assert (data / "keep.txt").read_text() == "precious\n" and (tree / "served" / "keep.txt").is_file()
    finally:
        subprocess.run(["umount", "-l", str(tree / "served")], check=False)
    remove_tree(tmp_path / "generation")
    assert not (tmp_path / "generation").exists() and (data / "keep.txt").is_file()


def test_a_mount_point_with_a_space_in_its_name_is_read_from_the_mount_table(tmp_path):
    from bwstack.store.tree import mounts_under

    table = tmp_path / "mountinfo"
    table.write_text(
        "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        "40 22 8:1 /data /opt/bwstack/generations/0001-x/env/with\\040space rw - ext4 /dev/sda1 rw\n"
    )
    assert mounts_under(Path("/opt/bwstack/generations/0001-x"), str(table)) == [
        "/opt/bwstack/generations/0001-x/env/with space"
    ]
    assert mounts_under(Path("/opt/bwstack/generations/0001-xy"), str(table)) == []


def test_without_the_mount_table_a_filesystem_mounted_inside_is_still_found_by_its_device(tmp_path):
    """/proc hidden or over-mounted: the table cannot be read, and removing must not go on blind."""
    from bwstack.store.tree import mounts_under

    (tmp_path / "tree").mkdir()
    with _mounted(tmp_path / "tree" / "served") as mount:
        assert mounts_under(tmp_path / "tree", str(tmp_path / "no-such-table")) == [str(mount)]
