"""`bwstack verify` on fixture envs: host specs, output, exit codes, waivers (real-env checks: test_real_stack)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml
from helpers import REPO, bwstack, needs_py312

from bwstack.image import daemon as docker_daemon

pytestmark = needs_py312


def _checks(result) -> dict:
    payload = json.loads(result.stdout)
    (host,) = payload["hosts"].values()
    return {c["check"]: c for c in host["checks"]}


def _outcomes(result) -> dict[str, str]:
    return {name: c["outcome"] for name, c in _checks(result).items()}


def test_verify_reports_a_table_and_fails_when_a_check_fails(stack):
    stack.build("fixture-new", check=True)
    result = stack.run("verify", "--no-runtime")
    assert result.returncode == 1
    assert "PASS  every_pinned_package_is_at_the_locked_version" in result.stdout
    assert "FAIL  toolkit_nvcc_is_the_profiles_cuda_version" in result.stdout
    assert "passed" in result.stdout.splitlines()[-1]


def test_verify_json_has_one_entry_per_host_with_every_check(stack):
    stack.build("fixture-new", check=True)
    checks = _checks(stack.run("verify", "--no-runtime", "--json"))
    assert checks["every_pinned_package_is_at_the_locked_version"]["outcome"] == "passed"
    assert checks["torch_sees_every_gpu"]["outcome"] == "skipped"
    assert "no GPU" in checks["torch_sees_every_gpu"]["message"]


@pytest.mark.parametrize(
    "setting",
    [
        {"PYTEST_ADDOPTS": "-k nothing_matches_this"},  # would deselect every check
        {"PYTEST_PLUGINS": "bwstack_no_such_plugin"},  # would stop the session at start
    ],
    ids=["addopts", "plugins"],
)
def test_the_callers_pytest_settings_do_not_change_the_report(stack, setting):
    stack.build("fixture-new", check=True)
    plain = _outcomes(stack.run("verify", "--no-runtime", "--json"))
    told = stack.run("verify", "--no-runtime", "--json", extra_env=setting)
    assert told.returncode == 1, told.stderr  # the fixture's nvcc check fails, as without the setting
    assert _outcomes(told) == plain


def test_an_ini_file_or_conftest_in_a_folder_above_the_installed_checks_does_not_change_the_report(stack, tmp_path):
    """Where bwstack is installed, the folders above its checks are not its own: their pytest.ini (any ini file
    pytest reads) and conftest.py must not reach the session."""
    stack.build("fixture-new", check=True)
    plain = _outcomes(stack.run("verify", "--no-runtime", "--json"))
    above = tmp_path / "above"
    shutil.copytree(REPO / "tests" / "infra", above / "site" / "bwstack_infra")
    (above / "pytest.ini").write_text("[pytest]\npython_functions = nothing_matches_this\naddopts = -k nothing\n")
    loaded = tmp_path / "conftest-ran"
    (above / "conftest.py").write_text(f"open({str(loaded)!r}, 'w').close()\n")
    told = stack.run("verify", "--no-runtime", "--json", extra_env={"PYTHONPATH": str(above / "site")})
    assert told.returncode == 1, told.stderr
    assert _outcomes(told) == plain
    assert not loaded.exists()


def test_the_env_is_checked_against_its_own_profile_unless_told_otherwise(stack):
    stack.build("fixture-old", check=True)
    own = _checks(stack.run("verify", "--no-runtime", "--json"))
    assert own["every_pinned_package_is_at_the_locked_version"]["outcome"] == "passed"
    other = _checks(stack.run("verify", "--no-runtime", "--json", "--profile", "fixture-new"))
    check = other["every_pinned_package_is_at_the_locked_version"]
    assert check["outcome"] == "failed" and "torch 2.9.1 (locked 2.9.1+cu130)" in check["message"]
    assert (
        "built for CUDA 12.8, profile fixture-new expects 13.0"
        in other["torch_cuda_version_matches_the_profile"]["message"]
    )


def test_a_waived_check_is_listed_as_skipped_with_the_reason(stack):
    stack.build("fixture-new", check=True)
    checks = _checks(stack.run("verify", "--no-runtime", "--json", "--skip", "nvcc=no toolkit in this fixture"))
    for name in ("toolkit_nvcc_is_the_profiles_cuda_version", "nvcc_compiles_for_the_target_architecture"):
        assert checks[name]["outcome"] == "skipped"
        assert checks[name]["message"] == "waived by the operator: no toolkit in this fixture"


def test_a_run_whose_every_check_was_waived_is_not_a_pass(stack):
    """`--skip e=x` waives every check whose name holds an "e": nothing was verified, which is not a pass."""
    stack.build("fixture-new", check=True)
    result = stack.run("verify", "--no-runtime", "--skip", "e=x")
    assert result.returncode == 1, result.stdout
    assert " 0 passed, 0 failed" in result.stdout
    assert "nothing was verified: every check was skipped or waived (not a pass)" in result.stdout


def test_gpu_checks_fail_when_the_runtime_saw_fewer_gpus_than_the_driver_lists(stack, tmp_path):
    """A stand-in nvidia-smi lists one GPU of capability 9.0 that torch cannot see: the matmul and the all-reduce
    ran on no GPU, which is not a pass, and the capability check fails (it used to skip exactly when it would
    fail)."""
    stack.build("fixture-new", check=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, NVIDIA H200 (stand-in), 9.0, 580.65, 143771'\n")
    smi.chmod(0o755)
    path = f"{bin_dir}:{os.environ['PATH']}"
    checks = _checks(stack.run("verify", "--json", "--skip", "nvcc=no toolkit", extra_env={"PATH": path}))
    assert checks["gpus_are_the_profiles_target_capability"]["outcome"] == "failed"
    assert "9.0 (NVIDIA H200 (stand-in)), not the profile's 12.0" in checks[
        "gpus_are_the_profiles_target_capability"]["message"]  # fmt: skip
    for name in ("matmul_is_correct_on_every_gpu", "nccl_allreduce_across_all_gpus_gives_the_right_sum"):
        assert checks[name]["outcome"] in ("failed", "error"), (name, checks[name])


def test_an_env_built_before_the_locks_wheel_hashes_changed_fails_the_lock_digest_check(stack, tmp_path):
    """The versions still match; the wheels the lock now names are other files (a hostile or updated lock)."""
    stack.build("fixture-new", check=True)
    name = "every_pinned_package_is_at_the_locked_version"
    assert _checks(stack.run("verify", "--no-runtime", "--json"))["the_generation_was_built_from_this_locks_closure"][
        "outcome"] == "passed"  # fmt: skip
    doc = yaml.safe_load(stack.lock.read_text())
    package = next(iter(doc["closures"]["fixture-new"]["env"].values()))
    package["wheels"][0]["sha256"] = "ab" * 32
    other = tmp_path / "other.lock.yaml"
    other.write_text(yaml.safe_dump(doc, sort_keys=False))
    result = bwstack("--lock", str(other), "verify", "--no-runtime", "--json", env=stack.env)
    checks = _checks(result)
    assert checks[name]["outcome"] == "passed"
    check = checks["the_generation_was_built_from_this_locks_closure"]
    assert check["outcome"] == "failed" and "its wheels, their hashes or its toolkit changed since" in check["message"]
    assert result.returncode == 1


def test_a_record_edited_after_sealing_fails_the_lock_digest_check(stack):
    """What the record says it was built from (its lock digest) is believed only as sealed: an edit that makes it
    name this lock's digest does not pass the check."""
    stack.build("fixture-new", check=True)
    (gen,) = (p for p in (stack.root / "generations").iterdir() if p.is_dir())
    record = gen / "record.json"
    doc = json.loads(record.read_text())
    record.chmod(0o644)
    record.write_text(json.dumps({**doc, "verification": doc.get("verification")}, indent=2))  # other bytes
    check = _checks(stack.run("verify", "--no-runtime", "--json"))["the_generation_was_built_from_this_locks_closure"]
    assert check["outcome"] == "failed" and "record.json changed since it was sealed" in check["message"]


