"""`bwstack build` and `bwstack rollback`: the node-level operations the Ansible roles and the CLI share.

build: back up the active env, build the profile's generation aside from the lock (uv, hashes required),
apply the SM120 patches, verify, seal, commit, switch. A generation already built from the same closure is
reused, so a converged re-run changes nothing. rollback: verify a generation's manifest and switch to it;
with nothing to go back to it refuses, saying so, unless asked to rebuild (then it builds the profile, by
default the lock's rollback profile, from the lock).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bwstack.errors import BwstackError
from bwstack.fsutil import free_bytes, tree_size
from bwstack.lock.model import Lock, Profile
from bwstack.lock.tags import Target, select
from bwstack.probe import envinspect
from bwstack.probe import main as probe
from bwstack.provision import backup, envbuild, patches
from bwstack.provision.wheelhouse import Fetcher, LocalWheel, Sources
from bwstack.store import manifest
from bwstack.store.generations import Generation, Store, checkpoint, generation_name, now_iso, write_hook
from bwstack.store.layout import Layout
from bwstack.store.record import GenerationRecord
from bwstack.store.session import open_store
from bwstack.store.tree import remove_tree, seal

GIB = 1 << 30


@dataclass
class BuildOptions:
    sources: Sources = field(default_factory=Sources)
    allow_unhashed: tuple[str, ...] = ()
    python: str | None = None
    switch: bool = True
    verify_depth: str = "quick"
    ca_bundle: str | None = None


def closure_digest(profile: Profile) -> str:
    """What decides an env's content: interpreter, patches and the exact wheel of every package."""
    closure = profile.require_closure()
    chosen = select(closure.env, Target.of(profile))
    payload = [
        profile.python,
        list(profile.patches),
        sorted((n, w.file, w.sha256 or "") for n, (_, w) in chosen.items()),
    ]
    return "sha256:" + hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def find_built(store: Store, profile: Profile, digest: str) -> Generation | None:
    """The newest verified generation built from exactly this closure whose files still verify."""
    for gen in reversed(store.generations()):
        same = gen.profile == profile.name and gen.record.closure_digest == digest
        if same and gen.verified and not gen.verify("quick"):
            return gen
    return None


def plan_build(lock: Lock, profile: Profile, layout: Layout, *, switch: bool = True) -> dict:
    """What `build` would do, changing nothing (Ansible check mode), step by step as `_build_locked` takes them:
    the backup (adopt a real-folder env, or snapshot an active generation that changed since it was sealed and
    restore it from the store), the build, the switch. The same command line with --check: what only the real
    run reads (where wheels come from) changes no planned action."""
    profile.require_closure(lock.path)
    store = Store(layout)
    digest = closure_digest(profile)
    active = store.active()
    next_id = store.next_id()
    actions = []
    drift: list = []
    if layout.ml_env.is_dir() and not layout.ml_env.is_symlink():
        actions.append(f"adopt {layout.ml_env} as a generation (no copy)")
        next_id += 1  # the adopted env takes the next id, the build the one after
    elif active is not None and not active.damaged:
        drift = active.verify("quick")
    built = find_built(store, profile, digest)
    if drift:
        actions.append(
            f"snapshot {layout.ml_env} as a generation ({len(drift)} paths differ from {active.name}'s manifest), "
            f"then restore {active.name} from the store where its bytes are still there"
        )
        next_id += 1
    if built is None:
        # After a snapshot the restored generation may serve, which only the restore can tell: the plan says
        # "build" (and the preflight asks for a build's free disk) rather than promise less than may happen.
        unless = f" unless the restore makes {active.name} whole" if drift and active.profile == profile.name else ""
        packages = len(profile.require_closure(lock.path).env)
        actions.append(f"build a {profile.name} generation ({packages} packages){unless}")
    if switch and (drift or active is None or built is None or active.name != built.name):
        actions.append(f"switch {layout.ml_env} to the {profile.name} generation")
    return {
        "changed": bool(actions),
        "actions": actions,
        "build": built is None,
        "active": active.name if active else None,
        "target": built.name if built else generation_name(next_id, profile.name, digest),
        "closure_digest": digest,
    }


