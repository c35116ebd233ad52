"""The few fields of a generation record the probe reports about the env it inspects.

The record's owner is the store (`bwstack.store.record.GenerationRecord`, which validates every field); the
probe ships to nodes without the store (it imports only itself), and reads records written by whatever
bwstack version provisioned the node, so it reads only these fields, leniently: a field of the wrong type is
reported as unknown (None), never guessed. test_owners.py keeps FIELDS among the record's JSON keys.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from bwstack.probe import treecheck

RECORD = "record.json"  # the store's name for it (bwstack.store.generations.RECORD)
MAX_RECORD_BYTES = 16 << 20  # the store reads records with the same bound
FIELDS = ("profile", "nearest_profile", "lock_digest", "cuda_home")


@dataclass(frozen=True)
class GenerationFacts:
    """What the probe says about the generation an env belongs to (facts["env"]["generation"])."""

    name: str
    profile: str | None
    nearest_profile: str | None
    lock_digest: str | None
    cuda_home: str | None
    verification: str | None  # the record's verification status: passed, failed, not-run

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_facts(cls, facts: dict | None) -> GenerationFacts | None:
        """The probe's JSON back as this type (on the controller, e.g. the infra checks' conftest)."""
        if not isinstance(facts, dict) or not isinstance(facts.get("name"), str):
            return None
        return cls(facts["name"], *(_text(facts.get(k)) for k in (*FIELDS, "verification")))

    @property
    def profile_like(self) -> str | None:
        """The profile it was built from, or for an adopted env the one it is nearest to (as the store's
        GenerationRecord.profile_like): what the checks judge it against unless told otherwise."""
        return self.profile or self.nearest_profile


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def read(generation_dir: Path) -> GenerationFacts | None:
    """The facts of the generation at `generation_dir` (None when it has no readable record)."""
    try:
        data = json.loads(treecheck.read_bounded(generation_dir / RECORD, MAX_RECORD_BYTES, "a record"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    verification = data.get("verification")
    status = verification.get("status") if isinstance(verification, dict) else None
    return GenerationFacts(generation_dir.name, *(_text(data.get(k)) for k in FIELDS), _text(status))
