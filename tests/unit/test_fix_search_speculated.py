"""A verify whose node remembers no earlier fix search (a new generation, a fresh node) plans what a fix search may
ask for beside the model, in the same start of SGLang: the catalogue's server-argument changes by component
(assemble.speculation), combined as a fix search combines them (each component's first change that is not what
the plan already runs, every combination of those, each other change alone). A fix search then finds its plans
there instead of starting SGLang again; the node remembers what it asked for, for the next verify's hints.
Which changes a fix search tries and keeps is still find_fix's alone: a request not planned early is planned on
the node as before.

The store is a TEST FIXTURE stack's; SGLang's interpreter is stood in by a fake env python that runs the real
planner script's speculation with an observer that resolves server arguments as given (a FIXTURE); the recorded
fix searches are the RECORDED serve-plan fixtures (tests/fixtures/serveplan)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import needs_py312

from bwstack.probe import interp, sealed
from bwstack.probe.serveplan import node
from bwstack.serveplan import assemble, catalogue

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "serveplan"
DEVICE = node.Device(node.SIMULATED, "12.0", 8, 98304, "NVIDIA RTX PRO 6000 Blackwell", "pcie")
JOB_DEVICE = {"mode": "simulated", "capability": "12.0", "count": 8, "memory_mib": 98304, "name": "RTX",
              "interconnect": "pcie"}  # fmt: skip
REQUEST = {"id": "model-0", "model": "llama-3.1-8b-instruct", "tp": 8}


def _planner() -> dict:
    ns: dict = {"__name__": "planner"}
    exec(compile(interp.script_source("serveplan"), "serveplan.py", "exec"), ns)
    return ns


def recorded(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.mark.parametrize("name", sorted(p.stem for p in FIXTURES.glob("*.json")))
def test_the_requests_planned_early_hold_every_server_argument_change_each_recorded_fix_search_asked_for(name):
    fixture = recorded(name)
    base = fixture["base"]
    values = base["inenv"]["observations"][0]["steps"]["server_args"]["values"]
    early = _planner()["_variants"](assemble.speculation(catalogue.load()), values)
    asked = [r["server_args"] for run in fixture["runs"] for r in run["requests"] if not r.get("env")]
    assert [args for args in asked if args not in early] == []


@pytest.mark.parametrize(
    ("case", "groups", "values", "expected"),
    [
        (
            "each component's first change, then both together",
            [[{"a": 1}], [{"b": 1}]],
            {},
            [{"a": 1}, {"b": 1}, {"a": 1, "b": 1}],
        ),
        (
            "a change the plan already runs is left out",
            [[{"a": 1}, {"a": 2}], [{"b": 1}]],
            {"a": 1},
            [{"a": 2}, {"b": 1}, {"a": 2, "b": 1}],
        ),
        (
            "every change alone first, then the combinations of the firsts",
            [[{"a": 1}, {"a": 2}], [{"b": 1}]],
            {},
            [{"a": 1}, {"b": 1}, {"a": 2}, {"a": 1, "b": 1}],
        ),
        ("nothing to change", [[{"a": 1}]], {"a": 1}, []),
    ],
)
def test_which_changes_are_planned_early(case, groups, values, expected):
    assert _planner()["_variants"](groups, values) == expected, case


def test_the_changes_planned_early_are_bounded_as_they_are_made():
    planner = _planner()
    groups = [[{f"k{i}": 1}] for i in range(16)]  # 65535 combinations: made one by one, it stops at the bound
    variants = planner["_variants"](groups, {})
    assert len(variants) == planner["SPECULATED_MAX"]
    assert variants[:16] == [{f"k{i}": 1} for i in range(16)]


def test_speculation_is_the_catalogues_server_argument_changes_without_environment_ones():
    groups = assemble.speculation(catalogue.load())
    changes = [change for group in groups for change in group]
    assert {"attention_backend": "triton"} in changes and {"sampling_backend": "pytorch"} in changes
    assert all(change and "SGLANG_ENABLE_JIT_DEEPGEMM" not in change for change in changes)


def _env_speculating(tmp_path: Path) -> Path:
    """A fake env whose python runs the real planner script's speculation (_speculate) with a FIXTURE observer in
    place of SGLang: server arguments resolve to what was given over flashinfer attention and sampling."""
    (tmp_path / "env/lib/python3.12/site-packages").mkdir(parents=True)
    (tmp_path / "env/bin").mkdir()
    fake = tmp_path / "env/bin/python"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        "script, job = sys.argv[-2], json.loads(sys.argv[-1])\n"
        "ns = {'__name__': 'planner'}\n"
        "exec(compile(open(script).read(), script, 'exec'), ns)\n"
        "class Observer:\n"
        "    def observe(self, request):\n"
        "        values = {'attention_backend': 'flashinfer', 'sampling_backend': 'flashinfer'}\n"
        "        values.update(request.get('server_args') or {}, planned_model=request['model_path'])\n"
        "        return {'id': request.get('id'), 'steps': {'server_args': {'ok': True, 'values': values}}}\n"
        "found = [Observer().observe(r) for r in job['requests']]\n"
        "result = {'observations': found}\n"
        "if job.get('speculate'):\n"
        "    result['speculated'] = ns['_speculate'](Observer(), job['requests'], found, job['speculate'])\n"
        "print(ns['MARKER'] + json.dumps(result))\n"
    )
    fake.chmod(0o755)
    return tmp_path / "env"


def _asks(request: dict) -> list[dict]:
    """Requests as a fix search builds them (assemble._apply) from each single change of the catalogue, and from
    the pairs of the first changes of two components."""
    groups = assemble.speculation(catalogue.load())
    single = [assemble._Candidate((), change, {}, "") for group in groups for change in group]
    firsts = [assemble._Candidate((), group[0], {}, "") for group in groups]
    return [assemble._apply(request, [c]) for c in single] + [assemble._apply(request, firsts[:2])]


def test_a_fix_search_finds_the_plans_made_early_as_it_asks_for_them(tmp_path: Path):
    env = _env_speculating(tmp_path)
    observed = node.observe(env, DEVICE, [dict(REQUEST)], speculate=assemble.speculation(catalogue.load()))
    assert observed.error is None, observed.error
    observation = observed.as_dict()
    request = observation["requests"][0]
    # flashinfer is what the plan runs already: the catalogue's change to it is not planned, nor asked for below
    asks = [a for a in _asks(request) if a["server_args"] != {"attention_backend": "flashinfer"}]
    answered = assemble.already_planned(observation, asks)
    assert answered is not None
    got = [o["steps"]["server_args"]["values"] for o in answered["inenv"]["observations"]]
    assert [{k: g[k] for k in a["server_args"]} for g, a in zip(got, asks, strict=True)] == [
        a["server_args"] for a in asks
    ]


def test_the_requests_planned_early_follow_the_given_ones_and_say_so(tmp_path: Path):
    env = _env_speculating(tmp_path)
    observed = node.observe(env, DEVICE, [dict(REQUEST)], speculate=[[{"sampling_backend": "pytorch"}]])
    assert [r["id"] for r in observed.requests] == ["model-0", "speculated-0"]
    assert observed.requests[1] == {**REQUEST, "id": "speculated-0", "server_args": {"sampling_backend": "pytorch"},
                                    "env": {}}  # fmt: skip
    assert len(observed.inenv["observations"]) == 2


def test_when_planning_early_fails_the_given_requests_are_planned_again_without(tmp_path: Path):
    env = _env_speculating(tmp_path)
    fake = env / "bin" / "python"
    # the interpreter dies while planning early (a crash, a hang cut at the time limit): no result at all
    fake.write_text(fake.read_text().replace("found = [", "if job.get('speculate'):\n    sys.exit(-11)\nfound = ["))
    speculate = [[{"sampling_backend": "pytorch"}]]
    observed = node.observe_speculating(env, DEVICE, [dict(REQUEST)], speculate)
    assert observed.error is None, observed.error
    assert [r["id"] for r in observed.requests] == ["model-0"]
    assert observed.inenv["observations"][0]["steps"]["server_args"]["ok"]


def test_plans_made_early_in_interpreters_of_their_own_go_with_their_own_requests(tmp_path: Path):
    """Requests of other environments plan in other interpreters: each plan made early is its request's."""
    env = _env_speculating(tmp_path)
    requests = [
        {"id": "model-0", "model": "llama-3.1-8b-instruct", "tp": 8, "env": {"SGLANG_X": "1"}},
        {"id": "model-1", "model": "gpt-oss-20b", "tp": 8},
        {"id": "model-2", "model": "qwen3-30b-a3b", "tp": 8, "env": {"SGLANG_X": "1"}},
    ]
    observed = node.observe(env, DEVICE, requests, speculate=[[{"sampling_backend": "pytorch"}]])
    found = observed.inenv["observations"]
    assert len(observed.requests) == len(found) == 6
    for request, observation in zip(observed.requests, found, strict=True):
        assert observation["steps"]["server_args"]["values"]["planned_model"].endswith("/" + request["model"])
        assert observation["env"] == (request.get("env") or {})
    assert [r["model"] for r in observed.requests[3:]] == ["llama-3.1-8b-instruct", "qwen3-30b-a3b", "gpt-oss-20b"]


