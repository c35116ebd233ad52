"""A verify reuses SGLang's recorded plan of a sealed, unchanged generation only while everything the planner's
interpreter loaded from outside the env is as it was (the rule the import checks' outcome already follows): a
system library copied over in place, a module dropped into a folder on sys.path, a new base interpreter make it
plan again. The planner's interpreters get a temporary folder of their own, so nothing they leave behind lands in
the shared /tmp, and nothing there becomes something a plan depends on.

The store is a TEST FIXTURE stack's. SGLang's interpreter is stood in for where it would run (node.run_inenv), or
is a shell script posing as the env's python; the real planner's list is checked in the slow tier
(test_serveplan_truth.py)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from helpers import needs_py312

from bwstack.probe import main as probe
from bwstack.probe import sealed
from bwstack.probe.serveplan import node

CAPABILITY = "12.0"  # the fixture target's
DEVICE = {"mode": "simulated", "capability": "12.0", "count": 8, "memory_mib": 98304, "name": "RTX",
          "interconnect": "pcie"}  # fmt: skip
JOB = {"device": DEVICE, "requests": [{"id": "model-0", "model": "llama-3.1-8b-instruct", "tp": 8}]}


def _stamp(path: Path) -> list:
    st = os.stat(path)
    return [str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


@pytest.fixture
def built(stack):
    stack.build("fixture-new", check=True)
    return stack


@pytest.fixture
def system_library(tmp_path: Path) -> Path:
    """A file outside the env that the stood-in planner says it loaded (a system library, in the real one)."""
    lib = tmp_path / "libsystem.so.1"
    lib.write_bytes(b"\x7fELF the library as the planner loaded it")
    return lib


@pytest.fixture
def planner(monkeypatch, system_library: Path) -> list[int]:
    """SGLang's interpreter stood in: each run plans every request and names `system_library` as loaded."""
    runs: list[int] = []

    def run_inenv(env, device, requests, timeout=1800, stand_in=None, speculate=None):
        runs.append(len(requests))
        observations = [{"id": r.get("id"), "steps": {}} for r in requests]
        return {"schema": 1, "versions": {}, "observations": observations, "loaded": [_stamp(system_library)]}

    monkeypatch.setattr(node, "run_inenv", run_inenv)
    return runs


def _collect(built) -> dict:
    return probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False, serve_plan=JOB)


@needs_py312
def test_an_unchanged_generation_reuses_its_plan_while_what_the_planner_loaded_is_unchanged(built, planner):
    first = _collect(built)
    again = _collect(built)
    assert planner == [1]
    assert again["facts_source"].get("serve_plan") == "recorded", again["facts_source"]
    assert again["serve_plan"] == first["serve_plan"]


@needs_py312
def test_a_library_the_planner_loaded_copied_over_in_place_makes_it_plan_again(built, planner, system_library):
    _collect(built)
    inode = os.stat(system_library).st_ino
    with open(system_library, "r+b") as lib:  # in place: the same inode, its folder's listing unchanged
        lib.write(b"\x7fELF another library, same name")
    assert os.stat(system_library).st_ino == inode
    again = _collect(built)
    assert planner == [1, 1]
    assert again["facts_source"]["serve_plan_again"] == f"{system_library} changed since SGLang's planner ran"
    assert _collect(built)["facts_source"].get("serve_plan") == "recorded"  # recorded again, as it is now


@needs_py312
def test_the_controller_gets_the_plan_without_the_list_of_loaded_files(built, planner):
    for facts in (_collect(built), _collect(built)):
        assert "loaded" not in facts["serve_plan"]


