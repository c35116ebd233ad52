"""`bwstack accept --record DIR` runs as root and writes the node's facts and kernel log into DIR: DIR is new or
an empty folder that only this user can change, and the Recorder writes through descriptors of the folder it
opened and checked, following no link, so a name swapped in the recording by another user (a `commands` folder
renamed, a `<name>.argv` link to a root-only file) never turns root's write into one elsewhere. The folders and
files here are TEST FIXTURES; the victim files stand for root-only files such as /etc/shadow."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import OTHER_UID, REAL_LOCK, acl_for_another_user, bwstack

from bwstack.probe.hw import machine as machine_mod
from bwstack.probe.hw.machine import Machine, Output, Recorder

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving folders to another user needs root")
OTHER_GID = 65534  # nogroup: not this user's private group
VICTIM_BYTES = b"root-only config\n"


def _accept(*args: str) -> object:
    return bwstack("--lock", str(REAL_LOCK), "accept", "--no-runtime", *args, timeout=120)


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every path under `root` (root included) with what it is: a change anywhere shows."""
    found = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            found[str(path)] = ("link", os.readlink(path), st.st_uid)
        elif stat.S_ISREG(st.st_mode):
            found[str(path)] = ("file", st.st_mode, st.st_uid, path.read_bytes())
        else:
            found[str(path)] = ("dir", st.st_mode, st.st_uid, st.st_mtime_ns)
    return found


# ------------------------------------------------------------------------------------------------ hostile DIR
# Each maker builds the hostile DIR under tmp_path/case and returns (DIR, part of the one-line error).


def _empty(tmp_path: Path, mode: int = 0o700) -> Path:
    folder = tmp_path / "case" / "rec"
    folder.mkdir(parents=True)
    folder.chmod(mode)
    return folder


def _not_empty(tmp_path: Path) -> tuple[Path, str]:
    folder = _empty(tmp_path)
    (folder / "keep").write_bytes(VICTIM_BYTES)
    return folder, "is not empty"


def _of_another_user(tmp_path: Path) -> tuple[Path, str]:
    folder = _empty(tmp_path, 0o755)
    os.chown(folder, OTHER_UID, OTHER_GID)
    return folder, f"belongs to uid {OTHER_UID}"


def _writable_by_everyone(tmp_path: Path) -> tuple[Path, str]:
    folder = _empty(tmp_path, 0o777)
    folder.chmod(0o777)  # past the umask
    return folder, "writable by everyone"


def _writable_by_a_shared_group(tmp_path: Path) -> tuple[Path, str]:
    folder = _empty(tmp_path)
    os.chown(folder, -1, OTHER_GID)
    folder.chmod(0o770)
    return folder, f"writable by group {OTHER_GID}"


def _with_an_acl(tmp_path: Path) -> tuple[Path, str]:
    folder = _empty(tmp_path)
    acl_for_another_user(folder)
    return folder, "given to others by an access ACL"


def _a_link(tmp_path: Path) -> tuple[Path, str]:
    real = _empty(tmp_path)
    link = real.with_name("link")
    link.symlink_to(real)
    return link, "is a link"


def _a_file(tmp_path: Path) -> tuple[Path, str]:
    folder = _empty(tmp_path)
    (folder / "file").write_bytes(VICTIM_BYTES)
    return folder / "file", "is not a directory"


def _new_in_a_folder_of_another_user(tmp_path: Path) -> tuple[Path, str]:
    above = _empty(tmp_path, 0o755)
    os.chown(above, OTHER_UID, OTHER_GID)
    return above / "deeper" / "rec", f"belongs to uid {OTHER_UID}"


def _new_under_a_link_of_another_user(tmp_path: Path) -> tuple[Path, str]:
    real = _empty(tmp_path)
    link = real.with_name("link")
    link.symlink_to(real)
    os.lchown(link, OTHER_UID, OTHER_GID)
    return link / "rec", f"the link {link} belongs to uid {OTHER_UID}"


HOSTILE: list[Callable[[Path], tuple[Path, str]]] = [
    _not_empty,
    _of_another_user,
    _writable_by_everyone,
    _writable_by_a_shared_group,
    _with_an_acl,
    _a_link,
    _a_file,
    _new_in_a_folder_of_another_user,
    _new_under_a_link_of_another_user,
]


