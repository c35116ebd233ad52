"""Fixtures for the node checks: the lock (read here, on the controller) and one probe run per host.

The probe (bwstack.probe.main, shipped as a zipapp) runs on each target with the env's own Python
and reports facts as JSON; every test judges one fact against the lock and says what to do when it is wrong.
"""

from __future__ import annotations

import base64
import json
import shlex
from pathlib import Path

import pytest

from bwstack.checks.session import session_lock
from bwstack.checks.verify import HostUnavailable
from bwstack.fleet import probe_bundle
from bwstack.fsutil import atomic_write_text, new_file_mode
from bwstack.lock.model import Lock, Profile
from bwstack.probe import schema, waivers
from bwstack.probe.generation import GenerationFacts
from bwstack.probe.serveplan import node
from bwstack.serveplan import assemble, catalogue
from bwstack.serveplan.check import request_of

CHUNK = 60_000  # base64 characters per command: well under Linux's 128 KiB limit for one argument
_FACTS: dict[str, dict | HostUnavailable] = {}
_JOBS: dict[str, dict | None] = {}  # the serve-plan job each host's probe was given (its fix searches name it)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("bwstack")
    group.addoption("--stack-lock", default=None, help="stack.lock.yaml (default: bwstack's own)")
    group.addoption("--stack-profile", default=None, help="profile to check against (default: the env's own)")
    group.addoption("--stack-env", default=None, help="env path on the target (default: its ml-env)")
    group.addoption("--stack-capability", default=None, help="target GPU capability (default: the profile's)")
    group.addoption("--stack-facts-dir", default=None, help="write each host's probe facts here as JSON")
    group.addoption("--stack-no-runtime", action="store_true", help="skip the GPU runtime probes")
    group.addoption("--stack-no-imports", action="store_true", help="skip the import checks (static checks only)")
    group.addoption(
        "--stack-cold", action="store_true", help="read the env's files even when its sealed generation recorded them"
    )
    group.addoption(
        "--stack-no-remembered-waivers",
        action="store_true",
        help="ignore the waivers the node's store remembers (use only --stack-skip)",
    )
    group.addoption(
        "--stack-image-checks", action="store_true",
        help="also check the image of the docker://CONTAINER host (test_image.py; what `bwstack image verify` runs)",
    )  # fmt: skip
    group.addoption(
        "--stack-image-scan-ca", default=None, metavar="PEM",
        help="with --stack-image-checks: also search the image's layers for the certificates in PEM",
    )  # fmt: skip
    group.addoption(
        "--stack-skip", action="append", default=[], metavar="CHECK=REASON",
        help="skip checks whose name contains CHECK, showing REASON (the operator's waiver; listed as SKIP)",
    )  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "image: a check of the host's container image (needs --stack-image-checks)")
    config.addinivalue_line("markers", "image_scan_ca: searches the image's layers (needs --stack-image-scan-ca)")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Facts are per run: `bwstack verify` may run the checks several times in one process."""
    _FACTS.clear()
    _JOBS.clear()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        given = waivers.parse_all(config.getoption("--stack-skip"))
    except ValueError as exc:
        raise pytest.UsageError(f"--stack-skip {exc}") from None
    # The image checks belong to `bwstack image verify` (--stack-image-checks): any other run leaves them out
    # rather than listing them as skipped, so a node's report is what it was.
    wanted = {
        "image": bool(config.getoption("--stack-image-checks")),
        "image_scan_ca": bool(config.getoption("--stack-image-checks") and config.getoption("--stack-image-scan-ca")),
    }
    left_out = [item for item in items if any(item.get_closest_marker(m) and not on for m, on in wanted.items())]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]
    for item in items:
        waiver = waivers.matching(given, item.name)
        if waiver is not None:
            item.add_marker(pytest.mark.skip(reason=waiver.message()))


@pytest.fixture(scope="session")
def lock(request: pytest.FixtureRequest) -> Lock:
    return session_lock(request.config)


def _run(host, command: str, expect_ok: bool = True):
    """host.run, with the transport's failures (testinfra raises the raw CommandResult when ssh exits 255)
    turned into one line naming the host."""
    name = host.backend.get_pytest_id()
    try:
        result = host.run(command)
    except Exception as exc:
        got = exc.args[0] if exc.args else exc
        lines = [line for line in (getattr(got, "stderr", "") or str(got)).strip().splitlines() if line.strip()]
        raise HostUnavailable(f"lost the connection to {name}: {lines[-1] if lines else type(exc).__name__}") from None
    if expect_ok and result.rc != 0:
        lines = [line for line in (result.stderr or result.stdout).strip().splitlines() if line.strip()]
        raise HostUnavailable(f"{command.split()[0]} failed on {name}: {lines[-1] if lines else f'exit {result.rc}'}")
    return result


# The probe's folder on the node: the connecting user's own, which no other user can write. In a shared one
# (/tmp) another user could leave a file under the probe's name for root to run. The folder must be a real
# directory of the user's, mode 0700; a probe found there runs only if it is the user's regular file with the
# bundle's hash, else a fresh copy replaces it. Prints the probe's path, then "ok" or "upload".
_PLACE = """umask 077; d="${{HOME:?is not set}}/.cache/bwstack"; mkdir -p "$d" || exit 3
if [ -L "$d" ] || [ ! -d "$d" ] || [ ! -O "$d" ]; then echo "$d is not a directory of $(id -un)'s own" >&2; exit 3; fi
chmod 0700 "$d" || exit 3
f="$d/{name}"; printf '%s\\n' "$f"
if [ ! -L "$f" ] && [ -f "$f" ] && [ -O "$f" ] && printf '%s  %s\\n' {sha} "$f" | sha256sum -c --status; then
  echo ok; else echo upload; fi"""


def _upload(host, data: bytes, remote: str) -> None:
    """Into a new file of the private folder (mktemp), renamed over `remote` once whole."""
    encoded = base64.b64encode(data).decode()
    folder = shlex.quote(str(Path(remote).parent))
    tmp = _run(host, f"mktemp {folder}/.upload.XXXXXXXX").stdout.strip()
    for start in range(0, len(encoded), CHUNK):
        _run(host, f"printf %s {encoded[start : start + CHUNK]} >> {shlex.quote(tmp)}")
    _run(
        host,
        f"base64 -d {shlex.quote(tmp)} > {shlex.quote(tmp)}.pyz && mv -f {shlex.quote(tmp)}.pyz "
        f"{shlex.quote(remote)}; rm -f {shlex.quote(tmp)}",
    )


def _remote_probe(host) -> str:
    """The probe's path on the node, uploaded there unless the user's own copy with its hash is there already."""
    name = f"bwstack-probe-{probe_bundle.digest()}.pyz"
    # One line each (a home folder's name may hold spaces): the probe's path, then "ok" or "upload".
    placed = _run(host, "sh -c " + shlex.quote(_PLACE.format(name=name, sha=probe_bundle.sha256()))).stdout
    placed = placed.rstrip("\n").split("\n")
    if len(placed) != 2 or placed[1] not in ("ok", "upload"):
        raise HostUnavailable(f"cannot place the probe on {host.backend.get_pytest_id()}: {' '.join(placed)[:200]}")
    remote, state = placed
    if state == "upload":
        _upload(host, probe_bundle.build(), remote)
    return remote


# Runs the probe from the bytes it hashed: the file is read once, checked against the bundle's sha256 and run
# from a private in-memory copy (memfd), so nothing that changes the file after the check (whoever could write a
# folder above it) changes what runs.
_BOOTSTRAP = """import hashlib, os, runpy, sys
path, want = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
with os.fdopen(fd, "rb") as handle:
    data = handle.read(64 << 20)
