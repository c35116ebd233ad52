"""SGLang's planner imports its model registry narrowed to the modules that can register the requests'
architectures, and every answer the registry gives is still the whole registry's.

Importing SGLang's model registry imports every model module (about 3 s of the planner's 6-7 s on this project's
machines, 1.1 s of it left once the layers they share are imported anyway). The planner imports it with SGLang's
own switch, SGLANG_DISABLED_MODEL_ARCHS, naming the modules that cannot register any of the architectures its
requests name. A question the narrowed registry cannot answer exactly reads the rest first.

The SGLang here is a TEST FIXTURE: a package laid out as SGLang 0.5.9's (`sglang/srt/models/registry.py` with
the same import_model_classes and ModelRegistry shape, the switch read the same way) with four small model
modules. That the rule finds the module of every architecture the real SGLang 0.5.9 registers is checked in the
slow tier (test_serveplan_truth.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bwstack.probe import interp

REGISTRY = """
import importlib, logging, os, pkgutil
from dataclasses import dataclass, field
from functools import lru_cache

IMPORTED = []


@dataclass
class _ModelRegistry:
    models: dict = field(default_factory=dict)

    def register(self, package_name, overwrite=False):
        for arch, cls in import_model_classes(package_name).items():
            if arch in self.models and not overwrite:
                raise ValueError(f"{arch} already registered")
            self.models[arch] = cls

    def get_supported_archs(self):
        return self.models.keys()

    def resolve_model_cls(self, architectures):
        normalized = [a for a in architectures if a in self.models]
        for arch in normalized:
            return self.models[arch], arch
        raise ValueError(f"{architectures} not supported; supported: {sorted(self.get_supported_archs())}")


@lru_cache()
def import_model_classes(package_name):
    out = {}
    package = importlib.import_module(package_name)
    disabled = [s.strip() for s in os.environ.get("SGLANG_DISABLED_MODEL_ARCHS", "").split(",") if s.strip()]
    for _, name, ispkg in pkgutil.iter_modules(package.__path__, package_name + "."):
        if ispkg or name.split(".")[-1] in disabled:
            continue
        module = importlib.import_module(name)
        if not name.endswith(".registry"):  # itself, half-imported (as in SGLang's loop)
            IMPORTED.append(name.split(".")[-1])
        entry = getattr(module, "EntryClass", None)
        for cls in entry if isinstance(entry, list) else [entry] if entry else []:
            assert cls.__name__ not in out, f"Duplicated model implementation for {cls.__name__}"
            out[cls.__name__] = cls
    return out


ModelRegistry = _ModelRegistry()
ModelRegistry.register("sglang.srt.models")
"""

MODULES = {
    "alpha": "class AlphaForCausalLM:\n    pass\n\n\nEntryClass = AlphaForCausalLM\n",
    # names Alpha (a subclass of its own, an import) but registers only Beta
    "beta": "class AlphaForCausalLM:\n    pass\n\n\nclass BetaForCausalLM(AlphaForCausalLM):\n    pass\n\n\n"
    "EntryClass = [BetaForCausalLM]\n",
    "gamma": "class GammaForCausalLM:\n    pass\n\n\nclass GammaEagle3(GammaForCausalLM):\n    pass\n\n\n"
    "EntryClass = [\n    GammaForCausalLM,  # the base\n    GammaEagle3,\n]\n",
    "delta": "class DeltaForCausalLM:\n    pass\n\n\ndef _entries():\n    return [DeltaForCausalLM]\n\n\n"
    "EntryClass = _entries()\n",
}

PROGRAM = """
import json, os, sys
ns = {"__name__": "planner"}
exec(compile(open(sys.argv[1]).read(), "serveplan.py", "exec"), ns)
requests, question = json.loads(sys.argv[2]), sys.argv[3]
narrowed = ns["_import_registry_narrowed"](requests)
from sglang.srt.models import registry
first = sorted(registry.IMPORTED)
answer = None
if question == "resolve":
    answer = registry.ModelRegistry.resolve_model_cls(requests[0]["ask"])[1]
elif question == "supported":
    answer = [a in registry.ModelRegistry.get_supported_archs() for a in requests[0]["ask"]]
elif question == "all":
    answer = sorted(registry.ModelRegistry.get_supported_archs())
elif question == "repr":
    answer = repr(registry.ModelRegistry.get_supported_archs())
print(json.dumps({"narrowed": narrowed, "first": first, "answer": answer, "after": sorted(registry.IMPORTED),
                  "switch": os.environ.get("SGLANG_DISABLED_MODEL_ARCHS")}))
