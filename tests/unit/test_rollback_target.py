"""Which generation a rollback goes to has one owner, `bwstack.provision.build.rollback_target`: `bwstack rollback`,
`bwstack rollback --check` and the Ansible module (`bwstack_node action=rollback`, which runs those two on the
node) pick the same target for the same store, in check mode and for real.

Each case builds a store from the fixture stack (fixture-old, fixture-new, a hand-made env adopted nearest to
fixture-old), then asks all three."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, needs_py312

from bwstack.provision.build import rollback_target
from bwstack.store.generations import Store
from bwstack.store.layout import Layout
from fixtures import fakestack

pytestmark = needs_py312
MODULE = REPO / "ansible" / "library" / "bwstack_node.py"
ansible = pytest.importorskip("ansible.module_utils.basic", reason="the module needs ansible-core")


def _steps_old_new(s):
    s.build("fixture-old", check=True)
    s.build("fixture-new", check=True)


def _steps_old_new_back(s):
    _steps_old_new(s)
    s.run("rollback", "--to", "0", check=True)


def _steps_adopted_new(s):
    fakestack.hand_made_env(s.ml_env, s.wheelhouse)
    s.build("fixture-new", check=True)  # adopts the hand-made env as generation 0 first


def _steps_adopted_old_new(s):
    fakestack.hand_made_env(s.ml_env, s.wheelhouse)
    _steps_old_new(s)


def _steps_one(s):
    s.build("fixture-new", check=True)


# (case, store, rollback arguments, the generation id it goes to; None: nothing to go back to)
CASES = [
    ("previous", _steps_old_new, {}, 0),
    ("previous-after-a-rollback", _steps_old_new_back, {}, 1),
    ("by-profile", _steps_old_new, {"profile": "fixture-old"}, 0),
    ("by-id", _steps_old_new_back, {"to": "1"}, 1),
    ("by-name-already-active", _steps_old_new, {"to": "1"}, 1),
    ("previous-is-the-adopted", _steps_adopted_new, {}, 0),
    # the nearest-profile rule: the adopted hand-made env counts for fixture-old, and it is the newest one
    ("adopted-counts-for-its-nearest-profile", _steps_adopted_new, {"profile": "fixture-old"}, 0),
    ("newest-of-the-profile", _steps_adopted_old_new, {"profile": "fixture-old"}, 1),
    ("previous-of-three", _steps_adopted_old_new, {}, 1),
    ("profile-with-none-left", _steps_old_new, {"profile": "fixture-new"}, None),
    ("only-one-generation", _steps_one, {}, None),
]


def _module(s, check: bool, **params) -> dict:
    args = {
        "bwstack": str(Path(sys.executable).parent / "bwstack"),
        "lock": str(s.lock),
        "action": "rollback",
        "root": str(s.root),
        "ml_env": str(s.ml_env),
        "cuda_link": str(s.cuda_link),
        "sources": {"wheelhouse": [str(s.wheelhouse)], "offline": True},
        **params,
        "_ansible_check_mode": check,
    }
    path = s.tmp / "module-args.json"
    path.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    out = subprocess.run(
        [sys.executable, str(MODULE), str(path)], capture_output=True, text=True, env={**os.environ, **s.env}
    )
    return json.loads(out.stdout)


def _cli_check(s, **params) -> subprocess.CompletedProcess:
    flags = [x for k, v in params.items() for x in (f"--{k}", v)]
    return s.run("rollback", "--check", "--json", *flags)


def _store(s) -> Store:
    return Store(Layout(s.root, s.ml_env, s.cuda_link, None))


@pytest.mark.parametrize(("case", "steps", "params", "want"), CASES, ids=[c[0] for c in CASES])
def test_the_module_and_the_cli_pick_the_same_rollback_target(stack, case, steps, params, want):
    steps(stack)
    store = _store(stack)
    active = store.active_or_none()
    chosen = rollback_target(store, active, to=params.get("to"), profile_name=params.get("profile"))
    assert (chosen.id if chosen else None) == want, case

    status = _module(stack, True, action="status")  # what the mlenv role remembers as the generation to go back to
    assert status["active"] == (active.name if active else None) and not status["changed"]

    cli = _cli_check(stack, **params)
    checked = _module(stack, True, **params)
    if want is None:
        assert cli.returncode == 1 and not cli.stdout, cli.stderr
        message = cli.stderr.strip().removeprefix("bwstack: error: ")
        assert checked["failed"] and checked["msg"] == message
        real = _module(stack, False, **params)
        assert real["failed"] and real["msg"] == message
        assert store.active_or_none() == active  # nothing switched
        return
    assert cli.returncode == 0, cli.stderr
    plan = json.loads(cli.stdout)
    assert plan["target"] == chosen.name
    assert checked["result"]["target"] == chosen.name and not checked.get("failed"), checked
    assert checked["switched"] is False and store.active_or_none() == active  # check mode changed nothing

    real = _module(stack, False, **params)
    assert not real.get("failed"), real
    assert real["result"]["generation"] == chosen.name
    assert store.active().name == chosen.name
    assert real["switched"] is (active is None or active.name != chosen.name)
    assert real["changed"] is checked["changed"] is plan["changed"]
