"""`bwstack receipt`: the provision play's converged fast path asks whether a node is as the last provision
run from the same inputs left it. Anything unsure answers no (a full run costs time; a wrong yes hides a
change), a hostile receipt is read as no receipt, and bad options are one line and exit 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

INPUTS = "a" * 64
OTHER_INPUTS = "b" * 64


@pytest.fixture
def node(stack, tmp_path: Path):
    stack.build("fixture-new", check=True)
    made = tmp_path / "made-by-the-run"
    made.mkdir()
    (made / "wrapper").write_text("#!/bin/sh\n")
    stack.watched = [str(made), str(made / "wrapper")]
    stack.made = made
    return stack


def _receipt(node, mode: str, inputs: str = INPUTS, *more: str):
    watch = [f"--watch={p}" for p in node.watched]
    return node.run("receipt", mode, "--json", "--inputs", inputs, *watch, *more)


def _verdict(node, inputs: str = INPUTS) -> dict:
    result = _receipt(node, "--check", inputs)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_node_is_converged_after_the_receipt_is_written_and_nothing_changed(node):
    assert json.loads(_receipt(node, "--write").stdout)["changed"] is True
    verdict = _verdict(node)
    assert verdict["converged"] is True and "0000-fixture-new" in verdict["why"]


def test_writing_the_same_receipt_again_changes_nothing(node):
    _receipt(node, "--write")
    assert json.loads(_receipt(node, "--write").stdout)["changed"] is False


def test_a_node_without_a_receipt_is_not_converged(node):
    verdict = _verdict(node)
    assert verdict["converged"] is False and "no receipt" in verdict["why"]


def test_other_inputs_are_not_converged(node):
    _receipt(node, "--write")
    verdict = _verdict(node, OTHER_INPUTS)
    assert verdict["converged"] is False and "inputs changed" in verdict["why"]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda made: (made / "wrapper").write_text("#!/bin/sh\necho changed\n"), id="file-content"),
        pytest.param(lambda made: os.chmod(made / "wrapper", 0o777), id="file-mode"),
        pytest.param(lambda made: (made / "wrapper").unlink(), id="file-removed"),
        pytest.param(lambda made: (made / "new").write_text("x"), id="file-added-to-a-directory"),
    ],
)
def test_a_change_to_a_watched_path_is_not_converged_and_names_it(node, change):
    _receipt(node, "--write")
    change(node.made)
    verdict = _verdict(node)
    assert verdict["converged"] is False and str(node.made) in verdict["why"]


def test_every_watched_path_that_changed_is_listed_even_when_the_inputs_changed_too(node):
    """The roles repair what the list names (a tool venv in it is made again): a new wheel must not hide it."""
    _receipt(node, "--write")
    (node.made / "wrapper").write_text("#!/bin/sh\necho changed\n")
    (node.made / "new").write_text("x")
    verdict = _verdict(node, OTHER_INPUTS)
    assert verdict["converged"] is False and "inputs changed" in verdict["why"]
    assert verdict["changed"] == sorted([str(node.made), str(node.made / "wrapper")])


def test_a_converged_node_lists_nothing_as_changed(node):
    _receipt(node, "--write")
    assert _verdict(node)["changed"] == []


def test_a_file_in_a_watched_directory_written_in_place_with_its_mtime_put_back_is_not_converged(node):
    """The tool's venv is watched as a folder: a module edited in place keeps its inode, size and mtime."""
    module = node.made / "module.py"
    module.write_text("X = 1\n")
    _receipt(node, "--write")
    st = os.lstat(module)
    with open(module, "r+") as handle:
        handle.write("X = 2\n")
    os.utime(module, ns=(st.st_atime_ns, st.st_mtime_ns))
    verdict = _verdict(node)
    assert verdict["converged"] is False and str(node.made) in verdict["why"]