@needs_root
@pytest.mark.parametrize("make", HOSTILE, ids=[m.__name__.lstrip("_") for m in HOSTILE])
def test_a_hostile_record_folder_is_one_line_exit_2_and_nothing_is_written(tmp_path, make):
    folder, why = make(tmp_path)
    before = _snapshot(tmp_path / "case")
    result = _accept("--record", str(folder))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("bwstack: error: --record"), result.stderr
    assert why in result.stderr, result.stderr
    assert _snapshot(tmp_path / "case") == before


# The Recorder checks the folder it opened itself: a folder swapped after the command's check is refused too.
RECORDER_REFUSES = [
    (_not_empty, "is not empty"),
    (_of_another_user, f"belongs to uid {OTHER_UID}"),
    (_writable_by_everyone, "is writable by others"),
    (_writable_by_a_shared_group, "is writable by others"),
    (_with_an_acl, "given to others by an access ACL"),
    (_a_link, "Not a directory"),  # O_NOFOLLOW|O_DIRECTORY on a link: ENOTDIR
    (_a_file, "Not a directory"),
]


@needs_root
@pytest.mark.parametrize(("make", "why"), RECORDER_REFUSES, ids=[m.__name__.lstrip("_") for m, _ in RECORDER_REFUSES])
def test_the_recorder_itself_refuses_a_hostile_folder_on_its_descriptor(tmp_path, make, why):
    folder, _ = make(tmp_path)
    before = _snapshot(tmp_path / "case")
    with pytest.raises((ValueError, OSError), match=why):
        Recorder(folder)
    assert _snapshot(tmp_path / "case") == before


# ------------------------------------------------------------------------------------------------ swapped names


def _fake_commands(monkeypatch) -> None:
    """Commands answer at once and the same everywhere (the test is about where their outputs go)."""
    monkeypatch.setattr(machine_mod, "_run_live", lambda alternatives: Output(alternatives[0], 3, "out\n", "err\n"))


def _victims(tmp_path: Path) -> Path:
    """tmp_path/outside: a root-only file under every name a write could be sent to."""
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("victim", "lspci.txt", "lspci.argv", "lspci.exit", "lspci.stderr", "cmdline", UNREADABLE):
        (outside / name).write_bytes(VICTIM_BYTES)
        (outside / name).chmod(0o600)
    return outside


UNREADABLE = machine_mod.UNREADABLE_FILE


def _commands_is_a_link(rec: Path, outside: Path) -> None:
    os.rename(rec / "commands", rec / "old-commands")
    (rec / "commands").symlink_to(outside)


def _argv_links_in_a_new_commands(rec: Path, outside: Path) -> None:
    """The attack as reproduced: commands/ renamed, a new one with `<name>.<part>` links to a root-only file."""
    os.rename(rec / "commands", rec / "old-commands")
    (rec / "commands").mkdir()
    for part in ("txt", "argv", "exit", "stderr"):
        (rec / "commands" / f"lspci.{part}").symlink_to(outside / "victim")


def _proc_is_a_link(rec: Path, outside: Path) -> None:
    (rec / "proc").symlink_to(outside)


def _cmdline_is_a_link(rec: Path, outside: Path) -> None:
    (rec / "proc").mkdir()
    (rec / "proc" / "cmdline").symlink_to(outside / "victim")


def _unreadable_is_a_link(rec: Path, outside: Path) -> None:
    (rec / UNREADABLE).symlink_to(outside / "victim")


def _record_command(recorder: Recorder) -> None:
    recorder.run("lspci")


def _record_file(recorder: Recorder) -> None:
    recorder.read("/proc/cmdline")


def _record_unreadable(recorder: Recorder) -> None:
    recorder._save_unreadable("/proc/kcore", "not readable")


@pytest.fixture
def recorders():
    """Recorder(folder), closed when the test ends (failed or not)."""
    made: list[Recorder] = []

    def make(folder: Path) -> Recorder:
        made.append(Recorder(folder))
        return made[-1]

    yield make
    for recorder in made:
        recorder.close()


