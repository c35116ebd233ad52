"""Reading stack.lock.yaml from a possibly hostile world: the bytes, then strict YAML, before any validation.

bwstack runs as root and reads the lock a user names with --lock, so the file is treated as hostile input:

- Only a regular file is read. The path is opened non-blocking and checked with fstat before the first read,
  so a FIFO, a device such as /dev/zero or a directory is refused at once instead of blocking or streaming
  forever. At most MAX_LOCK_BYTES are read (the real lock is ~200 KB).
- YAML that PyYAML would accept silently but that cannot be what the author meant is refused: a key given
  twice in one mapping (PyYAML keeps the last one, so one of two `torch` pins would vanish without a word),
  anchors and aliases (an alias bomb makes a few KB expand to gigabytes when the spec is digested), merge keys
  and nesting deeper than MAX_DEPTH.
- Errors never echo the file's content: PyYAML's messages can quote what they choke on, so only the line,
  the column and a content-free description reach the user.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode

from bwstack.errors import LockError, UsageError

MAX_LOCK_BYTES = 4 << 20
MAX_DEPTH = 32  # the real lock nests 8 deep
MAX_EVENTS = 200_000  # parser events: the real lock has about 9,000; 4 MiB of `[1,1,1,...]` is 2 million (16 s)
MAX_SHOWN = 60  # characters of a key or value an error message may quote
_MERGE_TAG = "tag:yaml.org,2002:merge"
# The parts of a PyYAML problem string that may be file content: anything quoted, except token names
# such as '<block mapping start>'.
_QUOTED = re.compile(r"'(?!<[a-z ]+>')(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")


def shown(value: object) -> str:
    """repr() of a value from the file, cut short: an error names it without pasting megabytes."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def _file_kind(mode: int) -> str:
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def read_lock_text(path: Path) -> str:
    """The lock's text: a regular file of at most MAX_LOCK_BYTES, UTF-8. Never blocks on special files."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such lock file (pass --lock PATH or run from the bwstack checkout)") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the lock: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LockError(str(path), "", f"is {_file_kind(info.st_mode)}, not a regular file: refusing to read it")
        if info.st_size > MAX_LOCK_BYTES:
            raise LockError(str(path), "", _too_large(info.st_size))
        chunks = []
        remaining = MAX_LOCK_BYTES + 1  # one byte more tells a file that grew past the limit
        while remaining > 0 and (chunk := os.read(fd, min(remaining, 1 << 20))):
            chunks.append(chunk)
            remaining -= len(chunk)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the lock: {exc.strerror}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_LOCK_BYTES:
        raise LockError(str(path), "", _too_large(len(data)))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LockError(str(path), "", f"not UTF-8 text (byte {exc.start})") from None


def _too_large(size: int) -> str:
    return f"{size} bytes is more than a lock can be ({MAX_LOCK_BYTES >> 20} MiB): refusing to read it"


class _Refused(Exception):
    """A YAML construct bwstack refuses: where it is and why, with no file content in the message."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.message = message


_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
MAX_NUMBER_TEXT = 80  # characters: every number a lock needs is far shorter (binary 64-bit: 66 with "0b")


class _Strict:
    """Mapping construction that refuses duplicate and merge keys, for PyYAML's safe loaders.

    It lives in the constructor, which is Python for both the libyaml (C) and the pure-Python loader, so the
    same check holds whichever PyYAML was installed with."""

    def construct_mapping(self, node: Node, deep: bool = False) -> dict[Any, Any]:
        if not isinstance(node, MappingNode):
            raise _Refused(node.start_mark.line + 1, "expected a mapping")
        mapping: dict[Any, Any] = {}
        lines: dict[Any, tuple[int, int]] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            column = key_node.start_mark.column + 1
            if key_node.tag == _MERGE_TAG:
                raise _Refused(line, "YAML merge keys (<<) are not allowed in the lock: write the keys out")
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                raise _Refused(line, "a mapping key must be a plain value, not a list or mapping")
            if key in mapping:
                first, first_column = lines[key]
                where = f"lines {first} and {line}"
                if first == line:
                    where = f"line {line}, columns {first_column} and {column}"
                raise _Refused(
                    line,
                    f"duplicate key {shown(key)} ({where}); YAML would keep only the last one silently, "
                    "so bwstack refuses both: keep one",
                )
            mapping[key] = self.construct_object(value_node, deep=deep)
            lines[key] = (line, column)
        return mapping

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        # A sexagesimal number (1:59:59...) is built digit group by digit group in quadratic time: a number that
        # long is refused before it is built (64 bits need at most 22 octal digits plus a sign and a prefix).
        if isinstance(node, ScalarNode) and node.tag in _NUMBER_TAGS and len(node.value) > MAX_NUMBER_TEXT:
            raise _Refused(node.start_mark.line + 1, "a number too large for a lock (more than 64 bits)")
        try:
            value = super().construct_object(node, deep=deep)  # type: ignore[misc]
        except (ValueError, TypeError, OverflowError):  # e.g. `2026-13-01` or `!!int x`: a constructor's own error
            line = node.start_mark.line + 1
            raise _Refused(line, "a value YAML cannot construct (bad date, number or tag)") from None
        # 0x/0b/sexagesimal integers skip Python's limit on digits when read, not when shown in a message: no
        # number in a lock needs more than 64 bits.
        if isinstance(value, int) and not isinstance(value, bool) and abs(value).bit_length() > 64:
            raise _Refused(node.start_mark.line + 1, "a number too large for a lock (more than 64 bits)")
        return value


class StrictCLoader(_Strict, getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """libyaml's parser (when PyYAML has it: the lock is ~4000 lines) with the strict constructor."""


class StrictPyLoader(_Strict, yaml.SafeLoader):
    """PyYAML's pure-Python parser with the strict constructor."""


def _refuse_aliases_and_depth(text: str, loader: type) -> None:
    """One pass over the parser's events (libyaml: ~15 ms for the real lock) before anything is composed."""
    depth = 0
    for count, event in enumerate(yaml.parse(text, Loader=loader), 1):
        line = event.start_mark.line + 1
        if count > MAX_EVENTS:
            raise _Refused(line, f"more than {MAX_EVENTS:,} YAML values: far more than a lock holds")
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _Refused(line, "YAML anchors and aliases (&name, *name) are not allowed in the lock")
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise _Refused(line, f"nested more than {MAX_DEPTH} levels deep")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def _content_free(problem: str) -> str:
    return " ".join(_QUOTED.sub("(...)", problem).split())


def load_yaml(text: str, path: str, loader: type = StrictCLoader) -> Any:
    """The lock's YAML as Python data, or a LockError with a line number and no content of the file."""
    try:
        _refuse_aliases_and_depth(text, loader)
        return yaml.load(text, Loader=loader)
    except _Refused as exc:
        raise LockError(path, f"line {exc.line}", exc.message) from None
    except yaml.reader.ReaderError as exc:
        raise LockError(path, f"character {exc.position}", "not valid YAML: a control character YAML forbids") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise LockError(path, where, f"not valid YAML: {_content_free(problem)}") from None
