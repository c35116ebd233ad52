"""`bwstack image build|verify|bench-rebuild`: the serving image from the same lock, through the Docker SDK.

How a build works (docker/Dockerfile has the image side):

1. The build context is staged in a temporary directory, never the repository: the Dockerfile and what bwstack
   renders from the lock under inputs/: one hash-pinned requirement file per image layer (`bwstack render
   --layers`, minus its lock-digest header so an unchanged layer stays byte-identical), the lock's
   system_packages per OS, and the profile's cuda-toolkit requirements. A few KB, whatever the wheelhouse.
   A missing or stale closure (a pin edited without `bwstack lock`) is refused here, before anything else.
2. The wheels are found on the host, by file name in --wheelhouse directories, and every one found there is
   hashed against the lock before Docker is asked for anything: a bad wheel is refused in seconds, named by
   its path in the operator's wheelhouse, and no layer, container or image is made. The rest are downloaded
   into bwstack's wheel store (hash-checked, store entries re-hashed; --offline forbids downloads).
3. A short-lived server on the Docker bridge gateway feeds the build: the step script
   (docker/bwstack-step.py), bwstack itself (tool.tar: its code, its pure-Python dependencies and uv), the
   lock, the CA bundle if one was given, and exactly the wheels the rendered files name. Each RUN fetches what
   it needs into /tmp, runs the real bwstack command, which checks every sha256, and deletes it: no wheel, no
   bwstack, no CA in any layer, and a 4.8 GB wheelhouse never goes through the build context. The Dockerfile
   runs the step script only if its sha256 is the one bwstack computed (build arg BWSTACK_STEP_SHA256).
4. The server answers only its own build, which proves itself with a per-build secret (a fresh random token;
   see "The build's secret" below). Any other client on the bridge (another container, another build) gets
   403. The build runs through the Docker SDK (docker-py drives the classic builder). Build args (versions,
   lock digest, labels, the step script's sha256) are rendered here; none is secret.

The build's secret. A build arg that changes with every build would, with the classic builder, bust the cache
of every RUN after it and show in `docker history` (`|N ARG=value /bin/sh -c ...`). BuildKit's secret mounts
(`RUN --mount=type=secret`) avoid both, but docker-py cannot drive BuildKit (it has no BuildKit session), the
docker CLI needs the buildx plugin for it since Docker 23 (this project's build host has a CLI without it),
and the classic builder's cache model (intermediate images, --cache-from the previous chain) would have to
be replaced. What both builders do offer are the predefined proxy build args: Docker passes HTTP_PROXY,
http_proxy, HTTPS_PROXY, FTP_PROXY and NO_PROXY (upper and lower case) into every RUN's environment, leaves
them out of the layer cache key and out of `docker history`, by design, because proxy URLs carry credentials
(Dockerfile reference, "Predefined ARGs"; checked on this host's Docker 20.10: two builds with different
tokens share every cached layer, and the history has no trace of it). So the build server is an HTTP proxy
for one name that never resolves, http://bwstack-build.invalid/, and the build reaches it through
`http_proxy=http://bwstack:<token>@<bridge gateway>:<port>`: every RUN fetches from that name, urllib sends
the token as Proxy-Authorization, the server compares it in constant time and refuses anything else (a
missing or wrong token, another host, a plain request) with 403. The token lives for one build (the server
stops when the build ends), never enters a layer, the history or an image's config (the tests search
`docker save` output and every history entry for it), and the address, also in the proxy URL, no longer
needs a fixed port to keep the cache. Consequences: plain-http traffic of any RUN goes to that proxy, which
refuses it; the system stage's apt therefore reaches the distribution's archive through the operator's
HTTP_PROXY if the Docker client sets one, else directly. Whoever can use the Docker socket can read a running
build's environment, and so the token: that is root on the build host, for whom nothing here is secret.

`image verify` starts a container (entrypoint overridden to sleep), runs the same node checks as `bwstack
verify --target docker://...` plus image checks (non-root user, labels, history), and removes it.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import hmac
import http.server
import importlib.metadata
import io
import json
import os
import re
import secrets
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from bwstack import paths
from bwstack.errors import BwstackError, UsageError

TAG_TEMPLATE = "bwstack/sglang:{profile}-{digest}"
DEFAULT_BUILD_PORT = 0  # any free port: the address reaches the build in http_proxy, outside the cache key
# The name the build's RUN steps fetch from. `.invalid` never resolves (RFC 6761): only the build's proxy answers.
BUILD_HOST = "bwstack-build.invalid"
PROXY_USER = "bwstack"
ENV_PATH = "/opt/ml-env"
LABEL_PROFILE = "io.bwstack.profile"
LABEL_DIGEST = "io.bwstack.lock-digest"
LABEL_BASE = "org.opencontainers.image.base.name"
# What bwstack needs at build time inside the image (env install, cuda install, patch apply); the rest of its
# dependencies (docker, ansible-core, pytest, pyelftools, zstandard) serve other commands.
TOOL_DEPENDENCIES = ("packaging", "PyYAML", "requests", "urllib3", "idna", "certifi", "charset-normalizer")
# Modules that only run on the host: left out of the tool digest so editing them does not rebuild every layer.
HOST_ONLY = ("bwstack/image.py",)
LAYER_STEP_RE = re.compile(r"^COPY inputs/layers/(\S+) ", re.MULTILINE)
BUILD_TIMEOUT = 6 * 3600

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ locating


def docker_dir() -> Path:
    """docker/ of the checkout (Dockerfile, step script, CI base script), or $BWSTACK_DOCKER_DIR."""
    candidates = [os.environ.get("BWSTACK_DOCKER_DIR"), paths.in_checkout("docker")]
    for candidate in candidates:
        if candidate and (Path(candidate) / "Dockerfile").is_file():
            return Path(candidate)
    raise UsageError(
        "docker/Dockerfile not found: run bwstack from its checkout or set BWSTACK_DOCKER_DIR to its docker/"
    )


def dockerfile_layer_files(text: str) -> list[str]:
    """The per-layer requirement files the Dockerfile installs, in its order."""
    return LAYER_STEP_RE.findall(text)


def layer_file_names(lock) -> list[str]:
    return [f"{i:02d}-{layer.name}.txt" for i, layer in enumerate(lock.image_layers, 1)]


def image_tag(template: str, profile) -> str:
    digest = profile.lock_digest().split(":", 1)[1][:12]
    tag = template.format(profile=profile.name, digest=digest)
    if digest not in tag:
        raise UsageError(f"--tag {template!r}: the tag must carry the lock digest (use {{digest}})")
    return tag


# ------------------------------------------------------------------------------------------------ context


@dataclass
class StagedContext:
    path: Path
    layer_files: dict[str, str]  # file name -> text
    env_selection: dict  # name -> (LockedPackage, Wheel)
    toolkit_selection: dict


def _stable(text: str, header: str) -> str:
    """A rendered file without `bwstack render`'s lock-digest header (it changes with every lock edit, which
    would bust every layer's cache); its requirement lines and per-package notes stay as rendered."""
    body = [
        line
        for line in text.splitlines()
        if not line.startswith(("# bwstack: profile ", "# rendered from stack.lock.yaml"))
    ]
    return "\n".join([header, *body]) + "\n"


