"""`--target`: where `provision`, `rollback` and `verify` act, spelled one way for all three.

    local://                                   this machine
    ssh://[user@]host[:port]                   a node over SSH (several: comma-separated)
    ansible://INVENTORY[?limit=PATTERN&group=GROUP]
                                               the hosts of your Ansible inventory (group: default
                                               bwstack_nodes; limit: Ansible's --limit)
    docker://CONTAINER                         a running container (verify only)

and, for SSH, the key and known-hosts file as options (`--ssh-key`, `--known-hosts`), never as
ansible_* extra vars or testinfra's `?ssh_config=`. Each target has a label that keeps its user and port
(`root@node7:2222`): reports and error lines name hosts by it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from bwstack.errors import UsageError

DEFAULT_GROUP = "bwstack_nodes"
# Host and user names a shell, ssh or an inventory cannot misread (no leading '-', no spaces, no quotes).
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.%-]*$")
_HOST = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.-]*|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.%A-Za-z]*)$")
_CONTAINER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class Scheme(Enum):
    LOCAL = "local"
    SSH = "ssh"
    ANSIBLE = "ansible"
    DOCKER = "docker"


USAGE = "local://, ssh://[user@]host[:port], ansible://INVENTORY[?limit=PATTERN&group=GROUP] or docker://CONTAINER"


@dataclass(frozen=True)
class LocalTarget:
    scheme = Scheme.LOCAL

    @property
    def label(self) -> str:
        return "local"


@dataclass(frozen=True)
class SshTarget:
    host: str
    user: str | None = None
    port: int | None = None
    scheme = Scheme.SSH

    @property
    def address(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def label(self) -> str:
        """user@host:port, as given (a port or user left out is left to ssh's configuration)."""
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port else ""
        return f"{user}{self.address}{port}"

    @property
    def inventory_name(self) -> str:
        """The label in the characters an Ansible inventory keeps as one host name (`host:port` it would split)."""
        return re.sub(r"[^A-Za-z0-9@._-]", "_", self.label)


@dataclass(frozen=True)
class AnsibleTarget:
    inventory: Path
    limit: str | None = None
    group: str | None = None
    scheme = Scheme.ANSIBLE

    @property
    def pattern(self) -> str:
        return self.group or DEFAULT_GROUP

    @property
    def label(self) -> str:
        return f"ansible://{self.inventory}"


@dataclass(frozen=True)
class DockerTarget:
    container: str
    scheme = Scheme.DOCKER

    @property
    def label(self) -> str:
        return f"docker://{self.container}"


Target = LocalTarget | SshTarget | AnsibleTarget | DockerTarget


def parse(spec: str | None, allowed: frozenset[Scheme]) -> list[Target]:
    """Comma-separated targets; every bad one is a UsageError naming it."""
    if spec is None or not spec.strip():
        raise UsageError("--target: empty (use " + _usage(allowed) + ")")
    targets: list[Target] = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            raise UsageError(f"--target {spec!r}: an empty target between commas")
        target = _parse_one(item, allowed)
        if target in targets:
            raise UsageError(f"--target {item}: given twice")
        targets.append(target)
    labels = [t.label for t in targets]
    if len(set(labels)) != len(labels):
        raise UsageError(f"--target {spec}: two targets name the same host")
    return targets


def _usage(allowed: frozenset[Scheme]) -> str:
    names = {
        Scheme.LOCAL: "local://",
        Scheme.SSH: "ssh://[user@]host[:port]",
        Scheme.ANSIBLE: "ansible://INVENTORY[?limit=PATTERN&group=GROUP]",
        Scheme.DOCKER: "docker://CONTAINER",
    }
    return ", ".join(names[s] for s in Scheme if s in allowed)


def _parse_one(item: str, allowed: frozenset[Scheme]) -> Target:
    if "\n" in item or "\0" in item:
        raise UsageError(f"--target {item!r}: control characters")
    if item == "local":
        item = "local://"
    if "://" not in item:
        raise UsageError(f"--target {item}: no scheme (use {_usage(allowed)})")
    parts = urlsplit(item)
    try:
        scheme = Scheme(parts.scheme)
    except ValueError:
        raise UsageError(f"--target {item}: unknown scheme {parts.scheme!r} (use {_usage(allowed)})") from None
    if scheme not in allowed:
        raise UsageError(f"--target {item}: {scheme.value}:// is not a target here (use {_usage(allowed)})")
    if scheme is Scheme.LOCAL:
        if parts.netloc or parts.path or parts.query:
            raise UsageError(f"--target {item}: local:// takes nothing after it")
        return LocalTarget()
    if scheme is Scheme.SSH:
        return _parse_ssh(item, parts)
    if scheme is Scheme.DOCKER:
        name = parts.netloc
        if not name or parts.path or parts.query or not _CONTAINER.match(name):
            raise UsageError(f"--target {item}: expected docker://CONTAINER (a container name or id)")
        return DockerTarget(name)
    return _parse_ansible(item, parts)


def _parse_ssh(item: str, parts) -> SshTarget:
    if parts.query or parts.fragment or parts.path not in ("", "/"):
        hint = " (give the key and known-hosts file with --ssh-key and --known-hosts)" if parts.query else ""
        raise UsageError(f"--target {item}: expected ssh://[user@]host[:port], nothing after it{hint}")
    if parts.password is not None:
        raise UsageError(f"--target {item}: no passwords in targets (use --ssh-key)")
    try:
        port = parts.port
    except ValueError:
        raise UsageError(f"--target {item}: the port must be a number from 1 to 65535") from None
    host = parts.hostname
    if not host or not _HOST.match(host):
        raise UsageError(f"--target {item}: expected ssh://[user@]host[:port]")
    if port == 0:
        raise UsageError(f"--target {item}: the port must be a number from 1 to 65535")
    user = parts.username
    if user is not None and not _NAME.match(user):
        raise UsageError(f"--target {item}: {user!r} is not a user name")
    return SshTarget(host=host, user=user, port=port)


def _parse_ansible(item: str, parts) -> AnsibleTarget:
    inventory = parts.netloc + parts.path
    query = parse_qs(parts.query, keep_blank_values=True)
    if "ansible_inventory" in query:
        raise UsageError(
            f"--target {item}: that is testinfra's spelling; bwstack's is ansible://INVENTORY?limit=PATTERN"
        )
    if not inventory:
        raise UsageError(f"--target {item}: expected ansible://INVENTORY[?limit=PATTERN&group=GROUP]")
    unknown = sorted(set(query) - {"limit", "group"})
    if unknown:
        raise UsageError(f"--target {item}: unknown option(s) {', '.join(unknown)} (limit, group)")
    values: dict[str, str] = {}
    for key, got in query.items():
        if len(got) != 1 or not got[0].strip():
            raise UsageError(f"--target {item}: {key} needs exactly one non-empty value")
        values[key] = got[0].strip()
    path = Path(inventory)
    if not path.exists():
        raise UsageError(f"--target {item}: no inventory at {inventory}")
    return AnsibleTarget(path, values.get("limit"), values.get("group"))


# ------------------------------------------------------------------------------------------------ ssh options


@dataclass(frozen=True)
class SshOptions:
    """The SSH identity and known-hosts file for every SSH connection of one command."""

    key: Path | None = None
    known_hosts: Path | None = None

    @classmethod
    def from_args(cls, key: str | None, known_hosts: str | None) -> SshOptions:
        return cls(_readable_file("--ssh-key", key), _readable_file("--known-hosts", known_hosts))

    def __bool__(self) -> bool:
        return self.key is not None or self.known_hosts is not None

    def ansible_vars(self) -> dict[str, str]:
        """Ansible's connection variables (common args reach ssh, scp and sftp alike)."""
        out: dict[str, str] = {}
        if self.key is not None:
            out["ansible_ssh_private_key_file"] = str(self.key)
        if self.known_hosts is not None:
            out["ansible_ssh_common_args"] = shlex.join(
                ["-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes"]
            )
        return out

    def ssh_config_lines(self) -> list[str]:
        """ssh_config(5) lines (paths quoted, '%' escaped: both keywords expand %-tokens)."""
        lines = []
        if self.key is not None:
            lines += [f'IdentityFile "{_ssh_escape(self.key)}"', "IdentitiesOnly yes"]
        if self.known_hosts is not None:
            lines += [f'UserKnownHostsFile "{_ssh_escape(self.known_hosts)}"', "StrictHostKeyChecking yes"]
        return lines


def _ssh_escape(path: Path) -> str:
    return str(path).replace("%", "%%")


def _readable_file(option: str, value: str | None) -> Path | None:
    if value is None:
        return None
    if not value.strip():
        raise UsageError(f"{option}: empty")
    if any(ch in value for ch in '"\n\r\0'):
        raise UsageError(f"{option} {value!r}: quotes and control characters are not allowed in the path")
    path = Path(value).expanduser().absolute()
    if not path.is_file():
        raise UsageError(f"{option} {value}: no such file")
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise UsageError(f"{option} {value}: cannot read it ({exc.strerror})") from None
    return path