def test_a_generation_changed_since_it_was_sealed_is_not_converged(node):
    _receipt(node, "--write")
    site = next((node.ml_env / "lib").glob("python3.*/site-packages"))
    target = site / "fixture_dep" / "__init__.py"
    os.chmod(target.parent, 0o755)
    target.unlink()
    target.write_text("VALUE = 'drifted'\n")
    verdict = _verdict(node)
    assert verdict["converged"] is False and "changed since it was sealed" in verdict["why"]


def test_a_switch_to_another_generation_is_not_converged(node):
    _receipt(node, "--write")
    node.build("fixture-old", check=True)
    verdict = _verdict(node)
    assert verdict["converged"] is False and "current changed" in verdict["why"]


def _symlink_to_a_good_receipt(path: Path) -> None:
    good = path.parent.parent / "elsewhere.json"
    good.write_text(path.read_text())
    path.unlink()
    path.symlink_to(good)


@pytest.mark.parametrize(
    "spoil, why",
    [
        pytest.param(_symlink_to_a_good_receipt, "receipt unreadable", id="symlink"),
        pytest.param(lambda p: p.write_text("{not json"), "not JSON", id="not-json"),
        pytest.param(lambda p: p.write_text(json.dumps([1, 2])), "not a format-1 receipt", id="a-list"),
        pytest.param(
            lambda p: p.write_text(json.dumps({"format": 1, "inputs": INPUTS, "items": {"current": 1}})),
            "not a format-1 receipt",
            id="wrong-item-type",
        ),
        pytest.param(lambda p: p.write_bytes(b" " * (2 << 20)), "not a small regular file", id="huge"),
        pytest.param(lambda p: (p.unlink(), os.mkfifo(p)), "not a small regular file", id="fifo"),
    ],
)
def test_a_hostile_or_damaged_receipt_is_read_as_no_receipt(node, spoil, why):
    _receipt(node, "--write")
    spoil(node.root / "provisioned.json")
    verdict = _verdict(node)
    assert verdict["converged"] is False and why in verdict["why"]


