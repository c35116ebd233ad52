"""What `bwstack provision` prints while Ansible runs: one line per phase with its time, download progress, the
path of the log that keeps Ansible's whole output, and on failure the failing task's message."""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
from pathlib import Path

import pytest
from helpers import OTHER_UID

from bwstack.errors import UsageError
from bwstack.fleet import phases, playbooks
from bwstack.provision.progress import DownloadProgress

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("role", "task", "phase"),
    [
        ("bwstack_preflight", "Run the preflight checks on the node (probe zipapp, nothing installed)", "preflight"),
        ("bwstack_tool", "Install bwstack and its dependencies into the tool venv", "tool"),
        ("bwstack_tool", "Install the packages the tool venv needs", "system packages"),
        ("bwstack_mlenv", "Install the system packages the wheels need", "system packages"),
        ("bwstack_cuda", "Lay the lock's cuda-toolkit wheels out at the profile's CUDA home (side by side)", "CUDA"),
        ("bwstack_mlenv", "Build and switch to the profile's generation (backup, install, patches, verify, switch)",
         "build"),
        ("bwstack_mlenv", "Read the generation active before this run", "env"),
        ("bwstack_verify", "Run the node checks", "verify"),
        ("", "Gathering Facts", "facts"),
        ("", "Stop the rollout", "other"),
    ],
)  # fmt: skip
def test_each_task_belongs_to_a_phase(role, task, phase):
    assert phases.phase_of(role, task) == phase


def _events(t0: float = 1000.0, build: dict | None = None, fail: str | None = None) -> list[dict]:
    """A run: facts, preflight (2 tasks), tool with its apt task, the build, verify (a 3 s command)."""
    tasks = [
        ("", "Gathering Facts", 1.0, {}),
        ("bwstack_preflight", "Ask bwstack's plan whether this run builds an env", 2.0, {"delta": "0:00:01.500000"}),
        ("bwstack_preflight", "Run the preflight checks on the node (probe zipapp, nothing installed)", 1.0, {}),
        ("bwstack_tool", "Install the packages the tool venv needs", 2.0, {"changed": True}),
        ("bwstack_tool", "Copy the bwstack wheel", 0.5, {}),
        ("bwstack_mlenv", "Build and switch to the profile's generation", 40.0, {"changed": True, "result": build}),
        ("bwstack_verify", "Run the node checks", 4.0, {"delta": "0:00:03.000000"}),
    ]
    events, now = [], t0
    for role, name, seconds, result in tasks:
        events.append({"event": "task", "role": role, "name": name, "t": now})
        now += seconds
        failed = fail is not None and role == "bwstack_verify"
        body = {**result, **({"msg": fail, "failed": True} if failed else {})}
        events.append({"event": "failed" if failed else "ok", "host": "localhost", "task": name, "role": role,
                       "result": body, "t": now})  # fmt: skip
    events.append({"event": "stats", "hosts": {"localhost": {"ok": 7, "changed": 2, "failures": int(bool(fail))}},
                   "t": now})  # fmt: skip
    return events


BUILD = {
    "actions": ["built 0001-cu128-abc"],
    "timings": {
        "fetch_s": 15.0,
        "fetch": {"bytes_downloaded": 4_800_000_000, "seconds": 15.0, "files": 169},
        "install_s": 5.0,
        "seal_manifest_s": 9.0,
        "verify_s": 9.5,
        "total_s": 38.0,
    },
}


def _report(events: list[dict], started: float = 1000.0) -> tuple[phases.PhaseReport, list[str]]:
    lines: list[str] = []
    report = phases.PhaseReport(lines.append, started=started)
    for event in events:
        report.feed(event)
    report.finish(now=events[-1]["t"])
    return report, lines


def test_one_line_per_phase_with_its_time_and_the_builds_own_phases():
    _, lines = _report(_events(build=BUILD))
    names = [line.split("  ")[1].strip() if line.startswith("  ") else line for line in lines]
    assert names[:8] == ["preflight", "tool", "system packages", "fetch", "install", "seal", "verify (build)", "verify"]
    text = "\n".join(" ".join(line.split()) for line in lines)
    assert "preflight 3.0 s (2 tasks)" in text
    assert "fetch 15.0 s (4.8 GB downloaded at 320.0 MB/s)" in text
    assert "verify 4.0 s (1 task)" in text
    # Overhead: the 50.5 s run less the time of the work itself: preflight's command 1.5, tool 2.5 (no
    # command: its wall time), the build's own 38, verify's command 3.
    assert "Ansible overhead 5.5 s" in text
    assert lines[-2].startswith("localhost") and "changed=2" in lines[-2]
    assert lines[-1] == "total 50.5 s"


def test_the_shared_roles_tasks_count_in_the_role_that_pulled_them_in():
    """Every role depends on `bwstack`: its tasks come between a role's own (argument check, controller facts,
    the role's work), as in a real run; the role's phase is still one line with all its tasks."""
    events = _events(build=BUILD)
    first_preflight = next(i for i, e in enumerate(events) if e.get("role") == "bwstack_preflight")
    shared = [
        {"event": "task", "role": "bwstack", "name": "Read the lock (controller)", "t": events[first_preflight]["t"]},
        {"event": "ok", "host": "localhost", "task": "Read the lock (controller)", "role": "bwstack", "result": {},
         "t": events[first_preflight]["t"]},
    ]  # fmt: skip
    events[first_preflight + 2 : first_preflight + 2] = shared  # between preflight's two tasks
    events[:0] = [dict(e, t=events[0]["t"]) for e in shared]  # and before any role (the converged check)
    _, lines = _report(events)
    text = "\n".join(" ".join(line.split()) for line in lines)
    assert [line.split()[0] for line in lines].count("preflight") == 1
    assert "preflight 3.0 s (3 tasks)" in text and "other" not in text


def _task(role: str, name: str, started: float, seconds: float, kind: str = "ok") -> list[dict]:
    result = {"event": kind, "host": "localhost", "task": name, "role": role, "result": {}, "t": started + seconds}
    return [{"event": "task", "role": role, "name": name, "t": started}, result]


def test_a_converged_node_shows_its_check_as_a_phase_and_the_roles_it_skipped():
    """The fast path: the converged check (the shared role's tasks before any role), then every task of
    preflight skipped, then verify."""
    ask = "bwstack : Converged check - ask the node whether it is as the last provision run from these inputs left it"
    events = _task("", "Gathering Facts", 1000.0, 1.0)
    events += _task("bwstack", ask, 1001.0, 1.0)
    events += _task("bwstack", "bwstack : Read the lock (controller)", 1002.0, 0.5)
    events += _task("bwstack", "bwstack : Converged check - say which way this run goes", 1002.5, 0.0)
    events[-1]["result"] = {"msg": "converged (provisioned from these inputs; 0003-cu128-abc ...): ... verify runs"}
    events += _task("bwstack_preflight", "Look for bwstack on the node", 1002.5, 0.01, "skipped")
    events += _task("bwstack_preflight", "Run the preflight checks on the node", 1002.51, 0.01, "skipped")
    events += _task("bwstack_verify", "Run the node checks", 1002.52, 2.0)
    events.append({"event": "stats", "hosts": {"localhost": {"ok": 4, "changed": 0}}, "t": 1004.52})
    _, lines = _report(events)
    text = "\n".join(" ".join(line.split()) for line in lines)
    assert "converged check 1.5 s (3 tasks)" in text
    assert "localhost: converged (provisioned from these inputs; 0003-cu128-abc ...): ... verify runs" in text
    assert "preflight 0.0 s (2 tasks, all skipped)" in text
    assert "verify 2.0 s (1 task)" in text


