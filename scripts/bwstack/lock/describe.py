"""What a profile pins, as data: `bwstack show` prints it, the image labels carry its stack versions."""

from __future__ import annotations

from bwstack.lock.model import Lock, Profile

# The components a user names when they talk about "the stack"; versions come from the lock.
COMPONENTS = {
    "torch": "torch",
    "sgl-kernel": "sgl-kernel",
    "flashinfer": "flashinfer-python",
    "sglang": "sglang",
}


def stack_versions(profile: Profile) -> dict[str, str]:
    versions = {"cuda": profile.cuda.version}
    for label, package in COMPONENTS.items():
        if package in profile.requirements:
            versions[label] = profile.requirements[package].version
    return versions


def describe(lock: Lock, profile: Profile) -> dict:
    closure = profile.closure
    return {
        "profile": profile.name,
        "description": profile.description,
        "stack": stack_versions(profile),
        "python": profile.python,
        "platform": profile.platform,
        "cuda_toolkit": {
            "version": profile.cuda.version,
            "min_driver": profile.cuda.min_driver,
            "home": profile.cuda.home,
            "apt": f"{profile.cuda.apt_package}={profile.cuda.apt_version}",
            "pip": f"cuda-toolkit[{','.join(profile.cuda.pip_components)}]=={profile.cuda.pip_version}",
            "docker_base": profile.cuda.docker_base,
        },
        "pins": {name: {"version": pin.version, "index": pin.index} for name, pin in profile.requirements.items()},
        "overrides": [
            {
                "package": o.package,
                "required_by": o.required_by,
                "replaces": o.replaces,
                "with": o.with_,
                "reason": o.reason,
            }
            for o in profile.overrides
        ],
        "patches": list(profile.patches),
        "target": {
            "name": profile.target.name,
            "description": profile.target.description,
            "capability": profile.target.capability,
            "count": profile.target.count,
            "memory_gb": profile.target.memory_gb,
            "interconnect": profile.target.interconnect,
        },
        "expect": {
            "torch_cuda": profile.expect.torch_cuda,
            "cudart_major": profile.expect.cudart_major,
            "target_capability": profile.expect.target_capability,
            "sm120_kernels": list(profile.expect.sm120_kernels),
            "features": dict(profile.expect.features),
        },
        "closure": None
        if closure is None
        else {
            "packages": len(closure.env),
            "resolved_here": sum(p.resolved_here for p in closure.env.values()),
            "not_resolved_here": sorted(p.name for p in closure.env.values() if not p.resolved_here),
            "missing_hashes": sorted(p.name for p in closure.env.values() if p.hash_missing),
            "resolved_with": closure.resolved_with,
            "exclude_newer": closure.exclude_newer,
        },
        "lock_digest": profile.lock_digest(),
    }
