"""stack.lock.yaml: malformed, hostile and stale locks fail with one clear line and exit 2; the real lock loads.

A malformed lock names the key that is wrong; a key given twice names both lines; hostile YAML (aliases, tags,
deep nesting) and special files are refused without echoing the file's content or blocking; a closure that no
longer matches its spec is refused by everything that would install it, and still shown and checked."""

from __future__ import annotations

import copy
import fcntl
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from helpers import REAL_LOCK, bwstack

from bwstack.cli.main import main
from bwstack.errors import LockError, UsageError
from bwstack.lock import read as lockread
from bwstack.lock.model import GENERATED_MARKER, load_lock, parse_lock


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
ENVELOPE = "targets.rtx-pro-6000-x8-pcie.envelope"

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
        "wheel-url-with-a-newline",
        _set(f"{TORCH_WHEEL}.url", "https://example.org/t.whl --hash=sha256:00\n-r /etc/shadow\n# "),
        "holds a space or a control character",
    ),
    (
        "wheel-url-naming-another-file",
        _set(f"{TORCH_WHEEL}.url", "https://example.org/whl/other-1.0-py3-none-any.whl"),
        "must end in the wheel's file name",
    ),
    (
        "wheel-url-with-a-query",
        _set(f"{TORCH_WHEEL}.url", "https://example.org/whl/x.whl?file=torch.whl"),
        "must end in the wheel's file name",
    ),
    ("index-url-without-host", _set("indexes.pytorch-cu130.url", "https:///whl/cu130"), "names no host"),
    ("index-url-bad-ipv6-host", _set("indexes.pytorch-cu130.url", "https://[host/whl/cu130"), "is not a valid URL"),
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
    # The name becomes a file in bwstack's folders (the resolver wrote its stand-in wheel at any path it named).
    ("wheel-absolute-path", _set(f"{TORCH_WHEEL}.file", "/tmp/victim.whl"), "is not a valid wheel file name"),
    (
        "wheel-path-traversal",
        _set(f"{TORCH_WHEEL}.file", "../../../tmp/torch-2.9.1-cp312-cp312-manylinux_2_28_x86_64.whl"),
        "not a valid wheel file name",
    ),
    ("wheel-name-not-a-wheel", _set(f"{TORCH_WHEEL}.file", "victim.whl"), "is not a valid wheel file name"),
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
        "envelope-figure-missing",
        _set(f"{ENVELOPE}.allreduce_busbw", _DELETE),
        f"{ENVELOPE}.allreduce_busbw: required key is missing",
    ),
    ("envelope-figure-unknown", _set(f"{ENVELOPE}.h2d_bandwidth", {}), f"{ENVELOPE}.h2d_bandwidth: unknown key"),
    (
        "envelope-unit-wrong",
        _set(f"{ENVELOPE}.p2p_same_numa.unit", "GiB/s"),
        "p2p_same_numa.unit: p2p_same_numa is measured in 'GB/s', not 'GiB/s'",
    ),
    (
        "envelope-threshold-not-a-number",
        _set(f"{ENVELOPE}.p2p_cross_numa.fail_below", "30 GB/s"),
        "p2p_cross_numa.fail_below: expected a positive number, got a string",
    ),
    (
        "envelope-threshold-boolean",
        _set(f"{ENVELOPE}.p2p_cross_numa.warn_below", True),
        "p2p_cross_numa.warn_below: expected a positive number, got a boolean",
    ),
    (
        "envelope-fail-above-warn",
        _set(f"{ENVELOPE}.allreduce_busbw.fail_below", 38),
        "allreduce_busbw.fail_below: fail_below (38) must not exceed warn_below (37)",
    ),
    (
        "envelope-warn-above-typical",
        _set(f"{ENVELOPE}.allreduce_busbw.warn_below", 39),
        "allreduce_busbw.warn_below: warn_below (39) is above the typical range",
    ),
    (
        "envelope-typical-reversed",
        _set(f"{ENVELOPE}.p2p_same_numa.typical", [56, 53]),
        "p2p_same_numa.typical: expected [low, high]",
    ),
    (
        "envelope-typical-one-number",
        _set(f"{ENVELOPE}.p2p_same_numa.typical", [53]),
        "p2p_same_numa.typical: expected [low, high]",
    ),
    (
        "envelope-ratio-above-one",
        _set(f"{ENVELOPE}.gpu_spread.typical", [0.97, 1.2]),
        "gpu_spread.typical: a fraction of the node median is at most 1",
    ),
    (
        "envelope-source-missing",
        _set(f"{ENVELOPE}.p2p_same_numa.source", _DELETE),
        "p2p_same_numa.source: required key is missing",
    ),
    (
        "envelope-source-too-short",
        _set(f"{ENVELOPE}.p2p_same_numa.source", "forum"),
        "p2p_same_numa.source: say where the typical range comes from",
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
        lambda d: d["closures"].update({"cu99": copy.deepcopy(d["closures"]["cu128"])}),
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
        "system-package-an-apt-option",
        _set("system_packages.debian-12", ["-oDpkg::Pre-Invoke::=touch /tmp/pwn", "libnuma1"]),
        "system_packages.debian-12: '-oDpkg::Pre-Invoke::=touch /tmp/pwn' is not a Debian package name",
    ),
    (
        "cuda-apt-version-with-options",
        _set("profiles.cu130.cuda.apt.version", "1' -oDPkg::Pre-Invoke::=id --allow-unauthenticated 'x"),
        "profiles.cu130.cuda.apt.version: \"1' -oDPkg::Pre-Invoke::=id --allow-unauthenticated 'x\" is not valid",
    ),
    (
        "cuda-apt-package-an-option",
        _set("profiles.cu130.cuda.apt.package", "-oAPT::Get::AllowUnauthenticated=true"),
        "profiles.cu130.cuda.apt.package: '-oAPT::Get::AllowUnauthenticated=true' is not valid",
    ),
    (
        "system-package-two-words",
        _set("system_packages.debian-12", ["libnuma1 ffmpeg"]),
        "system_packages.debian-12: 'libnuma1 ffmpeg' is not a Debian package name",
    ),
    (
        "profile-name-with-a-newline",
        _set("default_profile", "cu130\n"),
        "default_profile",
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
    from bwstack.lock.model import parse_lock

    after = parse_lock(yaml.safe_dump(doc, sort_keys=False)).profile("cu128")
    assert after.spec_digest() == before and after.expect.models[0].model == "qwen3-30b-a3b"


def test_spec_text_keeps_everything_above_the_generated_marker():
    lock = load_lock(REAL_LOCK)
    assert GENERATED_MARKER not in lock.spec_text
    assert lock.spec_text.startswith("# stack.lock.yaml")


# ------------------------------------------------------------------------------------------------ duplicates
# PyYAML keeps the last of two equal keys without a word; the lock refuses them, naming the key and both lines.
# Each case edits the real lock's text and returns (key, first line, second line), lines counted from 1.


def _find(lines: list[str], exact: str, after: int = 0) -> int:
    """0-based index of the first line equal to `exact` at or after index `after`."""
    return next(i for i in range(after, len(lines)) if lines[i].rstrip("\n") == exact)


def _package_pinned_twice(lines: list[str]) -> tuple[str, int, int]:
    i = _find(lines, '      sglang: "0.5.9"', _find(lines, "  cu128:", _find(lines, "profiles:")))
    lines.insert(i + 1, '      sglang: "0.5.10"\n')
    return "sglang", i + 1, i + 2


def _profile_defined_twice(lines: list[str]) -> tuple[str, int, int]:
    profiles = _find(lines, "profiles:")
    first, second = _find(lines, "  cu130:", profiles), _find(lines, "  cu128:", profiles)
    lines[first] = "  cu128:\n"
    return "cu128", first + 1, second + 1


def _index_defined_twice(lines: list[str]) -> tuple[str, int, int]:
    indexes = _find(lines, "indexes:")
    first, second = _find(lines, "  pytorch-cu130:", indexes), _find(lines, "  flashinfer-cu130:", indexes)
    lines[second] = "  pytorch-cu130:\n"
    return "pytorch-cu130", first + 1, second + 1


def _closure_package_twice(lines: list[str]) -> tuple[str, int, int]:
    env = _find(lines, "    env:", _find(lines, "  cu128:", _find(lines, "closures:")))
    first, second = _find(lines, "      idna:", env), _find(lines, "      torch:", env)
    lines[first] = "      torch:\n"
    return "torch", first + 1, second + 1


def _wheel_hash_twice(lines: list[str]) -> tuple[str, int, int]:
    i = next(j for j in range(_find(lines, "closures:"), len(lines)) if lines[j].strip().startswith("sha256: "))
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines.insert(i + 1, f"{indent}sha256: {'0' * 64}\n")
    return "sha256", i + 1, i + 2


def _top_level_key_twice(lines: list[str]) -> tuple[str, int, int]:
    first = _find(lines, "default_profile: cu130")
    lines.append("default_profile: cu128\n")
    return "default_profile", first + 1, len(lines)


DUPLICATES = [
    ("package-pinned-twice", _package_pinned_twice),
    ("profile-defined-twice", _profile_defined_twice),
    ("index-defined-twice", _index_defined_twice),
    ("closure-package-twice", _closure_package_twice),
    ("wheel-hash-twice", _wheel_hash_twice),
    ("top-level-key-twice", _top_level_key_twice),
]


@pytest.mark.parametrize("edit", [c[1] for c in DUPLICATES], ids=[c[0] for c in DUPLICATES])
def test_a_key_given_twice_is_refused_naming_the_key_and_both_lines(tmp_path, capsys, edit):
    lines = REAL_LOCK.read_text().splitlines(keepends=True)
    key, first, second = edit(lines)
    path = tmp_path / "stack.lock.yaml"
    path.write_text("".join(lines))
    assert main(["--lock", str(path), "show", "--profile", "cu128"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert f"duplicate key '{key}' (lines {first} and {second})" in err, err


# ------------------------------------------------------------------------------------------------ hostile YAML
# Each file carries CANARY; the one-line error must not: a parse error never echoes the file's content.

CANARY = "CANARY-5d1e"
BOMB = (
    "a: &a ["
    + ", ".join([f'"{CANARY}"'] * 9)
    + "]\n"
    + "".join(f"{n}: &{n} [" + ", ".join([f"*{p}"] * 9) + "]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True))
)

HOSTILE_YAML: list[tuple[str, str | bytes, str]] = [
    ("tab-indentation", f"schema_version: 1\nprofiles:\n\t{CANARY}: 1\n", "line 3, column 1: not valid YAML"),
    ("unknown-escape", f'x: "{CANARY} \\q"\n', "not valid YAML: found unknown escape character"),
    ("python-object-tag", f"x: !!python/object/apply:os.system ['echo {CANARY}']\n", "not valid YAML"),
    ("custom-tag", f"x: !{CANARY} 1\n", "not valid YAML"),
    ("unterminated-quote", f'x: "{CANARY}\n', "not valid YAML"),
    ("impossible-date", f"{CANARY}: 2026-13-01\n", "line 1: a value YAML cannot construct"),
    ("int-tag-on-text", f"x: !!int {CANARY}\n", "line 1: a value YAML cannot construct"),
    ("nul-byte", f"x: {CANARY}\x00\n", "not valid YAML: a control character"),
    ("not-utf8", f"x: {CANARY}".encode() + b"\xff\xfe\n", "not UTF-8 text"),
    ("anchor-and-alias", f"a: &{CANARY} [1]\nb: *{CANARY}\n", "line 1: YAML anchors and aliases"),
    ("anchor-alone", f"a: &{CANARY} 1\n", "line 1: YAML anchors and aliases"),
    ("alias-bomb", BOMB, "line 1: YAML anchors and aliases"),
    ("merge-key", f"a: {{x: 1}}\nb:\n  <<: {{{CANARY}: 1}}\n", "line 3: YAML merge keys (<<) are not allowed"),
    ("nested-too-deep", "x: " + "[" * 40 + CANARY + "]" * 40 + "\n", "nested more than 32 levels"),
    ("nested-past-libyaml", "[" * 5000 + CANARY, "nest"),  # libyaml's own limit (1000) or bwstack's (32)
    ("list-as-key", f"? [{CANARY}]\n: 1\n", "line 1: a mapping key must be a plain value"),
    ("key-twice-on-one-line", "{a: 1, a: 2}\n" + f"# {CANARY}\n", "duplicate key 'a' (line 1, columns 2 and 8)"),
    # Power-of-two bases skip Python's limit on digits when read, not when a message shows the number.
    ("huge-binary-int", f"# {CANARY}\ndefault_profile: 0b" + "1" * 20_000 + "\n", "line 2: a number too large"),
    ("huge-hex-int", f"# {CANARY}\nschema_version: 0x" + "f" * 5_000 + "\n", "line 2: a number too large"),
    ("huge-sexagesimal-int", f"# {CANARY}\nx: 1" + ":59" * 3_000 + "\n", "line 2: a number too large"),
    # Built digit group by digit group in quadratic time: refused before it is built (400,000 groups took 48 s).
    ("sexagesimal-int-of-a-megabyte", f"# {CANARY}\nx: 1" + ":59" * 400_000 + "\n", "line 2: a number too large"),
    ("long-float", f"# {CANARY}\nx: 1." + "5" * 100 + "\n", "line 2: a number too large"),
    # Two million list items in 4 MiB took 16 s and 785 MB to compose before the one-line refusal.
    ("two-million-values", f"# {CANARY}\nschema_version: [" + "1," * 1_500_000 + "1]\n", "YAML values: far more"),
    # A token file or a password line named as the lock (as root, through a sudo rule): the whole file is one value.
    ("a-token-file", f"hf_{CANARY}\n", "(top level): expected a mapping, got a string: not a lock file"),
    ("a-number-file", "4242\n", "(top level): expected a mapping, got a number: not a lock file"),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in HOSTILE_YAML], ids=[c[0] for c in HOSTILE_YAML])
def test_hostile_yaml_gives_one_line_naming_the_place_and_echoes_no_content(tmp_path, capsys, text, expected):
    path = tmp_path / "stack.lock.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert main(["--lock", str(path), "show"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(f"bwstack: error: {path}: ") and expected in err, err
    assert CANARY not in err


@pytest.mark.parametrize(
    "text",
    ["a: 1\nb: 2\na: 3\n", "a: &x 1\nb: *x\n", "a: {x: 1}\nb:\n  <<: {y: 1}\n", "a: 2026-02-30\n"],
    ids=["duplicate", "alias", "merge", "bad-date"],
)
@pytest.mark.parametrize("loader", [lockread.StrictCLoader, lockread.StrictPyLoader], ids=["libyaml", "python"])
def test_both_yaml_loaders_refuse_what_pyyaml_would_accept_silently(loader, text):
    if loader is lockread.StrictCLoader and not yaml.__with_libyaml__:
        pytest.skip("PyYAML here has no libyaml")
    with pytest.raises(LockError, match=r"p: line \d+: "):
        lockread.load_yaml(text, "p", loader)


def test_the_lock_is_read_with_libyaml_where_pyyaml_has_it():
    if not yaml.__with_libyaml__:
        pytest.skip("PyYAML here has no libyaml")
    assert issubclass(lockread.StrictCLoader, yaml.CSafeLoader)
    assert lockread.load_yaml.__defaults__ == (lockread.StrictCLoader,)


def test_a_huge_value_is_named_not_pasted(tmp_path, capsys):
    path = _write_case(tmp_path, _set("profiles.cu130.python", "3." + "1" * 200_000 + "x"))
    assert main(["--lock", str(path), "show"]) == 2
    err = capsys.readouterr().err.strip()
    assert "profiles.cu130.python: '3.111" in err and len(err) < 400, err[:600]


def test_a_lock_larger_than_the_limit_is_refused_unread(tmp_path, capsys):
    path = tmp_path / "stack.lock.yaml"
    path.write_text(("# " + "x" * 1022 + "\n") * ((lockread.MAX_LOCK_BYTES >> 10) + 1))
    assert main(["--lock", str(path), "show"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"bwstack: error: {path}: {path.stat().st_size} bytes is more than a lock can be (4 MiB): " + (
        "refusing to read it"
    )


# ------------------------------------------------------------------------------------------------ special files
# Run as a user would (a subprocess, with a timeout): a special file must be refused at once, never read.


def _fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "lock.fifo")
    return tmp / "lock.fifo"


def _socket(tmp: Path) -> Path:
    path = tmp / "lock.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    return path


def _link_to_fifo(tmp: Path) -> Path:
    (tmp / "link.yaml").symlink_to(_fifo(tmp))
    return tmp / "link.yaml"


def _link_loop(tmp: Path) -> Path:
    (tmp / "a.yaml").symlink_to(tmp / "b.yaml")
    (tmp / "b.yaml").symlink_to(tmp / "a.yaml")
    return tmp / "a.yaml"


SPECIAL_FILES: list[tuple[str, Callable[[Path], Path], str]] = [
    ("fifo", _fifo, "is a FIFO, not a regular file"),
    ("dev-zero", lambda tmp: Path("/dev/zero"), "is a character device, not a regular file"),
    ("dev-null", lambda tmp: Path("/dev/null"), "is a character device, not a regular file"),
    ("directory", lambda tmp: tmp, "is a directory, not a regular file"),
    ("unix-socket", _socket, "cannot read the lock: No such device or address"),
    ("link-to-fifo", _link_to_fifo, "is a FIFO, not a regular file"),
    ("link-loop", _link_loop, "cannot read the lock: Too many levels of symbolic links"),
]


@pytest.mark.parametrize(("make", "expected"), [c[1:] for c in SPECIAL_FILES], ids=[c[0] for c in SPECIAL_FILES])
def test_a_lock_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, make, expected):
    path = make(tmp_path)
    result = bwstack("--lock", str(path), "show", timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"bwstack: error: {path}: {expected}" + (
        ": refusing to read it\n" if "regular" in expected else "\n"
    )


# ------------------------------------------------------------------------------------------------ stale closures


def _stale_lock(tmp_path: Path) -> Path:
    """The real lock with cu128's sglang pin edited and `bwstack lock` not run: the closure no longer matches."""
    lines = REAL_LOCK.read_text().splitlines(keepends=True)
    i = _find(lines, '      sglang: "0.5.9"', _find(lines, "  cu128:", _find(lines, "profiles:")))
    lines[i] = '      sglang: "0.5.10"\n'
    path = tmp_path / "stack.lock.yaml"
    path.write_text("".join(lines))
    return path


# Every command that would install, fetch or render the closure; none gets as far as touching anything.
STALE_REFUSED = [
    ("build", ["build", "--root", "{tmp}/root", "--ml-env", "{tmp}/ml-env", "--cuda-link", "none"]),
    ("build-check", ["build", "--check", "--root", "{tmp}/root", "--ml-env", "{tmp}/ml-env", "--cuda-link", "none"]),
    ("image-build", ["image", "build", "--offline", "--wheelhouse", "{tmp}", "--store", "{tmp}/store"]),
    ("cuda-install", ["cuda", "install", "--prefix", "{tmp}/cuda", "--root", "{tmp}/root", "--offline"]),
    ("fetch", ["fetch", "--dest", "{tmp}/wheels", "--offline"]),
    ("render", ["render"]),
]


@pytest.mark.parametrize("argv", [c[1] for c in STALE_REFUSED], ids=[c[0] for c in STALE_REFUSED])
def test_a_stale_closure_is_refused_with_run_bwstack_lock_before_anything_is_touched(tmp_path, capsys, argv):
    path = _stale_lock(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    args = [a.format(tmp=tmp_path) for a in argv]
    assert main(["--lock", str(path), *args, "--profile", "cu128"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(f"bwstack: error: {path}: closures.cu128.spec_digest: ") and "run `bwstack lock`" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "nothing may be created"


def test_a_stale_lock_can_still_be_shown_and_checked(tmp_path):
    path = _stale_lock(tmp_path)
    shown = bwstack("--lock", str(path), "show", "--profile", "cu128", "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["stack"]["sglang"] == "0.5.10", shown.stderr
    checked = bwstack("--lock", str(path), "lock", "--check", "--offline")
    assert checked.returncode == 1
    assert "closures.cu128.spec_digest" in checked.stdout and "run `bwstack lock`" in checked.stdout


def test_the_real_target_carries_its_envelope_with_units_and_sources():
    envelope = load_lock(REAL_LOCK).targets["rtx-pro-6000-x8-pcie"].envelope
    assert envelope is not None
    assert (envelope.p2p_same_numa.unit, envelope.p2p_same_numa.typical) == ("GB/s", (53.0, 56.0))
    assert envelope.p2p_cross_numa.typical == (39.0, 51.0)
    assert envelope.allreduce_busbw.typical == (37.0, 41.0)
    assert all("rtx6kpro" in f.source for f in (envelope.p2p_same_numa, envelope.allreduce_busbw))


def test_editing_an_envelope_changes_no_digest_so_it_needs_no_relock():
    spec, closures = _spec_and_closures()
    edited = copy.deepcopy({**spec, "closures": closures})
    edited["targets"]["rtx-pro-6000-x8-pcie"]["envelope"]["allreduce_busbw"]["fail_below"] = 20
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    before = parse_lock(yaml.dump({**spec, "closures": closures}, Dumper=dumper, sort_keys=False))
    after = parse_lock(yaml.dump(edited, Dumper=dumper, sort_keys=False))
    assert after.targets["rtx-pro-6000-x8-pcie"].envelope.allreduce_busbw.fail_below == 20
    for name in before.profiles:
        assert after.profiles[name].spec_digest() == before.profiles[name].spec_digest()
        assert after.profiles[name].lock_digest() == before.profiles[name].lock_digest()
        assert after.profiles[name].spec_digest() == before.profiles[name].require_closure("x").spec_digest


@pytest.mark.parametrize(
    "name", ["../escaped-1.0-py3-none-any.whl", "/tmp/abs-1.0-py3-none-any.whl", ".hidden-1.0-py3-none-any.whl", ""]
)
def test_the_resolvers_stand_in_wheel_is_written_only_as_a_plain_name_in_its_folder(tmp_path, name):
    from bwstack.lock.resolve import write_stub_wheel

    folder = tmp_path / "stand-ins"
    folder.mkdir()
    with pytest.raises(UsageError):
        write_stub_wheel(folder, name, "escaped", "1.0", [])
    assert not list(tmp_path.rglob("*.whl"))


def test_the_resolvers_stand_in_wheel_never_writes_through_a_link(tmp_path):
    from bwstack.lock.resolve import write_stub_wheel

    folder = tmp_path / "stand-ins"
    folder.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.symlink(victim, folder / "torch-2.9.1-cp312-cp312-linux_x86_64.whl")
    with pytest.raises(UsageError):
        write_stub_wheel(folder, "torch-2.9.1-cp312-cp312-linux_x86_64.whl", "torch", "2.9.1", [])
    assert victim.read_text() == "precious\n"


def test_a_second_lock_rewrite_of_the_same_file_is_refused_while_the_first_runs(tmp_path):
    """Both would write a lock made from what they read before the other wrote: one profile's update lost."""
    path = tmp_path / "stack.lock.yaml"
    path.write_bytes(REAL_LOCK.read_bytes())
    held = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # what the first run holds from its read to its write
        result = bwstack("--lock", str(path), "lock", "--profile", "cu128")
    finally:
        os.close(held)
    assert result.returncode == 3 and result.stderr.count("\n") == 1, result.stderr
    assert "another `bwstack lock` rewriting stack.lock.yaml" in result.stderr
    assert path.read_bytes() == REAL_LOCK.read_bytes()


def test_a_lock_rewrite_through_a_link_is_refused_and_both_are_left_as_they_were(tmp_path):
    target = tmp_path / "real.yaml"
    target.write_bytes(REAL_LOCK.read_bytes())
    (tmp_path / "stack.lock.yaml").symlink_to(target)
    result = bwstack("--lock", str(tmp_path / "stack.lock.yaml"), "lock", "--profile", "cu128")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "is a link" in result.stderr
    assert (tmp_path / "stack.lock.yaml").is_symlink() and target.read_bytes() == REAL_LOCK.read_bytes()


@pytest.mark.parametrize(
    ("args", "says"),
    [(["--offline"], "--offline: only with --check"),
     (["--check", "--offline", "--profile", "nosuch"], "--profile: only when resolving")],
    ids=["offline-without-check", "profile-with-check"],
)  # fmt: skip
def test_lock_options_that_would_be_ignored_are_refused(args, says):
    result = bwstack("lock", *args)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and says in result.stderr, result.stderr