@needs_py312
@pytest.mark.parametrize(
    ("loaded", "why"),
    [
        (None, "the files SGLang's planner loaded were not recorded"),
        ("not a list", "the files SGLang's planner loaded were not recorded"),
        ([["/nonexistent/bwstack/libgone.so", 1, 2, 3, 4, 5]], "is gone since SGLang's planner ran"),
        ([["/lib"]], "was replaced while SGLang's planner ran"),
    ],
    ids=["recorded-before-it-was-kept", "damaged", "a-library-gone", "replaced-while-mapped"],
)
def test_a_plan_whose_loaded_files_cannot_be_checked_is_not_reused(built, loaded, why):
    key = sealed.derived_key(built.ml_env, "serve-plan", JOB)
    sealed.save_derived(built.ml_env, key, {"schema": 1, "requests": JOB["requests"], "loaded": loaded})
    recorded = node.recorded_plan(built.ml_env, key)
    assert recorded.plan is None and why in recorded.moved


def test_a_folded_plan_depends_on_what_both_interpreters_loaded(system_library, tmp_path):
    other = tmp_path / "libother.so"
    other.write_bytes(b"\x7fELF")
    plan = {"schema": 1, "device": DEVICE, "kernels": {}, "features": {}, "inenv": {"observations": [{}]}}
    job = {**plan, "requests": [{"id": "model-0", "tp": 8}], "loaded": [_stamp(system_library)]}
    answer = {**plan, "requests": [{"id": "fix-0", "tp": 4}], "loaded": [_stamp(system_library), _stamp(other)]}
    folded = node.fold_into(job, answer, own=1)
    assert folded is not None and folded["loaded"] == [_stamp(system_library), _stamp(other)]
    unknown = node.fold_into(job, {**answer, "loaded": None}, own=1)
    assert unknown is not None and unknown["loaded"] is None  # then never reused: recorded_plan plans again


def _posing_python(env: Path, record: Path) -> None:
    """The env's python as a shell script: it notes its TMPDIR and leaves a folder there, as torch does on import
    (a module written into a new temporary folder, kept by the interpreter's skipped teardown)."""
    python = env / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$TMPDIR" >> {record}\nmkdir -p "$(mktemp -d)/left-behind"\n')
    python.chmod(0o755)


@pytest.mark.parametrize("interpreter", ["planner", "imports"])
def test_an_env_interpreter_leaves_nothing_in_the_shared_temporary_folder(tmp_path, interpreter):
    env, record = tmp_path / "env", tmp_path / "tmpdirs"
    _posing_python(env, record)
    site = env / "lib" / "python3.12" / "site-packages"
    (site / "torch").mkdir(parents=True)
    if interpreter == "planner":
        device = node.Device(node.SIMULATED, "12.0", 8, 98304, "RTX", "pcie")
        found = node.run_inenv(env, device, [{"id": "m", "model": "llama-3.1-8b-instruct", "tp": 8}])
        assert "error" in found  # the posing python prints no plan
    else:
        probe.import_facts(env, site, gpu_present=True)
    used = record.read_text().split()
    shared = os.path.realpath(tempfile.gettempdir())
    assert used, "the interpreter ran"
    for folder in used:
        assert os.path.realpath(folder) != shared and not os.path.exists(folder), folder


