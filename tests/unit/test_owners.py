"""Decisions and defaults written once (issue 12): each has one owner, which the others call or read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import bwstack

REPO = Path(__file__).resolve().parents[2]
ROLES = REPO / "ansible" / "roles"
PACKAGE = Path(bwstack.__file__).parent
SOURCE_OPTIONS = ("wheelhouse", "index", "offline", "ca_bundle", "allow_unhashed")


def _role_files(pattern: str) -> list[Path]:
    return sorted(ROLES.glob(pattern))


def test_the_store_default_is_written_once_in_python_and_once_in_ansible():
    python = [p for p in PACKAGE.rglob("*.py") if "/opt/bwstack" in p.read_text(encoding="utf-8")]
    assert python == [PACKAGE / "paths.py"]
    yml = [p for p in ROLES.rglob("*.yml") if "/opt/bwstack" in p.read_text()]
    assert sorted(p.relative_to(ROLES).parts[0] for p in yml) == ["bwstack", "bwstack"]  # defaults + its spec


def test_the_shared_settings_are_declared_only_by_the_bwstack_role_which_every_role_depends_on():
    shared = set(yaml.safe_load((ROLES / "bwstack" / "defaults" / "main.yml").read_text()))
    for role in (p for p in ROLES.iterdir() if p.is_dir() and p.name != "bwstack"):
        declared = set(yaml.safe_load((role / "defaults" / "main.yml").read_text()) or {})
        specs = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
        documented = {name for entry in specs.values() for name in entry.get("options") or {}}
        assert not (declared | documented) & shared, (
            f"{role.name} re-declares {sorted((declared | documented) & shared)}"
        )
        # no per-role copy of a source option either (bwstack_tool_offline is another setting: pip's, for
        # bwstack's own dependencies, and defaults to bwstack_offline)
        for name in (declared | documented) - {"bwstack_tool_offline"}:
            assert not name.endswith(tuple(f"_{option}" for option in SOURCE_OPTIONS[1:])), f"{role.name}: {name}"
        deps = yaml.safe_load((role / "meta" / "main.yml").read_text())["dependencies"]
        assert {"role": "bwstack"} in deps, role.name


def test_controller_facts_are_read_by_one_task_file():
    callers = [p for p in ROLES.rglob("tasks/*.yml") if "controller-facts" in p.read_text()]
    assert callers == [ROLES / "bwstack" / "tasks" / "controller_facts.yml"]
    importers = sorted(
        p.relative_to(ROLES).parts[0]
        for p in ROLES.rglob("tasks/*.yml")
        if "tasks_from: controller_facts.yml" in p.read_text()
    )
    assert importers == ["bwstack_cuda", "bwstack_preflight", "bwstack_tool"]


def test_the_module_gets_the_source_options_as_one_value_and_passes_them_on_by_name():
    for path in ROLES.rglob("tasks/*.yml"):
        for task in yaml.safe_load(path.read_text()) or []:
            call = task.get("bwstack_node") if isinstance(task, dict) else None
            if call and call["action"] != "status":  # status fetches nothing
                assert call["sources"] == "{{ bwstack_sources }}", path
                assert not set(call) & set(SOURCE_OPTIONS), path
    import importlib.util

    spec = importlib.util.spec_from_file_location("bwstack_node", REPO / "ansible" / "library" / "bwstack_node.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    got = module._source_args(
        {"sources": {"wheelhouse": ["/a", "/b"], "index": ["pypi=https://m/simple"], "offline": True,
                     "ca_bundle": "/ca.pem", "allow_unhashed": ["torchaudio"]}}
    )  # fmt: skip
    # --index is not among them: the mirrors go in BWSTACK_INDEX (test_ansible.py checks that they get there)
    assert got == ["--wheelhouse", "/a", "--wheelhouse", "/b", "--offline",
                   "--ca-bundle", "/ca.pem", "--allow-unhashed", "torchaudio"]  # fmt: skip
    assert module._source_args({"sources": {"offline": False, "ca_bundle": "", "wheelhouse": []}}) == []
    assert set(module.SOURCE_OPTIONS) == set(SOURCE_OPTIONS)
    role_spec = yaml.safe_load((ROLES / "bwstack" / "meta" / "argument_specs.yml").read_text())
    assert {f"bwstack_{o}" for o in SOURCE_OPTIONS} <= set(role_spec["argument_specs"]["main"]["options"])


# ------------------------------------------------------------------------------------------------ the record


RECORDS = [
    {"id": 3, "profile": "cu130", "nearest_profile": None, "lock_digest": "sha256:ab",
     "cuda_home": "/usr/local/cuda-13.0", "verification": {"status": "passed", "checks": []}},
    {"id": 0, "profile": None, "nearest_profile": "cu128", "origin": "adopted:/opt/ml-env",
     "verification": {"status": "not-run", "why": "adopted as found"}},
    {"id": 1, "profile": None, "nearest_profile": None},
]  # fmt: skip


def test_the_probe_reads_only_fields_the_record_defines_and_agrees_on_the_profile(tmp_path):
    from typing import get_type_hints

    from bwstack.probe import generation
    from bwstack.store.record import GenerationRecord, RecordJSON

    assert set(generation.FIELDS) <= set(get_type_hints(RecordJSON))
    for data in RECORDS:
        gen_dir = tmp_path / f"{data['id']:04d}-x"
        gen_dir.mkdir()
        (gen_dir / generation.RECORD).write_text(json.dumps(data))
        record = GenerationRecord.from_json(data, expected_id=data["id"])
        facts = generation.read(gen_dir)
        assert facts.profile_like == record.profile_like
        assert facts.verification == record.verification_status
        assert generation.GenerationFacts.from_facts(json.loads(json.dumps(facts.as_dict()))) == facts


def test_a_record_is_validated_on_read_and_written_back_unchanged():
    from bwstack.store.record import GenerationRecord, RecordError

    for data in RECORDS:
        record = GenerationRecord.from_json(data)
        written = record.to_json()
        assert {k: v for k, v in written.items() if v not in (None, [], {})} == {
            k: v for k, v in data.items() if v not in (None, [], {})
        }
        assert GenerationRecord.from_json(json.loads(json.dumps(written))) == record
    newer = {"id": 2, "profile": "cu130", "something_new": {"kept": True}}
    assert GenerationRecord.from_json(newer).to_json()["something_new"] == {"kept": True}
    for bad, why in [({"id": "2"}, "`id` is not an integer"), ({"id": 2, "torch": []}, "`torch` is not an object"),
                     ({"id": 2, "profile": 7}, "`profile` is not a string"), ([], "not a JSON object")]:  # fmt: skip
        with pytest.raises(RecordError, match=why):
            GenerationRecord.from_json(bad)
    with pytest.raises(RecordError, match="does not match the directory name"):
        GenerationRecord.from_json({"id": 2}, expected_id=3)


def test_the_profile_a_role_works_on_is_resolved_by_bwstack_never_in_jinja():
    import subprocess
    import sys

    def facts(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "bwstack", "--lock", str(REPO / "stack.lock.yaml"), "controller-facts", *args],
            capture_output=True, text=True,
        )  # fmt: skip

    default = json.loads(facts().stdout)
    assert default["profile"] == default["default_profile"]
    assert json.loads(facts("--profile", "cu128").stdout)["profile"] == "cu128"
    unknown = facts("--profile", "cu999")
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1 and "unknown profile 'cu999'" in unknown.stderr
    for path in ROLES.rglob("tasks/*.yml"):
        assert "default_profile" not in path.read_text(), path
