"""The store preamble, owned here once: every command that changes a store opens it through `open_store`.

Opening a store for a change means: take the run lock (one bwstack run at a time per store), make sure the
store exists and clean what an interrupted run left (`Store.prepare`), and finish an adoption a kill
interrupted between committing the generation and swapping the hand-made directory in. Only then may a
command look at generations or change anything.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from bwstack.errors import UsageError
from bwstack.fsutil import atomic_symlink
from bwstack.probe import dirfd
from bwstack.store.generations import Store
from bwstack.store.layout import Layout, check_cache, check_private_folder, enclosing_store, is_store
from bwstack.store.runlock import NAME as LOCK_NAME
from bwstack.store.runlock import RunLock
from bwstack.store.tree import exchange, remove_tree

Log = Callable[[str], None]


@contextmanager
def open_store(layout: Layout, log: Log = print) -> Iterator[Store]:
    """The store at `layout`, locked for this run, prepared, with any interrupted adoption finished."""
    check_store_root(layout)
    check_cache(layout)
    with RunLock(layout.root):
        store = Store(layout, log)
        store.prepare()
        finish_interrupted_adoption(store, log)
        yield store


# What a store's root holds (bwstack puts each there: the node's tool, lock and receipt, the default cache, ...).
STORE_NAMES = frozenset(
    {"generations", LOCK_NAME, "current", "cache", "history.jsonl", "archives.jsonl", "tool", "dist",
     "stack.lock.yaml", "provisioned.json", "waivers.json",
     "tool.previous"}  # the tool role's venv set aside while it makes a new one (an interrupted run leaves it)
)  # fmt: skip
# What a write into the root leaves for a moment: bwstack's atomic writes (`.<name>.<random>.tmp`) and Ansible's
# copy of the lock or wheel (`.ansible_tmp<8 random characters><name>`, its atomic_move).
_PASSING = re.compile(r"\.(?P<name>[^/]+?)\.[A-Za-z0-9_]+\.tmp|\.ansible_tmp[a-z0-9_]{8}(?P<copied>[^/]+)")
# What the filesystem itself keeps at a root that is a filesystem of its own (a disk of its own for the store: ext4's
# lost+found) or on NFS (.nfsXXXX: a file removed while still open).
_FILESYSTEM_NAMES = re.compile(r"lost\+found|\.nfs[0-9a-fA-F]+")


def _a_store_entry(name: str) -> bool:
    if name in STORE_NAMES or _FILESYSTEM_NAMES.fullmatch(name):
        return True
    passing = _PASSING.fullmatch(name)
    return passing is not None and (passing["name"] or passing["copied"]) in STORE_NAMES


def _store_within(root: Path, entries: list[str]) -> Path | None:
    """A store at a name the root holds, or in its generations/ or cache/ (names a store uses, so a root holding
    them passes the check of other files): what this store's prune or cache would take for its own."""
    places = [root / name for name in entries]
    for folder in ("generations", "cache"):
        try:
            places += [root / folder / name for name in os.listdir(root / folder)]
        except OSError:
            continue
    return next((place for place in places if is_store(place)), None)


def check_store_root(layout: Layout) -> None:
    """The store's root is new, empty or a store already: it holds only what bwstack puts in one, and it is the
    running user's alone, as are the folders above it (check_private_folder). Opening a store makes the root
    0755 and leaves its lock and generations/ there: a mistyped --root naming a folder of other files (a home,
    /tmp, a folder that happens to hold a `tool/`) would be opened up to everyone and left holding the store's
    files, and a root another user owns is their store, not this run's."""
    root = layout.root
    # A store inside another (in a generation, or beside its generations/) would be files that store does not know:
    # its generation fails its manifest check, its root holds other files.
    outer = enclosing_store(root.parent)
    if outer is not None:
        raise UsageError(
            f"store root {root} is inside the store {outer}, which keeps only its own files: name a folder outside "
            f"it (--root)"
        )
    # Who can write the folders above it: another user who can rename the root away could put a folder of theirs
    # in its place after this check, and the run would open the store there.
    check_private_folder(root, "the store root", "--root")
    if not os.path.lexists(root):
        # Made here, then judged as made: below a sticky shared folder (/tmp) another user could have made a
        # missing folder on the way between the check above and the mkdir, which would take it as it found it.
        try:
            dirfd.make_folders(root, 0o755)
        except OSError as exc:
            where = f" ({exc.filename})" if exc.filename else ""
            raise UsageError(f"store root {root}: cannot be made: {exc.strerror or exc}{where}") from None
        check_private_folder(root, "the store root", "--root")
    try:
        st = os.lstat(root)
        entries = os.listdir(root) if stat.S_ISDIR(st.st_mode) else None
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UsageError(f"store root {root}: {exc.strerror or exc}") from None
    if entries is None:
        raise UsageError(f"store root {root} is not a directory (a link or a file): name the folder itself (--root)")
    inner = _store_within(root, entries)
    if inner is not None:
        raise UsageError(
            f"store root {root} holds the store {inner}: its prune would remove that store as a stray generation; "
            f"name another folder (--root)"
        )
    others = sorted(name for name in entries if not _a_store_entry(name))
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise UsageError(
            f"store root {root} holds other files ({shown}) beside what bwstack keeps in a store: name a new or "
            f"empty folder, or the store itself (--root)"
        )


def swap_in(real_dir: Path, placeholder: Path, log: Log) -> None:
    """Put a real directory where the placeholder link is, and the link where the directory was: one atomic
    exchange, so the path works before, during and after."""
    try:
        exchange(real_dir, placeholder)
    except OSError as exc:
        if exc.errno not in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
        # No RENAME_EXCHANGE on this filesystem: two renames, with a moment where the path is missing.
        log(f"warning: {real_dir.parent} does not support atomic exchange; moving in two steps")
        link_target = os.readlink(placeholder)
        placeholder.unlink()
        os.rename(real_dir, placeholder)
        atomic_symlink(link_target, real_dir)


def finish_interrupted_adoption(store: Store, log: Log = print) -> None:
    """A kill between committing an adopted generation and swapping the directory in: finish the swap."""
    placeholder = str(store.layout.current / "env")
    for gen in store.usable():
        adopted_from = gen.record.adopted_from
        if gen.env.is_symlink() and adopted_from is not None:
            src = Path(adopted_from)
            # Only what adopt itself leaves: its placeholder link, and the env this store adopts (a record naming
            # another folder would have bwstack move that folder into the store). Anything else never completed.
            ours = src == store.layout.ml_env and os.readlink(gen.env) == placeholder
            if ours and src.is_dir() and not src.is_symlink() and (src / "pyvenv.cfg").is_file():
                log(f"finishing the interrupted adoption of {src} as {gen.name}")
                if store.active_or_none() is None or store.active_or_none().name != gen.name:
                    store.flip(gen.name, None, f"adopt {src} (finishing an interrupted run)")
                swap_in(src, gen.env, log)
                store.index_files(gen)
            else:
                log(f"removing {gen.name}: its adoption never completed")
                remove_tree(gen.path)
                store.forget_removed()