@needs_py312
def test_a_model_folder_whose_config_changed_is_planned_again(built, planner, tmp_path):
    """A lock may name a model by its folder: SGLang plans from the config files there, which the folder's owner
    can change (an NVFP4 checkpoint's config in place of the dense one). The plan recorded before is not reused."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    job = {"device": DEVICE, "requests": [{"id": "model-0", "model": str(folder), "tp": 8}]}
    probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False, serve_plan=job)
    again = probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False, serve_plan=job)
    assert again["facts_source"].get("serve_plan") == "recorded" and planner == [1]
    (folder / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "NVFP4"}}\n')
    changed = probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False, serve_plan=job)
    assert changed["facts_source"].get("serve_plan") != "recorded" and planner == [1, 1]
    with open(folder / "config.json", "r+") as config:  # in place, the folder's listing as it was
        config.write('{"architectures": ["Qwen3MoeForCausalLM"]')
    probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False, serve_plan=job)
    assert planner == [1, 1, 1]


def _rewritten_in_place(path: Path) -> None:
    st = os.lstat(path)
    with open(path, "r+") as handle:
        handle.write('{"architectures": ["DeepseekV3ForCausalLM"]')
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@needs_py312
@pytest.mark.parametrize("where", ["behind-a-link", "in-a-subfolder"])
def test_a_model_config_changed_behind_a_link_or_in_a_subfolder_is_planned_again(built, planner, tmp_path, where):
    """The HF cache keeps config.json as a link into blobs/; some checkpoints keep configs in subfolders."""
    folder = tmp_path / "model"
    (folder / "original").mkdir(parents=True)
    blob = tmp_path / "blobs" / "abc"
    blob.parent.mkdir()
    blob.write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    (folder / "config.json").symlink_to(blob)
    (folder / "original" / "params.json").write_text('{"dim": 4096}\n')
    job = {"device": DEVICE, "requests": [{"id": "model-0", "model": str(folder), "tp": 8}]}
    probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False, serve_plan=job)
    _rewritten_in_place(blob if where == "behind-a-link" else folder / "original" / "params.json")
    probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False, serve_plan=job)
    assert planner == [1, 1]


def _hub_cache(hub: Path, repo_id: str, config: str) -> Path:
    """A model as huggingface_hub caches it: snapshots/<revision>/config.json, a link into blobs/."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "blobs" / "c0ffee").write_text(config)
    (repo / "snapshots" / "0123abcd" / "config.json").symlink_to("../../blobs/c0ffee")
    return repo


HF_SETTINGS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "TRANSFORMERS_CACHE",
               "PYTORCH_TRANSFORMERS_CACHE", "PYTORCH_PRETRAINED_BERT_CACHE")  # fmt: skip


@pytest.mark.parametrize(
    ("environ", "folders"),
    [
        ({"HOME": "/home/ml"}, ["/home/ml/.cache/huggingface/hub"]),
        ({"HOME": "/home/ml", "XDG_CACHE_HOME": "/xdg"}, ["/xdg/huggingface/hub"]),
        ({"HOME": "/home/ml", "HF_HOME": "~/hf"}, ["/home/ml/hf/hub"]),
        ({"HOME": "/home/ml", "DISK": "/data", "HF_HOME": "$DISK/hf"}, ["/data/hf/hub"]),
        ({"HOME": "/home/ml", "HF_HUB_CACHE": "${DISK}/hub", "DISK": "/d"}, ["/d/hub"]),
        ({"HOME": "/home/ml", "HUGGINGFACE_HUB_CACHE": "/legacy"}, ["/legacy"]),
        ({"HOME": "/home/ml", "HF_HOME": ""}, ["hub"]),
        ({"HOME": "/home/ml", "TRANSFORMERS_CACHE": "/tc"}, ["/tc", "/home/ml/.cache/huggingface/hub"]),
        ({"HOME": "/home/ml", "PYTORCH_TRANSFORMERS_CACHE": "/pt"}, ["/pt", "/home/ml/.cache/huggingface/hub"]),
    ],
    ids=[
        "home",
        "xdg",
        "hf-home-tilde",
        "hf-home-var",
        "hub-cache-braced-var",
        "legacy",
        "empty-is-set",
        "transformers-cache",
        "pytorch-transformers-cache",
    ],
)
def test_the_hf_cache_is_found_by_the_rules_of_huggingface_hub_and_transformers(environ, folders):
    """As the env's huggingface_hub (constants.py) and transformers (utils/hub.py) find it."""
    assert node.hub_cache_folders("acme/m", environ) == [Path(f) / "models--acme--m" for f in folders]


