"""`bwstack patch` runs as root on envs that others may own: it never follows a link inside the env.

An env's owner can make any folder of it (`sglang`, `site-packages`, a module's folder, `__pycache__`) or a patched
file a link to the same place in another env (root's, another store's sealed generation, another user's). Following
it, root would rewrite that env's files. So every path a patch touches is reached from the env one name at a time
without following a link, and a link on the way is refused (UsageError: the CLI's exit 2, one line).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from realwheels import site_packages

from bwstack.cli.main import main
from bwstack.errors import UsageError
from bwstack.probe import envinspect
from bwstack.provision import patches

PATCH = "sglang-sm120-symm-mem"
COMM = "sglang/srt/distributed/device_communicators"
UTILS = f"{COMM}/all_reduce_utils.py"
SYMM = f"{COMM}/torch_symm_mem.py"
SITE = "lib/python3.12/site-packages"


def fingerprint(path: Path) -> tuple:
    st = path.stat()
    return hashlib.sha256(path.read_bytes()).hexdigest(), st.st_ino, st.st_mtime_ns


def tree_fingerprint(sp: Path) -> dict[str, tuple]:
    return {rel: fingerprint(sp / rel) for rel in (UTILS, SYMM)}


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """The site-packages of an env that is not the patched env's owner's to change (sglang 0.5.9, unpatched)."""
    return site_packages(tmp_path, ("sglang", "0.5.9"), name=f"victim/{SITE}")


def hostile_env(tmp_path: Path, victim: Path) -> Path:
    """An env of its own (pyvenv.cfg, sglang's dist-info) whose site-packages holds nothing else yet."""
    env = tmp_path / "hostile"
    sp = env / SITE
    sp.mkdir(parents=True)
    (env / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.12.3\n")
    shutil.copytree(victim / "sglang-0.5.9.dist-info", sp / "sglang-0.5.9.dist-info")
    return env


def link_sglang(env: Path, victim: Path) -> None:
    os.symlink(victim / "sglang", env / SITE / "sglang")


def link_module_folder(env: Path, victim: Path) -> None:
    shutil.copytree(victim / "sglang", env / SITE / "sglang", ignore=shutil.ignore_patterns("device_communicators"))
    os.symlink(victim / COMM, env / SITE / COMM)


def link_patched_file(env: Path, victim: Path) -> None:
    shutil.copytree(victim / "sglang", env / SITE / "sglang")
    (env / SITE / UTILS).unlink()
    os.symlink(victim / UTILS, env / SITE / UTILS)


def link_site_packages(env: Path, victim: Path) -> None:
    shutil.rmtree(env / SITE)
    os.symlink(victim, env / SITE)


def link_python_folder(env: Path, victim: Path) -> None:
    shutil.rmtree(env / SITE.rsplit("/", 1)[0])
    os.symlink(victim.parent, env / SITE.rsplit("/", 1)[0])


# (what is a link, how the env makes it, the path the refusal names)
LINKS: list[tuple[str, Callable[[Path, Path], None], str]] = [
    ("the package folder", link_sglang, f"{SITE}/sglang"),
    ("a folder inside the package", link_module_folder, f"{SITE}/{COMM}"),
    ("the patched file", link_patched_file, f"{SITE}/{UTILS}"),
    ("site-packages", link_site_packages, SITE),
    ("lib/pythonX.Y", link_python_folder, SITE.rsplit("/", 1)[0]),
]


def refuse(env: Path, action: Callable) -> UsageError:
    with pytest.raises(UsageError, match="does not follow links inside an env") as caught:
        action(envinspect.site_packages(env), [PATCH])
    return caught.value


# ------------------------------------------------------------------------------------------------ links


@pytest.mark.network
@pytest.mark.parametrize("action", [patches.apply, patches.revert], ids=["apply", "revert"])
@pytest.mark.parametrize(("what", "make", "named"), LINKS, ids=[case[0] for case in LINKS])
def test_a_link_inside_the_env_is_refused_and_its_target_left_alone(
    tmp_path: Path, victim: Path, action: Callable, what: str, make: Callable, named: str
) -> None:
    if action is patches.revert:
        patches.apply(victim, [PATCH])  # patched: a revert followed through the link would rewrite it
    env = hostile_env(tmp_path, victim)
    make(env, victim)
    before = tree_fingerprint(victim)
    error = refuse(env, action)
    assert f"{env / named} is a link" in str(error)
    assert tree_fingerprint(victim) == before  # the same bytes in the same inodes


@pytest.mark.network
def test_status_refuses_to_read_through_a_linked_package_folder(tmp_path: Path, victim: Path) -> None:
    env = hostile_env(tmp_path, victim)
    link_sglang(env, victim)
    refuse(env, patches.status)


@pytest.mark.network
@pytest.mark.parametrize("action", ["apply", "revert"])
def test_the_cli_turns_a_link_into_one_line_and_exit_2(
    tmp_path: Path, victim: Path, action: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if action == "revert":
        patches.apply(victim, [PATCH])
    env = hostile_env(tmp_path, victim)
    link_sglang(env, victim)
    before = tree_fingerprint(victim)
    assert main(["patch", action, "--env", str(env), "--patch", PATCH]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not follow links inside an env" in err[0]
    assert tree_fingerprint(victim) == before


@pytest.mark.network
@pytest.mark.parametrize("action", ["apply", "revert"])
def test_an_env_reached_through_another_users_link_is_refused_before_anything_is_read(
    tmp_path: Path, victim: Path, action: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--env ~user/env` where the user made that name a link to root's env: root would patch the env the user
    chose (a sealed generation), so the env must be reached only through what root or this user owns."""
    env = victim.parents[2]
    if action == "revert":
        patches.apply(victim, [PATCH])
    theirs = tmp_path / "their-env"
    theirs.symlink_to(env)
    os.lchown(theirs, 65534, -1)
    before = tree_fingerprint(victim)
    assert main(["patch", action, "--env", str(theirs), "--patch", PATCH]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the link {theirs} belongs to uid 65534" in err[0], err
    assert tree_fingerprint(victim) == before


# ------------------------------------------------------------------------------------------ not regular files


def fifo(path: Path) -> None:
    os.mkfifo(path)


def folder(path: Path) -> None:
    path.mkdir()


@pytest.mark.network
@pytest.mark.parametrize("make", [fifo, folder], ids=["a FIFO", "a folder"])
def test_apply_refuses_a_patched_file_that_is_not_a_regular_file(tmp_path: Path, victim: Path, make: Callable) -> None:
    env = hostile_env(tmp_path, victim)
    shutil.copytree(victim / "sglang", env / SITE / "sglang")
    (env / SITE / UTILS).unlink()
    make(env / SITE / UTILS)
    before = fingerprint(env / SITE / SYMM)
    with pytest.raises(UsageError, match=f"{env / SITE / UTILS} is not a regular file"):
        patches.apply(envinspect.site_packages(env), [PATCH])
    assert fingerprint(env / SITE / SYMM) == before


# ------------------------------------------------------------------------------------------------ bytecode


@pytest.mark.network
def test_a_linked_pycache_is_not_followed_when_stale_bytecode_is_removed(tmp_path: Path) -> None:
    sp = site_packages(tmp_path, ("sglang", "0.5.9"))
    elsewhere = tmp_path / "elsewhere-pycache"
    elsewhere.mkdir()
    stale = elsewhere / "all_reduce_utils.cpython-312.pyc"
    stale.write_bytes(b"not ours to delete")
    os.symlink(elsewhere, sp / COMM / "__pycache__")
    [result] = patches.apply(sp, [PATCH])
    assert (result.action, [f.bytecode_removed for f in result.files]) == ("applied", [(), ()])
    assert stale.read_bytes() == b"not ours to delete"


# ------------------------------------------------------------------------------------- which site-packages


def make_env(tmp_path: Path, pythons: list[str], cfg: str | None) -> Path:
    env = tmp_path / "env"
    for python in pythons:
        (env / "lib" / python / "site-packages").mkdir(parents=True)
    if cfg is not None:
        (env / "pyvenv.cfg").write_text(f"home = /usr/bin\n{cfg}\n")
    return env


@pytest.mark.parametrize(
    ("pythons", "cfg", "chosen"),
    [
        (["python3.9", "python3.12"], None, "python3.12"),  # by number: 3.9 sorts after 3.12 as text
        (["python3.10", "python3.9", "python3.11"], None, "python3.11"),
        (["python3.9", "python3.12"], "version = 3.9.18", "python3.9"),  # python -m venv writes `version`
        (["python3.9", "python3.12"], "version_info = 3.9.18", "python3.9"),  # uv writes `version_info`
        (["python3.9", "python3.12"], "version = 3.11.2", "python3.12"),  # named but absent: by number
    ],
)
def test_site_packages_is_that_of_the_python_pyvenv_cfg_names_else_the_newest(
    tmp_path: Path, pythons: list[str], cfg: str | None, chosen: str
) -> None:
    env = make_env(tmp_path, pythons, cfg)
    assert envinspect.site_packages(env) == env / "lib" / chosen / "site-packages"


def test_an_env_without_site_packages_is_not_a_python_env(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a Python env"):
        envinspect.site_packages(make_env(tmp_path, [], None))
