"""The built-in reference model configs (probe/models/<name>/): Hugging Face config files, no weights.

Standard library only: this module also runs on target hosts inside the probe zipapp, where the files are read
from the archive through importlib.resources.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path

CONFIG_FILES = ("config.json", "hf_quant_config.json")
SOURCE_FILE = "source.json"


def _root():
    return resources.files("bwstack.probe").joinpath("models")


@cache
def reference_names() -> tuple[str, ...]:
    return tuple(sorted(entry.name for entry in _root().iterdir() if entry.joinpath("config.json").is_file()))


def source(name: str) -> dict:
    """Where the reference's files come from (repo, URLs, shape, note)."""
    return json.loads(_root().joinpath(name, SOURCE_FILE).read_text(encoding="utf-8"))


def files(name: str) -> dict[str, bytes]:
    folder = _root().joinpath(name)
    return {f: folder.joinpath(f).read_bytes() for f in CONFIG_FILES if folder.joinpath(f).is_file()}


def materialize(name: str, dest: Path) -> Path:
    """Write the reference's config files into dest/<name> (a model directory SGLang can read) and return it."""
    if name not in reference_names():
        raise KeyError(name)
    folder = Path(dest) / name
    folder.mkdir(parents=True, exist_ok=True)
    for filename, data in files(name).items():
        (folder / filename).write_bytes(data)
    return folder
