"""The Ansible side: lint and syntax of the playbooks, the roles' contracts, `bwstack provision`'s targets,
and the quick real runs (preflight refusal, canary stopping a rollout, check mode on a fresh node, the apt
method in check mode). The full fixture flow is in test_ansible_flow.py; the real cu128 env in
test_ansible_real.py. Their shared helpers are in helpers.py.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import (
    ANSIBLE,
    PLAYBOOKS,
    REPO,
    ROLES,
    Run,
    bwstack,
    fixture_vars,
    local_inventory,
    needs_ansible,
    playbook,
    run,
    tool,
)

from bwstack.errors import BwstackError, UsageError
from bwstack.fleet import playbooks

# ------------------------------------------------------------------------------------------------ static


@pytest.mark.skipif(
    tool("ansible-lint") is None and not os.environ.get("CI"), reason="ansible-lint not installed (dev extra)"
)
def test_ansible_lint_production_profile_passes():
    result = run(
        [tool("ansible-lint") or "ansible-lint", "--profile", "production", "--offline", "--nocolor"], timeout=600
    )
    assert result.rc == 0, result.tail(80)
    assert "Profile 'production' was required, and it passed" in result.out


@needs_ansible
@pytest.mark.parametrize("name", PLAYBOOKS)
def test_playbook_passes_syntax_check(name: str):
    inventory = ANSIBLE / "inventories" / "example" / "hosts.yml"
    result = run([tool("ansible-playbook"), "--syntax-check", "-i", str(inventory), str(ANSIBLE / name)])
    assert result.rc == 0, result.tail()


@pytest.mark.parametrize("role", ROLES)
def test_role_documents_every_default_in_its_argument_spec(role: str):
    base = ANSIBLE / "roles" / role
    defaults = yaml.safe_load((base / "defaults" / "main.yml").read_text()) or {}
    specs = yaml.safe_load((base / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    documented = set(specs["main"]["options"])
    assert set(defaults) <= documented, f"undocumented: {sorted(set(defaults) - documented)}"
    assert all(name.startswith(f"{role}_") for name in defaults), "every variable carries the role's prefix"


# What the converged fast path may leave out of its inputs digest: read only on the controller, by a rollback,
# by verify (which runs on the fast path too), or derived from settings that are in it.
NOT_IN_THE_RECEIPT = {
    "bwstack_sources": "derived from bwstack_wheelhouse, _index, _offline, _ca_bundle, _allow_unhashed",
    "bwstack_controller_bwstack": "how the controller runs bwstack",
    "bwstack_controller_cache": "the controller's scratch directory",
    "bwstack_controller_facts_args": "what a task asks the controller",
    "bwstack_converged_check": "whether to ask at all",
    "bwstack_take_over_links": "a permission used only where a link is not the store's, which a converged node's are",
    "bwstack_tool_uv": "how the tool venv is made, not what it holds",
    "bwstack_mlenv_rollback_to": "rollback.yml only",
    "bwstack_mlenv_rollback_profile": "rollback.yml only",
    "bwstack_mlenv_rollback_rebuild": "rollback.yml only",
    "bwstack_verify_profile": "verify, which runs on the fast path too",
    "bwstack_verify_runtime": "verify, which runs on the fast path too",
    "bwstack_verify_capability": "verify, which runs on the fast path too",
    "bwstack_verify_require_acceptance": "verify, which runs on the fast path too",
    "bwstack_verify_accept_timeout": "verify, which runs on the fast path too",
    "bwstack_verify_remember_waivers": "verify, which runs on the fast path too",
    "bwstack_verify_host_name": "verify, which runs on the fast path too",
    "bwstack_verify_timeout": "verify, which runs on the fast path too",
}


def test_the_receipt_digests_every_role_setting_that_shapes_a_node():
    """A setting missing from bwstack_receipt_settings would let a changed value pass as converged."""
    declared = set()
    for role in ROLES:
        specs = yaml.safe_load((ANSIBLE / "roles" / role / "meta" / "argument_specs.yml").read_text())
        declared |= {name for entry in specs["argument_specs"].values() for name in entry["options"]}
    digested = yaml.safe_load((ANSIBLE / "roles" / "bwstack" / "vars" / "main.yml").read_text())
    settings = set(digested["bwstack_receipt_settings"])
    assert declared - settings == set(NOT_IN_THE_RECEIPT), sorted((declared - settings) ^ set(NOT_IN_THE_RECEIPT))
    assert settings <= declared, f"not a setting of any role: {sorted(settings - declared)}"


@pytest.mark.parametrize("role", ROLES)
def test_role_has_defaults_meta_and_tasks(role: str):
    base = ANSIBLE / "roles" / role
    for part in ("defaults/main.yml", "meta/main.yml", "meta/argument_specs.yml", "tasks/main.yml"):
        assert (base / part).is_file(), part


def test_roles_do_not_verify_with_a_placeholder_assert():
    """DeepOps' verify is `assert: that: true`; ours must test something."""
    for path in (ANSIBLE / "roles").rglob("*.yml"):
        for doc in yaml.safe_load_all(path.read_text()):
            for task in doc if isinstance(doc, list) else []:
                check = task.get("ansible.builtin.assert") if isinstance(task, dict) else None
                if check:
                    assert check.get("that") not in (True, "true", [True], ["true"]), f"{path}: {task['name']}"


def _tasks(items: list) -> list[dict]:
    """Every task, the ones inside blocks (block/rescue/always) included."""
    out = []
    for task in items or []:
        nested = [task.get(key) or [] for key in ("block", "rescue", "always")]
        if any(nested):
            out += [t for part in nested for t in _tasks(part)]
        else:
            out.append(task)
    return out


def test_every_playbook_task_uses_fqcn_or_the_bwstack_module():
    allowed_short = {"bwstack_node"}
    keywords = {"name", "when", "register", "tags", "vars", "notify", "loop", "block", "rescue", "always",
                "delegate_to", "run_once", "check_mode", "changed_when", "failed_when", "ignore_errors", "become",
                "no_log", "environment", "listen", "until", "retries", "delay", "args", "diff", "timeout"}  # fmt: skip
    for path in list((ANSIBLE / "roles").rglob("tasks/*.yml")) + list((ANSIBLE / "roles").rglob("handlers/*.yml")):
        for task in _tasks(yaml.safe_load(path.read_text())):
            modules = [k for k in task if k not in keywords]
            assert len(modules) == 1, f"{path}: {task.get('name')}: {modules}"
            assert modules[0].startswith("ansible.builtin.") or modules[0] in allowed_short, f"{path}: {modules[0]}"


