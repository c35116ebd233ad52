"""Import each named module in this interpreter (argv[1]: JSON name -> import statement); print one line
`BWSTACK-IMPORTS <json>` with ok/error per module."""

import json
import os
import sys
import traceback

out = {}
for name, statement in json.loads(sys.argv[1]).items():
    try:
        exec(statement, {})
        out[name] = {"ok": True, "error": ""}
    except BaseException as exc:  # report every module, whatever one of them raises
        out[name] = {"ok": False, "error": "".join(traceback.format_exception_only(type(exc), exc))}
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
