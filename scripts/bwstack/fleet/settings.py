"""What a playbook run is told, as typed values: the CLI builds these from its option groups, the fleet layer
never sees an argparse namespace.

Paths here are paths on the targets (a wheelhouse, a CA bundle, the store), so nothing is checked against
this machine's filesystem; only what the controller itself reads (the SSH key and known-hosts file, in
`hostspec.SshOptions`) is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bwstack.checks import hostspec


@dataclass(frozen=True)
class SourceSettings:
    """Where the targets get wheels: --wheelhouse, --index NAME=URL, --offline, --ca-bundle, --allow-unhashed."""

    wheelhouse: tuple[str, ...] = ()
    index: tuple[str, ...] = ()
    offline: bool = False
    ca_bundle: str | None = None
    allow_unhashed: tuple[str, ...] = ()


@dataclass(frozen=True)
class StoreSettings:
    """The store on the targets: --root, --ml-env, --cuda-link (None: the inventory's or the roles' default), and
    --take-over-links (False: the inventory's or the roles' default)."""

    root: str | None = None
    ml_env: str | None = None
    cuda_link: str | None = None
    take_over_links: bool = False


@dataclass(frozen=True)
class TargetSettings:
    """--target and the SSH settings for its hosts."""

    spec: str = "local://"
    ssh: hostspec.SshOptions = field(default_factory=hostspec.SshOptions)


@dataclass(frozen=True)
class PlaybookSettings:
    """Everything `run_playbook` needs besides the playbook's own variables."""

    lock: str
    target: TargetSettings = field(default_factory=TargetSettings)
    store: StoreSettings = field(default_factory=StoreSettings)
    sources: SourceSettings = field(default_factory=SourceSettings)
    waivers: tuple[str, ...] = ()  # CHECK=REASON, already checked against the known checks
    extra_vars: tuple[str, ...] = ()  # -e, passed to ansible-playbook as given
    check: bool = False
    diff: bool = False
