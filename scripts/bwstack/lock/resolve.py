"""`bwstack lock`: resolve each profile's full closure with uv and record every wheel's sha256.

uv decides the versions (overrides applied, target Python and platform, PyPI only, wheels only, nothing
newer than `resolution.exclude_newer`). A package whose index this network cannot reach takes part through
a metadata-only stand-in wheel built from its static Requires-Dist in the spec, so its dependencies (the
CUDA 13 runtime wheels, triton, ...) are resolved here from PyPI and every constraint on it still counts.
Hashes come from the index's own listing of each file, or for stand-ins from the spec's cited references;
never from a download of ours and never made up.
"""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import requests
import yaml
from packaging.utils import canonicalize_name

from bwstack.errors import BusyError, BwstackError, UsageError
from bwstack.fsutil import atomic_write_text, new_file_mode
from bwstack.lock import pypi
from bwstack.lock.model import GENERATED_MARKER, HASH_SOURCE_PYPI, Lock, LockedPackage, Profile, Wheel
from bwstack.lock.tags import Target, applicable_requirements, requested_extras
from bwstack.lock.uvtool import run_uv, uv_env, uv_version


def write_stub_wheel(directory: Path, filename: str, name: str, version: str, requires_dist: Iterable[str]) -> Path:
    """A metadata-only wheel for the resolver: uv sees the package, its version and its Requires-Dist.

    It stands in for a wheel this network cannot download, so that every constraint other packages put on
    it (e.g. `compressed-tensors` wanting torch>=2.10) still takes part in the resolution. Never installed.
    """
    dist_info = f"{name.replace('-', '_')}-{version}.dist-info"
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    metadata += [f"Requires-Dist: {line}" for line in requires_dist]
    wheel = ["Wheel-Version: 1.0", "Generator: bwstack (resolver stand-in)", "Root-Is-Purelib: false"]
    if not filename or filename != Path(filename).name or filename.startswith("."):
        raise UsageError(f"{filename!r} is not a wheel file name")
    path = directory / filename
    # A new file in the resolver's own temporary folder: never through a link, never over a file already there.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        raise UsageError(f"{filename!r} is listed twice among the stand-in wheels") from None
    with os.fdopen(fd, "wb") as handle, zipfile.ZipFile(handle, "w") as archive:
        archive.writestr(f"{dist_info}/METADATA", "\n".join(metadata) + "\n")
        archive.writestr(f"{dist_info}/WHEEL", "\n".join(wheel) + "\n")
        archive.writestr(f"{dist_info}/RECORD", "")
    return path


def uv_compile(
    requirements: Iterable[str],
    overrides: Iterable[str],
    target: Target,
    exclude_newer: str,
    index_url: str,
    stand_ins: Iterable[LockedPackage] = (),
) -> dict[str, str]:
    """Versions uv resolves for `requirements` on the target: {normalised name: version}."""
    with tempfile.TemporaryDirectory(prefix="bwstack-lock-") as tmp:
        stubs = Path(tmp, "stand-ins")
        stubs.mkdir()
        for pkg in stand_ins:
            for wheel in pkg.wheels:
                write_stub_wheel(stubs, wheel.file, pkg.name, pkg.version, pkg.requires)
        req_file = Path(tmp, "requirements.in")
        req_file.write_text("\n".join(requirements) + "\n")
        ovr_file = Path(tmp, "overrides.txt")
        ovr_file.write_text("\n".join(overrides) + "\n")
        args = [
            "pip", "compile", str(req_file),
            "--override", str(ovr_file),
            "--python-version", target.python,
            "--python-platform", f"x86_64-manylinux_2_{target.glibc_minor}",
            "--only-binary", ":all:",
            "--exclude-newer", exclude_newer,
            "--index-url", index_url,
            "--find-links", str(stubs),
            "--no-header", "--no-annotate",
        ]  # fmt: skip
        result = run_uv(args, env=uv_env(), capture=True)
        if result.returncode != 0:
            detail = "\n".join(line for line in result.stderr.splitlines() if line.strip())[-1500:]
            raise BwstackError(f"uv could not resolve the closure:\n{detail}")
    pins: dict[str, str] = {}
    for line in result.stdout.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-")):
            continue
        name, _, version = line.partition("==")
        pins[canonicalize_name(name.split("[")[0])] = version.split(";")[0].strip()
    return pins


