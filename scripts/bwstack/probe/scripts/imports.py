"""Import each named module in this interpreter (argv[1]: JSON name -> import statement); print one line
`BWSTACK-IMPORTS <json>` with ok/error per module."""

import json
import sys
import traceback

out = {}
for name, statement in json.loads(sys.argv[1]).items():
    try:
        exec(statement, {})
        out[name] = {"ok": True, "error": ""}
    except BaseException as exc:  # report every module, whatever one of them raises
        out[name] = {"ok": False, "error": "".join(traceback.format_exception_only(type(exc), exc))}
print("BWSTACK-IMPORTS " + json.dumps(out))
