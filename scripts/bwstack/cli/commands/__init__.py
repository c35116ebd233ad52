"""One module per command (pip's `commands/` is the model). Each declares:

    NAME, HELP (and optionally DESCRIPTION)   what `bwstack --help` lists
    add_options(parser)                        its options, shared groups from bwstack.cli.options
    run(args) -> int                           the exit status; the work is done by the layer below

`COMMANDS` is the registry `bwstack.cli.main` builds the parser from, in the order `--help` lists them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

COMMANDS = (
    "lock",
    "show",
    "plan",
    "build",
    "rollback",
    "backup",
    "restore",
    "adopt",
    "generations",
    "prune",
    "fetch",
    "render",
    "env",
    "cuda",
    "patch",
    "features",
    "preflight",
    "probe_bundle",
    "bench",
    "provision",
    "controller_facts",
    "image",
    "accept",
    "serve_plan",
    "verify",
    "waivers",
    "receipt",
    "system_packages",
)


def modules() -> list[ModuleType]:
    return [importlib.import_module(f"{__name__}.{name}") for name in COMMANDS]
