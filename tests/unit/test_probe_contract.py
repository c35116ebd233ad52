"""The probe's contract with the controller: a versioned facts document, and one rule for a child's environment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bwstack.probe import interp, schema

GOOD = {"probe_version": schema.SCHEMA_VERSION, "host": {}, "gpu": {}, "env": {}}


@pytest.mark.parametrize(
    ("stdout", "says"),
    [
        ("", "printed no facts"),
        ("not json\n", "printed no facts"),
        ("[1, 2]\n", "printed list, not a facts document"),
        (json.dumps({**GOOD, "probe_version": 1}), "speaks facts schema 1, this bwstack reads"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "probe_version"}), "speaks facts schema None"),
        (json.dumps({**GOOD, "env": None}), "sent no 'env' section"),
    ],
    ids=["empty", "garbage", "not-an-object", "older-schema", "no-version", "missing-section"],
)
def test_a_facts_document_this_bwstack_cannot_read_is_refused_naming_the_host(stdout, says):
    with pytest.raises(schema.FactsError, match="node-7") as caught:
        schema.parse(stdout, "node-7")
    assert says in str(caught.value)


def test_the_facts_are_read_from_the_last_line_after_anything_a_library_printed():
    facts = schema.parse("warning: something\n" + json.dumps(GOOD) + "\n", "node-7")
    assert facts["probe_version"] == schema.SCHEMA_VERSION


def test_the_probe_writes_the_schema_version_it_speaks(tmp_path):
    from bwstack.probe.main import collect

    facts = collect(tmp_path / "no-env", runtime=False, imports=False)
    assert schema.parse(json.dumps(facts), "here")["env"]["exists"] is False


CALLER = {
    "PATH": "/usr/bin",
    "PYTHONPATH": "/elsewhere",
    "PYTHONHOME": "/x",
    "PYTHONSTARTUP": "/x/startup.py",
    "CUDA_HOME": "/usr/local/cuda-12.8",
    "VIRTUAL_ENV": "/venv",
    "SOURCE_DATE_EPOCH": "1",
}


@pytest.mark.parametrize(
    ("own", "kept"),
    [(False, {"PATH", "CUDA_HOME", "VIRTUAL_ENV", "SOURCE_DATE_EPOCH"}), (True, {"PATH"})],
    ids=["observer", "env-on-its-own"],
)
def test_a_child_never_inherits_another_python_path_and_a_build_not_the_callers_toolkit(own, kept):
    assert set(interp.clean_env(base=CALLER, own=own)) == kept


def test_extra_variables_win_over_what_is_dropped():
    assert interp.clean_env({"CUDA_HOME": "/gen/cuda"}, base=CALLER, own=True)["CUDA_HOME"] == "/gen/cuda"


def test_an_in_env_script_runs_from_its_file_and_reports_the_interpreter():
    facts = interp.interpreter_facts(sys.executable)
    assert facts["python"] == sys.version.split()[0]
    assert "torch" in facts or "torch_error" in facts


def test_an_interpreter_that_does_not_run_is_an_error_not_a_traceback(tmp_path):
    facts = interp.interpreter_facts(tmp_path / "bin" / "python")
    assert "not found" in facts["error"]


def test_the_import_check_reports_each_modules_outcome_from_one_interpreter():
    from bwstack.probe import main as probe

    statements = {"json": "import json", "absent": "import bwstack_no_such_module", "raises": "raise SystemExit(3)"}
    # The last assertion also fails when the result line is lost: the one-process-per-module fallback sees no
    # message for SystemExit on stderr.
    outcome = probe._import_all(sys.executable, statements, interp.clean_env()).results
    assert outcome["json"] == {"ok": True, "error": ""}
    assert not outcome["absent"]["ok"] and "ModuleNotFoundError" in outcome["absent"]["error"]
    assert not outcome["raises"]["ok"] and "SystemExit" in outcome["raises"]["error"]


def test_the_import_check_names_the_files_it_loaded_from_outside_the_env():
    """What a later verify checks before it reuses the outcome: the extension modules and libraries mapped, the
    module files read, each with the stat that identifies its bytes now; nothing under the folders it is told
    are the env's own (the manifest covers those)."""
    import ctypes
    import json as json_module

    from bwstack.probe import main as probe

    inside = str(Path(json_module.__file__).parent)
    run = probe._import_all(sys.executable, {"ctypes": "import ctypes, json"}, interp.clean_env(), [inside])
    assert run.results["ctypes"]["ok"] and run.loaded
    paths = {entry[0] for entry in run.loaded}
    assert str(Path(ctypes.__file__)) in paths, "a module file read"
    assert any("_ctypes" in p and ".so" in p for p in paths), "an extension module mapped"
    assert not any(p == inside or p.startswith(inside + "/") for p in paths), "the env's own files left out"
    assert str(Path(ctypes.__file__).parent) in paths, "the folder a module was found in"
    assert any(p.endswith("/lib-dynload") for p in paths), "a folder on sys.path"
    for path, *stamp in run.loaded:
        if stamp == [None]:  # absent when it ran (a bytecode file never written): it must still be
            assert not os.path.exists(path), path
            continue
        st = os.stat(path)
        assert stamp == [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns], path


