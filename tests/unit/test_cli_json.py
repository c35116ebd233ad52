"""Under --json, stdout is exactly one JSON document: every human line (progress, warnings, verdicts) goes to
stderr, so `bwstack X --json | jq` and the Ansible module can read it.

Table-driven over every command that takes --json and runs here without a GPU, a network or Docker: the
fixture stack (small wheels built here, a store under tmp) for the store commands, the real lock and the
recorded machine descriptions for the rest. A command that takes --json and is in neither table fails
the coverage test below, so a new one has to be added here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest
from helpers import MACHINES, REAL_LOCK, bwstack, needs_py312

from fixtures import fakestack

# Commands with --json that cannot run here, and why.
NOT_HERE = {
    "bench": "tens of GB of scratch space and PyPI",
    "image build": "needs a Docker daemon",
    "image verify": "needs a Docker daemon",
    "image bench-rebuild": "needs a Docker daemon and PyPI",
}


class Ctx:
    """The fixture stack the cases run against (one per module: the cases run in order, as a session would)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.lock, self.wheelhouse = fakestack.make_stack(base)
        self.root, self.ml_env = base / "root", base / "ml-env"
        self.env = {
            "BWSTACK_ROOT": str(self.root),
            "BWSTACK_ML_ENV": str(self.ml_env),
            "BWSTACK_CUDA_LINK": str(base / "cuda-link"),
            "BWSTACK_CACHE": str(self.root / "cache"),
        }


def _hand_made_env(path: Path) -> None:
    from bwstack.provision.envbuild import find_python

    subprocess.run([find_python("3.12"), "-m", "venv", "--without-pip", str(path)], check=True)


# (label, argv after --lock, exit statuses the case may end with, preparation). The fixture lock unless the
# argv starts with "REAL" (the repository's lock). Order matters: later cases use what earlier ones made.
STACK_CASES = [
    ("build --check", ["build", "--profile", "fixture-old", "--wheelhouse", "{wheelhouse}", "--check"], {0}),
    ("build", ["build", "--profile", "fixture-old", "--wheelhouse", "{wheelhouse}"], {0}),
    ("build (second profile)", ["build", "--profile", "fixture-new", "--wheelhouse", "{wheelhouse}"], {0}),
    ("plan", ["plan", "--profile", "fixture-new"], {0}),
    ("verify", ["verify", "--no-runtime"], {0, 1}),  # the fixture's fake torch fails checks: still one document
    ("generations", ["generations"], {0}),
    ("generations --check", ["generations", "--check", "--verify", "full"], {0}),
    ("receipt --write", ["receipt", "--write", "--inputs", "a" * 64], {0}),
    ("receipt --check", ["receipt", "--check", "--inputs", "a" * 64], {0}),
    ("rollback --check", ["rollback", "--check"], {0}),
    ("rollback", ["rollback"], {0}),
    ("backup", ["backup"], {0}),
    ("backup --archive", ["backup", "--archive", "{base}/gen.tar.zst"], {0}),
    ("restore", ["restore", "{base}/gen.tar.zst", "--no-switch"], {0}),
    ("prune", ["prune", "--keep", "2"], {0}),
    (
        "fetch",
        ["fetch", "--profile", "fixture-new", "--wheelhouse", "{wheelhouse}", "--offline", "--dest", "{base}/wh"],
        {0},
    ),
    ("cuda status", ["cuda", "status", "--prefix", "{base}/no-cuda"], {1}),
    ("patch status", ["patch", "status"], {0}),
    ("features", ["features"], {0}),
    ("preflight", ["preflight", "--allow-no-gpu", "--allow-other-gpu", "--min-free-gb", "0"], {0, 4}),
    ("waivers", ["waivers"], {0}),
    ("waivers --set --check", ["waivers", "--set", "nvcc=no nvcc on PyPI's CUDA 12 wheels", "--check"], {0}),
    ("adopt", ["adopt", "--root", "{base}/root2", "--ml-env", "{base}/hand-made", "--cuda-link", "none"], {0}),
    ("show", ["REAL", "show"], {0}),
    ("lock --check --offline", ["REAL", "lock", "--check", "--offline"], {0}),
    ("accept --machine", ["REAL", "accept", "--machine", str(MACHINES / "rtx-pro-6000-x8-misconfigured")], {1}),
    ("serve-plan --list-models", ["REAL", "serve-plan", "--list-models"], {0}),
    ("verify --list-checks", ["REAL", "verify", "--list-checks"], {0}),
    ("controller-facts", ["REAL", "controller-facts"], {0}),
    ("controller-facts --profile", ["REAL", "controller-facts", "--profile", "cu128"], {0}),
    ("system-packages", ["REAL", "system-packages"], {0, 1}),  # 1: the lock has no list for this OS
]


def _interrupted_run_left_debris(ctx: Ctx) -> None:
    """What a killed build leaves: opening the store removes it, saying so (a human line: stderr here)."""
    from bwstack.store.generations import BUILDING_PREFIX

    (ctx.root / "generations" / f"{BUILDING_PREFIX}0099-killed").mkdir()


# What a case needs beyond the earlier cases, done just before it runs.
PREPARE = {"prune": _interrupted_run_left_debris}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> Ctx:
    c = Ctx(tmp_path_factory.mktemp("json"))
    _hand_made_env(c.base / "hand-made")
    return c


@needs_py312
@pytest.mark.parametrize(("label", "argv", "codes"), STACK_CASES, ids=[c[0] for c in STACK_CASES])
def test_json_output_is_one_json_document_on_stdout(ctx: Ctx, label, argv, codes):
    lock = str(ctx.lock)
    if argv[0] == "REAL":
        lock, argv = str(REAL_LOCK), argv[1:]
    args = [a.format(base=ctx.base, wheelhouse=ctx.wheelhouse) for a in argv]
    if label in PREPARE:
        PREPARE[label](ctx)
    if not label.startswith("controller-facts"):  # always JSON, no --json option
        args.append("--json")
    result = bwstack("--lock", lock, *args, env=ctx.env)
    assert result.returncode in codes, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr
    decoder = json.JSONDecoder()
    text = result.stdout.strip()
    assert text, f"nothing on stdout; stderr: {result.stderr[-1000:]}"
    document, end = decoder.raw_decode(text)
    assert end == len(text), f"more than one JSON document on stdout, the rest: {text[end:][:300]!r}"
    assert isinstance(document, (dict, list))
    if label in PREPARE:
        assert result.stderr.strip(), "the preparation should have made the command say something"


def _json_commands() -> set[str]:
    from bwstack.cli.main import build_parser

    found = set()

    def walk(parser: argparse.ArgumentParser, prefix: tuple[str, ...]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*prefix, name))
                return
        if any("--json" in a.option_strings for a in parser._actions):
            found.add(" ".join(prefix))

    walk(build_parser(), ())
    return found


def test_every_command_with_json_is_covered_or_named_with_the_reason_it_cannot_run_here():
    covered = set()
    commands = _json_commands()
    for _, argv, _ in STACK_CASES:
        words = [a for a in argv if a != "REAL"]
        for length in (2, 1):
            name = " ".join(words[:length])
            if name in commands:
                covered.add(name)
                break
    missing = commands - covered - set(NOT_HERE)
    assert not missing, f"commands with --json that no case runs: {sorted(missing)}"
    assert set(NOT_HERE) <= commands, sorted(set(NOT_HERE) - commands)