@pytest.mark.parametrize(
    "args, message",
    [
        pytest.param(["--inputs", "not-a-digest"], "not a sha256 digest", id="inputs"),
        pytest.param(["--inputs", INPUTS, "--watch", "relative/path"], "give an absolute path", id="watch"),
        pytest.param(["--inputs", ""], "--inputs is empty", id="empty"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(node, args, message):
    result = node.run("receipt", "--check", *args)
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_no_receipt_is_written_for_a_generation_that_changed_since_it_was_sealed(node):
    site = next((node.ml_env / "lib").glob("python3.*/site-packages"))
    (site / "added.pth").write_text("")
    result = _receipt(node, "--write")
    assert result.returncode != 0 and "not writing a provision receipt" in result.stderr
    assert not (node.root / "provisioned.json").exists()


def _another_host(tmp_path: Path) -> dict:
    """The host as an apt upgrade leaves it, for the fingerprint: another library folder the loader searches."""
    (tmp_path / "more-libs").mkdir(exist_ok=True)
    return {"LD_LIBRARY_PATH": str(tmp_path / "more-libs")}


def test_a_receipt_is_written_when_the_host_changed_since_the_generation_was_built(node, tmp_path):
    """After an apt upgrade no receipt could be written against the build's host: every provision run failed."""
    watch = [f"--watch={p}" for p in node.watched]
    args = ("receipt", "--write", "--json", "--inputs", INPUTS, *watch)
    result = node.run(*args, extra_env=_another_host(tmp_path))
    assert result.returncode == 0, result.stderr
    check = node.run("receipt", "--check", "--json", "--inputs", INPUTS, *watch, extra_env=_another_host(tmp_path))
    assert json.loads(check.stdout)["converged"] is True, check.stdout


def test_a_host_changed_since_the_last_provision_run_is_not_converged_and_names_it(node, tmp_path):
    _receipt(node, "--write")
    watch = [f"--watch={p}" for p in node.watched]
    check = node.run("receipt", "--check", "--json", "--inputs", INPUTS, *watch, extra_env=_another_host(tmp_path))
    verdict = json.loads(check.stdout)
    assert verdict["converged"] is False and "host changed since the last provision run" in verdict["why"]


def test_kernel_pseudo_files_are_fingerprinted_by_their_content():
    """/proc files report size 0 and refuse large reads: the receipt reads them in small pieces."""
    from bwstack.provision.receipt import fingerprint

    value = fingerprint("/proc/sys/kernel/osrelease")
    assert value.startswith("f:") and len(value.rsplit(":", 1)[1]) == 64
    assert fingerprint("/proc/sys/kernel/osrelease") == value


def test_a_watched_link_is_fingerprinted_with_what_it_points_to(tmp_path: Path):
    from bwstack.provision.receipt import fingerprint

    (tmp_path / "a").write_text("one")
    (tmp_path / "link").symlink_to("a")
    before = fingerprint(str(tmp_path / "link"))
    (tmp_path / "a").write_text("two")
    assert before.startswith("l:a -> f:") and fingerprint(str(tmp_path / "link")) != before


RECORDED_INFORMATION = Path(__file__).parents[1] / "fixtures" / "proc-nvidia-gpus" / "h200-information"


def _driver_gpus(folder: Path, *bus_ids: str, edit=lambda text: text) -> Path:
    """A /proc/driver/nvidia/gpus of the recorded H200's `information` (fixture), one folder per bus id."""
    for bus in bus_ids:
        (folder / bus).mkdir(parents=True)
        text = RECORDED_INFORMATION.read_text().replace("0000:00:06.0", bus)
        (folder / bus / "information").write_text(edit(text))
    return folder


@pytest.mark.parametrize(
    ("after", "same"),
    [
        (
            lambda f: _driver_gpus(
                f, "0000:00:06.0", "0000:00:07.0", edit=lambda t: t.replace("IRQ:   \t\t 41", "IRQ: 99")
            ),
            True,
        ),
        (lambda f: _driver_gpus(f, "0000:00:06.0"), False),
        (
            lambda f: _driver_gpus(f, "0000:00:06.0", "0000:00:07.0", edit=lambda t: t.replace("H200", "RTX PRO 6000")),
            False,
        ),
        (
            lambda f: _driver_gpus(f, "0000:00:06.0", "0000:00:07.0", edit=lambda t: t.replace("GPU-2120", "GPU-9999")),
            False,
        ),
        (
            lambda f: _driver_gpus(
                f, "0000:00:06.0", "0000:00:07.0", edit=lambda t: t.replace("Excluded:\t No", "Excluded:\t Yes")
            ),
            False,
        ),
        (lambda f: f, False),
    ],
    ids=[
        "its-irq-moved-at-a-reboot",
        "a-gpu-removed",
        "a-gpu-of-another-model",
        "a-gpu-swapped-for-one-alike",
        "a-gpu-excluded",
        "the-driver-unloaded",
    ],
)
def test_the_gpus_the_driver_drives_are_fingerprinted_by_which_and_where(tmp_path: Path, after, same):
    """The converged run skips preflight, which judged the GPUs' model and count; a change to which GPUs are
    there is a change, a reboot's new IRQ numbers are not."""
    from bwstack.provision.receipt import gpus

    before = gpus(str(_driver_gpus(tmp_path / "before", "0000:00:06.0", "0000:00:07.0")))
    now = gpus(str(after(tmp_path / "after")))
    assert before.startswith("g:") and (now == before) is same


def test_a_node_without_the_nvidia_driver_has_no_gpus_to_fingerprint(tmp_path: Path):
    from bwstack.provision.receipt import gpus

    assert gpus(str(tmp_path / "no-such-folder")) == "absent"


def test_the_receipt_records_the_gpus(node):
    _receipt(node, "--write")
    assert "gpus" in json.loads((node.root / "provisioned.json").read_text())["items"]


def _venv_on(tmp_path: Path, home: str, version: str) -> Path:
    env = tmp_path / "env"
    env.mkdir()
    (env / "pyvenv.cfg").write_text(f"home = {home}\nversion_info = {version}\ninclude-system-site-packages = false\n")
    return env


def _interpreter(tmp_path: Path) -> Path:
    """A stand-in base interpreter's prefix (a pyenv-like layout): bin/ and lib/python3.12/."""
    prefix = tmp_path / "pyenv" / "3.12.1"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "lib" / "python3.12").mkdir(parents=True)
    (prefix / "lib" / "python3.12" / "os.py").write_text("# the stdlib\n")
    return prefix


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda stdlib: (stdlib / "os.py").write_text("# edited by hand\n"), id="stdlib-module-edited"),
        pytest.param(lambda stdlib: (stdlib / "sitecustomize.py").write_text("import sys\n"), id="sitecustomize-added"),
        pytest.param(lambda stdlib: (stdlib / "new.pth").write_text(""), id="file-added"),
    ],
)
def test_the_envs_base_interpreter_is_fingerprinted_by_its_standard_library(tmp_path: Path, change):
    """No package database records a pyenv interpreter rebuilt or edited in place, and the env runs on it."""
    from bwstack.provision.receipt import interpreters

    prefix = _interpreter(tmp_path)
    env = _venv_on(tmp_path, str(prefix / "bin"), "3.12.1")
    before = interpreters(env)
    assert before["python:env"].startswith(f"{prefix / 'lib' / 'python3.12'}: d:")
    assert interpreters(env) == before
    change(prefix / "lib" / "python3.12")
    after = interpreters(env)
    assert (
        after["python:env"] != before["python:env"]
        or after["python:env:sitecustomize"] != before["python:env:sitecustomize"]
    )


