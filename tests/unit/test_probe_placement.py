"""Where the node checks put the probe zipapp on a node before running it as the connecting user (root, mostly):
in that user's own folder (~/.cache/bwstack, 0700), and a copy found there runs only if it is the user's regular
file with the bundle's hash. It used to be /tmp/bwstack-probe-<digest>.pyz, reused when any file was there: any
local user could leave one for root to run. Run here through testinfra's local backend, HOME pointing at a
temporary folder."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import testinfra

from bwstack.checks.verify import HostUnavailable
from bwstack.fleet import probe_bundle

REPO = Path(__file__).resolve().parents[2]


def _infra():
    spec = importlib.util.spec_from_file_location("infra_conftest", REPO / "tests" / "infra" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def _place() -> Path:
    return Path(_infra()._remote_probe(testinfra.get_host("local://")))


def _folder(home: Path) -> Path:
    return home / ".cache" / "bwstack"


def test_the_probe_goes_into_the_users_own_private_folder_with_the_bundles_bytes(home):
    placed = _place()
    assert placed.parent == _folder(home)
    assert placed.read_bytes() == probe_bundle.build()
    assert _folder(home).stat().st_mode & 0o777 == 0o700


def test_a_file_left_under_the_probes_name_in_tmp_is_never_used(home):
    planted = Path("/tmp") / f"bwstack-probe-{probe_bundle.digest()}.pyz"
    existed = planted.exists()
    if not existed:
        planted.write_bytes(b"someone else's code")
    try:
        assert _place().parent == _folder(home)
    finally:
        if not existed:
            planted.unlink()


def test_a_copy_with_other_bytes_is_replaced_before_anything_runs_it(home):
    placed = _place()
    placed.write_bytes(b"import os; os.system('id > /tmp/owned')")
    assert _place() == placed and placed.read_bytes() == probe_bundle.build()


def test_a_link_in_place_of_the_probe_is_replaced_and_what_it_led_to_is_untouched(home, tmp_path):
    elsewhere = tmp_path / "elsewhere.pyz"
    elsewhere.write_bytes(probe_bundle.build())  # even with the right bytes: a link may be retargeted later
    placed = _place()
    placed.unlink()
    placed.symlink_to(elsewhere)
    assert _place() == placed and not placed.is_symlink() and placed.read_bytes() == probe_bundle.build()
    assert elsewhere.read_bytes() == probe_bundle.build()


def test_a_link_in_place_of_the_folder_is_refused_in_one_line(home, tmp_path):
    (home / ".cache").mkdir()
    (tmp_path / "shared").mkdir(mode=0o777)
    _folder(home).symlink_to(tmp_path / "shared")
    with pytest.raises(HostUnavailable, match="is not a directory of"):
        _place()
    assert list((tmp_path / "shared").iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the folder to another user")
def test_a_folder_another_user_owns_is_refused(home):
    _folder(home).mkdir(parents=True)
    os.chown(_folder(home), 65534, 65534)
    with pytest.raises(HostUnavailable, match="is not a directory of"):
        _place()


def test_the_probe_runs_from_the_bytes_it_was_checked_against(home):
    placed = _place()
    command = _infra()._probe_command(sys.executable, str(placed), ["--help"])
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "bwstack-probe" in done.stdout, done.stderr


def test_a_probe_changed_after_it_was_placed_is_not_run(home, tmp_path):
    """Whoever could write a folder above the probe could swap it between the placement's check and the run:
    the run checks the bytes it runs."""
    placed = _place()
    marker = tmp_path / "ran"
    placed.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    command = _infra()._probe_command(sys.executable, str(placed), ["--help"])
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "changed after it was placed" in done.stderr
    assert not marker.exists()


def test_a_home_folder_whose_name_holds_a_space_works(tmp_path, monkeypatch):
    home = tmp_path / "the home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    placed = _place()
    assert placed.parent == _folder(home) and placed.read_bytes() == probe_bundle.build()
    assert _place() == placed  # and found again


def test_the_probe_imports_nothing_from_the_folder_it_is_started_in(home, tmp_path):
    """With `python -c`, the working directory comes first on sys.path: anyone who can write it could leave a
    hashlib.py there for root to import. The probe runs isolated (-I)."""
    placed = _place()
    folder, marker = tmp_path / "shared", tmp_path / "ran"
    folder.mkdir()
    (folder / "hashlib.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nraise ImportError\n")
    command = _infra()._probe_command(sys.executable, str(placed), ["--help"])
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60, cwd=folder)
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