def _loaded_by(tmp_path, extra_env: dict) -> list:
    from bwstack.probe import main as probe

    env = {**interp.clean_env(), **extra_env}
    run = probe._import_all(sys.executable, {"json": "import json"}, env, [])
    assert run.results["json"]["ok"] and run.loaded is not None
    return run.loaded


def test_a_module_dropped_into_a_folder_imports_search_changes_what_was_loaded(tmp_path):
    """A torch.py put where the interpreter looks first shadows the env's torch: the folder's listing is part of
    what a reused outcome depends on."""
    from bwstack.probe import sealed

    searched = tmp_path / "searched"
    searched.mkdir()
    loaded = _loaded_by(tmp_path, {"PYTHONPATH": str(searched)})
    assert sealed.loaded_changed(loaded) is None
    (searched / "torch.py").write_text("raise ImportError('shadowed')\n")
    assert sealed.loaded_changed(loaded) == f"{searched} changed since the imports ran"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not found")
@pytest.mark.parametrize("folder", ["new\nline", "/dev/shm"], ids=["newline-in-the-path", "dev-shm"])
def test_a_preloaded_library_copied_over_in_place_is_seen_wherever_it_lives(tmp_path, folder):
    """/proc/self/maps escapes a newline in a path; /dev/shm holds regular files, not devices."""
    from bwstack.probe import sealed

    where = Path(folder) if folder.startswith("/") else tmp_path / folder
    if not os.access(where if where.exists() else tmp_path, os.W_OK):
        pytest.skip(f"{where} is not writable here")
    where.mkdir(exist_ok=True)
    source = tmp_path / "pre.c"
    source.write_text("int bwstack_test_preload(void) { return 1; }\n")
    lib = where / f"libbwstacktest-{os.getpid()}-{tmp_path.name}.so"
    try:
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
        loaded = _loaded_by(tmp_path, {"LD_PRELOAD": str(lib)})
        assert any(entry[0] == str(lib) and len(entry) == 6 for entry in loaded), "the library, stamped"
        assert sealed.loaded_changed(loaded) is None
        shutil.copyfile(lib, tmp_path / "copy.so")
        shutil.copyfile(tmp_path / "copy.so", lib)  # in place
        assert sealed.loaded_changed(loaded) is not None
    finally:
        lib.unlink(missing_ok=True)


def test_a_child_runs_from_the_root_directory_not_the_callers(tmp_path, monkeypatch):
    # `python -c` puts its working directory first on sys.path: a module planted where the caller stands is
    # never what a root probe imports.
    (tmp_path / "bwstack_planted.py").write_text("raise SystemExit('imported from the caller directory')\n")
    monkeypatch.chdir(tmp_path)
    code = "import os, sys; print(os.getcwd()); import importlib.util as u; print(u.find_spec('bwstack_planted'))"
    rc, out, _ = interp.run([sys.executable, "-c", code], env=interp.clean_env())
    assert rc == 0 and out.split() == ["/", "None"]


@pytest.mark.parametrize(
    ("before", "after"),
    [(None, "/stub"), ("", "/stub"), ("/opt/lib", "/stub:/opt/lib")],
    ids=["unset", "empty", "set"],
)
def test_a_library_folder_goes_first_and_leaves_no_empty_entry(before, after):
    env = {} if before is None else {"LD_LIBRARY_PATH": before}
    assert interp.with_library_dir(env, "/stub")["LD_LIBRARY_PATH"] == after
