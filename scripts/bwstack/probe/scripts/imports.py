"""Import each named module in this interpreter (argv[1]: JSON name -> import statement); print one line
`BWSTACK-LOADED <json>` naming what the imports depended on outside the folders in argv[2] (a JSON list: the env,
the stand-in libcuda's folder), then one line `BWSTACK-IMPORTS <json>` with ok/error per module."""

import json
import os
import stat
import sys
import traceback

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


out = {}
for name, statement in json.loads(sys.argv[1]).items():
    try:
        exec(statement, {})
        out[name] = {"ok": True, "error": ""}
    except BaseException as exc:  # report every module, whatever one of them raises
        out[name] = {"ok": False, "error": "".join(traceback.format_exception_only(type(exc), exc))}
inside = [p for p in json.loads(sys.argv[2]) if isinstance(p, str) and p] if len(sys.argv) > 2 else []
print("BWSTACK-LOADED " + json.dumps(loaded(inside)), flush=True)
print("BWSTACK-IMPORTS " + json.dumps(out), flush=True)
sys.stderr.flush()
# The outcome is written; the interpreter's teardown (torch.library's finalizers unregistering every op the
# imports registered: seconds on 2 cores) is not part of it, and the probe reads the line whatever the exit.
# The daemonic multiprocessing children a normal exit would end are ended here: they hold our stdout open.
if "multiprocessing" in sys.modules:
    for child in sys.modules["multiprocessing"].active_children():
        if child.daemon:
            child.terminate()
os._exit(0)
