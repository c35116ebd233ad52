"""The store preamble's one owner: open_store takes the run lock, prepares the store (cleaning what an
interrupted run left, saying so through the caller's log) and releases the lock when the block ends."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from helpers import bwstack

from bwstack.errors import BusyError, UsageError
from bwstack.store.generations import BUILDING_PREFIX
from bwstack.store.layout import Layout
from bwstack.store.session import open_store


def test_open_store_locks_prepares_and_releases(tmp_path: Path):
    layout = Layout(tmp_path / "root", tmp_path / "ml-env", None, None)
    debris = layout.generations / f"{BUILDING_PREFIX}0007-killed"
    debris.mkdir(parents=True)
    said: list[str] = []
    with open_store(layout, said.append) as store:
        assert store.layout is layout and not debris.exists()
        with pytest.raises(BusyError, match="another bwstack run holds"), open_store(layout, said.append):
            pass
    assert said == [f"removing {debris.name} left by an interrupted run"]
    with open_store(layout, said.append):  # released: a second run may open it now
        pass


def _a_home(folder: Path) -> None:
    folder.mkdir(mode=0o700)
    (folder / ".netrc").write_text("machine example.org password secret\n")


def _sticky_shared(folder: Path) -> None:
    folder.mkdir()
    os.chmod(folder, 0o1777)
    (folder / "someone-elses-file").write_text("")


def _a_home_with_a_tool_folder(folder: Path) -> None:
    _a_home(folder)
    (folder / "tool").mkdir()


def _a_project_beside_a_lock(folder: Path) -> None:
    folder.mkdir()
    (folder / "stack.lock.yaml").write_text("")
    (folder / "README.md").write_text("")


@pytest.mark.parametrize(
    ("prepare", "why"),
    [
        (_a_home, "holds other files"),
        (_sticky_shared, "is not this user's alone"),
        (_a_home_with_a_tool_folder, "holds other files"),
        (_a_project_beside_a_lock, "holds other files"),
    ],
    ids=["a-home-folder", "a-shared-sticky-folder", "a-home-holding-a-store-name", "a-project-holding-a-lock"],
)
@pytest.mark.parametrize("command", [["prune", "--keep", "1"], ["backup"]], ids=["prune", "backup"])
def test_a_root_of_other_files_is_refused_and_left_as_it_was(tmp_path, prepare, why, command, monkeypatch):
    """A mistyped --root (a home, /tmp): opening a store makes its root 0755 and leaves the run lock and
    generations/ in it. A folder that holds anything a store does not hold is refused before any of that, even
    beside a name a store uses."""
    root = tmp_path / "not-a-store"
    prepare(root)
    before = {p.name: p.stat().st_mode for p in [root, *root.iterdir()]}
    monkeypatch.setenv("BWSTACK_CACHE", str(tmp_path / "cache"))
    result = bwstack(*command, "--root", str(root), "--ml-env", str(tmp_path / "ml-env"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"store root {root} {why}" in result.stderr
    assert {p.name: p.stat().st_mode for p in [root, *root.iterdir()]} == before


@pytest.mark.parametrize("kept", ["generations", "tool", "stack.lock.yaml"])
def test_a_root_holding_what_bwstack_puts_in_a_store_opens(tmp_path, kept):
    """The tool role installs bwstack and the lock under the root before the first generation is built."""
    layout = Layout(tmp_path / "root", tmp_path / "ml-env", None, None)
    layout.root.mkdir()
    (layout.root / kept).mkdir()
    with open_store(layout, lambda _line: None) as store:
        assert store.layout.generations.is_dir()


@pytest.mark.parametrize(
    "passing",
    [
        ".history.jsonl.k3j2_x.tmp",
        ".provisioned.json.a8Zq0b.tmp",
        ".ansible_tmpq1w2e3r4stack.lock.yaml",
        "lost+found",
        ".nfs000000000a1b2c300000001",
    ],
)
def test_a_root_holding_a_write_in_progress_opens(tmp_path, passing):
    """An atomic write killed halfway (bwstack's own, or Ansible's copy of the lock) leaves a hidden temporary
    file of a store's name behind, and a root that is a filesystem of its own has lost+found (NFS: .nfs files);
    the store is still the store."""
    layout = Layout(tmp_path / "root", tmp_path / "ml-env", None, None)
    layout.root.mkdir()
    (layout.root / "generations").mkdir()
    (layout.root / passing).write_text("")
    with open_store(layout, lambda _line: None) as store:
        assert store.layout.generations.is_dir()


@pytest.mark.parametrize(
    "hidden", [".netrc.x.tmp", ".bashrc", ".tool.abc.tmp.keep", ".ansible_tmpabc.netrc", ".ansible_tmpq1w2e3r4.netrc"]
)
def test_a_hidden_file_not_of_a_store_is_refused(tmp_path, hidden):
    layout = Layout(tmp_path / "root", tmp_path / "ml-env", None, None)
    layout.root.mkdir()
    (layout.root / "generations").mkdir()
    (layout.root / hidden).write_text("")
    with pytest.raises(UsageError, match="holds other files"), open_store(layout, lambda _line: None):
        pass
    assert not (layout.root / "bwstack.lock").exists()


def test_a_root_another_user_owns_is_refused_and_left_as_it_was(tmp_path):
    """Another user's store is theirs: root running bwstack would otherwise take the lock in it and write
    generations/ into a folder that user controls."""
    layout = Layout(tmp_path / "root", tmp_path / "ml-env", None, None)
    layout.root.mkdir(mode=0o700)
    os.chown(layout.root, 65534, 65534)
    refused = pytest.raises(UsageError, match=r"the store root .* is not this user's alone \(.*65534")
    with refused, open_store(layout, print):
        pass
    assert os.listdir(layout.root) == [] and stat.S_IMODE(os.stat(layout.root).st_mode) == 0o700


def test_a_root_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "root").symlink_to("real")
    layout = Layout(tmp_path / "root", tmp_path / "ml-env", None, None)
    with pytest.raises(UsageError, match="is not a directory \\(a link or a file\\)"), open_store(layout, print):
        pass
    assert os.listdir(tmp_path / "real") == []


@pytest.mark.parametrize("exists", [True, False], ids=["a-store-there", "a-store-to-be-made"])
def test_a_root_in_a_folder_another_user_owns_is_refused(tmp_path, exists):
    """Who can write the folder above the root can rename the root away after the check and put a folder of
    theirs in its place: the run would open the store, its lock and generations/, in a folder they control."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    layout = Layout(theirs / "store", tmp_path / "ml-env", None, None, cache_dir=tmp_path / "cache")
    if exists:
        (layout.root / "generations").mkdir(parents=True)
    with pytest.raises(UsageError, match="the store root"), open_store(layout, print):
        pass
    assert not (layout.root / "bwstack.lock").exists()


