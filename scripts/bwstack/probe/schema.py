"""The probe's facts as data: what `bwstack-probe` prints (one JSON line) and the checks on the controller read.

The probe and the checks can be different bwstack versions (a zipapp cached on a node, a newer controller), so
the facts carry SCHEMA_VERSION and `parse` refuses a document of another version with a message that says what to
do, instead of letting a check read a key that moved. Bump SCHEMA_VERSION when a key changes meaning or place.

The TypedDicts name every section and the keys the checks rely on (total=False: a section the probe could not
gather is absent, and the checks say why it is missing).
"""

from __future__ import annotations

import json
from typing import Any, TypedDict

SCHEMA_VERSION = 2
SCHEMA_KEY = "probe_version"  # the key's name is kept from schema 1, so an old probe is recognised as old


class HostFacts(TypedDict):
    hostname: str
    os: str
    glibc: str
    probe_python: str
    uid: int
    free_bytes: int


class GpuEntry(TypedDict):
    index: int
    name: str
    capability: str
    memory_mib: str


class GpuFacts(TypedDict, total=False):
    present: bool
    reason: str
    driver: str | None
    gpus: list[GpuEntry]


class GenerationFacts(TypedDict):
    name: str
    profile: str | None
    nearest_profile: str | None
    lock_digest: str | None
    cuda_home: str | None
    verification: str | None
    record_sealed: bool  # its record.json is the one its manifest holds


class InstalledDist(TypedDict):
    version: str
    requires: list[str]
    installer: str


class StoreFacts(TypedDict, total=False):
    root: str | None
    waivers: list[dict[str, str]]
    waivers_error: str


class EnvFacts(TypedDict, total=False):
    path: str
    real: str
    exists: bool
    site_packages: str
    python: str | None
    installed: dict[str, InstalledDist]
    generation: GenerationFacts
    torch_version_py: dict[str, str | None]
    store: StoreFacts


class Facts(TypedDict, total=False):
    probe_version: int
    capability: str
    timings: dict[str, float]
    host: HostFacts
    gpu: GpuFacts
    env: EnvFacts
    cuda: dict[str, Any]
    elf: dict[str, Any]
    fatbin: dict[str, Any]
    features: dict[str, Any]
    imports: dict[str, dict[str, Any]]
    serve_plan: dict[str, Any]
    serve_plan_profile: str  # the profile whose models serve_plan planned
    runtime: dict[str, Any]


class FactsError(ValueError):
    """The probe's output is not a facts document this bwstack can read."""


def parse(text: str, where: str) -> Facts:
    """The facts document in a probe's stdout (its last line); FactsError names the host and what is wrong."""
    lines = text.strip().splitlines()
    try:
        data = json.loads(lines[-1])
    except (ValueError, IndexError):
        raise FactsError(f"the bwstack probe printed no facts on {where}") from None
    if not isinstance(data, dict):
        raise FactsError(f"the bwstack probe on {where} printed {type(data).__name__}, not a facts document")
    version = data.get(SCHEMA_KEY)
    if version != SCHEMA_VERSION:
        raise FactsError(
            f"the bwstack probe on {where} speaks facts schema {version!r}, this bwstack reads {SCHEMA_VERSION}: "
            f"remove ~/.cache/bwstack/bwstack-probe-*.pyz there (or upgrade bwstack on the controller) and run again"
        )
    for section in ("host", "gpu", "env"):
        if not isinstance(data.get(section), dict):
            raise FactsError(f"the bwstack probe on {where} sent no {section!r} section")
    return data  # type: ignore[return-value]  # shape checked above as far as the checks rely on it
