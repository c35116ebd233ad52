"""The generation record: what a generation is (`<generation>/record.json`), typed.

Written once, when a generation is committed (built, adopted, snapshotted or restored), sealed with the
generation and covered by its manifest. `GenerationRecord` is the one reader and writer: `from_json` validates
what it reads (a record that fails is a damaged generation, never a half-read one), `to_json` gives the JSON
shape (`RecordJSON`). Who reads it:

- the store (which generation is verified, what torch the post-switch check expects), provisioning (which
  closure a generation holds, which profile it counts for in a rollback), the CLI (`bwstack generations`,
  the JSON the Ansible roles consume);
- the probe, on nodes, reads its own few fields through `bwstack.probe.generation` (it ships without the
  store); test_owners.py keeps those field names among `RecordJSON`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypedDict

VERIFICATION_PASSED = "passed"


class RecordJSON(TypedDict, total=False):
    """record.json as written. Every key but `id` may be absent in records of older bwstack versions."""

    id: int
    profile: str | None  # the lock profile it was built from (None: adopted, no exact match)
    nearest_profile: str | None  # adopted: the profile whose packages it is closest to
    created: str  # UTC, ISO 8601
    origin: str  # built | adopted:<path> | snapshot-of:<generation> | restored:<archive> (was generation N)
    lock_digest: str | None
    closure_digest: str
    python: str
    python_executable: str
    cuda_home: str | None
    cuda_version: str
    patches: list[dict]
    torch: dict  # {"version", "cuda"} as the env reported them at build time ({} without torch)
    packages: dict[str, dict]  # name -> the wheel it came from (file, sha256, hash_verified, ...) or {"version"}
    verification: dict  # {"status": passed|failed|not-run, "at", "checks"|"why"}
    drift: list[str]  # snapshot-of: what differed from the generation it was taken from
    size_bytes: int
    files: int


class RecordError(ValueError):
    """A record.json that cannot be trusted; the message says which field and why."""


_STR_FIELDS = ("profile", "nearest_profile", "created", "origin", "lock_digest", "closure_digest", "python",
               "python_executable", "cuda_home", "cuda_version")  # fmt: skip
_DICT_FIELDS = ("verification", "torch", "packages")
_LIST_FIELDS = ("patches", "drift")
_INT_FIELDS = ("size_bytes", "files")


def _frozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def _thawed(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thawed(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value


@dataclass(frozen=True)
class GenerationRecord:
    id: int
    profile: str | None = None
    nearest_profile: str | None = None
    created: str | None = None
    origin: str | None = None
    lock_digest: str | None = None
    closure_digest: str | None = None
    python: str | None = None
    python_executable: str | None = None
    cuda_home: str | None = None
    cuda_version: str | None = None
    patches: tuple = ()
    torch: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    packages: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: MappingProxyType({}))
    verification: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    drift: tuple[str, ...] = ()
    size_bytes: int | None = None
    files: int | None = None
    # keys this bwstack does not know (a newer writer's), kept so that a record read and written again loses none
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), compare=False)

    def __post_init__(self) -> None:
        for name in ("torch", "packages", "verification", "extra", "patches", "drift"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    # -- reading -----------------------------------------------------------------------------------

    @classmethod
    def from_json(cls, data: object, *, expected_id: int | None = None) -> GenerationRecord:
        """Validate and type a record read from JSON; RecordError names every field that is wrong."""
        if not isinstance(data, Mapping):
            raise RecordError("not a JSON object")
        problems = []
        gen_id = data.get("id")
        if not isinstance(gen_id, int) or isinstance(gen_id, bool):
            problems.append("`id` is not an integer")
        elif expected_id is not None and gen_id != expected_id:
            problems.append(f"`id` {gen_id} does not match the directory name")
        for key in _STR_FIELDS:
            if data.get(key) is not None and not isinstance(data.get(key), str):
                problems.append(f"`{key}` is not a string")
        for key in _DICT_FIELDS:
            if key in data and not isinstance(data[key], Mapping):
                problems.append(f"`{key}` is not an object")
        for key in _LIST_FIELDS:
            if key in data and not isinstance(data[key], list | tuple):
                problems.append(f"`{key}` is not a list")
        for key in _INT_FIELDS:
            value = data.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                problems.append(f"`{key}` is not an integer")
        if problems:
            raise RecordError("; ".join(problems))
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values = {k: data[k] for k in known if k in data and data[k] is not None}
        return cls(**values, extra={k: v for k, v in data.items() if k not in known})

    @property
    def verification_status(self) -> str | None:
        status = self.verification.get("status")
        return status if isinstance(status, str) else None

    @property
    def passed(self) -> bool:
        """Its checks passed when it was built or restored (says nothing about its files since)."""
        return self.verification_status == VERIFICATION_PASSED

    @property
    def adopted_from(self) -> str | None:
        """The directory a hand-made env was adopted from (origin `adopted:<path>`), else None."""
        origin = self.origin or ""
        return origin.split(":", 1)[1] if origin.startswith("adopted:") else None

    @property
    def profile_like(self) -> str | None:
        """The profile it was built from, or for an adopted env the one it is nearest to: what a rollback by
        profile and the checks go by."""
        return self.profile or self.nearest_profile

    def counts_for(self, profile: str) -> bool:
        return profile in (self.profile, self.nearest_profile)

    # -- writing -----------------------------------------------------------------------------------

    def to_json(self) -> RecordJSON:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is None and f.name in ("size_bytes", "files", "python_executable", "closure_digest",
                                            "cuda_version", "created", "origin"):  # fmt: skip
                continue
            if f.name == "drift" and not value:
                continue
            out[f.name] = _thawed(value)
        out.update(_thawed(self.extra))
        return out  # type: ignore[return-value]

    def replace(self, **changes: Any) -> GenerationRecord:
        return dataclasses.replace(self, **changes)


def empty(gen_id: int) -> GenerationRecord:
    """The record of a generation whose record.json cannot be trusted (the generation is damaged)."""
    return GenerationRecord(id=gen_id)