"""


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A TEST FIXTURE SGLang: its model registry and four model modules, and the planner's text beside them."""
    models = tmp_path / "site" / "sglang" / "srt" / "models"
    models.mkdir(parents=True)
    for folder in (models.parent.parent, models.parent, models):
        (folder / "__init__.py").write_text("")
    (models / "registry.py").write_text(REGISTRY)
    for name, text in MODULES.items():
        (models / f"{name}.py").write_text(text)
    (tmp_path / "serveplan.py").write_text(interp.script_source("serveplan"))
    return tmp_path


def _model(site: Path, name: str, architectures) -> str:
    folder = site / "models" / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": architectures}))
    return str(folder)


def _plan(site: Path, requests: list, question: str = "", env: dict | None = None) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    environ.update(PYTHONPATH=str(site / "site"), PYTHONDONTWRITEBYTECODE="1", **(env or {}))
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(site / "serveplan.py"), json.dumps(requests), question],
        capture_output=True, text=True, env=environ, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_planner_imports_only_the_model_modules_that_can_register_its_architectures(site: Path):
    request = {"model_path": _model(site, "beta", ["BetaForCausalLM"]), "ask": ["BetaForCausalLM"]}
    out = _plan(site, [request], "resolve")
    # delta's EntryClass is computed, so it cannot be told apart: it is imported as well
    assert out["first"] == ["beta", "delta"]
    assert out["answer"] == "BetaForCausalLM"
    assert out["after"] == out["first"]
    assert out["narrowed"].startswith("2 of 4 model modules imported first")


def test_the_drafts_architecture_is_narrowed_for_beside_the_models(site: Path):
    request = {
        "model_path": _model(site, "alpha", ["AlphaForCausalLM"]),
        "draft_path": _model(site, "draft", ["GammaEagle3"]),
    }
    assert _plan(site, [request])["first"] == ["alpha", "delta", "gamma"]


def test_every_request_of_the_interpreter_is_narrowed_for(site: Path):
    requests = [
        {"model_path": _model(site, "alpha", ["AlphaForCausalLM"])},
        {"model_path": _model(site, "gamma", ["GammaForCausalLM"])},
    ]
    assert _plan(site, requests)["first"] == ["alpha", "delta", "gamma"]


def test_an_architecture_the_narrowed_registry_lacks_is_looked_up_in_the_whole_registry(site: Path):
    request = {"model_path": _model(site, "beta", ["BetaForCausalLM"]), "ask": ["GammaEagle3", "NoSuchModel"]}
    out = _plan(site, [request], "supported")
    assert out["answer"] == [True, False]
    assert set(out["after"]) == {"alpha", "beta", "delta", "gamma"}


def test_the_list_of_supported_architectures_is_the_whole_registrys(site: Path):
    request = {"model_path": _model(site, "beta", ["BetaForCausalLM"])}
    narrowed = _plan(site, [request], "all")["answer"]
    whole = _plan(site, [{"model_path": "/nonexistent"}], "all")
    assert whole["narrowed"] is None
    assert narrowed == whole["answer"] == [
        "AlphaForCausalLM", "BetaForCausalLM", "DeltaForCausalLM", "GammaEagle3", "GammaForCausalLM",
    ]  # fmt: skip


def test_the_supported_architectures_read_as_the_whole_registrys_in_its_order(site: Path):
    """SGLang prints them when a model is not supported: the same text, narrowed or not."""
    narrowed = _plan(site, [{"model_path": _model(site, "beta", ["BetaForCausalLM"])}], "repr")
    whole = _plan(site, [{"model_path": "/nonexistent"}], "repr")
    assert narrowed["narrowed"] is not None and whole["narrowed"] is None
    assert narrowed["answer"] == whole["answer"] and whole["answer"].startswith("dict_keys([")


