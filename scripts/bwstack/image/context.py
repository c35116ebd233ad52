"""What goes into the image's build context: the Dockerfile and what bwstack renders from the lock under inputs/.

One hash-pinned requirement file per image layer (`bwstack render --layers`, minus its lock-digest header so an
unchanged layer stays byte-identical), the profile's cuda-toolkit requirements and the OS packages bwstack picked
for the base image (Lock.system_packages_for; written once the base's /etc/os-release is known). A few KB,
whatever the wheelhouse. A missing or stale closure (a pin edited without `bwstack lock`) is refused here, before
anything else.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from bwstack import paths
from bwstack.errors import UsageError
from bwstack.lock.model import NoSystemPackages, SystemPackages

TAG_TEMPLATE = "bwstack/sglang:{profile}-{digest}"
LAYER_STEP_RE = re.compile(r"^COPY inputs/layers/(\S+) ", re.MULTILINE)
SYSTEM_PACKAGES = "inputs/system-packages.txt"
STEP_SCRIPT = "bwstack-step.py"


@dataclass(frozen=True)
class DockerFiles:
    """docker/: the Dockerfile and the step script its RUNs fetch (shipped with the package as `bwstack_docker`)."""

    directory: Path

    @property
    def dockerfile(self) -> Path:
        return self.directory / "Dockerfile"

    @property
    def step_script(self) -> Path:
        return self.directory / STEP_SCRIPT


def docker_files() -> DockerFiles:
    """$BWSTACK_DOCKER_DIR, the checkout's docker/, or the copy installed with bwstack."""
    found = paths.shipped("docker", "bwstack_docker", "Dockerfile", env="BWSTACK_DOCKER_DIR")
    if found is None:
        raise UsageError(
            "docker/Dockerfile is not installed with this bwstack: reinstall it, run it from its checkout, or set "
            "BWSTACK_DOCKER_DIR to the repository's docker/"
        )
    return DockerFiles(found)


def docker_dir() -> Path:
    return docker_files().directory


@dataclass(frozen=True)
class StagedContext:
    path: Path
    layer_files: Mapping[str, str]  # file name -> text, in layer order
    env_selection: Mapping  # name -> (LockedPackage, Wheel) the target installs
    toolkit_selection: Mapping  # the same for the profile's CUDA toolkit wheels


def dockerfile_layer_files(text: str) -> list[str]:
    """The per-layer requirement files the Dockerfile installs, in its order."""
    return LAYER_STEP_RE.findall(text)


def layer_file_names(lock) -> list[str]:
    return [f"{i:02d}-{layer.name}.txt" for i, layer in enumerate(lock.image_layers, 1)]


def image_tag(template: str, profile) -> str:
    digest = profile.lock_digest().split(":", 1)[1][:12]
    try:
        tag = template.format(profile=profile.name, digest=digest)
    except (KeyError, IndexError, ValueError) as exc:
        raise UsageError(f"--tag {template!r}: {exc}; the fields it may name are {{profile}} and {{digest}}") from None
    if digest not in tag:
        raise UsageError(f"--tag {template!r}: the tag must carry the lock digest (use {{digest}})")
    return tag


def _stable(text: str, header: str) -> str:
    """A rendered file with `header` instead of `bwstack render`'s lock-digest header (which would bust every
    layer's cache on any lock edit); its requirement lines and per-package notes stay as rendered."""
    from bwstack.lock.requirements import without_header

    return "\n".join([header, *without_header(text)]) + "\n"


