"""Files bwstack writes where the user points it (`render --layers DIR`, `verify --facts-dir DIR`): a link already
at a file's name, which anyone who can write the folder could have put there, is replaced by the new file, never
written through. The stacks are TEST FIXTURES (fakestack: small test-built wheels)."""

from __future__ import annotations

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
    stack.run("verify", "--no-runtime", "--facts-dir", str(out))
    assert victim.read_text() == "not bwstack's\n"
    assert not (out / "local.json").is_symlink() and (out / "local.json").read_text().startswith("{")


@pytest.mark.parametrize(
    "where", ["/proc/bwstack-facts", "/etc/hostname/facts"], ids=["cannot-be-made", "under-a-file"]
)
def test_a_facts_dir_that_cannot_be_made_is_refused_in_one_line_before_any_check(where):
    result = bwstack("verify", "--no-runtime", "--facts-dir", where)
    assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
    assert f"--facts-dir {where}: cannot be made" in result.stderr
