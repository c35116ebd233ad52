"""The CLI skeleton on the real lock: show, render, plan, lock --check."""

from __future__ import annotations

import argparse
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import OTHER_UID, REAL_LOCK, bwstack, needs_py312

from bwstack.lock.model import load_lock
from bwstack.lock.requirements import parse, render, render_layers


def test_show_cu130_json_gives_exactly_the_five_mission_versions():
    payload = json.loads(bwstack("show", "--profile", "cu130", "--json", check=True).stdout)
    assert payload["stack"] == {
        "cuda": "13.0.1",
        "torch": "2.9.1+cu130",
        "sgl-kernel": "0.3.21+cu130",
        "flashinfer": "0.6.4",
        "sglang": "0.5.9",
    }


def test_show_cu128_json_gives_the_rollback_stack():
    payload = json.loads(bwstack("show", "--profile", "cu128", "--json", check=True).stdout)
    assert payload["stack"] == {
        "cuda": "12.8.1",
        "torch": "2.9.1",
        "sgl-kernel": "0.3.21",
        "flashinfer": "0.6.3",
        "sglang": "0.5.9",
    }


def test_show_names_what_could_not_be_resolved_or_hashed_here():
    payload = json.loads(bwstack("show", "--json", check=True).stdout)
    assert payload["profile"] == "cu130"
    assert payload["closure"]["not_resolved_here"] == [
        "flashinfer-jit-cache", "sgl-kernel", "torch", "torchaudio", "torchvision",
    ]  # fmt: skip
    assert payload["closure"]["missing_hashes"] == ["flashinfer-jit-cache", "torchaudio"]


def test_every_override_carries_its_reason():
    for override in json.loads(bwstack("show", "--json", check=True).stdout)["overrides"]:
        assert len(override["reason"]) > 40


def test_lock_check_offline_passes_on_the_real_lock():
    result = bwstack("lock", "--check", "--offline")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "lock OK" in result.stdout


def test_lock_check_flags_a_conflict_no_override_explains(tmp_path):
    doc = yaml.safe_load(REAL_LOCK.read_text())
    doc["closures"]["cu128"]["env"]["transformers"]["version"] = "4.57.0"
    wheel = doc["closures"]["cu128"]["env"]["transformers"]["wheels"][0]
    wheel["file"] = "transformers-4.57.0-py3-none-any.whl"
    wheel["url"] = wheel["url"].rsplit("/", 1)[0] + "/" + wheel["file"]  # a wheel URL ends in its file name
    path = tmp_path / "stack.lock.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    result = bwstack("--lock", str(path), "lock", "--check", "--offline")
    assert result.returncode == 1
    assert "requires transformers==4.57.1 but the closure has transformers 4.57.0" in result.stdout


def test_lock_check_flags_a_stale_closure_after_the_spec_changed(tmp_path):
    doc = yaml.safe_load(REAL_LOCK.read_text())
    doc["profiles"]["cu128"]["requirements"]["sglang"] = "0.5.10"
    path = tmp_path / "stack.lock.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    result = bwstack("--lock", str(path), "lock", "--check", "--offline")
    assert result.returncode == 1
    assert "the spec changed since the closure was resolved" in result.stdout


@pytest.mark.network
def test_lock_check_online_confirms_every_pypi_hash():
    result = bwstack("lock", "--check")
    assert result.returncode == 0, result.stdout[-2000:]
    confirmed = int(result.stdout.rsplit("pypi hashes confirmed ", 1)[1].split(")")[0])
    assert confirmed >= 380
    assert "not verified from this network" in result.stdout  # the +cu130 wheels, said plainly


def test_rendered_requirements_pin_every_wheel_by_url_and_hash_and_read_back():
    lock = load_lock(REAL_LOCK)
    profile = lock.profile("cu128")
    text = render(profile, profile.closure.env)
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert len(lines) == len(profile.closure.env)
    assert all(" --hash=sha256:" in line for line in lines)


def test_rendered_file_reads_back_to_the_same_wheels(tmp_path):
    lock = load_lock(REAL_LOCK)
    profile = lock.profile("cu130")
    path = tmp_path / "reqs.txt"
    path.write_text(render(profile, profile.closure.env))
    back = parse(path)
    assert back["torch"].wheels[0].sha256 == "e70e1b18881e6b3c1ce402d0a989da39f956a3a057526e03c354df23d704ce9b"
    assert back["flashinfer-jit-cache"].wheels[0].sha256 is None
    assert set(back) == set(profile.closure.env)


def test_docker_layers_put_every_package_in_exactly_one_layer_slow_changing_first():
    lock = load_lock(REAL_LOCK)
    profile = lock.profile("cu128")
    layers = render_layers(profile, profile.closure.env, lock.image_layers)
    assert list(layers) == ["cuda-torch", "kernels", "app"]
    names = [line.split(" @ ")[0] for text in layers.values() for line in text.splitlines() if " @ " in line]
    assert sorted(names) == sorted(profile.closure.env)
    assert "torch @" in layers["cuda-torch"] and "sglang @" in layers["app"]


