"""`bwstack image verify`: the node checks and the image checks, run against a container of the image.

The checks are tests/infra's (pytest-testinfra), run through the runner of `bwstack verify`
(bwstack.checks.verify) against the host `docker://CONTAINER`; `--stack-image-checks` adds the image's own
(tests/infra/test_image.py: non-root user, labels, history, entrypoint, healthcheck, and with
`--stack-image-scan-ca=PEM` no copy of the CA in a layer), which read the container's image through the Docker
SDK. The container (entrypoint overridden to sleep) is removed afterwards.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bwstack.errors import UsageError
from bwstack.image import daemon
from bwstack.image.labels import ENV_PATH, LABEL_PROFILE
from bwstack.terminal import visible

Log = Callable[[str], None]
CONTAINER_LABEL = "io.bwstack.checks.verify"


def _stderr(message: str) -> None:
    print(visible(message), file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ImageFacts:
    """What the image checks judge: the image's config and history, as the Docker daemon reports them."""

    image_id: str
    config: dict  # the image's Config (User, Labels, Entrypoint, Healthcheck, ...)
    history: tuple[dict, ...]  # `docker history` entries (CreatedBy, ...)

    @property
    def labels(self) -> dict:
        return self.config.get("Labels") or {}


def image_facts(client, image_id: str) -> ImageFacts:
    image = client.images.get(image_id)
    return ImageFacts(image.id, dict(image.attrs.get("Config") or {}), tuple(client.api.history(image.id)))


def container_image_facts(container: str) -> ImageFacts:
    """The image a running container was made from (what the checks see of a `docker://CONTAINER` host)."""
    client = daemon.docker_client(timeout=600)
    return image_facts(client, client.containers.get(container).attrs["Image"])


def verify_image(
    lock,
    image: str,
    *,
    profile_name: str | None = None,
    skip: list[str] | None = None,
    runtime: bool = True,
    gpus: str | None = None,
    scan_ca: str | None = None,
    log: Log = _stderr,
):
    """The image checks and the node checks (tests/infra) run in a container of the image, which is removed
    afterwards. Returns the CheckResults, all under the image's name."""
    from docker.errors import ImageNotFound
    from docker.types import DeviceRequest

    from bwstack.checks import verify as node_verify

    if scan_ca and not Path(scan_ca).is_file():
        raise UsageError(f"--scan-ca {scan_ca}: no such file")
    client = daemon.docker_client(timeout=600)
    try:
        img = client.images.get(image)
    except ImageNotFound:
        raise UsageError(f"no image {image} here (bwstack image build ...)") from None
    labels = (img.attrs.get("Config") or {}).get("Labels") or {}
    name = profile_name or labels.get(LABEL_PROFILE)
    if not name:
        raise UsageError(f"{image} has no {LABEL_PROFILE} label: pass --profile")
    profile = lock.profile(name)
    device_requests = None
    if gpus:
        count = -1 if gpus == "all" else int(gpus)
        device_requests = [DeviceRequest(count=count, capabilities=[["gpu"]])]
    extra_args = ["--stack-image-checks"]
    if scan_ca:
        extra_args.append(f"--stack-image-scan-ca={Path(scan_ca).resolve()}")
    container_name = f"bwstack_verify_{uuid.uuid4().hex[:12]}"
    container = client.containers.run(
        img.id, entrypoint=["sleep"], command=["infinity"], detach=True, name=container_name,
        labels={CONTAINER_LABEL: image}, device_requests=device_requests,
    )  # fmt: skip
    try:
        log(f"verifying {image} (profile {profile.name}) in container {container_name} ...")
        return node_verify.run_checks(
            f"docker://{container_name}", lock_path=lock.path, profile=profile.name, env=ENV_PATH,
            runtime=runtime, skip=skip, extra_args=extra_args, label=image,
        )  # fmt: skip
    finally:
        container.remove(force=True)
