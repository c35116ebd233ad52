"""`bwstack generations`: every generation with its state.

`passed` only for one whose checks passed and whose files still match its manifest (a quick check;
--check --verify full re-hashes), so nothing listed good is refused by a rollback."""

from __future__ import annotations

import argparse

from bwstack.cli import options
from bwstack.cli.console import Console

NAME = "generations"
HELP = "list generations"
UNREAD = (options.Unread("check", absent=True, ignores=("verify",)),)  # listing checks quickly


def add_options(p: argparse.ArgumentParser) -> None:
    options.add_node(p, take_over_links=False, verify=True)
    p.add_argument("--check", action="store_true", help="also verify each against its manifest")


def run(args: argparse.Namespace) -> int:
    from bwstack.store.generations import Store

    console = Console.of(args)
    layout = options.layout(args)
    store = Store(layout, console.log)  # read-only: no run lock, nothing prepared
    notes = []
    problem = store.current_problem()
    if problem:
        notes.append(f"warning: {problem}")
    notes += [f"warning: {p}" for p in store.history_lines()[1]]
    active = store.active_or_none()
    rows = [_row(gen, active, args) for gen in store.generations()]
    for note in notes:
        console.note(note)
    failed = args.check and (problem or any(r["state"] in ("damaged", "changed") for r in rows))
    if console.json_mode:
        console.json(rows)
    elif not rows:
        console.text(f"no generations in {layout.generations}")
        return 0
    else:
        console.text("\n".join(_line(r) for r in rows))
    return 1 if failed else 0


def _row(gen, active, args: argparse.Namespace) -> dict:
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
        return row
    problems = gen.verify(args.verify if args.check else "quick")
    verification = gen.record.verification_status
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        row.update({"state": "changed", "why": f"{problems[0]}{more}", "verified": verification})
        row["integrity"] = f"{len(problems)} problems, e.g. {problems[0]}"
    else:
        row.update({"state": verification or "unknown", "why": "", "verified": verification})
        row["integrity"] = "ok"
    if gen.manifest.legacy:
        row["note"] = "format 1 manifest (bwstack 0.1): covers env/ only"
    return row


def _line(r: dict) -> str:
    size = f"{(r['size_bytes'] or 0) / (1 << 30):.1f} GiB"
    mark = "*" if r["active"] else " "
    profile = str(r["profile"])[:28]
    line = f"{mark} {r['id']:>4}  {r['name']:<36} {profile:<28} {r['created']!s:<20}  {size:>9}  {r['state']}"
    return line + (f": {r['why']}" if r["why"] else "")