@needs_py312
@pytest.mark.network
def test_the_rendered_file_installs_with_plain_uv_and_a_wrong_hash_is_refused(tmp_path):
    """Rendered requirements are a plain requirements file: uv installs it with --require-hashes, and
    refuses a wheel whose bytes do not match."""
    from bwstack.lock.uvtool import run_uv, uv_env
    from bwstack.provision.envbuild import find_python

    profile = load_lock(REAL_LOCK).profile("cu128")
    text = render(profile, profile.closure.env, ["typing-extensions"])
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text(text)
    sha = text.split("--hash=sha256:")[1][:64]
    bad.write_text(text.replace(sha, "0" * 64))
    env = uv_env({"UV_CACHE_DIR": str(tmp_path / "cache")})
    for name in ("ok", "tampered"):
        assert (
            run_uv(["venv", "--python", find_python("3.12"), str(tmp_path / name)], env=env, capture=True).returncode
            == 0
        )
    args = ["pip", "install", "--require-hashes", "--no-deps", "--python"]
    ok = run_uv([*args, str(tmp_path / "ok" / "bin" / "python"), "-r", str(good)], env=env, capture=True)
    assert ok.returncode == 0, ok.stderr
    refused = run_uv([*args, str(tmp_path / "tampered" / "bin" / "python"), "-r", str(bad)], env=env, capture=True)
    assert refused.returncode != 0 and "typing-extensions" in refused.stderr.lower().replace("_", "-")


@needs_py312
def test_plan_names_each_difference_between_a_venv_and_the_lock(stack):
    stack.build("fixture-old", check=True)
    result = stack.run("plan", "--profile", "fixture-new", "--json", check=True)
    plan = json.loads(result.stdout)
    assert plan["changes"] == 2
    assert {d["name"]: (d["installed"], d["locked"]) for d in plan["wrong_version"]} == {
        "torch": ("2.9.1", "2.9.1+cu130"),
        "fixture-dep": ("1.0", "2.0"),
    }
    text = stack.run("plan", "--profile", "fixture-new", check=True).stdout
    assert "version  torch" in text and "2 change(s)" in text


@needs_py312
def test_plan_reports_missing_extra_and_wrong_hash(stack):
    stack.build("fixture-new", check=True)
    env = stack.ml_env
    from bwstack.lock.uvtool import run_uv, uv_env

    run_uv(["pip", "uninstall", "--python", str(env / "bin" / "python"), "fixture-dep"], env=uv_env(), capture=True)
    extra = next(p for p in (stack.tmp / "extra-wheels").iterdir())
    result = run_uv(
        ["pip", "install", "--python", str(env / "bin" / "python"), "--no-deps", str(extra)], env=uv_env(), capture=True
    )
    assert result.returncode == 0, result.stderr
    record = stack.root / "current" / "record.json"
    data = json.loads(record.read_text())
    data["packages"]["torch"]["sha256"] = "f" * 64  # the wheel this env was built from is not the lock's
    record.chmod(0o644)
    record.write_text(json.dumps(data))
    plan = json.loads(stack.run("plan", "--profile", "fixture-new", "--json", check=True).stdout)
    assert [d["name"] for d in plan["missing"]] == ["fixture-dep"]
    assert [d["name"] for d in plan["wrong_hash"]] == ["torch"]
    assert [(d["name"], d["installed"], d["locked"]) for d in plan["wrong_version"]] == [
        ("fixture-shared", "2.0", "1.0")
    ]


def test_cli_help_lists_every_job():
    out = bwstack("--help", check=True).stdout
    for command in ("lock", "show", "plan", "build", "rollback", "backup", "restore", "generations", "verify"):
        assert command in out


_LOADED_AFTER = """import runpy, sys
sys.argv = ["bwstack", *sys.argv[2:]]
try:
    runpy.run_module("bwstack", run_name="__main__")
except SystemExit:
    pass
print(MODULE in sys.modules, file=sys.stderr)
"""


@pytest.mark.parametrize("module", ["requests", "bwstack.image.build"])
def test_a_command_that_downloads_nothing_starts_without_the_http_client_or_the_image_build(stack, module):
    """requests (urllib3, cookies, charset detection) and the image build are ~0.2 s of every start on a slow
    machine: only a download or `image build` loads them."""
    lock = ["--lock", str(stack.lock)]
    for args in (
        ["--help"],
        [*lock, "build", "--profile", "fixture-new", "--wheelhouse", str(stack.wheelhouse)],  # no download
        [*lock, "generations"],
        [*lock, "show"],
    ):
        run = subprocess.run(
            [sys.executable, "-c", _LOADED_AFTER.replace("MODULE", repr(module)), "-", *args],
            capture_output=True, text=True, env={**os.environ, **stack.env},
        )  # fmt: skip
        assert run.stderr.strip().splitlines()[-1] == "False", (args, run.stderr[-500:])
    assert (stack.ml_env / "bin").is_dir()  # the build did build


