"""One build step of docker/Dockerfile, run INSIDE the image build (served by `bwstack image build`).

The Dockerfile's step RUNs fetch this file from http://bwstack-build.invalid/step.py, check that its sha256 is
the build arg BWSTACK_STEP_SHA256 (which bwstack computed from this file), and only then run it as
    step.py STEP ARGS...
The name never resolves: the request goes through `http_proxy`, which the build gets from bwstack and which
holds the short-lived build server's address on the Docker bridge and this build's secret token (urllib sends
it as Proxy-Authorization; the server refuses requests without it). The server serves this file, bwstack
itself (tool.tar: bwstack's code, its pure-Python dependencies and uv), the lock, and exactly the wheels the
rendered requirement files name.

Every step downloads what it needs into a temporary directory, runs the real bwstack command (the same code as
on a node: `bwstack env install`, `bwstack cuda install`, `bwstack patch apply`), and deletes the directory
before the RUN ends, so neither bwstack nor a wheel is left in any layer. Hashes are checked by bwstack
against the rendered requirement file (the server is trusted for nothing but bytes).

Steps:
    layer REQUIREMENTS             install one rendered layer file into $BWSTACK_ENV (default /opt/ml-env)
    toolkit KEYFILE                the profile's CUDA toolkit from its PyPI wheels into /toolkit<home>,
                                   unless the base image already has /usr/local/cuda (then /toolkit is empty)
    patch ENV "PATCH_ID ..."       `bwstack patch apply` (an empty list: nothing to do)

Standard library only until it has fetched bwstack (it runs before anything is installed); Python >= 3.10,
as bwstack itself.

The rendered requirements format has one parser, bwstack.lock.requirements.parse. bwstack is not installed
where this script runs, but every step that reads a requirement file fetches bwstack anyway (tool.tar, whose
digest the build args pin) to run its command, so the step imports the parser from that bundle
(`requirement_files` below) instead of carrying a second parser that could drift from it. (Copying the module
into the build context instead would make it another input whose edits bust the layer cache, and it imports
the lock model, so the copy would grow into a second bundle.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

CHUNK = 1 << 20
TIMEOUT = 600
SERVER = "http://bwstack-build.invalid"  # reached through http_proxy (the build server), never resolved
TOOLKIT_ROOT = "/toolkit"  # the toolkit stage's output, copied into the runtime stage's /
BASE_CUDA = "/usr/local/cuda"  # a base image's own toolkit, used as is


def log(message: str) -> None:
    print(f"bwstack-step: {message}", flush=True)


def download(url: str, dest: str) -> int:
    """GET url into dest; the byte count. Retries a few times (the server is local, but the build is long)."""
    for attempt in range(3):
        try:
            with urllib.request.urlopen(url, timeout=TIMEOUT) as response, open(dest, "wb") as out:
                size = 0
                while True:
                    chunk = response.read(CHUNK)
                    if not chunk:
                        return size
                    out.write(chunk)
                    size += len(chunk)
        except OSError as exc:
            if attempt == 2:
                raise SystemExit(f"bwstack-step: cannot download {url}: {exc}") from None
            time.sleep(1 + attempt)
    raise AssertionError("unreachable")


def requirement_files(step: Step, path: str) -> list[tuple[str, str, bool]]:
    """(name, wheel file name, has a hash) for each line of a rendered requirement file, read by bwstack's own
    parser from the bundle this step fetched (see the module's docstring)."""
    step.fetch_tool()
    if step.tool not in sys.path:
        sys.path.insert(0, step.tool)
    from bwstack.errors import BwstackError
    from bwstack.lock.requirements import parse

    try:
        packages = parse(path)
    except BwstackError as exc:
        raise SystemExit(f"bwstack-step: {exc}") from None
    return [(p.name, p.wheels[0].file, p.wheels[0].sha256 is not None) for p in packages.values()]


class Step:
    def __init__(self) -> None:
        self.server = SERVER
        self.tmp = tempfile.mkdtemp(prefix="bwstack-step-", dir="/tmp")
        self.tool = os.path.join(self.tmp, "tool")
        self.wheelhouse = os.path.join(self.tmp, "wheelhouse")
        os.makedirs(self.wheelhouse)

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def fetch_tool(self) -> None:
        if os.path.isdir(self.tool):
            return  # fetched once per step
        archive = os.path.join(self.tmp, "tool.tar")
        size = download(f"{self.server}/tool.tar", archive)
        with tarfile.open(archive) as tar:
            if sys.version_info >= (3, 12):
                tar.extractall(self.tool, filter="data")
            else:
                tar.extractall(self.tool)
        os.unlink(archive)
        with open(os.path.join(self.tool, "BWSTACK_TOOL.json"), encoding="utf-8") as handle:
            info = json.load(handle)
        want = os.environ.get("BWSTACK_TOOL_DIGEST")
        if want and want != info["digest"]:
            raise SystemExit(
                f"bwstack-step: the build server's bwstack is {info['digest']}, the build args say {want}: "
                "refusing to run another bwstack than the one this build was planned with"
            )
        digest = info["digest"][:19]
        log(f"bwstack {info['bwstack_version']} (tool digest {digest}, {size >> 20} MiB), uv {info['uv_version']}")

    def fetch_wheels(self, files: list[str]) -> None:
        start = time.monotonic()

        def one(name: str) -> int:
            return download(f"{self.server}/wheels/{urllib.parse.quote(name)}", os.path.join(self.wheelhouse, name))

        with ThreadPoolExecutor(max_workers=4) as pool:
            total = sum(pool.map(one, files))
        log(
            f"fetched {len(files)} wheels ({total >> 20} MiB) from the build server in {time.monotonic() - start:.1f} s"
        )

    def bwstack(self, *args: str, capture: bool = False) -> str:
        env = dict(os.environ)
        env["PYTHONPATH"] = self.tool
        env["PATH"] = os.path.join(self.tool, "bin") + os.pathsep + env.get("PATH", "/usr/bin:/bin")
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # for bwstack itself; uv compiles the env's own bytecode
        env["UV_COMPILE_BYTECODE"] = "1"  # the runtime user cannot write __pycache__ into the root-owned env
        env.pop("PYTHONHOME", None)
        log("bwstack " + " ".join(args))
        result = subprocess.run(
            [sys.executable, "-m", "bwstack", *args], env=env, check=False, text=True,
            stdout=subprocess.PIPE if capture else None,
        )  # fmt: skip
        if result.returncode != 0:
            raise SystemExit(f"bwstack-step: bwstack {' '.join(args[:2])} failed (exit {result.returncode})")
        return result.stdout or ""


def step_layer(step: Step, requirements: str) -> None:
    lines = requirement_files(step, requirements)
    if not lines:
        log(f"{requirements}: no packages in this layer")
        return
    env = os.environ.get("BWSTACK_ENV", "/opt/ml-env")
    allowed = set(os.environ.get("BWSTACK_ALLOW_UNHASHED", "").split())
    unhashed = {name for name, _, hashed in lines if not hashed}
    step.fetch_wheels([f for _, f, _ in lines])
    args = [
        "env", "install", "--requirements", requirements, "--into", env,
        "--wheelhouse", step.wheelhouse, "--offline",
        "--store", os.path.join(step.tmp, "store"), "--uv-cache", os.path.join(step.tmp, "uv-cache"),
        # Hard links from uv's cache (same filesystem, deleted at the end of this RUN): one write per file.
        "--link-mode", "hardlink",
        "--python-version", os.environ.get("BWSTACK_PYTHON", "3.12"),
    ]  # fmt: skip
    for name in sorted(allowed & unhashed):
        args += ["--allow-unhashed", name]
    step.bwstack(*args)


def step_toolkit(step: Step, keyfile: str) -> None:
    with open(keyfile, encoding="utf-8") as handle:
        key = json.load(handle)
    os.makedirs(TOOLKIT_ROOT, exist_ok=True)
    if os.path.lexists(BASE_CUDA):
        nvcc = os.path.join(BASE_CUDA, "bin", "nvcc")
        version = ""
        if os.path.exists(nvcc):
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
            version = out.strip().splitlines()[-1] if out.strip() else ""
        log(
            f"the base image has a CUDA toolkit at {BASE_CUDA} -> {os.path.realpath(BASE_CUDA)} "
            f"({version or 'no nvcc'}); not installing one (bwstack verify checks it against the lock)"
        )
        return
    home = key["home"]
    lines = requirement_files(step, os.path.join(os.path.dirname(keyfile), key["requirements"]))
    step.fetch_wheels([f for _, f, _ in lines])
    lock = os.path.join(step.tmp, "stack.lock.yaml")
    download(f"{step.server}/lock.yaml", lock)
    prefix = TOOLKIT_ROOT + home
    args = [
        "--lock", lock, "cuda", "install", "--profile", key["profile"], "--prefix", prefix,
        "--root", os.path.join(step.tmp, "root"), "--wheelhouse", step.wheelhouse, "--offline",
    ]  # fmt: skip
    # The toolkit's own share of the operator's --allow-unhashed (a build arg of this stage alone, so a change to
    # the env's names does not rebuild the toolkit).
    allowed = set(os.environ.get("BWSTACK_ALLOW_UNHASHED_TOOLKIT", "").split())
    for name in sorted(allowed & {name for name, _, hashed in lines if not hashed}):
        args += ["--allow-unhashed", name]
    step.bwstack(*args)
    link = os.path.join(TOOLKIT_ROOT, "usr", "local", "cuda")
    os.symlink(os.path.basename(home), link)
    log(f"CUDA {key['cuda_version']} from PyPI wheels at {home}; /usr/local/cuda -> {os.path.basename(home)}")


def step_patch(step: Step, env: str, patch_ids: list[str]) -> None:
    if not patch_ids:
        log("the profile lists no patches")
        return
    step.fetch_tool()
    args = ["patch", "apply", "--env", env, "--json"]
    for patch_id in patch_ids:
        args += ["--patch", patch_id]
    results = json.loads(step.bwstack(*args, capture=True))
    for result in results:
        log(f"{result['patch_id']}: {result['action']} ({result['package']} {result['version']})")
    # bwstack deletes the patched modules' stale bytecode; compile it again (the runtime user cannot).
    files = [f["path"] for r in results for f in r["files"]]
    code = (
        "import py_compile, site, sys, os; sp = site.getsitepackages()[0]; "
        "[py_compile.compile(os.path.join(sp, f), doraise=True) for f in sys.argv[1:]]"
    )
    subprocess.run([os.path.join(env, "bin", "python"), "-c", code, *files], check=True)


def main(argv: list[str]) -> None:
    if len(argv) < 1:
        raise SystemExit('usage: step.py (layer FILE | toolkit KEYFILE | patch ENV "ID ...")')
    if not os.environ.get("http_proxy"):
        raise SystemExit("bwstack-step: no http_proxy: run by `bwstack image build` only (it serves the build)")
    name, *rest = argv
    step = Step()
    try:
        if name == "layer" and len(rest) == 1:
            step_layer(step, rest[0])
        elif name == "toolkit" and len(rest) == 1:
            step_toolkit(step, rest[0])
        elif name == "patch" and len(rest) == 2:
            step_patch(step, rest[0], rest[1].split())
        else:
            raise SystemExit(f"bwstack-step: unknown step or arguments: {name} {rest}")
    finally:
        step.close()


if __name__ == "__main__":
    main(sys.argv[1:])