def test_no_task_passes_a_space_joined_argument_string():
    """Commands get argument lists (argv), never strings a shell or module splits (issue 11, item 9)."""
    for path in (ANSIBLE / "roles").rglob("tasks/*.yml"):
        for task in _tasks(yaml.safe_load(path.read_text())):
            for module in ("ansible.builtin.command", "ansible.builtin.shell", "ansible.builtin.script"):
                if module in task:
                    assert isinstance(task[module], dict) and "argv" in task[module], f"{path}: {task['name']}"
            assert "ansible.builtin.pip" not in task, f"{path}: {task['name']}: extra_args is one string"


def test_services_restart_inside_the_rollout_never_in_a_handler_after_it():
    """A handler runs after the play's rescue: a unit failing to restart there left the node switched while the
    play failed. The restart is a task of the role, so provision.yml's block covers it."""
    assert not list((ANSIBLE / "roles" / "bwstack_mlenv").glob("handlers/*")), "no handlers in bwstack_mlenv"
    for name in ("generation.yml", "rollback.yml"):
        tasks = yaml.safe_load((ANSIBLE / "roles" / "bwstack_mlenv" / "tasks" / name).read_text())
        includes = [t for t in tasks if t.get("ansible.builtin.include_tasks") == "services.yml"]
        assert includes and all("switched" in " ".join(t["when"]) for t in includes), name
    assert not any("notify" in t for path in (ANSIBLE / "roles").rglob("bwstack_mlenv/tasks/*.yml")
                   for t in _tasks(yaml.safe_load(path.read_text())))  # fmt: skip


def test_tasks_where_index_urls_flow_hide_them():
    """An index URL may carry a token: the module hides its `index` option, the tool role its pip run, and pip
    gets it from its environment, not its command line."""
    module = (ANSIBLE / "library" / "bwstack_node.py").read_text()
    assert '"index": {"type": "list", "elements": "str", "default": [], "no_log": True}' in module
    tasks = _tasks(yaml.safe_load((ANSIBLE / "roles" / "bwstack_tool" / "tasks" / "install.yml").read_text()))
    pip = [t for t in tasks if "bwstack_tool_index_url" in json.dumps(t.get("environment", {}))]
    assert pip and all("no_log" in t and "PIP_INDEX_URL" in t["environment"] for t in pip)
    assert not any("--index-url" in json.dumps(t.get("ansible.builtin.command", {})) for t in tasks)


