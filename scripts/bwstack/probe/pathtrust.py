"""Whether others than root and this user could replace a path: what bwstack checks before it runs a program it
did not install (a toolkit's nvcc) or ships a file it keeps (the controller's cache) to nodes that run it as root.

Standard library only: the probe runs this on target hosts."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def private_group(gid: int) -> bool:
    """The user's own group (user private groups: a umask of 002 makes folders group-writable for it alone): this
    user's primary group, with no other member and no other user whose primary group it is."""
    import grp
    import pwd

    try:
        name = pwd.getpwuid(os.geteuid()).pw_name
        if gid != os.getegid() or not set(grp.getgrgid(gid).gr_mem) <= {name}:
            return False
        return not any(user.pw_gid == gid and user.pw_name != name for user in pwd.getpwall())
    except KeyError:
        return False


def has_acl(path: str | os.PathLike[str] | int) -> bool:
    """An access ACL grants others what the mode bits do not show (the group bits are then its mask). `path`: a
    path (a link there is not followed) or an open descriptor."""
    try:
        if isinstance(path, int):
            return "system.posix_acl_access" in os.listxattr(path)
        return "system.posix_acl_access" in os.listxattr(path, follow_symlinks=False)
    except OSError:  # a filesystem without extended attributes has no ACLs
        return False


def lookup(path: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """The folders a lookup of `path` passes through, links followed hop by hop as the kernel follows them, and
    each link met with its owner. (Checking only the folders above the path and above its realpath misses a
    link in the middle: a -> b/c -> d, where b is the attacker's.)"""
    folders: list[str] = []
    links: list[tuple[str, int]] = []
    current, parts = "/", list(Path(os.path.abspath(path)).parts[1:])
    while parts:
        name = parts.pop(0)
        folders.append(current)
        candidate = os.path.join(current, name)
        st = os.lstat(candidate)
        if not stat.S_ISLNK(st.st_mode):
            current = candidate
            continue
        links.append((candidate, st.st_uid))
        if len(links) > 40:
            raise OSError(errno.ELOOP, "too many links", str(path))
        target = Path(os.readlink(candidate))
        if target.is_absolute():
            current, parts = "/", [*target.parts[1:], *parts]
        else:
            parts = [*target.parts, *parts]
    return folders, links


def _writable_by_others(path: str | os.PathLike[str], st: os.stat_result) -> str | None:
    if st.st_mode & 0o002:
        return "writable by everyone"
    if st.st_mode & 0o020 and not private_group(st.st_gid):
        return f"writable by group {st.st_gid}"
    if has_acl(path):
        return "given to others by an access ACL"
    return None


def _closed(path: str | os.PathLike[str], st: os.stat_result, owners: tuple[int, ...] | None = None) -> str | None:
    """Why the file or folder at `path` (its stat `st`) is not closed to others: another owner than `owners`
    (root or this user by default), or writable by others."""
    if st.st_uid not in (owners if owners is not None else (0, os.geteuid())):
        return f"{path} belongs to uid {st.st_uid}"
    why = _writable_by_others(path, st)
    return f"{path} is {why}" if why else None


def open_to_others(directory: Path) -> str | None:
    """Why a folder that a lookup of `directory` passes through lets others replace what is below it: another
    owner than root or this user, or writable by others without the sticky bit; or a link on the way that
    another user owns. None when nobody else can."""
    folders, links = lookup(directory)
    for link, uid in links:
        if uid not in (0, os.geteuid()):
            return f"the link {link} belongs to uid {uid}"
    for folder in dict.fromkeys(folders):
        st = os.stat(folder)
        if st.st_uid not in (0, os.geteuid()):
            return f"{folder} belongs to uid {st.st_uid}"
        if st.st_mode & stat.S_ISVTX:
            continue
        why = _writable_by_others(folder, st)
        if why:
            return f"{folder} is {why}"
    return None


def own_folder_open_to_others(folder: Path) -> str | None:
    """Why `folder` (existing) is not this user's alone: the folders above it as open_to_others, and the folder
    itself this user's, not writable by others (sticky or not)."""
    why = open_to_others(folder)
    return why or _closed(folder, os.stat(folder), owners=(os.geteuid(),))


def folder_open_to_others(folder: Path) -> str | None:
    """Why others could replace what is put into `folder` (an existing folder): the folders above it, as
    open_to_others, and the folder itself (sticky, as /tmp is, is closed enough: nobody renames another's entry)."""
    why = open_to_others(folder)
    if why:
        return why
    st = os.stat(folder)
    if st.st_mode & stat.S_ISVTX and st.st_uid in (0, os.geteuid()):
        return None
    return _closed(folder, st)


def program_open_to_others(program: Path) -> str | None:
    """Why others than root and this user could have put their own code at `program` (its folders, as
    open_to_others, and the file itself: its owner and mode), or None. An unreadable path is a reason too."""
    try:
        why = open_to_others(Path(program))
        if why:
            return why
        st = os.stat(program)
    except OSError as exc:
        return f"{program} cannot be checked ({exc.strerror or exc})"
    if st.st_uid not in (0, os.geteuid()):
        return f"{program} belongs to uid {st.st_uid}"
    why = _writable_by_others(os.path.realpath(program), st)  # the ACL is the target's: a link has none
    return f"{program} is {why}" if why else None


def _entry_open_to_others(path: str) -> str | None:
    """One path inside a toolkit: itself (a link: its owner, then what it leads to) closed to others."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid not in (0, os.geteuid()):
            return f"the link {path} belongs to uid {st.st_uid}"
        target = os.path.realpath(path)
        if not os.path.exists(target):
            return None  # leads nowhere: nothing runs from it
        return program_open_to_others(Path(target))
    return _closed(path, st)


TOOLKIT_RUNS_FROM = ("bin", "nvvm")  # nvcc starts cicc, ptxas, fatbinary, nvlink... from these, and reads nvcc.profile


def toolkit_open_to_others(home: Path, limit: int = 50_000) -> str | None:
    """Why others could change what a toolkit's nvcc runs as root, or None: the folders above the toolkit and
    the toolkit folder itself, and every folder, program and link under bin/ and nvvm/ (nvcc is a driver: it
    runs cicc and ptxas and reads nvcc.profile, so checking nvcc alone is not enough). More than `limit` paths
    there is a reason too."""
    try:
        why = open_to_others(Path(home)) or _entry_open_to_others(str(home))
        if why:
            return why
        seen = 0
        for sub in TOOLKIT_RUNS_FROM:
            top = os.path.join(home, sub)
            if not os.path.lexists(top):
                continue
            why = _entry_open_to_others(top)
            if why:
                return why
            for folder, dirs, files in os.walk(top):  # links to folders are listed, never followed
                for name in (*dirs, *files):
                    seen += 1
                    if seen > limit:
                        return f"{home}: more than {limit} paths under {', '.join(TOOLKIT_RUNS_FROM)} to check"
                    why = _entry_open_to_others(os.path.join(folder, name))
                    if why:
                        return why
    except OSError as exc:
        return f"{home} cannot be checked ({exc.strerror or exc})"
    return None
