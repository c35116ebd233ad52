"""The field-report catalogue (data/known_issues.yaml): validated on load; an entry speaks only for the releases its
ranges name, and a release outside them gets "not catalogued", never a guess."""

from __future__ import annotations

import copy
from importlib import resources

import pytest
import yaml

from bwstack.serveplan import catalogue
from bwstack.serveplan.catalogue import Applies, CatalogueError, Kind

FP4 = ("dense GEMM", "flashinfer mm_fp4 (cutlass)")


def _real() -> dict:
    return yaml.safe_load(resources.files("bwstack.data").joinpath("known_issues.yaml").read_text())


def test_the_shipped_catalogue_loads_and_every_entry_names_its_sources():
    cat = catalogue.load()
    assert {i.id for i in cat.issues} >= {"flashinfer-mm-fp4-cutlass-zeros-sm120", "deepgemm-no-sm120"}
    for issue in cat.issues:
        assert issue.sources and all(s.startswith("https://github.com/") for s in issue.sources), issue.id
        assert issue.affects and issue.capabilities and issue.evidence
    assert cat.remedies and all(r.flags or r.env for r in cat.remedies)


def test_an_entry_applies_inside_its_range():
    (finding,) = catalogue.load().findings(*FP4, "12.0", {"flashinfer-python": "0.6.3"})
    assert finding.applies is Applies.YES and finding.issue.kind is Kind.WRONG_RESULTS
    assert finding.detail == "flashinfer-python 0.6.3"


@pytest.mark.parametrize("version", ["0.6.4", "0.6.2", "0.7.0", "0.6.3.post1"])
def test_a_release_outside_every_range_gets_no_verdict(version):
    (finding,) = catalogue.load().findings(*FP4, "12.0", {"flashinfer-python": version})
    assert finding.applies is Applies.NOT_CATALOGUED and finding.detail == f"flashinfer-python {version}"


def test_distribution_names_are_compared_after_normalisation():
    (finding,) = catalogue.load().findings(*FP4, "12.0", {"FlashInfer_Python": "0.6.3"})
    assert finding.applies is Applies.YES


def test_another_capability_or_path_is_not_matched():
    cat = catalogue.load()
    assert cat.findings(*FP4, "10.0", {"flashinfer-python": "0.6.3"}) == []
    assert cat.findings("dense GEMM", "cublas", "12.0", {"flashinfer-python": "0.6.3"}) == []


def test_an_uninstalled_package_is_said_so():
    (finding,) = catalogue.load().findings("dense GEMM", "deep_gemm", "12.0", {"sgl-kernel": None})
    assert finding.applies is Applies.NOT_INSTALLED


def test_a_fixed_range_is_reported_as_fixed():
    doc = _real()
    doc["issues"]["deepgemm-no-sm120"]["fixed"] = {"sgl-kernel": ">=0.4"}
    cat = catalogue.parse(yaml.safe_dump(doc))
    (finding,) = cat.findings("dense GEMM", "deep_gemm", "12.0", {"sgl-kernel": "0.4.1"})
    assert finding.applies is Applies.FIXED


def test_remedies_match_their_component_and_backend():
    cat = catalogue.load()
    moe = cat.remedies_for("MoE", "flashinfer_mxfp4")
    assert [r.flags for r in moe] == [("--moe-runner-backend", "triton"), ("--moe-runner-backend", "triton_kernel")]
    deep_gemm = cat.remedies_for("MoE", "deep_gemm")
    assert {"SGLANG_ENABLE_JIT_DEEPGEMM": "0"} in [dict(r.env) for r in deep_gemm]


def _mutate(path: str, value):
    def apply(doc: dict) -> None:
        *parents, last = path.split("/")
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return apply


DELETE = object()
ISSUE = "issues/deepgemm-no-sm120"
BAD = [
    ("range-not-a-specifier", _mutate(f"{ISSUE}/affects/sgl-kernel", "0.3.21"), "sgl-kernel: '0.3.21' is not a valid"),
    ("range-open", _mutate(f"{ISSUE}/affects/sgl-kernel", "!=0.3.20"), "sgl-kernel: '!=0.3.20' names no version"),
    ("range-a-number", _mutate(f"{ISSUE}/affects/sgl-kernel", 0.3), "affects.sgl-kernel: expected a version specifier"),
    ("no-affects", _mutate(f"{ISSUE}/affects", DELETE), "issues.deepgemm-no-sm120.affects: required key is missing"),
    ("empty-affects", _mutate(f"{ISSUE}/affects", {}), "affects: expected a mapping of distribution names"),
    ("kind-unknown", _mutate(f"{ISSUE}/kind", "slow"), "kind: expected one of crash, wrong-results, got 'slow'"),
    ("source-http", _mutate(f"{ISSUE}/sources/0", "http://x.org/1"), "sources[0]: 'http://x.org/1' is not an https"),
    ("no-sources", _mutate(f"{ISSUE}/sources", []), "sources: expected a non-empty list of strings"),
    ("capability-bad", _mutate(f"{ISSUE}/capabilities/0", "sm120"), "capabilities[0]: 'sm120' is not valid"),
    ("unknown-key", _mutate(f"{ISSUE}/severity", "high"), "issues.deepgemm-no-sm120.severity: unknown key"),
    ("match-without-backend", _mutate(f"{ISSUE}/matches/0", {"component": "MoE"}), "matches[0].backend: required key"),
    ("avoid-empty", _mutate(f"{ISSUE}/avoid", {}), "avoid: say what avoids it (flags, env) or that nothing does"),
    ("avoid-env-lowercase", _mutate(f"{ISSUE}/avoid/env", {"jit": "0"}), "avoid.env.jit: not an environment variable"),
    ("bad-id", lambda d: d["issues"].update({"Bad_ID": d["issues"]["deepgemm-no-sm120"]}), "issues.Bad_ID: ids are"),
    ("remedy-without-change", _mutate("remedies/0/flags", DELETE), "remedies[0].flags: flags and the server_args"),
    ("remedy-flag-not-a-flag", _mutate("remedies/0/flags/0", "attention-backend"), "remedies[0].flags[0]: "),
    ("remedy-arg-name", _mutate("remedies/0/server_args", {"Attention Backend": "triton"}), "remedies[0].server_args"),
    ("remedy-no-why", _mutate("remedies/0/why", DELETE), "remedies[0].why: required key is missing"),
    # the draft's rows are "attention (draft decode)" and "(draft extend)": a remedy for "(draft)" never applied
    ("remedy-component-no-plan-has", _mutate("remedies/0/component", "attention (draft)"),
     "remedies[0].component: 'attention (draft)' is no component of a plan"),
    ("match-component-no-plan-has", _mutate(f"{ISSUE}/matches/0/component", "GEMM"), "matches[0].component: 'GEMM'"),
    ("remedies-not-a-list", _mutate("remedies", {}), "(top level).remedies: expected a list"),
    ("top-level-unknown", _mutate("notes", "x"), "(top level).notes: unknown key"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "mutation", "expected"), BAD, ids=[c[0] for c in BAD])
def test_a_malformed_catalogue_is_refused_naming_the_entry_and_key(case, mutation, expected):
    doc = copy.deepcopy(_real())
    mutation(doc)
    with pytest.raises(CatalogueError) as raised:
        catalogue.parse(yaml.safe_dump(doc, sort_keys=False))
    message = str(raised.value)
    assert message.startswith("data/known_issues.yaml: ") and "\n" not in message
    assert expected in message


def test_not_yaml_is_refused_in_one_line():
    with pytest.raises(CatalogueError, match="not valid YAML"):
        catalogue.parse("issues: [\n  - {")
