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
