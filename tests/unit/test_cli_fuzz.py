"""Every bad value on the command line is one line on stderr and exit 2, never a traceback.

The invocations are generated from the parser itself, so an option added later is fuzzed too: every option
that takes a value gets an empty and a blank value, typed options get values of the wrong type, options
with choices an unknown choice, path options a path that does not exist, and every command an unknown
option and, where it has them, a missing required argument.
"""

from __future__ import annotations

import argparse
import os

import pytest

from bwstack.cli import options as cliargs
from bwstack.cli.main import build_parser, main

PLACEHOLDER = "x"
BAD_BY_TYPE = {
    cliargs.capability: ["banana", "12.0.1", "12", "-1.0"],
    cliargs.positive_int: ["0", "-3", "many", "1.5"],
    cliargs.non_negative_float: ["-1", "nan", "inf", "lots"],
    cliargs.existing_file: ["/nonexistent/bwstack-fuzz/file"],
    cliargs.existing_dir: ["/nonexistent/bwstack-fuzz/dir"],
    int: ["abc", "1.5"],
    float: ["abc"],
}


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*prefix, name))
            return
    yield prefix, parser


def _value_for(action: argparse.Action) -> str:
    if action.choices:
        return str(next(iter(action.choices)))
    return PLACEHOLDER


def _base(parser: argparse.ArgumentParser, skip: argparse.Action | None = None) -> list[str]:
    """The command's required arguments with placeholder values (the command never runs: every case is
    refused while its arguments are read)."""
    args: list[str] = []
    for action in parser._actions:
        if action is skip or isinstance(action, argparse._SubParsersAction):
            continue
        if not action.option_strings and action.nargs != 0:
            args.append(_value_for(action))
        elif action.required:
            args += [action.option_strings[0], _value_for(action)]
    return args


def _cases() -> list[tuple[str, list[str]]]:
    cases = []
    for command, parser in _commands(build_parser()):
        base = _base(parser)
        cases.append((f"{' '.join(command)} --no-such-option", [*command, *base, "--no-such-option"]))
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            if action.nargs == 0:
                continue
            name = action.option_strings[-1] if action.option_strings else action.dest
            rest = _base(parser, skip=action)

            def invocation(value: str, action=action, rest=rest, command=command) -> list[str]:
                if action.option_strings:
                    return [*command, *rest, action.option_strings[-1], value]
                return [*command, value, *rest]

            bad = ["", "   ", *BAD_BY_TYPE.get(action.type, [])]
            if action.choices:
                bad.append("no-such-choice")
            for value in bad:
                cases.append((f"{' '.join(command)} {name}={value!r}", invocation(value)))
            if action.required or not action.option_strings:
                cases.append((f"{' '.join(command)} without {name}", [*command, *rest]))
    return cases


CASES = _cases()


def test_the_fuzz_generates_more_than_a_hundred_bad_invocations():
    assert len(CASES) > 100


@pytest.mark.parametrize(("label", "argv"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_invocation_gives_one_line_and_exit_2(label, argv, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("BWSTACK_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv("BWSTACK_ML_ENV", str(tmp_path / "ml-env"))
    monkeypatch.setenv("BWSTACK_CUDA_LINK", "none")
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert code == 2, f"exit {code}: {err}"
    assert len(err.strip().splitlines()) == 1, err


def _a_file(tmp_path) -> str:
    path = tmp_path / "a-file"
    path.write_text("")
    return str(path)


PATHS_THAT_CANNOT_BE_USED = [
    ("store-root-is-a-file", lambda t: ["generations", "--root", _a_file(t)]),
    ("store-root-under-proc", lambda t: ["prune", "--root", "/proc/self/bwstack-absent", "--keep", "1"]),
    ("layers-folder-missing", lambda t: ["render", "--layers", "/proc/bwstack-absent"]),
    ("layers-folder-is-a-file", lambda t: ["render", "--layers", _a_file(t)]),
    ("store-root-with-a-newline", lambda t: ["generations", "--root", f"{t}/store\nid"]),
    ("ml-env-with-a-tab", lambda t: ["generations", "--root", str(t / "store"), "--ml-env", f"{t}/env\tx"]),
    ("target-root-with-a-newline", lambda t: ["rollback", "--target", "local://", "--root", f"{t}/r\nx"]),
    ("store-root-not-utf-8", lambda t: ["generations", "--root", os.fsdecode(os.fsencode(str(t)) + b"/r\xff")]),
]


@pytest.mark.parametrize("variable", ["BWSTACK_ROOT", "BWSTACK_ML_ENV", "BWSTACK_CACHE"])
def test_a_path_setting_with_a_control_character_is_refused_not_used(tmp_path, capsys, monkeypatch, variable):
    """Paths go into the wrapper script, unit files and Ansible variables, where a newline starts a new line."""
    monkeypatch.setenv(variable, f"{tmp_path}/x\ny")
    assert (
        main(["generations", "--root", str(tmp_path / "store")] if variable != "BWSTACK_ROOT" else ["generations"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert (
        err == f"bwstack: error: {variable} '{tmp_path}/x\\ny' holds a control character (a newline, a tab): not a path"
    )


@pytest.mark.parametrize(
    ("args"), [c[1] for c in PATHS_THAT_CANNOT_BE_USED], ids=[c[0] for c in PATHS_THAT_CANNOT_BE_USED]
)
def test_a_path_that_cannot_be_used_is_one_line_and_exit_2(tmp_path, capsys, args):
    node = ["--ml-env", str(tmp_path / "ml-env"), "--cuda-link", "none"] if args(tmp_path)[0] != "render" else []
    try:
        code = main([*args(tmp_path), *node])
    except SystemExit as exc:  # refused by the option's type, as argparse does: its usage error, one line
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "error: " in err and "\n" not in err and "Traceback" not in err, err


# Every path a command takes on its command line, as a user would mistype it: a control character in a path that
# goes into scripts, logs and folder names is refused by the option itself, before anything is made.
PATH_OPTIONS = [
    ["fetch", "--dest", "{bad}"],
    ["bench", "--work", "{bad}"],
    ["env", "install", "--into", "{bad}"],
    ["env", "install", "--into", "{ok}", "--store", "{bad}"],
    ["env", "install", "--into", "{ok}", "--uv-cache", "{bad}"],
    ["backup", "--archive", "{bad}"],
    ["accept", "--record", "{bad}"],
    ["verify", "--facts-dir", "{bad}"],
    ["verify", "--env", "{bad}"],
    ["plan", "--env", "{bad}"],
    ["patch", "status", "--env", "{bad}"],
    ["serve-plan", "--env", "{bad}"],
    ["probe-bundle", "--out", "{bad}"],
    ["image", "build", "--context-dir", "{bad}"],
    ["image", "build", "--store", "{bad}"],
    ["image", "bench-rebuild", "--store", "{bad}"],
]


@pytest.mark.parametrize("args", PATH_OPTIONS, ids=lambda a: "-".join(w.strip("-") for w in a if "{" not in w))
def test_a_path_option_with_a_control_character_is_refused_before_anything_is_made(tmp_path, capsys, args):
    bad = f"{tmp_path}/made\nhere"
    argv = [w.format(bad=bad, ok=str(tmp_path / "ok")) for w in args]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds a control character" in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []
