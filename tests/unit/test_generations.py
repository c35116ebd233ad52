"""Generations on a fixture stack (small wheels built by the tests, real uv, real venvs, real Python 3.12)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from helpers import needs_py312

from bwstack.probe import sealed
from bwstack.store.generations import Store
from bwstack.store.layout import Layout
from bwstack.store.record import GenerationRecord
from bwstack.store.runlock import RunLock
from bwstack.store.tree import remove_tree

pytestmark = needs_py312


def _python_facts(ml_env: Path) -> dict:
    code = (
        "import json, os, torch, fixture_dep\n"
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'dep': fixture_dep.VALUE,"
        " 'generation': os.environ.get('BWSTACK_GENERATION'), 'cuda_home': os.environ.get('CUDA_HOME')}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUDA_HOME"}
    out = subprocess.run(
        [str(ml_env / "bin" / "python"), "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout)


def _store(stack) -> Store:
    return Store(Layout(stack.root, stack.ml_env, stack.cuda_link, None))


def test_build_makes_ml_env_a_link_to_the_new_generation(stack):
    result = stack.build("fixture-old", "--json")
    assert result.returncode == 0, result.stderr
    assert stack.ml_env.is_symlink() and os.readlink(stack.ml_env) == str(stack.root / "current" / "env")
    facts = _python_facts(stack.ml_env)
    assert facts["torch"] == "2.9.1" and facts["cuda"] == "12.8" and facts["dep"] == 1
    assert facts["generation"] == json.loads(result.stdout)["generation"]


def test_record_holds_profile_lock_digest_python_cuda_patches_and_verification(stack):
    stack.build("fixture-new", check=True)
    gen = _store(stack).active()
    record = gen.record
    assert record.profile == "fixture-new"
    assert record.lock_digest.startswith("sha256:") and record.closure_digest.startswith("sha256:")
    assert record.python.startswith("3.12")
    assert record.cuda_home.endswith("cuda-13.0")
    assert record.patches == ()
    assert record.passed and record.verification_status == "passed"
    assert record.torch == {"version": "2.9.1+cu130", "cuda": "13.0"}
    assert record.packages["torch"]["hash_verified"] is True
    # record.json is the record's JSON shape, read back to the same record
    on_disk = json.loads((gen.path / "record.json").read_text())
    assert on_disk == record.to_json() and GenerationRecord.from_json(on_disk) == record


def test_cuda_follows_the_generation(stack):
    stack.build("fixture-old", check=True)
    assert _python_facts(stack.ml_env)["cuda_home"].endswith("cuda-12.8")
    assert os.path.realpath(stack.cuda_link).endswith("cuda-12.8")
    stack.build("fixture-new", check=True)
    assert _python_facts(stack.ml_env)["cuda_home"].endswith("cuda-13.0")
    assert os.path.realpath(stack.cuda_link).endswith("cuda-13.0")


def test_second_build_of_the_same_closure_changes_nothing(stack):
    stack.build("fixture-new", check=True)
    again = stack.build("fixture-new", "--json")
    assert again.returncode == 0, again.stderr
    payload = json.loads(again.stdout)
    assert payload["changed"] is False and payload["actions"] == []
    assert len(_store(stack).generations()) == 1


def test_the_plan_says_whether_a_build_is_needed_and_which_generation_it_reuses(stack):
    """What the preflight role asks before it requires free disk for a build."""
    fresh = json.loads(stack.build("fixture-new", "--check", "--json", check=True).stdout)
    stack.build("fixture-new", check=True)
    converged = json.loads(stack.build("fixture-new", "--check", "--json", check=True).stdout)
    assert fresh["build"] is True
    assert converged["build"] is False and converged["target"] == converged["active"]


def test_rollback_returns_to_the_previous_generation_which_reports_its_recorded_versions(stack):
    stack.build("fixture-old", check=True)
    stack.build("fixture-new", check=True)
    assert _python_facts(stack.ml_env)["torch"] == "2.9.1+cu130"
    result = stack.run("rollback", "--json", check=True)
    payload = json.loads(result.stdout)
    assert payload["switch"]["post_check"]["torch"] == "2.9.1"
    facts = _python_facts(stack.ml_env)
    assert (facts["torch"], facts["cuda"]) == ("2.9.1", "12.8")


def test_rollback_says_it_left_a_real_file_at_the_cuda_link_as_it_was(stack):
    stack.build("fixture-old", check=True)
    stack.build("fixture-new", check=True)
    stack.cuda_link.unlink()
    stack.cuda_link.write_text("someone else's\n")
    payload = json.loads(stack.run("rollback", "--json", check=True).stdout)
    assert payload["note"].startswith(f"{stack.cuda_link} is a real file (not managed by bwstack), left untouched")
    assert stack.cuda_link.read_text() == "someone else's\n"


def test_rollback_with_nothing_to_go_back_to_says_so_and_changes_nothing(stack):
    stack.build("fixture-new", check=True)
    before = os.readlink(stack.root / "current")
    result = stack.run("rollback")
    assert result.returncode == 1
    assert result.stderr.startswith("bwstack: error: nothing to roll back to: 0000-fixture-new-")
    assert "is the only generation" in result.stderr and "--rebuild" in result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert os.readlink(stack.root / "current") == before and len(_store(stack).generations()) == 1


def test_rollback_check_says_what_it_would_do_and_changes_nothing(stack):
    stack.build("fixture-old", check=True)
    stack.build("fixture-new", check=True)
    before = os.readlink(stack.root / "current")
    plan = json.loads(stack.run("rollback", "--check", "--json", check=True).stdout)
    assert plan["changed"] and plan["target"].startswith("0000-fixture-old-")
    assert os.readlink(stack.root / "current") == before


def test_rollback_rebuild_builds_the_rollback_profile_from_the_lock_when_there_is_nothing_to_go_back_to(stack):
    result = stack.run("rollback", "--rebuild", "--wheelhouse", str(stack.wheelhouse), "--json", check=True)
    payload = json.loads(result.stdout)
    assert payload["rolled_back_by"] == "rebuild from the lock"
    assert _python_facts(stack.ml_env)["torch"] == "2.9.1"


def test_generations_json_lists_id_profile_created_size_active_verified(stack):
    stack.build("fixture-old", check=True)
    stack.build("fixture-new", check=True)
    rows = json.loads(stack.run("generations", "--json", check=True).stdout)
    assert [r["profile"] for r in rows] == ["fixture-old", "fixture-new"]
    assert [r["active"] for r in rows] == [False, True]
    for row in rows:
        assert {"id", "created", "size_bytes", "verified"} <= set(row) and row["verified"] == "passed"


def test_rollback_to_a_corrupted_generation_is_refused_naming_the_file(stack):
    stack.build("fixture-old", check=True)
    stack.build("fixture-new", check=True)
    old = _store(stack).generations()[0]
    victim = next(old.env.glob("lib/python3.*/site-packages/torch/version.py"))
    victim.chmod(0o644)
    victim.write_text(victim.read_text() + "# changed after sealing\n")
    result = stack.run("rollback", "--to", str(old.id))
    assert result.returncode == 5
    assert "site-packages/torch/version.py" in result.stderr and "refusing to switch" in result.stderr
    assert _python_facts(stack.ml_env)["torch"] == "2.9.1+cu130", "the active env must be untouched"


def test_full_verify_catches_a_change_that_kept_size_and_mtime(stack):
    stack.build("fixture-old", check=True)
    stack.build("fixture-new", check=True)
    old = _store(stack).generations()[0]
    victim = next(old.env.glob("lib/python3.*/site-packages/fixture_dep/__init__.py"))
    st = victim.stat()
    victim.chmod(0o644)
    victim.write_text("VALUE = 9\n")  # same length as "VALUE = 1\n"
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    # quick (inode/size/mtime) cannot see it; full hashing does, and names the file
    assert stack.run("rollback", "--to", str(old.id), "--verify", "full").returncode == 5
    assert "fixture_dep/__init__.py" in stack.run("generations", "--check", "--verify", "full").stdout


def test_prune_never_removes_the_active_or_the_last_verified_generation(stack):
    stack.build("fixture-old", check=True)
    stack.build("fixture-new", check=True)
    stack.run("rollback", "--to", "0", check=True)
    removed = json.loads(stack.run("prune", "--keep", "1", "--json", check=True).stdout)["removed"]
    names = [g.name for g in _store(stack).generations()]
    assert removed == [] and len(names) == 2, "gen 0 is active, gen 1 is the last verified"


def test_prune_removes_old_generations_beyond_keep(stack):
    stack.build("fixture-old", check=True)
    stack.build("fixture-new", check=True)
    store = _store(stack)
    first = store.generations()[0]
    # a third generation: the old profile again, after the first was pruned away by keep=1
    removed = json.loads(stack.run("prune", "--keep", "1", "--json", check=True).stdout)["removed"]
    assert removed == [first.name]
    assert not first.path.exists()


def _remembered(stack, *names: str) -> Path:
    """What verifies would have remembered of these generations (the files `sealed.save_derived` writes), a
    killed writer's temporary file of the first, and a file the probe never writes."""
    folder = sealed.derived_folder(stack.root)
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / f"{name}.json").write_text("{}")
    (folder / f".{names[0]}.json.4242.tmp").write_text("{")
    (folder / "README").write_text("not bwstack's")
    return folder