def test_a_converged_build_says_so_in_one_line():
    converged = {"actions": [], "timings": {"backup_s": 0.3, "total_s": 0.9}}
    _, lines = _report(_events(build=converged))
    assert any("env build" in line and "nothing to build (converged)" in line for line in lines)


def test_a_failure_names_the_host_the_task_and_its_message():
    report, _ = _report(_events(build=BUILD, fail="3 check(s) failed: torch_imports: undefined symbol"))
    assert report.failures == [
        'localhost: failed at "Run the node checks": 3 check(s) failed: torch_imports: undefined symbol'
    ]


def test_progress_is_written_for_the_controller_and_summed_for_the_result(tmp_path):
    path = tmp_path / "progress.json"
    progress = DownloadProgress(files=1, path=path, interval=0)
    progress.started_download(3_000_000)
    progress.add(1_000_000)
    state = phases.read_progress(path)
    assert state["bytes"] == 1_000_000 and state["total_bytes"] == 3_000_000 and not state["done"]
    line = phases.progress_line(state)
    assert line.startswith("  fetch: 1.0 MB of 3.0 MB, 0/1 wheels, ") and line.endswith("/s")
    progress.add(2_000_000)
    progress.file_done()
    progress.close()
    assert phases.read_progress(path)["done"] is True
    summary = progress.summary()
    assert summary["bytes_downloaded"] == 3_000_000 and summary["files_downloaded"] == 1 and summary["files"] == 1


def _download_in_its_own_thread(progress: DownloadProgress, length: int) -> None:
    # The fetch downloads each wheel in one worker thread, from its start to its file_done.
    worker = threading.Thread(target=progress.started_download, args=(length,))
    worker.start()
    worker.join()


def test_the_download_total_is_shown_only_once_every_wheel_has_started_or_needed_none(tmp_path):
    path = tmp_path / "progress.json"
    progress = DownloadProgress(files=3, path=path, interval=0)
    progress.file_done()  # a wheel the store had: nothing to download
    progress.started_download(3_000_000)
    progress.add(1_000_000)
    assert phases.progress_line(phases.read_progress(path)).startswith("  fetch: 1.0 MB, 1/3 wheels, ")
    _download_in_its_own_thread(progress, 2_000_000)
    assert phases.progress_line(phases.read_progress(path)).startswith("  fetch: 1.0 MB of 5.0 MB, 1/3 wheels, ")
    progress.add(2_000_000)
    progress.file_done()
    assert phases.progress_line(phases.read_progress(path)).startswith("  fetch: 3.0 MB of 5.0 MB, 2/3 wheels, ")


def test_a_wheel_downloaded_again_after_a_failed_start_is_counted_once_towards_the_total(tmp_path):
    path = tmp_path / "progress.json"
    progress = DownloadProgress(files=2, path=path, interval=0)
    progress.started_download(3_000_000)
    progress.started_download(3_000_000)  # the same wheel from its next source
    assert phases.progress_line(phases.read_progress(path)).startswith("  fetch: 0 B, 0/2 wheels, ")


def test_no_total_is_shown_when_a_download_did_not_say_its_size(tmp_path):
    path = tmp_path / "progress.json"
    progress = DownloadProgress(files=2, path=path, interval=0)
    progress.started_download(0)  # no Content-Length
    _download_in_its_own_thread(progress, 2_000_000)
    progress.add(1_000_000)
    assert phases.progress_line(phases.read_progress(path)).startswith("  fetch: 1.0 MB, 0/2 wheels, ")


