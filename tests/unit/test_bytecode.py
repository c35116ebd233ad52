"""The bytecode phase of a build: which sources get bytecode, how they are shared among the env's interpreters, and
what a failure says. The envs are small venvs of this interpreter made here (TEST FIXTURES), not the stack."""

from __future__ import annotations

import os
import venv
from pathlib import Path

import pytest

from bwstack.errors import BwstackError
from bwstack.probe import envinspect
from bwstack.provision import envbuild


def _env(base: Path, modules: dict[str, str]) -> tuple[Path, Path]:
    env = base / "env"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env)
    site = envinspect.site_packages(env)
    for rel, text in modules.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    return env, site


def _compiled(site: Path) -> list[str]:
    return sorted(str(p.parent.parent.relative_to(site) / p.name.split(".")[0]) for p in site.rglob("*.pyc"))


def test_every_source_goes_to_exactly_one_interpreter():
    sources = [(size, f"/s/{i}.py") for i, size in enumerate([900, 10, 500, 400, 7, 3000, 1, 1, 250])]
    shares = envbuild.share_out(sources, 3)
    assert sorted(p for share in shares for p in share) == sorted(p for _s, p in sources)


def test_the_biggest_file_is_shared_out_first_to_the_interpreter_with_the_least():
    """One big file and three smaller: the big one alone, the rest together (handing out in turn would not)."""
    sources = [(10_000, "/a.py"), (3_000, "/b.py"), (3_000, "/c.py"), (3_000, "/d.py")]
    assert [sorted(share) for share in envbuild.share_out(sources, 2)] == [["/a.py"], ["/b.py", "/c.py", "/d.py"]]


def test_the_work_is_shared_evenly_biggest_first():
    # Four files of 10,000 bytes and eight of 5,000 on two interpreters: each gets half the bytes and half the files.
    sources = [(10_000, f"/big/{i}.py") for i in range(4)] + [(5_000, f"/small/{i}.py") for i in range(8)]
    shares = envbuild.share_out(sources, 2)
    sizes = dict((p, s) for s, p in sources)
    assert [sum(sizes[p] for p in share) for share in shares] == [40_000, 40_000]
    assert [len(share) for share in shares] == [6, 6]


def test_fewer_sources_than_cores_start_no_idle_interpreter():
    assert envbuild.share_out([(5, "/a.py")], 8) == [["/a.py"]]
    assert envbuild.share_out([], 8) == []


def test_every_module_gets_bytecode_from_several_interpreters(tmp_path):
    env, site = _env(tmp_path, {f"pkg/m{i}.py": f"x = {i}\n" for i in range(7)} | {"pkg/__init__.py": ""})
    envbuild.compile_bytecode(env, workers=3)
    assert _compiled(site) == ["pkg/__init__"] + [f"pkg/m{i}" for i in range(7)]


def test_a_source_that_does_not_compile_gets_none_and_the_rest_still_do(tmp_path):
    env, site = _env(tmp_path, {"pkg/__init__.py": "", "pkg/template.py": "def {{ name }}(:\n", "pkg/ok.py": "y = 2\n"})
    envbuild.compile_bytecode(env, workers=2)
    assert _compiled(site) == ["pkg/__init__", "pkg/ok"]


def test_a_linked_source_or_folder_is_not_compiled_through(tmp_path):
    """The build runs as root: a link in an env (a wheel may ship one) must not make it write next to its target."""
    outside = tmp_path / "outside"
    (outside / "pkg").mkdir(parents=True)
    (outside / "pkg" / "mod.py").write_text("z = 3\n")
    (outside / "lone.py").write_text("w = 4\n")
    env, site = _env(tmp_path, {"own.py": "v = 5\n"})
    os.symlink(outside / "pkg", site / "linkedpkg")
    os.symlink(outside / "lone.py", site / "linked.py")
    envbuild.compile_bytecode(env)
    assert _compiled(site) == ["own"]
    assert not list(outside.rglob("*.pyc"))


@pytest.mark.parametrize("folder", ["tests", "pkg/tests", "pkg/sub/tests"])
def test_a_packages_test_suite_gets_no_bytecode(tmp_path, folder):
    env, site = _env(tmp_path, {"pkg/__init__.py": "", f"{folder}/test_x.py": "t = 1\n", "pkg/testsuite/m.py": ""})
    envbuild.compile_bytecode(env)
    assert _compiled(site) == ["pkg/__init__", "pkg/testsuite/m"]


def test_an_interpreter_that_fails_is_one_line_naming_its_exit(tmp_path):
    env, _site = _env(tmp_path, {"a.py": "", "b.py": ""})
    python = env / "bin" / "python"
    python.unlink()
    python.write_text("#!/bin/sh\necho 'python: cannot start' >&2\nexit 3\n")
    python.chmod(0o755)
    with pytest.raises(BwstackError) as caught:
        envbuild.compile_bytecode(env, workers=2)
    message = str(caught.value)
    assert "exit 3" in message and "python: cannot start" in message and "\n" not in message


@pytest.mark.parametrize("code", [1, -9])
def test_an_interpreter_that_ends_early_is_an_error_not_a_source_that_did_not_compile(tmp_path, code):
    """A MemoryError ends Python with 1, as a source that did not compile once did: a whole share left without
    bytecode would go unsaid."""
    env, _site = _env(tmp_path, {"a.py": ""})
    python = env / "bin" / "python"
    python.unlink()
    body = "kill -9 $$" if code < 0 else f"exit {code}"
    python.write_text(f"#!/bin/sh\necho 'Traceback (most recent call last):' >&2\necho 'MemoryError' >&2\n{body}\n")
    python.chmod(0o755)
    with pytest.raises(BwstackError) as caught:
        envbuild.compile_bytecode(env, workers=1)
    assert f"exit {code}" in str(caught.value) and "\n" not in str(caught.value)
    assert "Traceback (most recent call last): | MemoryError" in str(caught.value)


def test_a_folder_whose_pycache_is_a_link_gets_no_bytecode_through_it(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    env, site = _env(tmp_path, {"pkg/__init__.py": "", "pkg/mod.py": "m = 1\n", "own.py": ""})
    os.symlink(outside, site / "pkg" / "__pycache__")
    envbuild.compile_bytecode(env)
    assert _compiled(site) == ["own"] and not list(outside.iterdir())


def test_an_env_without_its_interpreter_is_one_line(tmp_path):
    env, _site = _env(tmp_path, {"a.py": ""})
    (env / "bin" / "python").unlink()
    with pytest.raises(BwstackError, match=r"could not run .*bin/python to compile the bytecode"):
        envbuild.compile_bytecode(env)


def test_an_interpreter_that_hangs_is_stopped_at_the_time_limit_and_said_in_one_line(tmp_path, monkeypatch):
    env, _site = _env(tmp_path, {"a.py": "", "b.py": ""})
    python = env / "bin" / "python"
    python.unlink()
    pids = tmp_path / "pids"
    python.write_text(f"#!/bin/sh\necho $$ >> {pids}\nexec sleep 60\n")
    python.chmod(0o755)
    monkeypatch.setattr(envbuild, "BYTECODE_TIMEOUT_S", 1)
    with pytest.raises(BwstackError, match=r"took over 1 s; nothing was switched$"):
        envbuild.compile_bytecode(env, workers=2)
    for pid in pids.read_text().split():
        with pytest.raises(ProcessLookupError):  # killed and reaped, not left running
            os.kill(int(pid), 0)
