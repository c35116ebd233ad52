"""Which OS packages a host needs from the lock's `system_packages`: the one rule, for every path that installs them.

The lock keys its lists by OS id, `ID-VERSION_ID` as /etc/os-release spells them (`ubuntu-24.04`, `debian-12`).
A host takes the list of its exact `ID-VERSION_ID`, else of `ID-<major version>` (so `debian-12` serves a
`VERSION_ID="12.7"` host, and `ubuntu-24` every 24.x if a lock chooses to say so), else none: the caller says
so, never guesses. `bwstack system-packages` (what the Ansible role can ask) and `bwstack image build` (for
the base image's /etc/os-release) both call `pick`.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from bwstack.errors import UsageError


@dataclass(frozen=True)
class OsPackages:
    """What `pick` decided for one /etc/os-release."""

    os_ids: tuple[str, ...]  # the lock keys tried, in order
    os_id: str | None  # the key the lock has (None: no list for this OS)
    packages: tuple[str, ...]  # empty when os_id is None

    def as_dict(self) -> dict:
        return {"os_ids": list(self.os_ids), "os_id": self.os_id, "packages": list(self.packages)}


def parse_os_release(text: str, where: str = "/etc/os-release") -> dict[str, str]:
    """KEY=value lines (values shell-quoted or bare), as os-release(5) writes them; needs an ID."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        try:
            words = shlex.split(value)
        except ValueError:
            raise UsageError(f"{where}: unbalanced quotes in {key.strip()}") from None
        fields[key.strip()] = " ".join(words)
    if not fields.get("ID"):
        raise UsageError(f"{where}: no ID= line: not an os-release file")
    return fields


def os_ids(os_release: Mapping[str, str]) -> tuple[str, ...]:
    """The lock keys an OS answers to, most specific first."""
    os_id = (os_release.get("ID") or "").strip().lower()
    version = (os_release.get("VERSION_ID") or "").strip()
    if not os_id or not version:
        return ()
    ids = [f"{os_id}-{version}", f"{os_id}-{version.split('.')[0]}"]
    return tuple(dict.fromkeys(ids))


def pick(system_packages: Mapping[str, tuple[str, ...]], os_release: Mapping[str, str]) -> OsPackages:
    """The lock's system packages for the OS that /etc/os-release describes (see the module's rule)."""
    tried = os_ids(os_release)
    for key in tried:
        if key in system_packages:
            return OsPackages(tried, key, tuple(system_packages[key]))
    return OsPackages(tried, None, ())
