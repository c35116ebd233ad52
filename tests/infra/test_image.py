"""The image checks: the container image of a `docker://CONTAINER` host, read through the Docker SDK.

Run by `bwstack image verify IMAGE` (through the runner of `bwstack verify`, in a container of the image), or
as `pytest tests/infra --hosts=docker://CONTAINER --stack-image-checks [--stack-image-scan-ca=PEM]`. Without
--stack-image-checks they are left out (a node has no image).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bwstack.image import labels, scan
from bwstack.image.verify import ImageFacts, container_image_facts

pytestmark = pytest.mark.image


@pytest.fixture(scope="module")
def image(host) -> ImageFacts:
    container = getattr(host.backend, "name", None)
    if host.backend.NAME != "docker" or not container:
        pytest.fail(f"the image checks need a docker://CONTAINER host, not {host.backend.get_pytest_id()}")
    return container_image_facts(container)


def test_image_runs_as_a_non_root_user(image):
    user = (image.config.get("User") or "").split(":")[0]
    assert user not in ("", "0", "root"), f"Config.User is {user or 'unset (root)'}"


def test_image_labels_carry_the_lock_digest(image, profile):
    have, digest = image.labels.get(labels.LABEL_DIGEST), profile.lock_digest()
    assert have == digest and image.labels.get(labels.LABEL_PROFILE) == profile.name, (
        f"labels say {image.labels.get(labels.LABEL_PROFILE)} {have}; the lock's {profile.name} is {digest}: "
        "the image was built from another lock (rebuild it, or verify with the lock it was built from)"
    )


def test_image_history_shows_no_ca_or_secret(image):
    problems = scan.history_problems(list(image.history))
    assert not problems, "; ".join(problems[:3])


def test_image_entrypoint_is_sglang_launch_server(image):
    entry = image.config.get("Entrypoint") or []
    assert entry == labels.ENTRYPOINT, f"Entrypoint is {entry}"


def test_image_has_a_healthcheck(image):
    assert (image.config.get("Healthcheck") or {}).get("Test"), "no HEALTHCHECK"


@pytest.mark.image_scan_ca
def test_image_layers_hold_no_copy_of_the_ca(image, request, record_property):
    from bwstack.image import daemon

    pem = Path(request.config.getoption("--stack-image-scan-ca")).read_text(encoding="utf-8", errors="replace")
    client = daemon.docker_client(timeout=600)
    hits, searched = scan.scan_for_ca(client, image.image_id, pem, image.labels.get(labels.LABEL_BASE, ""))
    assert not hits, "; ".join(hits[:5])
    record_property("note", f"{searched} certificate(s) searched")
