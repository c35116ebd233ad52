"""Hash-pinned requirement files rendered from the lock, for uv/pip, for Docker layers, and read back.

Each line names the one wheel the target installs, by direct URL, with its sha256:
    torch @ https://files.pythonhosted.org/.../torch-2.9.1-cp312-cp312-manylinux_2_28_x86_64.whl --hash=sha256:...
so `uv pip install --require-hashes --no-deps -r FILE` (or pip) installs exactly the locked closure, and
`bwstack env install --requirements FILE` reads the same file back. A wheel the lock has no hash for is
written without one: --require-hashes then refuses it, which is the point.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import unquote

from packaging.utils import canonicalize_name, parse_wheel_filename

from bwstack.errors import UsageError
from bwstack.lock.model import ImageLayer, LockedPackage, Profile, Wheel
from bwstack.lock.tags import Target, select

LINE_RE = re.compile(r"^(?P<name>[A-Za-z0-9._-]+) @ (?P<url>\S+)(?P<hashes>(?: --hash=sha256:[0-9a-f]{64})*)\s*$")


HEADER = ("# bwstack: profile ", "# rendered from stack.lock.yaml")  # the first lines render() writes


def without_header(text: str) -> list[str]:
    """A rendered file's lines without render()'s header (it names the lock digest, which changes with every
    lock edit): its requirement lines and per-package notes."""
    return [line for line in text.splitlines() if not line.startswith(HEADER)]


def layer_of(name: str, layers: Iterable[ImageLayer]) -> str:
    layers = list(layers)
    for layer in layers:
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in layer.packages):
            return layer.name
    return layers[-1].name


def render(
    profile: Profile,
    packages: Mapping[str, LockedPackage],
    names: Iterable[str] | None = None,
    *,
    title: str = "",
) -> str:
    selection = select(packages, Target.of(profile))
    wanted = sorted(names) if names is not None else sorted(selection)
    lines = [
        f"{HEADER[0]}{profile.name}{(' ' + title) if title else ''}; lock digest {profile.lock_digest()}",
        f"{HEADER[1]} by `bwstack render`; do not edit (re-render instead)",
    ]
    for name in wanted:
        pkg, wheel = selection[name]
        line = f"{name} @ {wheel.url}"
        if wheel.sha256:
            line += f" --hash=sha256:{wheel.sha256}"
        else:
            lines.append(f"# {name} {pkg.version}: no sha256 in the lock ({wheel.hash_source}); needs --allow-unhashed")
        lines.append(line)
    return "\n".join(lines) + "\n"


def render_layers(
    profile: Profile, packages: Mapping[str, LockedPackage], layers: tuple[ImageLayer, ...]
) -> dict[str, str]:
    """One requirement file per image layer, in layer order; every package lands in exactly one."""
    groups: dict[str, list[str]] = {layer.name: [] for layer in layers}
    for name in packages:
        groups[layer_of(name, layers)].append(name)
    return {
        layer: render(profile, packages, names, title=f"layer {i + 1}/{len(groups)} ({layer})")
        for i, (layer, names) in enumerate(groups.items())
    }


def parse(path: Path) -> dict[str, LockedPackage]:
    """Read a rendered file back into packages with exactly one wheel each."""
    packages: dict[str, LockedPackage] = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read requirements: {exc.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = LINE_RE.match(line.strip())
        if not match:
            raise UsageError(f"{path}:{number}: not a bwstack requirement line (NAME @ URL [--hash=sha256:H])")
        url = match.group("url")
        file = unquote(url.rsplit("/", 1)[-1])
        try:
            name, version, _, _ = parse_wheel_filename(file)
        except ValueError:
            raise UsageError(f"{path}:{number}: {file!r} is not a wheel file name") from None
        if canonicalize_name(match.group("name")) != name:
            raise UsageError(f"{path}:{number}: {match.group('name')} does not match the wheel {file}")
        hashes = re.findall(r"[0-9a-f]{64}", match.group("hashes"))
        if len(hashes) > 1:
            raise UsageError(f"{path}:{number}: one wheel takes one hash")
        sha = hashes[0] if hashes else None
        source = "rendered from the lock" if sha else "missing: the lock has no sha256 for it"
        packages[name] = LockedPackage(
            name=name,
            version=str(version),
            index="pypi",
            requires=(),
            wheels=(Wheel(file=file, url=url, sha256=sha, hash_source=source),),
        )
    return packages