def test_the_checks_listed_are_the_node_checks_pytest_collects_and_nothing_else():
    listed = bwstack("verify", "--list-checks", check=True).stdout.split()
    infra = Path(__file__).resolve().parents[1] / "infra"
    collected = {line.split("def test_", 1)[1].split("(", 1)[0]
                 for path in infra.glob("test_*.py") for line in path.read_text().splitlines()
                 if line.startswith("def test_")}  # fmt: skip
    assert sorted(listed) == sorted(collected)
    assert not {"image", "runtime", "pytest_generate_tests"} & set(listed), "fixtures and hooks are no checks"


@pytest.mark.parametrize("name", ["runtime", "pytest_generate"], ids=["a-fixtures-name", "a-hooks-name"])
def test_a_waiver_naming_only_a_fixture_or_hook_of_the_checks_is_refused(name):
    result = bwstack("verify", "--skip", f"{name}=no check is called this")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and f"no check's name contains {name!r}" in result.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--only", "P9"], "'P9': not a bench"),
        (["--only", "P5,x"], "'x': not a bench"),
        (["--only", ","], "names no bench"),
        (["--work", "/proc/bwstack-bench-test"], "--work /proc/bwstack-bench-test: cannot be created"),
        (["--work", "/etc/os-release"], "--work /etc/os-release: not a directory"),
        (["--work="], "--work is empty"),
    ],
    ids=["unknown-bench", "one-unknown", "names-none", "scratch-not-creatable", "scratch-a-file", "scratch-empty"],
)
def test_bench_refuses_bad_input_before_measuring_anything(args, says, tmp_path):
    work = [] if any(a.startswith("--work") for a in args) else ["--work", str(tmp_path / "work")]
    result = bwstack("bench", *work, *args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and says in result.stderr
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())


@needs_py312
def test_bench_exits_non_zero_naming_a_figure_it_could_not_measure(tmp_path):
    """A table with a row that failed or did not run is not a result: a script running the benches must see it.
    P6 cannot run without a Docker daemon (here: one at a socket that does not exist)."""
    result = bwstack(
        "--lock", str(REAL_LOCK), "bench", "--quick", "--only", "P6", "--work", str(tmp_path / "work"),
        env={"DOCKER_HOST": f"unix://{tmp_path}/no-daemon.sock"},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "| P6 | image rebuild after an sglang bump (NOT RUN) |" in result.stdout
    assert "bwstack bench: not measured: P6 image rebuild after an sglang bump (not run)" in result.stderr
    assert "Traceback" not in result.stderr


def _made_by_another_user(work: Path) -> None:
    work.mkdir(mode=0o777)
    os.chown(work, OTHER_UID, OTHER_UID)


def _inside_a_folder_others_can_write(work: Path) -> None:
    work.parent.mkdir()
    os.chmod(work.parent, 0o777)


@pytest.mark.parametrize(
    ("prepare", "says"),
    [
        (_made_by_another_user, "is not this user's alone"),
        (lambda work: work.mkdir(mode=0o777) or os.chmod(work, 0o777), "is not this user's alone"),
        (_inside_a_folder_others_can_write, "would be made where others can write"),
    ],
    ids=["made-first-by-another-user", "writable-by-others", "to-be-made-where-others-write"],
)
def test_bench_refuses_a_scratch_folder_others_could_write(tmp_path, prepare, says):
    """The benches write a lock and requirement files there and run what they wrote as root: another user's
    folder (made first under the default's /var/tmp) could swap any of it."""
    work = tmp_path / "shared" / "work" if prepare is _inside_a_folder_others_can_write else tmp_path / "work"
    prepare(work)
    result = bwstack("bench", "--work", str(work), "--only", "P6")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and f"--work {work} " in result.stderr and says in result.stderr
    assert not work.exists() or not any(work.iterdir())


def test_bench_makes_its_scratch_folder_for_this_user_alone_even_under_a_sticky_one(tmp_path):
    """/var/tmp (the default's parent) is sticky: nobody renames another's entry, so a folder made there is safe."""
    from bwstack.cli.commands import bench

    (tmp_path / "sticky").mkdir()
    os.chmod(tmp_path / "sticky", 0o1777)
    work = tmp_path / "sticky" / "work"
    bench._scratch(str(work))
    assert stat.S_IMODE(os.stat(work).st_mode) == 0o700


def test_the_bench_compiles_bwstacks_bytecode_as_an_install_has_it(tmp_path, monkeypatch):
    """Timed commands are bwstack as installed (pip compiles its bytecode): not a checkout compiling 200 modules
    from source on every run, as it does where PYTHONDONTWRITEBYTECODE is set."""
    import importlib.util
    from pathlib import Path

    from bwstack.bench import run

    package = Path(run.__file__).parents[1]
    probe_main = package / "probe" / "main.py"
    cached = Path(importlib.util.cache_from_source(str(probe_main)))
    cached.unlink(missing_ok=True)
    asked: list[str] = []
    monkeypatch.setattr(run, "Bench", lambda *args, **kwargs: asked.append("bench") or run_stopped())

    def run_stopped():
        raise RuntimeError("stopped after the set-up")

    with pytest.raises(RuntimeError, match="stopped after the set-up"):
        run.run("stack.lock.yaml", "cu128", str(tmp_path), 1, True, ["P5"])
    assert asked == ["bench"] and cached.is_file()
    missing = [p for p in package.rglob("*.py") if not Path(importlib.util.cache_from_source(str(p))).is_file()]
    assert missing == []


def test_the_bench_compiles_its_dependencies_bytecode_as_an_install_has_it(tmp_path, monkeypatch):
    """pytest and testinfra, imported by every timed verify, are compiled too: uv installs a checkout's .venv
    without bytecode, and with PYTHONDONTWRITEBYTECODE set every run compiled them from source."""
    import importlib.util
    import sys
    from pathlib import Path

    import pluggy

    from bwstack.bench import run

    if sys.prefix == sys.base_prefix:
        pytest.skip("the tests run outside a venv: the bench compiles only a venv's own folders")
    module = Path(pluggy.__file__).with_name("_manager.py")
    cached = Path(importlib.util.cache_from_source(str(module)))
    cached.unlink(missing_ok=True)
    monkeypatch.setattr(run, "Bench", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("set up")))
    with pytest.raises(RuntimeError, match="set up"):
        run.run("stack.lock.yaml", "cu128", str(tmp_path), 1, True, ["P5"])
    assert cached.is_file()


