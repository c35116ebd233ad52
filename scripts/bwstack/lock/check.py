"""`bwstack lock --check`: the lock is internally consistent (offline) and PyPI still serves its hashes (online)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from bwstack.lock import pypi
from bwstack.lock.model import Lock, LockedPackage, Profile
from bwstack.lock.tags import Target

ERROR, WARNING, INFO = "error", "warning", "info"


@dataclass
class Finding:
    level: str
    profile: str
    where: str
    message: str


@dataclass
class LockReport:
    findings: list[Finding] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, level: str, profile: str, where: str, message: str) -> None:
        self.findings.append(Finding(level, profile, where, message))

    @property
    def ok(self) -> bool:
        return not any(f.level == ERROR for f in self.findings)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "counts": self.counts, "findings": [f.__dict__ for f in self.findings]}

    def render(self) -> str:
        lines = []
        for f in self.findings:
            lines.append(f"{f.level.upper():8} {f.profile:6} {f.where}: {f.message}")
        summary = ", ".join(f"{k} {v}" for k, v in self.counts.items())
        verdict = "lock OK" if self.ok else "lock has errors"
        lines.append(f"{verdict} ({summary})")
        return "\n".join(lines)


def _satisfied(version: str, spec: str) -> bool:
    return Version(version) in SpecifierSet(spec, prereleases=True)


def _check_packages(
    report: LockReport,
    profile: Profile,
    part: str,
    packages: Mapping[str, LockedPackage],
    roots: list[Requirement],
) -> None:
    target = Target.of(profile)
    used_overrides: set[tuple[str, str]] = set()
    for name, pkg in packages.items():
        where = f"closures.{profile.name}.{part}.{name}"
        for text in pkg.requires:
            req = Requirement(text)
            dep = canonicalize_name(req.name)
            if dep not in packages:
                report.add(ERROR, profile.name, where, f"requires {text}, which is not in the closure")
                continue
            have = packages[dep].version
            if _satisfied(have, str(req.specifier)):
                continue
            override = profile.override_for(dep, name)
            if override is None:
                report.add(
                    ERROR, profile.name, where,
                    f"requires {text} but the closure has {dep} {have}, and no override explains it",
                )  # fmt: skip
            elif SpecifierSet(override.replaces) != req.specifier:
                report.add(
                    ERROR, profile.name, where,
                    f"requires {text}; the override of {dep} says it replaces {override.replaces!r}",
                )  # fmt: skip
            elif not _satisfied(have, override.with_):
                report.add(
                    ERROR,
                    profile.name,
                    where,
                    f"closure has {dep} {have}, the override wants {override.with_}",
                )
            else:
                used_overrides.add((dep, name))
        wheels_ok = False
        for i, wheel in enumerate(pkg.wheels):
            try:
                wname, wversion, _, _ = parse_wheel_filename(wheel.file)
            except ValueError:
                report.add(ERROR, profile.name, f"{where}.wheels[{i}]", f"{wheel.file!r} is not a wheel name")
                continue
            if canonicalize_name(wname) != name or wversion != Version(pkg.version):
                report.add(ERROR, profile.name, f"{where}.wheels[{i}]", f"{wheel.file} is not {name} {pkg.version}")
            if target.wheel_rank(wheel.file) is not None:
                wheels_ok = True
            if wheel.sha256 is None:
                report.add(
                    WARNING, profile.name, f"{where}.wheels[{i}]",
                    f"no sha256 ({wheel.hash_source}); installing it needs --allow-unhashed {name}",
                )  # fmt: skip
            elif not wheel.verified_here:
                report.add(INFO, profile.name, f"{where}.wheels[{i}]", f"sha256 from {wheel.hash_source}")
        if not wheels_ok:
            report.add(
                ERROR,
                profile.name,
                where,
                f"no wheel installs on CPython {profile.python} {profile.platform}",
            )
    if part == "env":
        for override in profile.overrides:
            if (override.package, override.required_by) not in used_overrides:
                report.add(
                    ERROR, profile.name, f"profiles.{profile.name}.overrides",
                    f"override of {override.package} for {override.required_by} explains no conflict: remove it",
                )  # fmt: skip
    # Everything in the closure must be needed by something the spec asks for.
    reachable: set[str] = set()
    stack = [canonicalize_name(r.name) for r in roots]
    while stack:
        name = stack.pop()
        if name in reachable or name not in packages:
            continue
        reachable.add(name)
        stack.extend(canonicalize_name(Requirement(t).name) for t in packages[name].requires)
    for name in sorted(set(packages) - reachable):
        report.add(ERROR, profile.name, f"closures.{profile.name}.{part}.{name}", "nothing in the spec needs it")


def check_offline(lock: Lock, report: LockReport) -> None:
    for profile in lock.profiles.values():
        closure = profile.closure
        if closure is None:
            report.add(ERROR, profile.name, f"closures.{profile.name}", "missing: run `bwstack lock`")
            continue
        if closure.spec_digest != profile.spec_digest():
            report.add(
                ERROR, profile.name, f"closures.{profile.name}.spec_digest",
                "the spec changed since the closure was resolved: run `bwstack lock`",
            )  # fmt: skip
        for name, pin in profile.requirements.items():
            where = f"profiles.{profile.name}.requirements.{name}"
            pkg = closure.env.get(name)
            if pkg is None:
                report.add(ERROR, profile.name, where, "pinned but not in the closure")
                continue
            if pkg.version != pin.version:
                report.add(ERROR, profile.name, where, f"pinned {pin.version}, closure has {pkg.version}")
            if pkg.index != pin.index:
                report.add(ERROR, profile.name, where, f"must come from {pin.index}, closure says {pkg.index}")
            if (pin.static is None) != pkg.resolved_here:
                report.add(ERROR, profile.name, where, "resolved_here disagrees with the spec's `static` block")
            if pin.static is not None and tuple(pin.static.wheels) != tuple(pkg.wheels):
                report.add(ERROR, profile.name, where, "closure wheels differ from the spec's static wheels")
        roots = [Requirement(f"{n}=={p.version}") for n, p in profile.requirements.items()]
        _check_packages(report, profile, "env", closure.env, roots)
        tk_root = Requirement(f"cuda-toolkit[{','.join(profile.cuda.pip_components)}]=={profile.cuda.pip_version}")
        toolkit = closure.cuda_toolkit.get("cuda-toolkit")
        if toolkit is None or toolkit.version != profile.cuda.pip_version:
            report.add(ERROR, profile.name, f"closures.{profile.name}.cuda_toolkit", "cuda-toolkit pin not resolved")
        _check_packages(report, profile, "cuda_toolkit", closure.cuda_toolkit, [tk_root])
        static = sum(not p.resolved_here for p in closure.env.values())
        report.counts[f"{profile.name} packages"] = len(closure.env)
        report.counts[f"{profile.name} resolved here"] = len(closure.env) - static


def _stream_sha256(http: requests.Session, url: str) -> str:
    digest = hashlib.sha256()
    with http.get(url, stream=True, timeout=pypi.TIMEOUT) as response:
        response.raise_for_status()
        for chunk in response.iter_content(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_online(lock: Lock, report: LockReport) -> None:
    http = pypi.session()
    index = lock.indexes["pypi"].url
    wanted: dict[str, list[tuple[str, str, str]]] = {}  # project -> [(profile, file, sha)]
    remote: dict[str, tuple[str, str, str, str | None]] = {}  # url -> (profile, name, file, sha)
    for profile in lock.profiles.values():
        if profile.closure is None:
            continue
        for part in (profile.closure.env, profile.closure.cuda_toolkit):
            for pkg in part.values():
                for wheel in pkg.wheels:
                    if wheel.verified_here:
                        wanted.setdefault(pkg.name, []).append((profile.name, wheel.file, wheel.sha256 or ""))
                    else:
                        remote[wheel.url] = (profile.name, pkg.name, wheel.file, wheel.sha256)

    def listing(name: str) -> tuple[str, dict[str, str] | str]:
        try:
            return name, {f.filename: f.sha256 or "" for f in pypi.project_files(http, index, name)}
        except Exception as exc:  # reported per package below
            return name, str(exc)

    checked = 0
    with ThreadPoolExecutor(max_workers=16) as pool:
        for name, served in pool.map(listing, sorted(wanted)):
            for profile, file, sha in wanted[name]:
                if isinstance(served, str):
                    report.add(ERROR, profile, name, f"cannot read PyPI's listing: {served}")
                elif file not in served:
                    report.add(ERROR, profile, name, f"PyPI no longer serves {file}")
                elif served[file] != sha:
                    report.add(ERROR, profile, name, f"{file}: PyPI serves sha256 {served[file]}, lock has {sha}")
                else:
                    checked += 1
    report.counts["pypi hashes confirmed"] = checked
    for url, (profile, name, file, sha) in sorted(remote.items()):
        try:
            head = http.head(url, allow_redirects=True, timeout=(10, 30))
        except requests.RequestException as exc:
            report.add(INFO, profile, name, f"{file}: not verified from this network ({pypi._reason(exc)})")
            continue
        if not head.ok:
            report.add(ERROR, profile, name, f"{file}: HTTP {head.status_code} at {url}")
            continue
        actual = _stream_sha256(http, url)
        if sha is None:
            report.add(WARNING, profile, name, f"{file}: reachable; its sha256 is {actual} (add it to the lock)")
        elif actual != sha:
            report.add(ERROR, profile, name, f"{file}: served sha256 {actual}, lock has {sha} (re-uploaded?)")
        else:
            report.add(INFO, profile, name, f"{file}: sha256 verified from this network")


def check_lock(lock: Lock, *, online: bool) -> LockReport:
    report = LockReport()
    check_offline(lock, report)
    if online:
        check_online(lock, report)
    return report
