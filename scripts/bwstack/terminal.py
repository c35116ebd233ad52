"""What reaches a person's terminal: text read from nodes, recordings, lock files and Ansible, which whoever wrote
it chose, written out where a terminal would act on it instead of showing it."""

from __future__ import annotations

import re

# C0 controls but tab and newline, DEL, C1 controls (an escape sequence can clear the screen, set the title or
# print a verdict that is not the report's), and the invisible format characters that reorder or hide text
# (bidirectional overrides and isolates, zero-width characters, the line and paragraph separators, BOM).
_ACTED_ON = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def visible(text: str) -> str:
    """`text` with every character a terminal would act on, or would not show, written out (\\x1b, \\u202e)."""
    return _ACTED_ON.sub(
        lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text
    )
