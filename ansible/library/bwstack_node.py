#!/usr/bin/python
"""Ansible module: run bwstack's node operations (build, rollback, cuda) with check mode and --diff.

The work is done by the `bwstack` CLI installed on the node (one implementation for the CLI, the roles and
the Docker build); this module only maps check mode to `bwstack build --check`, reads `changed` from the
JSON bwstack prints, and turns "active generation before -> after" into a diff.
"""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: bwstack_node
short_description: Build, roll back or install a CUDA toolkit with the bwstack CLI on a node
description:
  - Runs C(bwstack build), C(bwstack rollback) or C(bwstack cuda install) on the node and reports
    C(changed) from bwstack's JSON. C(status) changes nothing and returns the active generation (C(active),
    from C(bwstack generations --json); null where there is none or bwstack is not installed yet).
  - In check mode it runs C(bwstack build --check) or C(bwstack cuda status) and changes nothing.
  - With C(--diff) it shows the active generation before and after, and the planned actions.
options:
  bwstack:
    description: The bwstack executable on the node.
    type: path
    required: true
  lock:
    description: The stack lock on the node.
    type: path
    required: true
  action:
    description: What to do.
    type: str
    required: true
    choices: [build, rollback, cuda, status]
  profile:
    description: The lock's profile (empty for its default; for rollback, the newest generation of it).
    type: str
    default: ""
  to:
    description: For rollback, the generation id or name to switch to.
    type: str
    default: ""
  rebuild:
    description: For rollback with nothing to go back to, build the profile from the lock instead of failing.
    type: bool
    default: false
  root:
    description: bwstack's store.
    type: path
    required: true
  ml_env:
    description: The env path users run.
    type: path
    required: true
  cuda_link:
    description: The /usr/local/cuda-style link the switch keeps on the active toolkit (C(none) or empty to leave it).
    type: str
    required: true
  prefix:
    description: For cuda, the install prefix (empty for the profile's cuda.home).
    type: str
    default: ""
  take_over_links:
    description:
      - For build and rollback, let the store re-point an ml-env or CUDA link that another store or somebody else
        made (bwstack's C(--take-over-links)). The roles pass the bwstack role's C(bwstack_take_over_links).
    type: bool
    default: false
  sources:
    description:
      - bwstack's source options, handed to it unchanged (each NAME becomes C(--NAME), underscores as dashes; a
        list repeats the option, true adds the flag, an empty value adds nothing). The roles pass the bwstack
        role's C(bwstack_sources).
    type: dict
    default: {}
    suboptions:
      wheelhouse:
        description: Directories of wheels on the node, used before any index.
        type: list
        elements: str
        default: []
      index:
        description:
          - NAME=URL mirrors for the lock's indexes.
          - Treated as secret (URLs may carry credentials) - never shown in Ansible's output or logs.
        type: list
        elements: str
        default: []
      offline:
        description: Use only the wheelhouses and the node's wheel store.
        type: bool
        default: false
      ca_bundle:
        description: CA bundle for TLS (TLS is always verified).
        type: str
        default: ""
      allow_unhashed:
        description: Packages that may be installed although the lock has no sha256 for them.
        type: list
        elements: str
        default: []
"""

RETURN = r"""
result:
  description: The JSON bwstack printed.
  type: dict
  returned: when bwstack ran
active_before:
  description: The active generation before the run (null when none).
  type: str
  returned: always
active:
  description: For status, the active generation's name (null when none).
  type: str
  returned: action is status
switched:
  description: Whether the active generation changed (services that run from the ml-env need a restart).
  type: bool
  returned: always
"""

import json  # noqa: E402 - Ansible modules keep their documentation first
import os  # noqa: E402
import re  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402


def _parse_json(out: str):
    """bwstack's JSON document; a log line printed before it (some commands do) is skipped."""
    if not out.strip():
        return {}
    starts = [0] + [i + 1 for i, ch in enumerate(out) if ch == "\n" and out[i + 1 : i + 2] in ("{", "[")]
    for start in starts:
        try:
            return json.loads(out[start:])
        except ValueError:
            continue
    return None


def _store_args(p: dict) -> list[str]:
    return ["--root", p["root"], "--ml-env", p["ml_env"], "--cuda-link", p["cuda_link"] or "none"]


def _source_args(p: dict) -> list[str]:
    """The `sources` option as bwstack's own options, unchanged: NAME -> --NAME (a list repeats it, true is the
    bare flag, an empty value is left out). The index mirrors go in BWSTACK_INDEX instead (Runner.run)."""
    args: list[str] = []
    for name, value in (p["sources"] or {}).items():
        if name == "index":
            continue  # in the environment (Runner.run): a command line is readable by every user of the node
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args += [flag] if value else []
        elif isinstance(value, list):
            for item in value:
                args += [flag, item]
        elif value:
            args += [flag, value]
    return args


def _link_args(p: dict) -> list[str]:
    """For the commands that point the ml-env and CUDA links (build, rollback)."""
    return ["--take-over-links"] if p["take_over_links"] else []


def _profile_args(p: dict) -> list[str]:
    return ["--profile", p["profile"]] if p["profile"] else []


def secrets_of(index: list[str]) -> set[str]:
    """What of the index mirrors must never be shown: each entry, its URL, and any user:token in it
    (bwstack's own messages name the URL, not the NAME=URL entry)."""
    out: set[str] = set()
    for item in index:
        url = item.partition("=")[2]
        out.update(v for v in (item, url) if v)
        found = re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://([^/@]+)@", url)
        if found:
            out.add(found.group(1))
    return out


# bwstack's source options (`bwstack build|rollback|cuda install --help`), declared once on the Ansible side here
# and in the bwstack role's argument specs; _source_args passes them on by name.
SOURCE_OPTIONS = {
    "wheelhouse": {"type": "list", "elements": "str", "default": []},
    "index": {"type": "list", "elements": "str", "default": [], "no_log": True},
    "offline": {"type": "bool", "default": False},
    "ca_bundle": {"type": "str", "default": ""},
    "allow_unhashed": {"type": "list", "elements": "str", "default": []},
}


class Runner:
    def __init__(self, module: AnsibleModule) -> None:
        self.module = module
        self.p = module.params
        self.base = [self.p["bwstack"], "--lock", self.p["lock"]]
        module.no_log_values.update(secrets_of((self.p["sources"] or {}).get("index") or []))

    def run(self, *args: str, ok_codes: tuple[int, ...] = (0,)) -> tuple[int, dict, str]:
        cmd = [*self.base, *args]
        mirrors = (self.p["sources"] or {}).get("index") or []
        rc, out, err = self.module.run_command(cmd, environ_update={"BWSTACK_INDEX": "\n".join(mirrors)})
        if rc not in ok_codes:
            lines = [line for line in err.strip().splitlines() if line.strip()]
            errors = [line for line in lines if line.startswith("bwstack: error:")]
            message = (errors or lines or [f"exit {rc}"])[-1].removeprefix("bwstack: error: ")
            self.module.fail_json(
                msg=message, rc=rc, cmd=cmd, stderr_lines=lines[-40:], busy=rc == 3, active_before=None
            )
        payload = _parse_json(out)
        if payload is None:
            self.module.fail_json(msg=f"bwstack printed no JSON: {out[-500:]}", rc=rc, cmd=cmd, active_before=None)
        return rc, payload, err

    def generations(self) -> list[dict]:
        if not os.path.isdir(os.path.join(self.p["root"], "generations")):
            return []
        _, rows, _ = self.run("generations", *_store_args(self.p), "--json")
        return rows if isinstance(rows, list) else []


def _active(rows: list[dict]) -> str | None:
    return next((r["name"] for r in rows if r.get("active")), None)


def _state(ml_env: str, active: str | None, extra: list[str] | None = None) -> str:
    lines = [f"ml_env: {ml_env}", f"active generation: {active or '(none)'}"]
    return "\n".join(lines + [f"# {a}" for a in extra or []]) + "\n"


def do_build(r: Runner) -> dict:
    p = r.p
    rows = r.generations()
    before = _active(rows)
    if r.module.check_mode:
        _, plan, _ = r.run("build", *_profile_args(p), *_store_args(p), *_link_args(p), "--check", "--json")
        after = plan.get("target") if plan.get("changed") else before
        return {
            "changed": bool(plan.get("changed")),
            "switched": False,
            "result": plan,
            "active_before": before,
            "msg": "; ".join(plan.get("actions") or []) or "nothing to do",
            "diff": {"before": _state(p["ml_env"], before), "after": _state(p["ml_env"], after, plan.get("actions"))},
        }
    _, result, err = r.run("build", *_profile_args(p), *_store_args(p), *_link_args(p), *_source_args(p), "--json")
    return {
        "changed": bool(result.get("changed")),
        "switched": result.get("active") != before,
        "result": result,
        "active_before": before,
        "msg": "; ".join(result.get("actions") or []) or "nothing to do",
        "log": err.strip().splitlines()[-60:],
        "diff": {
            "before": _state(p["ml_env"], before),
            "after": _state(p["ml_env"], result.get("active"), result.get("actions")),
        },
    }


def do_rollback(r: Runner) -> dict:
    """The target is bwstack's to choose (bwstack.provision.build.rollback_target, through `bwstack rollback
    [--check]`): this module never picks a generation itself, so check mode predicts what the run does."""
    p = r.p
    rows = r.generations()
    before = _active(rows)
    args = ["rollback", *_store_args(p), *_link_args(p), "--json"]
    if p["to"]:
        args += ["--to", p["to"]]
    elif p["profile"]:
        args += ["--profile", p["profile"]]
    if p["rebuild"]:
        args.append("--rebuild")
    if r.module.check_mode:
        _, plan, _ = r.run(*args, "--check")
        after = plan.get("target") if plan.get("changed") else before
        return {
            "changed": bool(plan.get("changed")),
            "switched": False,
            "result": plan,
            "active_before": before,
            "msg": plan.get("action") or "",
            "diff": {"before": _state(p["ml_env"], before), "after": _state(p["ml_env"], after)},
        }
    # Wheels are only fetched for a rebuild: `bwstack rollback` refuses source options it would not read.
    _, result, err = r.run(*args, *(_source_args(p) if p["rebuild"] else []))
    after = result.get("generation") or result.get("active")
    return {
        "changed": bool(result.get("changed")),
        "switched": after != before,
        "result": result,
        "active_before": before,
        "msg": f"{p['ml_env']} -> {after}" + (f" ({result['note']})" if result.get("note") else ""),
        "log": err.strip().splitlines()[-60:],
        "diff": {"before": _state(p["ml_env"], before), "after": _state(p["ml_env"], after)},
    }


def do_status(r: Runner) -> dict:
    active = _active(r.generations())
    return {"changed": False, "switched": False, "active": active, "active_before": active,
            "msg": f"{r.p['ml_env']}: {active or 'no active generation'}"}  # fmt: skip


def do_cuda(r: Runner) -> dict:
    p = r.p
    prefix = ["--prefix", p["prefix"]] if p["prefix"] else []
    # status reads the toolkit folder only: the store options are for the install (`bwstack cuda` refuses them here)
    rc, status, _ = r.run("cuda", "status", *_profile_args(p), *prefix, "--json", ok_codes=(0, 1))
    before = f"{status.get('home')}: CUDA {status.get('version') or 'absent'} ({status.get('managed_by')})\n"
    if rc == 0 and not status.get("matches") and status.get("managed_by") != "bwstack-pip":
        r.module.fail_json(
            msg=f"{status.get('home')} holds CUDA {status.get('version') or 'of unknown version'}, not "
            f"{status.get('profile_version')}: refusing to touch a toolkit bwstack did not install "
            "(set bwstack_cuda_prefix elsewhere, or bwstack_cuda_method: none)",
            result=status,
            active_before=None,
        )
    if r.module.check_mode or rc == 0:
        after = before if rc == 0 else f"{status.get('home')}: CUDA {status.get('profile_version')} (bwstack-pip)\n"
        return {
            "changed": rc != 0,
            "switched": False,
            "result": status,
            "active_before": None,
            "msg": status.get("note") or "",
            "diff": {"before": before, "after": after},
        }
    _, result, err = r.run("cuda", "install", *_profile_args(p), *prefix, *_store_args(p), *_source_args(p), "--json")
    return {
        "changed": bool(result.get("changed")),
        "switched": False,
        "result": result,
        "active_before": None,
        "msg": result.get("note") or "",
        "log": err.strip().splitlines()[-60:],
        "diff": {
            "before": before,
            "after": f"{result.get('home')}: CUDA {result.get('version')} ({result.get('managed_by')})\n",
        },
    }


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "bwstack": {"type": "path", "required": True},
            "lock": {"type": "path", "required": True},
            "action": {"type": "str", "required": True, "choices": ["build", "rollback", "cuda", "status"]},
            "profile": {"type": "str", "default": ""},
            "to": {"type": "str", "default": ""},
            "rebuild": {"type": "bool", "default": False},
            "root": {"type": "path", "required": True},
            "ml_env": {"type": "path", "required": True},
            "cuda_link": {"type": "str", "required": True},
            "prefix": {"type": "str", "default": ""},
            "sources": {"type": "dict", "default": {}, "options": SOURCE_OPTIONS},
            "take_over_links": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    runner = Runner(module)
    if not os.access(module.params["bwstack"], os.X_OK):
        if module.params["action"] == "status":
            module.exit_json(
                changed=False, switched=False, active=None, active_before=None, msg="bwstack: not installed"
            )
        if module.check_mode:
            module.exit_json(
                changed=True,
                switched=False,
                active_before=None,
                msg=f"bwstack is not installed on this node yet ({module.params['bwstack']}): "
                f"a real run would install it and {module.params['action']} "
                f"{module.params['profile'] or 'the default profile'}",
                diff={
                    "before": "(bwstack not installed)\n",
                    "after": f"{module.params['action']} {module.params['profile']}\n",
                },
            )
        module.fail_json(
            msg=f"bwstack is not installed at {module.params['bwstack']}: "
            "run the bwstack_tool role (provision.yml) first",
            active_before=None,
        )
    actions = {"build": do_build, "rollback": do_rollback, "cuda": do_cuda, "status": do_status}
    result = actions[module.params["action"]](runner)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
