"""The `bwstack` command line. Each subcommand is a thin wrapper over a module that does the work."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from bwstack import __version__, paths
from bwstack.cli import options as cliargs
from bwstack.errors import BwstackError, UsageError
from bwstack.lock.model import Lock, default_lock_path, load_lock

Handler = Callable[[argparse.Namespace], int]


def _lock(args: argparse.Namespace) -> Lock:
    return load_lock(args.lock)


def _print_json(payload: object) -> None:
    json.dump(payload, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


# ------------------------------------------------------------------------------------------------ lock


def cmd_lock(args: argparse.Namespace) -> int:
    from bwstack.lock import resolve

    lock = _lock(args)
    if args.check:
        from bwstack.lock import check as lockcheck

        report = lockcheck.check_lock(lock, online=not args.offline)
        if args.json:
            _print_json(report.as_dict())
        else:
            print(report.render())
        return 0 if report.ok else 1
    profiles = [args.profile] if args.profile else None
    if args.profile:
        lock.profile(args.profile)
    text = resolve.lock_profiles(lock, profiles, log=lambda msg: print(msg, file=sys.stderr))
    resolve.write_lock(args.lock, text)
    print(f"wrote {args.lock}")
    return 0


# ------------------------------------------------------------------------------------------------ show


def cmd_show(args: argparse.Namespace) -> int:
    from bwstack.cli import show

    lock = _lock(args)
    profile = lock.profile(args.profile)
    payload = show.describe(lock, profile)
    if args.json:
        _print_json(payload)
    else:
        print(show.render(payload))
    return 0


# ------------------------------------------------------------------------------------------------ plan


def cmd_plan(args: argparse.Namespace) -> int:
    from bwstack.provision import plan

    lock = _lock(args)
    profile = lock.profile(args.profile)
    result = plan.plan_env(profile, Path(args.env) if args.env else None, root=args.root, ml_env=args.ml_env)
    if args.json:
        _print_json(result.as_dict())
    else:
        print(result.render())
    return 0


# ------------------------------------------------------------------------------------------------ node ops


def _layout(args: argparse.Namespace):
    from bwstack.store.generations import Layout

    return Layout.default(args.root, args.ml_env, args.cuda_link, getattr(args, "take_over_links", False))


def _build_options(args: argparse.Namespace):
    from bwstack.provision.build import BuildOptions
    from bwstack.provision.wheelhouse import Sources

    return BuildOptions(
        sources=Sources.parse(args.wheelhouse or (), args.index or (), args.offline),
        allow_unhashed=tuple(args.allow_unhashed or ()),
        python=args.python,
        switch=not getattr(args, "no_switch", False),
        verify_depth=args.verify,
        ca_bundle=args.ca_bundle,
    )


def _apply_ca(args: argparse.Namespace) -> None:
    if getattr(args, "ca_bundle", None):
        if not Path(args.ca_bundle).is_file():
            raise UsageError(f"--ca-bundle {args.ca_bundle}: no such file")
        os.environ["REQUESTS_CA_BUNDLE"] = args.ca_bundle
        os.environ["SSL_CERT_FILE"] = args.ca_bundle


def _report(args: argparse.Namespace, payload: dict, text: str) -> None:
    if args.json:
        _print_json(payload)
    else:
        print(text)


def cmd_build(args: argparse.Namespace) -> int:
    from bwstack.provision import build

    lock = _lock(args)
    profile = lock.profile(args.profile)
    layout = _layout(args)
    _apply_ca(args)
    if args.check:
        plan = build.plan_build(lock, profile, layout)
        _report(args, plan, "\n".join(plan["actions"]) or "nothing to do")
        return 0
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    result = build.build(lock, profile, layout, _build_options(args), log=log)
    _report(
        args,
        result,
        f"{'changed' if result['changed'] else 'unchanged'}: {layout.ml_env} -> {result['active']}",
    )
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from bwstack.provision import build

    if args.target:
        from bwstack.fleet import playbooks

        return playbooks.run_rollback(args)
    for option in ("skip", "ssh_key", "known_hosts", "extra_vars"):
        if getattr(args, option, None):
            flag = "-e" if option == "extra_vars" else "--" + option.replace("_", "-")
            raise UsageError(f"{flag} is for `rollback --target` (the rollback playbook); a rollback here runs no play")
    lock = _lock(args)
    layout = _layout(args)
    _apply_ca(args)
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    if args.check:
        plan = build.plan_rollback(layout, to=args.to, profile_name=args.profile, rebuild=args.rebuild, lock=lock)
        _report(args, plan, plan["action"])
        return 0
    result = build.rollback(
        lock, layout, to=args.to, profile_name=args.profile, rebuild=args.rebuild, opts=_build_options(args), log=log
    )
    _report(
        args,
        result,
        f"{layout.ml_env} -> {result['generation']}" + (f" ({result['note']})" if result.get("note") else ""),
    )
    return 0


def cmd_backup(args: argparse.Namespace) -> int:
    from bwstack.provision import backup
    from bwstack.store import archive
    from bwstack.store.generations import Store
    from bwstack.store.runlock import RunLock

    lock = _lock(args)
    layout = _layout(args)
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    with RunLock(layout.root):
        store = Store(layout, log)
        store.prepare()
        backup.finish_interrupted_adoption(store, log)
        result = backup.backup(store, lock, depth=args.verify, log=log)
        if args.archive:
            gen = store.active()
            if gen is None:
                raise UsageError("nothing to archive: no active generation")
            result["archive"] = archive.write_archive(gen, Path(args.archive))
    text = f"{result['action']}: {result.get('generation')}"
    if args.archive:
        archive = result["archive"]
        text += f"; archive {archive['archive']} ({archive['bytes'] >> 20} MiB, sha256 {archive['sha256'][:16]}...)"
    _report(args, result, text)
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from bwstack.provision import backup
    from bwstack.store import archive
    from bwstack.store.generations import Store
    from bwstack.store.runlock import RunLock

    layout = _layout(args)
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    with RunLock(layout.root):
        store = Store(layout, log)
        store.prepare()
        backup.finish_interrupted_adoption(store, log)
        result = archive.restore(store, Path(args.archive), switch=not args.no_switch, log=log)
    text = f"restored {result['generation']}" if result.get("changed", True) else result["note"]
    _report(args, result, text)
    return 0


def cmd_adopt(args: argparse.Namespace) -> int:
    from bwstack.provision import backup
    from bwstack.store.generations import Store
    from bwstack.store.runlock import RunLock

    lock = _lock(args)
    layout = _layout(args)
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    with RunLock(layout.root):
        gen = backup.adopt(Store(layout, log), lock, log)
    _report(args, {"generation": gen.name}, f"adopted as {gen.name}")
    return 0


def cmd_generations(args: argparse.Namespace) -> int:
    """Every generation with its state: `passed` only for one whose checks passed and whose files still
    match its manifest (a quick check; --check --verify full re-hashes), so nothing listed good is refused
    by a rollback."""
    from bwstack.store.generations import Store

    layout = _layout(args)
    store = Store(layout)
    notes = []
    problem = store.current_problem()
    if problem:
        notes.append(f"warning: {problem}")
    notes += [f"warning: {p}" for p in store.history_lines()[1]]
    active = store.active_or_none()
    rows = []
    for gen in store.generations():
        damaged = gen.damaged
        row = {
            "id": gen.id,
            "name": gen.name,
            "profile": gen.profile or f"(adopted, like {gen.record.nearest_profile})",
            "created": gen.record.created,
            "size_bytes": gen.record.size_bytes,
            "active": active is not None and gen.name == active.name,
            "path": str(gen.path),
        }
        if damaged:
            row.update({"state": "damaged", "why": damaged, "verified": None, "integrity": f"damaged: {damaged}"})
        else:
            problems = gen.verify(args.verify if args.check else "quick")
            verification = gen.record.verification_status
            if problems:
                more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
                why = f"{problems[0]}{more}"
                row.update({"state": "changed", "why": why, "verified": verification})
                row["integrity"] = f"{len(problems)} problems, e.g. {problems[0]}"
            else:
                row.update({"state": verification or "unknown", "why": "", "verified": verification})
                row["integrity"] = "ok"
            if gen.manifest.legacy:
                row["note"] = "format 1 manifest (bwstack 0.1): covers env/ only"
        rows.append(row)
    for note in notes:
        print(note, file=sys.stderr)
    if args.json:
        _print_json(rows)
        return 1 if args.check and (problem or any(r["state"] in ("damaged", "changed") for r in rows)) else 0
    if not rows:
        print(f"no generations in {layout.generations}")
        return 0
    for r in rows:
        size = f"{(r['size_bytes'] or 0) / (1 << 30):.1f} GiB"
        mark = "*" if r["active"] else " "
        profile = str(r["profile"])[:28]
        line = f"{mark} {r['id']:>4}  {r['name']:<36} {profile:<28} {r['created']!s:<20}  {size:>9}  {r['state']}"
        if r["why"]:
            line += f": {r['why']}"
        print(line)
    return 1 if args.check and (problem or any(r["state"] in ("damaged", "changed") for r in rows)) else 0


def cmd_prune(args: argparse.Namespace) -> int:
    from bwstack.store.generations import Store
    from bwstack.store.runlock import RunLock

    layout = _layout(args)
    with RunLock(layout.root):
        store = Store(layout)
        store.prepare()
        removed = store.prune(args.keep)
    _report(args, {"removed": removed}, "removed: " + (", ".join(removed) or "nothing"))
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    from bwstack.lock.tags import Target
    from bwstack.provision.wheelhouse import Fetcher, Sources, export, select

    lock = _lock(args)
    profile = lock.profile(args.profile)
    closure = profile.require_closure(lock.path)
    _apply_ca(args)
    dest = Path(args.dest)
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    # DEST is the operator's directory (often shared, handed to other machines): what is already in it, its
    # .store included, is hashed again before it is reused.
    sources = Sources.parse(args.wheelhouse or (), args.index or (), args.offline)
    fetcher = Fetcher(dest / ".store", sources, args.allow_unhashed or (), log=log, rehash_store=True)
    parts = {"env": closure.env, "cuda-toolkit": closure.cuda_toolkit}
    chosen = {}
    for part in ["env", "cuda-toolkit"] if args.part == "all" else [args.part]:
        chosen.update(select(parts[part], Target.of(profile)))
    wheels = fetcher.fetch_all(chosen)
    replaced = export(wheels, dest, log)
    payload = {n: w.as_dict() for n, w in wheels.items()}
    text = f"{len(wheels)} wheels in {dest}" + (f" ({len(replaced)} damaged files replaced)" if replaced else "")
    _report(args, payload, text)
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from bwstack.lock import requirements

    lock = _lock(args)
    profile = lock.profile(args.profile)
    closure = profile.require_closure(lock.path)
    packages = closure.cuda_toolkit if args.part == "cuda-toolkit" else closure.env
    if args.layers:
        out = Path(args.layers)
        out.mkdir(parents=True, exist_ok=True)
        files = requirements.render_layers(profile, packages, lock.image_layers)
        for i, (layer, text) in enumerate(files.items(), 1):
            (out / f"{i:02d}-{layer}.txt").write_text(text)
        print("\n".join(str(out / f"{i:02d}-{layer}.txt") for i, layer in enumerate(files, 1)))
        return 0
    sys.stdout.write(requirements.render(profile, packages))
    return 0


def cmd_env_install(args: argparse.Namespace) -> int:
    """Install a rendered requirement file into an env (the Docker build's per-layer step)."""
    from bwstack.lock import requirements
    from bwstack.lock.tags import Target
    from bwstack.provision import envbuild
    from bwstack.provision.wheelhouse import Fetcher, Sources, select

    _apply_ca(args)
    env = Path(args.into)
    packages = requirements.parse(Path(args.requirements))
    target = Target(python=args.python_version, glibc_minor=args.glibc)
    store = Path(args.store) if args.store else env.parent / ".bwstack-wheels"
    fetcher = Fetcher(store, Sources.parse(args.wheelhouse or (), (), args.offline), args.allow_unhashed or ())
    wheels = fetcher.fetch_all(select(packages, target))
    if not (env / "bin" / "python").exists():
        envbuild.create_venv(env, envbuild.find_python(args.python_version, args.python))
    envbuild.install(env, wheels, link_mode=args.link_mode, cache_dir=Path(args.uv_cache) if args.uv_cache else None)
    print(f"installed {len(wheels)} packages into {env}")
    return 0


def cmd_cuda(args: argparse.Namespace) -> int:
    from bwstack.provision import cudatk
    from bwstack.provision.wheelhouse import Fetcher, Sources

    lock = _lock(args)
    profile = lock.profile(args.profile)
    home = Path(args.prefix or profile.cuda.home)
    if args.action == "status":
        st = cudatk.status(home)
        st_dict = st.as_dict() | {
            "profile_version": profile.cuda.version,
            "matches": cudatk.matches(profile, st),
        }
        _report(args, st_dict, f"{home}: {st.version or 'absent'} ({st.managed_by}) {st.note}".strip())
        return 0 if st.exists else 1
    _apply_ca(args)
    layout = _layout(args)
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    fetcher = Fetcher(layout.wheel_store, Sources.parse(args.wheelhouse or (), args.index or (), args.offline), log=log)
    before = cudatk.status(home)
    st = cudatk.install_pip(profile, fetcher, home, log=log)
    payload = st.as_dict() | {"changed": not before.exists}
    _report(args, payload, f"{home}: CUDA {st.version} ({'installed' if not before.exists else 'already there'})")
    return 0


# ------------------------------------------------------------------------------------------------ patches


def _env_site_packages(args: argparse.Namespace) -> Path:
    from bwstack.probe import envinspect

    env = Path(args.env) if args.env else _layout(args).ml_env
    try:
        return envinspect.site_packages(env)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None


def cmd_patch(args: argparse.Namespace) -> int:
    from bwstack.provision import patches

    site = _env_site_packages(args)
    ids = args.patch or list(_lock(args).profile(args.profile).patches)
    if args.action == "status":
        states = patches.status(site, ids)
        payload = [s.as_dict() for s in states]
        text = "\n".join(
            f"{s.patch_id}: {s.state} ({s.package} {s.version or 'not installed'}) {s.reason}".rstrip() for s in states
        )
        _report(args, payload, text)
        return 0
    results = patches.apply(site, ids) if args.action == "apply" else patches.revert(site, ids)
    payload = [r.as_dict() for r in results]
    text = "\n".join(f"{r.patch_id}: {r.action} ({r.package} {r.version})" for r in results)
    _report(args, payload, text)
    return 0


def cmd_features(args: argparse.Namespace) -> int:
    from bwstack.probe import features

    site = _env_site_packages(args)
    report = features.report(site, args.capability)
    if args.json:
        _print_json(report)
        return 0
    print(f"SM{args.capability.replace('.', '')} features of {site}:")
    for key in ("torch_symm_mem_allreduce", "flashinfer_allreduce_fusion"):
        item = report[key]
        print(f"  {key}: {item['state'].upper()}")
        print(f"    {item['reason']}")
    return 0


# ------------------------------------------------------------------------------------------------ preflight


def cmd_preflight(args: argparse.Namespace) -> int:
    from bwstack.probe import preflight

    profile = _lock(args).profile(args.profile)
    layout = _layout(args)
    report = preflight.check(
        preflight.requirements_of(profile),
        root=str(layout.root),
        min_free_gb=args.min_free_gb,
        allow_no_gpu=args.allow_no_gpu,
        allow_other_gpu=args.allow_other_gpu,
    )
    if args.json:
        _print_json(report.as_dict())
    else:
        print(report.render())
    if not report.ok:
        print(f"bwstack: error: preflight refused: {report.refusal()}", file=sys.stderr)
        return 4
    return 0


def cmd_probe_bundle(args: argparse.Namespace) -> int:
    from bwstack.fleet import probe_bundle

    print(probe_bundle.write(args.out))
    return 0


# ------------------------------------------------------------------------------------------------ verify


def cmd_verify(args: argparse.Namespace) -> int:
    from bwstack.checks import hostspec, verify

    if args.list_checks:
        print("\n".join(verify.known_checks()))
        return 0
    targets = hostspec.parse(args.target, frozenset(hostspec.Scheme))
    ssh = hostspec.SshOptions.from_args(args.ssh_key, args.known_hosts)
    if args.host_name is not None:
        if not args.host_name.strip():
            raise UsageError("--host-name: empty")
        if len(targets) != 1 or isinstance(targets[0], hostspec.AnsibleTarget):
            raise UsageError("--host-name names one host: give exactly one local://, ssh:// or docker:// target")
    reports = verify.check_hosts(
        targets,
        lock_path=args.lock,
        ssh=ssh,
        host_name=args.host_name,
        profile=args.profile,
        env=args.env,
        capability=args.capability,
        runtime=not args.no_runtime,
        facts_dir=args.facts_dir,
        skip=_waiver_texts(args.skip),
        extra_args=["--stack-no-remembered-waivers"] if args.no_remembered_waivers else [],
    )
    print(verify.as_json(reports) if args.json else verify.render(reports))
    return 0 if verify.ok(reports) else 1


def _waiver_texts(items: list[str] | None) -> list[str]:
    from bwstack.checks import verify

    return [w.text() for w in verify.parse_waivers(items or [])]


def cmd_waivers(args: argparse.Namespace) -> int:
    from bwstack.probe import waivers

    layout = _layout(args)
    replace = args.set is not None or args.clear
    changed = False
    if args.set is not None and args.clear:
        raise UsageError("--set and --clear: give one (--set replaces the remembered waivers, --clear drops them)")
    if replace and not layout.root.is_dir():
        raise UsageError(f"no bwstack store at {layout.root}: provision the node first")
    try:
        current = waivers.load(layout.root)
    except ValueError as exc:
        if not replace:
            raise BwstackError(str(exc)) from None
        current = None  # a damaged file is replaced
    if replace:
        wanted = [] if args.clear else [waivers.parse(t) for t in _waiver_texts(args.set)]
        changed = current != wanted
        if changed and not args.check:
            try:
                waivers.save(layout.root, wanted)
            except OSError as exc:
                raise BwstackError(f"could not write {waivers.path_of(layout.root)}: {exc.strerror}") from None
        current = wanted
    rows = [{"check": w.check, "reason": w.reason} for w in current or []]
    payload = {"store": str(layout.root), "waivers": rows, "changed": changed}
    text = "\n".join(f"{w['check']}: {w['reason']}" for w in rows) or f"no waivers remembered in {layout.root}"
    _report(args, payload, text)
    return 0


# ------------------------------------------------------------------------------------------------ bench


def cmd_bench(args: argparse.Namespace) -> int:
    import time

    from bwstack.bench import run as bench

    only = [x.strip().upper() for x in args.only.split(",")] if args.only else None
    figures = bench.run(
        args.lock, args.profile, args.work, args.runs, args.quick, only, log=lambda m: print(m, file=sys.stderr)
    )
    if args.json:
        _print_json([f.as_dict() for f in figures])
        return 0
    header = (
        f"bwstack bench{' --quick' if args.quick else ''} --profile {args.profile} --runs {args.runs}: "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {bench.machine()}"
    )
    print(header + "\n\n" + bench.render(figures))
    return 0


# ------------------------------------------------------------------------------------------------ parser


def _add_waiver_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--skip",
        action="append",
        metavar="CHECK=REASON",
        help="waive the verify checks whose name contains CHECK, with the reason (the report shows it; repeatable)",
    )


