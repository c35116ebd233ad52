"""`bwstack plan`: how an installed env differs from a profile's locked closure.

Versions come from the env's dist-info. Which wheel was installed (its sha256) comes from the generation's
record when the env is a bwstack generation, else from `direct_url.json` when the installer recorded an
archive hash, else it is reported as unknown rather than guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from bwstack.errors import BwstackError, UsageError
from bwstack.lock.model import Profile
from bwstack.probe import envinspect


@dataclass
class EnvPlan:
    profile: str
    env: str
    generation: str | None
    missing: list[dict] = field(default_factory=list)
    extra: list[dict] = field(default_factory=list)
    wrong_version: list[dict] = field(default_factory=list)
    wrong_hash: list[dict] = field(default_factory=list)
    unknown_hash: list[str] = field(default_factory=list)
    matching: int = 0

    @property
    def changes(self) -> int:
        return len(self.missing) + len(self.extra) + len(self.wrong_version) + len(self.wrong_hash)

    def as_dict(self) -> dict:
        return {**self.__dict__, "changes": self.changes}

    def render(self) -> str:
        lines = [
            f"{self.env} against profile {self.profile}"
            + (f" (generation {self.generation})" if self.generation else "")
        ]
        rows = (
            [("missing", d["name"], "-", d["version"]) for d in self.missing]
            + [("extra", d["name"], d["version"], "-") for d in self.extra]
            + [("version", d["name"], d["installed"], d["locked"]) for d in self.wrong_version]
            + [
                ("hash", d["name"], d["installed"][:16] + "…", " | ".join(h[:16] + "…" for h in d["locked"]))
                for d in self.wrong_hash
            ]
        )
        if rows:
            width = max(len(r[1]) for r in rows)
            lines.append(f"  {'change':<8} {'package':<{width}}  {'installed':<24} locked")
            for kind, name, have, want in rows:
                lines.append(f"  {kind:<8} {name:<{width}}  {have:<24} {want}")
        lines.append(
            f"  {self.changes} change(s); {self.matching} package(s) match"
            + (
                f"; wheel hash unknown for {len(self.unknown_hash)} (not installed by bwstack)"
                if self.unknown_hash
                else ""
            )
        )
        return "\n".join(lines)


def _installed_hashes(env: Path) -> tuple[str | None, dict[str, str]]:
    """(generation name, {package: sha256}) from the generation record or installers' direct_url.json."""
    from bwstack.store.generations import RECORD, read_record

    real = env.resolve()
    hashes: dict[str, str] = {}
    generation = None
    if (real.parent / RECORD).is_file():
        record, problem = read_record(real.parent)
        if problem:
            raise BwstackError(f"{real.parent}: {problem}")
        generation = real.parent.name
        for name, info in record.packages.items():
            if info.get("sha256"):
                hashes[name] = info["sha256"]
    for name, dist in envinspect.installed(env).items():
        if name in hashes:
            continue
        direct = dist.dist_info / "direct_url.json"
        if direct.is_file():
            info = json.loads(direct.read_text()).get("archive_info", {})
            digest = info.get("hashes", {}).get("sha256") or (info.get("hash", "").partition("sha256=")[2] or None)
            if digest:
                hashes[name] = digest
    return generation, hashes


def plan_env(profile: Profile, env: Path | None, ml_env: str | None = None) -> EnvPlan:
    if env is None:
        from bwstack.store.layout import Layout

        env = Layout.default(None, ml_env).ml_env
    if not env.exists():
        closure = profile.require_closure()
        plan = EnvPlan(profile.name, str(env), None)
        plan.missing = [{"name": n, "version": p.version} for n, p in sorted(closure.env.items())]
        return plan
    try:
        have = envinspect.installed(env)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    closure = profile.require_closure()
    generation, hashes = _installed_hashes(env)
    plan = EnvPlan(profile.name, str(env), generation)
    for name, pkg in sorted(closure.env.items()):
        dist = have.get(name)
        if dist is None:
            plan.missing.append({"name": name, "version": pkg.version})
            continue
        if dist.version != pkg.version:
            plan.wrong_version.append({"name": name, "installed": dist.version, "locked": pkg.version})
            continue
        locked = sorted(w.sha256 for w in pkg.wheels if w.sha256)
        got = hashes.get(name)
        if got is None:
            plan.unknown_hash.append(name)
        elif locked and got not in locked:
            plan.wrong_hash.append({"name": name, "installed": got, "locked": locked})
            continue
        plan.matching += 1
    for name in sorted(set(have) - set(closure.env)):
        plan.extra.append({"name": name, "version": have[name].version})
    return plan