def stage_context(lock, profile, dest: Path, dockerfile: Path) -> StagedContext:
    """Write the build context: Dockerfile + inputs/ rendered from the lock."""
    from bwstack.lock import requirements
    from bwstack.lock.tags import Target
    from bwstack.provision.wheelhouse import select

    closure = profile.require_closure(lock.path)
    text = dockerfile.read_text(encoding="utf-8")
    want = layer_file_names(lock)
    have = dockerfile_layer_files(text)
    if have != want:
        raise UsageError(
            f"the lock's image.layers render to {', '.join(want)}, but {dockerfile} installs "
            f"{', '.join(have) or 'no layer files'}: give the Dockerfile one COPY + RUN per lock layer, in order"
        )
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "Dockerfile").write_text(text, encoding="utf-8")
    inputs = dest / "inputs"
    layers_dir = inputs / "layers"
    layers_dir.mkdir(parents=True, exist_ok=True)
    rendered = requirements.render_layers(profile, closure.env, lock.image_layers)
    layer_files = {}
    for i, (name, file_name) in enumerate(zip(rendered, want, strict=True), 1):
        header = (
            f"# bwstack image layer {i}/{len(rendered)} ({name}) of profile {profile.name}: hash-pinned, "
            "rendered from the lock (the image's lock digest is in its labels)"
        )
        layer_files[file_name] = _stable(rendered[name], header)
        (layers_dir / file_name).write_text(layer_files[file_name], encoding="utf-8")
    system = inputs / "system-packages"
    system.mkdir(parents=True, exist_ok=True)
    for os_id, packages in sorted(lock.system_packages.items()):
        (system / f"{os_id}.txt").write_text("".join(f"{p}\n" for p in packages), encoding="utf-8")
    toolkit = inputs / "toolkit"
    toolkit.mkdir(parents=True, exist_ok=True)
    cuda = profile.cuda
    header = f"# bwstack: CUDA {cuda.version} toolkit wheels of profile {profile.name} (bwstack cuda install)"
    (toolkit / "cuda-toolkit.txt").write_text(
        _stable(requirements.render(profile, closure.cuda_toolkit), header), encoding="utf-8"
    )
    key = {
        "profile": profile.name,
        "home": cuda.home,
        "cuda_version": cuda.version,
        "pip": {"version": cuda.pip_version, "components": list(cuda.pip_components)},
        "python": profile.python,
        "platform": profile.platform,
        "requirements": "cuda-toolkit.txt",
    }
    (toolkit / "toolkit.json").write_text(json.dumps(key, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    target = Target.of(profile)
    return StagedContext(dest, layer_files, select(closure.env, target), select(closure.cuda_toolkit, target))


# ------------------------------------------------------------------------------------------------ the tool


@dataclass
class ToolBundle:
    path: Path
    digest: str
    size: int


def _tool_files() -> Iterator[tuple[str, Path]]:
    """(name in the bundle, file on this host): bwstack's code and its build-time dependencies' pure-Python
    files (compiled extensions are left out: PyYAML and charset-normalizer fall back to pure Python, so the
    bundle runs on any CPython >= 3.10 whatever this host's Python is)."""
    import bwstack

    package = Path(bwstack.__file__).parent
    for path in sorted(package.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            yield f"bwstack/{path.relative_to(package).as_posix()}", path
    for dist_name in TOOL_DEPENDENCIES:
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise BwstackError(f"{dist_name} is not installed beside bwstack; reinstall bwstack") from None
        for rel in sorted(dist.files or (), key=str):
            parts = Path(str(rel)).parts
            if not parts or parts[0] == ".." or parts[0].endswith((".dist-info", ".data")):
                continue
            if "__pycache__" in parts or rel.suffix in (".so", ".pyc", ".pyd"):
                continue
            source = Path(dist.locate_file(rel))
            if source.is_file():
                yield Path(str(rel)).as_posix(), source


def build_tool_bundle(directory: Path, step_script: Path) -> ToolBundle:
    """tool.tar: what the build's RUN steps run (`python3.12 -m bwstack ...` with PYTHONPATH on it)."""
    from bwstack import __version__
    from bwstack.provision.uvtool import uv_bin, uv_version

    entries = list(_tool_files())
    entries.append(("bin/uv", Path(uv_bin())))
    digest = hashlib.sha256()
    for name, path in sorted(entries):
        if name not in HOST_ONLY:
            digest.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    digest.update(b"step.py\0" + hashlib.sha256(step_script.read_bytes()).digest())
    info = {
        "bwstack_version": __version__,
        "uv_version": uv_version(),
        "digest": "sha256:" + digest.hexdigest(),
        "dependencies": {d: importlib.metadata.version(d) for d in TOOL_DEPENDENCIES},
    }
    out = directory / "tool.tar"
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, path in sorted(entries):
            member = tar.gettarinfo(str(path), arcname=name)
            member.uid = member.gid = 0
            member.uname = member.gname = "root"
            member.mtime = 0
            member.mode = 0o755 if name.startswith("bin/") else 0o644
            with open(path, "rb") as handle:
                tar.addfile(member, handle)
        blob = json.dumps(info, indent=2).encode()
        member = tarfile.TarInfo("BWSTACK_TOOL.json")
        member.size = len(blob)
        tar.addfile(member, io.BytesIO(blob))
    return ToolBundle(out, info["digest"], out.stat().st_size)


# ------------------------------------------------------------------------------------------------ build server


def new_build_token() -> str:
    """A fresh per-build secret (256 bits, URL-safe: it sits in the userinfo of a proxy URL)."""
    return secrets.token_urlsafe(32)


class BuildServer:
    """Serves one build's inputs to its RUN steps on the Docker bridge, for the length of that build.

    It is an HTTP proxy for http://bwstack-build.invalid/ only, and answers only requests that carry the build's
    token as `Proxy-Authorization: Basic` (user "bwstack"): a missing or wrong token, a request for any other
    host and a plain (non-proxy) request get 403, counted in `refused`. Only named routes exist: /step.py,
    /tool.tar, /lock.yaml, /ca.pem (when a CA bundle was given) and /wheels/<file> for the wheels the rendered
    requirement files name; anything else is 404.
    """

    def __init__(self, host: str, port: int, files: Mapping[str, Path], blobs: Mapping[str, bytes], token: str) -> None:
        if not token:
            raise ValueError("the build server needs a token")
        self.host = host
        self.port = port
        self.files = dict(files)
        self.blobs = dict(blobs)
        self.requests = 0
        self.bytes_sent = 0
        self.refused = 0
        self._token = token
        self._expected = "Basic " + base64.b64encode(f"{PROXY_USER}:{token}".encode()).decode()
        self._lock = threading.Lock()
        self._httpd: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Where the server listens (no secret in it)."""
        return f"http://{self.host}:{self.port}"

    @property
    def proxy_url(self) -> str:
        """The secret: what the build's RUN steps get as http_proxy (see build_secret_args)."""
        return f"http://{PROXY_USER}:{self._token}@{self.host}:{self.port}"

    def _authorized(self, request: http.server.BaseHTTPRequestHandler) -> tuple[str | None, str]:
        """(the route, "") for a request of this build, else (None, why it is refused)."""
        given = request.headers.get("Proxy-Authorization") or ""
        if not hmac.compare_digest(given.encode(), self._expected.encode()):
            return None, "no valid build token"
        target = urllib.parse.urlsplit(request.path)
        if target.scheme != "http" or target.netloc != BUILD_HOST:
            return None, f"this proxy serves http://{BUILD_HOST}/ only"
        return urllib.parse.unquote(target.path), ""

    def _handler(self):
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, format: str, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(head=True)

            def do_GET(self) -> None:
                self._serve(head=False)

            def _serve(self, head: bool) -> None:
                route, why = server._authorized(self)
                if route is None:
                    with server._lock:
                        server.refused += 1
                    self.send_error(403, f"refused by bwstack image build: {why}")
                    return
                blob = server.blobs.get(route)
                path = server.files.get(route)
                if blob is None and path is None:
                    self.send_error(404, "not served by bwstack image build")
                    return
                size = len(blob) if blob is not None else path.stat().st_size
                if not head:
                    with server._lock:  # counted before the answer, so a client that has it sees the count
                        server.requests += 1
                        server.bytes_sent += size
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size))
                self.end_headers()
                if head:
                    return
                if blob is not None:
                    self.wfile.write(blob)
                else:
                    self.wfile.flush()
                    with open(path, "rb") as handle:
                        self.connection.sendfile(handle)

        return Handler

    def __enter__(self) -> BuildServer:
        try:
            self._httpd = http.server.ThreadingHTTPServer((self.host, self.port), self._handler())
        except OSError as exc:
            raise BwstackError(
                f"cannot serve the build on {self.host}:{self.port} ({exc.strerror}): the port is taken, or the "
                "Docker daemon is not on this host; pass another --build-port (0: any free port)"
            ) from None
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="bwstack-build-server", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()


def build_secret_args(server: BuildServer) -> dict[str, str]:
    """The build args that carry the secret: only `http_proxy`, which Docker passes to every RUN but keeps out
    of the cache key and `docker history` (it is a predefined proxy arg, and the Dockerfile must never declare
    it with ARG, which would put it in both). Never logged, never returned."""
    return {"http_proxy": server.proxy_url}


# ------------------------------------------------------------------------------------------------ docker


def docker_client(timeout: int = BUILD_TIMEOUT):
    """A Docker SDK client for the daemon of DOCKER_HOST (default: the local socket), or a clear error."""
    try:
        import docker
        from docker.errors import DockerException
    except ImportError:
        raise BwstackError("the `docker` Python package is not installed (pip install 'docker>=7')") from None
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except DockerException as exc:
        raise BwstackError(
            f"no Docker daemon reachable ({str(exc).splitlines()[0][:200]}): start dockerd (or set DOCKER_HOST)"
        ) from None
    return client


def daemon_available() -> tuple[bool, str]:
    try:
        docker_client(timeout=10)
        return True, ""
    except BwstackError as exc:
        return False, str(exc)


def bridge_gateway(client) -> str:
    """The host's address on Docker's default bridge: what the build's RUN containers reach the host at."""
    try:
        config = client.networks.get("bridge").attrs["IPAM"]["Config"] or []
    except Exception as exc:  # docker.errors.NotFound, APIError
        raise BwstackError(f"the Docker daemon has no default bridge network ({exc})") from None
    for entry in config:
        if entry.get("Gateway"):
            return entry["Gateway"]
        if entry.get("Subnet"):
            import ipaddress

            return str(next(ipaddress.ip_network(entry["Subnet"]).hosts()))
    raise BwstackError("the Docker bridge network has no gateway address")


def ensure_image(client, name: str, log: Log) -> None:
    from docker.errors import ImageNotFound

    try:
        client.images.get(name)
    except ImageNotFound:
        log(f"pulling {name} ...")
        try:
            client.images.pull(name)
        except Exception as exc:
            raise BwstackError(f"base image {name} is not here and cannot be pulled: {exc}") from None


def base_has_cuda(client, base: str) -> bool:
    out = client.containers.run(
        base, entrypoint=["/bin/sh", "-c"], command=["if [ -e /usr/local/cuda ]; then echo yes; else echo no; fi"],
        remove=True, network_disabled=True,
    )  # fmt: skip
    return out.decode().strip().endswith("yes")


def git_revision() -> str:
    root = paths.checkout()
    if root is None or not (root / ".git").exists():
        return ""
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=30,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return f"{rev}{'-dirty' if dirty else ''}" if rev else ""


# ------------------------------------------------------------------------------------------------ wheels


def check_wheelhouses(selected: Iterable[tuple], wheelhouses: Iterable[Path | str]) -> dict[str, Path]:
    """file name -> the operator's file, for every selected wheel found (by name) in a wheelhouse, each hashed
    against the lock now, in parallel: a bad one is refused, named by its path in the wheelhouse, before
    Docker is asked for anything. Wheels the lock has no hash for are returned unchecked (gather_wheels
    refuses them unless allowed by name)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from bwstack.provision.wheelhouse import check_wheel_file

    found: dict[str, tuple] = {}
    houses = [Path(h) for h in wheelhouses]
    for pkg, wheel in selected:  # (LockedPackage, Wheel) pairs, as select() gives them
        for house in houses:
            candidate = house / wheel.file
            if candidate.is_file():  # a link to a wheel counts; a FIFO or a directory of that name does not
                found[wheel.file] = (pkg, wheel, candidate)
                break

    def check(item: tuple) -> None:
        pkg, wheel, candidate = item
        if wheel.sha256 is not None:
            check_wheel_file(pkg, wheel, candidate, str(candidate))

    pool = ThreadPoolExecutor(max_workers=4)
    try:
        for done in as_completed([pool.submit(check, item) for item in found.values()]):
            done.result()  # the first bad wheel refuses the build; what is still queued is dropped
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return {name: candidate.resolve() for name, (_, _, candidate) in found.items()}


def gather_wheels(
    selection: Mapping,
    wheelhouses: Iterable[Path | str],
    *,
    offline: bool,
    store: Path,
    allow_unhashed: Iterable[str],
    log: Log,
    checked: Mapping[str, Path] | None = None,
) -> dict[str, Path]:
    """file name -> a local file for every selected wheel: from a wheelhouse (by name, hash-checked by
    check_wheelhouses unless `checked` is its result already), else downloaded into the store (hash-checked;
    store entries re-hashed). Refuses unhashed wheels not allowed by name."""
    from bwstack.provision.wheelhouse import Fetcher, Sources

    allowed = set(allow_unhashed)
    unknown = allowed - set(selection)
    if unknown:
        raise UsageError(f"--allow-unhashed {', '.join(sorted(unknown))}: not in this profile's closure")
    refused = sorted(n for n, (_, w) in selection.items() if w.sha256 is None and n not in allowed)
    if refused:
        raise BwstackError(
            f"the lock has no sha256 for {', '.join(refused)}; refusing to build with unverified wheels "
            f"(pass --allow-unhashed {' --allow-unhashed '.join(refused)} to accept them knowingly)"
        )
    if checked is None:
        checked = check_wheelhouses(selection.values(), wheelhouses)
    found: dict[str, Path] = {}
    missing = {}
    for name, (pkg, wheel) in selection.items():
        if wheel.file in checked:
            found[wheel.file] = checked[wheel.file]
        else:
            missing[name] = (pkg, wheel)
    if missing and offline:
        listed = ", ".join(sorted(w.file for _, w in missing.values())[:6]) + (" ..." if len(missing) > 6 else "")
        raise BwstackError(
            f"--offline: {len(missing)} wheel(s) are in no --wheelhouse ({listed}); "
            "fill one with `bwstack fetch --profile P --part all --dest DIR`"
        )
    if missing:
        log(f"downloading {len(missing)} wheel(s) into {store} (hash-checked) ...")
        fetcher = Fetcher(store, Sources(), allowed & set(missing), log=log, rehash_store=True)
        for wheel in fetcher.fetch_all(missing).values():
            found[wheel.file] = wheel.path
    return found


# ------------------------------------------------------------------------------------------------ build


@dataclass
class BuildOptions:
    wheelhouses: list[str] = field(default_factory=list)
    offline: bool = False
    ca_bundle: str | None = None
    tag: str | None = None
    base_image: str | None = None
    allow_unhashed: list[str] = field(default_factory=list)
    no_cache: bool = False
    port: int = DEFAULT_BUILD_PORT
    store: str | None = None
    context_dir: str | None = None
    cache_from: list[str] = field(default_factory=list)


@dataclass
class Step:
    number: int
    instruction: str
    cached: bool = False
    seconds: float = 0.0


def _build_args(lock, profile, base: str, step_sha256: str, tool: ToolBundle, allow: Iterable[str]) -> dict:
    """The build's public args: in the cache key and `docker history`, so nothing secret and nothing that
    changes from one build of the same lock to the next (except the labels' creation time, used last)."""
    from bwstack import __version__
    from bwstack.cli.show import stack_versions

    versions = stack_versions(profile)
    return {
        "BASE_IMAGE": base,
        "BWSTACK_STEP_SHA256": step_sha256,
        "BWSTACK_TOOL_DIGEST": tool.digest,
        "BWSTACK_PYTHON": profile.python,
        "BWSTACK_ALLOW_UNHASHED": " ".join(sorted(allow)),
        "BWSTACK_PATCHES": " ".join(profile.patches),
        "BWSTACK_FLASHINFER_ARCH": f"{profile.expect.target_capability}a",
        "BWSTACK_PROFILE": profile.name,
        "BWSTACK_LOCK_DIGEST": profile.lock_digest(),
        "BWSTACK_VERSION": __version__,
        "BWSTACK_REVISION": git_revision(),
        "BWSTACK_CREATED": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "BWSTACK_VERSION_CUDA": versions.get("cuda", ""),
        "BWSTACK_VERSION_TORCH": versions.get("torch", ""),
        "BWSTACK_VERSION_SGL_KERNEL": versions.get("sgl-kernel", ""),
        "BWSTACK_VERSION_FLASHINFER": versions.get("flashinfer", ""),
        "BWSTACK_VERSION_SGLANG": versions.get("sglang", ""),
    }


def run_build(
    client, context: Path, tag: str, buildargs: dict, *, no_cache: bool, log: Log, cache_from: list[str] | None = None
) -> tuple[str, list[Step], list[str]]:
    """docker-py's build (the classic builder), streamed: (image id, steps with timings and cache hits, the
    image that ends each build stage: what a later build's --cache-from needs, every stage's, not only the
    last one's, or the classic builder rebuilds the toolkit stage)."""
    from docker.errors import APIError

    steps: list[Step] = []
    stage_images: list[str] = []
    current = None
    started = time.monotonic()
    image_id = None
    last_line = ""
    try:
        stream = client.api.build(
            path=str(context), tag=tag, buildargs=buildargs, rm=True, forcerm=True, pull=False,
            nocache=no_cache, decode=True, cache_from=cache_from or None,
        )  # fmt: skip
        for chunk in stream:
            if "error" in chunk:
                raise BwstackError(f"image build failed: {chunk['error'].strip()[-1500:]}")
            if "aux" in chunk and isinstance(chunk["aux"], dict) and chunk["aux"].get("ID"):
                image_id = chunk["aux"]["ID"]
            text = chunk.get("stream") or ""
            for line in text.splitlines():
                now = time.monotonic()
                match = re.match(r"^Step (\d+)/(\d+) : (.*)$", line)
                if match:
                    if steps:
                        steps[-1].seconds = round(now - started, 2)
                    started = now
                    steps.append(Step(int(match.group(1)), match.group(3)))
                    if match.group(3).startswith("FROM ") and current:
                        stage_images.append(current)
                    current = None
                elif line.strip() == "---> Using cache" and steps:
                    steps[-1].cached = True
                elif re.match(r"^ ---> [0-9a-f]{12}$", line):
                    current = line.split()[-1]
                if line.strip():
                    last_line = line
                    log(line.rstrip())
    except APIError as exc:
        raise BwstackError(f"image build failed: {exc.explanation or exc}") from None
    if steps:
        steps[-1].seconds = round(time.monotonic() - started, 2)
    if image_id is None:
        match = re.search(r"Successfully built ([0-9a-f]+)", last_line)
        if not match:
            raise BwstackError(f"image build ended without an image: {last_line}")
        image_id = match.group(1)
    return image_id, steps, [*stage_images, image_id]


def _default_store() -> Path:
    from bwstack.store.generations import Layout

    return Layout.default().wheel_store


def build(lock, profile, opts: BuildOptions, log: Log = _stderr, *, token: str | None = None) -> dict:
    """Build the profile's serving image; returns what was built (tag, id, size, timings, cache hits).

    Everything that can be refused without Docker is refused first (the lock, the Dockerfile's layers, every
    wheel in the operator's wheelhouses); `token` is the build server's secret (default: a fresh one)."""
    if opts.ca_bundle and not Path(opts.ca_bundle).is_file():
        raise UsageError(f"--ca-bundle {opts.ca_bundle}: no such file")
    tag = image_tag(opts.tag or TAG_TEMPLATE, profile)
    docker = docker_dir()
    step_blob = (docker / "bwstack-step.py").read_bytes()  # read once: the bytes hashed are the bytes served
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bwstack-image-") as tmp:
        context = Path(opts.context_dir) if opts.context_dir else Path(tmp, "context")
        staged = stage_context(lock, profile, context, docker / "Dockerfile")
        every = [*staged.env_selection.values(), *staged.toolkit_selection.values()]
        checked = check_wheelhouses(every, opts.wheelhouses)
        if opts.ca_bundle:  # the host-side downloads use it too, like every bwstack command
            os.environ["REQUESTS_CA_BUNDLE"] = os.environ["SSL_CERT_FILE"] = str(Path(opts.ca_bundle).resolve())
        client = docker_client()
        base = opts.base_image or profile.cuda.docker_base
        ensure_image(client, base, log)
        has_cuda = base_has_cuda(client, base)
        log(
            f"base {base}: "
            + (
                "has /usr/local/cuda (used as is)"
                if has_cuda
                else f"no CUDA toolkit: CUDA {profile.cuda.version} from the lock's PyPI wheels"
            )
        )
        selection = dict(staged.env_selection)
        if not has_cuda:
            selection.update(staged.toolkit_selection)
        store = Path(opts.store) if opts.store else _default_store()
        wheels = gather_wheels(
            selection, opts.wheelhouses, offline=opts.offline, store=store,
            allow_unhashed=opts.allow_unhashed, log=log, checked=checked,
        )  # fmt: skip
        tool = build_tool_bundle(Path(tmp), docker / "bwstack-step.py")
        files = {f"/wheels/{name}": path for name, path in wheels.items()}
        files["/tool.tar"] = tool.path
        files["/lock.yaml"] = Path(lock.path).resolve()
        if opts.ca_bundle:
            files["/ca.pem"] = Path(opts.ca_bundle).resolve()
        blobs = {"/step.py": step_blob}
        allowed = set(opts.allow_unhashed)
        prepared = time.monotonic() - t0
        step_sha256 = hashlib.sha256(step_blob).hexdigest()
        server = BuildServer(bridge_gateway(client), opts.port, files, blobs, token or new_build_token())
        with server:
            args = _build_args(lock, profile, base, step_sha256, tool, allowed)
            log(f"building {tag} from {base}: {len(wheels)} wheels served at {server.url} ({tool.size >> 20} MiB tool)")
            t1 = time.monotonic()
            image_id, steps, stage_images = run_build(
                client, context, tag, {**args, **build_secret_args(server)}, no_cache=opts.no_cache, log=log,
                cache_from=opts.cache_from,
            )  # fmt: skip
            build_seconds = time.monotonic() - t1
            served = server.bytes_sent
            refused = server.refused
    if refused:
        log(f"the build server refused {refused} request(s) without this build's token")
    image = client.images.get(image_id)
    return {
        "tag": tag,
        "image_id": image.id,
        "profile": profile.name,
        "lock_digest": profile.lock_digest(),
        "base_image": base,
        "base_has_cuda": has_cuda,
        "size_bytes": image.attrs.get("Size"),
        "seconds": round(time.monotonic() - t0, 1),
        "prepare_seconds": round(prepared, 1),
        "build_seconds": round(build_seconds, 1),
        "steps": [s.__dict__ for s in steps],
        "cached_steps": sum(s.cached for s in steps),
        "stage_images": stage_images,
        "wheels": len(wheels),
        "bytes_served": served,
        "requests_refused": refused,
    }


# ------------------------------------------------------------------------------------------------ checks


def history_problems(history: list[dict]) -> list[str]:
    """What in an image's history looks like a CA, a key or a secret put into a layer or a build arg."""
    problems = []
    for entry in history:
        created_by = entry.get("CreatedBy") or ""
        if re.search(r"-----BEGIN [A-Z ]*(CERTIFICATE|PRIVATE KEY)", created_by):
            problems.append(f"PEM material in: {created_by[:120]}")
        if re.search(r"(ADD|COPY) .*\.(pem|crt|key|p12)\b", created_by, re.IGNORECASE):
            problems.append(f"a certificate or key file is copied in: {created_by[:160]}")
        if re.search(r"\b(SSL_CERT_FILE|REQUESTS_CA_BUNDLE|PIP_CERT|CURL_CA_BUNDLE)=", created_by):
            problems.append(f"a CA bundle setting is baked in: {created_by[:160]}")
        if re.search(r"_proxy=\S*://[^\s/@]*:[^\s/@]*@", created_by, re.IGNORECASE):
            problems.append("a proxy URL with credentials (e.g. a build token) is in the history")
    return problems


def image_checks(image_attrs: dict, history: list[dict], profile, lock_digest: str):
    from bwstack.checks.verify import CheckResult

    config = image_attrs.get("Config") or {}
    labels = config.get("Labels") or {}
    results = []
    user = (config.get("User") or "").split(":")[0]
    ok = user not in ("", "0", "root")
    results.append(CheckResult("image", "image_runs_as_a_non_root_user", "passed" if ok else "failed",
                               "" if ok else f"Config.User is {user or 'unset (root)'}"))  # fmt: skip
    have = labels.get(LABEL_DIGEST)
    ok = have == lock_digest and labels.get(LABEL_PROFILE) == profile.name
    results.append(CheckResult(
        "image", "image_labels_carry_the_lock_digest", "passed" if ok else "failed",
        "" if ok else f"labels say {labels.get(LABEL_PROFILE)} {have}; the lock's {profile.name} is {lock_digest}: "
        "the image was built from another lock (rebuild it, or verify with the lock it was built from)",
    ))  # fmt: skip
    problems = history_problems(history)
    results.append(CheckResult("image", "image_history_shows_no_ca_or_secret", "failed" if problems else "passed",
                               "; ".join(problems[:3])))  # fmt: skip
    entry = config.get("Entrypoint") or []
    ok = entry == [f"{ENV_PATH}/bin/python", "-m", "sglang.launch_server"]
    results.append(CheckResult("image", "image_entrypoint_is_sglang_launch_server", "passed" if ok else "failed",
                               "" if ok else f"Entrypoint is {entry}"))  # fmt: skip
    ok = bool((config.get("Healthcheck") or {}).get("Test"))
    results.append(CheckResult("image", "image_has_a_healthcheck", "passed" if ok else "failed",
                               "" if ok else "no HEALTHCHECK"))  # fmt: skip
    return results


class _StreamReader(io.RawIOBase):
    """A file object over docker-py's chunk generator (for streaming `docker save` through tarfile)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = iter(chunks)
        self._buffer = b""

    def readable(self) -> bool:
        return True

    def readinto(self, target) -> int:
        while not self._buffer:
            try:
                self._buffer = next(self._chunks)
            except StopIteration:
                return 0
        n = min(len(target), len(self._buffer))
        target[:n] = self._buffer[:n]
        self._buffer = self._buffer[n:]
        return n


class _HashingReader(io.RawIOBase):
    """Reads through a file object, hashing what passes (a saved layer's sha256 is its diff id)."""

    def __init__(self, raw) -> None:
        self._raw = raw
        self.digest = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, target) -> int:
        data = self._raw.read(len(target))
        self.digest.update(data)
        target[: len(data)] = data
        return len(data)

    def drain(self) -> None:
        while data := self._raw.read(1 << 20):
            self.digest.update(data)


def pem_needles(pem_text: str) -> list[bytes]:
    """One distinctive base64 line from each certificate in a PEM bundle (what a copy of it would contain)."""
    needles = []
    for block in re.findall(r"-----BEGIN CERTIFICATE-----\s+(.*?)-----END CERTIFICATE-----", pem_text, re.S):
        lines = [line.strip() for line in block.splitlines() if len(line.strip()) >= 48]
        if lines:
            needles.append(lines[len(lines) // 2].encode())
    return needles


def scan_image(client, image: str, needles: list[bytes], skip_layers: Iterable[str] = ()) -> list[str]:
    """Paths (layer diff id: file) of files in the image's layers that contain any needle; streams
    `docker save`, nothing is written to disk. Layers whose diff id is in skip_layers (the base) are ignored."""
    skip = set(skip_layers)
    hits: list[tuple[str, str]] = []
    if not needles:
        return []
    overlap = max(len(n) for n in needles)
    chunks = client.api.get_image(image)
    with tarfile.open(fileobj=io.BufferedReader(_StreamReader(chunks), 1 << 20), mode="r|") as outer:
        for member in outer:
            if not member.name.endswith("layer.tar"):
                continue
            layer = _HashingReader(outer.extractfile(member))
            layer_hits = []
            with tarfile.open(fileobj=io.BufferedReader(layer, 1 << 20), mode="r|") as inner:
                for item in inner:
                    if not item.isfile():
                        continue
                    handle = inner.extractfile(item)
                    tail = b""
                    while chunk := handle.read(1 << 20):
                        window = tail + chunk
                        if any(n in window for n in needles):
                            layer_hits.append(item.name)
                            break
                        tail = window[-overlap:]
            layer.drain()  # the rest of the layer, for its digest
            diff_id = "sha256:" + layer.digest.hexdigest()
            hits += [(diff_id, name) for name in layer_hits if diff_id not in skip]
    return [f"{d[:19]}: {n}" for d, n in hits]


# ------------------------------------------------------------------------------------------------ verify


def verify(
    lock,
    image: str,
    *,
    profile_name: str | None = None,
    skip: list[str] | None = None,
    runtime: bool = True,
    gpus: str | None = None,
    scan_ca: str | None = None,
    log: Log = _stderr,
):
    """Image checks + the node checks (tests/infra) run in a container of the image; the container is
    removed afterwards. Returns the CheckResults."""
    from docker.errors import ImageNotFound
    from docker.types import DeviceRequest

    from bwstack.checks import verify as node_verify
    from bwstack.checks.verify import CheckResult

    client = docker_client(timeout=600)
    try:
        img = client.images.get(image)
    except ImageNotFound:
        raise UsageError(f"no image {image} here (bwstack image build ...)") from None
    labels = (img.attrs.get("Config") or {}).get("Labels") or {}
    name = profile_name or labels.get(LABEL_PROFILE)
    if not name:
        raise UsageError(f"{image} has no {LABEL_PROFILE} label: pass --profile")
    profile = lock.profile(name)
    results = image_checks(img.attrs, client.api.history(img.id), profile, profile.lock_digest())
    if scan_ca:
        needles = pem_needles(Path(scan_ca).read_text(encoding="utf-8", errors="replace"))
        base_layers: list[str] = []
        with contextlib.suppress(Exception):
            base_layers = client.images.get(labels.get(LABEL_BASE, "")).attrs["RootFS"]["Layers"]
        hits = scan_image(client, img.id, needles, base_layers)
        message = "; ".join(hits[:5]) if hits else f"{len(needles)} certificate(s) searched"
        outcome = "failed" if hits else "passed"
        results.append(CheckResult("image", "image_layers_hold_no_copy_of_the_ca", outcome, message))
    device_requests = None
    if gpus:
        count = -1 if gpus == "all" else int(gpus)
        device_requests = [DeviceRequest(count=count, capabilities=[["gpu"]])]
    # no "-" in the name: the check report splits pytest ids at the first "-"
    container_name = f"bwstack_verify_{uuid.uuid4().hex[:12]}"
    container = client.containers.run(
        img.id, entrypoint=["sleep"], command=["infinity"], detach=True, name=container_name,
        labels={"io.bwstack.checks.verify": image}, device_requests=device_requests,
    )  # fmt: skip
    try:
        log(f"verifying {image} (profile {profile.name}) in container {container_name} ...")
        results += node_verify.run_checks(
            f"docker://{container_name}", lock_path=lock.path, profile=profile.name, env=ENV_PATH,
            runtime=runtime, skip=skip,
        )  # fmt: skip
    finally:
        container.remove(force=True)
    return results


# ------------------------------------------------------------------------------------------------ benchmark


def bench_rebuild(
    lock_a: str,
    lock_b: str,
    profile: str | None = None,
    *,
    opts: BuildOptions | None = None,
    log: Log = _stderr,
    out: Log = print,
) -> dict:
    """Clean build of lock A (no cache), then a build of lock B (an app-layer-only change of A, e.g. an
    sglang bump) on that cache; prints both times and their ratio, from one run each."""
    from bwstack.lock.model import load_lock

    first, second = load_lock(lock_a), load_lock(lock_b)
    prof_a, prof_b = first.profile(profile), second.profile(profile)
    with tempfile.TemporaryDirectory(prefix="bwstack-bench-") as tmp:
        dockerfile = docker_dir() / "Dockerfile"
        a = stage_context(first, prof_a, Path(tmp, "a"), dockerfile).layer_files
        b = stage_context(second, prof_b, Path(tmp, "b"), dockerfile).layer_files
    changed = [name for name in a if a[name] != b.get(name)]
    if changed != [list(a)[-1]]:
        log(f"WARNING: the two locks differ in layers {changed or 'none'}, not in the last (app) layer only")
    base = BuildOptions(**(opts.__dict__ if opts else {}))
    # lock B's wheels before the long clean build, so a missing one fails now, not ten minutes in
    store = Path(base.store) if base.store else _default_store()
    with tempfile.TemporaryDirectory(prefix="bwstack-bench-") as tmp:
        selection = stage_context(second, prof_b, Path(tmp), docker_dir() / "Dockerfile").env_selection
    gather_wheels(selection, base.wheelhouses, offline=base.offline, store=store,
                  allow_unhashed=base.allow_unhashed, log=log)  # fmt: skip
    clean = build(first, prof_a, BuildOptions(**{**base.__dict__, "no_cache": True}), log=log)
    _stderr(f"bench-rebuild: clean build of {clean['tag']}: {clean['build_seconds']:.1f} s")
    # B's cache is exactly A's chain (--cache-from): no intermediate image of an earlier run can serve B
    bump_opts = {**base.__dict__, "no_cache": False, "cache_from": clean["stage_images"]}
    bump = build(second, prof_b, BuildOptions(**bump_opts), log=log)
    ratio = bump["build_seconds"] / clean["build_seconds"] if clean["build_seconds"] else float("nan")
    rebuilt = [s["instruction"][:60] for s in bump["steps"] if not s["cached"] and s["instruction"].startswith("RUN")]
    result = {
        "profile": prof_a.name,
        "clean_build_seconds": clean["build_seconds"],
        "rebuild_seconds": bump["build_seconds"],
        "ratio": round(ratio, 4),
        "changed_layers": changed,
        "rebuilt_run_steps": rebuilt,
        "cached_steps": bump["cached_steps"],
        "steps": len(bump["steps"]),
        "clean_size_bytes": clean["size_bytes"],
        "clean_tag": clean["tag"],
        "bump_tag": bump["tag"],
    }
    out(
        f"image rebuild after an app-layer-only bump ({', '.join(changed)}), profile {prof_a.name}: "
        f"clean build {clean['build_seconds']:.1f} s, rebuild {bump['build_seconds']:.1f} s, "
        f"ratio {ratio:.3f} ({bump['cached_steps']}/{len(bump['steps'])} steps from cache; "
        f"{len(rebuilt)} RUN steps rebuilt)"
    )
    return result


# ------------------------------------------------------------------------------------------------ CLI


def _options(args: argparse.Namespace) -> BuildOptions:
    return BuildOptions(
        wheelhouses=list(args.wheelhouse or []),
        offline=args.offline,
        ca_bundle=args.ca_bundle,
        tag=args.tag,
        base_image=args.base_image,
        allow_unhashed=list(args.allow_unhashed or []),
        no_cache=getattr(args, "no_cache", False),
        port=args.build_port,
        store=args.store,
        context_dir=getattr(args, "context_dir", None),
        cache_from=list(getattr(args, "cache_from", None) or []),
    )


def cmd_build(args: argparse.Namespace) -> int:
    from bwstack.lock.model import load_lock

    lock = load_lock(args.lock)
    profile = lock.profile(args.profile)
    log = (lambda m: None) if args.quiet else _stderr
    result = build(lock, profile, _options(args), log=log)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        size = (result["size_bytes"] or 0) / (1 << 30)
        print(
            f"built {result['tag']} ({result['image_id'][:19]}, {size:.2f} GiB) in {result['seconds']:.0f} s; "
            f"{result['cached_steps']}/{len(result['steps'])} steps from cache"
        )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from bwstack.checks import verify as node_verify
    from bwstack.lock.model import load_lock

    results = verify(
        load_lock(args.lock), args.image, profile_name=args.profile, skip=args.skip,
        runtime=not args.no_runtime, gpus=args.gpus, scan_ca=args.scan_ca,
    )  # fmt: skip
    print(node_verify.as_json(results) if args.json else node_verify.render(results))
    return 0 if node_verify.ok(results) else 1


def cmd_bench(args: argparse.Namespace) -> int:
    result = bench_rebuild(args.lock, args.lock_b, args.profile, opts=_options(args),
                           log=(lambda m: None) if args.quiet else _stderr)  # fmt: skip
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    return 0


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535; 0: any free port)")
    return port


def _build_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", help="the lock's profile (default: its default_profile)")
    p.add_argument("--wheelhouse", action="append", help="directory of wheels, used first by file name (repeatable)")
    p.add_argument("--offline", action="store_true", help="use only --wheelhouse: download nothing")
    p.add_argument(
        "--ca-bundle",
        help="CA bundle for the host's downloads and apt inside the build; never kept in the image",
    )
    p.add_argument(
        "--tag",
        help="image tag; {profile} and {digest} are filled in (default: bwstack/sglang:{profile}-{digest})",
    )
    p.add_argument("--base-image", help="base image (default: the profile's cuda.docker_base)")
    p.add_argument(
        "--allow-unhashed",
        action="append",
        metavar="NAME",
        help="build with NAME although the lock has no sha256 for it",
    )
    p.add_argument(
        "--build-port",
        type=_port,
        default=DEFAULT_BUILD_PORT,
        help="port of the build's file server on the Docker bridge (default: any free port; the address "
        "reaches the build outside the layer cache key, so any port keeps the cache)",
    )
    p.add_argument(
        "--store", help=f"wheel store for downloads (default: bwstack's, e.g. {paths.DEFAULT_ROOT}/cache/wheels)"
    )
    p.add_argument("--quiet", action="store_true", help="do not stream the build's output")
    p.add_argument("--json", action="store_true")


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bwstack image build|verify|bench-rebuild`."""
    image = sub.add_parser("image", help="the serving image from the lock: build (Docker SDK), verify, bench-rebuild")
    isub = image.add_subparsers(dest="image_command", metavar="ACTION", required=True)

    p = isub.add_parser(
        "build", help="build the profile's SGLang image (offline from a wheelhouse, layer per lock layer)"
    )
    _build_flags(p)
    p.add_argument("--no-cache", action="store_true", help="rebuild every layer")
    p.add_argument(
        "--cache-from",
        action="append",
        metavar="IMAGE",
        help="use only IMAGE's layers (repeatable) as the build cache, e.g. the previous release",
    )
    p.add_argument("--context-dir", help="stage the build context here (kept) instead of a temporary directory")
    p.set_defaults(func=cmd_build)

    p = isub.add_parser("verify", help="run the node checks and image checks against a container of IMAGE")
    p.add_argument("image")
    p.add_argument("--profile", help="profile to check against (default: the image's io.bwstack.profile label)")
    p.add_argument(
        "--skip",
        action="append",
        metavar="CHECK=REASON",
        help="waive checks whose name contains CHECK, with the reason shown in the report",
    )
    p.add_argument("--no-runtime", action="store_true", help="skip the GPU runtime probes")
    p.add_argument("--gpus", help="give the container GPUs: all or a count (needs the NVIDIA container toolkit)")
    p.add_argument(
        "--scan-ca",
        metavar="PEM",
        help="also search every layer the build added for the certificates in PEM (streams docker save)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)

    p = isub.add_parser(
        "bench-rebuild",
        help="clean build of --lock, then rebuild with --lock-b (an app-only bump): times and ratio",
    )
    p.add_argument("--lock-b", required=True, help="the bumped lock (differs from --lock in the app layer only)")
    _build_flags(p)
    p.set_defaults(func=cmd_bench)


def sglang_only_bump(lock_path: str, profile: str, version: str, dest: Path) -> Path:
    """Lock A with closures.<profile>.env.sglang pointing at another sglang release's wheel."""
    import yaml

    from bwstack.lock import pypi
    from bwstack.lock.model import load_lock
    from bwstack.lock.resolve import render_lock_text

    lock = load_lock(lock_path)
    data = yaml.load(Path(lock_path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    entry = data["closures"][profile]["env"]["sglang"]
    files = [f for f in pypi.project_files(pypi.session(), lock.indexes["pypi"].url, "sglang")
             if f.filename == f"sglang-{version}-py3-none-any.whl"]  # fmt: skip
    if not files or not files[0].sha256:
        raise BwstackError(f"PyPI lists no sglang-{version}-py3-none-any.whl with a sha256")
    entry["version"] = version
    entry["wheels"] = [{"file": files[0].filename, "url": files[0].url, "sha256": files[0].sha256,
                        "hash_source": "pypi"}]  # fmt: skip
    dest.write_text(render_lock_text(lock, data["closures"]))
    return dest


CI_BASE_TAG = "bwstack-ci-base:bookworm-py312"


def ensure_bench_base() -> str:
    """The debootstrap base (docker/ci-base.sh: a test fixture, no CUDA, the host's Python 3.12), built if
    absent: the NVIDIA bases cannot be pulled where this project is built."""
    import subprocess

    import docker

    client = docker.from_env()
    try:
        client.images.get(CI_BASE_TAG)
    except docker.errors.ImageNotFound:
        result = subprocess.run(["bash", str(docker_dir() / "ci-base.sh")], capture_output=True, text=True)
        if result.returncode != 0:
            raise BwstackError(f"docker/ci-base.sh failed: {result.stderr.strip()[-400:]}") from None
    return CI_BASE_TAG
