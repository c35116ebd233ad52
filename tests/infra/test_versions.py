"""Versions: every locked package at exactly its locked version; sglang's own pins are checked with the
lock's overrides known; FlashInfer's three packages agree (it refuses to import otherwise)."""

from __future__ import annotations

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from bwstack.lock.tags import Target
from bwstack.probe.generation import GenerationFacts


def test_every_pinned_package_is_at_the_locked_version(env, profile):
    installed = env["installed"]
    wrong = []
    for name, pin in profile.requirements.items():
        have = installed.get(name, {}).get("version")
        if have != pin.version:
            wrong.append(f"{name} {have or 'missing'} (locked {pin.version})")
    assert not wrong, (
        f"{len(wrong)} pinned package(s) differ from profile {profile.name}: {'; '.join(wrong)}. "
        f"Provision the profile (`bwstack provision --profile {profile.name}`) or check the right profile."
    )


def test_the_generation_was_built_from_this_locks_closure(env, profile):
    """Versions can match while the wheels differ: a lock whose hashes (or URLs, or toolkit) changed since the env
    was built describes other files than the ones installed. The generation's record names the lock digest it
    was built from."""
    gen = GenerationFacts.from_facts(env.get("generation"))
    if gen is None:
        pytest.skip("the env is not a bwstack generation: nothing records what it was built from")
    assert env["generation"].get("record_sealed") is not False, (
        f"generation {gen.name}'s record.json changed since it was sealed: what it says it was built from cannot "
        f"be believed (`bwstack generations` names the change)"
    )
    if gen.profile != profile.name or gen.lock_digest is None:
        pytest.skip(f"generation {gen.name} was not built from profile {profile.name} (the version checks judge it)")
    want = profile.lock_digest()
    assert gen.lock_digest == want, (
        f"generation {gen.name} was built from lock digest {gen.lock_digest[:19]}, profile {profile.name} of this "
        f"lock is {want[:19]}: its wheels, their hashes or its toolkit changed since (`bwstack plan --profile "
        f"{profile.name}` lists how); provision again to install what the lock says"
    )


def test_every_closure_package_is_installed_at_its_locked_version(env, profile):
    closure = profile.require_closure("stack.lock.yaml")
    installed = env["installed"]
    missing = [f"{n} {p.version}" for n, p in closure.env.items() if n not in installed]
    wrong = [
        f"{n} {installed[n]['version']} (locked {p.version})"
        for n, p in closure.env.items()
        if n in installed and installed[n]["version"] != p.version
    ]
    extra = sorted(set(installed) - set(closure.env))
    problems = (
        ([f"missing: {', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}"] if missing else [])
        + ([f"wrong version: {', '.join(wrong[:8])}{' …' if len(wrong) > 8 else ''}"] if wrong else [])
        + ([f"not in the lock: {', '.join(extra[:8])}"] if extra else [])
    )
    assert not problems, (
        f"the env differs from profile {profile.name}'s closure: {' | '.join(problems)}. "
        f"`bwstack plan --profile {profile.name}` lists every difference; provisioning fixes them."
    )


def test_dependency_pins_hold_except_where_the_lock_overrides_them(env, profile):
    target = Target.of(profile)
    installed = {n: d["version"] for n, d in env["installed"].items()}
    conflicts = []
    for name, dist in env["installed"].items():
        for text in dist["requires"]:
            req = Requirement(text)
            if req.marker is not None and not target.applies(req.marker):
                continue
            dep = canonicalize_name(req.name)
            have = installed.get(dep)
            if have is None or Version(have) in SpecifierSet(str(req.specifier), prereleases=True):
                continue
            override = profile.override_for(dep, name)
            if override is not None and Version(have) in SpecifierSet(override.with_, prereleases=True):
                continue
            conflicts.append(f"{name} requires {req.name}{req.specifier}, installed {have}")
    assert not conflicts, (
        f"dependency pins broken without an override in the lock: {'; '.join(conflicts)}. "
        "Either the env was changed by hand (re-provision) or the lock needs an override with a reason."
    )


def test_flashinfer_python_cubin_and_jit_cache_versions_agree(env):
    installed = env["installed"]
    python = installed.get("flashinfer-python", {}).get("version")
    if python is None:
        assert "flashinfer-cubin" not in installed and "flashinfer-jit-cache" not in installed, (
            "flashinfer-cubin/-jit-cache are installed without flashinfer-python"
        )
        pytest.skip("flashinfer is not installed in this env")
    cubin = installed.get("flashinfer-cubin", {}).get("version")
    jit = installed.get("flashinfer-jit-cache", {}).get("version")
    assert cubin in (None, python), (
        f"flashinfer-cubin {cubin} != flashinfer-python {python}: `import flashinfer` raises RuntimeError. "
        "Install both at the same version (the lock's flashinfer-cubin override does this)."
    )
    assert jit is None or jit.startswith(python), (
        f"flashinfer-jit-cache {jit} does not start with flashinfer-python {python}: FlashInfer refuses it."
    )