def _recording_bwstack(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in bwstack for the module: it records each command line with its BWSTACK_INDEX and answers as a
    store with no generation would. (stand-in, its record)"""
    seen = tmp_path / "seen.json"
    stand_in = tmp_path / "bwstack"
    stand_in.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"open({str(seen)!r}, 'a').write(json.dumps([sys.argv[1:], os.environ.get('BWSTACK_INDEX')]) + '\\n')\n"
        "print('[]' if 'generations' in sys.argv else json.dumps({'changed': False, 'actions': []}))\n"
    )
    stand_in.chmod(0o755)
    (tmp_path / "root" / "generations").mkdir(parents=True)
    return stand_in, seen


@needs_ansible
def test_the_module_hands_index_mirrors_to_bwstack_in_its_environment_never_on_its_command_line(tmp_path):
    """A command line is readable by every user of the node (/proc/PID/cmdline): a mirror's token is not."""
    stand_in, seen = _recording_bwstack(tmp_path)
    mirror = "pypi=https://deploy:S3CRET-TOKEN@mirror.example/simple"
    args = {
        "action": "build", "bwstack": str(stand_in), "lock": str(tmp_path / "lock"), "root": str(tmp_path / "root"),
        "ml_env": str(tmp_path / "env"), "cuda_link": "none", "sources": {"index": [mirror], "offline": True},
    }  # fmt: skip
    inventory = local_inventory(tmp_path / "hosts.yml")
    result = run([tool("ansible"), "bwstack_nodes", "-i", str(inventory), "-m", "bwstack_node", "-a", json.dumps(args)])
    assert result.rc == 0, result.out[-2000:]
    calls = [json.loads(line) for line in seen.read_text().splitlines()]
    assert calls and all("S3CRET" not in " ".join(argv) for argv, _ in calls)
    assert any(env == mirror for argv, env in calls if "build" in argv)
    assert "S3CRET" not in result.out


@needs_ansible
def test_the_module_passes_take_over_links_to_build_and_rollback_only_when_asked(tmp_path):
    stand_in, seen = _recording_bwstack(tmp_path)
    inventory = local_inventory(tmp_path / "hosts.yml")
    for action in ("build", "rollback"):
        for take in (False, True):
            args = {
                "action": action, "bwstack": str(stand_in), "lock": str(tmp_path / "lock"),
                "root": str(tmp_path / "root"), "ml_env": str(tmp_path / "env"), "cuda_link": "none",
                "take_over_links": take,
            }  # fmt: skip
            seen.unlink(missing_ok=True)
            result = run([tool("ansible"), "bwstack_nodes", "-i", str(inventory), "-m", "bwstack_node", "-a",
                          json.dumps(args)])  # fmt: skip
            assert result.rc == 0, result.out[-2000:]
            calls = [argv for argv, _ in (json.loads(line) for line in seen.read_text().splitlines())]
            acting = [argv for argv in calls if action in argv]
            assert acting and all(("--take-over-links" in argv) == take for argv in acting), calls
            assert not any("--take-over-links" in argv for argv in calls if "generations" in argv)


# ------------------------------------------------------------------------------------------------ provision CLI


def test_local_target_is_this_machine_over_the_local_connection():
    got = playbooks.parse_targets("local://")
    host = got.inventory["all"]["children"]["bwstack_nodes"]["hosts"]["localhost"]
    assert (got.args, got.extra, host["ansible_connection"]) == ([], {}, "local")


def test_a_local_target_makes_its_tool_venv_with_the_uv_bwstack_runs_and_a_remote_one_with_pip():
    from bwstack.lock.uvtool import uv_bin

    local = playbooks.parse_targets("local://").inventory["all"]["children"]["bwstack_nodes"]["hosts"]["localhost"]
    assert local["bwstack_tool_uv"] == uv_bin()
    remote = playbooks.parse_targets("ssh://root@node").inventory["all"]["children"]["bwstack_nodes"]["hosts"]
    assert "bwstack_tool_uv" not in remote["root@node"]  # the controller's binary may not run there


def test_ansible_gets_none_of_the_callers_uv_settings(tmp_path: Path, monkeypatch):
    """A local node's tasks inherit ansible-playbook's environment: its tool role's uv must not take the caller's
    extra indexes, find-links or insecure hosts."""
    for name, value in {"UV_EXTRA_INDEX_URL": "https://evil.example/simple", "UV_FIND_LINKS": "/tmp/x",
                        "UV_INSECURE_HOST": "evil.example", "PATH_KEPT": "yes"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    env = playbooks._ansible_env(ANSIBLE, tmp_path)
    assert not [k for k in env if k.startswith("UV_")] and env["PATH_KEPT"] == "yes"


def test_ssh_targets_become_a_temporary_inventory_named_with_user_and_port():
    got = playbooks.parse_targets("ssh://ops@gpu-a01,ssh://gpu-a02:2222,ssh://root@gpu-a02:2222")
    hosts = got.inventory["all"]["children"]["bwstack_nodes"]["hosts"]
    assert hosts["ops@gpu-a01"] == {
        "ansible_host": "gpu-a01",
        "ansible_connection": "ssh",
        "ansible_user": "ops",
        "ansible_become": True,
    }
    assert hosts["gpu-a02_2222"]["ansible_port"] == 2222 and "ansible_user" not in hosts["gpu-a02_2222"]
    assert "ansible_become" not in hosts["root@gpu-a02_2222"], "root needs no sudo"
    assert got.labels == {
        "ops@gpu-a01": "ops@gpu-a01",
        "gpu-a02_2222": "gpu-a02:2222",
        "root@gpu-a02_2222": "root@gpu-a02:2222",
    }


def test_ssh_key_and_known_hosts_become_the_hosts_ssh_settings(tmp_path: Path):
    from bwstack.checks.hostspec import SshOptions

    key, known = tmp_path / "id key", tmp_path / "known hosts"
    key.write_text("k")
    known.write_text("")
    got = playbooks.parse_targets("ssh://root@node:2222", SshOptions.from_args(str(key), str(known)))
    host = got.inventory["all"]["children"]["bwstack_nodes"]["hosts"]["root@node_2222"]
    assert host["ansible_ssh_private_key_file"] == str(key)
    common = shlex.split(host["ansible_ssh_common_args"])  # how Ansible splits it for ssh, scp and sftp
    assert common == ["-o", f"UserKnownHostsFile={known}", "-o", "StrictHostKeyChecking=yes"]


def test_ansible_target_uses_the_users_inventory_with_limit_and_group(tmp_path: Path):
    inv = tmp_path / "hosts.yml"
    inv.write_text("all: {}\n")
    got = playbooks.parse_targets(f"ansible://{inv}?limit=rack_a&group=gpus")
    assert (got.args, got.extra, got.inventory) == (
        ["-i", str(inv), "--limit", "rack_a"],
        {"bwstack_hosts": "gpus"},
        None,
    )


@pytest.mark.parametrize(
    "spec",
    [
        "ftp://x",
        "ssh://",
        "ansible:///no/such/inventory",
        "local://,ansible://x",
        "",
        "ssh://a,,ssh://b",
        "ssh://h:0",
        "ssh://h:port",
        "ssh://u:password@h",
        "ssh://-oProxyCommand=x",
        "ssh://h?ssh_config=/tmp/c",
        "docker://c",
        "ssh://h,ssh://h",
    ],
)
def test_bad_targets_are_refused_with_a_usage_error(spec: str):
    with pytest.raises(UsageError):
        playbooks.parse_targets(spec)


@pytest.mark.parametrize("option", ["--ssh-key", "--known-hosts"])
@pytest.mark.parametrize("value", ["", "/no/such/file", '/tmp/with"quote'])
def test_bad_ssh_files_are_one_line_and_exit_2(option: str, value: str):
    result = subprocess.run(
        [sys.executable, "-m", "bwstack", "provision", "--target", "ssh://root@node", option, value],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith(f"bwstack: error: {option}") and len(result.stderr.splitlines()) == 1


def test_a_failed_run_ends_with_one_line_per_failed_host_by_its_label():
    outcome = playbooks._Outcome()
    lines = [
        'fatal: [root@node_2222]: UNREACHABLE! => {"changed": false, "msg": "Task failed: Failed to connect to the '
        'host via ssh: Timeout, server not responding.", "unreachable": true}',
        'fatal: [gpu-a01]: FAILED! => {"changed": false, "msg": "verify failed on gpu-a01: x"}',
        'fatal: [gpu-a01]: FAILED! => {"changed": false, "msg": "provisioning failed on gpu-a01 at \\"Run\\": x"}',
    ]
    for line in lines:
        outcome.read(line)
    assert outcome.summary({"root@node_2222": "root@node:2222"}) == (
        "root@node:2222: unreachable: Failed to connect to the host via ssh: Timeout, server not responding.; "
        'gpu-a01: provisioning failed on gpu-a01 at "Run": x'
    )


def test_credentials_in_urls_are_masked_in_what_bwstack_prints():
    assert playbooks.redact("-e bwstack_tool_index_url=https://ci:s3cr3t@pypi.example/simple") == (
        "-e bwstack_tool_index_url=https://***@pypi.example/simple"
    )


def test_missing_ansible_playbook_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BwstackError, match="ansible-playbook not found"):
        playbooks.ansible_playbook()


def test_provision_options_become_extra_vars(tmp_path: Path):
    from bwstack.cli import options
    from bwstack.cli.main import build_parser

    args = build_parser().parse_args(
        ["--lock", "stack.lock.yaml", "provision", "--wheelhouse", "/w", "--index", "pypi=https://m/simple",
         "--ca-bundle", "/ca.pem", "--skip", "nvcc=no nvcc", "--root", "/r"]
    )  # fmt: skip
    got = playbooks._common_vars(options.playbook_settings(args))
    assert got["bwstack_wheelhouse"] == ["/w"] and got["bwstack_index"] == ["pypi=https://m/simple"]
    assert (got["bwstack_ca_bundle"], got["bwstack_root"]) == ("/ca.pem", "/r") and "bwstack_offline" not in got
    assert got["bwstack_verify_skip"] == ["nvcc=no nvcc"]


def test_the_fleet_takes_typed_settings_and_passes_only_what_was_given():
    from bwstack.fleet.settings import PlaybookSettings, SourceSettings, StoreSettings

    bare = playbooks._common_vars(PlaybookSettings(lock="stack.lock.yaml"))
    assert set(bare) == {"bwstack_lock"}  # the rest stays with the inventory
    got = playbooks._common_vars(
        PlaybookSettings(
            lock="stack.lock.yaml",
            store=StoreSettings(ml_env="/srv/ml-env", cuda_link="none"),
            sources=SourceSettings(allow_unhashed=("torchaudio",), offline=True),
            waivers=("nvcc=no nvcc",),
        )
    )
    assert (got["bwstack_ml_env"], got["bwstack_cuda_link"], got["bwstack_allow_unhashed"]) == (
        "/srv/ml-env", "none", ["torchaudio"],
    )  # fmt: skip
    assert got["bwstack_offline"] is True and got["bwstack_verify_skip"] == ["nvcc=no nvcc"]
    assert "bwstack_take_over_links" not in got  # the inventory's, unless the command line gives it
    taking = playbooks._common_vars(PlaybookSettings(lock="stack.lock.yaml", store=StoreSettings(take_over_links=True)))
    assert taking["bwstack_take_over_links"] is True


@pytest.mark.parametrize("command", [["provision"], ["rollback", "--target", "local://"]])
def test_the_fleet_commands_carry_take_over_links_to_the_nodes(command):
    """A node's link error tells the user to pass --take-over-links: the commands that run the playbooks take it."""
    from bwstack.cli import options
    from bwstack.cli.main import build_parser

    args = build_parser().parse_args(["--lock", "stack.lock.yaml", *command, "--take-over-links"])
    assert playbooks._common_vars(options.playbook_settings(args))["bwstack_take_over_links"] is True


def test_controller_facts_give_each_profiles_preflight_requirements_and_toolkit(real_lock_path: Path):
    from bwstack.lock.model import load_lock

    facts = playbooks.controller_facts(load_lock(real_lock_path), None, None, None)
    assert facts["profiles"]["cu130"]["cuda"]["apt_package"] == "cuda-toolkit-13-0"
    assert facts["profiles"]["cu128"]["requirements"]["min_driver"] == "525.60.13"
    assert "debian-12" in facts["system_packages"]


def test_controller_facts_name_the_profile_by_the_same_rule_as_every_command(real_lock_path: Path):
    from bwstack.errors import UsageError
    from bwstack.lock.model import load_lock

    lock = load_lock(real_lock_path)
    assert playbooks.controller_facts(lock, None, None, None)["profile"] == lock.profile(None).name == "cu130"
    assert playbooks.controller_facts(lock, None, None, None, profile="")["profile"] == "cu130"
    assert playbooks.controller_facts(lock, None, None, None, profile="cu128")["profile"] == "cu128"
    with pytest.raises(UsageError, match="unknown profile 'cu999'"):
        playbooks.controller_facts(lock, None, None, None, profile="cu999")


# ------------------------------------------------------------------------------------------------ quick real runs


@pytest.fixture(scope="module")
def fakestack_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    from fixtures import fakestack

    base = tmp_path_factory.mktemp("ansible-fakestack")
    fakestack.make_stack(base)
    return base


@needs_ansible
@pytest.mark.ansible
def test_preflight_refuses_a_node_without_a_gpu_before_touching_it(fakestack_dir: Path, tmp_path: Path):
    node = tmp_path / "node"
    variables = fixture_vars(fakestack_dir, node, bwstack_preflight_allow_no_gpu=False, bwstack_profile="fixture-new")
    result = playbook("provision.yml", local_inventory(tmp_path / "hosts.yml"), variables, log=tmp_path / "run.log")
    if "REFUSED gpu" not in result.out and "ok      gpu" in result.out:
        pytest.skip("this machine has a GPU of the profile's capability")
    assert result.rc != 0
    assert "preflight refused localhost for profile fixture-new: no NVIDIA GPU" in result.out
    assert not node.exists()


@needs_ansible
@pytest.mark.ansible
def test_a_failed_canary_stops_the_rollout_before_the_next_batch(fakestack_dir: Path, tmp_path: Path):
    hosts = {
        "canary": {"bwstack_root": str(tmp_path / "canary" / "root"), "bwstack_preflight_min_free_gb": 1e9},
        "second": {"bwstack_root": str(tmp_path / "second" / "root")},
    }
    variables = fixture_vars(fakestack_dir, tmp_path / "unused", bwstack_profile="fixture-new")
    del variables["bwstack_root"], variables["bwstack_preflight_min_free_gb"]
    result = playbook(
        "provision.yml", local_inventory(tmp_path / "hosts.yml", hosts), variables, log=tmp_path / "run.log"
    )
    assert result.rc != 0
    assert result.recap["canary"]["failed"] == 1
    assert "second" not in result.recap, "the second batch must not start after the canary failed"
    assert not (tmp_path / "second").exists()


@needs_ansible
@pytest.mark.ansible
def test_check_mode_on_a_fresh_node_reports_changes_and_creates_nothing(fakestack_dir: Path, tmp_path: Path):
    node = tmp_path / "node"
    variables = fixture_vars(fakestack_dir, node, bwstack_profile="fixture-new", bwstack_cuda_method="pip")
    result = playbook(
        "provision.yml",
        local_inventory(tmp_path / "hosts.yml"),
        variables,
        "--check",
        "--diff",
        log=tmp_path / "run.log",
    ).ok()
    assert result.changed() > 0
    assert "a real run would install it and build fixture-new" in result.out
    assert not node.exists(), "check mode created files on the node"


@needs_ansible
@pytest.mark.ansible
def test_apt_method_in_check_mode_plans_keyring_repository_and_pinned_package(fakestack_dir: Path, tmp_path: Path):
    """NVIDIA's repository is unreachable here: a stand-in keyring .deb in a local directory takes its place, and
    only check mode runs (nothing is installed; the package itself cannot be found without the real repo)."""
    pkg = tmp_path / "pkg"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "DEBIAN" / "control").write_text(
        "Package: cuda-keyring\nVersion: 1.1-1\nArchitecture: all\nMaintainer: tests <t@bwstack.invalid>\n"
        "Description: TEST FIXTURE standing in for NVIDIA's cuda-keyring\n"
    )
    repo = tmp_path / "repos"
    arch = "sbsa" if platform.machine() == "aarch64" else "x86_64"
    os_release = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
    os_id, version = os_release["ID"].strip('"'), os_release["VERSION_ID"].strip('"')
    folder = repo / f"{os_id}{version.replace('.', '') if os_id == 'ubuntu' else version.split('.')[0]}" / arch
    folder.mkdir(parents=True)
    built = subprocess.run(
        ["dpkg-deb", "--build", str(pkg), str(folder / "cuda-keyring_1.1-1_all.deb")], capture_output=True
    )
    if built.returncode != 0:
        pytest.skip("dpkg-deb is not available")
    node = tmp_path / "node"
    variables = fixture_vars(
        fakestack_dir,
        node,
        bwstack_profile="fixture-new",
        bwstack_cuda_method="apt",
        bwstack_cuda_apt_repo_base=str(repo),
    )
    result = playbook(
        "provision.yml",
        local_inventory(tmp_path / "hosts.yml"),
        variables,
        "--check",
        "--diff",
        "--tags",
        "bwstack_cuda",
        log=tmp_path / "run.log",
    ).ok()
    assert "Install NVIDIA's CUDA keyring package" in result.out
    assert "fixture=0" in result.out or "No package matching 'fixture'" in result.out
    assert not Path("/etc/apt/sources.list.d/bwstack-cuda.sources").exists()
    assert subprocess.run(["dpkg", "-s", "cuda-keyring"], capture_output=True).returncode != 0


# ------------------------------------------------------------------------------------------------ the CUDA link

_LINK_TASKS = (
    "Remember where the active-toolkit link points",
    "Look at the active-toolkit link after the package install",
    "Put the active-toolkit link back where it was (the generation switch decides it, not the package)",
)


def _apt_link_play(tmp_path: Path, link: Path, moved_to: str | None) -> Path:
    """The apt method's own link tasks (from apt.yml, as written), with a stand-in for the package install that
    re-points the link (moved_to) or leaves it."""
    apt = yaml.safe_load((ANSIBLE / "roles" / "bwstack_cuda" / "tasks" / "apt.yml").read_text())
    tasks = {t["name"]: t for t in apt}
    package = {
        "name": "The package install (stand-in)",
        "ansible.builtin.file": {"path": str(link), "src": moved_to, "state": "link", "force": True},
        "when": moved_to is not None,
    }
    play = [{
        "name": "apt link tasks", "hosts": "bwstack_nodes", "gather_facts": False,
        "vars": {"bwstack_cuda_link": str(link)},
        "tasks": [tasks[_LINK_TASKS[0]], package, tasks[_LINK_TASKS[1]], tasks[_LINK_TASKS[2]]],
    }]  # fmt: skip
    path = tmp_path / "play.yml"
    path.write_text(yaml.safe_dump(play, sort_keys=False))
    return path


@needs_ansible
@pytest.mark.parametrize(
    ("target", "moved_to", "after"),
    [
        ("alternatives", None, "alternatives"),
        ("cuda-12.8", None, "cuda-12.8"),
        ("cuda-12.8", "cuda-13.0", "cuda-12.8"),
    ],
    ids=["an-alternatives-chain-stays", "a-relative-link-stays-relative", "a-link-the-package-moved-goes-back"],
)
def test_the_apt_method_puts_back_only_a_link_the_package_moved_as_it_was_written(tmp_path, target, moved_to, after):
    for name in ("cuda-12.8", "cuda-13.0"):
        (tmp_path / name).mkdir()
    (tmp_path / "alternatives").symlink_to("cuda-12.8")  # as /etc/alternatives/cuda would be
    link = tmp_path / "cuda"
    link.symlink_to(target)
    play = _apt_link_play(tmp_path, link, moved_to)
    result = run([tool("ansible-playbook"), "-i", str(local_inventory(tmp_path / "hosts.yml")), str(play)])
    assert result.rc == 0, result.out[-2000:]
    assert os.readlink(link) == after


@needs_ansible
@pytest.mark.parametrize("option", ["--root", "--ml-env"], ids=["a-command-in-root", "a-command-in-ml-env"])
def test_option_values_reach_ansible_as_text_never_as_templates_run_on_the_controller(tmp_path, option):
    """bwstack's options go to ansible-playbook as extra vars, which Ansible would render: a value holding
    `{{ lookup('pipe', ...) }}` (a path, a waiver reason, a password) must stay the text it is."""
    marker = tmp_path / "ran-on-controller"
    value = f"{tmp_path}/{{{{ lookup('pipe', 'touch {marker}') }}}}"
    paths = {"--root": str(tmp_path / "store"), "--ml-env": str(tmp_path / "ml-env"), option: value}
    result = bwstack(
        "rollback", "--target", "local://", "--root", paths["--root"], "--ml-env", paths["--ml-env"],
        "--cuda-link", "none", env={"BWSTACK_LOG_DIR": str(tmp_path / "log")}, timeout=300,
    )  # fmt: skip
    assert not marker.exists(), "the template in the option ran"
    if option == "--root":
        assert f"bwstack is not installed at {value}/tool/bin/bwstack" in result.stderr + result.stdout


@needs_ansible
def test_ssh_connection_values_reach_the_inventory_as_text_never_as_templates(tmp_path):
    """The inventory bwstack writes for --target ssh:// holds the operator's paths (--ssh-key, --known-hosts):
    a template in a file name must not run on the controller."""
    marker = tmp_path / "ran-on-controller"
    key = tmp_path / "{{ lookup('pipe', 'touch $BWSTACK_TEST_MARKER') }}"  # a file name holds no slash
    key.write_text("not a key")
    key.chmod(0o600)
    result = bwstack(
        "rollback", "--target", "ssh://root@127.0.0.1:1", "--ssh-key", str(key), "--root", str(tmp_path / "store"),
        "--ml-env", str(tmp_path / "ml-env"), "--cuda-link", "none", timeout=300,
        env={"BWSTACK_LOG_DIR": str(tmp_path / "log"), "BWSTACK_TEST_MARKER": str(marker)},
    )  # fmt: skip
    assert result.returncode != 0
    assert not marker.exists(), "the template in the key's path ran"


_ECHO_FACTS = ["/bin/sh", "-c", "echo '{}'", "sh"]  # a stand-in controller: `controller-facts` answering {}


def _controller_facts_play(tmp_path: Path, before: list[dict]) -> Path:
    """A play of the real controller_facts.yml (what every role imports first), after `before`."""
    tasks = [
        *before,
        {
            "ansible.builtin.import_tasks": str(ANSIBLE / "roles" / "bwstack" / "tasks" / "controller_facts.yml"),
            "vars": {"bwstack_lock": "", "bwstack_controller_facts_args": "{{ ['--profile', bwstack_profile] }}"},
        },
    ]
    path = tmp_path / "play.yml"
    path.write_text(yaml.safe_dump([{"hosts": "bwstack_nodes", "gather_facts": False, "tasks": tasks}]))
    return path


@needs_ansible
def test_a_nodes_facts_never_become_variables_the_controller_runs(tmp_path):
    """A compromised node answers every module call: facts it reports, injected as variables (Ansible's default),
    would outrank host_vars and role defaults, such as the command the controller runs for the lock."""
    marker = tmp_path / "ran-on-controller"
    (tmp_path / "library").mkdir()
    (tmp_path / "library" / "node_reply.py").write_text(
        "#!/usr/bin/python3\nimport json\n"
        f"print(json.dumps({{'changed': False, 'ansible_facts': {{'bwstack_controller_bwstack': "
        f"['/bin/sh', '-c', 'touch {marker}; echo {{}}', 'sh']}}}}))\n"
    )
    play = _controller_facts_play(tmp_path, [{"node_reply": {}}])
    hosts = {"node": {"bwstack_controller_bwstack": _ECHO_FACTS, "bwstack_profile": "cu128"}}
    result = run([tool("ansible-playbook"), "-i", str(local_inventory(tmp_path / "hosts.yml", hosts)), str(play)])
    assert result.rc == 0, result.out[-2000:]
    assert not marker.exists(), "the node's fact ran as the controller's command"


@needs_ansible
def test_a_host_set_up_with_another_profile_than_its_batch_fails_instead_of_taking_the_first_hosts(tmp_path):
    """The lock is read once per batch, with its first host's settings: a host whose host_vars name another lock,
    profile or wheel would otherwise be provisioned from the first host's."""
    play = _controller_facts_play(tmp_path, [])
    hosts = {
        "team-a": {"bwstack_controller_bwstack": _ECHO_FACTS, "bwstack_profile": "cu128"},
        "team-b": {"bwstack_controller_bwstack": _ECHO_FACTS, "bwstack_profile": "cu130"},
    }
    result = run([tool("ansible-playbook"), "-i", str(local_inventory(tmp_path / "hosts.yml", hosts)), str(play)])
    assert result.rc != 0
    assert "team-b is set up with another lock, profile, wheel or controller cache than team-a" in result.out
    assert "team-a                     : ok=" in result.out and "failed=0" in result.out.split("team-a", 2)[-1]


def _counting_controller(tmp_path: Path) -> tuple[list[str], Path]:
    """A stand-in controller that answers {} and appends each command line it was run with to a file."""
    calls = tmp_path / "controller-calls"
    return ["/bin/sh", "-c", f'echo "$*" >> {calls}; echo "{{}}"', "sh"], calls


def _reads_play(tmp_path: Path, requests: list[list[str]]) -> Path:
    """A play that imports the real controller_facts.yml once per request, as provision.yml's roles do in turn."""
    path = ANSIBLE / "roles" / "bwstack" / "tasks" / "controller_facts.yml"
    tasks = [
        {"ansible.builtin.import_tasks": str(path), "vars": {"bwstack_lock": "", "bwstack_controller_facts_args": args}}
        for args in requests
    ]
    play = tmp_path / "play.yml"
    play.write_text(yaml.safe_dump([{"hosts": "bwstack_nodes", "gather_facts": False, "tasks": tasks}]))
    return play


_COVERING_READS = [
    ("a role asking for part of what was read", [["--profile", "cu128", "--probe-dir", "/c"], ["--profile", "cu128"]],
     ["--profile cu128 --probe-dir /c"]),
    ("roles asking for the same", [["--wheel-dir", "/w"], ["--wheel-dir", "/w"]], ["--wheel-dir /w"]),
    ("a role asking for an option not read", [["--profile", "cu128"], ["--profile", "cu128", "--probe-dir", "/c"]],
     ["--profile cu128", "--profile cu128 --probe-dir /c"]),
    ("a role asking for another profile", [["--profile", "cu128"], ["--profile", "cu130"]],
     ["--profile cu128", "--profile cu130"]),
    ("a role asking for the lock's default profile",
     [["--profile", "cu128", "--probe-dir", "/c"], ["--probe-dir", "/c"]],
     ["--profile cu128 --probe-dir /c", "--probe-dir /c"]),
    ("a role asking for another wheel", [["--wheel", "/a.whl"], ["--wheel", "/b.whl"]],
     ["--wheel /a.whl", "--wheel /b.whl"]),
]  # fmt: skip


@needs_ansible
@pytest.mark.parametrize(("case", "requests", "expected"), _COVERING_READS, ids=[c[0] for c in _COVERING_READS])
def test_the_lock_is_read_again_only_when_the_plays_answer_does_not_cover_the_request(
    tmp_path, case, requests, expected
):
    """Every role imports the lock read; an answer of this play that covers a role's request (the same profile,
    every other option among those read) is used again instead of starting bwstack on the controller again."""
    controller, calls = _counting_controller(tmp_path)
    hosts = {"node": {"bwstack_controller_bwstack": controller}}
    play = _reads_play(tmp_path, requests)
    result = run([tool("ansible-playbook"), "-i", str(local_inventory(tmp_path / "hosts.yml", hosts)), str(play)])
    assert result.rc == 0, result.out[-2000:]
    assert [line.removeprefix("controller-facts ") for line in calls.read_text().splitlines()] == expected


@needs_ansible
def test_hosts_a_later_play_adds_to_the_batch_get_the_lock_read_for_them(tmp_path):
    """run_once decides on the batch's first host: one that read the lock in an earlier play must not make the
    others, with the same settings, go without an answer."""
    controller, calls = _counting_controller(tmp_path)
    hosts = {name: {"bwstack_controller_bwstack": controller} for name in ("h1", "h2", "h3")}
    path = ANSIBLE / "roles" / "bwstack" / "tasks" / "controller_facts.yml"
    task = {"ansible.builtin.import_tasks": str(path),
            "vars": {"bwstack_lock": "", "bwstack_controller_facts_args": ["--profile", "cu128"]}}  # fmt: skip
    play = tmp_path / "play.yml"
    play.write_text(yaml.safe_dump([
        {"hosts": "h1", "gather_facts": False, "tasks": [task]},
        {"hosts": "bwstack_nodes", "gather_facts": False, "tasks": [task]},
    ]))  # fmt: skip
    result = run([tool("ansible-playbook"), "-i", str(local_inventory(tmp_path / "hosts.yml", hosts)), str(play)])
    assert result.rc == 0, result.out[-2000:]
    assert "failed=0" in result.out.split("h3", 2)[-1]
    assert calls.read_text().splitlines() == ["controller-facts --profile cu128"] * 2


@needs_ansible
def test_a_host_whose_settings_the_first_read_does_not_cover_fails_on_the_reused_read(tmp_path):
    """With the answer used again, a host of the batch set up with another profile still fails the batch check
    in the role that asks for it, and is not provisioned from the first host's."""
    controller, calls = _counting_controller(tmp_path)
    hosts = {
        "team-a": {"bwstack_controller_bwstack": controller, "bwstack_profile": "cu128"},
        "team-b": {"bwstack_controller_bwstack": controller, "bwstack_profile": "cu130"},
    }
    play = _reads_play(tmp_path, [["--wheel-dir", "/w"], ["--profile", "{{ bwstack_profile }}"]])
    result = run([tool("ansible-playbook"), "-i", str(local_inventory(tmp_path / "hosts.yml", hosts)), str(play)])
    assert result.rc != 0
    assert "team-b is set up with another lock, profile, wheel or controller cache than team-a" in result.out
    assert calls.read_text().splitlines() == ["controller-facts --wheel-dir /w", "controller-facts --profile cu128"]


def _receipt(compared: bool, changed: list[str]) -> dict:
    return {"converged": False, "why": "changed since the last run", "compared": compared, "changed": changed}


_TOOL_ANSWERS = [
    # case, what the node's bwstack answers to `receipt --check` (None: no bwstack there), changed, drifted
    ("no bwstack on the node yet", None, False, False),
    ("an older bwstack without receipt", (2, "usage: bwstack ..."), True, False),
    ("no receipt to compare with", (0, _receipt(False, [])), True, False),
    ("compared and the tool venv unchanged", (0, _receipt(True, ["/x"])), False, False),
    ("compared and the tool venv changed", (0, _receipt(True, ["{root}/tool"])), True, True),
]


@needs_ansible
@pytest.mark.parametrize(("case", "answer", "changed", "drifted"), _TOOL_ANSWERS, ids=[c[0] for c in _TOOL_ANSWERS])
def test_the_converged_check_says_whether_the_tool_venv_is_made_again_and_whether_preflight_may_run_it(
    tmp_path, case, answer, changed, drifted
):
    """bwstack_receipt_tool_changed (the tool role makes the venv again) and bwstack_receipt_tool_drifted (preflight
    does not run it), from the real converged.yml against a stand-in for the node's bwstack."""
    root = tmp_path / "store"
    if answer is not None:
        code, out = answer
        text = json.dumps(out).replace("{root}", str(root)) if isinstance(out, dict) else out
        (root / "tool" / "bin").mkdir(parents=True)
        fake = root / "tool" / "bin" / "bwstack"
        fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{text}\nEOF\nexit {code}\n")
        fake.chmod(0o755)
    answer_of_controller = {"lock_sha256": "0" * 64, "wheel": {"sha256": "1" * 64}, "profile": "cu128"}
    variables = {
        "bwstack_controller_bwstack": ["/bin/sh", "-c", f"echo '{json.dumps(answer_of_controller)}'", "sh"],
        "bwstack_lock": "", "bwstack_root": str(root), "bwstack_cuda_method": "none", "bwstack_tool_wrapper": "",
        "bwstack_mlenv_os_release": "/etc/os-release", "bwstack_tool_wheel": "",
    }  # fmt: skip
    tasks = [
        {"ansible.builtin.import_role": {"name": "bwstack", "tasks_from": "converged.yml"}},
        {"ansible.builtin.debug": {"msg": "FACTS {{ {'changed': bwstack_receipt_tool_changed | bool, "
                                          "'drifted': bwstack_receipt_tool_drifted | bool} | to_json }}"}},
    ]  # fmt: skip
    play = tmp_path / "play.yml"
    play.write_text(yaml.safe_dump([{"hosts": "bwstack_nodes", "gather_facts": False, "vars": variables,
                                     "tasks": tasks}]))  # fmt: skip
    # The digest of every role's settings is not what this asks about: no settings (extra vars outrank role vars).
    no_settings = ["-e", json.dumps({"bwstack_receipt_settings": []})]
    result = run([tool("ansible-playbook"), "-i", str(local_inventory(tmp_path / "hosts.yml")), *no_settings,
                  str(play)])  # fmt: skip
    assert result.rc == 0, result.out[-3000:]
    facts = json.loads(result.out.split('"msg": "FACTS ', 1)[1].split('"\n', 1)[0].replace('\\"', '"'))
    assert facts == {"changed": changed, "drifted": drifted}


# A stand-in interpreter for the tool role: `-m venv DIR` makes a venv whose python (pip included) and bwstack
# succeed, so the role's own steps run without installing anything.
_FAKE_PYTHON = """#!/bin/sh
if [ "$1" = -m ] && [ "$2" = venv ]; then
  mkdir -p "$3/bin"
  printf '#!/bin/sh\\nexit 0\\n' > "$3/bin/python"; cp "$3/bin/python" "$3/bin/bwstack"
  chmod +x "$3/bin/python" "$3/bin/bwstack"; echo made > "$3/made-by-this-run"
  exit 0
fi
exec %s "$@"
"""


def _tool_install(tmp_path: Path, root: Path, *, python: str, **more) -> Run:
    """The tool role's install.yml on this machine against `root`, the controller answering with a wheel that is
    not a wheel (pip fails on it)."""
    wheel = tmp_path / "bwstack-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"not a zip")
    lock = tmp_path / "stack.lock.yaml"
    lock.write_text("a lock\n")
    answer = {"lock": str(lock), "wheel": {"path": str(wheel), "name": wheel.name, "sha256": "0" * 64}}
    (tmp_path / "wheelhouse").mkdir(exist_ok=True)
    variables = {
        "bwstack_controller_bwstack": ["/bin/sh", "-c", f"echo '{json.dumps(answer)}'", "sh"], "bwstack_lock": "",
        "bwstack_root": str(root), "bwstack_tool_python": python, "bwstack_tool_os_packages": [],
        "bwstack_tool_offline": True, "bwstack_tool_wheelhouse": str(tmp_path / "wheelhouse"),
        "bwstack_tool_index_url": "", "bwstack_ca_bundle": "", "bwstack_tool_wrapper": "", **more,
    }  # fmt: skip
    tasks = [{"ansible.builtin.import_role": {"name": "bwstack_tool", "tasks_from": "install.yml"}}]
    play = tmp_path / "play.yml"
    play.write_text(yaml.safe_dump([{"hosts": "bwstack_nodes", "gather_facts": False, "vars": variables,
                                     "tasks": tasks}]))  # fmt: skip
    return run([tool("ansible-playbook"), "-i", str(local_inventory(tmp_path / "hosts.yml")), str(play)])


def _venv(path: Path, text: str) -> Path:
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").write_text(text)
    return path


@needs_ansible
def test_a_tool_venv_made_again_is_put_back_as_it_was_when_the_new_one_cannot_be_installed(tmp_path):
    """The venv root runs bwstack from is set aside, not removed, while a new one is made: a pip that fails leaves
    the node with the bwstack it had (here the wheel is not a wheel, so pip fails)."""
    root = tmp_path / "root"
    old = _venv(root / "tool", "the venv the node had\n")
    result = _tool_install(tmp_path, root, python=sys.executable, bwstack_receipt_tool_changed=True)
    assert result.rc != 0
    assert "pip could not install bwstack-0.1.0-py3-none-any.whl" in result.out
    assert (old / "bin" / "python").read_text() == "the venv the node had\n"
    assert not (root / "tool.previous").exists()


@needs_ansible
def test_a_run_after_one_stopped_while_making_the_tool_venv_starts_from_the_venv_it_set_aside(tmp_path):
    """A run killed between setting the venv aside and installing the new one leaves a half-made `tool` beside
    `tool.previous`; the next run makes the venv again whatever the converged check said, and puts the one set
    aside back when it cannot."""
    root = tmp_path / "root"
    _venv(root / "tool", "half made\n")
    _venv(root / "tool.previous", "the last whole venv\n")
    result = _tool_install(tmp_path, root, python=sys.executable)
    assert result.rc != 0
    assert (root / "tool" / "bin" / "python").read_text() == "the last whole venv\n"
    assert not (root / "tool.previous").exists()


@needs_ansible
def test_a_run_that_makes_the_tool_venv_removes_the_one_an_interrupted_run_set_aside(tmp_path):
    root = tmp_path / "root"
    _venv(root / "tool", "half made\n")
    _venv(root / "tool.previous", "the last whole venv\n")
    python = tmp_path / "python"
    python.write_text(_FAKE_PYTHON % sys.executable)
    python.chmod(0o755)
    result = _tool_install(tmp_path, root, python=str(python))
    assert result.rc == 0, result.out[-2000:]
    assert (root / "tool" / "made-by-this-run").exists()
    assert not (root / "tool.previous").exists()


def test_a_store_root_holding_the_tool_venv_set_aside_is_still_a_store(tmp_path):
    """An interrupted tool role leaves `tool.previous`: builds and rollbacks of that store must not refuse it."""
    from bwstack.store.layout import Layout
    from bwstack.store.session import check_store_root

    root = tmp_path / "root"
    for name in ("tool", "tool.previous", "generations"):
        (root / name).mkdir(parents=True)
    check_store_root(Layout(root, tmp_path / "ml-env", None, None))


@needs_ansible
@pytest.mark.parametrize(("uv", "installer"), [("", "pip"), ("/usr/local/bin/uv", "uv")])
def test_the_installers_error_shows_neither_the_index_url_nor_credentials_in_urls(tmp_path, uv, installer):
    """A token may sit in the index URL's path or query, where the user:pass@ masking does not reach; uv prints
    URLs normalised (host lowercased, default port dropped), so the URL as given may not appear word for word."""
    url = "https://Mirror.Example:443/simple?token=S3CRET-TOKEN"
    tasks = _tasks(yaml.safe_load((ANSIBLE / "roles" / "bwstack_tool" / "tasks" / "install.yml").read_text()))
    fail = next(t for t in tasks if t.get("name", "").startswith("Fail with the installer's error"))
    play = [{"hosts": "bwstack_nodes", "gather_facts": False, "tasks": [fail], "vars": {
        "bwstack_tool_uv": uv,
        "bwstack_tool_index_url": url,
        "bwstack_tool_venv": "/opt/bwstack/tool",
        "bwstack_tool_facts": {"wheel": {"name": "bwstack-0.1.0-py3-none-any.whl"}},
        "bwstack_tool_pip": {"rc": 1, "stderr_lines": [
            f"ERROR: Could not fetch {url}/torch/ (HTTP 403)", "Looking in https://deploy:OTHER-SECRET@a.example/x",
            "error: Request failed after 3 retries: https://mirror.example/simple/torch/?token=S3CRET-TOKEN (403)",
            "Looking in https://user:pass-secret@b.example/y",
        ]},
    }}]  # fmt: skip
    path = tmp_path / "play.yml"
    path.write_text(yaml.safe_dump(play, sort_keys=False))
    result = run([tool("ansible-playbook"), "-i", str(local_inventory(tmp_path / "hosts.yml")), str(path)])
    assert result.rc != 0 and f"{installer} could not install" in result.out
    assert "S3CRET" not in result.out and "OTHER-SECRET" not in result.out and "pass-secret" not in result.out
    assert "<the index URL>/torch/" in result.out and "://***@a.example" in result.out
