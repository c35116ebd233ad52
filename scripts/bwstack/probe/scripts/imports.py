"""Import each named module in this interpreter (argv[1]: JSON name -> import statement); print one line
`BWSTACK-LOADED <json>` naming what the imports depended on outside the folders in argv[2] (a JSON list: the env,
the stand-in libcuda's folder), then one line `BWSTACK-IMPORTS <json>` with ok/error per module."""

import json
import os
import sys
import traceback

# bwstack-include: loaded


out = {}
for name, statement in json.loads(sys.argv[1]).items():
    try:
        exec(statement, {})
        out[name] = {"ok": True, "error": ""}
    except BaseException as exc:  # report every module, whatever one of them raises
        out[name] = {"ok": False, "error": "".join(traceback.format_exception_only(type(exc), exc))}
inside = [p for p in json.loads(sys.argv[2]) if isinstance(p, str) and p] if len(sys.argv) > 2 else []
print("BWSTACK-LOADED " + json.dumps(loaded(inside)), flush=True)  # noqa: F821 (included)
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
