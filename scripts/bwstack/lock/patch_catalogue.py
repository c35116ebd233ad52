"""The patch catalogue (data/patches.yaml): which source patches exist, for which releases of which package, with
every file's original and patched sha256. A declaration like the lock itself, so it lives in the lock layer: the
lock names patches by id (and is checked against this list); provision.patches applies them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from bwstack.errors import BwstackError

_SHA256 = re.compile(r"^[0-9a-f]{64}\Z")


class PatchCatalogueError(BwstackError):
    """data/patches.yaml is inconsistent (an edit that does not produce its recorded hash): a bwstack bug."""


# ------------------------------------------------------------------------------------------------ catalogue


@dataclass(frozen=True)
class Edit:
    old: str
    new: str


@dataclass(frozen=True)
class FileSpec:
    path: str  # relative to site-packages
    original_sha256: str
    patched_sha256: str
    edits: tuple[Edit, ...]


@dataclass(frozen=True)
class Family:
    versions: str  # PEP 440 specifier set
    verified: tuple[str, ...]
    files: tuple[FileSpec, ...]

    def contains(self, version: str) -> bool:
        return _contains(self.versions, version)


@dataclass(frozen=True)
class Unsupported:
    versions: str
    reason: str

    def contains(self, version: str) -> bool:
        return _contains(self.versions, version)


@dataclass(frozen=True)
class Patch:
    id: str
    package: str
    description: str
    families: tuple[Family, ...]
    unsupported: tuple[Unsupported, ...]

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f.path for fam in self.families for f in fam.files))

    def family_for(self, version: str) -> Family | None:
        return next((fam for fam in self.families if fam.contains(version)), None)


def _contains(spec: str, version: str) -> bool:
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def _parse_patch(patch_id: str, node: dict) -> Patch:
    def fail(message: str) -> PatchCatalogueError:
        return PatchCatalogueError(f"data/patches.yaml: patches.{patch_id}: {message}")

    if not isinstance(node, dict) or not node.get("package") or not node.get("families"):
        raise fail("needs package and families")
    families = []
    for i, fam in enumerate(node["families"]):
        try:
            SpecifierSet(str(fam["versions"]))
        except (KeyError, InvalidSpecifier) as exc:
            raise fail(f"families[{i}].versions: {exc}") from None
        files = []
        for spec in fam.get("files") or ():
            for key in ("original_sha256", "patched_sha256"):
                if not _SHA256.match(str(spec.get(key, ""))):
                    raise fail(f"families[{i}] {spec.get('path')}: {key} is not a sha256")
            edits = tuple(Edit(str(e["old"]), str(e["new"])) for e in spec.get("edits") or ())
            if not edits:
                raise fail(f"families[{i}] {spec.get('path')}: no edits")
            files.append(FileSpec(str(spec["path"]), spec["original_sha256"], spec["patched_sha256"], edits))
        if not files:
            raise fail(f"families[{i}]: no files")
        verified = tuple(str(v) for v in fam.get("verified") or ())
        families.append(Family(str(fam["versions"]), verified, tuple(files)))
    unsupported = tuple(Unsupported(str(u["versions"]), str(u["reason"])) for u in node.get("unsupported") or ())
    return Patch(patch_id, str(node["package"]), str(node.get("description", "")), tuple(families), unsupported)


@cache
def _catalogue() -> dict:
    text = resources.files("bwstack.data").joinpath("patches.yaml").read_text(encoding="utf-8")
    # The package's own file, read at every lock load: libyaml's loader where PyYAML has it (3x the pure one).
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))["patches"]


@cache
def catalogue() -> dict[str, Patch]:
    return {pid: _parse_patch(pid, node) for pid, node in _catalogue().items()}


def known_patch_ids() -> tuple[str, ...]:
    return tuple(sorted(_catalogue()))
