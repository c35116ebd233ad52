"""What this interpreter is: its generation (from the bwstack hook), version, prefix, CUDA_HOME, and torch with its
CUDA version (or why torch does not import). One JSON line."""

import json
import os
import sys

out = {
    "generation": os.environ.get("BWSTACK_GENERATION"),
    "python": sys.version.split()[0],
    "prefix": os.path.realpath(sys.prefix),
    "cuda_home": os.environ.get("CUDA_HOME"),
}
try:
    import torch

    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
except ImportError as exc:
    out["torch_error"] = str(exc)
print(json.dumps(out))
