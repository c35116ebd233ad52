"""Running a child process from bwstack, and an env's own interpreter in particular.

One rule for the environment a child gets (`clean_env`) and one way to run the scripts of probe/scripts in an
env's interpreter (`run_script`), for the probe and for every layer above it: the copies of these that used to
live in five modules disagreed about what to drop.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# What would make a child interpreter load other code than the env's (or run a user's start-up file).
ISOLATING = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONPYCACHEPREFIX")
# What the env must not inherit from the caller when it is to run as it does on its own (bytecode rules,
# reproducible-build stamps, the caller's toolkit and venv): builds and the env checks drop these too; an
# observer of the caller's situation (the probe's CUDA facts) keeps them, since they are part of what it sees.
OWN = ("PYTHONDONTWRITEBYTECODE", "SOURCE_DATE_EPOCH", "CUDA_HOME", "VIRTUAL_ENV")


def clean_env(
    extra: Mapping[str, str] | None = None, *, base: Mapping[str, str] | None = None, own: bool = False
) -> dict[str, str]:
    """`base` (the caller's environment by default) without ISOLATING (and OWN when the env is to run as on its
    own), plus `extra`."""
    drop = ISOLATING + OWN if own else ISOLATING
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in drop}
    env.update(extra or {})
    return env


def run(cmd: list[str], timeout: int = 120, env: Mapping[str, str] | None = None) -> tuple[int, str, str]:
    """(returncode, stdout, stderr); a missing program is 127 and a timeout 124, as a shell would say.

    Children run from "/", not from the caller's directory: an interpreter started with -c or -m puts its working
    directory first on sys.path, and an empty entry of a library path means it too; "/" is writable by root only."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd="/")
    except FileNotFoundError:
        return 127, "", f"{cmd[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"{' '.join(cmd)}: timed out after {timeout}s"
    except OSError as exc:
        return 126, "", f"{cmd[0]}: {exc.strerror or exc}"
    return out.returncode, out.stdout, out.stderr


YIELDING_NICE = 10


def yielding(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) in this thread, its CPU priority lowered first (what it starts inherits it), for work beside the
    run's longest path: a verify's SGLang planner, seconds of imports on a node of few cores, which the import
    checks and the file reads beside it held back by a second. Call it only in a pool that never runs the
    planner: a thread's priority cannot be raised again without privilege. The nice value is the process's (its
    main thread's) plus YIELDING_NICE: a pool thread that yielded before stays where it is, and a thread already
    lower is never raised. Where it cannot be lowered, fn runs as it is."""
    with contextlib.suppress(OSError, AttributeError):
        thread = threading.get_native_id()
        wanted = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + YIELDING_NICE)
        if os.getpriority(os.PRIO_PROCESS, thread) < wanted:
            os.setpriority(os.PRIO_PROCESS, thread, wanted)
    return fn(*args)


def private_folder(parent: Path) -> str:
    """A new folder `tmp` in `parent` (a run's own temporary folder) for an env's interpreter to use as its
    TMPDIR: what the interpreter leaves there goes with the run's folder, not into the shared /tmp."""
    folder = parent / "tmp"
    folder.mkdir(mode=0o700)
    return str(folder)


def with_library_dir(env: Mapping[str, str], folder: str | os.PathLike) -> dict[str, str]:
    """`env` with `folder` searched first for shared libraries. No empty entry is left (it would mean the working
    directory) when there was no library path before."""
    before = env.get("LD_LIBRARY_PATH", "")
    return {**env, "LD_LIBRARY_PATH": f"{folder}:{before}" if before else str(folder)}


INCLUDE = "# bwstack-include: "  # a script line naming another probe/scripts file whose text goes there


def script_source(name: str) -> str:
    """The text of probe/scripts/<name>.py (read through importlib.resources: the probe may be a zipapp), with
    the text of each script it includes (a line `# bwstack-include: NAME`) in place of that line: a script runs
    as one file in the env's interpreter, where nothing of bwstack can be imported."""
    text = resources.files("bwstack.probe.scripts").joinpath(f"{name}.py").read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    return "".join(script_source(line[len(INCLUDE) :].strip()) if line.startswith(INCLUDE) else line for line in lines)


def run_script(
    python: str | os.PathLike,
    name: str,
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: int = 600,
    as_file: bool = False,
) -> tuple[int, str, str]:
    """Run probe/scripts/<name>.py in `python` (isolated from the caller's PYTHONPATH by `env`, clean_env() by
    default). `as_file`: from a temporary file, for scripts that spawn workers (multiprocessing needs a path)."""
    env = clean_env() if env is None else env
    if not as_file:
        return run([str(python), "-c", script_source(name), *args], timeout=timeout, env=env)
    with tempfile.TemporaryDirectory(prefix="bwstack-script-") as folder:
        path = Path(folder) / f"{name}.py"
        path.write_text(script_source(name), encoding="utf-8")
        return run([str(python), str(path), *args], timeout=timeout, env=env)


def last_json_line(out: str) -> dict | None:
    """The JSON object a script printed last (scripts print one line; libraries may print before it)."""
    for line in reversed(out.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        return value if isinstance(value, dict) else None
    return None


def interpreter_facts(python: str | os.PathLike, *, timeout: int = 300) -> dict:
    """What probe/scripts/interpreter.py reports for `python` (no bytecode written: it may run inside a sealed
    generation); {"error": ...} when the interpreter does not run."""
    env = clean_env({"PYTHONDONTWRITEBYTECODE": "1"}, own=True)
    rc, out, err = run_script(python, "interpreter", env=env, timeout=timeout)
    facts = last_json_line(out) if rc == 0 else None
    if facts is None:
        return {"error": (err.strip() or out.strip())[-500:] or f"{python} exited {rc}"}
    return facts
