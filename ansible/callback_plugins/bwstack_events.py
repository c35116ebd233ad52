# bwstack's event callback: one JSON line per task start and per host result, appended to the file named by
# $BWSTACK_EVENTS (nothing when it is unset). `bwstack provision` reads it to print one line per phase with its
# time and, on failure, the failing task's message; Ansible's own output goes to a log file. Enabled by
# `bwstack provision` through ANSIBLE_CALLBACKS_ENABLED; running the playbooks by hand leaves it off.
from __future__ import annotations

import contextlib
import json
import os
import time

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
    name: bwstack_events
    type: aggregate
    short_description: task and result events as JSON lines, for bwstack provision
    description:
      - Appends one JSON object per task start and per host result to the file named by BWSTACK_EVENTS.
    requirements:
      - the BWSTACK_EVENTS environment variable
"""

_KEEP = ("changed", "failed", "skipped", "unreachable", "rc", "delta", "msg", "stdout", "stderr_lines")
_MAX_TEXT = 64 << 10


def _short(value):
    if isinstance(value, str) and len(value) > _MAX_TEXT:
        return value[:_MAX_TEXT]
    if isinstance(value, list):
        return [_short(v) for v in value[-40:]]
    return value


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "bwstack_events"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        path = os.environ.get("BWSTACK_EVENTS")
        self._out = open(path, "a", buffering=1, encoding="utf-8") if path else None  # noqa: SIM115

    def _emit(self, event: dict) -> None:
        if self._out is None:
            return
        event["t"] = time.time()
        with contextlib.suppress(OSError, TypeError, ValueError):
            self._out.write(json.dumps(event, default=str) + "\n")

    @staticmethod
    def _role(task) -> str:
        role = getattr(task, "_role", None)
        return role.get_name() if role is not None else ""

    def v2_playbook_on_play_start(self, play):
        self._emit({"event": "play", "name": play.get_name()})

    def v2_playbook_on_task_start(self, task, is_conditional):
        self._emit({"event": "task", "name": task.get_name(), "role": self._role(task), "action": task.action})

    def v2_playbook_on_handler_task_start(self, task):
        self._emit({"event": "task", "name": task.get_name(), "role": self._role(task), "action": task.action})

    def _result(self, status: str, result) -> None:
        raw = result._result if isinstance(result._result, dict) else {}
        if raw.get("_ansible_no_log"):
            raw = {k: raw[k] for k in ("changed", "failed", "skipped", "unreachable", "rc") if k in raw}
        kept = {k: _short(raw[k]) for k in _KEEP if k in raw}
        if isinstance(raw.get("result"), dict):  # bwstack_node: the command's JSON (the build's timings)
            kept["result"] = {k: raw["result"][k] for k in ("timings", "actions", "generation") if k in raw["result"]}
        if "results" in raw and isinstance(raw["results"], list):  # loops: the failing item's message
            failed = [r for r in raw["results"] if isinstance(r, dict) and r.get("failed")]
            if failed and "msg" not in kept:
                kept["msg"] = _short(str(failed[-1].get("msg", "")))
        self._emit(
            {
                "event": status,
                "host": result._host.get_name(),
                "task": result._task.get_name(),
                "role": self._role(result._task),
                "ignore_errors": bool(getattr(result._task, "ignore_errors", False)),
                "result": kept,
            }
        )

    def v2_runner_on_ok(self, result):
        self._result("ok", result)

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._result("failed", result)

    def v2_runner_on_skipped(self, result):
        self._result("skipped", result)

    def v2_runner_on_unreachable(self, result):
        self._result("unreachable", result)

    def v2_playbook_on_stats(self, stats):
        hosts = {h: stats.summarize(h) for h in sorted(stats.processed)}
        self._emit({"event": "stats", "hosts": hosts})