if hashlib.sha256(data).hexdigest() != want:
    sys.exit(path + ": not the probe bwstack placed there (it changed after it was placed); run again")
copy = os.memfd_create("bwstack-probe")
os.write(copy, data)
sys.argv = [path] + sys.argv[3:]
runpy.run_path("/proc/self/fd/%d" % copy, run_name="__main__")
"""


def _probe_command(python: str, remote: str, args: list[str]) -> str:
    # -I: with -c, Python puts the working directory first on sys.path, where anyone who can write it could
    # leave a hashlib.py for root to import.
    words = [python, "-I", "-c", _BOOTSTRAP, remote, probe_bundle.sha256(), *args]
    return " ".join(shlex.quote(w) for w in words)


def _python(host, env: str | None) -> str:
    python_cmd = (
        f"p={shlex.quote(env or '')}/bin/python; "
        'if [ -n "$p" ] && [ -x "$p" ]; then echo $p; else command -v python3; fi'
    )
    return _run(host, python_cmd).stdout.strip() or "python3"


def serve_plan_job(profile: Profile, requests: list[dict]) -> dict:
    """The probe's serve-plan job: the profile's hardware target (simulated unless the node has it) and models."""
    target = profile.target
    device = {
        "mode": "auto",
        "capability": target.capability,
        "count": target.count,
        "memory_mib": target.memory_gb * 1024,
        "name": target.gpu_name,
        "interconnect": target.interconnect,
    }
    # What a fix search may ask for, planned beside the models when the node remembers nothing of an earlier one.
    return {"device": device, "requests": requests, "speculate": assemble.speculation(catalogue.load())}


def _facts_of(host, result, what: str, read=None) -> dict:
    """The document a probe command printed; `read` parses and checks it (schema.parse for the probe's facts)."""
    where = host.backend.get_pytest_id()
    if result.rc != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        why = lines[-1][:400] if lines else "no error output"
        raise HostUnavailable(f"{what} failed on {where} (exit {result.rc}): {why}")
    if read is not None:
        try:
            return read(result.stdout, where)
        except schema.FactsError as exc:
            raise HostUnavailable(str(exc)) from None
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise HostUnavailable(f"{what} printed no facts on {where}") from None


def collect(host, config: pytest.Config, capability: str, serve_plan: dict | None = None) -> dict:
    remote = _remote_probe(host)
    env = config.getoption("--stack-env")
    args = ["--capability", capability]
    if env:
        args += ["--env", env]
    if config.getoption("--stack-no-runtime"):
        args.append("--no-runtime")
    if config.getoption("--stack-no-imports"):
        args.append("--no-imports")
    if config.getoption("--stack-cold"):
        args.append("--cold")
    if serve_plan:
        args += ["--serve-plan", json.dumps(serve_plan)]
    python = _python(host, env)
    command = _probe_command(python, remote, args)
    return _facts_of(host, _run(host, command, expect_ok=False), "the bwstack probe", read=schema.parse)


def _serve_plan_command(host, config: pytest.Config, env_path: str, job: dict) -> str:
    python = _python(host, config.getoption("--stack-env"))
    return _probe_command(python, _remote_probe(host), ["serve-plan", "--env", env_path, json.dumps(job)])


def run_serve_plan(host, config: pytest.Config, env_path: str, job: dict) -> dict:
    """Plan more requests on the node (the fix search plans the model again with candidate flags)."""
    command = _serve_plan_command(host, config, env_path, job)
    return _facts_of(host, _run(host, command, expect_ok=False), "serve-plan")


def remember_asked(host, config: pytest.Config, env_path: str, requests: list[dict], asked_after: dict) -> None:
    """Have the node remember what a fix search asked for after the verify job (no planning): its next probe
    plans that beside the job, and keeps it in the recorded plan of an unchanged generation. Best effort, as the
    node's own remembering is."""
    job = {"remember": requests, "hint_for": asked_after}
    try:
        _run(host, _serve_plan_command(host, config, env_path, job), expect_ok=False)
    except HostUnavailable:
        return  # the plans are in hand; the next probe call on this host says what went wrong


def _job_of(profile: Profile) -> dict | None:
    """The serve-plan job for the models a profile says a node must serve (None: it names none)."""
    models = [request_of(m, i) for i, m in enumerate(profile.expect.models)]
    return serve_plan_job(profile, models) if models else None


@pytest.fixture(scope="module")
def facts(host, request: pytest.FixtureRequest, lock: Lock) -> dict:
    key = host.backend.get_pytest_id()
    if key not in _FACTS:
        capability = request.config.getoption("--stack-capability")
        profile_name = request.config.getoption("--stack-profile")
        planned = lock.profile(profile_name)
        capability = capability or planned.expect.target_capability
        # Without --stack-profile the env is judged against the profile its generation was built from (the
        # `profile` fixture), which only the node knows: the probe gets each profile's job and plans that one.
        jobs = {p.name: _job_of(p) for p in ([planned] if profile_name else lock.profiles.values())}
        job = jobs[planned.name] if profile_name else {"by_profile": jobs, "default": lock.default_profile}
        try:
            _FACTS[key] = collect(host, request.config, capability, job)
        except HostUnavailable as exc:
            _FACTS[key] = exc  # every module of this host fails at once with it, not after another timeout
        else:
            _JOBS[key] = jobs.get(_FACTS[key].get("serve_plan_profile") or planned.name)
            out = request.config.getoption("--stack-facts-dir")
            if out:
                Path(out).mkdir(parents=True, exist_ok=True)
                # A new file put in place: a link already at that name is replaced, not written through (as root).
                atomic_write_text(
                    Path(out) / f"{key.replace('/', '_')}.json", json.dumps(_FACTS[key], indent=1), new_file_mode()
                )
    got = _FACTS[key]
    if isinstance(got, HostUnavailable):
        raise got
    return got


@pytest.fixture(autouse=True)
def _remembered_waivers(request: pytest.FixtureRequest, facts: dict) -> None:
    """The waivers the node's store remembers (written at provision time) apply as if given again."""
    if request.config.getoption("--stack-no-remembered-waivers"):
        return
    store = facts.get("env", {}).get("store") or {}
    if store.get("waivers_error"):
        pytest.fail(f"the node's remembered waivers are unreadable: {store['waivers_error']}")
    remembered = [waivers.Waiver(w["check"], w["reason"]) for w in store.get("waivers", [])]
    waiver = waivers.matching(remembered, request.node.name)
    if waiver is not None:
        request.node.user_properties.append(("note", f"waiver remembered by the node's store {store.get('root')}"))
        pytest.skip(waiver.message())


@pytest.fixture(scope="module")
def plan_again(host, request: pytest.FixtureRequest, facts: dict):
    """Plans changed requests on the same node and device as the probe's serve plan (for the fix search)."""
    observed = facts.get("serve_plan") or {}

    asked_after = _JOBS.get(host.backend.get_pytest_id())

    def run(requests: list[dict]) -> dict:
        planned = assemble.already_planned(observed, requests)  # the probe planned them beside the model
        if planned is not None:
            if asked_after is not None and any(
                str(r.get("id")).startswith(node.SPECULATED_PREFIX) for r in planned["requests"]
            ):
                # Planned early, as nothing was remembered: the node remembers what this search asked for.
                asked = [{k: v for k, v in r.items() if k != "id"} for r in requests]
                remember_asked(host, request.config, facts["env"]["path"], asked, asked_after)
            return planned
        job = {"device": observed["device"], "requests": requests, "hint_for": asked_after}
        reuse = (facts.get("facts_source") or {}).get("reuse")
        if reuse is not None:  # the probe found the generation unchanged moments ago: its check holds
            job["reuse"] = reuse
        return run_serve_plan(host, request.config, facts["env"]["path"], job)

    return run


@pytest.fixture(scope="module")
def profile(facts: dict, lock: Lock, request: pytest.FixtureRequest) -> Profile:
    """The profile named on the command line, else the one the env's generation was built from."""
    name = request.config.getoption("--stack-profile")
    if not name:
        gen = GenerationFacts.from_facts(facts.get("env", {}).get("generation"))
        name = (gen.profile_like if gen else None) or lock.default_profile
    return lock.profile(name)


@pytest.fixture(scope="module")
def env(facts: dict) -> dict:
    if not facts["env"].get("exists"):
        pytest.fail(
            f"no env at {facts['env']['path']} on this host: provision it (`bwstack provision`) or pass --stack-env"
        )
    return facts["env"]


@pytest.fixture(scope="module")
def gpu(facts: dict) -> dict:
    if not facts["gpu"]["present"]:
        pytest.skip(f"no GPU: {facts['gpu']['reason']}")
    return facts["gpu"]