def _index_wheels(
    http: requests.Session, index_url: str, name: str, version: str, target: Target, cutoff: datetime
) -> tuple[list[Wheel], list[pypi.IndexFile]]:
    files = pypi.project_files(http, index_url, name)
    chosen = []
    for f in files:
        if not f.filename.endswith(".whl") or f.yanked:
            continue
        if f.upload_time is not None and f.upload_time > cutoff:
            continue
        try:
            from packaging.utils import parse_wheel_filename

            _, file_version, _, _ = parse_wheel_filename(f.filename)
        except ValueError:
            continue
        if str(file_version) != version or target.wheel_rank(f.filename) is None:
            continue
        if not f.sha256:
            raise BwstackError(f"{name} {version}: {index_url} lists {f.filename} without a sha256")
        chosen.append(f)
    chosen.sort(key=lambda f: target.wheel_rank(f.filename) or 0)
    if not chosen:
        raise BwstackError(
            f"{name} {version}: no wheel for CPython {target.python} on manylinux_2_{target.glibc_minor} x86_64"
        )
    wheels = [Wheel(f.filename, f.url, f.sha256, HASH_SOURCE_PYPI) for f in chosen]
    return wheels, chosen


def _closure_from_pins(
    http: requests.Session,
    pins: Mapping[str, str],
    static: Mapping[str, LockedPackage],
    target: Target,
    index_url: str,
    cutoff: datetime,
    top_level: Iterable[str],
) -> dict[str, LockedPackage]:
    """Fetch hashes and Requires-Dist for resolved pins; merge the static packages."""

    def fetch(item: tuple[str, str]) -> tuple[str, str, list[Wheel], list[str]]:
        name, version = item
        wheels, files = _index_wheels(http, index_url, name, version, target, cutoff)
        metadata = pypi.wheel_metadata(http, files[0].url)
        return name, version, wheels, pypi.requires_dist(metadata)

    with ThreadPoolExecutor(max_workers=16) as pool:
        fetched = list(pool.map(fetch, sorted(pins.items())))
    raw_requires = {name: reqs for name, _, _, reqs in fetched}
    raw_requires.update({name: list(pkg.requires) for name, pkg in static.items()})
    # Extras requested anywhere in the closure decide which extra-conditioned requirements apply.
    extras: dict[str, set[str]] = {}
    for req in applicable_requirements(target, top_level):
        extras.setdefault(req.name, set()).update(req.extras)
    while True:
        before = {k: set(v) for k, v in extras.items()}
        for name, reqs in raw_requires.items():
            for wanted, names in requested_extras(applicable_requirements(target, reqs, extras.get(name, ()))).items():
                extras.setdefault(wanted, set()).update(names)
        if extras == before:
            break
    packages: dict[str, LockedPackage] = {}
    for name, version, wheels, _ in fetched:
        applicable = applicable_requirements(target, raw_requires[name], extras.get(name, ()))
        packages[name] = LockedPackage(
            name=name,
            version=version,
            index="pypi",
            requires=tuple(sorted({str(r) for r in applicable})),
            wheels=tuple(wheels),
        )
    for name, pkg in static.items():
        applicable = applicable_requirements(target, pkg.requires, extras.get(name, ()))
        packages[name] = LockedPackage(**{**pkg.__dict__, "requires": tuple(sorted({str(r) for r in applicable}))})
    return dict(sorted(packages.items()))


def resolve_profile(lock: Lock, profile: Profile, http: requests.Session) -> dict:
    target = Target.of(profile)
    index_url = lock.indexes["pypi"].url
    cutoff = datetime.fromisoformat(lock.exclude_newer.replace("Z", "+00:00"))
    static = {
        name: LockedPackage(
            name=name,
            version=pin.version,
            index=pin.index,
            requires=pin.static.requires_dist,
            wheels=pin.static.wheels,
            resolved_here=False,
            metadata_source=pin.static.metadata_source,
        )
        for name, pin in profile.requirements.items()
        if pin.static is not None
    }
    top_level = [f"{name}=={pin.version}" for name, pin in profile.requirements.items()]
    overrides = [f"{o.package}{o.with_}" for o in profile.overrides]
    pins = uv_compile(top_level, overrides, target, lock.exclude_newer, index_url, static.values())
    for name, pin in profile.requirements.items():
        if pins.get(name) != pin.version:
            raise BwstackError(f"{profile.name}: uv resolved {name} {pins.get(name)}, the spec pins {pin.version}")
    resolved = {name: version for name, version in pins.items() if name not in static}
    env = _closure_from_pins(http, resolved, static, target, index_url, cutoff, top_level)

    toolkit_req = f"cuda-toolkit[{','.join(profile.cuda.pip_components)}]=={profile.cuda.pip_version}"
    tk_pins = uv_compile([toolkit_req], [], target, lock.exclude_newer, index_url)
    toolkit = _closure_from_pins(http, tk_pins, {}, target, index_url, cutoff, [toolkit_req])
    metadata = pypi.wheel_metadata(http, toolkit["cuda-toolkit"].wheels[0].url)
    unknown = set(profile.cuda.pip_components) - pypi.provides_extras(metadata)
    if unknown:
        raise BwstackError(
            f"profiles.{profile.name}.cuda.pip.components: cuda-toolkit {profile.cuda.pip_version} has no "
            f"extra named {', '.join(sorted(unknown))}"
        )
    return {
        "spec_digest": profile.spec_digest(),
        "resolved_with": f"uv {uv_version()}",
        "resolved_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "exclude_newer": lock.exclude_newer,
        "env": _dump_packages(env),
        "cuda_toolkit": _dump_packages(toolkit),
    }