@pytest.mark.parametrize(("ours", "anchor", "shown"), [(280.7, 129.6, "0.46x"), (100.0, 49.6, "0.49x")])
def test_the_bench_report_shows_a_ratio_short_of_its_goal_as_short_of_it(ours, anchor, shown):
    """P7's 129.6 s anchor against 280.7 s is 0.46: printed to one decimal it read "0.5x", its goal of 0.5 met; 0.496
    rounded to two would read "0.50x"."""
    from bwstack.bench.run import Figure, render

    figure = Figure("P7", "fresh node", [ours], anchor="uv + verify", anchor_runs=[anchor], goal="ratio >= 0.5")
    assert f"| {shown} | ratio >= 0.5 |" in render([figure])


# ------------------------------------------------------------------------------------------------ Ctrl-C at start-up

# Modules bwstack imports on its way to a command, after its package's first lines (which guard SIGINT) ran: the
# CLI's entry module, the shared options, the heaviest import (the lock model), the console (imported by the
# command modules) and the last import while the parser is built (`accept`'s options).
START_UP_IMPORTS = (
    "bwstack.cli",
    "bwstack.cli.main",
    "bwstack.cli.options",
    "bwstack.lock.model",
    "bwstack.cli.console",
    "bwstack.accept.command",
)
ENTRY_POINTS = ("python -m bwstack", "the bwstack script")

# Loaded by the interpreter at start (sitecustomize on PYTHONPATH): the process interrupts itself as it begins to
# import the module named in the environment, so the Ctrl-C lands at a known point of start-up whatever the load.
_INTERRUPT_AT_IMPORT = """
import os, signal, sys

class _Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ.get("BWSTACK_TEST_INTERRUPT_AT"):
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, _Interrupt())
"""


def _cli(entry: str, *args: str) -> list[str]:
    import sys

    if entry == "python -m bwstack":
        return [sys.executable, "-m", "bwstack", *args]
    return [str(Path(sys.executable).with_name("bwstack")), *args]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("module", START_UP_IMPORTS)
def test_ctrl_c_while_bwstack_starts_exits_130_with_one_line_and_no_traceback(tmp_path, entry, module):
    import subprocess

    (tmp_path / "sitecustomize.py").write_text(_INTERRUPT_AT_IMPORT)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    # Ctrl-C as a terminal delivers it: a test run started in the background of a non-interactive shell inherits
    # SIGINT ignored, and the interpreter would then never see the interrupt this test sends.
    result = subprocess.run(
        _cli(entry, "--version"), capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": path, "BWSTACK_TEST_INTERRUPT_AT": module},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert "Traceback" not in result.stderr, result.stderr
    assert (result.returncode, result.stdout, result.stderr.count("\n")) == (130, "", 1), result.stderr
    assert result.stderr.startswith("bwstack: interrupted")


# ------------------------------------------------------------------------------------------------ values refused early

REQUIREMENT = (
    "six @ https://files.pythonhosted.org/packages/x/six-1.16.0-py2.py3-none-any.whl --hash=sha256:" + "0" * 64
)


def _env_install(tmp_path: Path, *extra: str, env: dict | None = None, offline: bool = True):
    """`env install` of one locked wheel, offline with no wheelhouse: a run that gets past its checks fails at
    the fetch (exit 1, "is in no wheelhouse"), so exit 2 says the value was refused before anything ran. Not
    offline for a bad --index (an offline run reads none): its check refuses the value before any download."""
    requirements = tmp_path / "r.txt"
    requirements.write_text(REQUIREMENT + "\n")
    store = tmp_path / "store"
    store.mkdir(mode=0o700, exist_ok=True)
    args = ["env", "install", "--requirements", str(requirements), "--store", str(store)]
    args += ["--offline"] if offline else []
    if "--into" not in extra:
        args += ["--into", str(tmp_path / "env")]
    return bwstack(*args, *extra, env=env)


def test_env_install_gets_past_its_checks_to_the_fetch_with_good_values(tmp_path):
    # (a mirror in BWSTACK_INDEX: an offline run given --index refuses it as unread)
    result = _env_install(
        tmp_path, "--python-version", "3.12", env={"BWSTACK_INDEX": "pypi=https://mirror.example/simple"}
    )
    assert result.returncode == 1 and "is in no wheelhouse and the run is offline" in result.stderr


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("abc", "argument --python-version: 'abc' is not a Python version like 3.12"),
        ("3", "argument --python-version: '3' is not a Python version like 3.12"),
        ("3.12.1", "argument --python-version: '3.12.1' is not a Python version like 3.12"),
        ("2.7", "argument --python-version: '2.7' is not a Python version like 3.12"),
        ("3.", "argument --python-version: '3.' is not a Python version like 3.12"),
    ],
    ids=["letters", "major-only", "patch-level", "python-2", "no-minor"],
)
def test_env_install_refuses_a_bad_python_version_in_one_line(tmp_path, value, says):
    result = _env_install(tmp_path, "--python-version", value)
    assert (result.returncode, result.stderr) == (2, f"bwstack env install: error: {says}\n")
    assert not (tmp_path / "env").exists()


