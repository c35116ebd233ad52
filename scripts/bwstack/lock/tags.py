"""The interpreter and platform a profile is resolved for: wheel tags in priority order, markers, requirements.

Everything here is computed for the profile's target (e.g. CPython 3.12 on x86_64 manylinux_2_28), never
for the machine bwstack happens to run on: the controller may be Python 3.11 on another glibc.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from bwstack.errors import BwstackError

if TYPE_CHECKING:
    from bwstack.lock.model import LockedPackage, Wheel


@dataclass(frozen=True)
class Target:
    python: str  # "3.12"
    glibc_minor: int  # manylinux_2_<N>

    @classmethod
    def of(cls, profile) -> Target:  # profile: bwstack.lock.model.Profile
        return cls(python=profile.python, glibc_minor=profile.glibc_minor)

    @property
    def version_tuple(self) -> tuple[int, int]:
        major, minor = self.python.split(".")
        return int(major), int(minor)

    @cached_property
    def platforms(self) -> list[str]:
        legacy = {17: "manylinux2014_x86_64", 12: "manylinux2010_x86_64", 5: "manylinux1_x86_64"}
        platforms = []
        for minor in range(self.glibc_minor, 4, -1):
            platforms.append(f"manylinux_2_{minor}_x86_64")
            if minor in legacy:
                platforms.append(legacy[minor])
        return platforms

    @cached_property
    def tag_priority(self) -> dict[Tag, int]:
        version = self.version_tuple
        abi = f"cp{version[0]}{version[1]}"
        tags = list(cpython_tags(version, platforms=self.platforms))
        tags += list(compatible_tags(version, abi, platforms=self.platforms))
        return {tag: i for i, tag in reversed(list(enumerate(tags)))}

    def wheel_rank(self, filename: str) -> int | None:
        """Lower is better; None when the wheel cannot be installed on the target."""
        try:
            _, _, _, tags = parse_wheel_filename(filename)
        except InvalidWheelFilename:
            return None
        ranks = [self.tag_priority[t] for t in tags if t in self.tag_priority]
        return min(ranks) if ranks else None

    def marker_env(self, extra: str = "") -> dict[str, str]:
        return {
            "implementation_name": "cpython",
            "implementation_version": f"{self.python}.0",
            "os_name": "posix",
            "platform_machine": "x86_64",
            "platform_python_implementation": "CPython",
            "platform_release": "",
            "platform_system": "Linux",
            "platform_version": "",
            "python_full_version": f"{self.python}.0",
            "python_version": self.python,
            "sys_platform": "linux",
            "extra": extra,
        }

    def applies(self, marker: Marker | None, extras: Iterable[str] = ()) -> bool:
        if marker is None:
            return True
        # An extra-conditioned requirement applies when any requested extra matches.
        return any(marker.evaluate(self.marker_env(extra)) for extra in ("", *extras))


def applicable_requirements(
    target: Target, requires_dist: Iterable[str], extras: Iterable[str] = ()
) -> list[Requirement]:
    """Requires-Dist lines that apply on the target for the given extras, markers stripped."""
    out = []
    extras = tuple(extras)
    for text in requires_dist:
        req = Requirement(text)
        if target.applies(req.marker, extras):
            req.marker = None
            req.name = canonicalize_name(req.name)
            out.append(req)
    return out


def requested_extras(requirements: Iterable[Requirement]) -> Mapping[str, set[str]]:
    wanted: dict[str, set[str]] = {}
    for req in requirements:
        if req.extras:
            wanted.setdefault(canonicalize_name(req.name), set()).update(req.extras)
    return wanted


def select(packages: Mapping[str, LockedPackage], target: Target) -> dict[str, tuple[LockedPackage, Wheel]]:
    """The one wheel per package the target installs: the best-ranked compatible file the lock lists."""
    chosen = {}
    for name, pkg in packages.items():
        ranked = [(target.wheel_rank(w.file), i, w) for i, w in enumerate(pkg.wheels)]
        ranked = [r for r in ranked if r[0] is not None]
        if not ranked:
            raise BwstackError(f"{name} {pkg.version}: the lock lists no wheel for CPython {target.python}")
        chosen[name] = (pkg, min(ranked)[2])
    return chosen