@needs_py312
def test_a_hub_model_is_keyed_by_the_cache_its_requests_environment_names(built, planner, tmp_path, monkeypatch):
    """The lock's served model may set HF_HUB_CACHE in its own `env`: the planner reads that cache, not the one
    of bwstack's environment."""
    for name in HF_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))
    repo = _hub_cache(tmp_path / "own", "acme/tiny-llama", '{"architectures": ["LlamaForCausalLM"]}\n')
    request = {"id": "model-0", "model": "acme/tiny-llama", "tp": 8, "env": {"HF_HUB_CACHE": str(tmp_path / "own")}}
    job = {"device": DEVICE, "requests": [request]}
    probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False, serve_plan=job)
    _rewritten_in_place(repo / "blobs" / "c0ffee")
    probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False, serve_plan=job)
    assert planner == [1, 1]


@needs_py312
@pytest.mark.parametrize(
    "setting", ["HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"], ids=["hub-cache", "hf-home", "xdg-cache-home"]
)
def test_a_model_named_by_its_hub_id_is_planned_again_when_its_cached_config_changed(
    built, planner, tmp_path, monkeypatch, setting
):
    """The planner reads a hub id's config offline from the HF cache (HF_HUB_OFFLINE): a new revision pulled
    there, or its blob rewritten, is another model to plan."""
    for name in HF_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(setting, str(tmp_path / "cache"))
    hub = {"HF_HUB_CACHE": tmp_path / "cache", "HF_HOME": tmp_path / "cache" / "hub"}.get(
        setting, tmp_path / "cache" / "huggingface" / "hub"
    )
    repo = _hub_cache(hub, "acme/tiny-llama", '{"architectures": ["LlamaForCausalLM"]}\n')
    assert repo in node.hub_cache_folders("acme/tiny-llama", os.environ)
    job = {"device": DEVICE, "requests": [{"id": "model-0", "model": "acme/tiny-llama", "tp": 8}]}
    probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False, serve_plan=job)
    again = probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False, serve_plan=job)
    assert again["facts_source"].get("serve_plan") == "recorded" and planner == [1]
    _rewritten_in_place(repo / "blobs" / "c0ffee")
    probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False, serve_plan=job)
    assert planner == [1, 1]


# Which profile's models a node plans: the node's env is judged against the profile its generation was built from
# (or, adopted, is nearest to), which only the node knows; the controller sends every profile's job.
JOBS = {
    "fixture-new": {"device": DEVICE, "requests": [{"id": "model-0", "model": "llama-3.1-8b-instruct", "tp": 8}]},
    "fixture-old": {"device": DEVICE, "requests": [{"id": "model-0", "model": "qwen3-30b-a3b", "tp": 8}]},
    "no-models": None,
}


@pytest.mark.parametrize(
    ("generation", "chosen"),
    [
        ({"profile": "fixture-old"}, "fixture-old"),
        ({"profile": None, "nearest_profile": "fixture-old"}, "fixture-old"),
        ({"profile": "a-profile-this-lock-lacks"}, "fixture-new"),
        (None, "fixture-new"),
        ({"profile": "no-models"}, "no-models"),
    ],
    ids=[
        "built-from-it",
        "adopted-nearest-to-it",
        "unknown-profile-the-default",
        "no-generation-the-default",
        "a-profile-without-models",
    ],
)
def test_the_probe_plans_the_models_of_the_profile_the_env_was_built_from(generation, chosen):
    job, name = probe.job_for_env({"by_profile": JOBS, "default": "fixture-new"}, generation)
    assert name == chosen and job == JOBS[chosen]


def test_a_single_job_is_planned_as_given():
    assert probe.job_for_env(JOBS["fixture-old"], {"profile": "fixture-new"}) == (JOBS["fixture-old"], None)


@needs_py312
def test_the_facts_say_which_profiles_models_were_planned(built, planner):
    facts = probe.collect(built.ml_env, CAPABILITY, runtime=False, imports=False,
                          serve_plan={"by_profile": JOBS, "default": "fixture-old"})  # fmt: skip
    assert facts["serve_plan_profile"] == "fixture-new"  # the generation's own, not the default
    assert [r["model"] for r in facts["serve_plan"]["requests"]] == ["llama-3.1-8b-instruct"]