def test_a_folder_another_user_makes_on_the_way_to_a_new_root_is_refused(tmp_path, monkeypatch):
    """Below a sticky shared folder (/tmp) another user can make a missing folder between the check and the
    mkdir of the root: the root is judged again once it is made."""
    from bwstack.store import session

    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    layout = Layout(sticky / "x" / "store", tmp_path / "ml-env", None, None, cache_dir=tmp_path / "cache")
    checked = session.check_private_folder
    calls = []

    def check_then_lose_the_race(folder, what, setting):
        checked(folder, what, setting)
        if not calls:
            (sticky / "x").mkdir()  # the other user's folder, made in the window
            os.chown(sticky / "x", 65534, 65534)
        calls.append(folder)

    monkeypatch.setattr(session, "check_private_folder", check_then_lose_the_race)
    with (
        pytest.raises(UsageError, match=r"store root .* cannot be made: a folder uid 65534 owns"),
        open_store(layout, print),
    ):
        pass
    assert os.listdir(sticky / "x") == []  # nothing of root's left in the other user's folder


def test_a_link_another_user_plants_on_the_way_to_a_new_root_is_never_made_through(tmp_path, monkeypatch):
    """makedirs would follow it and make root's folders wherever it points; the store's folders are made one name
    at a time, none through a link, and those this run made are removed again on a refusal."""
    from bwstack.store import session

    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    layout = Layout(sticky / "x" / "b" / "store", tmp_path / "ml-env", None, None, cache_dir=tmp_path / "cache")
    checked = session.check_private_folder

    def check_then_lose_the_race(folder, what, setting):
        checked(folder, what, setting)
        if not (sticky / "x").is_symlink():
            (sticky / "x").symlink_to(victim)  # the other user's link, made in the window
            os.lchown(sticky / "x", 65534, 65534)

    monkeypatch.setattr(session, "check_private_folder", check_then_lose_the_race)
    with pytest.raises(UsageError, match="cannot be made"), open_store(layout, print):
        pass
    assert os.listdir(victim) == []