def test_a_sitecustomize_link_is_fingerprinted_with_the_file_it_names(tmp_path: Path):
    """Debian's sitecustomize.py is a link into /etc/python3.X: an edit there changes what the env imports."""
    from bwstack.provision.receipt import interpreters

    prefix = _interpreter(tmp_path)
    etc = tmp_path / "etc-python"
    etc.mkdir()
    (etc / "sitecustomize.py").write_text("# Debian's\n")
    (prefix / "lib" / "python3.12" / "sitecustomize.py").symlink_to(etc / "sitecustomize.py")
    env = _venv_on(tmp_path, str(prefix / "bin"), "3.12.1")
    before = interpreters(env)["python:env:sitecustomize"]
    (etc / "sitecustomize.py").write_text("# edited\n")
    assert interpreters(env)["python:env:sitecustomize"] != before


@pytest.mark.parametrize(
    "cfg",
    [
        "",
        "home = relative/bin\nversion_info = 3.12.1\n",
        "home = /usr/bin\nversion_info = three\n",
        "home = /usr/b\x00in\nversion_info = 3.12.1\n",
        "home = /nowhere/bin\nversion_info = 3.12.1\n",
    ],
    ids=["empty", "relative-home", "no-version", "nul-in-home", "no-standard-library-there"],
)
def test_a_venv_whose_interpreter_cannot_be_told_is_fingerprinted_as_unknown(tmp_path: Path, cfg: str):
    from bwstack.provision.receipt import interpreters

    env = tmp_path / "env"
    env.mkdir()
    (env / "pyvenv.cfg").write_text(cfg)
    assert interpreters(env)["python:env"] == "unknown"


def test_the_receipt_records_the_interpreters_the_tool_and_the_env_run_on(node):
    _receipt(node, "--write")
    items = json.loads((node.root / "provisioned.json").read_text())["items"]
    assert items["python:tool"].split(": ", 1)[1].startswith("d:")
    assert items["python:env"].split(": ", 1)[1].startswith("d:")


