"""The controller's cache folder (`bwstack controller-facts --probe-dir / --wheel-dir`, the roles'
bwstack_controller_cache): the probe zipapp and bwstack's wheel written there are shipped to nodes and run as
root. A file found there is used only if this user's folder is closed to others and the file holds the bytes
expected of it; files are written new and renamed into place, never through a link someone left at the name."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bwstack.fleet import probe_bundle

REPO = Path(__file__).resolve().parents[2]
PROBE = f"bwstack-probe-{probe_bundle.digest()}.pyz"


def _facts(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bwstack", "--lock", str(REPO / "stack.lock.yaml"), "controller-facts", *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _probe_in(folder: Path) -> Path:
    done = _facts("--probe-dir", str(folder))
    assert done.returncode == 0, done.stderr
    return Path(json.loads(done.stdout)["probe"])


def test_a_file_of_other_bytes_under_the_probes_name_is_replaced(tmp_path):
    (tmp_path / PROBE).write_bytes(b"someone else's zipapp")
    assert _probe_in(tmp_path).read_bytes() == probe_bundle.build()


def test_a_link_under_the_probes_name_is_replaced_and_what_it_led_to_is_untouched(tmp_path):
    folder, victim = tmp_path / "cache", tmp_path / "victim"
    folder.mkdir()
    victim.write_text("root's file")
    (folder / PROBE).symlink_to(victim)
    placed = _probe_in(folder)
    assert not placed.is_symlink() and placed.read_bytes() == probe_bundle.build()
    assert victim.read_text() == "root's file"


def test_a_folder_others_could_write_is_closed_and_what_it_held_is_made_again(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    os.chmod(folder, 0o777)
    (folder / PROBE).write_bytes(probe_bundle.build())  # the right bytes, but anyone could have put them there
    before = os.stat(folder / PROBE).st_ino
    placed = _probe_in(folder)
    assert os.stat(folder).st_mode & 0o022 == 0
    assert os.stat(placed).st_ino != before


@pytest.mark.parametrize("kind", ["link", "other-owner"])
def test_a_folder_that_is_not_this_users_is_refused_in_one_line(tmp_path, kind):
    real = tmp_path / "real"
    real.mkdir()
    folder = tmp_path / "cache"
    if kind == "link":
        folder.symlink_to(real)
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to give the folder to another user")
        folder.mkdir()
        os.chown(folder, 65534, 65534)
    done = _facts("--probe-dir", str(folder))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "not a directory of this user's" in done.stderr
    assert list(real.iterdir()) == []


def test_missing_folders_are_made_for_this_user_alone_whatever_the_umask(tmp_path):
    done = subprocess.run(
        f"umask 002; {sys.executable} -m bwstack --lock {REPO / 'stack.lock.yaml'} controller-facts "
        f"--probe-dir {tmp_path / 'home' / '.cache' / 'bwstack'}",
        shell=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for folder in (tmp_path / "home", tmp_path / "home" / ".cache", tmp_path / "home" / ".cache" / "bwstack"):
        assert folder.stat().st_mode & 0o777 == 0o700, folder


@pytest.mark.parametrize("kind", ["world-writable", "another-owner", "link-in-the-middle"])
def test_a_folder_above_that_others_could_replace_is_refused_in_one_line(tmp_path, kind):
    """Whoever can write a folder above the cache, or one a link on the way leads through, can move the cache
    aside and put their own in its place."""
    above = tmp_path / "above"
    (above / "cache").mkdir(parents=True)
    if kind == "link-in-the-middle":  # home/u -> open/u -> above: the open folder is on neither path's parents
        (tmp_path / "open").mkdir(mode=0o777)
        os.chmod(tmp_path / "open", 0o777)
        (tmp_path / "open" / "u").symlink_to(above)
        (tmp_path / "home").mkdir()
        (tmp_path / "home" / "u").symlink_to(tmp_path / "open" / "u")
        done = _facts("--probe-dir", str(tmp_path / "home" / "u" / "cache"))
        assert done.returncode == 2 and f"{tmp_path / 'open'} is writable by everyone" in done.stderr, done.stderr
        return
    if kind == "world-writable":
        os.chmod(above, 0o777)
    elif os.geteuid() == 0:
        os.chown(above, 65534, 65534)
    else:
        pytest.skip("needs root to give the folder to another user")
    done = _facts("--probe-dir", str(above / "cache"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert str(above) in done.stderr and list((above / "cache").iterdir()) == []


def test_the_wheel_stamp_is_trusted_for_nothing_it_cannot_be(tmp_path):
    """A FIFO in place of the stamp (it hung the command) and then a stamp that names a wheel outside the folder,
    with that wheel's true hash and the checkout's true source digest: neither is used, each is built again."""
    folder = tmp_path / "wheel"
    folder.mkdir()
    os.mkfifo(folder / ".bwstack-wheel.json")
    done = _facts("--wheel-dir", str(folder), timeout=120)
    assert done.returncode == 0, done.stderr
    built = json.loads(done.stdout)["wheel"]
    assert Path(built["path"]).parent == folder
    stamp = json.loads((folder / ".bwstack-wheel.json").read_text())
    outside = tmp_path / "bwstack-9.9.9-py3-none-any.whl"
    outside.write_bytes(b"not bwstack")
    stamp.update(name=f"../{outside.name}", sha256=hashlib.sha256(outside.read_bytes()).hexdigest())
    (folder / ".bwstack-wheel.json").write_text(json.dumps(stamp))
    done = _facts("--wheel-dir", str(folder), timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["wheel"] == built