def test_a_whole_read_that_fails_fails_again_at_the_next_question(site: Path):
    """The narrowed registry never answers from its part after the whole registry could not be read."""
    broken = site / "site" / "sglang" / "srt" / "models" / "gamma.py"
    broken.write_text(broken.read_text() + "\nraise SystemExit('gamma cannot be imported')\n")
    program = PROGRAM.replace(
        'if question == "resolve":',
        "tries = []\nfor _ in range(2):\n    try:\n"
        '        tries.append("GammaForCausalLM" in registry.ModelRegistry.models)\n'
        '    except BaseException as exc:\n        tries.append(str(exc))\nanswer = tries\nif question == "resolve":',
    )
    request = {"model_path": _model(site, "beta", ["BetaForCausalLM"])}
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    environ.update(PYTHONPATH=str(site / "site"), PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run(
        [sys.executable, "-c", program, str(site / "serveplan.py"), json.dumps([request]), "none"],
        capture_output=True, text=True, env=environ, timeout=60, check=True,
    )  # fmt: skip
    assert json.loads(done.stdout.strip().splitlines()[-1])["answer"] == ["gamma cannot be imported"] * 2


def test_the_operators_own_disabled_modules_stay_disabled_and_the_switch_is_restored(site: Path):
    request = {"model_path": _model(site, "beta", ["BetaForCausalLM"]), "ask": ["GammaForCausalLM"]}
    out = _plan(site, [request], "supported", env={"SGLANG_DISABLED_MODEL_ARCHS": "gamma"})
    assert out["answer"] == [False]
    assert "gamma" not in out["after"]
    assert out["switch"] == "gamma"


@pytest.mark.parametrize(
    ("case", "config", "env"),
    [
        ("another package adds models", {"architectures": ["BetaForCausalLM"]}, {"SGLANG_EXTERNAL_MODEL_PACKAGE": "x"}),
        ("no architectures", {}, {}),
        ("architectures not a list", {"architectures": "BetaForCausalLM"}, {}),
        ("an architecture that is no name", {"architectures": ["Beta|Alpha"]}, {}),
        ("config.json missing", None, {}),
    ],
)
def test_the_whole_registry_is_imported_when_the_narrowing_cannot_be_sure(site: Path, case, config, env):
    folder = site / "models" / "m"
    folder.mkdir(parents=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if "SGLANG_EXTERNAL_MODEL_PACKAGE" in env:
        # the registry imports that package: a fixture one with no models
        (site / "site" / "x").mkdir()
        (site / "site" / "x" / "__init__.py").write_text("")
        registry = site / "site" / "sglang" / "srt" / "models" / "registry.py"
        registry.write_text(
            registry.read_text() + "\nif os.environ.get('SGLANG_EXTERNAL_MODEL_PACKAGE'):\n"
            "    ModelRegistry.register(os.environ['SGLANG_EXTERNAL_MODEL_PACKAGE'], True)\n"
        )
    out = _plan(site, [{"model_path": str(folder)}], env=env)
    assert out["narrowed"] is None, case
    assert out["first"] == ["alpha", "beta", "delta", "gamma"], case


@pytest.mark.parametrize("kind", ["fifo", "oversized"])
def test_a_config_json_that_is_no_small_regular_file_narrows_nothing_and_is_not_read(site: Path, kind):
    """A FIFO would hold the planner (SGLang reads the same file later, and its own read says what is wrong)."""
    folder = site / "models" / "m"
    folder.mkdir(parents=True)
    config = folder / "config.json"
    if kind == "fifo":
        os.mkfifo(config)  # nothing ever writes it: a read would block until the test's time limit
    else:
        config.write_text(json.dumps({"architectures": ["BetaForCausalLM"], "pad": "x" * (5 << 20)}))
    out = _plan(site, [{"model_path": str(folder)}])
    assert out["narrowed"] is None
    assert out["first"] == ["alpha", "beta", "delta", "gamma"]


@pytest.mark.parametrize(
    ("case", "text", "names", "registers"),
    [
        ("an EntryClass naming it", "EntryClass = BetaForCausalLM\n", {"BetaForCausalLM"}, True),
        ("a list naming it", "EntryClass = [AForCausalLM, BetaForCausalLM]\n", {"BetaForCausalLM"}, True),
        ("a list over lines, with comments", "EntryClass = [\n  A,  # x\n  Beta,\n]\n", {"Beta"}, True),
        ("a dotted name", "EntryClass = [mod.Beta]\n", {"Beta"}, True),
        ("inside an if", "if X:\n    EntryClass = [Beta]\n", {"Beta"}, True),
        ("an alias imported as another name", "from m import Beta as B\nEntryClass = B\n", {"Beta"}, True),
        ("a computed value", "EntryClass = entries()\n", {"Beta"}, True),
        ("a value added later", "EntryClass = [A]\nEntryClass += [B]\n", {"Beta"}, True),
        ("naming it only in an import", "from m import Beta\nEntryClass = [Gamma]\n", {"Beta"}, False),
        ("a subclass of it", "class G(Beta):\n    pass\nEntryClass = G\n", {"Beta"}, False),
        ("no EntryClass", "class Beta:\n    pass\n", {"Beta"}, False),
        ("a longer name", "EntryClass = BetaForCausalLM\n", {"Beta"}, False),
    ],
)
def test_which_model_modules_may_register_an_architecture(case, text, names, registers):
    ns: dict = {"__name__": "planner"}
    exec(compile(interp.script_source("serveplan"), "serveplan.py", "exec"), ns)
    assert ns["_registers"](text, names) is registers, case