def test_prune_forgets_what_verifies_remembered_of_the_generations_it_removes(stack):
    stack.build("fixture-old", check=True)
    stack.build("fixture-new", check=True)
    first, second = (g.name for g in _store(stack).generations())
    folder = _remembered(stack, first, second)
    assert json.loads(stack.run("prune", "--keep", "1", "--json", check=True).stdout)["removed"] == [first]
    assert sorted(p.name for p in folder.iterdir()) == [f"{second}.hashed", f"{second}.json", "README"]


def test_prune_forgets_what_was_remembered_of_generations_removed_earlier(stack):
    stack.build("fixture-new", check=True)
    (kept,) = (g.name for g in _store(stack).generations())
    folder = _remembered(stack, "0007-fixture-old-0123456789ab", kept)
    assert json.loads(stack.run("prune", "--keep", "1", "--json", check=True).stdout)["removed"] == []
    assert sorted(p.name for p in folder.iterdir()) == [f"{kept}.hashed", f"{kept}.json", "README"]


def test_a_new_generation_inherits_nothing_remembered_of_an_earlier_one_of_its_name(stack):
    """Ids count up from the highest one left, and the name's digest is the closure's: a rebuild after the newest
    generation was removed gets its name again."""
    stack.build("fixture-new", check=True)
    (name,) = (g.name for g in _store(stack).generations())
    folder = _remembered(stack, name)
    (gen,) = _store(stack).generations()  # removed by hand, as nothing in bwstack removes the active one
    os.unlink(stack.ml_env)
    os.unlink(stack.root / "current")
    remove_tree(gen.path)
    stack.build("fixture-new", check=True)
    assert [g.name for g in _store(stack).generations()] == [name]
    # Only the new generation's own record of when its bytes were hashed (at its build), none of the old one's.
    assert sorted(p.name for p in folder.iterdir()) == [f"{name}.hashed", "README"]
    (rebuilt,) = _store(stack).generations()
    assert int((folder / f"{name}.hashed").read_text()) >= (rebuilt.path / "manifest.json").stat().st_mtime_ns


