"""The Docker daemon, through the Docker SDK: a client, the bridge the build server listens on, the base image."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bwstack.errors import BwstackError
from bwstack.probe import osrelease

BUILD_TIMEOUT = 6 * 3600

Log = Callable[[str], None]


@dataclass(frozen=True)
class BaseFacts:
    """What the build needs to know of its base image, read from one container of it."""

    image: str
    has_cuda: bool  # /usr/local/cuda exists (else the lock's PyPI toolkit is installed)
    os_release: dict  # its /etc/os-release, parsed


def docker_client(timeout: int = BUILD_TIMEOUT):
    """A Docker SDK client for the daemon of DOCKER_HOST (default: the local socket), or a clear error."""
    try:
        import docker
        from docker.errors import DockerException
    except ImportError:
        raise BwstackError("the `docker` Python package is not installed (pip install 'docker>=7')") from None
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except DockerException as exc:
        raise BwstackError(
            f"no Docker daemon reachable ({str(exc).splitlines()[0][:200]}): start dockerd (or set DOCKER_HOST)"
        ) from None
    return client


def daemon_available() -> tuple[bool, str]:
    try:
        docker_client(timeout=10)
        return True, ""
    except BwstackError as exc:
        return False, str(exc)


def bridge_gateway(client) -> str:
    """The host's address on Docker's default bridge: what the build's RUN containers reach the host at."""
    try:
        config = client.networks.get("bridge").attrs["IPAM"]["Config"] or []
    except Exception as exc:  # docker.errors.NotFound, APIError
        raise BwstackError(f"the Docker daemon has no default bridge network ({exc})") from None
    for entry in config:
        if entry.get("Gateway"):
            return entry["Gateway"]
        if entry.get("Subnet"):
            import ipaddress

            return str(next(ipaddress.ip_network(entry["Subnet"]).hosts()))
    raise BwstackError("the Docker bridge network has no gateway address")


def ensure_image(client, name: str, log: Log) -> None:
    from docker.errors import ImageNotFound

    try:
        client.images.get(name)
    except ImageNotFound:
        log(f"pulling {name} ...")
        try:
            client.images.pull(name)
        except Exception as exc:
            raise BwstackError(f"base image {name} is not here and cannot be pulled: {exc}") from None


_MARK = "bwstack-base-cuda="


def probe_base(client, base: str) -> BaseFacts:
    """/usr/local/cuda and /etc/os-release of the base, from one short container (no network)."""
    script = (
        f"if [ -e /usr/local/cuda ]; then echo {_MARK}yes; else echo {_MARK}no; fi; "
        "cat /etc/os-release 2>/dev/null || cat /usr/lib/os-release 2>/dev/null || true"
    )
    try:
        out = client.containers.run(
            base, entrypoint=["/bin/sh", "-c"], command=[script], remove=True, network_disabled=True,
        ).decode(errors="replace")  # fmt: skip
    except Exception as exc:  # docker.errors.ContainerError (no /bin/sh), APIError
        raise BwstackError(f"cannot run base image {base} to read it: {str(exc).splitlines()[0][:300]}") from None
    has_cuda = f"{_MARK}yes" in out
    release = "\n".join(line for line in out.splitlines() if not line.startswith(_MARK))
    return BaseFacts(base, has_cuda, osrelease.parse(release))
