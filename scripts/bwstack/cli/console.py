"""The one place a command writes to the terminal.

A command's result goes to stdout: a table or a sentence for people, or, under --json, exactly one JSON
document and nothing else, so `bwstack X --json | jq` and the Ansible module can read it. Everything said on
the way (progress, warnings, the verdict beside a JSON report) is a human line: on stdout for people, on
stderr under --json. Warnings and refusals always go to stderr.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from bwstack.terminal import visible


class Console:
    def __init__(self, json_mode: bool = False) -> None:
        self.json_mode = json_mode

    @classmethod
    def of(cls, args) -> Console:
        return cls(bool(getattr(args, "json", False)))

    # -------------------------------------------------------------------------------- human lines

    def log(self, message: str) -> None:
        """A progress line: stdout for people, stderr under --json (stdout then carries the JSON only)."""
        _line(sys.stderr if self.json_mode else sys.stdout, message, flush=self.json_mode)

    def note(self, message: str) -> None:
        """A line for the person running the command whatever the mode: warnings, verdicts, hints (stderr)."""
        _line(sys.stderr, message, flush=True)

    def stderr_log(self) -> Callable[[str], None]:
        """A `log=` callback for work whose progress goes to stderr in both modes."""
        return self.note

    # -------------------------------------------------------------------------------- results

    def result(self, payload: object, text: str | Callable[[], str]) -> None:
        """The command's result: `payload` as JSON under --json, else `text` (or what it renders)."""
        if self.json_mode:
            self.json(payload)
        else:
            self.text(text() if callable(text) else text)

    def json(self, payload: object) -> None:
        """One JSON document on stdout."""
        json.dump(payload, sys.stdout, indent=2, sort_keys=False, default=str)
        sys.stdout.write("\n")

    def json_text(self, document: str) -> None:
        """A JSON document already serialised by the layer that owns its format."""
        sys.stdout.write(document.rstrip("\n") + "\n")

    def text(self, text: str) -> None:
        """Human output on stdout (the result of a command without --json)."""
        print(visible(text))

    def raw(self, text: str) -> None:
        """Bytes-exact output on stdout (rendered requirement files)."""
        sys.stdout.write(text)


def _line(stream, message: str, *, flush: bool) -> None:
    """One write for the line and its newline: the fetch's threads log at once, and print() writes the two apart,
    so their lines ran together ("...unverifiedWARNING: ...")."""
    stream.write(visible(message) + "\n")
    if flush:
        stream.flush()