def test_verify_runs_through_an_ansible_inventory_with_the_provision_spelling(stack, tmp_path):
    stack.build("fixture-new", check=True)
    inventory = tmp_path / "hosts.ini"
    inventory.write_text("[bwstack_nodes]\nlocalhost ansible_connection=local\nother ansible_connection=local\n")
    target = f"ansible://{inventory}?limit=localhost"
    payload = json.loads(stack.run("verify", "--no-runtime", "--json", "--target", target).stdout)
    assert list(payload["hosts"]) == ["localhost"]
    checks = {c["check"]: c for c in payload["hosts"]["localhost"]["checks"]}
    assert checks["every_pinned_package_is_at_the_locked_version"]["outcome"] == "passed"


def test_the_report_names_the_host_as_told(stack):
    stack.build("fixture-new", check=True)
    result = stack.run("verify", "--no-runtime", "--host-name", "root@gpu-a01:2222")
    assert result.stdout.splitlines()[0] == "root@gpu-a01:2222:"


def test_waivers_remembered_by_the_store_apply_without_being_given_again(stack):
    stack.build("fixture-new", check=True)
    stack.run("waivers", "--set", "nvcc=remembered: no toolkit in this fixture", check=True)
    checks = _checks(stack.run("verify", "--no-runtime", "--json"))
    check = checks["toolkit_nvcc_is_the_profiles_cuda_version"]
    assert (check["outcome"], check["message"]) == (
        "skipped",
        "waived by the operator: remembered: no toolkit in this fixture",
    )
    assert any(str(stack.root) in note for note in check["notes"])