FAKE_PLAYBOOK = """#!{python}
import json, os, sys, time
out = open(os.environ["BWSTACK_EVENTS"], "a")
def event(**e):
    e["t"] = time.time(); out.write(json.dumps(e) + "\\n"); out.flush()
print("PLAY [Provision bwstack nodes] " + "*" * 40)
event(event="task", role="bwstack_preflight", name="Run the preflight checks on the node")
print("TASK [bwstack_preflight : Run the preflight checks on the node] ****")
event(event="ok", host="localhost", task="Run the preflight checks", role="bwstack_preflight", result={{}})
event(event="task", role="bwstack_verify", name="Run the node checks")
print("TASK [bwstack_verify : Run the node checks] ****")
msg = "1 check(s) failed on localhost: module_imports[torch]: libcudart.so.12: cannot open shared object file"
print('fatal: [localhost]: FAILED! => ' + json.dumps({{"msg": msg}}))
event(event="failed", host="localhost", task="Run the node checks", role="bwstack_verify", result={{"msg": msg}})
event(event="stats", hosts={{"localhost": {{"ok": 1, "failures": 1}}}})
print("PLAY RECAP ****")
sys.exit({code})
"""


@pytest.mark.parametrize("code", [0, 2])
def test_ansible_output_goes_to_a_log_whose_path_is_printed_and_a_failure_is_shown(tmp_path, monkeypatch, capsys,
                                                                                   code):  # fmt: skip
    fake = tmp_path / "ansible-playbook"
    fake.write_text(FAKE_PLAYBOOK.format(python=sys.executable, code=code))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    logs = tmp_path / "logs"
    monkeypatch.setenv("BWSTACK_LOG_DIR", str(logs))
    work = tmp_path / "work"
    work.mkdir()
    outcome = playbooks._Outcome()
    rc = playbooks._run_quiet([str(fake), str(REPO / "ansible" / "provision.yml")], dict(os.environ),
                              REPO / "ansible", outcome, work)  # fmt: skip
    out = capsys.readouterr().out
    assert rc == code
    first = out.splitlines()[0]
    assert first.startswith("bwstack: Ansible's output: ")
    log = Path(first.split(": ", 2)[2])
    assert log.parent == logs and log.is_file()
    kept = log.read_text()
    assert "TASK [bwstack_verify : Run the node checks]" in kept and "PLAY RECAP" in kept
    assert "TASK [" not in out, "Ansible's own lines stay in the log"
    assert any(line.startswith("  preflight ") for line in out.splitlines())
    assert any(line.startswith("  verify ") for line in out.splitlines())
    failure = "libcudart.so.12: cannot open shared object file"
    assert 'bwstack: localhost: failed at "Run the node checks": 1 check(s) failed on localhost' in out
    assert failure in out
    if code:
        assert out.rstrip().splitlines()[-1] == f"bwstack: the whole Ansible output is in {log}"
    assert outcome.failed["localhost"][0] == "FAILED"


def test_the_event_callback_is_shipped_beside_the_playbooks():
    plugin = REPO / "ansible" / "callback_plugins" / "bwstack_events.py"
    assert plugin.is_file()
    assert "bwstack_events" in playbooks._callbacks({"ANSIBLE_CALLBACKS_ENABLED": "timer"}).split(",")
    assert json.dumps(phases.BUILD_TIMINGS)