def test_forgetting_never_follows_a_link_in_place_of_the_cache_folder(stack, tmp_path):
    stack.build("fixture-new", check=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "0007-fixture-old-0123456789ab.json").write_text("someone else's")
    folder = sealed.derived_folder(stack.root)
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_tree(folder)  # the build's own record of when it hashed its files is there
    folder.symlink_to(elsewhere)
    stack.run("prune", "--keep", "1", "--json", check=True)
    assert (elsewhere / "0007-fixture-old-0123456789ab.json").read_text() == "someone else's"


def test_forgetting_never_follows_a_link_in_place_of_the_store_cache_folder_above_it(stack, tmp_path):
    stack.build("fixture-new", check=True)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "verify-facts").mkdir(parents=True)
    (elsewhere / "verify-facts" / "0007-fixture-old-0123456789ab.json").write_text("someone else's")
    cache = sealed.derived_folder(stack.root).parent
    if cache.exists():
        remove_tree(cache)
    cache.symlink_to(elsewhere)
    stack.run("prune", "--keep", "1", "--json", check=True)
    assert (elsewhere / "verify-facts" / "0007-fixture-old-0123456789ab.json").read_text() == "someone else's"


def test_a_second_run_while_one_holds_the_store_says_who_holds_it(stack):
    stack.root.mkdir(parents=True)
    with RunLock(stack.root, command="bwstack build --profile fixture-new"):
        result = stack.build("fixture-old")
    assert result.returncode == 3
    assert f"pid {os.getpid()}" in result.stderr and "bwstack build --profile fixture-new" in result.stderr
    assert not stack.ml_env.exists()