def test_nothing_is_planned_early_without_speculation(tmp_path: Path):
    env = _env_speculating(tmp_path)
    observed = node.observe(env, DEVICE, [dict(REQUEST)])
    assert [r["id"] for r in observed.requests] == ["model-0"]


@pytest.mark.parametrize(
    "value",
    [
        None, "attention", [], [[]], [["triton"]], [[{}]], [[{"attention_backend": ["triton"]}]],
        [[{"not a name": 1}]], [[{"a": 1}]] * 17, [[{"a": i} for i in range(9)]],
    ],
    ids=["none", "string", "no-groups", "empty-group", "change-not-a-mapping", "empty-change", "value-not-scalar",
         "name-not-an-identifier", "too-many-groups", "too-many-changes"],
)  # fmt: skip
def test_a_speculation_of_another_shape_or_size_plans_nothing_early(value):
    assert node.speculation_groups(value) is None


@pytest.fixture
def built(stack):
    stack.build("fixture-new", check=True)
    return stack


@needs_py312
@pytest.mark.parametrize("remembered", [False, True], ids=["nothing-remembered", "hints-remembered"])
def test_a_verify_job_plans_early_only_when_the_node_remembers_no_fix_search(built, monkeypatch, remembered):
    job = {"device": JOB_DEVICE, "requests": [REQUEST], "speculate": [[{"sampling_backend": "pytorch"}]]}
    if remembered:
        node.remember_asked(built.ml_env, job, [{**REQUEST, "server_args": {"attention_backend": "triton"}}])
    seen: list = []

    def observe(env, device, requests, cuda=None, stand_in=None, speculate=None):
        seen.append((len(requests), speculate))
        result = node.Observation(device=device, requests=list(requests))
        result.inenv = {"observations": [{"id": r.get("id"), "steps": {}} for r in requests]}
        return result

    monkeypatch.setattr(node, "observe", observe)
    node.observe_job(built.ml_env, DEVICE, job)
    assert seen == ([(2, None)] if remembered else [(1, job["speculate"])])


