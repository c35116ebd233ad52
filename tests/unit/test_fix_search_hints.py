"""A verify's fix search asks the node to plan the model again with candidate flags, and each ask starts SGLang
in a new interpreter. The node remembers what the fix search of a job asked on a generation; the next probe of
the same job on it plans those requests beside the model's own, in the same interpreter, and the fix search takes
them from there when it asks the same again (exactly the same requests; anything else is planned as before).
The store is a TEST FIXTURE stack's; the observations are the RECORDED serve-plan fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import needs_py312

from bwstack.probe import sealed
from bwstack.probe.serveplan import node
from bwstack.serveplan import assemble, catalogue

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "serveplan"
DEVICE = {"mode": "auto", "capability": "12.0", "count": 8, "memory_mib": 98304, "name": "RTX", "interconnect": "pcie"}
JOB = {"device": DEVICE, "requests": [{"id": "model-0", "model": "llama-3.1-8b-instruct", "tp": 8}]}
TRITON = {"model": "llama-3.1-8b-instruct", "tp": 8, "server_args": {"attention_backend": "triton"}, "env": {}}
NO_DEEPGEMM = {**TRITON, "server_args": {}, "env": {"SGLANG_ENABLE_JIT_DEEPGEMM": "0"}}


@pytest.fixture
def built(stack):
    stack.build("fixture-new", check=True)
    return stack


def recorded(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@needs_py312
def test_what_a_fix_search_asked_is_planned_beside_the_same_job_next_time(built):
    node.remember_asked(built.ml_env, JOB, [{**TRITON, "id": "fix-0"}])
    hints = node.hinted_requests(built.ml_env, JOB)
    assert [{k: v for k, v in h.items() if k != "id"} for h in hints] == [TRITON]
    assert all(h["id"].startswith("hint-") for h in hints)


@needs_py312
def test_another_job_gets_no_hints(built):
    node.remember_asked(built.ml_env, JOB, [TRITON])
    other = {**JOB, "requests": [{"id": "model-0", "model": "gpt-oss-20b", "tp": 8}]}
    assert node.hinted_requests(built.ml_env, other) == []


@needs_py312
def test_a_hint_that_would_need_an_interpreter_of_its_own_is_left_out(built):
    node.remember_asked(built.ml_env, JOB, [TRITON, NO_DEEPGEMM])
    assert [h["env"] for h in node.hinted_requests(built.ml_env, JOB)] == [{}]


@needs_py312
def test_a_request_the_job_plans_anyway_is_not_planned_twice(built):
    same = {"model": "llama-3.1-8b-instruct", "tp": 8, "server_args": {}, "env": {}}  # as a fix search asks
    node.remember_asked(built.ml_env, JOB, [same])
    assert node.hinted_requests(built.ml_env, JOB) == []


@needs_py312
@pytest.mark.parametrize(
    "hint",
    [
        {**TRITON, "model": "deepseek-v3"},
        {**TRITON, "tp": 1},
        {**TRITON, "draft": "sglang-eagle3-llama-3.1-8b-instruct"},
        {**TRITON, "server_args": {"attention_backend": ["triton"]}},
        {**TRITON, "server_args": {"not an identifier": 1}},
    ],
    ids=["another-model", "another-tp", "a-draft-added", "argument-not-a-value", "argument-not-a-name"],
)
def test_a_hint_is_only_the_jobs_own_request_with_other_server_arguments(built, hint):
    node.remember_asked(built.ml_env, JOB, [hint])
    assert node.hinted_requests(built.ml_env, JOB) == []


@needs_py312
def test_when_planning_with_hints_fails_they_are_forgotten_and_the_job_is_planned_without_them(built, monkeypatch):
    node.remember_asked(built.ml_env, JOB, [TRITON])
    planned: list[int] = []

    def observe(env, device, requests, cuda=None, stand_in=None, speculate=None):
        planned.append(len(requests))
        result = node.Observation(device=device, requests=list(requests))
        if len(requests) > 1:  # the interpreter that had the hint in it crashed, taking every request along
            result.error = "the env's interpreter exited -11 without a result"
        else:
            result.inenv = {"observations": [{"id": "model-0", "steps": {}}]}
        return result

    monkeypatch.setattr(node, "observe", observe)
    device = node.Device("simulated", "12.0", 8, 98304, "RTX", "pcie")
    observed = node.observe_job(built.ml_env, device, JOB)
    assert planned == [2, 1] and observed.error is None
    assert node.hinted_requests(built.ml_env, JOB) == []


@needs_py312
@pytest.mark.parametrize(
    "remembered",
    [{"not": "a list"}, ["a string", 3, None], [{"model": 5}], [{"model": "m", "env": "not a mapping"}]],
    ids=["not-a-list", "not-requests", "model-not-a-name", "env-not-a-mapping"],
)
def test_damaged_hints_are_ignored(built, remembered):
    sealed.save_derived(built.ml_env, sealed.derived_key(built.ml_env, "fix-search-asked", JOB), remembered)
    assert node.hinted_requests(built.ml_env, JOB) == []


def test_an_ask_is_answered_from_the_probe_when_it_planned_exactly_those_requests():
    run = recorded("gpt-oss-20b-tp8-sm120")["runs"][0]
    asked = [run["requests"][2], run["requests"][0]]
    answered = assemble.already_planned(run, asked)
    assert answered is not None
    for index, original in ((0, 2), (1, 0)):
        got = assemble.plan_for(answered, index, catalogue.load())
        assert got == assemble.plan_for(run, original, catalogue.load())


@pytest.mark.parametrize(
    "change",
    [
        lambda r: {**r, "server_args": {**r["server_args"], "sampling_backend": "flashinfer"}},
        lambda r: {**r, "env": {"SGLANG_ENABLE_JIT_DEEPGEMM": "0"}},
        lambda r: {**r, "tp": 4},
    ],
    ids=["other-flags", "other-environment", "other-tp"],
)
def test_an_ask_the_probe_did_not_plan_exactly_is_planned_on_the_node(change):
    run = recorded("gpt-oss-20b-tp8-sm120")["runs"][0]
    assert assemble.already_planned(run, [change(run["requests"][0])]) is None


def test_an_observation_that_failed_answers_nothing():
    run = recorded("gpt-oss-20b-tp8-sm120")["runs"][0]
    assert assemble.already_planned({**run, "error": "the env's interpreter exited 1"}, run["requests"][:1]) is None


# A fix search's answer on a generation as sealed is kept with the verify job's recorded plan: the next verify
# of the unchanged generation reuses that plan and its fix search finds the answer there, without starting the
# probe again (a verify recorded at build time, before any fix search asked, would otherwise ask every time).


def _split(run: dict, *indices: int) -> dict:
    """The recorded run as if only the requests at `indices` had been planned in it."""
    found = run["inenv"]["observations"]
    return {
        **run,
        "requests": [run["requests"][i] for i in indices],
        "inenv": {**run["inenv"], "observations": [found[i] for i in indices]},
    }


def test_a_fix_search_answer_is_folded_into_the_recorded_plan_of_its_job():
    run = recorded("gpt-oss-20b-tp8-sm120")["runs"][0]
    folded = node.fold_into(_split(run, 0), _split(run, 2), own=1)
    assert folded is not None
    answered = assemble.already_planned(folded, [run["requests"][2]])
    assert answered is not None
    assert assemble.plan_for(answered, 0, catalogue.load()) == assemble.plan_for(run, 2, catalogue.load())
    assert assemble.already_planned(folded, [run["requests"][0]]) is not None  # the job's own plan is kept


def test_a_request_the_recorded_plan_holds_is_not_folded_twice():
    run = recorded("gpt-oss-20b-tp8-sm120")["runs"][0]
    folded = node.fold_into(_split(run, 0, 2), _split(run, 2), own=1)
    assert folded is not None and len(folded["requests"]) == len(folded["inenv"]["observations"]) == 2


def _other(run: dict, where: str, value: object) -> dict:
    if where.startswith("inenv."):
        return {**run, "inenv": {**run["inenv"], where.split(".", 1)[1]: value}}
    return {**run, where: value}


@pytest.mark.parametrize(
    ("side", "where", "value"),
    [
        ("answer", "error", "the env's interpreter exited -11 without a result"),
        ("recorded", "error", "the env's interpreter exited 1"),
        ("answer", "inenv.error", "sglang failed to import"),
        ("answer", "device", {**DEVICE, "count": 4}),
        ("answer", "kernels", {}),
        ("answer", "features", {}),
        ("answer", "inenv.versions", {"sglang": "0.5.8"}),
        ("answer", "inenv.sglang_device_view", {}),
        ("answer", "inenv.observations", []),
        ("recorded", "inenv", "not a mapping"),
        ("recorded", "requests", 1),
        ("recorded", "inenv.observations", 7),
        ("answer", "requests", True),
    ],
    ids=[
        "answer-failed",
        "recorded-failed",
        "answer-interpreter-failed",
        "other-device",
        "other-kernel-facts",
        "other-feature-facts",
        "other-sglang",
        "other-device-view",
        "observations-missing",
        "recorded-damaged",
        "recorded-requests-not-a-list",
        "recorded-observations-not-a-list",
        "answer-requests-not-a-list",
    ],
)
def test_an_answer_that_is_not_the_same_observation_is_not_folded(side, where, value):
    run = recorded("gpt-oss-20b-tp8-sm120")["runs"][0]
    recorded_plan, answer = _split(run, 0), _split(run, 2)
    if side == "answer":
        answer = _other(answer, where, value)
    else:
        recorded_plan = _other(recorded_plan, where, value)
    assert node.fold_into(recorded_plan, answer, own=1) is None


def test_no_recorded_plan_takes_no_fold():
    run = recorded("gpt-oss-20b-tp8-sm120")["runs"][0]
    assert node.fold_into(None, _split(run, 2), own=1) is None


def test_a_fold_stops_at_the_hints_kept_beyond_the_jobs_own_requests(monkeypatch):
    run = recorded("gpt-oss-20b-tp8-sm120")["runs"][0]
    monkeypatch.setattr(node, "HINTS_KEPT", 1)
    once = node.fold_into(_split(run, 0), _split(run, 1), own=1)
    assert once is not None
    assert node.fold_into(once, _split(run, 2), own=1) is None  # folds before count against the bound
    assert node.fold_into(_split(run, 0), _split(run, 1, 2), own=1) is None


@needs_py312
def test_the_fix_search_probe_on_an_unchanged_generation_folds_its_answer_into_the_jobs_plan(built, capsys):
    run = recorded("gpt-oss-20b-tp8-sm120")["runs"][0]
    env = built.ml_env
    verify_job = {"device": DEVICE, "requests": [run["requests"][0]]}
    gpu, cuda, basis = [], {"home": "/usr/local/cuda-12.8"}, sealed.basis(env)
    job_key = node.plan_key(env, verify_job, gpu, cuda)
    sealed.save_derived(env, job_key, {**_split(run, 0), "loaded": []})  # what the verify's probe recorded
    ask = {"device": run["device"], "requests": [run["requests"][2]]}
    # The answer as an earlier identical ask recorded it: the probe takes it from the cache, SGLang does not start.
    answer = {**_split(run, 2), "loaded": []}  # its interpreter loaded nothing outside the env (none to check)
    ask_key = sealed.derived_key(None, "serve-plan-job", ask, gpu, cuda, node.model_folders(ask), base=basis)
    sealed.save_derived(env, ask_key, answer)
    reuse = {"basis": basis, "gpu": gpu, "cuda": cuda}
    assert node.main(["--env", str(env), json.dumps({**ask, "hint_for": verify_job, "reuse": reuse})]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == [run["requests"][2]]
    kept = sealed.load_derived(env, job_key)
    assert assemble.already_planned(kept, [run["requests"][2]]) is not None
    assert assemble.already_planned(kept, [run["requests"][0]]) is not None


@needs_py312
def test_a_plan_observed_after_the_generation_changed_is_kept_under_no_sealed_key(built, capsys, monkeypatch):
    """The verify hands its basis on to skip the fix search's walk; had the generation changed meanwhile, the
    plan SGLang makes is of another tree, and a later verify (after the drift was repaired) must not reuse it."""
    run = recorded("gpt-oss-20b-tp8-sm120")["runs"][0]
    env = built.ml_env
    verify_job = {"device": DEVICE, "requests": [run["requests"][0]]}
    gpu, cuda, basis = [], {"home": "/usr/local/cuda-12.8"}, sealed.basis(env)
    job_key = node.plan_key(env, verify_job, gpu, cuda)
    sealed.save_derived(env, job_key, _split(run, 0))
    ask = {"device": run["device"], "requests": [run["requests"][2]]}
    site = next(env.resolve().glob("lib/python3.*/site-packages"))

    class Observed:
        loaded = ()  # nothing outside the env

        def as_dict(self) -> dict:
            return _split(run, 2)

    def observe_a_changed_tree(*_args, **_kwargs) -> Observed:
        (site / "dropped.pth").write_text("")  # root can still write into a sealed generation
        return Observed()

    monkeypatch.setattr(node, "observe", observe_a_changed_tree)
    reuse = {"basis": basis, "gpu": gpu, "cuda": cuda}
    assert node.main(["--env", str(env), json.dumps({**ask, "hint_for": verify_job, "reuse": reuse})]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == [run["requests"][2]]
    ask_key = sealed.derived_key(None, "serve-plan-job", ask, gpu, cuda, node.model_folders(ask), base=basis)
    assert sealed.load_derived(env, ask_key) is None
    assert sealed.load_derived(env, job_key) == _split(run, 0)