def stage_context(lock, profile, dest: Path, dockerfile: Path) -> StagedContext:
    """Write the build context: Dockerfile + inputs/ rendered from the lock (the OS packages come later, from
    write_system_packages, once the base image is known)."""
    from bwstack.lock import requirements
    from bwstack.lock.tags import Target, select

    closure = profile.require_closure(lock.path)
    text = dockerfile.read_text(encoding="utf-8")
    want = layer_file_names(lock)
    have = dockerfile_layer_files(text)
    if have != want:
        raise UsageError(
            f"the lock's image.layers render to {', '.join(want)}, but {dockerfile} installs "
            f"{', '.join(have) or 'no layer files'}: give the Dockerfile one COPY + RUN per lock layer, in order"
        )
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "Dockerfile").write_text(text, encoding="utf-8")
    inputs = dest / "inputs"
    layers_dir = inputs / "layers"
    layers_dir.mkdir(parents=True, exist_ok=True)
    rendered = requirements.render_layers(profile, closure.env, lock.image_layers)
    layer_files = {}
    for i, (name, file_name) in enumerate(zip(rendered, want, strict=True), 1):
        header = (
            f"# bwstack image layer {i}/{len(rendered)} ({name}) of profile {profile.name}: hash-pinned, "
            "rendered from the lock (the image's lock digest is in its labels)"
        )
        layer_files[file_name] = _stable(rendered[name], header)
        (layers_dir / file_name).write_text(layer_files[file_name], encoding="utf-8")
    toolkit = inputs / "toolkit"
    toolkit.mkdir(parents=True, exist_ok=True)
    cuda = profile.cuda
    header = f"# bwstack: CUDA {cuda.version} toolkit wheels of profile {profile.name} (bwstack cuda install)"
    (toolkit / "cuda-toolkit.txt").write_text(
        _stable(requirements.render(profile, closure.cuda_toolkit), header), encoding="utf-8"
    )
    key = {
        "profile": profile.name,
        "home": cuda.home,
        "cuda_version": cuda.version,
        "pip": {"version": cuda.pip_version, "components": list(cuda.pip_components)},
        "python": profile.python,
        "platform": profile.platform,
        "requirements": "cuda-toolkit.txt",
    }
    (toolkit / "toolkit.json").write_text(json.dumps(key, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    target = Target.of(profile)
    return StagedContext(dest, layer_files, select(closure.env, target), select(closure.cuda_toolkit, target))


def system_packages_of(lock, base: str, os_release: dict[str, str]) -> SystemPackages:
    """The lock's packages for the base image's OS (the one rule, Lock.system_packages_for); no entry for it is
    refused here, before the build, naming the base."""
    try:
        return lock.system_packages_for(os_release.get("ID"), os_release.get("VERSION_ID"))
    except NoSystemPackages as exc:
        raise UsageError(f"base image {base}: {exc}") from None
    except UsageError as exc:
        raise UsageError(f"base image {base}: {exc}") from None


def write_system_packages(context: Path, picked: SystemPackages) -> Path:
    """inputs/system-packages.txt: the packages bwstack picked for the base's OS, one a line (the Dockerfile
    installs exactly these, with `xargs`: it decides nothing)."""
    path = context / SYSTEM_PACKAGES
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{name}\n" for name in picked.packages), encoding="utf-8")
    return path


def check_kept_context(dest: Path) -> None:
    """--context-dir names a folder this run makes: an existing one (anyone's, links and files already inside
    it) is refused, and so is one that would be made where others could write and swap it."""
    from bwstack.store.layout import check_private_folder

    if os.path.lexists(dest):
        raise UsageError(f"--context-dir {dest}: it exists; name a new folder (bwstack makes it)")
    check_private_folder(dest, "--context-dir", "--context-dir")
    if os.path.isdir(dest.parent):  # as keep_context judges it, before the build (a shared /tmp is not this user's)
        check_private_folder(dest.parent, "--context-dir's folder", "--context-dir")


def keep_context(staged: Path, dest: Path) -> None:
    """A copy of the staged context at dest, made in a folder created here (exclusively): the operator reads it,
    Docker builds from the private one, so nothing written to dest can change the image."""
    from bwstack.store.layout import check_private_folder

    check_kept_context(dest)
    os.makedirs(dest.parent, exist_ok=True)
    # The folders made just now sit below one that may be shared and sticky (/tmp): another user could have made
    # one of them first, and makedirs takes it as it finds it. The folder dest goes into must be this user's.
    check_private_folder(dest.parent, "--context-dir's folder", "--context-dir")
    try:
        os.mkdir(dest, 0o755)
    except FileExistsError:
        raise UsageError(f"--context-dir {dest}: it appeared during the build; name a new folder") from None
    shutil.copytree(staged, dest, symlinks=True, dirs_exist_ok=True)