@needs_py312
def test_a_fix_search_answered_early_is_remembered_as_one_run_on_the_node(built, capsys):
    job = {"device": JOB_DEVICE, "requests": [REQUEST], "speculate": [[{"sampling_backend": "pytorch"}]]}
    asked = {"model": REQUEST["model"], "tp": 8, "server_args": {"sampling_backend": "pytorch"}, "env": {}}
    remember = {"remember": [asked], "hint_for": job}
    assert node.main(["--env", str(built.ml_env), json.dumps(remember)]) == 0
    assert json.loads(capsys.readouterr().out) == {}
    hints = node.hinted_requests(built.ml_env, job)
    assert [{k: v for k, v in h.items() if k != "id"} for h in hints] == [asked]


@needs_py312
@pytest.mark.parametrize("hint_for", [None, "a job", ["a job"]], ids=["none", "string", "list"])
def test_a_remember_without_its_verify_job_remembers_nothing(built, capsys, hint_for):
    asked = {"model": REQUEST["model"], "tp": 8, "server_args": {"sampling_backend": "pytorch"}, "env": {}}
    cache = sealed.derived_cache(built.ml_env)
    before = cache.read_bytes() if cache.exists() else None
    assert node.main(["--env", str(built.ml_env), json.dumps({"remember": [asked], "hint_for": hint_for})]) == 0
    assert (cache.read_bytes() if cache.exists() else None) == before  # nothing written, under any key