@pytest.mark.parametrize("kind", ["regular file", "dangling link"])
def test_env_install_into_something_that_is_not_a_folder_is_refused_before_the_fetch(tmp_path, kind):
    into = tmp_path / "into"
    if kind == "regular file":
        into.write_text("not an env\n")
    else:
        into.symlink_to(tmp_path / "nowhere")
    result = _env_install(tmp_path, "--into", str(into))
    assert result.returncode == 2
    assert (
        result.stderr
        == f"bwstack: error: --into {into}: exists and is not a directory (give an env folder or a new path)\n"
    )


@pytest.mark.parametrize("command", ["fetch", "env install"])
@pytest.mark.parametrize(
    "mirror",
    ["garbage-no-equals", "pypi=http://plain-http.example/simple", "=https://no-name.example/simple", "pypi="],
    ids=["no-equals", "plain-http", "no-name", "no-url"],
)
def test_fetch_and_env_install_refuse_the_same_bad_index_with_the_same_line(tmp_path, command, mirror):
    if command == "fetch":
        result = bwstack("fetch", "--dest", str(tmp_path / "dest"), "--index", mirror)  # refused before any download
    else:
        result = _env_install(tmp_path, "--index", mirror, offline=False)
    assert result.returncode == 2
    assert result.stderr == f"bwstack: error: --index {mirror!r}: expected NAME=https://mirror/simple\n"


def test_env_install_checks_the_mirrors_in_bwstack_index_as_fetch_does(tmp_path):
    result = _env_install(tmp_path, env={"BWSTACK_INDEX": "pypi=https://mirror.example/simple\nnot-a-mirror\n"})
    assert (result.returncode, result.stderr) == (
        2,
        "bwstack: error: --index 'not-a-mirror': expected NAME=https://mirror/simple\n",
    )


@pytest.mark.parametrize(
    "command", [["waivers"], ["preflight", "--allow-no-gpu", "--allow-other-gpu", "--min-free-gb", "0"]]
)
def test_a_store_command_takes_the_ml_env_that_keeps_the_links_apart_from_its_store(tmp_path, command):
    """The store and its links must not overlap (a store at /opt needs its env elsewhere): a command that reads
    the store alone still takes --ml-env to say where the env is, or nothing could use such a store."""
    store = tmp_path / "store"
    inside = {"BWSTACK_ML_ENV": str(store / "ml-env")}
    overlapping = bwstack("--lock", str(REAL_LOCK), *command, "--root", str(store), env=inside)
    assert overlapping.returncode == 2 and "overlap" in overlapping.stderr, overlapping.stderr
    apart = bwstack("--lock", str(REAL_LOCK), *command, "--root", str(store), "--ml-env", str(tmp_path / "env"),
                    env=inside)  # fmt: skip
    assert apart.returncode in (0, 4) and "overlap" not in apart.stderr, apart.stderr


def test_rollback_target_takes_a_wheelhouse_on_the_hosts_as_provision_does():
    """--target's --wheelhouse and --ca-bundle name paths on the hosts: this machine need not have them."""
    from bwstack.cli import options
    from bwstack.cli.main import build_parser
    from bwstack.fleet import playbooks

    for command in (["provision"], ["rollback", "--target", "ssh://node", "--rebuild"]):
        argv = ["--lock", "stack.lock.yaml", *command, "--wheelhouse", "/srv/on-the-node", "--ca-bundle", "/node.pem"]
        got = playbooks._common_vars(options.playbook_settings(build_parser().parse_args(argv)))
        assert (got["bwstack_wheelhouse"], got["bwstack_ca_bundle"]) == (["/srv/on-the-node"], "/node.pem")


