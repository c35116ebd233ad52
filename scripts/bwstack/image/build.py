"""`bwstack image build`: the serving image of one lock profile, through the Docker SDK (docker/Dockerfile has the
image side). The build is orchestrated here; each concern lives in its own module:

1. context.py stages the build context in a temporary directory, never the repository: the Dockerfile and what
   bwstack renders from the lock under inputs/ (a few KB, whatever the wheelhouse).
2. wheels.py finds the wheels on the host and hashes every one found in --wheelhouse against the lock before
   Docker is asked for anything; the rest are downloaded into bwstack's wheel store (hash-checked).
3. daemon.py reads the base image (its /usr/local/cuda and /etc/os-release); Lock.system_packages_for picks the OS
   packages for that OS, and context.py writes them for the Dockerfile, which decides nothing.
4. server.py serves the build on the Docker bridge gateway: the step script (docker/bwstack-step.py), bwstack
   itself (tool.py's tool.tar: its code, its pure-Python dependencies and uv), the lock, the CA bundle if one
   was given, and exactly the wheels the rendered files name. Each RUN fetches what it needs into /tmp, runs
   the real bwstack command, which checks every sha256, and deletes it: no wheel, no bwstack, no CA in any
   layer. The server answers only its own build, which proves itself with a per-build secret (server.py, "The
   build's secret"). The Dockerfile runs the step script only if its sha256 is the one bwstack computed
   (build arg BWSTACK_STEP_SHA256).
5. labels.py renders the public build args (versions, lock digest, OCI labels, the step script's sha256); none
   is secret. run_build drives docker-py's classic builder and records each step's time and cache hit.

`bwstack image verify` is verify.py; `bwstack image bench-rebuild` is bench.py; the command line is cli.py.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bwstack.errors import BwstackError, UsageError
from bwstack.image import DEFAULT_BUILD_PORT, context, daemon, labels, server, tool, wheels
from bwstack.terminal import visible

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    import sys

    print(visible(message), file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ImageBuildOptions:
    """How to build the image (not to be confused with provision.build's options, which build an env)."""

    wheelhouses: tuple[str, ...] = ()
    offline: bool = False
    ca_bundle: str | None = None
    tag: str | None = None
    base_image: str | None = None
    allow_unhashed: tuple[str, ...] = ()
    no_cache: bool = False
    port: int = DEFAULT_BUILD_PORT
    store: str | None = None
    context_dir: str | None = None
    cache_from: tuple[str, ...] = ()

    def __post_init__(self) -> None:  # lists given by callers become tuples: the options do not change
        for name in ("wheelhouses", "allow_unhashed", "cache_from"):
            object.__setattr__(self, name, tuple(getattr(self, name) or ()))


@dataclass
class BuildStep:
    """One Dockerfile instruction as the builder ran it (filled in while the build streams)."""

    number: int
    instruction: str
    cached: bool = False
    seconds: float = 0.0


@dataclass(frozen=True)
class ImageBuildResult:
    """What `bwstack image build` built; as_dict() is its --json output."""

    tag: str
    image_id: str
    profile: str
    lock_digest: str
    base_image: str
    base_has_cuda: bool
    system_packages_os: str
    size_bytes: int | None
    seconds: float
    prepare_seconds: float
    build_seconds: float
    steps: tuple[BuildStep, ...]
    stage_images: tuple[str, ...]
    wheels: int
    bytes_served: int
    requests_refused: int
    cached_steps: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cached_steps", sum(s.cached for s in self.steps))

    def as_dict(self) -> dict:
        out = asdict(self)
        out["steps"] = [asdict(s) for s in self.steps]
        out["stage_images"] = list(self.stage_images)
        return out


def run_build(
    client, context_dir: Path, tag: str, buildargs: dict, *, no_cache: bool, log: Log,
    cache_from: tuple[str, ...] | list[str] | None = None,
) -> tuple[str, list[BuildStep], list[str]]:  # fmt: skip
    """docker-py's build (the classic builder), streamed: (image id, steps with timings and cache hits, the
    image that ends each build stage: what a later build's --cache-from needs, every stage's, not only the
    last one's, or the classic builder rebuilds the toolkit stage)."""
    from docker.errors import APIError

    steps: list[BuildStep] = []
    stage_images: list[str] = []
    current = None
    started = time.monotonic()
    image_id = None
    last_line = ""
    try:
        stream = client.api.build(
            path=str(context_dir), tag=tag, buildargs=buildargs, rm=True, forcerm=True, pull=False,
            nocache=no_cache, decode=True, cache_from=list(cache_from or ()) or None,
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
                    steps.append(BuildStep(int(match.group(1)), match.group(3)))
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


def build_image(
    lock, profile, opts: ImageBuildOptions, log: Log = _stderr, *, token: str | None = None
) -> ImageBuildResult:
    """Build the profile's serving image; returns what was built (tag, id, size, timings, cache hits).

    Everything that can be refused without Docker is refused first (the lock, the Dockerfile's layers, every
    wheel in the operator's wheelhouses); `token` is the build server's secret (default: a fresh one)."""
    if opts.ca_bundle and not Path(opts.ca_bundle).is_file():
        raise UsageError(f"--ca-bundle {opts.ca_bundle}: no such file")
    tag = context.image_tag(opts.tag or context.TAG_TEMPLATE, profile)
    files_of = context.docker_files()
    step_blob = files_of.step_script.read_bytes()  # read once: the bytes hashed are the bytes served
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bwstack-image-") as tmp:
        # Docker always reads the context from this private folder; --context-dir gets a copy of it (below).
        context_dir = Path(tmp, "context")
        if opts.context_dir:
            context.check_kept_context(Path(opts.context_dir))
        staged = context.stage_context(lock, profile, context_dir, files_of.dockerfile)
        every = [*staged.env_selection.values(), *staged.toolkit_selection.values()]
        checked = wheels.check_wheelhouses(every, opts.wheelhouses)
        if opts.ca_bundle:  # the host-side downloads use it too, like every bwstack command
            os.environ["REQUESTS_CA_BUNDLE"] = os.environ["SSL_CERT_FILE"] = str(Path(opts.ca_bundle).resolve())
        client = daemon.docker_client()
        base = opts.base_image or profile.cuda.docker_base
        daemon.ensure_image(client, base, log)
        facts = daemon.probe_base(client, base)
        picked = context.system_packages_of(lock, base, facts.os_release)
        context.write_system_packages(context_dir, picked)
        if opts.context_dir:
            context.keep_context(context_dir, Path(opts.context_dir))
        log(
            f"base {base} ({picked.entry}): "
            + (
                "has /usr/local/cuda (used as is)"
                if facts.has_cuda
                else f"no CUDA toolkit: CUDA {profile.cuda.version} from the lock's PyPI wheels"
            )
        )
        selection = dict(staged.env_selection)
        if not facts.has_cuda:
            selection.update(staged.toolkit_selection)
        store = wheels.private_store(opts.store)
        found = wheels.gather_wheels(
            selection, opts.wheelhouses, offline=opts.offline, store=store,
            allow_unhashed=opts.allow_unhashed, log=log, checked=checked,
        )  # fmt: skip
        bundle = tool.build_tool_bundle(Path(tmp), files_of.step_script)
        files = {f"/wheels/{name}": path for name, path in found.items()}
        files["/tool.tar"] = bundle.path
        files["/lock.yaml"] = Path(lock.path).resolve()
        if opts.ca_bundle:
            files["/ca.pem"] = Path(opts.ca_bundle).resolve()
        blobs = {"/step.py": step_blob}
        prepared = time.monotonic() - t0
        step_sha256 = hashlib.sha256(step_blob).hexdigest()
        serving = server.BuildServer(
            daemon.bridge_gateway(client), opts.port, files, blobs, token or server.new_build_token()
        )
        with serving:
            args = labels.build_args(lock, profile, base, step_sha256, bundle, opts.allow_unhashed)
            log(f"building {tag} from {base}: {len(found)} wheels served at {serving.url} "
                f"({bundle.size >> 20} MiB tool)")  # fmt: skip
            t1 = time.monotonic()
            image_id, steps, stage_images = run_build(
                client, context_dir, tag, {**args, **server.build_secret_args(serving)}, no_cache=opts.no_cache,
                log=log, cache_from=opts.cache_from,
            )  # fmt: skip
            build_seconds = time.monotonic() - t1
            served = serving.bytes_sent
            refused = serving.refused
    if refused:
        log(f"the build server refused {refused} request(s) without this build's token")
    image = client.images.get(image_id)
    return ImageBuildResult(
        tag=tag,
        image_id=image.id,
        profile=profile.name,
        lock_digest=profile.lock_digest(),
        base_image=base,
        base_has_cuda=facts.has_cuda,
        system_packages_os=picked.entry or "",
        size_bytes=image.attrs.get("Size"),
        seconds=round(time.monotonic() - t0, 1),
        prepare_seconds=round(prepared, 1),
        build_seconds=round(build_seconds, 1),
        steps=tuple(steps),
        stage_images=tuple(stage_images),
        wheels=len(found),
        bytes_served=served,
        requests_refused=refused,
    )