def _dump_packages(packages: Mapping[str, LockedPackage]) -> dict:
    out = {}
    for name, pkg in packages.items():
        entry: dict = {"version": pkg.version}
        if pkg.index != "pypi":
            entry["index"] = pkg.index
        if not pkg.resolved_here:
            entry["resolved_here"] = False
            entry["metadata_source"] = pkg.metadata_source
        entry["requires"] = list(pkg.requires)
        entry["wheels"] = [
            {"file": w.file, "url": w.url, "sha256": w.sha256, "hash_source": w.hash_source} for w in pkg.wheels
        ]
        out[name] = entry
    return out


def render_lock_text(lock: Lock, closures: Mapping[str, dict]) -> str:
    body = yaml.safe_dump({"closures": dict(closures)}, sort_keys=False, width=4096, allow_unicode=True)
    header = (
        f"{GENERATED_MARKER}; edit the spec above and re-run it ----\n"
        "# Hash sources: `pypi` = read from PyPI's own listing when this lock was resolved; anything else says\n"
        "# where the hash was found and whether it could be verified from the resolving network.\n"
    )
    return lock.spec_text.rstrip() + "\n\n" + header + body


def lock_profiles(lock: Lock, profiles: Iterable[str] | None = None, *, log=print) -> str:
    """Resolve the named profiles (all by default), keeping others' closures; return the new lock text."""
    http = pypi.session()
    names = list(profiles or lock.profiles)
    closures: dict[str, dict] = {}
    for name in lock.profiles:
        profile = lock.profile(name)
        if name in names:
            log(f"resolving {name} (Python {profile.python}, {profile.platform}) with uv ...")
            closures[name] = resolve_profile(lock, profile, http)
            log(
                f"  {name}: {len(closures[name]['env'])} packages, {len(closures[name]['cuda_toolkit'])} toolkit wheels"
            )
        elif profile.closure is not None:
            closures[name] = {
                "spec_digest": profile.closure.spec_digest,
                "resolved_with": profile.closure.resolved_with,
                "resolved_at": profile.closure.resolved_at,
                "exclude_newer": profile.closure.exclude_newer,
                "env": _dump_packages(profile.closure.env),
                "cuda_toolkit": _dump_packages(profile.closure.cuda_toolkit),
            }
    return render_lock_text(lock, closures)


@contextmanager
def rewriting(path: str | os.PathLike) -> Iterator[None]:
    """One rewrite of the lock file at a time, from its read to its write (a second `bwstack lock` on the same file
    would write a lock made from what it read before the first wrote, losing the first one's profiles). Held on
    the file's folder: the write puts a new file in place, so the file itself is not a lasting thing to hold. A
    link at the lock's name is refused: the new file would replace the link and leave what it names as it was."""
    path = Path(path)
    if path.is_symlink():
        raise UsageError(f"--lock {path} is a link: name the file it points to (the lock is written as a new file)")
    try:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise UsageError(f"--lock {path}: its folder cannot be opened ({exc.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BusyError(
                f"another process holds {path.parent} locked (another `bwstack lock` rewriting {path.name}?): run it "
                f"again when that one ends"
            ) from None
        yield
    finally:
        os.close(fd)


def write_lock(path: str | os.PathLike, text: str) -> None:
    """The lock rewritten in place keeps its mode (a group-writable checkout stays so); a new one gets the umask's."""
    try:
        mode = stat.S_IMODE(os.lstat(path).st_mode) & 0o777
    except FileNotFoundError:
        mode = new_file_mode()
    atomic_write_text(Path(path), text, mode)
