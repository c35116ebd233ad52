"""`bwstack verify` on fixture envs: host specs, output, exit codes, waivers (real-env checks: test_real_stack)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest
from conftest import needs_py312

pytestmark = needs_py312


def _checks(result) -> dict:
    payload = json.loads(result.stdout)
    (host,) = payload["hosts"].values()
    return {c["check"]: c for c in host["checks"]}


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


def test_verify_runs_through_an_ansible_inventory(stack, tmp_path):
    stack.build("fixture-new", check=True)
    inventory = tmp_path / "hosts.ini"
    inventory.write_text("[nodes]\nlocalhost ansible_connection=local\n")
    result = stack.run("verify", "--no-runtime", "--json", "--target", f"ansible://nodes?ansible_inventory={inventory}")
    payload = json.loads(result.stdout)
    assert list(payload["hosts"]) == ["ansible://localhost"]
    checks = {c["check"]: c for c in payload["hosts"]["ansible://localhost"]["checks"]}
    assert checks["every_pinned_package_is_at_the_locked_version"]["outcome"] == "passed"


def test_a_host_without_the_env_fails_every_env_check_saying_so(stack, tmp_path):
    stack.root.mkdir(parents=True)
    checks = _checks(stack.run("verify", "--no-runtime", "--json", "--env", str(tmp_path / "nowhere")))
    check = checks["every_pinned_package_is_at_the_locked_version"]
    assert check["outcome"] == "error" and "no env at" in check["message"] and "provision" in check["message"]


@pytest.mark.parametrize("spec", ["nosuch://x", "docker://"])
def test_a_bad_target_is_a_clear_usage_error(stack, spec):
    result = stack.run("verify", "--target", spec)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr


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
    ssh_config = keys / "client_config"
    ssh_config.write_text(
        f"Host bwstack-test\n  HostName 127.0.0.1\n  Port {port}\n  User root\n  IdentityFile {keys / 'client'}\n"
        "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
    )
    for _ in range(50):
        probe = subprocess.run(["ssh", "-F", str(ssh_config), "bwstack-test", "true"], capture_output=True)
        if probe.returncode == 0:
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.skip(f"sshd did not come up: {proc.stderr.read()[-300:] if proc.stderr else ''}")
    yield ssh_config
    proc.kill()
    proc.wait()


def test_verify_runs_over_ssh(stack, sshd):
    stack.build("fixture-new", check=True)
    target = f"ssh://bwstack-test?ssh_config={sshd}"
    result = stack.run("verify", "--no-runtime", "--json", "--target", target, "--env", str(stack.ml_env))
    payload = json.loads(result.stdout)
    (host,) = payload["hosts"]
    assert host.startswith("ssh://")
    checks = {c["check"]: c for c in payload["hosts"][host]["checks"]}
    assert checks["every_pinned_package_is_at_the_locked_version"]["outcome"] == "passed"