def _required_bytes(wheels: dict[str, LocalWheel], uv_cache: Path) -> int:
    """Rough need: wheels unpack to ~2.5x their size in uv's cache; what the cache holds is reused."""
    wheel_bytes = sum(w.path.stat().st_size for w in wheels.values())
    cached = tree_size(uv_cache) if uv_cache.is_dir() else 0
    return max(int(wheel_bytes * 2.5) - cached, 0) + GIB


def _same_version(runtime: str, dist: str) -> bool:
    """torch reports "2.9.1+cu128" at run time for the PyPI wheel whose metadata says "2.9.1"."""
    from packaging.version import InvalidVersion, Version

    try:
        have, want = Version(runtime), Version(dist)
    except InvalidVersion:
        return runtime == dist
    return have == want if want.local else have.public == want.public


def _verify_new_env(profile: Profile, env: Path, expected: dict[str, str]) -> tuple[dict, dict]:
    checks = []
    problems = envbuild.differences(env, expected)
    checks.append({"check": "installed set equals the closure", "ok": not problems, "detail": problems[:10]})
    sp = envinspect.site_packages(env)
    states = patches.status(sp, profile.patches) if profile.patches else []
    bad = [s for s in states if getattr(s, "state", "applied") != "applied"]
    checks.append({"check": "patches applied", "ok": not bad, "detail": [str(s) for s in bad]})
    torch: dict = {}
    if "torch" in expected:
        torch = envinspect.import_torch(env)
        ok = "error" not in torch and _same_version(torch.get("version", ""), expected["torch"])
        checks.append({"check": "import torch", "ok": ok, "detail": torch})
    status = "passed" if all(c["ok"] for c in checks) else "failed"
    return {"status": status, "at": now_iso(), "checks": checks}, torch


def build(lock: Lock, profile: Profile, layout: Layout, opts: BuildOptions, log=print) -> dict:
    profile.require_closure(lock.path)  # a missing or stale closure is refused before the store is touched
    with open_store(layout, log) as store:
        return _build_locked(lock, profile, store, opts, log)


def _build_locked(lock: Lock, profile: Profile, store: Store, opts: BuildOptions, log) -> dict:
    layout = store.layout
    started = time.perf_counter()
    timings: dict = {}
    result: dict = {"profile": profile.name, "changed": False, "actions": []}
    backed = backup.backup(store, lock, log=log)
    if backed["action"] in ("adopted", "snapshot"):
        result["changed"] = True
        result["actions"].append(f"backup: {backed['action']} {backed['generation']}")
    result["backup"] = backed
    timings["backup_s"] = time.perf_counter() - started
    digest = closure_digest(profile)
    gen = find_built(store, profile, digest)
    if gen is None:
        gen = _build_generation(lock, profile, store, opts, digest, timings, log)
        result["changed"] = True
        result["actions"].append(f"built {gen.name}")
    active = store.active()
    if opts.switch and (active is None or active.name != gen.name):
        timings["switch"] = store.switch(gen, depth=opts.verify_depth, why=f"build {profile.name}")
        result["changed"] = True
        result["actions"].append(f"switched {layout.ml_env} to {gen.name}")
    note = store.cuda_link_note()
    if note:
        result["note"] = note
    result["generation"] = gen.name
    result["active"] = (store.active() or gen).name
    timings["total_s"] = time.perf_counter() - started
    result["timings"] = timings
    return result


