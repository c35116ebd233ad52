"""The models the lock says a node must serve (`expect.models`): every path SGLang chooses for them on the target
GPU has kernels for it, or the suggested flags take the model onto paths that do (the check then lists them).

The probe plans each model with the node's own SGLang (bwstack.serveplan); the judgement is
bwstack.serveplan.check.judge, the same one `bwstack serve-plan` shows.
"""

from __future__ import annotations

import pytest

from bwstack.checks.session import session_lock
from bwstack.serveplan import catalogue, check


def _models(config: pytest.Config) -> list:
    return list(session_lock(config).profile(config.getoption("--stack-profile")).expect.models)


def _labels(models: list) -> list[str]:
    """One label per entry (the check's name in the verify table): model[+draft], numbered when repeated."""
    labels = [m.model + (f"+{m.draft}" if m.draft else "") for m in models]
    return [f"{label}#{i}" if labels.count(label) > 1 else label for i, label in enumerate(labels)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "served" in metafunc.fixturenames:
        labels = _labels(_models(metafunc.config))
        metafunc.parametrize("served", labels or ["none"])


def test_every_expected_model_runs_on_kernels_for_the_gpu(facts, env, plan_again, served, request, record_property):
    labels = _labels(_models(request.config))
    if served not in labels:
        pytest.skip("the profile names no models to serve (expect.models)")
    model_index = labels.index(served)
    observation = facts.get("serve_plan")
    if observation is None:
        pytest.fail("the probe returned no serve plan although the lock names models to serve")
    outcome = check.judge(observation, model_index, catalogue.load(), plan_again)
    for note in outcome.notes:
        record_property("note", note)
    assert outcome.passed, outcome.message