def test_the_waivers_command_replaces_and_clears_what_the_store_remembers(stack):
    stack.build("fixture-new", check=True)
    first = json.loads(stack.run("waivers", "--set", "nvcc=why", "--json", check=True).stdout)
    again = json.loads(stack.run("waivers", "--set", "nvcc=why", "--json", check=True).stdout)
    cleared = json.loads(stack.run("waivers", "--clear", "--json", check=True).stdout)
    assert (first["changed"], again["changed"], cleared["changed"]) == (True, False, True)
    assert first["waivers"] == [{"check": "nvcc", "reason": "why"}] and cleared["waivers"] == []


def test_a_host_without_the_env_fails_every_env_check_saying_so(stack, tmp_path):
    stack.root.mkdir(parents=True)
    checks = _checks(stack.run("verify", "--no-runtime", "--json", "--env", str(tmp_path / "nowhere")))
    check = checks["every_pinned_package_is_at_the_locked_version"]
    assert check["outcome"] == "error" and "no env at" in check["message"] and "provision" in check["message"]


BAD_TARGETS = [
    "nosuch://x",
    "docker://",
    "ssh://",
    "ssh://root@host:99999",
    "ssh://-oProxyCommand=touch@x",
    "ssh://root@host?ssh_config=/tmp/c",
    "ansible://nodes?ansible_inventory=/tmp/hosts",
    "",
    "local://,local://",
    "local://,",
    "gpu-a01",
]


@pytest.mark.parametrize("spec", BAD_TARGETS)
def test_a_bad_target_is_one_line_and_exit_2(stack, spec):
    result = stack.run("verify", "--target", spec)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("bwstack: error: --target")
    assert result.stdout == ""


NOT_CHECKED = ("Traceback", "INTERNALERROR", "CommandResult(", "RuntimeError")


def _one_line_per_host(result) -> list[str]:
    for marker in NOT_CHECKED:
        assert marker not in result.stdout + result.stderr
    return result.stdout.strip().splitlines()


def test_an_unreachable_host_is_one_line_naming_it_with_user_and_port(stack):
    result = stack.run("verify", "--no-runtime", "--target", "ssh://root@127.0.0.1:1")
    assert result.returncode == 1
    assert _one_line_per_host(result) == [
        "root@127.0.0.1:1: not checked: unreachable: ssh: connect to host 127.0.0.1 port 1: Connection refused"
    ]


