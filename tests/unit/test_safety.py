"""Bad input and bad luck lose nothing: hash mismatches, unhashed wheels, SIGKILL, full disks, archives."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import OTHER_UID, needs_py312, vouched

from bwstack.store.generations import Store
from bwstack.store.layout import Layout
from fixtures import fakestack

pytestmark = needs_py312


def _store(stack) -> Store:
    return Store(Layout(stack.root, stack.ml_env, stack.cuda_link, None))


def _active_imports(stack) -> str:
    out = subprocess.run(
        [str(stack.ml_env / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.strip()


# ------------------------------------------------------------------------------------------------ hashes


def test_a_wheel_whose_hash_differs_from_the_lock_is_refused_naming_the_package(stack, tmp_path):
    stack.build("fixture-old", check=True)
    before = os.readlink(stack.root / "current")
    tampered = tmp_path / "tampered"
    tampered.mkdir()
    for wheel in stack.wheelhouse.iterdir():
        data = wheel.read_bytes()
        (tampered / wheel.name).write_bytes(data + (b"\0" if wheel.name.startswith("torch-2.9.1+cu130") else b""))
    result = stack.run("build", "--profile", "fixture-new", "--wheelhouse", str(tampered))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr  # bad input: one line, exit 2
    assert "torch 2.9.1+cu130" in result.stderr and "refused" in result.stderr
    assert os.readlink(stack.root / "current") == before, "the active env is untouched"
    assert [g.profile for g in _store(stack).generations()] == ["fixture-old"]
    assert not list((stack.root / "generations").glob(".building-*"))
    assert not any(p.name.startswith("torch-2.9.1+cu130") for p in (stack.root / "cache" / "wheels").rglob("*.whl"))


def _null_hash(stack, package: str) -> None:
    text = stack.lock.read_text()
    spec, _, rest = text.partition("# ---- generated")
    doc = yaml.safe_load(text)
    wheel = doc["closures"]["fixture-new"]["env"][package]["wheels"][0]
    wheel["sha256"] = None
    wheel["hash_source"] = "missing: test case"
    closures = yaml.safe_dump({"closures": doc["closures"]}, sort_keys=False)
    stack.lock.write_text(spec + "# ---- generated" + rest.split("\n", 1)[0] + "\n" + closures)


def test_a_wheel_without_a_hash_needs_allow_unhashed_and_says_so(stack):
    _null_hash(stack, "fixture-dep")
    result = stack.build("fixture-new")
    assert result.returncode == 1
    assert "no sha256 for fixture-dep 2.0" in result.stderr and "--allow-unhashed fixture-dep" in result.stderr
    assert not stack.ml_env.exists()


def test_allow_unhashed_installs_and_records_the_wheel_as_unverified(stack):
    _null_hash(stack, "fixture-dep")
    result = stack.build("fixture-new", "--allow-unhashed", "fixture-dep")
    assert result.returncode == 0, result.stderr
    assert "WARNING: fixture-dep 2.0: installing" in result.stdout
    record = _store(stack).active().record
    assert record.packages["fixture-dep"]["hash_verified"] is False
    assert record.packages["torch"]["hash_verified"] is True


# ------------------------------------------------------------------------------------------------ kills

KILL_POINTS = [
    "after-venv", "after-install", "after-patch", "after-verify", "before-manifest",
    "before-commit-rename", "after-commit", "before-flip", "after-flip",
]  # fmt: skip


def _invariants_hold(stack, expected_torch: str) -> None:
    assert _active_imports(stack) == expected_torch
    store = _store(stack)
    active = store.active()
    assert active is not None and active.verify("full") == []
    assert store.history()[-1]["to"] == active.name, "history agrees with current"


@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkill_at_a_named_point_of_a_build_leaves_the_active_env_working_and_a_rerun_converges(stack, point):
    stack.build("fixture-old", check=True)
    killed = stack.build("fixture-new", extra_env={"BWSTACK_TEST_KILL_AT": point})
    assert killed.returncode == -signal.SIGKILL
    active = _store(stack).active()
    _invariants_hold(stack, "2.9.1+cu130" if active.profile == "fixture-new" else "2.9.1")
    rerun = stack.build("fixture-new", "--json")
    assert rerun.returncode == 0, rerun.stderr
    _invariants_hold(stack, "2.9.1+cu130")
    assert not list((stack.root / "generations").glob(".building-*"))
    assert len([g for g in _store(stack).generations() if g.profile == "fixture-new"]) == 1


@pytest.mark.parametrize("delay_ms", [40, 80, 120, 160, 200, 240, 280, 320, 380, 450, 520, 600])
def test_sigkill_at_a_random_moment_of_a_build_or_switch_leaves_a_working_env(stack, delay_ms):
    stack.build("fixture-old", check=True)
    stack.build("fixture-new", check=True)
    stack.run("rollback", "--to", "0", check=True)
    env = {**os.environ, **stack.env}
    victim = subprocess.Popen(
        [sys.executable, "-m", "bwstack", "--lock", str(stack.lock), "rollback", "--to", "1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    ) if delay_ms % 80 == 0 else subprocess.Popen(
        [sys.executable, "-m", "bwstack", "--lock", str(stack.lock), "build", "--profile", "fixture-new",
         "--wheelhouse", str(stack.wheelhouse), "--no-switch"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(delay_ms / 1000)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    active = _store(stack).active()
    _invariants_hold(stack, "2.9.1+cu130" if active.profile == "fixture-new" else "2.9.1")
    assert stack.run("rollback", "--to", "1").returncode == 0
    _invariants_hold(stack, "2.9.1+cu130")


@pytest.mark.parametrize("point", ["adopt-before-current", "adopt-before-exchange"])
def test_sigkill_during_adoption_keeps_the_hand_made_env_working_and_a_rerun_finishes_it(stack, point):
    _hand_made_env(stack)
    killed = stack.run("adopt", extra_env={"BWSTACK_TEST_KILL_AT": point})
    assert killed.returncode == -signal.SIGKILL
    assert _active_imports(stack) == "2.9.1"  # still works through the same path
    assert stack.build("fixture-new").returncode == 0
    gens = _store(stack).generations()
    assert gens[0].record.adopted_from == str(stack.ml_env) and not gens[0].env.is_symlink()
    stack.run("rollback", "--to", str(gens[0].id), check=True)
    assert _active_imports(stack) == "2.9.1"


def test_an_interrupted_adoption_is_finished_only_for_the_env_the_store_adopts(stack, tmp_path):
    """The record of an interrupted adoption names the folder to move in; one naming another folder (a record
    someone edited) moves nothing: that generation never completed and is removed, the folder stays as it was."""
    _hand_made_env(stack)
    killed = stack.run("adopt", extra_env={"BWSTACK_TEST_KILL_AT": "adopt-before-exchange"})
    assert killed.returncode == -signal.SIGKILL
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "pyvenv.cfg").write_text("home = /usr/bin\n")
    gen = _store(stack).generations()[0]
    record = gen.path / "record.json"
    doc = json.loads(record.read_text())
    doc["origin"] = f"adopted:{victim}"
    os.chmod(record, 0o644)
    record.write_text(json.dumps(doc))
    os.chmod(record, 0o444)
    stack.run("prune", "--keep", "5")  # a command that opens the store, which finishes interrupted runs
    assert (victim / "pyvenv.cfg").is_file() and not victim.is_symlink()
    assert not gen.path.exists()
    assert _active_imports(stack) == "2.9.1"  # the hand-made env, still where it was


def test_a_file_rewritten_while_an_interrupted_adoption_waited_is_found_once_it_is_finished(stack):
    """The hand-made env waits outside the store until a later run finishes its adoption, writable by whoever
    made it. Finishing links its files into the store (which moves their inode change times); the store vouches
    for those times only when no file had changed since the adoption hashed it."""
    _hand_made_env(stack)
    killed = stack.run("adopt", extra_env={"BWSTACK_TEST_KILL_AT": "adopt-before-exchange"})
    assert killed.returncode == -signal.SIGKILL
    victim = next(stack.ml_env.glob("lib/python3.*/site-packages/fixture_dep/__init__.py"))
    st = victim.stat()
    victim.write_bytes(b"9" * st.st_size)  # same size, and the mtime put back
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    stack.run("prune", "--keep", "5", check=True)  # a command that opens the store finishes the adoption
    gen = _store(stack).generations()[0]
    assert gen.record.adopted_from == str(stack.ml_env) and not gen.env.is_symlink()
    result = stack.run("generations", "--check")
    assert "fixture_dep/__init__.py" in result.stdout, result.stdout


def test_the_kill_tests_cover_more_than_twenty_points():
    assert len(KILL_POINTS) + 12 + 2 >= 20


# ------------------------------------------------------------------------------------------------ adoption


def _hand_made_env(stack) -> Path:
    return fakestack.hand_made_env(stack.ml_env, stack.wheelhouse)


def test_adopting_a_hand_made_env_makes_it_generation_0_without_copying(stack):
    env = _hand_made_env(stack)
    marker = next(env.glob("lib/python3.*/site-packages/torch/__init__.py"))
    inode = marker.stat().st_ino
    result = stack.run("adopt", "--json", check=True)
    gen = _store(stack).get(json.loads(result.stdout)["generation"])
    assert gen.id == 0 and gen.record.nearest_profile == "fixture-old"
    assert next(gen.env.glob("lib/python3.*/site-packages/torch/__init__.py")).stat().st_ino == inode
    assert stack.ml_env.is_symlink() and _active_imports(stack) == "2.9.1"


def test_build_backs_up_a_hand_made_env_before_changing_anything(stack):
    _hand_made_env(stack)
    result = stack.build("fixture-new", "--json", check=True)
    assert json.loads(result.stdout)["backup"]["action"] == "adopted"
    assert _active_imports(stack) == "2.9.1+cu130"
    stack.run("rollback", check=True)
    assert _active_imports(stack) == "2.9.1"


def test_backup_of_a_modified_generation_snapshots_it_with_hard_links(stack):
    stack.build("fixture-new", check=True)
    gen = _store(stack).active()
    extra = next(gen.env.glob("lib/python3.*/site-packages")) / "added_by_user.py"
    extra.write_text("X = 1\n")
    result = json.loads(stack.run("backup", "--json", check=True).stdout)
    assert result["action"] == "snapshot" and result["from"] == gen.name
    snap = _store(stack).active()
    assert snap.name != gen.name and snap.verify("full") == []
    torch_init = "lib/python3.12/site-packages/torch/__init__.py"
    assert (snap.env / torch_init).stat().st_ino == (gen.env / torch_init).stat().st_ino


# ------------------------------------------------------------------------------------------------ archives


def test_archive_restores_on_a_clean_root_and_imports(stack, tmp_path):
    stack.build("fixture-old", check=True)
    archive = tmp_path / "gen.tar.zst"
    result = json.loads(stack.run("backup", "--archive", str(archive), "--json", check=True).stdout)
    assert archive.is_file() and Path(f"{archive}.sha256").read_text().split()[0] == result["archive"]["sha256"]
    clean = {
        "BWSTACK_ROOT": str(tmp_path / "new-root"),
        "BWSTACK_ML_ENV": str(tmp_path / "new-ml-env"),
        "BWSTACK_CUDA_LINK": "none",
    }
    restored = stack.run("restore", str(archive), *vouched(archive), "--json", check=True, extra_env=clean)
    payload = json.loads(restored.stdout)
    assert payload["switch"]["post_check"]["torch"] == "2.9.1"
    python = str(tmp_path / "new-ml-env" / "bin" / "python")
    out = subprocess.run([python, "-c", "import torch; print(torch.version.cuda)"], capture_output=True, text=True)
    assert out.stdout.strip() == "12.8"


def test_a_restored_generation_does_not_take_the_archives_recorded_facts_on_trust(stack, tmp_path):
    """The archive's facts.json is what its maker says the env holds; the restored generation's verify reads
    its files."""
    from bwstack.probe import sealed

    stack.build("fixture-old", check=True)
    archive = tmp_path / "gen.tar.zst"
    stack.run("backup", "--archive", str(archive), check=True)
    clean = {
        "BWSTACK_ROOT": str(tmp_path / "new-root"),
        "BWSTACK_ML_ENV": str(tmp_path / "new-ml-env"),
        "BWSTACK_CUDA_LINK": "none",
    }
    stack.run("restore", str(archive), *vouched(archive), check=True, extra_env=clean)
    gen = sealed.generation_of(tmp_path / "new-ml-env")
    assert gen is not None and not (gen / sealed.FACTS_NAME).exists()
    static, why = sealed.load_static(tmp_path / "new-ml-env", "12.0")
    assert static is None and "no facts.json" in why, why


def test_a_corrupted_archive_is_refused_and_nothing_is_switched(stack, tmp_path):
    stack.build("fixture-old", check=True)
    archive = tmp_path / "gen.tar.zst"
    stack.run("backup", "--archive", str(archive), check=True)
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    archive.write_bytes(bytes(data))
    clean = {"BWSTACK_ROOT": str(tmp_path / "r"), "BWSTACK_ML_ENV": str(tmp_path / "m"), "BWSTACK_CUDA_LINK": "none"}
    result = stack.run("restore", str(archive), extra_env=clean)
    # A damaged copy is bad input (exit 2), refused in one line before anything of it is written.
    assert result.returncode == 2 and "is not the one in gen.tar.zst.sha256" in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("point", ["restore-before-commit", "before-commit-rename", "before-flip", "after-flip"])
def test_sigkill_during_a_restore_leaves_history_consistent_with_current_and_a_rerun_converges(stack, tmp_path, point):
    stack.build("fixture-old", check=True)
    archive = tmp_path / "gen.tar.zst"
    stack.run("backup", "--archive", str(archive), check=True)
    env = {
        "BWSTACK_ROOT": str(tmp_path / "other"),
        "BWSTACK_CACHE": str(tmp_path / "other" / "cache"),
        "BWSTACK_ML_ENV": str(tmp_path / "other-env"),
        "BWSTACK_CUDA_LINK": "none",
    }
    stack.build("fixture-new", check=True, extra_env=env)
    killed = stack.run("restore", str(archive), *vouched(archive), extra_env=env | {"BWSTACK_TEST_KILL_AT": point})
    assert killed.returncode == -signal.SIGKILL
    store = Store(Layout(tmp_path / "other", tmp_path / "other-env", None, None))
    assert store.history()[-1]["to"] == store.active().name
    stack.run("restore", str(archive), *vouched(archive), check=True, extra_env=env)
    assert Store(Layout(tmp_path / "other", tmp_path / "other-env", None, None)).active().profile == "fixture-old"


# ------------------------------------------------------------------------------------------------ full disk


@pytest.fixture
def tiny_fs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "tiny"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_archive_replaces_links_left_at_its_names_instead_of_writing_through_them(stack, tmp_path):
    """The archive's folder may be a share others can write: links at the archive's, its sidecar's and the
    old partial file's names must not turn root's writes to the files they lead to."""
    stack.build("fixture-old", check=True)
    shared, victims = tmp_path / "shared", tmp_path / "victims"
    shared.mkdir()
    victims.mkdir()
    archive = shared / "gen.tar.zst"
    for suffix in ("", ".sha256", ".partial"):
        (victims / f"v{suffix}").write_text("root's file")
        Path(f"{archive}{suffix}").symlink_to(victims / f"v{suffix}")
    stack.run("backup", "--archive", str(archive), "--json", check=True)
    assert [p.read_text() for p in sorted(victims.iterdir())] == ["root's file"] * 3
    assert not archive.is_symlink() and not Path(f"{archive}.sha256").is_symlink()
    assert archive.stat().st_mode & 0o777 == 0o644


def test_the_partial_archive_a_killed_run_left_is_removed_by_the_next_one_and_nothing_else(stack, tmp_path):
    """A kill while the archive is written leaves its temporary file (it can be gigabytes on a NAS). The next
    archive to the same name removes what a killed run left: this user's own files that no run holds locked,
    never another user's file, a link, or the file of a run still writing."""
    stack.build("fixture-old", check=True)
    shared = tmp_path / "shared"
    shared.mkdir()
    archive = shared / "gen.tar.zst"
    killed = stack.run("backup", "--archive", str(archive), extra_env={"BWSTACK_TEST_KILL_AT": "archive-before-close"})
    assert killed.returncode != 0
    (left,) = shared.glob(".gen.tar.zst.*.partial")
    theirs = shared / ".gen.tar.zst.theirs.partial"
    theirs.write_text("")
    os.chown(theirs, OTHER_UID, OTHER_UID)
    victim = tmp_path / "victim"
    victim.write_text("root's file")
    (shared / ".gen.tar.zst.link.partial").symlink_to(victim)
    writing = shared / ".gen.tar.zst.writing.partial"
    writing.write_text("")
    with open(writing) as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # a run that is still writing its archive
        stack.run("backup", "--archive", str(archive), check=True)
    assert not left.exists()
    assert theirs.exists() and writing.exists() and victim.read_text() == "root's file"
    assert (shared / ".gen.tar.zst.link.partial").is_symlink()


