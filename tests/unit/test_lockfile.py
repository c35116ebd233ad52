"""stack.lock.yaml: malformed locks fail with one clear line and exit 2; the real lock loads and checks."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from conftest import REAL_LOCK, bwstack

from bwstack.cli import main
from bwstack.lockfile import GENERATED_MARKER, load_lock


def _spec_and_closures() -> tuple[dict, dict]:
    data = yaml.load(REAL_LOCK.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    closures = data.pop("closures")
    return data, closures


def _set(path: str, value) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        *parents, last = path.split(".")
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is _DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


_DELETE = object()
TORCH_WHEEL = "profiles.cu130.requirements.torch.static.wheels.0"

# (case id, mutation of the whole document, text the one-line error must contain)
CASES: list[tuple[str, Callable[[dict], None] | str, str]] = [
    ("empty-file", "", "the file is empty"),
    ("not-yaml", "schema_version: 1\n  profiles: [\n", "not valid YAML"),
    ("top-level-list", "- 1\n- 2\n", "(top level): expected a mapping"),
    ("schema-version-missing", _set("schema_version", _DELETE), "schema_version: required key is missing"),
    (
        "schema-version-future",
        _set("schema_version", 2),
        "schema_version: this bwstack reads schema version 1",
    ),
    ("unknown-top-level-key", _set("profile", "cu130"), "profile: unknown key"),
    (
        "default-profile-unknown",
        _set("default_profile", "cu999"),
        "default_profile: 'cu999' is not one of the profiles",
    ),
    (
        "rollback-profile-unknown",
        _set("rollback_profile", "cu11"),
        "rollback_profile: 'cu11' is not one of the profiles",
    ),
    ("exclude-newer-format", _set("resolution.exclude_newer", "yesterday"), "resolution.exclude_newer"),
    ("pypi-index-missing", _set("indexes.pypi", _DELETE), "indexes: must define `pypi`"),
    (
        "index-not-https",
        _set("indexes.pytorch-cu130.url", "http://download.pytorch.org/whl/cu130"),
        "must be an https:// URL",
    ),
    (
        "python-as-number",
        _set("profiles.cu130.python", 3.12),
        "profiles.cu130.python: expected a non-empty string",
    ),
    (
        "platform-invalid",
        _set("profiles.cu130.platform", "linux"),
        "profiles.cu130.platform: 'linux' is not valid",
    ),
    (
        "cuda-version-unquoted",
        _set("profiles.cu128.cuda.version", 12.8),
        "profiles.cu128.cuda.version: expected a version string",
    ),
    (
        "min-driver-garbage",
        _set("profiles.cu130.cuda.min_driver", "latest"),
        "profiles.cu130.cuda.min_driver",
    ),
    (
        "cuda-home-relative",
        _set("profiles.cu130.cuda.home", "cuda-13.0"),
        "profiles.cu130.cuda.home: 'cuda-13.0' must be an absolute path",
    ),
    (
        "version-not-pep440",
        _set("profiles.cu130.requirements.sglang", "0.5.9 final"),
        "requirements.sglang.version: '0.5.9 final' is not a valid PEP 440",
    ),
    (
        "index-undefined",
        _set("profiles.cu130.requirements.torch.index", "pytorch-cu999"),
        "requirements.torch.index: index 'pytorch-cu999' is not defined",
    ),
    (
        "non-pypi-without-static",
        _set("profiles.cu130.requirements.torch.static", _DELETE),
        "requirements.torch: a package from a non-PyPI index needs `static`",
    ),
    (
        "sha256-too-short",
        _set(f"{TORCH_WHEEL}.sha256", "e70e1b18881e6b3c1ce402d0a989da39f956a3a057526e03c354df23d704ce9"),
        f"{TORCH_WHEEL.replace('.0', '[0]')}.sha256: expected 64 lowercase hex digits",
    ),
    (
        "null-hash-without-reason",
        _set(f"{TORCH_WHEEL}.sha256", None),
        "sha256 is null, so hash_source must say why",
    ),
    ("wheel-not-whl", _set(f"{TORCH_WHEEL}.file", "torch-2.9.1.tar.gz"), "is not a wheel file name"),
    (
        "override-reason-too-short",
        _set("profiles.cu130.overrides.0.reason", "needed"),
        "profiles.cu130.overrides[0].reason: say why",
    ),
    (
        "override-bad-specifier",
        _set("profiles.cu130.overrides.0.with", "0.6.4"),
        "overrides[0].with: '0.6.4' is not a valid version specifier",
    ),
    (
        "patch-unknown",
        _set("profiles.cu130.patches", ["sglang-sm130"]),
        "profiles.cu130.patches[0]: unknown patch 'sglang-sm130'",
    ),
    (
        "feature-state-unknown",
        _set("profiles.cu130.expect.features.flashinfer_allreduce_fusion", "works"),
        "expect.features.flashinfer_allreduce_fusion: expected one of",
    ),
    (
        "capability-format",
        _set("targets.rtx-pro-6000-x8-pcie.capability", "12"),
        "targets.rtx-pro-6000-x8-pcie.capability: '12' is not valid",
    ),
    (
        "profile-target-unknown",
        _set("profiles.cu128.target", "h100-x8-nvlink"),
        "profiles.cu128.target: 'h100-x8-nvlink' is not one of the targets",
    ),
    (
        "target-interconnect-unknown",
        _set("targets.rtx-pro-6000-x8-pcie.interconnect", "infiniband"),
        "targets.rtx-pro-6000-x8-pcie.interconnect: expected one of pcie, nvlink",
    ),
    (
        "target-count-zero",
        _set("targets.rtx-pro-6000-x8-pcie.count", 0),
        "targets.rtx-pro-6000-x8-pcie.count: must be at least 1",
    ),
    (
        "cudart-major-string",
        _set("profiles.cu130.expect.cudart_major", "13"),
        "expect.cudart_major: expected an integer",
    ),
    (
        "duplicate-after-normalisation",
        lambda d: d["profiles"]["cu128"]["requirements"].update({"flashinfer_python": "0.6.3"}),
        "requirements.flashinfer_python: listed twice",
    ),
    (
        "closure-for-unknown-profile",
        lambda d: d["closures"].update({"cu99": d["closures"]["cu128"]}),
        "closures.cu99: has no matching profile",
    ),
    (
        "closure-package-without-wheels",
        _set("closures.cu128.env.sglang.wheels", []),
        "closures.cu128.env.sglang.wheels: must list at least one wheel",
    ),
    (
        "closure-hash-uppercase",
        _set(
            "closures.cu128.env.torch.wheels.0.sha256",
            "27331CD902FB4322252657F3902ADF1C4F6ACAD9DCAD81D8DF3AE14C7C4F07C4",
        ),
        "closures.cu128.env.torch.wheels[0].sha256: expected 64 lowercase hex",
    ),
    (
        "served-model-unknown-reference",
        _set("profiles.cu128.expect.models.0.model", "llama-9-70b"),
        "profiles.cu128.expect.models[0].model: 'llama-9-70b' is neither a reference config",
    ),
    (
        "served-model-relative-path",
        _set("profiles.cu128.expect.models.0.model", "models/llama"),
        "expect.models[0].model: 'models/llama' is neither a reference config (",
    ),
    (
        "served-model-empty",
        _set("profiles.cu128.expect.models.0.model", ""),
        "expect.models[0].model: expected a non-empty string",
    ),
    (
        "served-model-tp-zero",
        _set("profiles.cu128.expect.models.0.tp", 0),
        "expect.models[0].tp: must be between 1 and the target's 8 GPUs, got 0",
    ),
    (
        "served-model-tp-beyond-the-target",
        _set("profiles.cu130.expect.models.0.tp", 16),
        "profiles.cu130.expect.models[0].tp: must be between 1 and the target's 8 GPUs, got 16",
    ),
    (
        "served-model-tp-string",
        _set("profiles.cu128.expect.models.0.tp", "8"),
        "expect.models[0].tp: expected an integer, got a string ('8')",
    ),
    (
        "served-model-tp-missing",
        _set("profiles.cu128.expect.models.0.tp", _DELETE),
        "expect.models[0].tp: required key is missing",
    ),
    (
        "served-model-draft-without-algorithm",
        _set("profiles.cu128.expect.models.0.speculative_algorithm", _DELETE),
        "expect.models[0].draft: a draft model needs speculative_algorithm",
    ),
    (
        "served-model-algorithm-lowercase",
        _set("profiles.cu128.expect.models.0.speculative_algorithm", "eagle3"),
        "expect.models[0].speculative_algorithm: 'eagle3' is not valid (an SGLang algorithm name like EAGLE3)",
    ),
    (
        "served-model-backend-not-a-name",
        _set("profiles.cu128.expect.models.0.attention_backend", "Triton!"),
        "expect.models[0].attention_backend: 'Triton!' is not valid (a lowercase SGLang name)",
    ),
    (
        "served-model-env-number",
        _set("profiles.cu128.expect.models.0.env", {"SGLANG_ENABLE_JIT_DEEPGEMM": 0}),
        "expect.models[0].env.SGLANG_ENABLE_JIT_DEEPGEMM: expected a non-empty string in quotes",
    ),
    (
        "served-model-env-name",
        _set("profiles.cu128.expect.models.0.env", {"enable jit": "0"}),
        "expect.models[0].env.enable jit: not an environment variable name",
    ),
    (
        "served-model-unknown-key",
        _set("profiles.cu128.expect.models.0.weights", "/srv/models"),
        "expect.models[0].weights: unknown key",
    ),
    (
        "served-models-not-a-list",
        _set("profiles.cu128.expect.models", {"model": "llama-3.1-8b-instruct"}),
        "profiles.cu128.expect.models: expected a list",
    ),
    (
        "requirement-line-invalid",
        _set("closures.cu128.env.sglang.requires.0", "torch ==> 2"),
        "closures.cu128.env.sglang.requires[0]: 'torch ==> 2' is not a valid requirement",
    ),
]


def _write_case(tmp_path: Path, mutation) -> Path:
    path = tmp_path / "stack.lock.yaml"
    if isinstance(mutation, str):
        path.write_text(mutation)
        return path
    spec, closures = _spec_and_closures()
    doc = copy.deepcopy({**spec, "closures": closures})
    mutation(doc)
    path.write_text(yaml.dump(doc, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False))
    return path


@pytest.mark.parametrize(("case", "mutation", "expected"), CASES, ids=[c[0] for c in CASES])
def test_malformed_lock_gives_one_line_error_naming_the_key_and_exit_2(tmp_path, capsys, case, mutation, expected):
    path = _write_case(tmp_path, mutation)
    before = path.read_bytes()
    rc = main(["--lock", str(path), "show", "--profile", "cu128"])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.count("\n") == 0, f"expected one line, got:\n{err}"
    assert err.startswith(f"bwstack: error: {path}:"), err
    assert expected in err
    assert path.read_bytes() == before, "a failed load must not touch the file"


def test_there_are_at_least_twenty_malformed_cases():
    assert len(CASES) >= 20


def test_malformed_lock_prints_no_traceback_from_the_real_cli(tmp_path):
    path = _write_case(tmp_path, _set("profiles.cu130.cuda.home", "relative/path"))
    result = bwstack("--lock", str(path), "show")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1


def test_missing_lock_file_is_a_usage_error(tmp_path, capsys):
    assert main(["--lock", str(tmp_path / "nope.yaml"), "show"]) == 2
    assert "no such lock file" in capsys.readouterr().err


def test_unknown_profile_is_named_with_the_known_ones(capsys):
    assert main(["--lock", str(REAL_LOCK), "show", "--profile", "cu999"]) == 2
    err = capsys.readouterr().err
    assert "unknown profile 'cu999'" in err and "cu128, cu130" in err


def test_real_lock_loads_with_both_profiles_and_closures():
    lock = load_lock(REAL_LOCK)
    assert set(lock.profiles) == {"cu130", "cu128"}
    assert lock.default_profile == "cu130" and lock.rollback_profile == "cu128"
    for profile in lock.profiles.values():
        assert profile.closure is not None and len(profile.closure.env) > 150


def test_the_real_lock_names_the_seeds_model_for_both_profiles():
    lock = load_lock(REAL_LOCK)
    for profile in lock.profiles.values():
        (served,) = profile.expect.models
        assert (served.model, served.tp, served.speculative_algorithm, served.draft) == (
            "llama-3.1-8b-instruct",
            8,
            "EAGLE3",
            "sglang-eagle3-llama-3.1-8b-instruct",
        )


def test_editing_the_served_models_needs_no_relock():
    spec, closures = _spec_and_closures()
    before = load_lock(REAL_LOCK).profile("cu128").spec_digest()
    doc = copy.deepcopy({**spec, "closures": closures})
    doc["profiles"]["cu128"]["expect"]["models"] = [{"model": "qwen3-30b-a3b", "tp": 4}]
    from bwstack.lockfile import parse_lock

    after = parse_lock(yaml.safe_dump(doc, sort_keys=False)).profile("cu128")
    assert after.spec_digest() == before and after.expect.models[0].model == "qwen3-30b-a3b"


def test_spec_text_keeps_everything_above_the_generated_marker():
    lock = load_lock(REAL_LOCK)
    assert GENERATED_MARKER not in lock.spec_text
    assert lock.spec_text.startswith("# stack.lock.yaml")
