"""Written by bwstack into each generation's site-packages as _bwstack_generation.py (do not edit: it is part
of the generation's manifest; the first line names the generation).

Pins this process to the generation it started in (so a switch never changes the code a running server
imports later, nor the interpreter its workers start with), and points CUDA_HOME at this generation's own
toolkit unless the user chose another one: FlashInfer's JIT compiles with $CUDA_HOME/bin/nvcc. Stops
Python from writing bytecode into the sealed generation (root ignores read-only bits): the bytecode it
needs was compiled when it was built and is part of its manifest.

bwstack never imports this module: it reads the file and copies it (store.generations.write_hook).
"""

import os
import sys

sys.dont_write_bytecode = True


def _pin() -> None:
    prefix = sys.prefix
    real = os.path.realpath(prefix)
    if real != prefix:
        sys.path[:] = [real + p[len(prefix):] if p == prefix or p.startswith(prefix + os.sep) else p for p in sys.path]
        if sys.executable.startswith(prefix + os.sep):
            sys.executable = real + sys.executable[len(prefix):]
    generation = os.path.dirname(real)
    cuda = os.path.join(generation, "cuda")
    os.environ["BWSTACK_GENERATION"] = os.path.basename(generation)
    if not os.path.isdir(cuda):
        return
    root = os.path.dirname(os.path.dirname(generation))
    chosen = os.environ.get("CUDA_HOME", "")
    managed = not chosen or chosen.startswith(root + os.sep)
    if not managed and os.path.islink(chosen):
        managed = os.readlink(chosen).startswith(root + os.sep)
    if managed:
        os.environ["CUDA_HOME"] = os.path.realpath(cuda)


try:  # noqa: SIM105 (contextlib would be one more import at every interpreter start)
    _pin()
except Exception:  # never break interpreter start-up
    pass