def _build_generation(
    lock: Lock, profile: Profile, store: Store, opts: BuildOptions, digest: str, timings: dict, log
) -> Generation:
    layout = store.layout
    closure = profile.require_closure(lock.path)
    t0 = time.perf_counter()
    fetcher = Fetcher(layout.wheel_store, opts.sources, opts.allow_unhashed, log=log, elsewhere=closure.cuda_toolkit)
    wheels = fetcher.fetch_all(select(closure.env, Target.of(profile)))
    timings["fetch_s"] = time.perf_counter() - t0
    timings["fetch"] = fetcher.progress.summary()
    need = _required_bytes(wheels, layout.uv_cache)
    free = free_bytes(layout.generations)
    if free < need:
        raise BwstackError(
            f"not enough disk to build the {profile.name} env in {layout.generations}: about {need / GIB:.1f} GiB "
            f"needed, {free / GIB:.1f} GiB free; free space, `bwstack prune --keep 2`, or pass --root elsewhere"
        )
    python = envbuild.find_python(profile.python, opts.python)
    name = generation_name(store.next_id(), profile.name, digest)
    building = store.begin(name)
    try:
        t0 = time.perf_counter()
        env = building / "env"
        envbuild.create_venv(env, python, cache_dir=layout.uv_cache)
        checkpoint("after-venv")
        envbuild.install(env, wheels, cache_dir=layout.uv_cache, ca_bundle=opts.ca_bundle)
        timings["install_s"] = time.perf_counter() - t0
        checkpoint("after-install")
        applied = patches.apply(envinspect.site_packages(env), profile.patches) if profile.patches else []
        checkpoint("after-patch")
        write_hook(env, name)
        # Hashed now, while the files uv just wrote are still in memory: by the seal, after the bytecode, a host
        # short of memory (or one that pages out what was not read for a minute) reads them from disk again. The
        # files are made read-only first (their folders stay writable for the bytecode), since that moves every
        # inode change time; the seal reuses a hash only for a file whose inode has not changed since.
        t1 = time.perf_counter()
        seal(env, folders=False)
        hashed_until = _filesystem_now(building)
        hashed = manifest.known_hashes(manifest.build(building), os.stat(building).st_dev)
        timings["hash_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        envbuild.compile_bytecode(env)
        timings["bytecode_s"] = time.perf_counter() - t1
        checkpoint("after-bytecode")
        os.symlink(profile.cuda.home, building / "cuda")
        t0 = time.perf_counter()
        expected = {n: p.version for n, p in closure.env.items()}
        # Verification imports torch (seconds) while this process seals the env, records the static facts the
        # node checks need (facts.json: `bwstack verify` reuses them while the generation is unchanged) and
        # hashes the files.
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(_verify_new_env, profile, env, expected)
            seal(env)
            t1 = time.perf_counter()
            probe.record_static(building, env, profile.expect.target_capability)
            timings["facts_s"] = time.perf_counter() - t1
            entries = store.seal_and_hash(building, sealed=True, hashed=hashed, hashed_until=hashed_until)
            timings["seal_manifest_s"] = time.perf_counter() - t0
            verification, torch = pending.result()
        timings["verify_s"] = time.perf_counter() - t0
        if verification["status"] != "passed":
            failed = [c for c in verification["checks"] if not c["ok"]]
            raise BwstackError(f"the new {profile.name} env failed verification, not committed: {failed}")
        checkpoint("after-verify")
        record = GenerationRecord(
            id=int(name.split("-", 1)[0]),
            profile=profile.name,
            created=now_iso(),
            origin="built",
            lock_digest=profile.lock_digest(),
            closure_digest=digest,
            python=envinspect.env_python_version(env),
            python_executable=python,
            cuda_home=profile.cuda.home,
            cuda_version=profile.cuda.version,
            patches=tuple(_as_dict(a) for a in applied),
            torch=torch,
            packages={n: w.as_dict() for n, w in sorted(wheels.items())},
            verification=verification,
        )
        meta = _manifest_meta(record)
        gen = store.commit(building, record, meta, entries)
        checkpoint("after-commit")
        return gen
    except BaseException:
        remove_tree(building)
        raise


def _filesystem_now(folder: Path) -> int:
    """Now on the clock `folder`'s filesystem stamps inodes with (a network filesystem's server, a kernel's coarse
    tick), less one: a file changed in the same tick counts as changed after it. Read from a file made there."""
    probe_path = folder / f".bwstack-now.{os.getpid()}"
    fd = os.open(probe_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        return os.fstat(fd).st_ctime_ns - 1
    finally:
        os.close(fd)
        os.unlink(probe_path)


def _manifest_meta(record: GenerationRecord) -> dict:
    """What the manifest repeats of the record (an archive's manifest stands on its own)."""
    data = record.to_json()
    return {key: data.get(key) for key in ("lock_digest", "python", "cuda_home", "created", "packages")}


def _as_dict(item) -> dict:
    return item.as_dict() if hasattr(item, "as_dict") else dict(item)


class NothingToRollBackTo(BwstackError):
    """No generation to switch to, and no rebuild asked for."""


def _no_target_message(store: Store, active: Generation | None, profile_name: str | None, rebuild_profile: str) -> str:
    gens = store.generations()
    if profile_name is not None:
        what = f"no {profile_name} generation to roll back to"
    elif not gens:
        what = f"nothing to roll back to: {store.layout.generations} holds no generation"
    elif active is not None and len(gens) == 1:
        what = f"nothing to roll back to: {active.name} is the only generation (and it is active)"
    else:
        what = "nothing to roll back to"
    return (
        f"{what}; `--rebuild` builds the {rebuild_profile} profile from the lock instead "
        "(a full build: tens of GB and minutes), or `--to` names a generation (`bwstack generations`)"
    )


def plan_rollback(
    layout: Layout, *, to: str | None = None, profile_name: str | None = None, rebuild: bool = False, lock: Lock
) -> dict:
    """What `rollback` would do, changing nothing (the Ansible module's check mode asks this)."""
    store = Store(layout)
    active = store.active_or_none()  # as the rollback itself: a broken `current` is what it repairs
    target = rollback_target(store, active, to=to, profile_name=profile_name)
    name = profile_name or lock.rollback_profile
    if target is None:
        if not rebuild:
            raise NothingToRollBackTo(_no_target_message(store, active, profile_name, name))
        plan = plan_build(lock, lock.profile(name), layout)
        return {**plan, "action": f"rebuild: {'; '.join(plan['actions']) or 'nothing to do'}", "rebuild": True}
    changed = active is None or active.name != target.name
    action = f"switch {layout.ml_env} to {target.name}" if changed else f"{target.name} is already active"
    return {"changed": changed, "active": active.name if active else None, "target": target.name, "action": action}


def rollback(
    lock: Lock,
    layout: Layout,
    *,
    to: str | None = None,
    profile_name: str | None = None,
    rebuild: bool = False,
    opts: BuildOptions | None = None,
    log=print,
) -> dict:
    opts = opts or BuildOptions()
    started = time.perf_counter()
    with open_store(layout, log) as store:
        problem = store.current_problem()
        if problem:
            log(f"warning: {problem}; rolling back repairs it")
        active = store.active_or_none()
        target = rollback_target(store, active, to=to, profile_name=profile_name)
        if target is None:
            name = profile_name or lock.rollback_profile
            if not rebuild:
                raise NothingToRollBackTo(_no_target_message(store, active, profile_name, name))
            log(f"no {name} generation to go back to: building it from the lock (--rebuild)")
            result = _build_locked(lock, lock.profile(name), store, opts, log)
            result["rolled_back_by"] = "rebuild from the lock"
            return result
        if active is not None and active.name == target.name:
            return {"changed": False, "generation": target.name, "note": "already active"}
        switch = store.switch(target, depth=opts.verify_depth, why="rollback")
        result = {
            "changed": True,
            "from": active.name if active else None,
            "generation": target.name,
            "profile": target.profile,
            "switch": switch,
            "seconds": time.perf_counter() - started,
        }
        note = store.cuda_link_note()  # as a build says it: the toolkit link the switch left alone
        if note:
            result["note"] = note
        return result


def rollback_target(
    store: Store, active: Generation | None, *, to: str | None = None, profile_name: str | None = None
) -> Generation | None:
    """The one rule for which generation a rollback switches to (`rollback`, `rollback --check` and so the
    Ansible module, which runs those, all come here); None when there is none.

    - `to`: that generation (by id, 4-digit id or name; a damaged or unknown one is an error);
    - `profile_name`: the newest usable generation, other than the active one, built from that profile or
      adopted as nearest to it (a hand-made env adopted as generation 0 counts for its nearest profile);
    - neither: the generation the newest switch came from, other than the active one and still usable; with no
      such switch in the history, the newest usable generation other than the active one.
    """
    if to is not None:
        return store.get(to)
    gens = [g for g in store.usable() if active is None or g.name != active.name]
    if profile_name is not None:
        matching = [g for g in gens if g.record.counts_for(profile_name)]
        return matching[-1] if matching else None
    for entry in reversed(store.history()):
        if entry.get("from") and (active is None or entry["from"] != active.name):
            for gen in gens:
                if gen.name == entry["from"]:
                    return gen
    return gens[-1] if gens else None
