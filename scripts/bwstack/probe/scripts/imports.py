"""Import each named module in this interpreter (argv[1]: JSON name -> import statement); print one line
`BWSTACK-LOADED <json>` naming the files the imports loaded from outside the folders in argv[2] (a JSON list: the
env, the stand-in libcuda's folder), then one line `BWSTACK-IMPORTS <json>` with ok/error per module."""

import json
import os
import sys
import traceback

SKIPPED = ("/dev/", "/proc/", "/sys/", "/memfd:")


def loaded(inside):
    """Every file mapped into this process (shared libraries) or a module was imported from, outside `inside`,
    each as [path, dev, ino, size, mtime_ns, ctime_ns] read now: a verify reuses the outcome only while each is
    the same file with the same bytes (an in-place `cp` over a system library leaves its folder as it was but
    moves its mtime and ctime). [path] alone: a library replaced while it was mapped (nothing holds). None: this
    process's maps are unreadable."""
    mapped = {}
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as maps:
            for line in maps:
                fields = line.rstrip("\n").split(None, 5)
                if len(fields) == 6 and fields[5].startswith("/") and fields[4] != "0":
                    mapped[fields[5]] = int(fields[4])
    except (OSError, ValueError):
        return None
    paths = dict(mapped)
    for module in list(sys.modules.values()):
        try:
            names = vars(module)  # never the module's own __getattr__ (lazy modules import on attribute access)
        except TypeError:
            continue
        for attr in ("__file__", "__cached__"):
            path = names.get(attr)
            if isinstance(path, str) and path.startswith("/"):
                paths.setdefault(os.path.normpath(path), None)
    out = []
    for path, ino in sorted(paths.items()):
        if path.startswith(SKIPPED) or any(path == p or path.startswith(p + "/") for p in inside):
            continue
        if path.endswith(" (deleted)"):
            out.append([path])
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue  # a module's bytecode never written, a temporary file gone: nothing left to change
        if ino is not None and st.st_ino != ino:
            out.append([path])
            continue
        out.append([path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
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