@pytest.mark.parametrize("command", [["provision"], ["rollback", "--target", "ssh://node", "--rebuild"]])
@pytest.mark.parametrize("option", ["--wheelhouse", "--ca-bundle"])
def test_a_hosts_source_path_with_a_control_character_is_refused(command, option):
    """It goes into Ansible's variables on the hosts, where a newline would start a line of its own."""
    result = bwstack("--lock", str(REAL_LOCK), *command, option, "/srv/wheels\nrm -rf /")
    assert result.returncode == 2 and f"argument {option}:" in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("option", "says"),
    [("--wheelhouse", "no such directory"), ("--ca-bundle", "no such file")],
)
def test_a_rollback_here_that_rebuilds_refuses_source_paths_this_machine_lacks(tmp_path, option, says):
    result = bwstack("--lock", str(REAL_LOCK), "rollback", "--root", str(tmp_path / "store"), "--rebuild",
                     option, str(tmp_path / "missing"))  # fmt: skip
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"bwstack: error: argument {option}: '{tmp_path / 'missing'}': {says}\n"
    assert not (tmp_path / "store").exists()


UNREACHABLE = ["--target", "ssh://127.0.0.1:1", "--check"]  # port 1: nothing listens, should anything try


@pytest.mark.parametrize("command", [["provision", *UNREACHABLE], ["preflight"]], ids=["provision", "preflight"])
@pytest.mark.parametrize("value", ["nan", "-5", "inf", "-inf", "ten", "1e999"])
def test_every_command_refuses_a_min_free_gb_that_no_disk_check_can_use(tmp_path, command, value):
    """One option definition (options.add_min_free_gb) for every command that takes it: refused while the
    command line is read, before a playbook or a check runs."""
    # --min-free-gb=VALUE: argparse would take a separate "-inf" for an option of its own.
    result = bwstack(*command, f"--min-free-gb={value}", env={"BWSTACK_LOG_DIR": str(tmp_path)})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"bwstack {command[0]}: error: argument --min-free-gb: {value!r}")
    assert result.stderr.count("\n") == 1 and list(tmp_path.iterdir()) == []


def _dir_setting(tmp_path: Path, kind: str) -> str:
    """A value for a directory setting that must be refused, and what it is."""
    if kind == "empty":
        return ""
    if kind == "spaces":
        return "   "
    if kind == "missing":
        return "/nonexistent"
    if kind == "regular file":
        (tmp_path / "file").write_text("")
        return str(tmp_path / "file")
    (tmp_path / "other").mkdir()
    return str(tmp_path / "other")


DIR_SETTING_CASES = [
    ("empty", "{var} is empty: give a directory (or unset it to use the default)"),
    ("spaces", "{var} is empty: give a directory (or unset it to use the default)"),
    ("missing", "{var}=/nonexistent: not a directory (give one, or unset it to use the default)"),
    ("regular file", "{var}={value}: not a directory (give one, or unset it to use the default)"),
    ("folder without the files", "{var}={value}: holds no {marker} (is it the right directory?)"),
]


@pytest.mark.parametrize("command", ["provision", "rollback"])
@pytest.mark.parametrize(("kind", "says"), DIR_SETTING_CASES, ids=[kind for kind, _ in DIR_SETTING_CASES])
def test_a_bad_ansible_dir_setting_is_refused_not_replaced_by_the_checkouts(tmp_path, kind, says, command):
    logs = tmp_path / "logs"
    logs.mkdir()
    value = _dir_setting(tmp_path, kind)
    result = bwstack(command, *UNREACHABLE, env={"BWSTACK_ANSIBLE_DIR": value, "BWSTACK_LOG_DIR": str(logs)})
    expected = says.format(var="BWSTACK_ANSIBLE_DIR", value=value, marker="provision.yml")
    assert (result.returncode, result.stderr) == (2, f"bwstack: error: {expected}\n")
    assert list(logs.iterdir()) == []


@pytest.mark.parametrize(("kind", "says"), DIR_SETTING_CASES, ids=[kind for kind, _ in DIR_SETTING_CASES])
def test_a_bad_docker_dir_setting_is_refused_not_replaced_by_the_checkouts(tmp_path, kind, says):
    """Refused before Docker is asked for anything (this needs no Docker daemon)."""
    value = _dir_setting(tmp_path, kind)
    result = bwstack("image", "build", "--offline", env={"BWSTACK_DOCKER_DIR": value})
    expected = says.format(var="BWSTACK_DOCKER_DIR", value=value, marker="Dockerfile")
    assert (result.returncode, result.stderr) == (2, f"bwstack: error: {expected}\n")


def test_a_docker_dir_setting_that_holds_the_dockerfile_is_the_one_used(tmp_path, monkeypatch):
    from bwstack import paths

    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    monkeypatch.setenv("BWSTACK_DOCKER_DIR", str(tmp_path))
    assert paths.shipped("docker", "bwstack_docker", "Dockerfile", env="BWSTACK_DOCKER_DIR") == tmp_path


