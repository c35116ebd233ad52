"""Files bwstack writes where the user points it (`render --layers DIR`, `verify --facts-dir DIR`): a link already
at a file's name, which anyone who can write the folder could have put there, is replaced by the new file, never
written through. The stacks are TEST FIXTURES (fakestack: small test-built wheels)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REAL_LOCK, bwstack, needs_py312


def _planted_link(folder: Path, name: str) -> Path:
    """folder/name: a link to a file outside the folder; returns that file (its bytes must stay as they are)."""
    folder.mkdir(parents=True, exist_ok=True)
    victim = folder.parent / "victim"
    victim.write_text("not bwstack's\n")
    (folder / name).symlink_to(victim)
    return victim


def test_render_layers_replaces_a_link_at_a_layers_name_instead_of_writing_through_it(tmp_path):
    out = tmp_path / "layers"
    victim = _planted_link(out, "01-cuda-torch.txt")
    bwstack("--lock", str(REAL_LOCK), "render", "--profile", "cu128", "--layers", str(out), check=True)
    assert victim.read_text() == "not bwstack's\n"
    layer = out / "01-cuda-torch.txt"
    assert not layer.is_symlink() and "layer 1/3 (cuda-torch)" in layer.read_text()


@needs_py312
def test_verify_facts_dir_replaces_a_link_at_a_hosts_name_instead_of_writing_through_it(stack):
    stack.build("fixture-new", check=True)
    out = stack.tmp / "facts"
    victim = _planted_link(out, "local.json")
    umask = os.umask(0o077)  # the verify inherits it, as from a user's shell
    try:
        stack.run("verify", "--no-runtime", "--facts-dir", str(out))
    finally:
        os.umask(umask)
    assert victim.read_text() == "not bwstack's\n"
    assert not (out / "local.json").is_symlink() and (out / "local.json").read_text().startswith("{")
    assert stat.S_IMODE((out / "local.json").stat().st_mode) == 0o600, "the user's umask, as for any new file"


@pytest.mark.parametrize(
    "where", ["/proc/bwstack-facts", "/etc/hostname/facts"], ids=["cannot-be-made", "under-a-file"]
)
def test_a_facts_dir_that_cannot_be_made_is_refused_in_one_line_before_any_check(where):
    result = bwstack("verify", "--no-runtime", "--facts-dir", where)
    assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
    assert f"--facts-dir {where}: cannot be made" in result.stderr


def test_render_layers_files_get_the_users_umask_as_any_new_file_would(tmp_path):
    """A user who keeps a umask of 077 does not get files others can read."""
    out = tmp_path / "layers"
    args = [sys.executable, "-m", "bwstack", "--lock", str(REAL_LOCK), "render", "--profile", "cu128", "--layers"]
    subprocess.run([*args, str(out)], check=True, capture_output=True, preexec_fn=lambda: os.umask(0o077))
    modes = {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes == {0o600}


def test_a_rewritten_lock_keeps_its_mode_and_a_new_one_gets_the_umasks(tmp_path):
    from bwstack.lock.resolve import write_lock

    kept = tmp_path / "kept.yaml"
    kept.write_text("old\n")
    kept.chmod(0o664)
    write_lock(kept, "new\n")
    assert kept.read_text() == "new\n" and stat.S_IMODE(kept.stat().st_mode) == 0o664
    old_umask = os.umask(0o027)
    try:
        write_lock(tmp_path / "new.yaml", "new\n")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE((tmp_path / "new.yaml").stat().st_mode) == 0o640