def test_pyvenv_cfg_is_read_as_cpython_reads_it_keys_in_any_case_the_first_one_kept(tmp_path: Path):
    from bwstack.provision.receipt import interpreters

    prefix = _interpreter(tmp_path)
    env = tmp_path / "env"
    env.mkdir()
    (env / "pyvenv.cfg").write_text(f"HOME = {prefix / 'bin'}\nhome = /usr/bin\nversion_info = 3.12.1\n")
    assert interpreters(env)["python:env"].startswith(f"{prefix / 'lib' / 'python3.12'}: ")


def test_a_standard_library_in_lib64_is_found_by_its_landmark(tmp_path: Path):
    from bwstack.provision.receipt import interpreters

    prefix = tmp_path / "usr"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "lib64" / "python3.12").mkdir(parents=True)
    (prefix / "lib64" / "python3.12" / "os.py").write_text("# the stdlib\n")
    env = _venv_on(tmp_path, str(prefix / "bin"), "3.12.1")
    assert interpreters(env)["python:env"].startswith(f"{prefix / 'lib64' / 'python3.12'}: d:")


def test_the_envs_interpreter_binary_and_libpython_are_fingerprinted(tmp_path: Path):
    """A shared pyenv build keeps libpython and the binary outside lib/python3.X."""
    from bwstack.provision.receipt import interpreters

    prefix = _interpreter(tmp_path)
    (prefix / "bin" / "python3.12").write_bytes(b"\x7fELF binary")
    (prefix / "lib" / "libpython3.12.so.1.0").write_bytes(b"\x7fELF library")
    env = _venv_on(tmp_path, str(prefix / "bin"), "3.12.1")
    (env / "bin").mkdir()
    (env / "bin" / "python").symlink_to(prefix / "bin" / "python3.12")
    before = interpreters(env)
    with open(prefix / "lib" / "libpython3.12.so.1.0", "ab") as handle:
        handle.write(b"X")
    middle = interpreters(env)
    assert middle["python:env:libpython"] != before["python:env:libpython"]
    with open(prefix / "bin" / "python3.12", "ab") as handle:
        handle.write(b"X")
    assert interpreters(env)["python:env:binary"] != middle["python:env:binary"]


def test_a_sitecustomize_leading_into_proc_is_never_read(tmp_path: Path):
    """Content made on read would make every run a full run, or consume the kernel's log (/proc/kmsg)."""
    from bwstack.provision.receipt import interpreters

    prefix = _interpreter(tmp_path)
    (prefix / "lib" / "python3.12" / "sitecustomize.py").symlink_to("/proc/self/status")
    env = _venv_on(tmp_path, str(prefix / "bin"), "3.12.1")
    first = interpreters(env)["python:env:sitecustomize"]
    assert first.startswith("refused:") and interpreters(env)["python:env:sitecustomize"] == first


def test_a_generation_the_store_does_not_trust_is_not_read_for_its_interpreter(node):
    """`current` leading out of the store: its pyvenv.cfg could send the check to walk any tree."""
    from bwstack.provision.receipt import interpreters

    _receipt(node, "--write")
    elsewhere = node.root.parent / "elsewhere"
    (elsewhere / "env").mkdir(parents=True)
    (elsewhere / "env" / "pyvenv.cfg").write_text("home = /usr/bin\nversion_info = 3.11.2\n")
    current = node.root / "current"
    current.unlink()
    current.symlink_to(elsewhere)
    verdict = _verdict(node)
    assert verdict["converged"] is False and verdict["compared"] is True
    assert "python:env" in verdict["changed"]
    assert interpreters(None)["python:env"] == "none"


def test_without_a_receipt_nothing_is_said_to_be_compared(node):
    verdict = _verdict(node)
    assert verdict["compared"] is False and verdict["changed"] == []