def test_a_relative_dir_setting_is_taken_from_where_bwstack_was_started(tmp_path, monkeypatch):
    """Ansible runs in the playbooks' folder: a path left relative would be looked up from there."""
    from bwstack import paths

    (tmp_path / "ans").mkdir()
    (tmp_path / "ans" / "provision.yml").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BWSTACK_ANSIBLE_DIR", "ans")
    assert paths.setting_dir("BWSTACK_ANSIBLE_DIR", "provision.yml") == tmp_path / "ans"


# An option given where its command does not read it would act as nothing: refused in one line instead, before
# any work (the paths below do not exist, so a command that got past its options would fail differently).
UNREAD_CASES = [
    (["verify", "--list-checks", "--skip", "cuda_runtime=no GPU"], "--skip is not read with --list-checks"),
    (["serve-plan", "--list-models", "--tp", "2"], "--tp is not read with --list-models"),
    (["serve-plan", "--list-models", "--model", "llama"], "--model is not read with --list-models"),
    (["accept", "--machine", "/nonexistent/rec", "--env", "/nonexistent/env"], "--env is not read with --machine"),
    (["accept", "--machine", "/nonexistent/rec", "--timeout", "5"], "--timeout is not read with --machine"),
    (["cuda", "status", "--offline"], "--offline is not read with status"),
    (["cuda", "status", "--root", "/nonexistent/root"], "--root is not read with status"),
    (["generations", "--verify", "full"], "--verify is read only with --check: add --check or leave --verify out"),
    (["plan", "--env", "/nonexistent/env", "--ml-env", "/nonexistent/m"], "--ml-env is not read with --env"),
    (["preflight", "--take-over-links"], "unrecognized arguments: --take-over-links"),
    (["preflight", "--verify", "full"], "unrecognized arguments: --verify full"),
    (["waivers", "--take-over-links"], "unrecognized arguments: --take-over-links"),
    (["cuda", "install", "--python", "python3"], "unrecognized arguments: --python python3"),
    (
        ["controller-facts", "--wheel", "/nonexistent/w.whl", "--wheel-dir", "/nonexistent/d"],
        "--wheel-dir is not read with --wheel",
    ),
    (["restore", "/nonexistent/a.tar", "--verify", "full"], "unrecognized arguments: --verify full"),
    (["accept", "--no-runtime", "--env", "/nonexistent/env"], "--env is not read with --no-runtime"),
    (
        ["fetch", "--dest", "/nonexistent/d", "--offline", "--index", "pypi=https://127.0.0.1:1/simple"],
        "--index is not read with --offline",
    ),
    (
        ["cuda", "install", "--offline", "--index", "pypi=https://127.0.0.1:1/simple"],
        "--index is not read with --offline",
    ),
    (["patch", "status", "--env", "/nonexistent/env", "--ml-env", "/nonexistent/m"], "--ml-env is not read with --env"),
    (
        ["patch", "status", "--patch", "sglang-sm120-symm-mem", "--profile", "cu128"],
        "--profile is not read with --patch",
    ),
    (["features", "--env", "/nonexistent/env", "--ml-env", "/nonexistent/m"], "--ml-env is not read with --env"),
    (["serve-plan", "--env", "/nonexistent/env", "--ml-env", "/nonexistent/m"], "--ml-env is not read with --env"),
    (["patch", "apply", "--root", "/nonexistent/root"], "unrecognized arguments: --root"),
    (["plan", "--root", "/nonexistent/root"], "unrecognized arguments: --root"),
    (
        ["build", "--offline", "--index", "pypi=https://127.0.0.1:1/simple"],
        "--index is not read with --offline",
    ),
    (
        [
            "env",
            "install",
            "--requirements",
            str(REAL_LOCK),
            "--into",
            "/nonexistent/env",
            "--offline",
            "--index",
            "pypi=https://127.0.0.1:1/simple",
        ],
        "--index is not read with --offline",
    ),
    (["provision", "--offline", "--index", "pypi=https://127.0.0.1:1/simple"], "--index is not read with --offline"),
    (
        ["rollback", "--rebuild", "--offline", "--index", "pypi=https://127.0.0.1:1/simple"],
        "--index is not read with --offline",
    ),
    (["rollback", "--target", "ssh://127.0.0.1:1", "--verify", "full"], "--verify is not read with --target"),
    (["rollback", "--target", "ssh://127.0.0.1:1", "--json"], "--json is not read with --target"),
]


@pytest.mark.parametrize(("argv", "says"), UNREAD_CASES, ids=[" ".join(a[:3]) for a, _ in UNREAD_CASES])
def test_an_option_its_command_would_not_read_is_refused_in_one_line(tmp_path, argv, says):
    result = bwstack("--lock", str(REAL_LOCK), *argv, env={"BWSTACK_ROOT": str(tmp_path / "store")})
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert says in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert list(tmp_path.iterdir()) == []


ACTING_CASES = [
    ["verify", "--list-checks", "--json"],
    ["accept", "--machine", "/nonexistent/rec", "--no-runtime"],  # says what --machine does anyway
    ["generations", "--check", "--verify", "full"],
]


