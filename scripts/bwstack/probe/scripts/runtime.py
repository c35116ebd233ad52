"""GPU runtime facts from torch in this env: devices, a matmul per device, rmsnorm from sgl-kernel and FlashInfer."""

import json
import sys

out = {}
try:
    import torch
except Exception as exc:
    print(json.dumps({"error": f"import torch: {exc}"}))
    sys.exit(0)
out["cuda_available"] = torch.cuda.is_available()
n = torch.cuda.device_count()
out["device_count"] = n
devices = []
for i in range(n):
    capability = "{}.{}".format(*torch.cuda.get_device_capability(i))
    d = {"index": i, "name": torch.cuda.get_device_name(i), "capability": capability}
    try:
        a = torch.randn(512, 512, device=f"cuda:{i}")
        b = torch.randn(512, 512, device=f"cuda:{i}")
        ref = a.double().cpu() @ b.double().cpu()
        got = (a @ b).double().cpu()
        d["matmul_max_rel_err"] = float(((got - ref).abs().max() / ref.abs().max()).item())
        d["matmul_ok"] = d["matmul_max_rel_err"] < 1e-2
    except Exception as exc:
        d["matmul_ok"] = False
        d["matmul_error"] = str(exc)[:400]
    devices.append(d)
out["devices"] = devices


def rms_ref(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


if n:
    x = torch.randn(8, 1024, dtype=torch.bfloat16, device="cuda:0")
    w = torch.randn(1024, dtype=torch.bfloat16, device="cuda:0")
    try:
        import sgl_kernel

        y = sgl_kernel.rmsnorm(x, w, 1e-6)
        err = float((y.float() - rms_ref(x, w, 1e-6).float()).abs().max().item())
        out["sgl_kernel_rmsnorm"] = {"ok": err < 0.1, "max_abs_err": err}
    except Exception as exc:
        out["sgl_kernel_rmsnorm"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
    try:
        import flashinfer

        y = flashinfer.norm.rmsnorm(x, w, 1e-6)
        err = float((y.float() - rms_ref(x, w, 1e-6).float()).abs().max().item())
        out["flashinfer_rmsnorm"] = {"ok": err < 0.1, "max_abs_err": err}
    except Exception as exc:
        out["flashinfer_rmsnorm"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
print(json.dumps(out))