def test_archive_to_a_full_disk_fails_cleanly_and_leaves_no_partial_file(stack, tiny_fs):
    stack.build("fixture-old", check=True)
    big = next(_store(stack).active().env.glob("lib/python3.*/site-packages")) / "padding.bin"
    big.write_bytes(os.urandom(3 << 20))  # incompressible, larger than the 1 MiB filesystem
    stack.run("backup", check=True)  # snapshot the modified env so the archive has something large
    result = stack.run("backup", "--archive", str(tiny_fs / "gen.tar.zst"))
    assert result.returncode == 1 and "disk full" in result.stderr
    assert list(tiny_fs.iterdir()) == []


def test_a_build_on_a_full_disk_fails_cleanly_and_switches_nothing(stack, tiny_fs):
    stack.build("fixture-old", check=True)
    current = os.readlink(stack.root / "current")
    # The wheel store is already warm; the new generation has to be built on the full filesystem.
    result = stack.run("build", "--profile", "fixture-new", "--wheelhouse", str(stack.wheelhouse),
                       extra_env={"BWSTACK_ROOT": str(tiny_fs / "root")})  # fmt: skip
    assert result.returncode in (1, 3, 4)
    assert "disk" in result.stderr.lower() or "space" in result.stderr.lower()
    assert os.readlink(stack.root / "current") == current
    assert _active_imports(stack) == "2.9.1"


def test_an_atomic_write_sets_mode_and_owner_through_the_open_file_never_by_name(tmp_path, monkeypatch):
    """In a folder others can write, the temporary name could be turned into a link between the write and a
    chmod by name: root would then chmod (or chown) whatever the link leads to."""
    from bwstack import fsutil

    def by_name(*_args, **_kwargs):
        raise AssertionError("changed a file's mode or owner by its name")

    monkeypatch.setattr(os, "chmod", by_name)
    monkeypatch.setattr(os, "chown", by_name)
    fsutil.atomic_write_bytes(tmp_path / "f", b"data", mode=0o640, owner=(4242, 4242))
    st = os.stat(tmp_path / "f")
    assert (tmp_path / "f").read_bytes() == b"data" and st.st_mode & 0o777 == 0o640
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == (4242, 4242)
