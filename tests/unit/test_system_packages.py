"""Which OS packages a host needs has one owner, `bwstack.lock.model.system_packages_for` (given os-release's
ID and VERSION_ID): the CLI (`bwstack system-packages`), the mlenv role (which hands the node's os-release to
that command) and the infra checks ask it, and all pick the same entry for the same os-release."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REAL_LOCK, local_inventory, needs_ansible, playbook

from bwstack.errors import UsageError
from bwstack.lock.model import NoSystemPackages, load_lock, system_packages_for

# (case, os-release text, the lock entry chosen, or the error)
CASES = [
    ("debian-12", 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\nVERSION_ID="12"\n', "debian-12"),
    ("ubuntu-24.04", 'NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\nVERSION_ID="24.04"\n', "ubuntu-24.04"),
    # another minor release is another release: 24.10's package names differ (no t64 rename to match)
    ("ubuntu-24.10", "ID=ubuntu\nVERSION_ID='24.10'\n", NoSystemPackages),
    # an ID-MAJOR entry covers the major's point releases
    ("debian-12.7", "ID=debian\nVERSION_ID=12.7\n", "debian-12"),
    ("fedora-40", "ID=fedora\nVERSION_ID=40\n", NoSystemPackages),
    ("no-version", "ID=arch\n", UsageError),
]


def _ids(text: str) -> tuple[str | None, str | None]:
    from bwstack.probe import osrelease

    fields = osrelease.parse(text)
    return fields.get("ID"), fields.get("VERSION_ID")


@pytest.fixture(scope="module")
def lock():
    return load_lock(REAL_LOCK)


@pytest.mark.parametrize(("case", "text", "want"), CASES, ids=[c[0] for c in CASES])
def test_the_rule_picks_the_exact_release_then_the_major_entry(lock, case, text, want):
    if isinstance(want, str):
        got = lock.system_packages_for(*_ids(text))
        assert got.entry == want and got.packages == lock.system_packages[want]
    else:
        with pytest.raises(want) as caught:
            lock.system_packages_for(*_ids(text))
        assert "\n" not in str(caught.value)
        if want is NoSystemPackages:
            assert case.rsplit("-", 1)[0] in str(caught.value) and "debian-12, ubuntu-24.04" in str(caught.value)


def test_a_lock_without_system_packages_asks_for_nothing():
    got = system_packages_for({}, "ubuntu", "24.10")
    assert (got.entry, got.packages) == (None, ())


def _cli(os_release: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bwstack", "--lock", str(REAL_LOCK), "system-packages", "--os-release",
         str(os_release), "--json"],
        capture_output=True, text=True,
    )  # fmt: skip


@pytest.mark.parametrize(("case", "text", "want"), CASES, ids=[c[0] for c in CASES])
def test_the_cli_answers_with_the_rules_entry_or_one_line(tmp_path, lock, case, text, want):
    path = tmp_path / "os-release"
    path.write_text(text)
    result = _cli(path)
    if isinstance(want, str):
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == lock.system_packages_for(*_ids(text)).as_dict()
    else:
        assert result.returncode == want.exit_code and not result.stdout
        assert result.stderr.startswith("bwstack: error: ") and result.stderr.count("\n") == 1
        assert "Traceback" not in result.stderr


SYSTEM_PACKAGES_PLAY = """\
- name: Ask the mlenv role which system packages this os-release needs
  hosts: bwstack_nodes
  gather_facts: false
  tasks:
    - name: The role's own task file
      ansible.builtin.include_role:
        name: bwstack_mlenv
        tasks_from: system_packages.yml
    - name: Show the answer
      ansible.builtin.debug:
        msg: "ANSWER {{ bwstack_mlenv_os_packages | to_json }}"
"""


@needs_ansible
@pytest.mark.ansible
@pytest.mark.parametrize(("case", "text", "want"), CASES[:3], ids=[c[0] for c in CASES[:3]])
def test_the_mlenv_role_installs_what_the_cli_picks(tmp_path, lock, case, text, want):
    """The role's path (node's os-release -> controller's `bwstack system-packages`) against the CLI's answer."""
    path = tmp_path / "os-release"
    path.write_text(text)
    play = tmp_path / "system-packages.yml"
    play.write_text(SYSTEM_PACKAGES_PLAY)
    variables = {
        "bwstack_mlenv_os_release": str(path),
        "bwstack_lock": str(REAL_LOCK),
        "bwstack_controller_bwstack": [sys.executable, "-m", "bwstack"],
    }
    got = playbook(str(play), local_inventory(tmp_path / "hosts.yml"), variables).ok()
    line = next(line for line in got.out.splitlines() if '"msg": "ANSWER ' in line)
    answer = yaml.safe_load(json.loads("{" + line.strip().rstrip(",") + "}")["msg"].removeprefix("ANSWER "))
    cli = _cli(path)
    if isinstance(want, str):
        assert answer == json.loads(cli.stdout)["packages"] == list(lock.system_packages[want])
    else:
        assert answer is None and cli.returncode == want.exit_code
        assert "WARNING - THE LOCK LISTS NO SYSTEM PACKAGES FOR THIS OS" in got.out
        assert "has no entry for ubuntu-24.10" in got.out