def _an_empty_store(folder: Path) -> Path:
    with open_store(Layout(folder, folder.parent / "ml-env", None, None), lambda _line: None):
        pass
    return folder


@pytest.mark.parametrize(
    "inside",
    ["nested", "generations/0000-cu128-abc/env/x", "cache/wheels/mine"],
    ids=["beside-its-generations", "in-a-generation", "in-its-cache"],
)
@pytest.mark.parametrize("command", [["prune", "--keep", "1"], ["backup"]], ids=["prune", "backup"])
def test_a_root_inside_another_store_is_refused_and_nothing_is_made_there(tmp_path, inside, command, monkeypatch):
    """A store made inside another would be files that store does not know: a generation that fails its manifest
    check, a root holding other files that its own prune then refuses."""
    outer = _an_empty_store(tmp_path / "outer")
    before = sorted(str(p.relative_to(outer)) for p in outer.rglob("*"))
    monkeypatch.setenv("BWSTACK_CACHE", str(tmp_path / "cache"))
    root = outer / inside
    result = bwstack(*command, "--root", str(root), "--ml-env", str(tmp_path / "ml-env"), "--cuda-link", "none")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"store root {root} is inside the store {outer}" in result.stderr
    assert sorted(str(p.relative_to(outer)) for p in outer.rglob("*")) == before


def test_a_root_beside_another_store_opens(tmp_path):
    _an_empty_store(tmp_path / "one")
    assert (_an_empty_store(tmp_path / "two") / "generations").is_dir()


@pytest.mark.parametrize(
    ("ml_env", "cuda_link"),
    [("env", "env"), ("root/env", "cuda"), ("env", "root/cuda"), ("root", "cuda"), ("env", "env/cuda")],
    ids=["both-links-at-one-path", "env-link-in-the-store", "cuda-link-in-the-store", "env-link-is-the-store",
         "cuda-link-below-the-env-link"],
)  # fmt: skip
def test_a_store_and_links_that_overlap_are_refused_before_anything_is_touched(tmp_path, ml_env, cuda_link):
    """The env link re-pointed at the toolkit (both links at one path) left the env without its python."""
    result = bwstack("rollback", "--root", str(tmp_path / "root"), "--ml-env", str(tmp_path / ml_env),
                     "--cuda-link", str(tmp_path / cuda_link), "--take-over-links")  # fmt: skip
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "must be three separate places" in result.stderr
    assert list(tmp_path.iterdir()) == []


def _a_folder_of_other_files(tmp_path: Path) -> Path:
    folder = tmp_path / "notastore"
    folder.mkdir()
    (folder / "important.txt").write_text("kept\n")
    return folder


def _a_link_to_a_store(tmp_path: Path) -> Path:
    (tmp_path / "slink").symlink_to(_an_empty_store(tmp_path / "store"))
    return tmp_path / "slink"


