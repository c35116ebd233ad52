"""Waivers: checks the operator chose to skip, each with its reason, and the ones a node remembers.

`CHECK=REASON` waives every check whose name contains CHECK; the report lists it as skipped with the reason.
Provisioning writes the waivers it was given into the store (`<root>/waivers.json`), so that every later
verify of the node (by hand on the node, from the controller, after a rollback) applies them without being
told again, and says so.

Node-side: standard library only (it also runs inside the probe zipapp, which reads a node's waivers).
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

FILE = "waivers.json"
FORMAT = 1
MAX_BYTES = 1 << 20
WAIVED = "waived by the operator"


@dataclass(frozen=True)
class Waiver:
    check: str
    reason: str

    def text(self) -> str:
        return f"{self.check}={self.reason}"

    def message(self) -> str:
        """What the report shows for a waived check."""
        return f"{WAIVED}: {self.reason}"


def parse(item: str) -> Waiver:
    """`CHECK=REASON`; ValueError (with the item) when either side is empty."""
    check, sep, reason = item.partition("=")
    if not sep or not check.strip() or not reason.strip():
        raise ValueError(f"{item!r}: expected CHECK=REASON (a waiver needs its reason)")
    if any(ch in item for ch in "\n\r\0"):
        raise ValueError(f"{item!r}: control characters in a waiver")
    return Waiver(check.strip(), reason.strip())


def parse_all(items: list[str] | tuple[str, ...]) -> list[Waiver]:
    out: list[Waiver] = []
    for item in items:
        waiver = parse(item)
        if waiver not in out:
            out.append(waiver)
    return out


def matching(waivers: list[Waiver], check_name: str) -> Waiver | None:
    return next((w for w in waivers if w.check in check_name), None)


def path_of(root: Path) -> Path:
    return Path(root) / FILE


def load(root: Path) -> list[Waiver]:
    """The waivers a store remembers ([] when it remembers none). ValueError naming the file when it is not
    what bwstack writes (a link, too big, not the format)."""
    path = path_of(root)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file")
        data = handle.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ValueError(f"{path}: larger than {MAX_BYTES} bytes")
    try:
        doc = json.loads(data)
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT}")
        return [parse(f"{row['check']}={row['reason']}") for row in doc["waivers"]]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a bwstack waiver file ({exc})") from None


def save(root: Path, waivers: list[Waiver]) -> bool:
    """Remember exactly these waivers; True when that changed the file. Atomic (a new inode, fsync'd)."""
    path = path_of(root)
    try:
        if load(root) == waivers and path.is_file():
            return False
    except ValueError:
        pass  # a damaged file is replaced
    doc = {"format": FORMAT, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    doc["waivers"] = [asdict(w) for w in waivers]
    fd, tmp = tempfile.mkstemp(prefix=f".{FILE}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(doc, handle, indent=2)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def store_of_env(env: Path) -> Path | None:
    """The store an env belongs to: <root>/generations/<generation>/env -> <root>; None for a plain env."""
    real = Path(env).resolve()
    generation = real.parent
    if (generation / "record.json").is_file() and generation.parent.name == "generations":
        return generation.parent.parent
    return None
