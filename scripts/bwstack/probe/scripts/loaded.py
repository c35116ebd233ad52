"""Never run alone: interp.script_source puts this text where an in-env script says `# bwstack-include: loaded`
(the import checks, SGLang's planner). `loaded(inside)` names what the interpreter depended on outside `inside`,
stamped, so that a verify reuses what the script found only while all of it is as it was
(bwstack.probe.sealed.loaded_changed)."""

import os
import stat
import sys

SKIPPED = ("/proc/", "/sys/", "/memfd:")


def _unescaped(path):
    """A path as /proc/self/maps shows it, with the newline it escapes (as \\012) put back."""
    return path.replace("\\012", "\n")


def _stamp(path, ino=None):
    """[path, dev, ino, size, mtime_ns, ctime_ns] as the file is now; [path, None]: absent (a module's bytecode
    never written, a sys.path entry that does not exist: one appearing later changes what imports find); [path]:
    replaced since it was mapped, or not readable as a path (nothing holds for it); None: a device node."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return [path] if ino is not None else [path, None]
    except OSError:
        return [path]
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        return None  # /dev/zero, a GPU's device node: not code, and their times move on their own
    if ino is not None and st.st_ino != ino:
        return [path]
    return [path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def loaded(inside):
    """What a verify must find unchanged to reuse these imports' outcome, outside `inside`: every file mapped
    into this process (shared libraries), every file a module was imported from (source and bytecode), and the
    folders imports search (sys.path) or found a module in, whose listing changes when a module is added that
    would shadow another. None: this process's maps are unreadable."""
    mapped = {}
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as maps:
            for line in maps:
                fields = line.rstrip("\n").split(None, 5)
                if len(fields) == 6 and fields[5].startswith("/") and fields[4] != "0":
                    mapped[_unescaped(fields[5])] = int(fields[4])
    except (OSError, ValueError):
        return None
    paths = dict(mapped)
    folders = set()
    for module in list(sys.modules.values()):
        try:
            names = vars(module)  # never the module's own __getattr__ (lazy modules import on attribute access)
        except TypeError:
            continue
        for attr in ("__file__", "__cached__"):
            path = names.get(attr)
            if isinstance(path, str) and path.startswith("/"):
                path = os.path.normpath(path)
                paths.setdefault(path, None)
                if attr == "__file__":
                    folders.add(os.path.dirname(path))
    for entry in sys.path:
        if isinstance(entry, str) and entry.startswith("/"):
            folders.add(os.path.normpath(entry))
    for folder in folders:
        paths.setdefault(folder, None)
    out = []
    for path, ino in sorted(paths.items()):
        if path.startswith(SKIPPED) or any(path == p or path.startswith(p + "/") for p in inside):
            continue
        if path.endswith(" (deleted)"):
            out.append([path])
            continue
        stamp = _stamp(path, ino)
        if stamp is not None:
            out.append(stamp)
    return out
