"""The catalogue of field reports (data/known_issues.yaml): validated on load, matched by version range only.

The same discipline as the patch catalogue: an entry gives a verdict only for the releases its `affects` ranges
name; a release outside them gets "not catalogued for <dist> <version>", never a guess.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from functools import cache
from importlib import resources
from typing import Any

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from bwstack.errors import BwstackError
from bwstack.serveplan.records import COMPONENTS

CATALOGUE_FILE = "known_issues.yaml"
ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
CAPABILITY_RE = re.compile(r"^\d+\.\d+$")
ENV_RE = re.compile(r"^[A-Z_][A-Z0-9_]*$")
ARG_RE = re.compile(r"^[a-z][a-z0-9_]*$")
FLAG_RE = re.compile(r"^--[a-z0-9-]+$")


class CatalogueError(BwstackError):
    """data/known_issues.yaml is malformed: a bwstack bug (or a bad edit), named by entry and key."""


class Kind(str, Enum):
    CRASH = "crash"
    WRONG_RESULTS = "wrong-results"


@dataclass(frozen=True)
class PathMatch:
    component: str
    backend: str


@dataclass(frozen=True)
class Avoid:
    flags: tuple[str, ...]
    env: Mapping[str, str]
    note: str


@dataclass(frozen=True)
class Issue:
    id: str
    title: str
    matches: tuple[PathMatch, ...]
    capabilities: tuple[str, ...]
    affects: Mapping[str, str]  # canonical distribution name -> specifier
    fixed: Mapping[str, str]
    kind: Kind
    symptom: str
    evidence: str
    sources: tuple[str, ...]
    avoid: Avoid | None

    def matches_path(self, component: str, backend: str) -> bool:
        return any(m.component == component and m.backend == backend for m in self.matches)


@dataclass(frozen=True)
class Remedy:
    component: str
    backend: str  # "*" for any backend of the component
    flags: tuple[str, ...]
    server_args: Mapping[str, object]
    env: Mapping[str, str]
    why: str
    sources: tuple[str, ...]

    def applies_to(self, component: str, backend: str) -> bool:
        return self.component == component and self.backend in ("*", backend)


class Applies(str, Enum):
    YES = "applies"
    FIXED = "fixed"
    NOT_CATALOGUED = "not-catalogued"  # the installed release is outside every range the entry names
    NOT_INSTALLED = "not-installed"


@dataclass(frozen=True)
class Finding:
    """What one catalogue entry says about one path of one env."""

    issue: Issue
    applies: Applies
    detail: str  # the versions that decided it


@dataclass(frozen=True)
class Catalogue:
    issues: tuple[Issue, ...]
    remedies: tuple[Remedy, ...]

    def findings(self, component: str, backend: str, capability: str, versions: Mapping[str, str | None]) -> list:
        """Every entry about this path and capability, and whether it applies to the installed versions."""
        out: list[Finding] = []
        for issue in self.issues:
            if not issue.matches_path(component, backend) or capability not in issue.capabilities:
                continue
            out.append(_judge(issue, {canonicalize_name(k): v for k, v in versions.items()}))
        return out

    def remedies_for(self, component: str, backend: str) -> list[Remedy]:
        return [r for r in self.remedies if r.applies_to(component, backend)]


def _inside(spec: str, version: str) -> bool:
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def _judge(issue: Issue, versions: Mapping[str, str | None]) -> Finding:
    installed = {name: versions.get(name) for name in issue.affects}
    missing = [name for name, version in installed.items() if version is None]
    if missing:
        return Finding(issue, Applies.NOT_INSTALLED, f"{', '.join(missing)} not installed")
    described = ", ".join(f"{name} {version}" for name, version in installed.items())
    if all(_inside(issue.affects[name], version) for name, version in installed.items()):
        return Finding(issue, Applies.YES, described)
    fixed = {name: versions.get(name) for name in issue.fixed}
    if fixed and all(v is not None and _inside(issue.fixed[n], v) for n, v in fixed.items()):
        return Finding(issue, Applies.FIXED, ", ".join(f"{n} {v}" for n, v in fixed.items()))
    outside = [f"{n} {v}" for n, v in installed.items() if not _inside(issue.affects[n], v)]
    return Finding(issue, Applies.NOT_CATALOGUED, ", ".join(outside))


# ------------------------------------------------------------------------------------------------ loading


class _Entry:
    """One mapping of the file, with the place it sits at, for errors that name the key."""

    def __init__(self, where: str, value: Any) -> None:
        self.where = where
        if not isinstance(value, dict):
            self.fail(f"expected a mapping, got {type(value).__name__}")
        self.value: dict = value

    def fail(self, message: str, key: str | None = None) -> CatalogueError:
        at = f"{self.where}.{key}" if key else self.where
        raise CatalogueError(f"data/{CATALOGUE_FILE}: {at}: {message}")

    def only(self, allowed: set[str], required: set[str]) -> None:
        for key in self.value:
            if key not in allowed:
                self.fail(f"unknown key (allowed: {', '.join(sorted(allowed))})", str(key))
        for key in sorted(required - set(self.value)):
            self.fail("required key is missing", key)

    def text(self, key: str) -> str:
        value = self.value.get(key)
        if not isinstance(value, str) or not value.strip():
            self.fail("expected a non-empty string", key)
        return value.strip()

    def texts(self, key: str, pattern: re.Pattern[str] | None = None, required: bool = True) -> tuple[str, ...]:
        value = self.value.get(key, None if required else [])
        if not isinstance(value, list) or (required and not value):
            self.fail("expected a non-empty list of strings", key)
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item or (pattern is not None and not pattern.match(item)):
                self.fail(f"{item!r} is not valid", f"{key}[{i}]")
        return tuple(value)

    def specifiers(self, key: str, required: bool = True) -> dict[str, str]:
        value = self.value.get(key, None if required else {})
        if not isinstance(value, dict) or (required and not value):
            self.fail("expected a mapping of distribution names to version specifiers", key)
        out = {}
        for name, spec in value.items():
            if not isinstance(spec, str) or not spec.strip():
                self.fail('expected a version specifier in quotes (e.g. "==0.6.3")', f"{key}.{name}")
            try:
                SpecifierSet(spec)
            except InvalidSpecifier:
                self.fail(f"{spec!r} is not a valid version specifier", f"{key}.{name}")
            if not any(op in spec for op in ("==", "<", ">", "~=")):
                self.fail(f"{spec!r} names no version", f"{key}.{name}")
            out[canonicalize_name(str(name))] = spec
        return out

    def env(self, key: str) -> dict[str, str]:
        value = self.value.get(key, {})
        if not isinstance(value, dict):
            self.fail("expected a mapping of environment variables", key)
        for name, setting in value.items():
            if not isinstance(name, str) or not ENV_RE.match(name):
                self.fail("not an environment variable name", f"{key}.{name}")
            if not isinstance(setting, str) or not setting:
                self.fail("expected a non-empty string in quotes", f"{key}.{name}")
        return dict(value)


def _component(entry: _Entry) -> str:
    """A component a plan's paths name (records.COMPONENTS): an entry naming another would never apply."""
    name = entry.text("component")
    if name not in COMPONENTS:
        entry.fail(f"{name!r} is no component of a plan (one of: {', '.join(COMPONENTS)})", "component")
    return name