@pytest.mark.parametrize("argv", ACTING_CASES, ids=[" ".join(a[:3]) for a in ACTING_CASES])
def test_options_that_act_in_the_mode_are_not_refused(tmp_path, argv):
    result = bwstack("--lock", str(REAL_LOCK), *argv, env={"BWSTACK_ROOT": str(tmp_path / "store")})
    assert "is not read with" not in result.stderr and "is read only with" not in result.stderr, result.stderr


def test_every_unread_rule_names_options_its_command_has():
    """A rule naming an option the command lacks would never fire: a check that cannot fail."""
    from bwstack.cli.commands import modules
    from bwstack.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    ruled = 0
    for command in modules():
        top = sub.choices[command.NAME]
        nested = [p for a in top._actions if isinstance(a, argparse._SubParsersAction) for p in a.choices.values()]
        actions = {a.dest: a for p in (top, *nested) for a in p._actions}  # a nested command's own (env install)
        dests = set(actions)
        for rule in getattr(command, "UNREAD", ()):
            dest, _, value = rule.mode.partition("=")
            named = {dest, *(rule.reads or ()), *rule.ignores}
            assert named <= dests, (command.NAME, named - dests)
            if value:  # a positional's value the rule waits for must be one it can take
                assert value in actions[dest].choices, (command.NAME, rule.mode)
            ruled += 1
    assert ruled >= 10


def test_an_empty_value_is_named_as_its_own_command_spells_the_option(tmp_path):
    """backup's --archive and restore's positional ARCHIVE share a dest: the message named restore's."""
    result = bwstack("backup", "--root", str(tmp_path / "store"), "--archive", "")
    assert result.returncode == 2 and result.stderr == (
        "bwstack: error: --archive is empty: give a value or leave the option out\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_cuda_install_refuses_an_allow_unhashed_name_outside_its_closure_as_fetch_does(tmp_path):
    """cuda install never handed --allow-unhashed to its fetcher: a toolkit wheel without a hash could not be
    installed, and a misspelt name was accepted."""
    result = bwstack("--lock", str(REAL_LOCK), "cuda", "install", "--profile", "cu128", "--prefix",
                     str(tmp_path / "cuda"), "--root", str(tmp_path / "root"), "--offline",
                     "--allow-unhashed", "no-such-package")  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr == "bwstack: error: --allow-unhashed no-such-package: not in this closure\n"
    assert not (tmp_path / "cuda").exists()


def test_cuda_install_takes_the_provision_runs_allow_unhashed_names_of_the_env_part(tmp_path):
    """Provision hands one --allow-unhashed list (README: torchaudio, flashinfer-jit-cache) to the env build and
    the toolkit install alike: a name of the env's part must not stop the toolkit install. Here it gets past the
    names to the offline fetch, which has no wheelhouse."""
    result = bwstack("--lock", str(REAL_LOCK), "cuda", "install", "--profile", "cu130", "--prefix",
                     str(tmp_path / "cuda"), "--root", str(tmp_path / "root"), "--offline",
                     "--allow-unhashed", "torchaudio", "--allow-unhashed", "flashinfer-jit-cache")  # fmt: skip
    assert result.returncode == 1 and "is in no wheelhouse and the run is offline" in result.stderr, result.stderr
    assert not (tmp_path / "cuda").exists()


def test_backup_takes_over_a_link_it_did_not_make_when_told_to(tmp_path):
    """backup adopts an env that is a real folder and then points the links: it needs --take-over-links as a
    build does, and offers it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "ml-env")], check=True)
    (tmp_path / "other-cuda").mkdir()
    (tmp_path / "cuda").symlink_to(tmp_path / "other-cuda")
    where = [
        "--root",
        str(tmp_path / "root"),
        "--ml-env",
        str(tmp_path / "ml-env"),
        "--cuda-link",
        str(tmp_path / "cuda"),
    ]
    refused = bwstack("backup", *where)
    assert refused.returncode == 2 and "pass --take-over-links" in refused.stderr, refused.stderr
    taken = bwstack("backup", *where, "--take-over-links")
    assert taken.returncode == 0 and "\nadopted: 0000-adopted-" in taken.stdout, taken.stderr
    assert os.readlink(tmp_path / "cuda") == str(tmp_path / "root" / "current" / "cuda")


def test_backup_with_no_env_says_why_it_did_nothing(tmp_path):
    result = bwstack("backup", "--root", str(tmp_path / "root"), "--ml-env", str(tmp_path / "no-env"),
                     "--cuda-link", "none")  # fmt: skip
    assert result.returncode == 0 and result.stdout == "nothing: no active env to back up\n", result.stdout


def test_build_check_plans_no_switch_when_the_run_would_not_switch(stack):
    """--check is the same command line as a dry run: --no-switch was ignored and the plan said "switch"."""
    plain = json.loads(stack.run("build", "--profile", "fixture-new", "--check", "--json", check=True).stdout)
    kept = json.loads(
        stack.run("build", "--profile", "fixture-new", "--check", "--no-switch", "--json", check=True).stdout
    )
    assert any(a.startswith("switch ") for a in plain["actions"])
    assert kept["actions"] == [a for a in plain["actions"] if not a.startswith("switch ")] and kept["build"]