def test_the_run_lock_is_released_when_its_holder_dies(stack):
    stack.root.mkdir(parents=True)
    holder = subprocess.Popen(
        ["python3", "-c", f"import fcntl,os,time; fd=os.open('{stack.root}/bwstack.lock', os.O_RDWR|os.O_CREAT); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    assert stack.build("fixture-old").returncode == 3
    holder.kill()
    holder.wait()
    assert stack.build("fixture-old").returncode == 0


def test_nothing_in_the_store_is_world_writable(stack):
    stack.build("fixture-new", check=True)
    offenders = []
    for dirpath, dirnames, filenames in os.walk(stack.root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path) and os.lstat(path).st_mode & 0o002:
                offenders.append(path)
    assert offenders == []


def test_generation_files_are_read_only(stack):
    stack.build("fixture-new", check=True)
    gen = _store(stack).active()
    init = next(gen.env.glob("lib/python3.*/site-packages/torch/__init__.py"))
    assert init.stat().st_mode & 0o222 == 0


def test_an_install_into_one_generation_never_writes_through_into_another(stack, tmp_path):
    stack.build("fixture-old", check=True)
    stack.build("fixture-new", check=True)
    old, new = _store(stack).generations()
    shared_old = next(old.env.glob("lib/python3.*/site-packages/fixture_shared/__init__.py"))
    shared_new = next(new.env.glob("lib/python3.*/site-packages/fixture_shared/__init__.py"))
    assert shared_old.stat().st_ino == shared_new.stat().st_ino, "both generations hard-link the same file"
    # a real installer run into the new generation (as root, the worst case): uv replaces, never writes through
    from bwstack.lock.uvtool import run_uv, uv_env

    result = run_uv(
        ["pip", "install", "--python", str(new.env / "bin" / "python"), "--no-index",
         "--find-links", str(stack.tmp / "extra-wheels"), "fixture-shared==2.0"],
        env=uv_env({"UV_CACHE_DIR": str(stack.root / "cache" / "uv")}), capture=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "shared v2" in next(new.env.glob("lib/python3.*/site-packages/fixture_shared/__init__.py")).read_text()
    assert shared_old.read_text() == "DATA = 'shared v1'\n"
    assert old.verify("full") == [], "the other generation still verifies byte for byte"
    assert new.verify("quick") != [], "the changed generation no longer matches its own manifest"


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to act as nobody")
def test_a_non_root_writer_cannot_modify_a_sealed_file(stack):
    stack.build("fixture-new", check=True)
    gen = _store(stack).active()
    target = next(gen.env.glob("lib/python3.*/site-packages/fixture_shared/__init__.py"))
    os.chmod(stack.tmp, 0o755)
    result = subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "sh", "-c", f"echo x >> {target}"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode != 0 and "Permission denied" in result.stderr


def test_a_running_process_keeps_the_generation_it_started_with(stack):
    stack.build("fixture-old", check=True)
    probe = subprocess.Popen(
        [str(stack.ml_env / "bin" / "python"), "-c",
         "import sys, os\nsys.stdin.readline()\nimport fixture_dep, torch\n"
         "print(fixture_dep.VALUE, torch.__version__, os.environ['BWSTACK_GENERATION'])"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    stack.build("fixture-new", check=True)  # switch while the process runs, before its lazy imports
    out, _ = probe.communicate("go\n", timeout=60)
    value, torch_version, gen = out.split()
    assert (value, torch_version) == ("1", "2.9.1") and "fixture-old" in gen


def test_concurrent_builds_leave_one_consistent_store(stack):
    results = []

    def run():
        results.append(stack.build("fixture-new"))

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.returncode for r in results)
    assert codes[0] == 0 and set(codes) <= {0, 3}
    assert len(_store(stack).generations()) == 1


def _plan_and_run(stack, *flags: str) -> tuple[dict, dict]:
    plan = json.loads(stack.run("build", "--profile", "fixture-new", "--check", *flags, "--json", check=True).stdout)
    done = json.loads(stack.run("build", "--profile", "fixture-new", *flags, "--json", check=True).stdout)
    return plan, done


@pytest.mark.parametrize("flags", [(), ("--no-switch",)], ids=["switch", "no-switch"])
def test_build_check_plans_the_snapshot_of_a_changed_active_env_as_the_build_takes_it(stack, flags):
    """The plan modelled no snapshot: with the active env changed it planned a build and a switch only, and a
    `build --no-switch` then moved `current` to the snapshot it did not plan."""
    stack.build("fixture-new", check=True)
    active = _store(stack).active()
    victim = next(active.env.glob("lib/python3.*/site-packages/fixture_dep/__init__.py"))
    victim.chmod(0o644)
    victim.write_text("VALUE = 99  # changed in place\n")  # through its hard links: the bytes are gone
    plan, done = _plan_and_run(stack, *flags)
    assert plan["actions"][0].startswith(f"snapshot {stack.ml_env} as a generation (1 paths differ")
    assert plan["build"] and any(a == f"built {plan['target']}" for a in done["actions"]), (plan, done["actions"])
    assert done["backup"]["action"] == "snapshot"
    switched = [a for a in done["actions"] if a.startswith("switched ")]
    assert bool(switched) == any(a.startswith("switch ") for a in plan["actions"]) == (flags == ())


@needs_py312
def test_build_check_names_the_generation_a_build_after_an_adopt_will_make(stack):
    from bwstack.provision.envbuild import find_python

    subprocess.run([find_python("3.12"), "-m", "venv", "--without-pip", str(stack.ml_env)], check=True)
    plan, done = _plan_and_run(stack, "--wheelhouse", str(stack.wheelhouse))
    assert plan["actions"][0] == f"adopt {stack.ml_env} as a generation (no copy)" and plan["build"]
    assert any(a == f"built {plan['target']}" for a in done["actions"]), (plan["target"], done["actions"])


def test_a_rollback_given_source_options_without_rebuild_says_it_reads_none_and_goes_back(stack):
    """The emergency path does not refuse what an older controller's module passes to every rollback, nor does it
    take them silently."""
    stack.build("fixture-old", check=True)
    stack.build("fixture-new", check=True)
    result = stack.run("rollback", "--to", "0", "--wheelhouse", str(stack.wheelhouse), "--offline")
    assert result.returncode == 0, result.stderr
    assert "note: --wheelhouse, --offline not read: without --rebuild a rollback fetches no wheel" in result.stderr
    assert _store(stack).active().id == 0


def test_a_rollback_without_rebuild_is_not_stopped_by_source_paths_this_node_lacks(stack, tmp_path):
    """It said it reads them: a wheelhouse or CA bundle that is not here must not fail it either."""
    stack.build("fixture-old", check=True)
    stack.build("fixture-new", check=True)
    result = stack.run("rollback", "--to", "0", "--wheelhouse", str(tmp_path / "none"), "--ca-bundle",
                       str(tmp_path / "none.pem"))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "note: --wheelhouse, --ca-bundle not read" in result.stderr
    assert _store(stack).active().id == 0
