"""Text bwstack prints for people comes from nodes, recordings, lock files and Ansible, which whoever wrote them
chose: what a terminal would act on, or would not show, is written out."""

from __future__ import annotations

import pytest

from bwstack.terminal import visible


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("\x1b[2J\x1b[HACCEPTED", "\\x1b[2J\\x1b[HACCEPTED"),
        ("a\rb\bc\x07", "a\\x0db\\x08c\\x07"),
        ("\x9b31m", "\\x9b31m"),
        ("node\x7f", "node\\x7f"),
        ("ok \u202etxt.exe", "ok \\u202etxt.exe"),
        ("a\u2066b\u2069", "a\\u2066b\\u2069"),
        ("zero\u200bwidth", "zero\\u200bwidth"),
        ("one\u2028two", "one\\u2028two"),
        ("\ufeffbom", "\\ufeffbom"),
        ("soft\u00adhyphen", "soft\\xadhyphen"),
        ("tag\U000e0041", "tag\\U000e0041"),
        ("private\ue000use", "private\\ue000use"),
    ],
    ids=[
        "escape-sequence",
        "carriage-return-backspace-bell",
        "c1-csi",
        "del",
        "bidi-override",
        "bidi-isolate",
        "zero-width-space",
        "line-separator",
        "bom",
        "soft-hyphen",
        "tag-character",
        "private-use",
    ],
)
def test_what_a_terminal_acts_on_is_written_out(text, shown):
    assert visible(text) == shown


@pytest.mark.parametrize("text", ["a table\twith tabs\nand lines", "GPU0 H200 842 TFLOP/s", "ünïcödé 名前 ✓"])
def test_text_a_terminal_only_shows_is_kept_as_it_is(text):
    assert visible(text) == text


def test_a_single_value_stays_on_its_line():
    from bwstack.terminal import one_line

    assert one_line("Y\nFORGED-3 hmm\r\nx\ry") == "Y\\nFORGED-3 hmm\\nx\\ry"


def test_progress_lines_logged_from_many_threads_at_once_stay_whole_lines(monkeypatch):
    """The fetch's eight threads log at once: print() wrote each line and its newline apart, and two warnings ran
    together on one line. A stream that yields between writes makes that interleaving happen every time."""
    import sys
    import threading
    import time

    from bwstack.cli.console import Console

    class Yielding:
        def __init__(self) -> None:
            self.parts: list[str] = []

        def write(self, text: str) -> int:
            time.sleep(0.0005)  # let another thread write before this one's next write
            self.parts.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    stream = Yielding()
    monkeypatch.setattr(sys, "stdout", stream)
    console = Console()
    threads = [
        threading.Thread(target=lambda n=n: [console.log(f"WARNING: wheel {n}-{i} unverified") for i in range(20)])
        for n in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = "".join(stream.parts).splitlines()
    assert sorted(lines) == sorted(f"WARNING: wheel {n}-{i} unverified" for n in range(8) for i in range(20))
