"""The models the lock says a node must serve (`expect.models`): every path SGLang chooses for them on the target
GPU has kernels for it, or the suggested flags take the model onto paths that do (the check then lists them).

The probe plans each model with the node's own SGLang (bwstack.serveplan); the judgement is
bwstack.serveplan.check.judge, the same one `bwstack serve-plan` shows.
"""

from __future__ import annotations

import pytest

from bwstack.checks.session import session_lock
from bwstack.serveplan import catalogue, check


def _profiles(config: pytest.Config) -> list:
    """The profile named on the command line, else every profile: which one a node's env is judged against is
    known only from its generation (the `profile` fixture), after collection."""
    lock = session_lock(config)
    name = config.getoption("--stack-profile")
    return [lock.profile(name)] if name else list(lock.profiles.values())


def _labels(models: list) -> list[str]:
    """One label per entry (the check's name in the verify table): model[+draft], numbered when repeated."""
    labels = [m.model + (f"+{m.draft}" if m.draft else "") for m in models]
    return [f"{label}#{i}" if labels.count(label) > 1 else label for i, label in enumerate(labels)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "served" in metafunc.fixturenames:
        labels = list(dict.fromkeys(label for p in _profiles(metafunc.config) for label in _labels(p.expect.models)))
        metafunc.parametrize("served", labels or ["none"])


def test_every_expected_model_runs_on_kernels_for_the_gpu(
    facts, env, profile, plan_again, served, record_property
):  # fmt: skip
    labels = _labels(profile.expect.models)
    if not labels:
        pytest.skip(f"profile {profile.name} names no models to serve (expect.models)")
    if served not in labels:
        pytest.skip(f"not a model of profile {profile.name}, which the env is judged against")
    if facts.get("serve_plan_profile", profile.name) != profile.name:
        pytest.fail(f"the probe planned profile {facts['serve_plan_profile']}'s models, not {profile.name}'s")
    model_index = labels.index(served)
    observation = facts.get("serve_plan")
    if observation is None:
        pytest.fail("the probe returned no serve plan although the lock names models to serve")
    outcome = check.judge(observation, model_index, catalogue.load(), plan_again)
    for note in outcome.notes:
        record_property("note", note)
    assert outcome.passed, outcome.message