@pytest.mark.parametrize(
    ("root_of", "says"),
    [(_a_folder_of_other_files, "no bwstack store at"), (_a_link_to_a_store, "no bwstack store at")],
    ids=["a-folder-that-is-no-store", "a-link-to-a-store"],
)
def test_the_waivers_command_writes_only_into_a_store_named_as_it_is(tmp_path, root_of, says):
    root = root_of(tmp_path)
    before = {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}
    result = bwstack("waivers", "--root", str(root), "--set", "nvcc=no toolkit here")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and says in result.stderr, result.stderr
    assert {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")} == before


def test_the_waivers_command_waits_for_no_one_and_changes_nothing_while_another_run_holds_the_store(tmp_path):
    store = _an_empty_store(tmp_path / "store")
    with open_store(Layout(store, tmp_path / "ml-env", None, None), lambda _line: None):
        result = bwstack("waivers", "--root", str(store), "--set", "nvcc=no toolkit here")
    assert result.returncode == 3 and "another bwstack run holds" in result.stderr, result.stderr
    assert not (store / "waivers.json").exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [(["--check"], "--check: give --set or --clear"),
     (["--set", "runtime=no check is called this"], "--set runtime: no check's name contains 'runtime'"),
     (["--set", "nvcc"], "expected CHECK=REASON")],
    ids=["check-alone", "a-waiver-matching-no-check", "a-waiver-without-its-reason"],
)  # fmt: skip
def test_the_waivers_command_refuses_what_would_do_nothing(tmp_path, args, says):
    store = _an_empty_store(tmp_path / "store")
    result = bwstack("waivers", "--root", str(store), *args)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and says in result.stderr, result.stderr
    assert not (store / "waivers.json").exists()


def _a_store_at(place: str):
    def make(root: Path) -> Path:
        root.mkdir()
        return _an_empty_store(root / place)

    return make


@pytest.mark.parametrize(
    "place", ["generations", "generations/node-a", "cache", "cache/node-a"],
    ids=["a-store-named-generations", "a-store-among-its-generations", "a-store-named-cache", "a-store-in-its-cache"],
)  # fmt: skip
def test_a_root_holding_a_store_where_a_store_keeps_its_own_is_refused(tmp_path, place, monkeypatch):
    """Its prune would remove the inner store as a stray generation; its cache would write into it."""
    root = tmp_path / "outer"
    inner = _a_store_at(place)(root)
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    monkeypatch.setenv("BWSTACK_CACHE", str(tmp_path / "cache"))
    result = bwstack("prune", "--keep", "1", "--root", str(root), "--ml-env", str(tmp_path / "env"),
                     "--cuda-link", "none")  # fmt: skip
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"store root {root} holds the store {inner}" in result.stderr
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before


@pytest.mark.parametrize(
    "cuda_link", ["x/../env", "linked/env", "linked/root/cuda"],
    ids=["dot-dot-to-the-env-link", "a-linked-folder-to-the-env-link", "a-linked-folder-into-the-store"],
)  # fmt: skip
def test_a_store_and_links_that_overlap_through_links_or_dot_dot_are_refused(tmp_path, cuda_link):
    (tmp_path / "linked").symlink_to(tmp_path)
    result = bwstack("rollback", "--root", str(tmp_path / "root"), "--ml-env", str(tmp_path / "env"),
                     "--cuda-link", f"{tmp_path}/{cuda_link}", "--take-over-links")  # fmt: skip
    assert result.returncode == 2 and "must be three separate places" in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["linked"]


def test_the_waivers_command_leaves_the_stores_repairs_to_commands_given_its_links(tmp_path):
    """--root alone may name the store: finishing an interrupted adoption needs the env link it was adopting."""
    store = _an_empty_store(tmp_path / "store")
    debris = store / "generations" / f"{BUILDING_PREFIX}0001-killed"
    debris.mkdir()
    result = bwstack("waivers", "--root", str(store), "--set", "nvcc=no toolkit here")
    assert result.returncode == 0, result.stderr
    assert debris.is_dir() and (store / "waivers.json").is_file()
