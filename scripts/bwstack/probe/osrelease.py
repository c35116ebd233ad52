"""/etc/os-release, read once here: the probe reports it, and the lock layer maps it to the lock's system packages
(`bwstack.lock.model.system_packages_for`). Standard library only: this ships to nodes inside the probe."""

from __future__ import annotations

import shlex
from pathlib import Path

PATH = Path("/etc/os-release")


def parse(text: str) -> dict[str, str]:
    """KEY=value lines (values optionally quoted, shell style); comments, blank and malformed lines are ignored."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        try:
            words = shlex.split(value)
        except ValueError:
            words = [value.strip("\"'")]
        out[key.strip()] = words[0] if words else ""
    return out


def read(path: Path = PATH) -> dict[str, str]:
    """This host's os-release ({} where it cannot be read)."""
    try:
        return parse(path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return {}