def _planned_early(run: dict) -> dict:
    """A recorded run as a verify's probe records it when it planned early: the first request is the job's own,
    the others speculated."""
    requests = [
        run["requests"][0],
        *({**r, "id": f"{node.SPECULATED_PREFIX}{i}"} for i, r in enumerate(run["requests"][1:])),
    ]
    return {**run, "requests": requests}


@needs_py312
def test_a_later_verify_keeps_of_the_plans_made_early_only_what_fix_searches_asked_for(built):
    run = _planned_early(recorded("gpt-oss-20b-tp8-sm120")["runs"][0])  # four requests, three planned early
    env = built.ml_env
    job = {"device": run["device"], "requests": [run["requests"][0]], "speculate": [[{"sampling_backend": "x"}]]}
    key = node.plan_key(env, job, [], {"home": "/usr/local/cuda-12.8"})
    sealed.save_derived(env, key, {**run, "loaded": []})
    asked = [{k: v for k, v in run["requests"][i].items() if k != "id"} for i in (2, 3)]
    node.remember_asked(env, job, asked[:1])
    node.remember_asked(env, job, asked[1:])  # a fix search's second ask: what the first asked stays
    kept = node.recorded_plan_for(env, key, job).plan
    assert [{k: v for k, v in r.items() if k != "id"} for r in kept["requests"]] == [
        {k: v for k, v in run["requests"][i].items() if k != "id"} for i in (0, 2, 3)
    ]
    assert [r["id"] for r in kept["requests"]] == [run["requests"][0]["id"], "asked-1", "asked-2"]
    assert kept["inenv"]["observations"] == [run["inenv"]["observations"][i] for i in (0, 2, 3)]
    assert sealed.load_derived(env, key)["requests"] == kept["requests"]  # recorded so: the next read is small


@needs_py312
def test_a_plan_made_early_that_no_fix_search_asked_for_is_dropped_at_the_next_verify(built):
    run = _planned_early(recorded("gpt-oss-20b-tp8-sm120")["runs"][0])
    job = {"device": run["device"], "requests": [run["requests"][0]]}
    key = node.plan_key(built.ml_env, job, [], {})
    sealed.save_derived(built.ml_env, key, {**run, "loaded": []})
    assert node.recorded_plan_for(built.ml_env, key, job).plan["requests"] == [run["requests"][0]]


@pytest.mark.parametrize(
    "recorded_plan",
    [None, "a plan", {"requests": [1], "inenv": {"observations": []}}, {"requests": [], "inenv": "x"}],
    ids=["none", "not-a-mapping", "requests-and-observations-differ", "inenv-not-a-mapping"],
)
def test_a_malformed_recorded_plan_is_left_as_it_is(recorded_plan):
    assert node.keep_asked(recorded_plan, [{"model": "m"}], own=1) is None