@pytest.mark.ansible
def test_the_callback_writes_task_and_result_events_from_a_real_playbook(tmp_path):
    """ansible-playbook with the shipped callback: task starts, results (a failure's message) and the recap."""
    binary = Path(sys.executable).parent / "ansible-playbook"
    if not binary.is_file():
        pytest.skip("ansible-playbook is not installed beside this Python")
    book = tmp_path / "book.yml"
    book.write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - name: Say hello\n      ansible.builtin.command: echo hello\n      changed_when: false\n"
        "    - name: Fail on purpose\n      ansible.builtin.fail:\n        msg: the node is unfit\n"
    )
    events = tmp_path / "events.jsonl"
    env = {**os.environ, "BWSTACK_EVENTS": str(events), "ANSIBLE_CALLBACKS_ENABLED": "bwstack_events",
           "ANSIBLE_CALLBACK_PLUGINS": str(REPO / "ansible" / "callback_plugins"),
           "ANSIBLE_LOCALHOST_WARNING": "false", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false"}  # fmt: skip
    import subprocess

    cmd = [str(binary), "-i", "localhost,", "-c", "local", "-e", f"ansible_python_interpreter={sys.executable}"]
    done = subprocess.run([*cmd, str(book)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout[-2000:]
    got = [json.loads(line) for line in events.read_text().splitlines()]
    kinds = [(e["event"], e.get("name") or e.get("task")) for e in got if e["event"] != "play"]
    assert kinds[:4] == [("task", "Say hello"), ("ok", "Say hello"), ("task", "Fail on purpose"),
                         ("failed", "Fail on purpose")]  # fmt: skip
    assert got[2]["result"]["delta"].startswith("0:00:")
    assert got[-1]["event"] == "stats" and got[-1]["hosts"]["localhost"]["failures"] == 1
    report, _ = _report(got, started=got[0]["t"])
    assert report.failures == ['localhost: failed at "Fail on purpose": the node is unfit']


def test_an_unwritable_log_directory_falls_back_to_a_temporary_file(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("BWSTACK_LOG_DIR", str(blocker / "logs"))
    path = phases.new_log("provision")
    try:
        assert path.is_file() and path.name.startswith("bwstack-provision-")
    finally:
        path.unlink()


def test_old_logs_are_pruned_to_the_last_few(tmp_path, monkeypatch):
    monkeypatch.setenv("BWSTACK_LOG_DIR", str(tmp_path))
    for i in range(phases.LOG_KEEP + 5):
        (tmp_path / f"provision-20260101T0000{i:02d}Z-1.log").write_text("")
    kept = phases.new_log("provision")
    logs = sorted(tmp_path.glob("provision-*.log"))
    assert len(logs) == phases.LOG_KEEP and kept in logs


def test_a_log_directory_others_can_write_is_not_used(tmp_path, monkeypatch):
    """Another user could put a link under the log's name there, or take the file away while the run writes it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("BWSTACK_LOG_DIR", str(shared))
    path = phases.new_log("provision")
    try:
        assert path.parent != shared and path.name.startswith("bwstack-provision-") and list(shared.iterdir()) == []
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        path.unlink()


def test_pruning_removes_only_this_users_own_logs(tmp_path, monkeypatch):
    """A sticky folder (BWSTACK_LOG_DIR=/tmp) holds others' files too: root removes none of them."""
    monkeypatch.setenv("BWSTACK_LOG_DIR", str(tmp_path))
    theirs = []
    for i in range(phases.LOG_KEEP + 2):
        log = tmp_path / f"provision-20260101T0000{i:02d}Z-1.log"
        log.write_text("")
        os.chown(log, OTHER_UID, OTHER_UID)
        theirs.append(log)
    phases.new_log("provision")
    assert all(log.exists() for log in theirs)


def test_an_empty_log_directory_setting_is_refused_not_replaced_by_the_default(monkeypatch):
    monkeypatch.setenv("BWSTACK_LOG_DIR", " ")
    with pytest.raises(UsageError, match="BWSTACK_LOG_DIR is empty"):
        phases.new_log("provision")


def test_download_progress_is_shown_at_intervals_when_not_a_terminal(tmp_path):
    import io
    import time

    path = tmp_path / "progress.json"
    progress = DownloadProgress(files=1, path=path, interval=0)
    progress.started_download(10_000_000)
    progress.add(5_000_000)
    stream = io.StringIO()
    with phases.DownloadWatch(path, stream=stream, interval=0.05, poll=0.02):
        time.sleep(0.3)
    lines = stream.getvalue().splitlines()
    assert lines and all(line.startswith("  fetch: 5.0 MB of 10.0 MB, 0/1 wheels, ") for line in lines)
    assert "\r" not in stream.getvalue(), "no carriage returns when not on a terminal"
    progress.close()  # done: nothing more is shown
    stream = io.StringIO()
    with phases.DownloadWatch(path, stream=stream, interval=0, poll=0.02):
        time.sleep(0.1)
    assert stream.getvalue() == ""