def test_a_host_without_python3_is_one_line(stack, tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    result = stack.run("verify", "--no-runtime", "--env", str(tmp_path / "no-env"), extra_env={"PATH": str(empty)})
    (line,) = _one_line_per_host(result)
    assert result.returncode == 1
    want = f"no python3 on the host (and no {tmp_path / 'no-env'}/bin/python): the checks run a Python probe there"
    assert line.endswith(f"(local): not checked: {want}; install python3")


# testinfra's docker:// backend runs the docker CLI against the daemon image.daemon checks for
_DOCKER_OK, _DOCKER_WHY = docker_daemon.daemon_available() if shutil.which("docker") else (False, "no docker CLI")


@pytest.mark.docker
@pytest.mark.skipif(not _DOCKER_OK, reason=_DOCKER_WHY)
def test_a_container_that_does_not_exist_is_one_line(stack):
    result = stack.run("verify", "--no-runtime", "--target", "docker://bwstack-no-such-container")
    (line,) = _one_line_per_host(result)
    assert result.returncode == 1
    assert line.startswith("docker://bwstack-no-such-container: not checked: ")
    assert "bwstack-no-such-container" in line.split("not checked: ", 1)[1]


def test_two_unreachable_targets_are_two_lines_in_the_given_order(stack):
    result = stack.run("verify", "--no-runtime", "--target", "ssh://root@127.0.0.1:2,ssh://127.0.0.1:1")
    lines = _one_line_per_host(result)
    assert [line.split(": ", 1)[0] for line in lines] == ["root@127.0.0.1:2", "127.0.0.1:1"]


@pytest.fixture
def sshd(tmp_path):
    """A throwaway sshd on 127.0.0.1 (a key of our own, an unprivileged port): a real ssh:// target."""
    daemon = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(daemon) or os.geteuid() != 0:
        pytest.skip("needs root and openssh-server (apt install openssh-server)")
    keys = tmp_path / "ssh"
    keys.mkdir(mode=0o700)
    for name in ("host", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True)
    (keys / "authorized_keys").write_text((keys / "client.pub").read_text())
    port = 22000 + os.getpid() % 1000
    config = keys / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {keys / 'host'}\nPidFile {keys / 'pid'}\n"
        f"AuthorizedKeysFile {keys / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nStrictModes no\nUsePAM no\nSetEnv BWSTACK_TEST_SSH=1\n"
    )
    os.makedirs("/run/sshd", exist_ok=True)
    proc = subprocess.Popen([daemon, "-D", "-e", "-f", str(config)], stderr=subprocess.PIPE, text=True)
    host_key = (keys / "host.pub").read_text().split()
    known_hosts = keys / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{port},[localhost]:{port} {host_key[0]} {host_key[1]}\n")
    options = ["--ssh-key", str(keys / "client"), "--known-hosts", str(known_hosts)]
    for _ in range(50):
        probe = subprocess.run(
            ["ssh", "-p", str(port), "-i", str(keys / "client"), "-o", f"UserKnownHostsFile={known_hosts}",
             "-o", "BatchMode=yes", "root@127.0.0.1", "true"],
            capture_output=True,
        )  # fmt: skip
        if probe.returncode == 0:
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.skip(f"sshd did not come up: {proc.stderr.read()[-300:] if proc.stderr else ''}")
    yield port, options
    proc.kill()
    proc.wait()


def test_verify_runs_over_ssh_with_the_key_and_known_hosts_given_as_options(stack, sshd):
    port, options = sshd
    stack.build("fixture-new", check=True)
    target = f"ssh://root@127.0.0.1:{port}"
    result = stack.run("verify", "--no-runtime", "--json", "--target", target, "--env", str(stack.ml_env), *options)
    payload = json.loads(result.stdout)
    assert list(payload["hosts"]) == [f"root@127.0.0.1:{port}"]
    checks = {c["check"]: c for c in payload["hosts"][f"root@127.0.0.1:{port}"]["checks"]}
    assert checks["every_pinned_package_is_at_the_locked_version"]["outcome"] == "passed"


def test_two_targets_at_one_host_are_two_reports(stack, sshd):
    port, options = sshd
    stack.build("fixture-new", check=True)
    target = f"ssh://root@127.0.0.1:{port},ssh://root@localhost:{port}"
    result = stack.run("verify", "--no-runtime", "--json", "--target", target, "--env", str(stack.ml_env), *options)
    payload = json.loads(result.stdout)
    assert list(payload["hosts"]) == [f"root@127.0.0.1:{port}", f"root@localhost:{port}"]
    assert all(host["checks"] for host in payload["hosts"].values())


def test_a_host_whose_key_is_not_in_the_known_hosts_file_is_refused_in_one_line(stack, sshd, tmp_path):
    port, options = sshd
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    options = [*options[:2], "--known-hosts", str(empty)]
    result = stack.run("verify", "--no-runtime", "--target", f"ssh://root@127.0.0.1:{port}", *options)
    (line,) = _one_line_per_host(result)
    assert line.startswith(f"root@127.0.0.1:{port}: not checked: unreachable: ")
    assert "Host key verification failed" in line


def test_verify_without_pytest_testinfra_is_one_line_not_an_internal_error():
    """A Python without testinfra (a GPU host's own venv running bwstack from a checkout) is told what to install."""
    hide_testinfra = (
        "import importlib.util, sys\n"
        "found = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'testinfra' else found(name, *a)\n"
        "from bwstack.cli.main import main\n"
        "sys.exit(main(['verify', '--no-runtime']))"
    )
    result = subprocess.run([sys.executable, "-c", hide_testinfra], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "pytest-testinfra" in result.stderr
