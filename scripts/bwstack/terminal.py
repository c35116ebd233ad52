"""What reaches a person's terminal: text read from nodes, recordings, lock files and Ansible, which whoever wrote
it chose, written out where a terminal would act on it, or would not show it, instead of passed on."""

from __future__ import annotations

import unicodedata

# Controls (an escape sequence can clear the screen, set the title or print a verdict that is not the report's),
# format characters (bidirectional overrides and isolates, zero-width ones, soft hyphens, tags), the line and
# paragraph separators, private-use, surrogate and unassigned code points. Tab and newline are a table's own.
_HIDDEN = frozenset({"Cc", "Cf", "Zl", "Zp", "Co", "Cs", "Cn"})
_KEPT = frozenset("\t\n")


def _written_out(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def visible(text: str) -> str:
    """`text` with every character a terminal would act on, or would not show, written out (\\x1b, \\u202e)."""
    if text.isascii() and all(" " <= ch <= "~" or ch in _KEPT for ch in text):
        return text
    return "".join(_written_out(ch) if ch not in _KEPT and unicodedata.category(ch) in _HIDDEN else ch for ch in text)


def one_line(value: str) -> str:
    """A single value (a table cell, a detail) that stays on its line: its own line breaks written out, so a value
    read from a node cannot start a line of the report."""
    return value.replace("\r\n", "\\n").replace("\n", "\\n").replace("\r", "\\r")