# (case, plant, record, refused, the file then written into the recording's own folder when not refused)
PLANTED = [
    ("commands-is-a-link", _commands_is_a_link, _record_command, True, None),
    ("argv-links-in-a-new-commands", _argv_links_in_a_new_commands, _record_command, False, "commands/lspci.argv"),
    ("proc-is-a-link", _proc_is_a_link, _record_file, True, None),
    ("cmdline-is-a-link", _cmdline_is_a_link, _record_file, False, "proc/cmdline"),
    ("unreadable-json-is-a-link", _unreadable_is_a_link, _record_unreadable, False, UNREADABLE),
]


@pytest.mark.parametrize(("case", "plant", "record", "refused", "written"), PLANTED, ids=[c[0] for c in PLANTED])
def test_a_link_planted_in_the_recording_is_never_written_through(
    tmp_path, monkeypatch, recorders, case, plant, record, refused, written
):
    _fake_commands(monkeypatch)
    outside = _victims(tmp_path)
    before = _snapshot(outside)
    rec = tmp_path / "rec"
    recorder = recorders(rec)
    plant(rec, outside)  # after the Recorder opened and checked the folder, before it writes
    try:
        record(recorder)
        refused_now = False
    except OSError:
        refused_now = True  # a link where the recording needs a folder
    assert _snapshot(outside) == before  # the point: root's write went nowhere outside
    assert refused_now is refused
    if written:
        st = (rec / written).lstat()
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, written


def test_a_refused_write_says_where_and_why(tmp_path, monkeypatch, recorders):
    _fake_commands(monkeypatch)
    outside = _victims(tmp_path)
    recorder = recorders(tmp_path / "rec")
    _commands_is_a_link(tmp_path / "rec", outside)
    with pytest.raises(OSError, match="the recording needs its own folder there") as raised:
        recorder.run("lspci")
    assert raised.value.filename == str(tmp_path / "rec" / "commands")


# ------------------------------------------------------------------------------------------------ a recording


def _modes(rec: Path) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {"dir": set(), "file": set()}
    for path in [rec, *rec.rglob("*")]:
        st = path.lstat()
        if stat.S_ISDIR(st.st_mode):
            found["dir"].add(stat.S_IMODE(st.st_mode))
        elif stat.S_ISREG(st.st_mode):
            found["file"].add(stat.S_IMODE(st.st_mode))
    return found


def test_a_new_record_folder_is_made_private_and_replays(tmp_path):
    rec = tmp_path / "new" / "deeper" / "rec"
    live = _accept("--json", "--record", str(rec))
    assert live.returncode in (0, 1), live.stderr
    assert _modes(rec) == {"dir": {0o700}, "file": {0o600}}
    assert not list(rec.rglob(".bwstack-new"))  # no temporary file left behind
    assert Machine.recorded(rec).read("/proc/cmdline") == Path("/proc/cmdline").read_text()
    assert not (rec / "commands" / "kernel-log.argv").is_symlink()
    replay = bwstack("--lock", str(REAL_LOCK), "accept", "--machine", str(rec), "--json", timeout=120)
    findings = [
        [(f["check"], f["verdict"], f["detail"]) for f in json.loads(r.stdout)["findings"]] for r in (live, replay)
    ]
    assert findings[0] == findings[1]


def test_an_empty_folder_of_this_user_is_used_and_made_private(tmp_path):
    rec = tmp_path / "rec"
    rec.mkdir()
    rec.chmod(0o755)
    result = _accept("--record", str(rec))
    assert result.returncode in (0, 1), result.stderr
    assert _modes(rec) == {"dir": {0o700}, "file": {0o600}}
    assert (rec / "proc" / "cmdline").read_text() == Path("/proc/cmdline").read_text()


def test_the_recorder_lets_its_folders_go(tmp_path, monkeypatch):
    _fake_commands(monkeypatch)
    before = len(os.listdir("/proc/self/fd"))
    recorder = Recorder(tmp_path / "rec")
    recorder.run("lspci")
    recorder.read("/proc/cmdline")
    recorder.listdir("/sys/class")
    recorder.close()
    recorder.close()  # twice is harmless
    assert len(os.listdir("/proc/self/fd")) == before
