"""`bwstack build --fetch-only`: the build's first step alone, which provision.yml runs on a node in the background
while the CUDA toolkit and system packages go in. On the FIXTURE stack (test-built wheels from a wheelhouse)."""

from __future__ import annotations

import json
import os

import pytest

from bwstack.store.runlock import RunLock


def _store_wheels(stack) -> list[str]:
    found = []
    for _dirpath, _dirs, files in os.walk(stack.root / "cache" / "wheels"):
        found += [name for name in files if name.endswith(".whl")]
    return sorted(found)


def test_it_puts_every_wheel_of_the_profiles_env_in_the_store_and_builds_nothing(stack):
    result = stack.build("fixture-new", "--fetch-only", "--json")
    assert result.returncode == 0, result.stderr
    fetched = json.loads(result.stdout)
    assert fetched["profile"] == "fixture-new" and fetched["wheels"] == len(_store_wheels(stack)) > 0
    assert fetched["changed"] is True and fetched["fetch"]["files_stored"] == fetched["wheels"]
    assert not (stack.root / "generations").exists() or not os.listdir(stack.root / "generations")
    assert not os.path.lexists(stack.ml_env)


def test_the_build_after_it_finds_every_wheel_in_the_store(stack):
    stack.build("fixture-new", "--fetch-only", check=True)
    # No wheelhouse now: whatever the build needed and did not find in the store would fail it.
    built = stack.run("build", "--profile", "fixture-new", "--offline", "--json")
    assert built.returncode == 0, built.stderr
    assert json.loads(built.stdout)["timings"]["fetch"]["bytes_downloaded"] == 0


def test_a_second_fetch_changes_nothing(stack):
    stack.build("fixture-new", "--fetch-only", check=True)
    again = json.loads(stack.build("fixture-new", "--fetch-only", "--json", check=True).stdout)
    assert again["changed"] is False and again["fetch"]["files_stored"] == 0


@pytest.mark.parametrize("option", [["--check"], ["--no-switch"], ["--take-over-links"], ["--verify", "full"],
                                    ["--python", "/usr/bin/python3"]])  # fmt: skip
def test_an_option_the_fetch_does_not_read_is_refused_in_one_line(stack, option):
    result = stack.build("fixture-new", "--fetch-only", *option)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"bwstack: error: {option[0]} is not read with --fetch-only: leave it out"
    ]
    assert not (stack.root / "cache" / "wheels").exists()


def test_it_waits_for_no_other_run_it_says_the_store_is_busy(stack):
    """It writes the store's wheel cache: under the store's lock, as a build's fetch is."""
    stack.root.mkdir(parents=True)
    with RunLock(stack.root):
        result = stack.build("fixture-new", "--fetch-only")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not _store_wheels(stack)


def test_a_wheel_whose_hash_is_not_the_locks_is_refused_and_not_kept(stack):
    for wheel in stack.wheelhouse.glob("*.whl"):  # whichever the fetch reads first
        wheel.write_bytes(wheel.read_bytes() + b"tampered")
    result = stack.build("fixture-new", "--fetch-only")
    assert result.returncode == 2, result.stderr
    assert "sha256" in result.stderr and "Traceback" not in result.stderr
    assert not _store_wheels(stack)
