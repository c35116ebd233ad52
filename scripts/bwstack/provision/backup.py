"""Backups: adopt a hand-made env as generation 0, and snapshot the active env when it drifted.

Nothing here copies gigabytes on the node. Adoption moves the directory into the store with one atomic
exchange (the ml-env path is a working env before and after, never missing) and takes it over: owned by the
store's owner, write bits removed. A generation that has not changed since it was sealed already is its own
backup. One that drifted (someone pip-installed into it) is captured as a new generation of hard links plus
a fresh manifest, and the drift then leaves the sealed generation: what was added is removed and what was
replaced or removed is re-linked from the store's objects (see bwstack.store.objects), so every generation listed
as good can still be switched to. Off-node archives live in bwstack.store.archive.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import time
from pathlib import Path

from bwstack.errors import BwstackError, UsageError
from bwstack.lock.model import Lock
from bwstack.probe import envinspect, treecheck
from bwstack.store import manifest
from bwstack.store.generations import (
    BUILDING_PREFIX,
    MANIFEST,
    RECORD,
    Generation,
    Store,
    checkpoint,
    generation_name,
    now_iso,
    write_hook,
)
from bwstack.store.record import GenerationRecord
from bwstack.store.session import swap_in
from bwstack.store.tree import remove_tree, seal, take_ownership

# ------------------------------------------------------------------------------------------------ adopt


def detect_profile(lock: Lock, env: Path) -> tuple[str | None, str | None, dict]:
    """(exact profile, nearest profile, facts) for a hand-made env, from its installed distributions."""
    have = {name: dist.version for name, dist in envinspect.installed(env).items()}
    exact = None
    nearest = None
    best = None
    for profile in lock.profiles.values():
        if profile.closure is None:
            continue
        want = {name: pkg.version for name, pkg in profile.closure.env.items()}
        diff = sum(have.get(n) != v for n, v in want.items()) + len(set(have) - set(want))
        if diff == 0:
            exact = profile.name
        torch = have.get("torch", "")
        same_torch = torch == want.get("torch")
        score = (not same_torch, diff)
        if best is None or score < best:
            best, nearest = score, profile.name
    facts = {k: have[k] for k in ("torch", "sglang", "sgl-kernel", "flashinfer-python") if k in have}
    return exact, nearest, facts


def _cuda_home_guess(profile_home: str | None) -> str | None:
    for candidate in (
        os.environ.get("CUDA_HOME"),
        profile_home,
        shutil.which("nvcc") and str(Path(shutil.which("nvcc")).resolve().parents[1]),
    ):
        if candidate and Path(candidate, "bin").is_dir():
            return str(Path(candidate).resolve())
    return profile_home


def _torch_record(env: Path) -> dict:
    facts = envinspect.import_torch(env)
    return {} if "error" in facts else facts


def _prefixed(entries: list[manifest.Entry], prefix: str) -> list[manifest.Entry]:
    """Entries of a tree rooted at `prefix` inside a generation ("." becomes `prefix`)."""
    from dataclasses import replace

    return [replace(e, path=prefix if e.path == "." else f"{prefix}/{e.path}") for e in entries]


def adopt(store: Store, lock: Lock, log=print) -> Generation:
    """Turn the real directory at the ml-env path into the store's next generation, in place. The store is
    open (bwstack.store.session.open_store: locked and prepared)."""
    layout = store.layout
    src = layout.ml_env
    if src.is_symlink() or not src.is_dir():
        raise UsageError(f"{src} is not a real env directory (already adopted, or nothing there)")
    if not (src / "pyvenv.cfg").is_file():
        raise UsageError(f"{src} has no pyvenv.cfg: bwstack adopts virtual environments only")
    if os.stat(src).st_dev != os.stat(layout.generations).st_dev:
        raise BwstackError(
            f"{src} and the store {layout.root} are on different filesystems; adoption moves the env without "
            f"copying it, so pass --root on the filesystem of {src}"
        )
    store.check_links(adopting=True)
    try:
        foreign = take_ownership(src)
    except treecheck.OtherFilesystem as exc:
        raise UsageError(f"not adopting {src}: {exc}") from None
    if foreign:
        raise UsageError(
            f"{src}: {len(foreign)} paths belong to another user (e.g. {foreign[0]}); adopt it as root or as "
            f"their owner, so that only the store's owner can change the generation"
        )
    exact, nearest, facts = detect_profile(lock, src)
    log(f"adopting {src} ({', '.join(f'{k} {v}' for k, v in facts.items()) or 'no known packages'}) ...")
    installed = envinspect.installed(src)
    digest = hashlib.sha256(json.dumps(sorted((n, d.version) for n, d in installed.items())).encode()).hexdigest()
    gen_id = store.next_id()
    name = generation_name(gen_id, None, digest)
    write_hook(src, name)  # the generation hook: pins processes to it, sets CUDA_HOME, stops bytecode writes
    seal(src)
    building = store.begin(name)
    profile_home = lock.profiles[nearest].cuda.home if nearest else None
    cuda_home = _cuda_home_guess(profile_home)
    if cuda_home:
        os.symlink(cuda_home, building / "cuda")
    # The manifest describes the generation as it will be once the env is swapped in.
    entries = [e for e in manifest.build(building, skip_top=(MANIFEST, RECORD)) if e.path != "env"]
    entries += _prefixed(manifest.build(src, skip_top=()), "env")
    record = GenerationRecord(
        id=gen_id,
        profile=exact,
        nearest_profile=nearest,
        created=now_iso(),
        origin=f"adopted:{src}",
        lock_digest=lock.profiles[exact].lock_digest() if exact else None,
        python=envinspect.env_python_version(src),
        cuda_home=cuda_home,
        packages={n: {"version": d.version} for n, d in installed.items()},
        torch=_torch_record(src) if facts.get("torch") else {},
        verification={"status": "not-run", "at": now_iso(), "why": "adopted as found"},
    )
    json_record = record.to_json()
    meta = {"packages": json_record["packages"], "python": record.python, "cuda_home": cuda_home,
            "lock_digest": record.lock_digest, "created": record.created}  # fmt: skip
    os.symlink(str(layout.current / "env"), building / "env")  # placeholder, swapped with the real dir below
    gen = store.commit(building, record, meta, entries, link_objects=False)
    checkpoint("adopt-before-current")
    store.flip(gen.name, None, f"adopt {src}")
    checkpoint("adopt-before-exchange")
    swap_in(src, gen.env, log)
    store.ensure_links()
    store.index_files(gen)
    log(f"adopted {src} as generation {name} ({(gen.record.size_bytes or 0) >> 20} MiB, nothing copied)")
    return gen


# ------------------------------------------------------------------------------------------------ snapshot


def _link_tree(src: Path, dest: Path) -> None:
    """cp -al: directories recreated, files hard-linked, symlinks copied (bytecode included)."""
    os.mkdir(dest, 0o755)
    src_s, dest_s = str(src), str(dest)
    for rel, st in treecheck.walk(src):
        if rel == ".":
            continue
        source, target = os.path.join(src_s, rel), os.path.join(dest_s, rel)
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(target, stat.S_IMODE(st.st_mode) | 0o700)
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(source), target)
        elif stat.S_ISREG(st.st_mode):
            os.link(source, target)
        else:
            raise BwstackError(f"{source}: a device or FIFO inside the env; refusing to snapshot it")


def backup(store: Store, lock: Lock, *, depth: str = "quick", log=print) -> dict:
    """Make sure the active env is captured as an immutable generation; return what was done."""
    layout = store.layout
    started = time.perf_counter()
    if layout.ml_env.is_dir() and not layout.ml_env.is_symlink():
        gen = adopt(store, lock, log)
        return {"action": "adopted", "generation": gen.name, "seconds": time.perf_counter() - started}
    active = store.active()
    if active is None:
        return {"action": "nothing", "generation": None, "seconds": 0.0, "note": "no active env to back up"}
    if active.damaged:
        raise BwstackError(
            f"the active generation {active.name} is damaged ({active.damaged}); roll back to another "
            f"(`bwstack rollback --to N`) or rebuild (`bwstack build`)"
        )
    problems = active.verify(depth)
    if not problems:
        return {
            "action": "verified",
            "generation": active.name,
            "seconds": time.perf_counter() - started,
            "note": "the active generation is unchanged since it was sealed; it is its own backup",
        }
    log(f"{active.name} changed since it was sealed ({len(problems)} paths, e.g. {problems[0]}); snapshotting")
    gen = _snapshot(store, active, problems)
    # just hashed from these very files: no second manifest pass before the switch
    store.switch(gen, depth="none", why=f"snapshot of modified {active.name}", post_check=False)
    unrepaired = store.repair(active)
    result = {
        "action": "snapshot",
        "generation": gen.name,
        "from": active.name,
        "seconds": time.perf_counter() - started,
    }
    if unrepaired:
        result["unrepaired"] = [str(p) for p in unrepaired[:20]]
        log(
            f"warning: {active.name} could not be brought back to its manifest ({len(unrepaired)} paths, e.g. "
            f"{unrepaired[0]}): its original bytes are nowhere in the store; it stays listed as changed"
        )
    else:
        result["restored"] = active.name
        log(f"{active.name} is back to its manifest; the drift lives on in {gen.name}")
    return result


def _snapshot(store: Store, active: Generation, problems: list[manifest.Problem]) -> Generation:
    gen_id = store.next_id()
    building = store.begin(f"{gen_id:04d}-snapshot")
    try:
        _link_tree(active.env, building / "env")
        if active.cuda.is_symlink():
            os.symlink(os.readlink(active.cuda), building / "cuda")
        seal(building / "env")
        dev = os.stat(building).st_dev
        entries = manifest.build(
            building, manifest.known_hashes(active.manifest_entries(), dev), skip_top=(MANIFEST, RECORD)
        )
        digest = hashlib.sha256(json.dumps([e.content for e in entries]).encode()).hexdigest()
        name = generation_name(gen_id, active.profile, digest)
        final_building = building.with_name(f"{BUILDING_PREFIX}{name}")
        os.rename(building, final_building)
        building = final_building
        record = active.record.replace(
            id=gen_id,
            created=now_iso(),
            origin=f"snapshot-of:{active.name}",
            packages={n: {"version": d.version} for n, d in envinspect.installed(building / "env").items()},
            verification={"status": "not-run", "at": now_iso(), "why": f"snapshot of a modified {active.name}"},
            drift=tuple(str(p) for p in problems[:50]),
        )
        meta = {k: v for k, v in active.manifest.meta.items() if k != "generation"}
        meta.update({"created": record.created, "packages": record.to_json()["packages"]})
        return store.commit(building, record, meta, entries)
    except BaseException:
        remove_tree(building)
        raise