def _add_ssh_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ssh-key", metavar="FILE", help="private key for ssh:// and ansible:// hosts")
    p.add_argument(
        "--known-hosts",
        metavar="FILE",
        help="known-hosts file for ssh:// and ansible:// hosts (host keys are then checked strictly)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = cliargs.Parser(
        prog="bwstack",
        description="Provision, snapshot, roll back and verify the pinned SM120 LLM-serving stack.",
    )
    parser.add_argument("--version", action="version", version=f"bwstack {__version__}")
    # No type check here: argparse would apply it to the default too, and commands that never read the lock
    # (generations, prune) must work where no lock file is beside them. load_lock says what is wrong.
    parser.add_argument(
        "--lock",
        default=os.environ.get("BWSTACK_LOCK", str(default_lock_path())),
        help="the stack lock (default: $BWSTACK_LOCK, else %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("lock", help="resolve every profile's closure with hashes, or --check the lock")
    p.add_argument("--check", action="store_true", help="verify the lock instead of resolving it")
    p.add_argument("--offline", action="store_true", help="with --check: skip the comparison with PyPI")
    p.add_argument("--profile", help="resolve only this profile (others keep their closure)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_lock)

    p = sub.add_parser("show", help="what a profile pins")
    p.add_argument("--profile", help="profile (default: the lock's default_profile)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("plan", help="what provisioning would change in an env (missing, extra, version, hash)")
    p.add_argument("--profile")
    p.add_argument("--env", help="the env to compare (default: the active ml-env)")
    p.add_argument("--root", help=f"bwstack's store (default: {paths.DEFAULT_ROOT} as root, else ~/{paths.USER_ROOT})")
    p.add_argument("--ml-env")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    node = argparse.ArgumentParser(add_help=False)
    node.add_argument(
        "--root", help=f"bwstack's store (default: {paths.DEFAULT_ROOT} as root, else ~/{paths.USER_ROOT})"
    )
    node.add_argument("--ml-env", help="the env path users run (default: /opt/ml-env as root, else ~/ml-env)")
    node.add_argument(
        "--cuda-link",
        help="the /usr/local/cuda-style link to keep on the active toolkit ('none' to leave it)",
    )
    node.add_argument("--json", action="store_true")
    node.add_argument(
        "--take-over-links",
        action="store_true",
        help="let this store re-point an ml-env or CUDA link that another store or somebody else made",
    )
    node.add_argument(
        "--verify", choices=["quick", "full"], default="quick",
        help="manifest check before switching: quick (inode/size/mtime, re-hash what moved) or full (every byte)",
    )  # fmt: skip

    sources = argparse.ArgumentParser(add_help=False)
    sources.add_argument(
        "--wheelhouse", action="append", type=cliargs.existing_dir, help="directory of wheels to use first (repeatable)"
    )
    sources.add_argument("--index", action="append", help="NAME=URL: a mirror for one of the lock's indexes")
    sources.add_argument("--offline", action="store_true", help="use only the store and --wheelhouse")
    sources.add_argument("--ca-bundle", type=cliargs.existing_file, help="CA bundle for TLS (always verified)")
    sources.add_argument(
        "--allow-unhashed", action="append", metavar="NAME",
        help="install NAME although the lock has no sha256 for it (recorded as unverified)",
    )  # fmt: skip
    sources.add_argument("--python", help="interpreter for new envs (default: pythonX.Y of the profile)")

    p = sub.add_parser("build", parents=[node, sources], help="back up, build the profile's generation, switch")
    p.add_argument("--profile")
    p.add_argument("--no-switch", action="store_true", help="build and commit, but leave the active env")
    p.add_argument("--check", action="store_true", help="say what would change; change nothing")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("rollback", parents=[node, sources], help="switch back to a verified generation")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--to", help="generation id or name")
    group.add_argument("--profile", help="the newest generation of this profile")
    p.add_argument(
        "--rebuild",
        action="store_true",
        help="with nothing to go back to, build the profile (default: the lock's rollback profile) from the lock",
    )
    p.add_argument("--check", action="store_true", help="say what the rollback would do; change nothing")
    p.add_argument(
        "--target",
        help="roll back these hosts through the rollback playbook, then verify them: local://, "
        "ssh://[user@]host[:port][,...] or ansible://INVENTORY[?limit=...&group=...]",
    )
    p.set_defaults(func=cmd_rollback)

    p = sub.add_parser("backup", parents=[node], help="capture the active env as a verified generation")
    p.add_argument("--archive", help="also write an off-node archive (tar + zstd, with .sha256)")
    p.set_defaults(func=cmd_backup)

    p = sub.add_parser("restore", parents=[node], help="bring an archived generation back and switch to it")
    p.add_argument("archive")
    p.add_argument("--no-switch", action="store_true")
    p.set_defaults(func=cmd_restore)

    p = sub.add_parser("adopt", parents=[node], help="turn a hand-made env at --ml-env into a generation")
    p.set_defaults(func=cmd_adopt)

    p = sub.add_parser("generations", parents=[node], help="list generations")
    p.add_argument("--check", action="store_true", help="also verify each against its manifest")
    p.set_defaults(func=cmd_generations)

    p = sub.add_parser("prune", parents=[node], help="remove old generations (never the active or last verified)")
    p.add_argument("--keep", type=cliargs.positive_int, required=True)
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser("fetch", parents=[sources], help="download a profile's wheels (hash-checked) into a directory")
    p.add_argument("--profile")
    p.add_argument("--dest", required=True)
    p.add_argument("--part", choices=["env", "cuda-toolkit", "all"], default="env")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("render", help="hash-pinned requirements of a profile (stdout), or per Docker layer")
    p.add_argument("--profile")
    p.add_argument("--part", choices=["env", "cuda-toolkit"], default="env")
    p.add_argument("--layers", metavar="DIR", help="write one file per image layer into DIR")
    p.set_defaults(func=cmd_render)

    env_p = sub.add_parser("env", help="low-level env operations")
    env_sub = env_p.add_subparsers(dest="env_command", required=True)
    p = env_sub.add_parser("install", parents=[sources], help="install a rendered requirement file into an env")
    p.add_argument("--requirements", type=cliargs.existing_file, required=True)
    p.add_argument("--into", required=True)
    p.add_argument("--python-version", default="3.12")
    p.add_argument("--glibc", type=int, default=28, help="manylinux_2_N of the target (default 28)")
    p.add_argument("--store", help="wheel store (default: beside the env)")
    p.add_argument("--uv-cache")
    p.add_argument("--link-mode", default="copy", choices=["copy", "hardlink"])
    p.set_defaults(func=cmd_env_install)

    p = sub.add_parser("cuda", parents=[node, sources], help="the profile's CUDA toolkit: status, or install (pip)")
    p.add_argument("action", choices=["status", "install"])
    p.add_argument("--profile")
    p.add_argument("--prefix", help="install prefix (default: the profile's cuda.home)")
    p.set_defaults(func=cmd_cuda)

    envsel = argparse.ArgumentParser(add_help=False)
    envsel.add_argument("--env", help="the env (default: the active ml-env)")
    envsel.add_argument("--root", help=argparse.SUPPRESS)
    envsel.add_argument("--ml-env", help=argparse.SUPPRESS)
    envsel.add_argument("--cuda-link", help=argparse.SUPPRESS)
    envsel.add_argument("--json", action="store_true")

    p = sub.add_parser("patch", parents=[envsel], help="SGLang SM120 patches: apply, revert or show their state")
    p.add_argument("action", choices=["apply", "revert", "status"])
    p.add_argument("--patch", action="append", help="patch id (default: the profile's patches)")
    p.add_argument("--profile")
    p.set_defaults(func=cmd_patch)

    p = sub.add_parser("features", parents=[envsel], help="what the installed code will really do on SM120")
    p.add_argument(
        "--capability", type=cliargs.capability, default="12.0", help="target compute capability (default 12.0)"
    )
    p.set_defaults(func=cmd_features)

    p = sub.add_parser("preflight", parents=[node], help="is this node fit for the profile? (changes nothing)")
    p.add_argument("--profile")
    p.add_argument("--min-free-gb", type=cliargs.non_negative_float, default=25.0)
    p.add_argument("--allow-no-gpu", action="store_true", help="accept a CPU-only target (containers, CI), loudly")
    p.add_argument("--allow-other-gpu", action="store_true", help="accept GPUs of another capability, loudly")
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser("probe-bundle", help="write the probe zipapp (what the playbooks ship to nodes)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_probe_bundle)

    p = sub.add_parser("bench", help="the performance figures (P1-P6) against their anchors, in one run")
    p.add_argument("--profile", default="cu128", help="profile to benchmark (default cu128: the one PyPI serves)")
    p.add_argument("--work", default="/var/tmp/bwstack-bench", help="scratch directory (tens of GB for cu128)")
    p.add_argument("--runs", type=cliargs.positive_int, default=3)
    p.add_argument("--quick", action="store_true", help="a small real closure: checks the harness, not speed")
    p.add_argument("--only", help="comma list, e.g. P1,P3")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)

    from bwstack.accept import command as accept
    from bwstack.cli import system_packages
    from bwstack.fleet import playbooks
    from bwstack.image import build as image
    from bwstack.serveplan import cli as serveplan_cli

    playbooks.register(sub)
    image.register(sub)
    accept.register(sub)
    serveplan_cli.register(sub)
    system_packages.register(sub)

    p = sub.add_parser("verify", help="run the node checks (ABI, CUDA, SM120 kernels, features, GPU) on hosts")
    p.add_argument(
        "--target",
        default="local://",
        help="local:// (default), ssh://[user@]host[:port][,...], ansible://INVENTORY[?limit=...&group=...] "
        "or docker://CONTAINER",
    )
    p.add_argument("--profile", help="profile to check against (default: the env's own)")
    p.add_argument("--env", help="env path on the targets (default: their ml-env)")
    p.add_argument("--capability", type=cliargs.capability, help="target GPU capability (default: the profile's)")
    p.add_argument("--no-runtime", action="store_true", help="skip the GPU runtime probes")
    p.add_argument("--facts-dir", help="also write each host's probe facts as JSON here")
    _add_waiver_option(p)
    p.add_argument(
        "--no-remembered-waivers",
        action="store_true",
        help="ignore the waivers the node's store remembers (provision verifies with exactly the ones it is given)",
    )
    _add_ssh_options(p)
    p.add_argument(
        "--host-name", help="the name the report gives the one target (the verify role passes user@host:port)"
    )
    p.add_argument("--list-checks", action="store_true", help="name every check (what --skip matches against)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("waivers", parents=[node], help="the verify waivers this node remembers (set at provision time)")
    p.add_argument("--set", action="append", metavar="CHECK=REASON", help="replace the remembered waivers (repeatable)")
    p.add_argument("--clear", action="store_true", help="forget every remembered waiver")
    p.add_argument(
        "--check", action="store_true", help="with --set/--clear: say whether it would change; change nothing"
    )
    p.set_defaults(func=cmd_waivers)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not args.lock.strip():
            raise UsageError("--lock (or BWSTACK_LOCK) is empty: give a lock file")
        cliargs.reject_empty(parser, args)
        return int(args.func(args))
    except BwstackError as exc:
        _error(str(exc))
        return exc.exit_code
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        print("bwstack: interrupted (a switch is whole or not made; re-run to converge)", file=sys.stderr)
        return 130
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        _error(f"{where}{exc.strerror or exc}")
        return 2 if isinstance(exc, PermissionError) else 1
    except Exception as exc:  # the last line of defence: a person gets one line, not a traceback
        if os.environ.get("BWSTACK_DEBUG"):
            raise
        _error(f"internal error ({type(exc).__name__}: {exc}); BWSTACK_DEBUG=1 shows where")
        return 70


def _error(text: str) -> None:
    message = " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    print(f"bwstack: error: {message}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