def _urls(entry: _Entry, required: bool = True) -> tuple[str, ...]:
    urls = entry.texts("sources", required=required)
    for i, url in enumerate(urls):
        if not url.startswith("https://"):
            entry.fail(f"{url!r} is not an https:// URL", f"sources[{i}]")
    return urls


def _issue(issue_id: str, value: Any) -> Issue:
    entry = _Entry(f"issues.{issue_id}", value)
    if not ID_RE.match(issue_id):
        entry.fail("ids are lowercase words joined by dashes")
    keys = {"title", "matches", "capabilities", "affects", "kind", "symptom", "evidence", "sources"}
    entry.only(keys | {"fixed", "avoid"}, keys)
    matches = entry.value["matches"]
    if not isinstance(matches, list) or not matches:
        entry.fail("expected a non-empty list of {component, backend}", "matches")
    parsed = []
    for i, item in enumerate(matches):
        sub = _Entry(f"issues.{issue_id}.matches[{i}]", item)
        sub.only({"component", "backend"}, {"component", "backend"})
        parsed.append(PathMatch(_component(sub), sub.text("backend")))
    kind = entry.text("kind")
    if kind not in {k.value for k in Kind}:
        entry.fail(f"expected one of {', '.join(k.value for k in Kind)}, got {kind!r}", "kind")
    avoid = None
    if "avoid" in entry.value:
        sub = _Entry(f"issues.{issue_id}.avoid", entry.value["avoid"])
        sub.only({"flags", "env", "note"}, set())
        flags = sub.texts("flags", required=False)
        env = sub.env("env")
        note = sub.text("note") if "note" in sub.value else ""
        if not (flags or env or note):
            sub.fail("say what avoids it (flags, env) or that nothing does (note)")
        avoid = Avoid(flags, env, note)
    return Issue(
        id=issue_id,
        title=entry.text("title"),
        matches=tuple(parsed),
        capabilities=entry.texts("capabilities", CAPABILITY_RE),
        affects=entry.specifiers("affects"),
        fixed=entry.specifiers("fixed", required=False),
        kind=Kind(kind),
        symptom=entry.text("symptom"),
        evidence=entry.text("evidence"),
        sources=_urls(entry),
        avoid=avoid,
    )


def _remedy(index: int, value: Any) -> Remedy:
    entry = _Entry(f"remedies[{index}]", value)
    entry.only(
        {"component", "backend", "flags", "server_args", "env", "why", "sources"}, {"component", "backend", "why"}
    )
    flags = entry.texts("flags", required=False)
    args = entry.value.get("server_args", {})
    if not isinstance(args, dict) or not all(isinstance(k, str) and ARG_RE.match(k) for k in args):
        entry.fail("expected a mapping of ServerArgs field names to values", "server_args")
    if bool(flags) != bool(args):
        entry.fail("flags and the server_args they set go together", "flags" if not flags else "server_args")
    if flags and not FLAG_RE.match(flags[0]):
        entry.fail(f"{flags[0]!r} is not a --flag", "flags[0]")
    env = entry.env("env")
    if not flags and not env:
        entry.fail("a remedy changes flags or env")
    return Remedy(
        component=_component(entry),
        backend=entry.text("backend"),
        flags=flags,
        server_args=args,
        env=env,
        why=entry.text("why"),
        sources=_urls(entry, required=False) if "sources" in entry.value else (),
    )


def parse(text: str) -> Catalogue:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CatalogueError(f"data/{CATALOGUE_FILE}: not valid YAML: {str(exc).splitlines()[0]}") from None
    root = _Entry("(top level)", data)
    root.only({"issues", "remedies"}, {"issues", "remedies"})
    issues = _Entry("issues", root.value["issues"])
    remedies = root.value["remedies"]
    if not isinstance(remedies, list):
        root.fail("expected a list", "remedies")
    return Catalogue(
        issues=tuple(_issue(str(k), v) for k, v in issues.value.items()),
        remedies=tuple(_remedy(i, v) for i, v in enumerate(remedies)),
    )


@cache
def load() -> Catalogue:
    return parse(resources.files("bwstack.data").joinpath(CATALOGUE_FILE).read_text(encoding="utf-8"))
